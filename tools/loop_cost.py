"""What a call of the decode loop costs beyond its rounds: per program, calls of 0, 1 and 1 + N rounds, each
timed right after a fresh prefill (new state buffers: `generate`'s one call per prompt) and again on the state
that call returned (the same buffers, donated back: the calibration's and the bench's `--shape` calls).

    python tools/loop_cost.py [--dtype bfloat16] [--modes ar,dflash,16] [--auto chain,32] [--rounds 16]

Per program and kind of call (fresh, again): `call_s` the median call of 0 rounds (dispatch, the loop's exit
test), `first_round_s` what a call's first round costs beyond a later one ((1-round call) - (0-round call) -
per round), `per_round_s` ((1 + N)-round call - 1-round call) / N. `--auto chain,32`: the `--budget auto` program
over those candidates, once forced to each of them (the others' cost infinite, as its calibration forces them),
so its rounds are those of the fixed program it is compared with. Prompt: the demo pair's first held-out prompt
(or `--shape`'s random weights); EOS never stops a row here (every call runs the rounds it is asked for).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from auto_projection import load_pair  # noqa: E402


def measure(programs: dict, repeats: int, rounds: int) -> dict:
    """Per program (label -> (GenerationPrograms, prepare)), median seconds of calls of 0, 1 and 1 + `rounds`
    rounds, fresh (right after a prefill) and again (on the state that call returned); `prepare(state)` runs on
    every prefilled state before its first call. The programs take turns within each repeat, so that what drifts
    (a GPU's clock) weighs on all of them alike."""
    import jax

    from ddtree_jax.parallel import to_host

    sizes = (0, 1, 1 + rounds)
    kinds = ("fresh", "again")
    times = {label: {kind: {n: [] for n in sizes} for kind in kinds} for label in programs}
    ran = {label: {kind: {n: [] for n in sizes} for kind in kinds} for label in programs}
    for repeat in range(repeats + 1):  # the first pass warms up, untimed
        for label, (program, prepare) in programs.items():
            for n in sizes:
                state = jax.block_until_ready(prepare(program.prefill()))
                for kind in kinds:
                    first = int(to_host(state.step))
                    start = time.perf_counter()
                    state = jax.block_until_ready(program.loop(state, n))
                    seconds = time.perf_counter() - start
                    if repeat:
                        times[label][kind][n].append(seconds)
                        ran[label][kind][n].append(int(to_host(state.step)) - first)
    out = {}
    for label in programs:
        out[label] = {}
        for kind in kinds:
            t = {n: statistics.median(v) for n, v in times[label][kind].items()}
            r = {n: statistics.median(v) for n, v in ran[label][kind].items()}
            per_round = (t[sizes[2]] - t[1]) / max(r[sizes[2]] - r[1], 1)
            out[label][kind] = {"call_s": t[0], "first_round_s": t[1] - t[0] - per_round, "per_round_s": per_round,
                                "seconds": {str(n): t[n] for n in sizes}, "rounds": {str(n): r[n] for n in sizes}}
    return out


TRACE_ROUNDS = 2


def trace_calls(programs: dict, trace_dir: Path) -> None:
    """Per program, one call of 1 + TRACE_ROUNDS rounds traced (after an untimed call of as many, on the state it
    returned: the "again" kind) under trace_dir/PROGRAM (the label with [],@ spelt _), its rounds in rounds.json."""
    import jax

    from ddtree_jax.measure.timing import record_trace

    for label, (program, prepare) in programs.items():
        row = trace_dir / re.sub(r"[^A-Za-z0-9.-]+", "_", label).strip("_")
        row.mkdir(parents=True, exist_ok=True)
        state = jax.block_until_ready(program.loop(prepare(program.prefill()), 1 + TRACE_ROUNDS))
        record_trace(row, lambda s=state: program.loop(s, 1 + TRACE_ROUNDS))
        (row / "rounds.json").write_text(json.dumps({"rounds": 1 + TRACE_ROUNDS}) + "\n")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--modes", default="ar,dflash,16", help="ar, dflash, and DDTree budgets (comma list)")
    p.add_argument("--auto", default="chain,32", help="--budget auto candidates ('' for none)")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--shape", default=None, help="random weights of this bench shape instead of the demo pair")
    p.add_argument("--rounds", type=int, default=16, help="N: the long call runs 1 + N rounds")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--trace", type=Path, default=None, metavar="DIR",
                   help="also trace one call of 1 + TRACE_ROUNDS rounds per program, on the state a call returned "
                        "(DIR/PROGRAM, for tools/trace_summary.py --gaps)")
    args = p.parse_args(argv)
    try:
        from ddtree_jax.budget import parse_candidates

        modes = [m.strip() for m in args.modes.split(",") if m.strip()]
        budgets = [int(m) for m in modes if m not in ("ar", "dflash")]
        if any(b < 1 for b in budgets):
            raise ValueError("a DDTree budget is an integer >= 1")
        candidates = parse_candidates(args.auto) if args.auto else ()
    except ValueError as e:
        print(f"error: --modes {args.modes!r} / --auto {args.auto!r}: {e}", file=sys.stderr)
        return 2
    if args.rounds < 1 or args.repeats < 1:
        print("error: --rounds and --repeats: expected integers >= 1", file=sys.stderr)
        return 2

    import jax
    import jax.numpy as jnp

    from ddtree_jax.cli import atomic_path, recorded_command
    from ddtree_jax.engine import FORCED_OUT, DecodeOptions, Mode, compile_generation, with_round_costs

    dtype = {"bfloat16": jnp.bfloat16, "float32": jnp.float32}[args.dtype]
    target, drafter, prompts, source = load_pair(args.shape, 1, dtype)
    prompt = prompts[0]
    max_new = (args.rounds + 1) * 2 * 17 + 64  # room for two calls of 1 + N rounds of up to 17 tokens
    plan = [(m, DecodeOptions(mode=Mode.AR if m == "ar" else Mode.DFLASH if m == "dflash" else Mode.DDTREE,
                              max_new_tokens=max_new, budget=64 if m in ("ar", "dflash") else int(m)), None)
            for m in modes]
    auto = (DecodeOptions(mode=Mode.DDTREE, max_new_tokens=max_new, budgets=candidates, auto_scope="round")
            if candidates else None)
    for i, b in enumerate(candidates):
        plan.append((f"auto[{','.join(map(str, candidates))}]@{'chain' if b == 0 else b}", auto, i))

    programs = {}
    for label, options, forced in plan:
        prepare = lambda s: s  # noqa: E731
        if forced is not None:
            costs = [FORCED_OUT] * len(candidates)
            costs[forced] = 1.0
            prepare = lambda s, c=costs: with_round_costs(s, c)  # noqa: E731
        programs[label] = (compile_generation(target, [prompt], options, drafter=drafter), prepare)
    rows = []
    if args.trace:
        trace_calls(programs, args.trace)
    for label, result in measure(programs, args.repeats, args.rounds).items():
        rows.append({"program": label, **result})
        line = "  ".join(f"{kind}: call {r['call_s'] * 1e3:.3f} first {r['first_round_s'] * 1e3:+.3f} "
                         f"round {r['per_round_s'] * 1e3:.4f} ms" for kind, r in result.items())
        print(f"{label:24s} {line}", flush=True)
    report = {"source": source, "device": jax.devices()[0].device_kind, "jax": jax.__version__, "dtype": args.dtype,
              "xla_flags": os.environ.get("XLA_FLAGS", ""), "rounds": args.rounds, "repeats": args.repeats,
              "command": recorded_command("python tools/loop_cost.py", sys.argv[1:] if argv is None else argv),
              "rows": rows}
    if args.out:
        with atomic_path(args.out) as tmp:
            tmp.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
