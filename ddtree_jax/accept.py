"""Tree acceptance: the target's decoding rule at every node, then a vectorised walk.

A node is accepted iff every node on its root path carries the token that its parent's decoded token
asks for. Siblings carry distinct tokens, so the accepted nodes form one chain from the root; its
deepest node's decoded token is the next bonus. No loop over nodes and no host round trip.

Example (greedy), tree tokens [x a b c] with parents [0 0 1 0], decoded post = [a b q c']:
ok = [1, a == post[0], b == post[1], c == post[0]] = [1 1 1 0]; accepted = [1 1 1 0];
the deepest accepted node is 2 (depth 2), path = [0 1 2], count 3, bonus = post[2] = q.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from ddtree_jax.tree import DraftTree


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Acceptance:
    """Per row (device):
      path:   [b, P] int32 node indices of the accepted chain by depth (root first), padded with the
              deepest node's index beyond `count` (P = max depth + 1, the block size).
      count:  [b] int32 accepted nodes, root included (1..P).
      bonus:  [b] int32 the target's decoded token at the deepest accepted node.
      tokens: [b, P] int32 the tokens this round emits: decoded tokens along the path (the accepted
              drafts, then the bonus at index count - 1); valid up to count.
    """

    path: jax.Array
    count: jax.Array
    bonus: jax.Array
    tokens: jax.Array


def accept_tree(tree: DraftTree, decoded: jax.Array, path_len: int) -> Acceptance:
    """tree: DraftTree with T nodes; decoded [b, T] int32 the target's token at every node; path_len P
    (static) bounds the path (max depth + 1)."""
    parent_token = jnp.take_along_axis(decoded, tree.parents, axis=1)
    ok = (tree.tokens == parent_token) & tree.valid
    ok = ok.at[:, 0].set(True)
    # Accepted iff no node on the root path (itself included) failed.
    accepted = ~jnp.any(tree.ancestor & ~ok[:, None, :], axis=-1)
    deepest = jnp.argmax(jnp.where(accepted, tree.depths, -1), axis=1)
    count = jnp.take_along_axis(tree.depths, deepest[:, None], axis=1)[:, 0] + 1
    on_path = jnp.take_along_axis(tree.ancestor, deepest[:, None, None], axis=1)[:, 0]  # [b, T]
    b, t = tree.tokens.shape
    # Scatter each on-path node to its depth; other nodes go to slot P (dropped).
    slot = jnp.where(on_path, tree.depths, path_len)
    path = jnp.broadcast_to(deepest[:, None], (b, path_len)).astype(jnp.int32)
    path = path.at[jnp.arange(b)[:, None], slot].set(jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t)),
                                                     mode="drop")
    tokens = jnp.take_along_axis(decoded, path, axis=1)
    bonus = jnp.take_along_axis(decoded, deepest[:, None], axis=1)[:, 0]
    return Acceptance(path=path, count=count.astype(jnp.int32), bonus=bonus, tokens=tokens)


def chain_tree(tokens: jax.Array) -> DraftTree:
    """The chain [root, d1, ..., d_{P-1}] as a DraftTree (DFlash verifies a chain)."""
    b, p = tokens.shape
    idx = jnp.arange(p, dtype=jnp.int32)
    parents = jnp.broadcast_to(jnp.maximum(idx - 1, 0), (b, p))
    ancestor = jnp.broadcast_to(idx[None, :] <= idx[:, None], (b, p, p))
    return DraftTree(tokens=tokens.astype(jnp.int32), parents=parents, depths=jnp.broadcast_to(idx, (b, p)),
                     valid=jnp.ones((b, p), bool), ancestor=ancestor, scores=jnp.zeros((b, p), jnp.float32))
