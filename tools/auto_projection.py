"""`--budget auto`'s choices against the fixed budgets, under given round costs (issue 22).

    PYTHONPATH=. python tools/auto_projection.py --costs chain=0.27255e-3,16=0.3031e-3 [--num-prompts 12]
    PYTHONPATH=. python tools/auto_projection.py --shape tiny --costs chain=1e-3,4=1.2e-3   # random weights

Generates with the chain (DFlash), each fixed tree budget and `--budget auto` over those candidates, on this
machine in float32, with auto deciding by `--costs` (seconds per round of each candidate, e.g. as calibrated on
a GPU: the `round_costs_s` of a bench JSON) and `--change-cost` (seconds a round costs on top when it verifies
another candidate than the round before: the JSON's `change_cost_s`). Every round of every mode is then charged
its candidate's cost (and auto's changes theirs), so
the projected device seconds compare auto's choices with the fixed budgets' under one cost table, leaving out
what auto's own machinery adds per round on that device (which only a run there shows). The `auto` row is the
per-round choice (`--auto-scope round`); `auto per call` (the default scope) runs one fixed program per call, so
its row is the fixed rows' own calls, prompt by prompt as `budget.decide_call` picks them from an empty record
(exact: it adds nothing to a fixed program; its calibration runs' projected seconds are `calibration_s`).
Greedy, so every mode emits the same tokens; acceptance is this machine's float32 (a GPU's bf16 may flip
near-ties).
Writes the result as JSON (`--out`) and prints a table. The demo pair and its held-out prompts by default.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ddtree_jax.budget import CallRecord, decide_call


def parse_costs(text: str) -> dict[int, float]:
    """'chain=2.7e-4,16=3.0e-4' -> {0: 2.7e-4, 16: 3.0e-4} (0 the chain)."""
    costs = {}
    for item in text.split(","):
        name, _, value = item.partition("=")
        costs[0 if name == "chain" else int(name)] = float(value)
    if 0 not in costs or len(costs) < 2 or any(c <= 0 for c in costs.values()):
        raise ValueError("expected the chain and at least one tree budget, seconds > 0")
    return dict(sorted(costs.items()))


def load_pair(shape: str | None, num_prompts: int, dtype=None):
    """(target, drafter, prompts, source) in `dtype` (default float32): random weights of a bench shape (up to 4
    synthetic prompts), or the demo pair and its first `num_prompts` held-out prompts (shape None)."""
    import jax.numpy as jnp

    dtype = dtype or jnp.float32
    if shape:
        from ddtree_jax.measure.workload import random_pair
        from ddtree_jax.parallel import Parallel

        target, drafter = random_pair(shape, Parallel(), dtype=dtype)
        vocab = target.config.vocab_size - 1
        prompts = [[(7 * i + 3 + 13 * r) % vocab for i in range(40 - 3 * r)] for r in range(min(num_prompts, 4))]
        return target, drafter, prompts, f"random {shape} weights"
    from ddtree_jax.bench import read_prompts
    from ddtree_jax.checkpoint import load_drafter, load_target
    from ddtree_jax.demo_pair import demo_drafter, demo_prompts, demo_target

    target = load_target(demo_target(), dtype)
    drafter = load_drafter(demo_drafter(), target.config, dtype)
    prompts = read_prompts(demo_prompts(), demo_target(), target.config.vocab_size)[:num_prompts]
    return target, drafter, prompts, "the demo pair"


def pair_parser(description: str, num_prompts: int, max_new_tokens: int) -> argparse.ArgumentParser:
    """The options this tool and tools/auto_counterfactual.py share: --costs, --shape, --num-prompts,
    --max-new-tokens, --out."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--costs", required=True, help="seconds per round: chain=S,B=S[,B=S...]")
    p.add_argument("--shape", default=None,
                   help="random weights of this bench shape (e.g. tiny) instead of the demo pair")
    p.add_argument("--num-prompts", type=int, default=num_prompts)
    p.add_argument("--max-new-tokens", type=int, default=max_new_tokens)
    p.add_argument("--out", type=Path, default=None)
    return p


def costs_or_error(text: str) -> dict[int, float] | None:
    """`parse_costs(text)`, or None after printing the one error line."""
    try:
        return parse_costs(text)
    except ValueError as exc:
        print(f"error: --costs {text!r}: {exc}", file=sys.stderr)
        return None


def main(argv=None) -> int:
    p = pair_parser(__doc__.split("\n")[0], num_prompts=12, max_new_tokens=128)
    p.add_argument("--change-cost", type=float, default=0.0,
                   help="seconds per change of candidate (a bench JSON's change_cost_s)")
    args = p.parse_args(argv)
    costs = costs_or_error(args.costs)
    if costs is None:
        return 2
    if args.change_cost < 0:
        print(f"error: --change-cost {args.change_cost}: expected seconds >= 0", file=sys.stderr)
        return 2

    from ddtree_jax.cli import atomic_path
    from ddtree_jax.engine import DecodeOptions, Mode, generate

    target, drafter, prompts, source = load_pair(args.shape, args.num_prompts)

    budgets = tuple(costs)
    modes = [("chain", DecodeOptions(mode=Mode.DFLASH, max_new_tokens=args.max_new_tokens), None)]
    modes += [(str(b), DecodeOptions(mode=Mode.DDTREE, max_new_tokens=args.max_new_tokens, budget=b), None)
              for b in budgets if b]
    modes += [("auto", DecodeOptions(mode=Mode.DDTREE, max_new_tokens=args.max_new_tokens, budgets=budgets,
                                     auto_scope="round"), [costs[b] for b in budgets])]
    rows, outputs, fixed_by_prompt = [], {}, {}
    for name, options, round_costs in modes:
        seconds, tokens, rounds, changes, chosen, learned, by_prompt = 0.0, 0, 0, 0, [], None, []
        for prompt in prompts:  # one row per call: auto's choice is per batch; what it learned carries, as in
            # `generate --prompts` and the bench
            result = generate(target, [prompt], options, drafter=drafter, round_costs=round_costs,
                              change_cost=args.change_cost if round_costs else 0.0, auto_learned=learned)
            learned = result.auto_learned
            picks = result.budgets_chosen[0] if round_costs else [0 if name == "chain" else int(name)] * len(
                result.acceptance_lengths[0])
            changed = sum(a != b for a, b in zip(picks, picks[1:]))  # the first round enters with the call
            by_prompt.append({"seconds": sum(costs[b] for b in picks) + changed * args.change_cost,
                              "tokens": len(result.output_ids[0]), "picks": picks})
            seconds += by_prompt[-1]["seconds"]
            changes += changed
            tokens += len(result.output_ids[0])
            rounds += len(picks)
            chosen += picks
            outputs.setdefault(name, []).append(result.output_ids[0])
        rows.append(projected_row(name, by_prompt, budgets, changes))
        print(json.dumps(rows[-1]), flush=True)
        fixed_by_prompt[name] = by_prompt
    # Per call: each prompt runs the fixed program the record picks (its seconds and rounds are that row's), after
    # the calibration runs of the candidates with too few calls (their seconds reported apart, as the engine does).
    record, calls, calibration_s = CallRecord.empty(len(budgets)), [], 0.0
    for p in range(len(prompts)):
        def run(i, calibrating):
            call = fixed_by_prompt["chain" if budgets[i] == 0 else str(budgets[i])][p]
            if not calibrating:
                calls.append(call)
            return call["tokens"], call["seconds"]

        record, _, seconds = decide_call(record, run)
        calibration_s += seconds
    rows.append({**projected_row("auto per call", calls, budgets, 0), "calibration_s": calibration_s})
    print(json.dumps(rows[-1]), flush=True)
    same = all(outputs[name] == outputs["chain"] for name in outputs)
    report = {"source": source, "prompts": len(prompts), "max_new_tokens": args.max_new_tokens,
              "costs_s": {str(b): c for b, c in costs.items()}, "change_cost_s": args.change_cost,
              "outputs_equal": same, "rows": rows}
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        with atomic_path(args.out) as tmp:
            tmp.write_text(json.dumps(report, indent=1))
    best = max((r for r in rows if not r["mode"].startswith("auto")), key=lambda r: r["projected_tokens_per_s"])
    print(f"\n{'mode':>13} {'rounds':>7} {'tau':>6} {'projected tok/s':>16}")
    for r in rows:
        print(f"{r['mode']:>13} {r['rounds']:>7} {r['tau']:6.2f} {r['projected_tokens_per_s']:16.1f}")
    for auto in rows[-2:]:
        print(f"{auto['mode']} / best fixed ({best['mode']}): "
              f"{auto['projected_tokens_per_s'] / best['projected_tokens_per_s']:.4f}")
    print(f"outputs {'equal' if same else 'DIFFERENT'} across modes")
    return 0 if same else 1


def projected_row(name: str, by_prompt: list[dict], budgets: tuple[int, ...], changes: int) -> dict:
    """A row of the report from its calls' projected seconds, tokens and per-round picks."""
    seconds = sum(c["seconds"] for c in by_prompt)
    tokens = sum(c["tokens"] for c in by_prompt)
    picks = [b for c in by_prompt for b in c["picks"]]
    return {"mode": name, "rounds": len(picks), "tokens": tokens, "tau": tokens / len(picks),
            "projected_s": seconds, "projected_tokens_per_s": tokens / seconds,
            "rounds_by_budget": {str(b): picks.count(b) for b in budgets}, "changes": changes,
            "rounds_by_prompt": [len(c["picks"]) for c in by_prompt]}


if __name__ == "__main__":
    sys.exit(main())
