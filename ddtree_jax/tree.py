"""Draft trees: the B most probable prefixes under the drafter's per-position marginals, static shapes.

The paper's Proposition 2: with per-depth log-probabilities `lp[d, token]`, the set of the B
highest-scoring prefixes (score = sum of the log-probs along the prefix) is prefix-closed and is the
optimal draft tree; Lemma 1: only the top-K tokens per depth matter, K = min(B, V). Algorithm 1 finds
it with a heap on the host. Here the same set is built on device with fixed shapes:

1. Per depth d, keep the beam of the B best depth-d prefixes (a depth-d prefix in the global top-B is in
   the top-B of its depth, and its parent is in the top-B of depth d - 1): candidates are beam(d - 1)
   x top-K tokens at depth d, B x K scores, of which `lax.top_k` keeps B.
2. The global top-B over the L x B beam entries.

Ties: order is (score desc, depth asc, rank tuple lexicographic asc), where a prefix's rank tuple lists
the rank of its token among the top-K at each depth. Shallower first keeps the set prefix-closed (a
child never scores above its parent). `lax.top_k` puts the lower index first among equal values, so
each step lays its candidates out in that order: beam entries sorted lexicographically by rank tuple,
then the token rank. The order of the new beam's entries by flat candidate index is then again
lexicographic, which the next depth uses.

Nodes come out in (score desc, depth asc, lex) order, so parents precede children; index 0 is the root
(the bonus token, depth 0). Siblings carry distinct tokens (different ranks at one depth).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DraftTree:
    """A batch of static-size draft trees of T = B + 1 nodes (node 0 = root = bonus token).

    Fields (device):
      tokens:   [b, T] int32 node tokens.
      parents:  [b, T] int32 parent node index; the root is its own parent (0).
      depths:   [b, T] int32, root 0.
      valid:    [b, T] bool; False for padding nodes (only when fewer than B prefixes have finite score).
      ancestor: [b, T, T] bool, ancestor[i, j] = node j is on node i's root path (itself included).
      scores:   [b, T] float32 prefix log-probability (root 0; -inf for padding).
    """

    tokens: jax.Array
    parents: jax.Array
    depths: jax.Array
    valid: jax.Array
    ancestor: jax.Array
    scores: jax.Array


def build_tree(log_probs: jax.Array, root_tokens: jax.Array, budget: int) -> DraftTree:
    """log_probs [b, L, v] float32 per-depth draft log-probabilities (depth d + 1 at index d);
    root_tokens [b] int32; budget B (static). Returns a DraftTree with B + 1 nodes."""
    return jax.vmap(lambda lp, root: _build_one(lp, root, budget))(log_probs, root_tokens)


def _build_one(log_probs: jax.Array, root: jax.Array, budget: int) -> DraftTree:
    depth_limit, vocab = log_probs.shape
    k = min(budget, vocab)
    top_lp, top_tok = jax.lax.top_k(log_probs.astype(jnp.float32), k)  # [L, K] each, rank order

    # Depth 1: the beam is the top-K tokens (slots K..B-1 empty). Entries are in rank order, which is
    # also their lexicographic order.
    neg_inf = jnp.float32(-jnp.inf)
    beam_score = jnp.full((budget,), neg_inf).at[:k].set(top_lp[0])
    beam_rank = jnp.zeros((budget,), jnp.int32).at[:k].set(jnp.arange(k, dtype=jnp.int32))
    beam_lex = jnp.arange(budget, dtype=jnp.int32)  # lexicographic position of each entry in its beam

    def next_depth(carry, lp_d):
        """One depth: the B best children of the beam; lp_d [K] this depth's top-K log-probs."""
        beam_score, beam_lex = carry
        # Lay parents out in lexicographic order so flat index order = (parent lex, token rank) order.
        by_lex = jnp.argsort(beam_lex)  # beam index of the entry at each lexicographic position
        cand = beam_score[by_lex][:, None] + lp_d[None, :]  # [B, K]
        best, flat = jax.lax.top_k(cand.reshape(-1), budget)
        beam_parent = by_lex[flat // k]  # index into the previous depth's beam
        beam_rank = (flat % k).astype(jnp.int32)
        beam_lex = jnp.argsort(jnp.argsort(flat)).astype(jnp.int32)  # rank of each entry's flat index
        return (best, beam_lex), (best, beam_rank, beam_parent, beam_lex)

    # A scan, not a Python loop: the depth step (three sorts and a top-k over B x K) compiles once instead
    # of L - 1 times (at L = 15 the tree's GPU compile is 4x shorter); with its static trip count XLA runs
    # the body back to back on the device, no host round trip per depth.
    _, (scores, ranks, parents, lexes) = jax.lax.scan(next_depth, (beam_score, beam_lex), top_lp[1:])

    def all_depths(depth_1, deeper):  # [B] and [L - 1, B] -> [L, B]
        return jnp.concatenate([depth_1[None], deeper])

    score = all_depths(beam_score, scores)  # [L, B]
    lex = all_depths(beam_lex, lexes)
    # Global order over (depth, lex position): put entries at flat index d * B + lex, so lower index =
    # shallower, then lexicographically smaller; top_k's lower-index-first rule does the rest.
    by_lex = jnp.argsort(lex, axis=1)  # [L, B] beam index at each lex position
    laid_out = jnp.take_along_axis(score, by_lex, axis=1).reshape(-1)
    chosen_score, flat = jax.lax.top_k(laid_out, budget)
    chosen_depth = (flat // budget).astype(jnp.int32)  # 0-based depth index
    chosen_beam = by_lex[chosen_depth, flat % budget]

    rank_all = all_depths(beam_rank, ranks)
    parent_all = all_depths(jnp.zeros((budget,), jnp.int32), parents)  # depth 1's parent is the root
    token = top_tok[chosen_depth, rank_all[chosen_depth, chosen_beam]]
    valid = jnp.isfinite(chosen_score)

    # Node index of every (depth, beam entry) that was chosen: node = 1 + position in chosen order.
    node_of = jnp.full((depth_limit, budget), -1, jnp.int32).at[chosen_depth, chosen_beam].set(
        jnp.arange(1, budget + 1, dtype=jnp.int32))
    parent_beam = parent_all[chosen_depth, chosen_beam]
    parent_node = jnp.where(chosen_depth == 0, 0, node_of[jnp.maximum(chosen_depth - 1, 0), parent_beam])
    parent_node = jnp.where(valid, parent_node, 0)

    tokens = jnp.concatenate([root[None].astype(jnp.int32), token.astype(jnp.int32)])
    parents_out = jnp.concatenate([jnp.zeros((1,), jnp.int32), parent_node])
    depths = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.where(valid, chosen_depth + 1, 0)])
    valid_out = jnp.concatenate([jnp.ones((1,), bool), valid])
    scores_out = jnp.concatenate([jnp.zeros((1,), jnp.float32), chosen_score])
    return DraftTree(tokens=tokens, parents=parents_out, depths=depths, valid=valid_out,
                     ancestor=ancestor_mask(parents_out, valid_out, depth_limit), scores=scores_out)


def ancestor_mask(parents: jax.Array, valid: jax.Array, max_depth: int) -> jax.Array:
    """parents [T] (root is its own parent) -> [T, T] bool, row i marks i and its ancestors.

    Walks every node up one level at a time, max_depth steps. Padding nodes see only themselves.
    Example: parents [0, 0, 1, 0] -> row 2 = [1, 1, 1, 0].
    """
    t = parents.shape[0]
    eye = jnp.eye(t, dtype=bool)
    nodes = jnp.arange(t)
    mask, current = eye, nodes
    for _ in range(max_depth):
        # The barrier keeps each level's gather in a kernel of its own. Without it XLA's GPU backend fuses
        # the chain current = parents[parents[...]] into one kernel whose emitter re-emits each earlier
        # gather for every later one (exponential in the depth): at depth 15 the DDTree round took minutes
        # to compile on the H200.
        current = jax.lax.optimization_barrier(parents[current])
        mask = mask | (current[:, None] == nodes[None, :])
    return mask & (valid[:, None] | eye)
