"""What choosing the budget once per `generate` call, among the fixed programs, would reach (issue 22).

    python tools/per_call_choice.py BENCH_JSON [--candidates chain,15,31] [--rule once|lcb] [--orders 200]

Reads a bench JSON of the demo pair (or any checkpoint run) whose rows hold `decode_s_by_prompt` (the seconds of
each prompt's own `generate` call) for DFlash (the chain) and fixed DDTree budgets, and replays the prompts, in
`--orders` random orders, with a chooser that runs one fixed program per prompt and sees only the seconds of the
prompts it ran: `once` tries each candidate once, then takes the one with the fewest mean seconds per prompt;
`lcb` takes the lowest mean less a confidence term (mean x 0.15 x sqrt(ln n / runs)); `engine` is `--budget auto`
per call's own decision (`budget.decide_call`: the candidates with too few calls calibrated on the prompt, their
seconds left out as the engine leaves them out; each prompt counted as one token: the bench's prompts all
generate `--max-new-tokens`); with `--prior
EARLIER_BENCH_JSON`, also the candidate that was fastest in that earlier run, for every prompt (what a choice
kept on disk from an earlier run would give). Greedy decoding emits the
same tokens in every mode, so a prompt's seconds compare the programs directly, and a fixed program's seconds do
not depend on which programs ran before (the bench warms each up first). Prints, and with `--out` writes as JSON,
each fixed row's total against the best fixed one, the bench's auto rows' if the JSON has them (per round: the
device-side switch; per call: `--auto-scope call`, what this replays, run for real), and the
chooser's mean and 5th percentile over the orders: the ceiling of a per-call choice that pays nothing per round
(no switch in the loop), and what learning from a run's own calls costs where the candidates are a few percent
apart and prompts vary more than that.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from ddtree_jax.budget import CallRecord, decide_call

RULES = ("once", "lcb", "engine")


def fixed_seconds(bench: dict) -> dict[str, np.ndarray]:
    """{'chain' or str(budget): seconds per prompt [P]} of the bench's DFlash and fixed DDTree rows."""
    rows = {}
    for r in bench["rows"]:
        if "decode_s_by_prompt" not in r:
            continue
        if r["mode"] == "dflash":
            rows["chain"] = np.asarray(r["decode_s_by_prompt"], np.float64)
        elif r["mode"] == "ddtree" and r["budget"] != "auto":
            rows[str(r["budget"])] = np.asarray(r["decode_s_by_prompt"], np.float64)
    return rows


def replay(seconds: np.ndarray, order: np.ndarray, rule: str) -> float:
    """Total seconds of one chooser over the prompts in `order`; seconds [C, P] per candidate and prompt."""
    if rule == "engine":  # `generate --budget auto`'s own decision, a prompt counted as one token
        record, total = CallRecord.empty(len(seconds)), 0.0
        for prompt in order:  # the calibration runs' seconds are left out, as the engine leaves them out
            record, pick, _ = decide_call(record, lambda i, calibrating: (1, seconds[i, prompt]))
            total += seconds[pick, prompt]
        return total
    runs = np.zeros(len(seconds))
    sums = np.zeros(len(seconds))
    total = 0.0
    for n, prompt in enumerate(order):
        if runs.min() == 0:
            pick = int(np.argmin(runs))  # each candidate once, in order
        else:
            mean = sums / runs
            bonus = 0.15 * mean * np.sqrt(np.log(n + 1) / runs) if rule == "lcb" else 0.0
            pick = int(np.argmin(mean - bonus))
        spent = seconds[pick, prompt]
        total += spent
        sums[pick] += spent
        runs[pick] += 1
    return total


def evaluate(bench: dict, candidates: list[str] | None, rule: str, orders: int, seed: int = 0,
             prior: dict | None = None) -> dict:
    rows = fixed_seconds(bench)
    names = list(rows) if candidates is None else candidates
    missing = [c for c in names if c not in rows]
    if missing or len(names) < 2:
        raise ValueError(f"candidates {','.join(names)}: the bench has fixed rows for {','.join(rows) or 'none'} "
                         "(at least two needed)")
    seconds = np.stack([rows[c] for c in names])
    best = min(float(s.sum()) for s in rows.values())
    rng = np.random.default_rng(seed)
    ratios = np.array([best / replay(seconds, rng.permutation(seconds.shape[1]), rule) for _ in range(orders)])
    auto = {r.get("auto_scope", "round"): best / r["decode_s"] for r in bench["rows"] if r.get("budget") == "auto"}
    result = {"prompts": int(seconds.shape[1]), "rule": rule, "candidates": names, "orders": orders,
              "fixed_x_best": {c: best / float(s.sum()) for c, s in rows.items()},
              "device_auto_x_best": auto.get("round"), "bench_per_call_x_best": auto.get("call"),
              "per_call_x_best_mean": float(ratios.mean()), "per_call_x_best_p5": float(np.percentile(ratios, 5))}
    if prior is not None:
        earlier = fixed_seconds(prior)
        if any(c not in earlier for c in names):
            raise ValueError(f"the prior has fixed rows for {','.join(earlier)}, not every candidate")
        pick = min(names, key=lambda c: float(earlier[c].sum()))
        result.update(prior_pick=pick, prior_x_best=best / float(rows[pick].sum()))
    return result


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python tools/per_call_choice.py", description=__doc__.split("\n")[0])
    p.add_argument("bench", type=Path, help="a bench JSON with decode_s_by_prompt rows")
    p.add_argument("--candidates", default=None, help="comma list of 'chain' and budgets (default: every fixed row)")
    p.add_argument("--rule", default="once", choices=RULES)
    p.add_argument("--orders", type=int, default=200, help="random prompt orders replayed")
    p.add_argument("--prior", type=Path, default=None, help="an earlier bench JSON: its fastest candidate, kept")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    try:
        bench = json.loads(args.bench.read_text())
        prior = json.loads(args.prior.read_text()) if args.prior else None
        result = evaluate(bench, args.candidates.split(",") if args.candidates else None, args.rule, args.orders,
                          prior=prior)
    except (OSError, ValueError, KeyError) as e:
        print(f"error: {args.bench}: {e}", file=sys.stderr)
        return 2
    for name, ratio in result["fixed_x_best"].items():
        print(f"fixed {name:>6}: {ratio:.3f} x the best fixed")
    if result["device_auto_x_best"] is not None:
        print(f"auto per round (the bench's row): {result['device_auto_x_best']:.3f}")
    if result["bench_per_call_x_best"] is not None:
        print(f"auto per call (the bench's row): {result['bench_per_call_x_best']:.3f}")
    print(f"per call ({args.rule}, over {','.join(result['candidates'])}, {result['prompts']} prompts): "
          f"{result['per_call_x_best_mean']:.3f} mean, {result['per_call_x_best_p5']:.3f} at the 5th percentile")
    if "prior_pick" in result:
        print(f"the prior's fastest ({result['prior_pick']}) kept: {result['prior_x_best']:.3f}")
    if args.out:
        from ddtree_jax.cli import atomic_path, recorded_command

        result["command"] = recorded_command("python tools/per_call_choice.py", sys.argv[1:] if argv is None else argv)
        with atomic_path(args.out) as tmp:
            tmp.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
