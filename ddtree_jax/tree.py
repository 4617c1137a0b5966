"""Draft trees: the B most probable prefixes under the drafter's per-position marginals, static shapes.

The paper's Proposition 2: with per-depth log-probabilities `lp[d, token]`, the set of the B
highest-scoring prefixes (score = sum of the log-probs along the prefix) is prefix-closed and is the
optimal draft tree; Lemma 1: only the top-K tokens per depth matter, K = min(B, V). Algorithm 1 finds
it with a heap on the host. Here the same set is built on device with fixed shapes:

1. Per depth d, the beam of the B best depth-d prefixes, sorted best first (a depth-d prefix in the
   global top-B is in the top-B of its depth, and its parent is in the top-B of depth d - 1). Its
   children are (beam entry i, token rank j) with score beam[i] + lp_d[j]. Only the pairs with
   (i + 1)(j + 1) <= B can be among the B best: every (i', j') with i' <= i and j' <= j scores at least
   as much and comes first on ties, and there are (i + 1)(j + 1) - 1 of them. That is about B ln B
   candidates (280 at B = 64, 3.4k at B = 512) instead of B x K; counting the candidates ahead of each
   orders them (no sort).
2. The global top-B over the L x B beam entries (counted the same way).

Ties: order is (score desc, depth asc, rank tuple lexicographic asc), where a prefix's rank tuple lists
the rank of its token among the top-K at each depth (the order in which Algorithm 1's heap pops). Shallower
first keeps the set prefix-closed (a child never scores above its parent). Each beam carries a label per
entry in the lexicographic order of its depth (its rank among the depth's candidates), so a child's
lexicographic key is (parent's label, token rank).

Nodes come out in (score desc, depth asc, lex) order, so parents precede children; index 0 is the root
(the bonus token, depth 0). Siblings carry distinct tokens (different ranks at one depth). The ancestor
mask comes from each beam entry's ancestors (carried down the depths), not from walking parent pointers.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import tree_build, vocab_top_k


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


def default_top_k_chunk(budget: int, vocab: int | None = None) -> int:
    """Chunk of the two-stage top-k (`chunked_top_k`) for a budget, from the H200 (tools/topk_probe.py,
    2026-12-01, both Qwen vocabularies): 2048 built the tree fastest at B = 64, 256 and 512 (677 against
    1217 us for one lax.top_k at B = 64, V = 151936), 16384 at B = 16 (413 against 557 us). A vocabulary
    no longer than 16384 (the demo pair's 8192) takes 2048 too: one lax.top_k over it is slow on a CPU
    (17.1 ms against 0.37 ms for 15 rows of 8192 at k = 16, this project's 2-core machine, 2026-12-01)."""
    return 16384 if budget <= 16 and (vocab is None or vocab > 16384) else 2048


def default_top_k() -> str:
    """build_tree's vocabulary top-k on the default backend: "chunked" on a CPU (there threshold_top_k's
    cumsum runs as a log-depth scan: the demo's B = 16 build took 6.6 against 0.6 ms, 15 x 8192, this
    project's 2-core machine), else "threshold": on a GPU lax.top_k (k > 16) sorts every row it is given,
    and chunked_top_k's two sorts were 219 of the 499 us of the B = 64 build on the H200 (V = 151936),
    where threshold_top_k is a handful of reductions, a cumsum and two scatters (tools/topk_probe.py times
    both)."""
    return "chunked" if jax.default_backend() == "cpu" else "threshold"


def build_tree(log_probs: jax.Array, root_tokens: jax.Array, budget: int,
               top_k_chunk: int | None | str = "auto", unroll: bool | int = True,
               top_k: str = "auto", implementation: str = "reference",
               interpret: bool | None = None, kernel_config: tree_build.TreeBuildConfig | None = None) -> DraftTree:
    """log_probs [b, L, v] float32 per-depth draft log-probabilities (depth d + 1 at index d);
    root_tokens [b] int32; budget B (static); top_k: the per-depth top K = min(B, v) of the vocabulary,
    "threshold" (`threshold_top_k`), "pallas" (`kernel_top_k`: the same algorithm in Pallas kernels),
    "chunked" (`chunked_top_k`, the only one before 2026-12; also the other two's fallback) or "auto"
    (`default_top_k()`); top_k_chunk: `chunked_top_k`'s chunk
    ("auto": `default_top_k_chunk(B)`; None: one `lax.top_k`); unroll: the depth loop's `lax.scan` unrolling
    (True: none of it runs as a device loop). implementation: what builds the tree from the top-k,
    "reference" (`_build_one`, vmapped: ~116 small XLA kernels at B = 64, L = 15) or "pallas" (one launch of
    `pallas_kernels.tree_build`, bit-identical) for B <= its MAX_BUDGET (512), `_build_one` above it;
    interpret: the kernels' (None: interpreted where there is no GPU); kernel_config: the build kernel's (None: its
    defaults). Every choice gives the same tree.
    Returns a DraftTree with B + 1 nodes."""
    if top_k == "auto":
        top_k = default_top_k()
    chunk = default_top_k_chunk(budget, log_probs.shape[-1]) if top_k_chunk == "auto" else top_k_chunk
    k = min(budget, log_probs.shape[-1])
    lp = log_probs.astype(jnp.float32)
    # Outside the vmap over rows: threshold_top_k's fallback predicate stays one scalar for the batch (under
    # vmap a lax.cond with a batched predicate would run both branches).
    if top_k == "threshold":
        top_lp, top_tok = threshold_top_k(lp, k, fallback_chunk=chunk)  # [b, L, K], rank order
    elif top_k == "pallas":
        top_lp, top_tok = kernel_top_k(lp, k, fallback_chunk=chunk, interpret=interpret)
    elif top_k == "chunked":
        top_lp, top_tok = chunked_top_k(lp, k, chunk)
    else:
        raise ValueError(f"top_k must be 'threshold', 'pallas' or 'chunked', not {top_k!r}")
    if implementation not in ("reference", "pallas"):
        raise ValueError(f"implementation must be 'reference' or 'pallas', not {implementation!r}")
    if implementation == "pallas" and budget <= tree_build.MAX_BUDGET:
        built = tree_build.tree_build(top_lp, top_tok, root_tokens, budget=budget, config=kernel_config,
                                      interpret=interpret)
        return DraftTree(**built._asdict())
    return jax.vmap(lambda t_lp, t_tok, root: _build_one(t_lp, t_tok, root, budget, unroll))(
        top_lp, top_tok, root_tokens)


def chunked_top_k(x: jax.Array, k: int, chunk: int | None) -> tuple[jax.Array, jax.Array]:
    """`lax.top_k(x, k)` over the last axis in two stages, with the same values, indices and tie order.

    x [..., n]; the top min(k, chunk) of every chunk of `chunk` entries (the last one padded with -inf),
    then the top k of those candidates laid out chunk after chunk. Exact: an entry with fewer than k
    entries before it in (value desc, index asc) order has fewer than k before it in its chunk; and
    equal values stay in index order (within a chunk by stage one's rule, across chunks by the layout),
    so stage two's lower-position-first rule is lax.top_k's lower-index-first. Why: on the GPU one
    lax.top_k over a vocabulary row lowers to a sort of the whole row; a batch of short rows and a
    short second row sort faster. Returns (values [..., k], int32 indices [..., k]).
    """
    n = x.shape[-1]
    if chunk is None or n <= chunk or k >= chunk:
        return jax.lax.top_k(x, k)
    num_chunks = -(-n // chunk)
    padded = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, num_chunks * chunk - n)], constant_values=-jnp.inf)
    values, within = jax.lax.top_k(padded.reshape(*x.shape[:-1], num_chunks, chunk), k)  # [..., C, k]
    index = within + (jnp.arange(num_chunks, dtype=within.dtype) * chunk)[:, None]
    flat = x.shape[:-1] + (num_chunks * k,)
    top_values, at = jax.lax.top_k(values.reshape(flat), k)
    return top_values, jnp.take_along_axis(index.reshape(flat), at, axis=-1).astype(jnp.int32)


_INT32_MIN = np.iinfo(np.int32).min


def total_order_key(x: jax.Array) -> jax.Array:
    """float32 [...] -> int32 [...] whose integer order is XLA's total order of the floats (the order of
    lax.top_k and sort): -NaN < -inf < ... < -0.0 < +0.0 < ... < +inf < +NaN. Its own inverse on the bits
    (`from_total_order_key`). Non-negative floats keep their bits; negative ones flip all but the sign bit."""
    bits = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.int32)
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


def from_total_order_key(key: jax.Array) -> jax.Array:
    return jax.lax.bitcast_convert_type(key ^ ((key >> 31) & 0x7FFFFFFF), jnp.float32)


def threshold_top_k_sizes(n: int, k: int) -> tuple[int, int]:
    """(chunk c, candidate slots M) of `threshold_top_k` over rows of n: about max(4k, 256) chunks, so the
    k-th largest chunk maximum sits near the k-th largest entry (about 1.15 k entries of an i.i.d. row lie
    at or above it), and M = max(4k, 512) slots."""
    return max(1, n // max(4 * k, 256)), max(4 * k, 512)


def threshold_top_k(x: jax.Array, k: int, chunk: int | None = None, slots: int | None = None,
                    fallback_chunk: int | None = 2048) -> tuple[jax.Array, jax.Array]:
    """`lax.top_k(x, k)` over the last axis without sorting the rows: the same values, int32 indices and tie
    order (value desc in XLA's total order, `total_order_key`; lower index first among equals).

    x [..., n] float32. Per row, in integer keys (`total_order_key`), with chunk c and M slots
    (`threshold_top_k_sizes` unless given):
    1. t = the k-th largest of the ceil(n / c) chunk maxima (by counting, no sort). k different chunks each
       hold an entry >= t, so the k-th largest entry is >= t: every top-k entry is > t or == t.
    2. The candidates: every entry > t, and the first k entries == t in index order (if the top k holds m
       entries == t, they are the m lowest-indexed ones). Written in index order into M slots (a cumsum
       gives each its slot; one scatter); empty slots hold the lowest key and come after every candidate.
    3. The top k of the M slots by (key desc, slot asc), by counting (M x M compares): slot order is index
       order, so this is lax.top_k's order, and at least k candidates exist (#(> t) + #(== t) >= k), so an
       empty slot is never picked.
    Exact whenever #(> t) + min(#(== t), k) <= M. Otherwise (checked on device) the whole batch takes
    `chunked_top_k(x, k, fallback_chunk)` through a lax.cond, exact as well. The fallback needs more than
    M - k entries strictly above the k-th largest chunk maximum: the large entries crowded into fewer than k
    chunks of c consecutive indices (e.g. a near-flat top over a contiguous id range of more than M - k
    tokens). Ties (a uniform row: all entries == t) and -inf (a padded vocabulary: a chunk of only -inf has
    maximum -inf, below t unless fewer than k chunks hold a finite entry) do not trigger it. Under a
    vmap the cond's predicate is batched and both branches run (same result): call it on the whole batch.
    Inside the compiled decode loop on the H200 the cond ran as a conditional node of XLA's CUDA graph (a
    `set_case_condition` kernel in the round's trace, no device-to-host copy beyond the loop's own:
    docs/data/trace_summary_qwen3_8b_h200_2026-12-01_pending.json), so it does not sync with the host.
    Why: on the GPU lax.top_k (k > 16) sorts every row; this is a few reductions, a cumsum and two
    scatters. Returns (values [..., k], int32 indices [..., k]).
    """
    n = x.shape[-1]
    auto_chunk, auto_slots = threshold_top_k_sizes(n, k)
    c = auto_chunk if chunk is None else chunk
    m = auto_slots if slots is None else slots
    num_chunks = -(-n // c)
    if k > num_chunks or m >= n or m < k:  # too few chunks for the bound, or no fewer slots than entries
        return chunked_top_k(x, k, fallback_chunk)
    lead = x.shape[:-1]
    key = total_order_key(x).reshape(-1, n)  # [r, n]
    rows = key.shape[0]
    padded = jnp.pad(key, ((0, 0), (0, num_chunks * c - n)), constant_values=_INT32_MIN)
    chunk_max = padded.reshape(rows, num_chunks, c).max(axis=-1)  # [r, N]
    # The k-th largest chunk maximum t: the largest one with at least k chunk maxima >= it.
    at_least = jnp.sum(chunk_max[:, None, :] >= chunk_max[:, :, None], axis=-1, dtype=jnp.int32)
    t = jnp.max(jnp.where(at_least >= k, chunk_max, _INT32_MIN), axis=-1, keepdims=True)  # [r, 1]
    above, tie = key > t, key == t
    before = jnp.cumsum(jnp.stack([above, tie]).astype(jnp.int32), axis=-1) - jnp.stack([above, tie])
    above_before, tie_before = before[0], before[1]  # exclusive counts, [r, n]
    keep = above | (tie & (tie_before < k))
    slot = jnp.where(keep, above_before + jnp.minimum(tie_before, k), m)  # index order; m: dropped
    count = above_before[:, -1] + above[:, -1] + jnp.minimum(tie_before[:, -1] + tie[:, -1], k)
    fits = jnp.all(count <= m)

    def fast():
        index = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), (rows, n))
        payload = jnp.stack([key, index], axis=-1)  # [r, n, 2]: one scatter moves both
        buf = jnp.broadcast_to(jnp.array([_INT32_MIN, 0], jnp.int32), (rows, m, 2))
        buf = buf.at[jnp.arange(rows)[:, None], slot].set(payload, mode="drop")  # [r, M, 2]
        bkey = buf[..., 0]
        pos = jnp.arange(m)
        ahead = (bkey[:, None, :] > bkey[:, :, None]) | (
            (bkey[:, None, :] == bkey[:, :, None]) & (pos[None, :] < pos[:, None]))
        place = jnp.sum(ahead, axis=-1, dtype=jnp.int32)  # [r, M], a permutation of 0..M-1
        out = jnp.zeros((rows, k, 2), jnp.int32).at[jnp.arange(rows)[:, None], jnp.where(place < k, place, k)].set(
            buf, mode="drop")
        return from_total_order_key(out[..., 0]).reshape(*lead, k), out[..., 1].reshape(*lead, k)

    return jax.lax.cond(fits, fast, lambda: tuple(chunked_top_k(x.astype(jnp.float32), k, fallback_chunk)))


def kernel_top_k(x: jax.Array, k: int, fallback_chunk: int | None = 2048, interpret: bool | None = None,
                 config: vocab_top_k.VocabTopKConfig | None = None) -> tuple[jax.Array, jax.Array]:
    """`threshold_top_k`'s algorithm in three launches (`pallas_kernels.vocab_top_k`, interpreted where there is
    no GPU): `lax.top_k(x, k)`'s values, int32 indices and tie order over the last axis (as a CPU orders NaNs).
    Where a row's entries above its threshold overflow the kernel's slots, the whole batch takes
    `chunked_top_k(x, k, fallback_chunk)` through a lax.cond (exact as well; call it on the whole batch, as
    `threshold_top_k`); where the kernel does not apply (k above its MAX_K, short rows), `threshold_top_k`.
    config: the kernel's knobs (None: its defaults). x [..., n] float32; returns (values [..., k], indices
    [..., k])."""
    sizes = vocab_top_k.kernel_sizes(x.shape[-1], k)
    if sizes is None:
        return threshold_top_k(x, k, fallback_chunk=fallback_chunk)
    values, indices, count = vocab_top_k.vocab_top_k(x, k, config=config, interpret=interpret)
    fits = jnp.all(count <= sizes[1])
    return jax.lax.cond(fits, lambda: (values, indices),
                        lambda: tuple(chunked_top_k(x.astype(jnp.float32), k, fallback_chunk)))


def candidate_pairs(budget: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """(i, j) int32 [C] of every child (beam entry i, token rank j) that can be among a depth's B best:
    (i + 1)(j + 1) <= B, i < B, j < K; in (i, j) order. Example, B = 4, K = 4: i = [0 0 0 0 1 1 2 3],
    j = [0 1 2 3 0 1 0 0]."""
    pairs = [(i, j) for i in range(budget) for j in range(min(k, budget // (i + 1)))]
    i, j = np.array(pairs, np.int32).T
    return i, j


def _build_one(top_lp: jax.Array, top_tok: jax.Array, root: jax.Array, budget: int,
               unroll: bool | int) -> DraftTree:
    """top_lp, top_tok [L, K]: every depth's top-K log-probs and tokens in rank order; root [] int32."""
    depth_limit, k = top_lp.shape
    pair_i, pair_j = (jnp.asarray(x) for x in candidate_pairs(budget, k))

    # Depth 1: the top-K tokens in rank order, which is best first with ties in lexicographic order
    # (slots K..B-1 empty). Carried per beam entry: score, lexicographic rank among its depth, and the beam
    # position of its ancestor at every depth (its own at its depth).
    neg_inf = jnp.float32(-jnp.inf)
    positions = jnp.arange(budget, dtype=jnp.int32)
    beam_score = jnp.full((budget,), neg_inf).at[:k].set(top_lp[0])
    beam_lex = positions
    beam_anc = jnp.zeros((budget, depth_limit), jnp.int32).at[:, 0].set(positions)

    num_pairs = pair_i.shape[0]
    assert num_pairs < 1 << 15, "place and lexicographic rank share one int32 sum (16 bits each)"

    def next_depth(carry, x):
        """One depth: the B best children of the beam, best first; lp_d [K] this depth's top-K log-probs."""
        beam_score, beam_lex, beam_anc = carry
        lp_d, d = x
        score = beam_score[pair_i] + lp_d[pair_j]  # [C], summed left to right as Algorithm 1 does
        lex = beam_lex[pair_i] * k + pair_j  # a child's lexicographic key: (parent's label, token rank); distinct
        # Each candidate's place in (score desc, lex asc) order, by counting the candidates ahead of it (one
        # fused compare-and-count over C x C; a sort of C costs ~20 us per depth on the H200), and in the same
        # sum (high 16 bits) its rank in lex order among all C: the children's next label. Any labels in the
        # beam's lex order give the same comparisons, and ranks among C keep them below C.
        lex_less = lex[None, :] < lex[:, None]
        ahead = (score[None, :] > score[:, None]) | ((score[None, :] == score[:, None]) & lex_less)
        packed = jnp.sum(ahead.astype(jnp.int32) + (lex_less.astype(jnp.int32) << 16), axis=1)
        place, new_lex = packed & 0xFFFF, packed >> 16  # place: a permutation of 0..C-1 (C >= B)
        # The candidate at each of the B first places (exactly one matches each): a one-hot sum over C, then
        # every carried field by gathers from it (one small fusion), not one scatter per field into fresh buffers.
        at = jnp.sum(jnp.where(place[None, :] == positions[:, None], jnp.arange(num_pairs, dtype=jnp.int32), 0),
                     axis=1)  # [B]
        parent, rank, new_lex = pair_i[at], pair_j[at], new_lex[at]
        score = beam_score[parent] + lp_d[rank]  # the same sum as score[at], bit for bit
        anc = beam_anc[parent].at[:, d].set(positions)
        return (score, new_lex, anc), (score, rank, parent, anc)

    # A scan with a static trip count, unrolled: no loop (and no per-iteration predicate read back to the
    # host) on the device.
    depths_1 = jnp.arange(1, depth_limit, dtype=jnp.int32)
    _, (scores, ranks, parents, ancs) = jax.lax.scan(next_depth, (beam_score, beam_lex, beam_anc),
                                                     (top_lp[1:], depths_1), unroll=unroll)

    def all_depths(depth_1, deeper):  # [B, ...] and [L - 1, B, ...] -> [L, B, ...]
        return jnp.concatenate([depth_1[None], deeper])

    # Global order over (depth, position in the depth's best-first beam): entry (d, i) at flat index
    # d * B + i, so lower index = shallower, then (within a depth, among equal scores) lexicographically
    # smaller. lax.top_k's order (score desc in total order, lower index first), by counting the entries
    # ahead of each over (L B)^2 compares (one fused reduction; no sort), then one scatter of the B first.
    score = all_depths(beam_score, scores).reshape(-1)  # [L B]
    skey = total_order_key(score)
    flat_pos = jnp.arange(score.shape[0], dtype=jnp.int32)
    ahead = (skey[None, :] > skey[:, None]) | ((skey[None, :] == skey[:, None]) & (flat_pos[None, :] < flat_pos[:, None]))
    place = jnp.sum(ahead, axis=1, dtype=jnp.int32)  # a permutation of 0..LB-1
    flat = jnp.sum(jnp.where(place[None, :] == positions[:, None], flat_pos, 0), axis=1)  # [B], the entry at each place
    chosen_score = score[flat]
    chosen_depth = flat // budget  # 0-based depth index
    chosen_beam = flat % budget
    valid = jnp.isfinite(chosen_score)

    rank_all = all_depths(positions, ranks)
    parent_all = all_depths(jnp.zeros((budget,), jnp.int32), parents)  # depth 1's parent is the root
    anc_all = all_depths(beam_anc, ancs)  # [L, B, L]
    token = top_tok[chosen_depth, rank_all[chosen_depth, chosen_beam]]

    # Node index of every (depth, beam entry) that was chosen: node = 1 + position in chosen order (-1: not chosen).
    node_of = jnp.where(place < budget, place + 1, -1).reshape(depth_limit, budget)
    parent_beam = parent_all[chosen_depth, chosen_beam]
    parent_node = jnp.where(chosen_depth == 0, 0, node_of[jnp.maximum(chosen_depth - 1, 0), parent_beam])
    parent_node = jnp.where(valid, parent_node, 0)
    # The node ids of every chosen node's ancestors, depth by depth (prefix-closed: all are chosen); -1 below
    # the node's own depth.
    levels = jnp.arange(depth_limit, dtype=jnp.int32)
    anc_node = node_of[levels[None, :], anc_all[chosen_depth, chosen_beam]]  # [B, L]
    anc_node = jnp.where((levels[None, :] <= chosen_depth[:, None]) & valid[:, None], anc_node, -1)

    tokens = jnp.concatenate([root[None].astype(jnp.int32), token.astype(jnp.int32)])
    parents_out = jnp.concatenate([jnp.zeros((1,), jnp.int32), parent_node])
    depths = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.where(valid, chosen_depth + 1, 0)])
    valid_out = jnp.concatenate([jnp.ones((1,), bool), valid])
    scores_out = jnp.concatenate([jnp.zeros((1,), jnp.float32), chosen_score])
    nodes = jnp.arange(budget + 1, dtype=jnp.int32)
    # ancestor[n, m]: m is the root, n itself, or one of n's ancestors (a padding node: only itself).
    on_path = (anc_node[:, :, None] == nodes[None, None, :]).any(axis=1) | (nodes[None, :] == 0)  # [B, T]
    ancestor = jnp.concatenate([(nodes == 0)[None], on_path & valid[:, None]]) | jnp.eye(budget + 1, dtype=bool)
    return DraftTree(tokens=tokens, parents=parents_out, depths=depths, valid=valid_out, ancestor=ancestor,
                     scores=scores_out)


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
