"""How many candidates each depth of the tree build keeps under each prune rule, on the probe's logits (NumPy).

    python tools/prune_counts.py [--vocab 151936] [--budgets 64,128,512] [--depths 15] [--peak 0,20]

For tools/topk_probe.py's drafter logits (2 x normal, key V; `--peak` added to one token per depth) and each
budget B: the candidates (beam entry i, token rank j; (i + 1)(j + 1) <= B) of every depth, and how many of them the
tree-build kernel counts places among: all (`prune=0`), those at or above the worst of the B children (i, 0)
(`prune=1` without `running_bound`), those of them above the running top B's last entry (`prune=1`, the default),
those at or above the B-th best candidate itself (what `prune=2` keeps where the bounds keep more than 2 B); up to
the depth after which no deeper prefix can enter the running top B (the kernel's early stop). The counting tiles'
work grows with the square of the kept count. Prints a table; writes nothing.
"""

from __future__ import annotations

import argparse
import sys


def kept_per_depth(log_probs, budget: int):
    """log_probs [L, V] one row's per-depth log-probs -> (rows of (depth, candidates, kept by the bound of
    prune 1, kept by it and the running list's last entry, kept at or above the B-th best score) for the depths the
    kernel runs, 2.., the depth after which the build stops early or None). prune 2 keeps the last where the two
    bounds keep more than 2 B, else those. Beams here are the depths' B best (the kernel's keep only the entries
    above the running list's last, which changes no count: the rest have no kept descendant)."""
    import numpy as np

    from ddtree_jax.tree import candidate_pairs

    top = -np.sort(-np.asarray(log_probs, np.float32), axis=-1)[:, :budget]  # [L, K] best first
    k = top.shape[1]
    i, j = candidate_pairs(budget, k)
    beam = np.full(budget, -np.inf, np.float32)
    beam[:k] = top[0]
    running = beam.copy()  # the running top B, best first
    rows, stop = [], None
    for d in range(1, top.shape[0]):
        score = beam[i] + top[d, j]  # float32, as the kernel sums
        best = np.sort(score)[::-1][budget - 1]
        bound = score >= beam[budget - 1] + top[d, 0]
        rows.append((d + 1, len(score), int(np.sum(bound)), int(np.sum(bound & (score > running[budget - 1]))),
                     int(np.sum(score >= best))))
        beam = np.sort(score)[::-1][:budget]
        running = np.sort(np.concatenate([running, beam]))[::-1][:budget]
        if stop is None and not beam[0] > running[budget - 1]:
            stop = d + 1
    return rows, stop


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--budgets", default="64,128,512")
    p.add_argument("--depths", type=int, default=15)
    p.add_argument("--peak", default="0,20", help="comma list: added to one token's logit per depth")
    args = p.parse_args(argv)
    import jax
    import jax.numpy as jnp

    print("| peak | B | depth | candidates | kept by the bound of prune 1 | and above the running list's last "
          "(the default) | at or above the B-th best |")
    print("|---|---|---|---|---|---|---|")
    for peak in (float(x) for x in args.peak.split(",")):
        logits = 2.0 * jax.random.normal(jax.random.key(args.vocab), (args.depths, args.vocab), jnp.float32)
        logits = logits.at[jnp.arange(args.depths), (7 * jnp.arange(args.depths)) % args.vocab].add(peak)
        log_probs = jax.nn.log_softmax(logits, axis=-1)
        for budget in (int(b) for b in args.budgets.split(",")):
            rows, stop = kept_per_depth(log_probs, budget)
            for depth, candidates, bound, running, exact in rows[:(stop or args.depths) - 1]:  # the kernel's depths
                print(f"| {peak:g} | {budget} | {depth} | {candidates} | {bound} | {running} | {exact} |")
            print(f"| {peak:g} | {budget} | stops after depth {stop if stop else args.depths} | | | | |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
