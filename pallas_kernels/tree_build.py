"""The draft-tree build after the vocabulary top-k, in one kernel launch (Pallas, Triton).

The contract is `ddtree_jax.tree._build_one` (the B most probable prefixes under per-depth top-K
log-probabilities, node order (score desc, depth asc, lexicographic rank tuple asc), ancestor mask),
bit for bit: the same float32 sums, the same comparisons, the same tie order. Its reference is that
function (`build_tree(..., implementation="reference")`), which tests/test_tree.py checks against the
paper's heap Algorithm 1; kernels never import the application, so the two meet in the tests.

Letters: b batch, l depths (L, the drafter's block - 1), k top entries per depth (K = min(B, V)),
B budget, c candidate pairs (C, `candidate_pairs`: (i + 1)(j + 1) <= B), t tree nodes (T = B + 1).
A trailing p means the power of two at or above (Triton blocks): bp, cp, tp.

One program per batch row (grid (b,)); the whole build runs inside it, depth after depth, with
per-row scratch in global memory (extra outputs) and CTA barriers between a store and the loads of
other threads. Per depth d >= 1:
1. Lexicographic slots. The beam's labels are in lexicographic order; entry i's candidates (i, j),
   j < width(i) = min(K, B // (i + 1)), take the slots offset(i) + j, where offset(i) sums the widths
   of the entries with smaller labels (a B x B count). Slot order is then the lexicographic order
   of `_build_one`'s `lex` keys, so its tie-break "lex' < lex" becomes "slot' < slot".
2. Places. Each candidate's place in (score desc, slot asc) order counts the candidates ahead of it
   (score' > score, or score' == score and slot' < slot: float compares, as `_build_one`), in
   [block_rows, block] tiles: few wide steps, since one program's dependent steps are its latency.
   The candidate at place n < B is scattered to `select[n]`.
3. The new beam, best first: parent, token rank, score = beam_score[parent] + lp_d[rank] (the same
   float32 sum) and, as its label, its slot (lexicographic order again; only the order matters).
The global top B (score desc in XLA's total order, then flat index d * B + i asc) is merged depth by
depth into a running best-first list of B entries (its own index is its count among itself; 3 B x B
counts per depth instead of one (L B)^2). Last, node numbering (node = 1 + place), parents through
`node_of[d, i]`, and the ancestor mask: the identity, then a scatter of True at every (node,
ancestor) found by walking the beam's parent pointers up the depths (what `_build_one` carries).

Scores are taken to be NaN-free (log-softmax outputs): NaN compares differ between the two counts.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels._counting import INT32_MIN, count_ahead, from_total_order_key, total_order_key
from pallas_kernels._dispatch import cdiv, check_knobs, next_pow2, resolve_interpret

MAX_BUDGET = 128  # C = 620 candidates per depth at B = 128; larger budgets stay on the XLA builder
REGISTER_CANDIDATES = 128  # the register form's one tile of candidates: B <= 32 (C = 119 at B = 32)

_NEG_INF = float("-inf")


class BuiltTree(NamedTuple):
    """`ddtree_jax.tree.DraftTree`'s fields in its order (device), T = B + 1:
      tokens [b, T] int32, parents [b, T] int32, depths [b, T] int32, valid [b, T] bool,
      ancestor [b, T, T] bool, scores [b, T] float32."""

    tokens: jax.Array
    parents: jax.Array
    depths: jax.Array
    valid: jax.Array
    ancestor: jax.Array
    scores: jax.Array


@dataclasses.dataclass(frozen=True)
class TreeBuildConfig:
    """Tuning knobs of the kernel (static, hashable).

    block:      columns of a counting tile (the candidates or beam entries compared against); a power of
                two >= 16, clamped to the padded sizes.
    block_rows: rows of a candidate-place counting tile: the candidates placed at once, each step comparing
                them with `block` others. Wide, because one program does the whole build: at B = 64 (280
                candidates) 32 x 32 tiles took 81 dependent steps per depth, 128 x 32 take 27 and 256 x 32 18.
                A power of two >= 16, clamped to the padded candidate count.
    num_warps:  Triton's warps per program (one program per batch row). 8: at B = 64 on the H200 the build took
                257 against 323 us with 4 (2026-12-02), and the same at B = 16.
    num_stages: Triton's software pipelining; 1, because the depth loop stores and reloads scratch
                across barriers and must not have loads hoisted into an earlier iteration.
    registers:  1: the register form (`_tree_build_registers_kernel`) where the candidates fit one tile
                (REGISTER_CANDIDATES, i.e. B <= 32), the scratch form above it; 0: the scratch form always.
                The knobs above are the scratch form's.
    register_warps: Triton's warps per program of the register form. 4: at B = 32 its [128, 128] counts fit
                the registers without spilling (sm_90, tools/triton_offline.py).
    """

    block: int = 32
    block_rows: int = 128
    num_warps: int = 8
    num_stages: int = 1
    registers: int = 1
    register_warps: int = 4

    def __post_init__(self):
        check_knobs(self, pow2={"block": 16, "block_rows": 16, "register_warps": 1})


def candidate_table(budget: int, k: int) -> np.ndarray:
    """int32 [2, cp]: `_build_one`'s candidate pairs (beam entry i, token rank j), (i + 1)(j + 1) <= B,
    j < K, in (i, j) order, padded with zeros to a power of two. Example, B = 4, K = 4:
    i = [0 0 0 0 1 1 2 3], j = [0 1 2 3 0 1 0 0]."""
    pairs = [(i, j) for i in range(budget) for j in range(min(k, budget // (i + 1)))]
    table = np.zeros((2, next_pow2(len(pairs))), np.int32)
    table[:, :len(pairs)] = np.array(pairs, np.int32).T
    return table


# ----------------------------------------------------------------------------------------------------
# Kernel body


def _tree_build_kernel(
    # inputs
    lp_ref,        # [l, k] float32 top-K log-probs per depth, rank order
    tok_ref,       # [l, k] int32 their tokens
    root_ref,      # [1] int32 the root (bonus) token
    pair_ref,      # [2, cp] int32 candidate pairs (i, j), `candidate_table`
    # outputs
    tokens_ref,    # [t] int32
    parents_ref,   # [t] int32
    depths_ref,    # [t] int32
    valid_ref,     # [t] bool
    ancestor_ref,  # [t, t] bool
    scores_ref,    # [t] float32
    # scratch (per row, global memory)
    score_ref,     # [l, bp] float32 beam scores per depth, best first (-inf past K at depth 0)
    parent_ref,    # [l, bp] int32 beam parent (position in the previous depth's beam)
    rank_ref,      # [l, bp] int32 token rank
    node_ref,      # [l, bp] int32 node of each beam entry (1 + global place), -1 if not chosen
    label_ref,     # [bp] int32 the current beam's labels (lexicographic order)
    offset_ref,    # [bp] int32 first slot of each beam entry's candidates
    slot_score_ref,  # [cp] float32 candidate scores by slot
    slot_cand_ref,   # [cp] int32 candidate index (into pair_ref) by slot
    select_ref,    # [bp] int32 slot at each of the B first places
    new_key_ref,   # [bp] int32 total-order keys of the depth being merged
    run_key_ref,   # [bp] int32 running global top B: keys, best first
    run_flat_ref,  # [bp] int32 and flat indices d * B + i
    *,
    budget: int,
    k: int,
    depth_limit: int,
    num_pairs: int,
    bp: int,
    cp: int,
    tp: int,
    block_c: int,
    block_r: int,
    block_b: int,
    block_t: int,
    interpret: bool,
):
    b_, k_, l_, c_ = budget, k, depth_limit, num_pairs
    t_ = budget + 1
    pos = jnp.arange(bp, dtype=jnp.int32)
    in_beam = pos < b_
    # Masked lanes of a scatter get an out-of-range index: the interpreter drops those writes (a masked
    # lane writing back the old value at a shared index could overwrite a real one); Triton masks them.
    bp_out, cp_out, t_out = bp, cp, t_

    def barrier():  # the interpreter runs a program as one sequential program and has no barrier
        if not interpret:
            plt.debug_barrier()

    def merge(d, score, first: bool):
        """Merge depth d's beam (score [bp], position i = flat d * B + i) into the running global list."""
        key = jnp.where(in_beam, total_order_key(score), INT32_MIN)
        new_key_ref[...] = key
        barrier()
        kw = dict(block=block_b, num_cols=b_, other=INT32_MIN, masked=True)
        nb = cdiv(b_, block_b)
        place_new = count_ahead(key, pos, new_key_ref, 0, nb, tie="index", **kw)
        if not first:
            run_key, run_flat = run_key_ref[...], run_flat_ref[...]
            place_new += count_ahead(key, pos, run_key_ref, 0, nb, tie="always", **kw)  # shallower: first on ties
            place_run = pos + count_ahead(run_key, pos, new_key_ref, 0, nb, tie="never", **kw)
        barrier()  # every read of the running list is done
        if not first:
            keep = in_beam & (place_run < b_)
            at = jnp.where(keep, place_run, bp_out)
            plt.store(run_key_ref.at[at], run_key, mask=keep)
            plt.store(run_flat_ref.at[at], run_flat, mask=keep)
        keep = in_beam & (place_new < b_)
        at = jnp.where(keep, place_new, bp_out)
        plt.store(run_key_ref.at[at], key, mask=keep)
        plt.store(run_flat_ref.at[at], d * b_ + pos, mask=keep)
        barrier()

    # Nothing chosen yet.
    def clear(e, _):
        node_ref[e, :] = jnp.full((bp,), -1, jnp.int32)
        return 0

    lax.fori_loop(0, l_, clear, 0)

    # Depth 1 (index 0): the top-K in rank order, best first; positions K..B-1 empty (-inf).
    score0 = jnp.where(pos < k_, lp_ref[0, jnp.minimum(pos, k_ - 1)], _NEG_INF)
    score_ref[0, :] = score0
    parent_ref[0, :] = jnp.zeros((bp,), jnp.int32)
    rank_ref[0, :] = pos
    label_ref[...] = pos
    barrier()
    merge(0, score0, first=True)

    num_col_blocks = cdiv(c_, block_c)

    def next_depth(d, _):
        # 1. offset(i) = sum of width(i') over the beam entries with smaller labels.
        label = label_ref[...]

        def offset_body(q, acc):  # width(i') = min(K, B // (i' + 1)): entry i' has that many candidates
            col = q * block_b + jnp.arange(block_b, dtype=jnp.int32)
            col_ok = col < b_
            col_label = plt.load(label_ref.at[pl.ds(q * block_b, block_b)], mask=col_ok, other=0)
            col_width = jnp.where(col_ok, jnp.minimum(k_, lax.div(jnp.int32(b_), col + 1)), 0)
            return acc + jnp.where(col_label[None, :] < label[:, None], col_width[None, :], 0)

        offset = jnp.sum(lax.fori_loop(0, cdiv(b_, block_b), offset_body, jnp.zeros((bp, block_b), jnp.int32)),
                         axis=1)
        offset_ref[...] = offset
        barrier()
        # 2. Every candidate's score into its lexicographic slot (the [cp] vectors are made here, not kept
        # live across the depth loop: registers).
        cand = jnp.arange(cp, dtype=jnp.int32)
        cand_ok = cand < c_
        pair_i, pair_j = pair_ref[0, :], pair_ref[1, :]
        slot = jnp.where(cand_ok, offset_ref[pair_i] + pair_j, cp_out)
        score = score_ref[d - 1, pair_i] + lp_ref[d, jnp.minimum(pair_j, k_ - 1)]  # left to right, as _build_one
        plt.store(slot_score_ref.at[slot], score, mask=cand_ok)
        plt.store(slot_cand_ref.at[slot], cand, mask=cand_ok)
        barrier()

        # 3. Places in (score desc, slot asc) order; the first B scattered to `select`. Columns past C read
        # as NaN, which is never ahead.
        def place_block(r, _):
            row_idx = r * block_r + jnp.arange(block_r, dtype=jnp.int32)
            row_ok = row_idx < c_
            rows = plt.load(slot_score_ref.at[pl.ds(r * block_r, block_r)], mask=row_ok, other=0.0)
            place = count_ahead(rows, row_idx, slot_score_ref, 0, num_col_blocks, tie="index", block=block_c,
                                 num_cols=c_, other=float("nan"), masked=False)
            keep = row_ok & (place < b_)
            plt.store(select_ref.at[jnp.where(keep, place, bp_out)], row_idx, mask=keep)
            return 0

        lax.fori_loop(0, cdiv(c_, block_r), place_block, 0)
        barrier()
        # 4. The new beam, best first; labels = slots.
        at = select_ref[jnp.minimum(pos, b_ - 1)]
        c = slot_cand_ref[at]
        parent, rank = pair_ref[0, c], pair_ref[1, c]
        new_score = score_ref[d - 1, parent] + lp_ref[d, rank]  # the same sum as the candidate's, bit for bit
        new_score = jnp.where(in_beam, new_score, _NEG_INF)
        score_ref[d, :] = new_score
        parent_ref[d, :] = parent
        rank_ref[d, :] = rank
        label_ref[...] = at
        barrier()
        merge(d, new_score, first=False)
        return 0

    lax.fori_loop(1, l_, next_depth, 0)

    # Nodes: node n + 1 is the running list's entry n.
    node_ok = in_beam
    flat = run_flat_ref[jnp.minimum(pos, b_ - 1)]
    depth = lax.div(flat, jnp.int32(b_))  # 0-based depth index
    beam = lax.rem(flat, jnp.int32(b_))
    score = score_ref[depth, beam]
    valid = node_ok & (jnp.abs(score) < jnp.inf)  # finite (NaN: False)
    plt.store(node_ref.at[jnp.where(node_ok, depth, l_), beam], pos + 1, mask=node_ok)
    barrier()
    token = tok_ref[depth, jnp.minimum(rank_ref[depth, beam], k_ - 1)]  # _build_one's gather clamps too
    parent_node = node_ref[jnp.maximum(depth - 1, 0), parent_ref[depth, beam]]
    parent_node = jnp.where(valid & (depth > 0), parent_node, 0)
    out = jnp.where(node_ok, pos + 1, t_out)
    plt.store(tokens_ref.at[out], token, mask=node_ok)
    plt.store(parents_ref.at[out], parent_node, mask=node_ok)
    plt.store(depths_ref.at[out], jnp.where(valid, depth + 1, 0), mask=node_ok)
    plt.store(valid_ref.at[out], valid, mask=node_ok)
    plt.store(scores_ref.at[out], score, mask=node_ok)
    tokens_ref[0] = root_ref[0]
    parents_ref[0] = jnp.int32(0)
    depths_ref[0] = jnp.int32(0)
    valid_ref[0] = jnp.bool_(True)
    scores_ref[0] = jnp.float32(0.0)

    # Ancestor mask: the identity (a padding node sees only itself), then the root and the ancestors of every
    # valid node, level by level up its beam parents (node_of may say -1 where _build_one's does).
    def eye_block(r, _):
        row = r * block_t + jnp.arange(block_t, dtype=jnp.int32)
        col = jnp.arange(tp, dtype=jnp.int32)
        plt.store(ancestor_ref.at[pl.ds(r * block_t, block_t), pl.ds(0, tp)], row[:, None] == col[None, :],
                  mask=(row < t_)[:, None] & (col < t_)[None, :])
        return 0

    lax.fori_loop(0, cdiv(t_, block_t), eye_block, 0)
    barrier()
    true = jnp.ones((bp,), jnp.bool_)
    row_out = jnp.where(valid, pos + 1, t_out)
    plt.store(ancestor_ref.at[row_out, jnp.zeros((bp,), jnp.int32)], true, mask=valid)

    def up(i, cur):
        e = l_ - 1 - i
        active = valid & (e <= depth)
        anc = node_ref[e, cur]
        hit = active & (anc >= 0)
        plt.store(ancestor_ref.at[jnp.where(hit, pos + 1, t_out), jnp.maximum(anc, 0)], true, mask=hit)
        return jnp.where(active, parent_ref[e, cur], cur)

    lax.fori_loop(0, l_, up, beam)


def num_candidates(budget: int, k: int) -> int:
    """C: the candidate pairs (i + 1)(j + 1) <= B, j < K."""
    return sum(min(k, budget // (i + 1)) for i in range(budget))


def register_form(budget: int, k: int, config: TreeBuildConfig) -> bool:
    """Whether the build runs the register form (its candidates fit one tile and `config.registers`)."""
    return bool(config.registers) and next_pow2(num_candidates(budget, k)) <= REGISTER_CANDIDATES


def _tree_build_registers_kernel(
    lp_ref,        # [l, k] float32 top-K log-probs per depth, rank order
    tok_ref,       # [l, k] int32 their tokens
    root_ref,      # [1] int32 the root (bonus) token
    pair_ref,      # [2, cp] int32 candidate pairs (i, j), `candidate_table`
    tokens_ref, parents_ref, depths_ref, valid_ref, ancestor_ref, scores_ref,  # outputs, [t] and [t, t]
    *,
    budget: int,
    k: int,
    depth_limit: int,
    num_pairs: int,
    bp: int,
    cp: int,
    tp: int,
    flat_bits: int,
    pos_bits: int,
):
    """The build for candidate sets of one register tile (cp <= REGISTER_CANDIDATES): every per-depth array
    lives in registers, gathers are one-hot reductions, and nothing goes through memory between depths (the
    scratch form's global-memory round trips and CTA barriers, several per depth, are its latency at small B).

    Carried from depth to depth: the beam (score, lexicographic label; best first) and the running global
    top B (total-order key, and packed: flat index d * B + i | token rank << flat_bits | parent beam position
    << flat_bits + pos_bits; the new beam's labels travel in the first field of the same packing, so
    flat_bits covers both L B and C). The nodes, their parents and the ancestor mask come from the final
    running list alone: node n + 1 is its entry n, and a node's parent is the entry at (depth - 1, parent
    position), which is chosen too (prefix-closed: log-probs are <= 0)."""
    b_, k_, l_, c_ = budget, k, depth_limit, num_pairs
    t_ = budget + 1
    neg_inf = jnp.float32(_NEG_INF)
    pos = jnp.arange(bp, dtype=jnp.int32)
    in_beam = pos < b_
    flat_mask = (1 << flat_bits) - 1
    pos_mask = (1 << pos_bits) - 1

    def count(pred):  # [r, c] bool -> [r] int32
        return jnp.sum(pred.astype(jnp.int32), axis=1)

    def gather(index, values, fill):
        """values[index] for index [r] into values [bp] (a one-hot reduction; fill where no entry matches)."""
        hit = index[:, None] == pos[None, :]
        if jnp.issubdtype(values.dtype, jnp.floating):  # max keeps the value's bits (-0.0 included)
            return jnp.max(jnp.where(hit, values[None, :], neg_inf), axis=1)
        return jnp.sum(jnp.where(hit, values[None, :], 0), axis=1) + jnp.where(count(hit) > 0, 0, fill)

    def pack(first, rank, parent):
        return first | (rank << flat_bits) | (parent << (flat_bits + pos_bits))

    def merge(run_key, run_pay, key, pay):
        """Merge a depth's beam (key [bp], INT32_MIN past B; payload pay [bp]) into the running list (None:
        the first depth): places in (key desc, then running entries first, then beam position asc)."""
        key_r, key_c = key[:, None], key[None, :]
        place_new = count(((key_c > key_r) | ((key_c == key_r) & (pos[None, :] < pos[:, None]))) & in_beam[None, :])
        if run_key is not None:
            place_new += count((run_key[None, :] >= key_r) & in_beam[None, :])
            place_run = pos + count((key_c > run_key[:, None]) & in_beam[None, :])
        at_new = (place_new[None, :] == pos[:, None]) & in_beam[None, :]  # [place, entry]
        out_key = jnp.sum(jnp.where(at_new, key_c, 0), axis=1)
        out_pay = jnp.sum(jnp.where(at_new, pay[None, :], 0), axis=1)
        if run_key is not None:
            at_run = (place_run[None, :] == pos[:, None]) & in_beam[None, :]
            out_key += jnp.sum(jnp.where(at_run, run_key[None, :], 0), axis=1)
            out_pay += jnp.sum(jnp.where(at_run, run_pay[None, :], 0), axis=1)
        return jnp.where(in_beam, out_key, INT32_MIN), out_pay

    cand = jnp.arange(cp, dtype=jnp.int32)
    cand_ok = cand < c_
    pair_i, pair_j = pair_ref[0, :], pair_ref[1, :]

    # Depth 1 (index 0): the top-K in rank order; positions K..B-1 empty (-inf).
    score0 = jnp.where(in_beam & (pos < k_), lp_ref[0, jnp.minimum(pos, k_ - 1)], neg_inf)
    run_key, run_pay = merge(None, None, jnp.where(in_beam, total_order_key(score0), INT32_MIN),
                             pack(pos, pos, jnp.zeros_like(pos)))

    def next_depth(d, carry):
        beam_score, beam_lex, run_key, run_pay = carry
        score = gather(pair_i, beam_score, 0) + lp_ref[d, jnp.minimum(pair_j, k_ - 1)]  # left to right, as _build_one
        score = jnp.where(cand_ok, score, jnp.nan)  # a padding candidate is never ahead
        lex = gather(pair_i, beam_lex, 0) * k_ + pair_j  # (parent's label, token rank): distinct
        # Each candidate's place in (score desc, lex asc) order and (high 16 bits) its rank in lex order: the
        # children's next label.
        lex_less = (lex[None, :] < lex[:, None]) & cand_ok[None, :]
        ahead = (score[None, :] > score[:, None]) | ((score[None, :] == score[:, None]) & lex_less)
        packed = jnp.sum(ahead.astype(jnp.int32) + (lex_less.astype(jnp.int32) << 16), axis=1)
        place = jnp.where(cand_ok, packed & 0xFFFF, c_)
        hit = (place[None, :] == pos[:, None]) & in_beam[:, None]  # [beam position, candidate]
        new_pay = jnp.sum(jnp.where(hit, pack(packed >> 16, pair_j, pair_i)[None, :], 0), axis=1)
        new_score = jnp.where(in_beam, jnp.max(jnp.where(hit, score[None, :], neg_inf), axis=1), neg_inf)
        rank, parent = (new_pay >> flat_bits) & pos_mask, new_pay >> (flat_bits + pos_bits)
        run_key, run_pay = merge(run_key, run_pay, jnp.where(in_beam, total_order_key(new_score), INT32_MIN),
                                 pack(d * b_ + pos, rank, parent))
        return new_score, new_pay & flat_mask, run_key, run_pay

    if l_ > 1:
        _, _, run_key, run_pay = lax.fori_loop(1, l_, next_depth, (score0, pos, run_key, run_pay))

    # Nodes: node n + 1 is the running list's entry n.
    flat = run_pay & flat_mask
    rank, parent = (run_pay >> flat_bits) & pos_mask, run_pay >> (flat_bits + pos_bits)
    depth = lax.div(flat, jnp.int32(b_))  # 0-based depth index
    score = from_total_order_key(run_key)  # the chosen prefix's score, bit for bit
    valid = in_beam & (jnp.abs(score) < jnp.inf)  # finite
    token = tok_ref[jnp.where(in_beam, depth, 0), jnp.minimum(rank, k_ - 1)]  # _build_one's gather clamps too
    # The parent's entry: the one at (depth - 1, parent position); -1 where there is none (depth 0).
    target = jnp.where(depth > 0, (depth - 1) * b_ + parent, -1)
    is_parent = jnp.where(in_beam, flat, -2)[None, :] == target[:, None]  # [entry, its parent's entry]
    parent_entry = jnp.sum(jnp.where(is_parent, pos[None, :], 0), axis=1) + jnp.where(count(is_parent) > 0, 0, -1)
    # Scatters to index vectors (masked lanes out of range, dropped): a slice [1, 1 + bp) may pass T.
    out = jnp.where(in_beam, pos + 1, t_)
    plt.store(tokens_ref.at[out], token, mask=in_beam)
    plt.store(parents_ref.at[out], jnp.where(valid & (depth > 0), parent_entry + 1, 0), mask=in_beam)
    plt.store(depths_ref.at[out], jnp.where(valid, depth + 1, 0), mask=in_beam)
    plt.store(valid_ref.at[out], valid, mask=in_beam)
    plt.store(scores_ref.at[out], score, mask=in_beam)
    tokens_ref[0] = root_ref[0]
    parents_ref[0] = jnp.int32(0)
    depths_ref[0] = jnp.int32(0)
    valid_ref[0] = jnp.bool_(True)
    scores_ref[0] = jnp.float32(0.0)

    # Ancestor rows of nodes 1..B: itself, and for a valid node the root and every node up its parents.
    nodes = jnp.arange(tp, dtype=jnp.int32)
    mark = (nodes[None, :] == (pos + 1)[:, None]) | (valid[:, None] & (nodes[None, :] == 0))

    def up(_, carry):
        mark, cur = carry
        mark = mark | ((cur >= 0)[:, None] & (nodes[None, :] == (cur + 1)[:, None]))
        return mark, gather(cur, parent_entry, -1)

    mark, _ = lax.fori_loop(0, l_, up, (mark, jnp.where(valid, pos, -1)))
    col_ok = nodes < t_
    ok = in_beam[:, None] & col_ok[None, :]
    rows = jnp.where(ok, jnp.broadcast_to((pos + 1)[:, None], (bp, tp)), t_)
    cols = jnp.where(ok, jnp.broadcast_to(nodes[None, :], (bp, tp)), t_)
    plt.store(ancestor_ref.at[rows, cols], mark, mask=ok)
    plt.store(ancestor_ref.at[0, jnp.where(col_ok, nodes, t_)], nodes == 0, mask=col_ok)


# ----------------------------------------------------------------------------------------------------
# pallas_call wrapper and public function


@functools.partial(jax.jit, static_argnames=("budget", "config", "interpret", "debug"))
def tree_build_pallas(top_lp, top_tok, root_tokens, *, budget: int, config: TreeBuildConfig | None = None,
                      interpret: bool = False, debug: bool = False) -> BuiltTree:
    """top_lp [b, L, K] float32 and top_tok [b, L, K] int32: every depth's top K = min(B, V) log-probs and
    tokens in rank order (the vocabulary top-k's output); root_tokens [b] int32; budget B (static,
    1 <= B <= MAX_BUDGET). Returns BuiltTree, equal to `ddtree_jax.tree._build_one` vmapped."""
    config = TreeBuildConfig() if config is None else config
    if not isinstance(budget, int) or isinstance(budget, bool) or not 1 <= budget <= MAX_BUDGET:
        raise ValueError(f"budget={budget!r}: the tree-build kernel takes 1 <= B <= {MAX_BUDGET}")
    if top_lp.ndim != 3 or top_tok.shape != top_lp.shape:
        raise ValueError(f"top_lp and top_tok must both be [b, L, K], got {top_lp.shape} and {top_tok.shape}")
    b, depth_limit, k = top_lp.shape
    if k > budget:
        raise ValueError(f"K={k} top entries per depth: must be min(B, V) <= B={budget}")
    if root_tokens.shape != (b,):
        raise ValueError(f"root_tokens must be [b] = ({b},), got {root_tokens.shape}")
    num_pairs = num_candidates(budget, k)
    bp, t = next_pow2(budget), budget + 1
    tp = next_pow2(t)

    def row(*shape):
        return pl.BlockSpec((None, *shape), lambda i: (i,) + (0,) * len(shape))

    table = candidate_table(budget, k)
    cp = table.shape[1]
    if register_form(budget, k, config):
        flat_bits = max(depth_limit * budget - 1, num_pairs - 1, 1).bit_length()
        pos_bits = max(bp - 1, 1).bit_length()
        if flat_bits + 2 * pos_bits > 31:
            raise ValueError(f"L={depth_limit} depths at B={budget}: the packed running list needs "
                             f"{flat_bits + 2 * pos_bits} > 31 bits")
        kernel = functools.partial(
            _tree_build_registers_kernel, budget=budget, k=k, depth_limit=depth_limit, num_pairs=num_pairs, bp=bp,
            cp=cp, tp=tp, flat_bits=flat_bits, pos_bits=pos_bits)
        out_dims = [((t,), jnp.int32), ((t,), jnp.int32), ((t,), jnp.int32), ((t,), jnp.bool_), ((t, t), jnp.bool_),
                    ((t,), jnp.float32)]
        outs = pl.pallas_call(
            kernel,
            grid=(b,),
            in_specs=[row(depth_limit, k), row(depth_limit, k), row(1), pl.BlockSpec((2, cp), lambda i: (0, 0))],
            out_specs=[row(*shape) for shape, _ in out_dims],
            out_shape=[jax.ShapeDtypeStruct((b, *shape), dtype) for shape, dtype in out_dims],
            compiler_params=plt.CompilerParams(num_warps=config.register_warps, num_stages=1),
            interpret=interpret,
            debug=debug,
            name="tree_build",
        )(top_lp.astype(jnp.float32), top_tok.astype(jnp.int32), root_tokens.astype(jnp.int32).reshape(b, 1),
          jnp.asarray(table))
        return BuiltTree(*outs)

    kernel = functools.partial(
        _tree_build_kernel, budget=budget, k=k, depth_limit=depth_limit, num_pairs=num_pairs, bp=bp, cp=cp,
        tp=tp, block_c=min(config.block, cp), block_r=min(config.block_rows, cp), block_b=min(config.block, bp),
        block_t=min(config.block, tp),
        interpret=interpret)

    out_dims = [((t,), jnp.int32), ((t,), jnp.int32), ((t,), jnp.int32), ((t,), jnp.bool_), ((t, t), jnp.bool_),
                ((t,), jnp.float32),
                ((depth_limit, bp), jnp.float32), ((depth_limit, bp), jnp.int32), ((depth_limit, bp), jnp.int32),
                ((depth_limit, bp), jnp.int32), ((bp,), jnp.int32), ((bp,), jnp.int32), ((cp,), jnp.float32),
                ((cp,), jnp.int32), ((bp,), jnp.int32), ((bp,), jnp.int32), ((bp,), jnp.int32), ((bp,), jnp.int32)]
    outs = pl.pallas_call(
        kernel,
        grid=(b,),
        in_specs=[row(depth_limit, k), row(depth_limit, k), row(1), pl.BlockSpec((2, cp), lambda i: (0, 0))],
        out_specs=[row(*shape) for shape, _ in out_dims],
        out_shape=[jax.ShapeDtypeStruct((b, *shape), dtype) for shape, dtype in out_dims],
        compiler_params=plt.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages),
        interpret=interpret,
        debug=debug,
        name="tree_build",
    )(top_lp.astype(jnp.float32), top_tok.astype(jnp.int32), root_tokens.astype(jnp.int32).reshape(b, 1),
      jnp.asarray(table))
    return BuiltTree(*outs[:6])


def tree_build(top_lp, top_tok, root_tokens, *, budget: int, config: TreeBuildConfig | None = None,
               interpret: bool | None = None) -> BuiltTree:
    """`tree_build_pallas`, interpreted where there is no GPU (interpret None). There is no reference branch
    here: the reference is the application's `ddtree_jax.tree._build_one`, and `build_tree` chooses."""
    return tree_build_pallas(top_lp, top_tok, root_tokens, budget=budget, config=config,
                             interpret=resolve_interpret(interpret))
