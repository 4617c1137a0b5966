"""What `--budget auto`'s choices could gain: every candidate's round from the same state, round by round (issue 22).

    PYTHONPATH=. python tools/auto_counterfactual.py --costs chain=0.226e-3,16=0.286e-3,32=0.306e-3 \
        --num-prompts 8 --max-new-tokens 512 [--out FILE]
    PYTHONPATH=. python tools/auto_counterfactual.py --shape tiny --costs chain=1e-3,4=1.2e-3   # random weights

Decodes with `--budget auto` over the candidates of `--costs` (seconds per round, e.g. the fixed rows' measured
round costs on a GPU), one prompt per call, in float32 on this machine, greedy. Every round, from the state auto
reached, each candidate's round runs too (`round.auto_candidate_round`), so every round has every candidate's
committed count from the same state; auto's own round then continues. Along that trajectory it reports, under
the cost table, the tokens per second of
- each candidate in every round (a fixed budget on these states),
- auto's choices,
- the rule that knows the drafter's exact reach of every candidate's tree (built every round, a cost this table
  leaves out) and picks the most expected tokens less lambda x cost, lambda the rule's own resulting tokens per
  second (Dinkelbach's rule: per round the best ratio of expected tokens to cost is not the best total ratio),
- the same rule knowing the committed counts themselves (an oracle: the most any per-round choice can reach),
and how well the predicted gain of each tree over the chain (auto's, and the exact reach's) correlates with the
gain the target granted. Greedy, so every candidate emits the same tokens; a change of candidate is not charged.
"""

from __future__ import annotations

import dataclasses
import json
import sys

import numpy as np

from auto_projection import costs_or_error, load_pair, pair_parser


def tokens_per_second(counts: np.ndarray, costs: np.ndarray, picks: np.ndarray) -> float:
    """counts [R, N] committed tokens of each candidate per round, costs [N] seconds, picks [R] candidate index."""
    rounds = np.arange(len(picks))
    return float(counts[rounds, picks].sum() / costs[picks].sum())


def dinkelbach(expected: np.ndarray, counts: np.ndarray, costs: np.ndarray, iterations: int = 50):
    """The per-round rule argmax_c expected[r, c] - lam x costs[c] with lam the tokens per second its own picks
    reach on `counts` (iterated to the fixed point, from lam = 0): returns (tokens per second, picks [R]).
    With expected = counts it is the best any per-round choice reaches on these rounds.

    Example: counts [[1, 3], [4, 4]], costs [1, 2]: the ratio rule picks the tree in round 0 (3/2 > 1/1) and reaches
    7/3; this rule settles on the chain in both rounds, 5/2."""
    lam, picks = 0.0, None
    for _ in range(iterations):
        new = np.argmax(expected - lam * costs[None], axis=1)
        if picks is not None and np.array_equal(new, picks):
            break
        picks = new
        lam = tokens_per_second(counts, costs, picks)
    return lam, picks


def summarize(counts: np.ndarray, picks: np.ndarray, predicted: np.ndarray, exact: np.ndarray,
              costs: np.ndarray, names: list[str]) -> dict:
    """counts [R, N], auto's picks [R], auto's estimate of every candidate's tokens per round [R, N], the
    drafter's expected tokens [R, N] (`expected_tokens`), costs [N] -> the report's figures."""
    gain = counts[:, 1:] - counts[:, :1]

    def corr(a, b):
        return float(np.corrcoef(a, b)[0, 1]) if a.std() > 0 and b.std() > 0 else None

    oracle, oracle_picks = dinkelbach(counts, counts, costs)
    reach_rule, reach_picks = dinkelbach(exact, counts, costs)
    return {
        "rounds": int(len(picks)),
        "fixed": {n: {"tau": float(counts[:, i].mean()), "std": float(counts[:, i].std()),
                      "tokens_per_s": tokens_per_second(counts, costs, np.full(len(picks), i))}
                  for i, n in enumerate(names)},
        "auto": {"tokens_per_s": tokens_per_second(counts, costs, picks),
                 "rounds_by_candidate": dict(zip(names, np.bincount(picks, minlength=len(names)).tolist()))},
        "exact_reach_rule": {"tokens_per_s": reach_rule,
                             "rounds_by_candidate": dict(zip(names, np.bincount(reach_picks,
                                                                                minlength=len(names)).tolist()))},
        "oracle": {"tokens_per_s": oracle,
                   "rounds_by_candidate": dict(zip(names, np.bincount(oracle_picks, minlength=len(names)).tolist()))},
        "gain_over_chain": {n: {"mean": float(gain[:, i].mean()), "std": float(gain[:, i].std()),
                                "auto_estimate_mean": float((predicted[:, i + 1] - predicted[:, 0]).mean()),
                                "auto_estimate_correlation": corr(predicted[:, i + 1] - predicted[:, 0], gain[:, i]),
                                "exact_reach_mean": float((exact[:, i + 1] - exact[:, 0]).mean()),
                                "exact_reach_correlation": corr(exact[:, i + 1] - exact[:, 0], gain[:, i])}
                            for i, n in enumerate(names[1:])},
    }


def expected_tokens(tree, logits, chain: bool):
    """The drafter's expected committed tokens of a tree [b]: 1 + the sum over its nodes below the root of
    exp(score), the probability of the node's root path under the drafter's marginals (siblings exclude each
    other, so this sums the probabilities of reaching each depth); the chain's, from the per-depth top-1
    probabilities of logits [b, L, v]."""
    import jax
    import jax.numpy as jnp

    if chain:
        top1 = jnp.max(logits, axis=-1) - jax.nn.logsumexp(logits, axis=-1)
        return 1.0 + jnp.exp(jnp.cumsum(top1, axis=-1)).sum(-1)
    below_root = tree.valid & (tree.depths > 0)
    return 1.0 + jnp.where(below_root, jnp.exp(tree.scores), 0.0).sum(-1)


def trajectory(target, drafter, prompts, budgets: tuple[int, ...], costs: list[float], max_new_tokens: int):
    """Auto's decode of each prompt (one per call, what it learned carried to the next as the bench does), every
    round's every candidate run from the same state. Returns per round (all prompts in order): counts [R, N],
    auto's picks [R], auto's learned tokens per round of each candidate before the round [R, N], the drafter's
    expected tokens of each candidate's tree [R, N]."""
    import jax
    import jax.numpy as jnp

    from ddtree_jax import round as rounds
    from ddtree_jax.budget import CHAIN, choose
    from ddtree_jax.engine import DecodeOptions, Mode, cache_shape, resolve_options, with_round_costs

    options = resolve_options(DecodeOptions(mode=Mode.DDTREE, max_new_tokens=max_new_tokens, budgets=budgets,
                                            auto_scope="round"), drafter, jnp.float32)

    @jax.jit
    def features(s):
        logits = rounds.draft(drafter, target, s.last_token, s.draft_cache, options)
        learned = s.budget.per_round
        exact = [expected_tokens(rounds.propose(logits, s.last_token, options.candidate(b)), logits, b == CHAIN)
                 for b in budgets]
        return choose(s.budget), learned, jnp.stack(exact, 1)

    run = [jax.jit(lambda s, i=i: rounds.auto_candidate_round(target, drafter, s, i, options))
           for i in range(len(budgets))]
    counts, picks, predicted, exact, learned = [], [], [], [], None
    for prompt in prompts:
        width, capacity = cache_shape(len(prompt), options)
        tokens = np.zeros((1, width), np.int32)
        tokens[0, :len(prompt)] = prompt
        state = rounds.prefill(target, drafter, jnp.asarray(tokens), jnp.asarray([len(prompt)], jnp.int32),
                               jax.random.key(0), capacity=capacity, options=options)
        state = with_round_costs(state, costs)
        if learned is not None:
            state = dataclasses.replace(state, budget=state.budget.with_learned(learned))
        # Every leaf committed to the device, as the rounds' outputs are: a mix of committed and uncommitted
        # arrays is another signature, and `features` and each candidate's round compiled again for it.
        state = jax.device_put(state, jax.devices()[0])
        while not bool(state.done[0]):
            pick, pred, ex = features(state)
            after = [r(state) for r in run]  # each drafts the same logits from the same state
            counts.append([int(a.round_lengths[0, int(a.num_rounds[0]) - 1]) for a in after])
            picks.append(int(pick))
            predicted.append(np.asarray(pred))
            exact.append(np.asarray(ex[0]))
            state = after[int(pick)]
        learned = state.budget.learned()
    return np.array(counts, float), np.array(picks), np.array(predicted), np.array(exact)


def main(argv=None) -> int:
    args = pair_parser(__doc__.split("\n")[0], num_prompts=8, max_new_tokens=512).parse_args(argv)
    costs = costs_or_error(args.costs)
    if costs is None:
        return 2

    from ddtree_jax.cli import atomic_path

    target, drafter, prompts, source = load_pair(args.shape, args.num_prompts)
    budgets = tuple(costs)
    names = ["chain" if b == 0 else str(b) for b in budgets]
    seconds = np.array([costs[b] for b in budgets])
    counts, picks, predicted, exact = trajectory(target, drafter, prompts, budgets, list(seconds),
                                                 args.max_new_tokens)
    report = {"source": source, "prompts": len(prompts), "max_new_tokens": args.max_new_tokens,
              "costs_s": dict(zip(names, seconds.tolist())),
              **summarize(counts, picks, predicted, exact, seconds, names)}
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        with atomic_path(args.out) as tmp:
            tmp.write_text(json.dumps(report, indent=1))
    print(f"{report['rounds']} rounds of {source}, costs {args.costs}")
    for name, row in report["fixed"].items():
        print(f"  every round {name:>5}: tau {row['tau']:.2f} (std {row['std']:.2f}), "
              f"{row['tokens_per_s']:9.0f} tokens/s")
    for key in ("auto", "exact_reach_rule", "oracle"):
        print(f"  {key:>16}: {report[key]['tokens_per_s']:9.0f} tokens/s, rounds {report[key]['rounds_by_candidate']}")
    r2 = lambda x: "-" if x is None else f"{x:.2f}"  # noqa: E731
    for name, g in report["gain_over_chain"].items():
        print(f"  {name}'s gain over the chain: {g['mean']:.2f} tokens, std {g['std']:.2f} (auto estimates "
              f"{g['auto_estimate_mean']:.2f}, "
              f"correlation {r2(g['auto_estimate_correlation'])}; exact reach {g['exact_reach_mean']:.2f}, correlation "
              f"{r2(g['exact_reach_correlation'])})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
