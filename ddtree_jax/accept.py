"""Tree acceptance: the target's decoding rule at every node, then a vectorised walk.

A node is accepted iff every node on its root path carries the token that its parent's decoded token
asks for. Siblings carry distinct tokens, so the accepted nodes form one chain from the root; its
deepest node's decoded token is the next bonus. No loop over nodes and no host round trip. The walk is
`pallas_kernels.tree_accept.tree_walk` (pointer doubling), the one the fused greedy kernel runs too, and
the result type is its `Accepted`.

Example (greedy), tree tokens [x a b c] with parents [0 0 1 0], decoded post = [a b q c']:
ok = [1, a == post[0], b == post[1], c == post[0]] = [1 1 1 0]; accepted = [1 1 1 0];
the deepest accepted node is 2 (depth 2), path = [0 1 2], count 3, bonus = post[2] = q.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ddtree_jax.tree import DraftTree
from pallas_kernels.tree_accept import Accepted, tree_walk

__all__ = ["Accepted", "accept_tree", "chain_tree"]


def accept_tree(tree: DraftTree, decoded: jax.Array, path_len: int) -> Accepted:
    """tree: DraftTree with T nodes; decoded [b, T] int32 the target's token at every node; path_len P
    (static) bounds the path (max depth + 1). Returns Accepted: path [b, P] (root first, padded with the
    deepest node), count [b] (root included), bonus [b], tokens [b, P] (what the round emits)."""
    return tree_walk(decoded.astype(jnp.int32), tree.tokens, tree.parents, tree.depths, tree.valid,
                     path_len=path_len)


def chain_tree(tokens: jax.Array) -> DraftTree:
    """The chain [root, d1, ..., d_{P-1}] as a DraftTree (DFlash verifies a chain)."""
    b, p = tokens.shape
    idx = jnp.arange(p, dtype=jnp.int32)
    parents = jnp.broadcast_to(jnp.maximum(idx - 1, 0), (b, p))
    ancestor = jnp.broadcast_to(idx[None, :] <= idx[:, None], (b, p, p))
    return DraftTree(tokens=tokens.astype(jnp.int32), parents=parents, depths=jnp.broadcast_to(idx, (b, p)),
                     valid=jnp.ones((b, p), bool), ancestor=ancestor, scores=jnp.zeros((b, p), jnp.float32))
