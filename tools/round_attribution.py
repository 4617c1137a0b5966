"""What the draft tree's construction costs in a DDTree round: `tools/loop_cost.py` with one part of the round
swapped for a cheaper stand-in, so the difference in ms per round is that part's cost (a measurement aid; the
swapped programs decode differently and their tokens mean nothing).

    python tools/round_attribution.py --swap build --modes dflash,16,32 --auto "" --rounds 48 --repeats 9

--swap none: loop_cost as it is. fallback: the vocabulary top-k kernel without its lax.cond to the exact fallback
(on a GPU the cond is a conditional node of XLA's command buffer). build: no top-k and no tree build, the tree is
the drafter's argmax chain padded with invalid nodes to B + 1 (one argmax and a few pads), so every other stage
of the round (verify over T = B + 1 nodes, acceptance, commit) runs at its size. Every other argument is
loop_cost's.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

SWAPS = ("none", "fallback", "build")


def chain_padded_tree(log_probs, root_tokens, budget: int, **_):
    """build_tree's stand-in: the argmax chain [root, d1, ..., dL] with B - L invalid nodes after it (each its own
    ancestor only). log_probs [b, L, v], root_tokens [b]; B >= L."""
    import jax.numpy as jnp

    from ddtree_jax.accept import chain_tree
    from ddtree_jax.tree import DraftTree

    drafts = jnp.argmax(log_probs, axis=-1).astype(jnp.int32)
    chain = chain_tree(jnp.concatenate([root_tokens[:, None].astype(jnp.int32), drafts], axis=1))
    pad = budget + 1 - chain.tokens.shape[1]
    if pad < 0:
        raise ValueError(f"B={budget} is shorter than the chain of {chain.tokens.shape[1] - 1} drafts")

    def padded(x, value):
        return jnp.pad(x, ((0, 0), (0, pad)), constant_values=value)

    ancestor = jnp.pad(chain.ancestor, ((0, 0), (0, pad), (0, pad))) | jnp.eye(budget + 1, dtype=bool)[None]
    return DraftTree(tokens=padded(chain.tokens, 0), parents=padded(chain.parents, 0), depths=padded(chain.depths, 0),
                     valid=padded(chain.valid, False), ancestor=ancestor, scores=padded(chain.scores, -jnp.inf))


def top_k_without_fallback(x, k, fallback_chunk=2048, interpret=None, config=None):
    """`tree.kernel_top_k` without the cond to its exact fallback (exact only while no row overflows)."""
    from pallas_kernels import vocab_top_k

    values, indices, _ = vocab_top_k.vocab_top_k(x, k, config=config, interpret=interpret)
    return values, indices


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python tools/round_attribution.py", description=__doc__.split("\n")[0],
                                add_help=False)
    p.add_argument("--swap", default="none")
    args, rest = p.parse_known_args(argv)
    if args.swap not in SWAPS:
        print(f"error: --swap {args.swap!r}: expected one of {', '.join(SWAPS)}", file=sys.stderr)
        return 2
    from ddtree_jax import round as round_
    from ddtree_jax import tree

    import loop_cost

    if args.swap == "fallback":
        tree.kernel_top_k = top_k_without_fallback
    elif args.swap == "build":
        round_.build_tree = chain_padded_tree
    return loop_cost.main(rest)


if __name__ == "__main__":
    sys.exit(main())
