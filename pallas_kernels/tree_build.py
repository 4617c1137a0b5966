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
other threads. A program's dependent steps are its latency, so a depth has two barriers. Per depth
d >= 1:
1. Candidates. Every candidate (i, j), in (i, j) order: its score beam_score[i] + lp_d[j] (the same
   float32 sum as `_build_one`) and its lexicographic key (label[i], j) = label[i] * K + j, stored.
2. Places, labels and the merge. Each candidate's place in (score desc, key asc) order counts the
   candidates ahead of it (score' > score, or score' == score and key' < key: float compares, as
   `_build_one`), and the same sum's high 16 bits its rank in key order (the children's label), in
   [block_rows, block] tiles: few wide steps. The candidate at place n < B is written straight into
   the new beam's row n: score, parent i, token rank j, label. In the same step the beam is merged
   into the running global top B (score desc in XLA's total order, then flat index d * B + i asc;
   two lists alternate by depth parity, so one is read while the other is written): a beam entry's
   place there is its beam place plus the running entries at or above it, a running entry's is its
   own plus min(B, candidates above it).
The loop stops after depth d when no deeper prefix can enter the running list: a deeper prefix
scores at most the depth-d beam's best (log-probs are <= 0) and loses ties to shallower entries, so
once that best is no longer above the list's last entry the rest of the depths cannot change it (a
shallow tree, i.e. an unconfident drafter, costs a few depths instead of L). Last, node numbering
(node = 1 + place), parents through `node_of[d, i]`, and the ancestor mask: the identity, then a
scatter of True at every (node, ancestor) found by walking the beam's parent pointers up the depths
(what `_build_one` carries).

Log-probs are taken to be log-softmax outputs, as `build_tree` passes them: NaN-free (NaN compares
differ between the two counts), <= 0 (the early stop) and never -0.0 (the merge takes float order for
XLA's total order); the depth-1 row in rank order (the top-k's output order).
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

from pallas_kernels._counting import INT32_MIN, count_ahead, count_sorted, kth_largest, total_order_key
from pallas_kernels._dispatch import cdiv, check_knobs, next_pow2, resolve_interpret
from pallas_kernels.launch import kernel_body

MAX_BUDGET = 512  # C = 3280 candidates per depth, 4096 padded (16 per thread of 8 warps): on sm_90 255 registers and
# 136 bytes of spill with its default config (the candidate table in registers), 245 and none without

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
    prune:      1: each depth counts only the candidates at or above the worst of the B children (i, 0)
                (those B score at least that, so no candidate below it is among the B best), compacted
                first: a confident drafter's deep tree at B = 64 keeps few of its 280. On the H200 deep trees
                (V = 151936, L = 15, top-k included) took 123 against 204 us at B = 64 and 166 against 524 at
                B = 128; shallow ones the same within the spread (tools/topk_probe.py, 2026-12-04).
                2: as 1, and where the bounds keep more than `exact_above` x B, only the candidates at or above the
                B-th best candidate score itself (`kth_largest`, a 32-step bisection over the candidates' keys, held
                in registers): the B best and their ties. The bound keeps every candidate where a depth's
                log-probs are flat (i.i.d. logits at B = 512: all 3280 at depth 2, ~10^7 compares in one
                program; the bisection keeps 512), and few on a confident drafter's deep tree (512-1023 at
                B = 512), where the bisection's 32 reductions would cost more than they save
                (tools/prune_counts.py). 0: every candidate. (The first bound raised to the best worst corner of the
                a x ceil(B / a) rectangles of candidates, each holding B or more, kept 515 of depth 2's candidates
                at B = 512 on a deep tree where it keeps 976, but the build took as long on an H100, 262.8 against
                262.2 us, and 266.9 without the bisection (2026-12-06): not kept.)
    exact_above: with prune 2, the bisection runs where the other bounds keep more than exact_above x B candidates
                (2: the B = 512 deep tree's 976 kept at depth 2 are all counted against each other; 1: the bisection
                cuts them to the 512 best, a quarter of the place counting's compares there, for 32 reductions).
    fuse_above: 1: the running list read once per depth, into registers: its entries' counts of candidates
                above them ride in the first row block's pass over the candidates (one pass over them less per
                depth, a [bp, block] tile more in it), and the candidates' counts of running entries at or above
                them compare with it in one [block_rows, bp] tile; 0: a pass of their own after the places, and
                the list read from memory in `block`-wide steps.
    running_bound: 1 (with prune): also leave out the candidates at or below the running list's last entry (none of
                them or their descendants can enter it): on a flat depth none is kept and the loop stops there, on a
                confident drafter's deep tree (V = 151936, B = 512, tools/prune_counts.py) ~3x fewer compares than
                the bound of prune 1 alone. On the H200 (2026-12-06, top-k included) B = 64 took 99.8 / 63.7 us on
                deep / i.i.d. trees against 104.4 / 73.4 without it; B = 512 485.8 / 142.7 against 1009 / 1114 with
                prune 1 alone. 0: the other bounds alone (for an A/B on the device).
    merge_search: 1 (without fuse_above): the merge into the running list by binary search, both lists being sorted:
                each new entry's count of running entries at or above it, and each running entry's count of beam
                entries above it (after a barrier: the beam is written by then), ceil(log2(B + 1)) dependent gathers
                each, where the counting passes compare every kept candidate with all B running entries ([bp,
                block] tiles over the kept candidates: at B = 512 the deep tree's ~3400 kept candidates against 512
                entries, twice); 0: those passes.
    hoist_pairs: 1 (with prune): the candidate table loaded once, before the depth loop, and each kept candidate's
                pair (i, j) compacted with it: each depth's gathers start from registers and the places' from the
                compacted pairs, two dependent loads fewer per depth; 0: the table read at every depth.
                Both off up to B = 128: on the H200 neither won across budgets there (both: 16% faster at B = 31 on deep
                trees, 4-7% slower at B = 63 and 64; 2026-12-05, docs/performance.md). hoist_pairs on above 128
                (`default_config`): 3-5% faster on deep trees at B = 256 and 512 on an H100 (2026-12-06), though at
                B = 512 its 4096 pairs take the program to 255 registers with 136 bytes of spill (245, none, without).
    """

    block: int = 32
    block_rows: int = 128
    num_warps: int = 8
    num_stages: int = 1
    prune: int = 1
    fuse_above: int = 0
    hoist_pairs: int = 0
    running_bound: int = 1
    merge_search: int = 0
    exact_above: int = 2

    def __post_init__(self):
        check_knobs(self, pow2={"block": 16, "block_rows": 16})
        if self.prune not in (0, 1, 2) or isinstance(self.prune, bool):
            raise ValueError(f"TreeBuildConfig.prune={self.prune!r}: must be 0, 1 or 2")
        if self.exact_above not in (1, 2) or isinstance(self.exact_above, bool):
            raise ValueError(f"TreeBuildConfig.exact_above={self.exact_above!r}: must be 1 or 2")
        for name in ("fuse_above", "hoist_pairs", "running_bound", "merge_search"):
            if getattr(self, name) not in (0, 1):
                raise ValueError(f"TreeBuildConfig.{name}={getattr(self, name)!r}: must be 0 or 1")


def default_config(budget: int) -> TreeBuildConfig:
    """The knobs for a budget B: the dataclass's defaults up to B = 128; above it the exact prune (`prune=2`, its
    bisection wherever the other bounds keep more than B: `exact_above=1`), 256-row tiles and the merge by binary
    search, with the candidate table held in registers. On the H200 no knob was faster at every budget up to 128
    (2026-12-05, docs/performance.md): 64-row tiles (`block_rows`) took 64.4 / 69.6 / 83.8 us against 71.1 / 69.6 /
    85.1 at V = 8192, B = 15 / 31 / 63 with deep trees, but 105.8 against 101.0 at V = 151936, B = 64, and the same
    within 2-4% elsewhere; on an H100 at B = 64 256-row tiles took 116.6 against 99.1 us, the merge by search 101.0
    (2026-12-06). At B = 512 (V = 151936, top-k included, an H100, 2026-12-06) deep trees took 304.1 us against
    486.0 with `prune=2` alone (356.3 with the merge by search alone, 330.3 with the wider tiles too), i.i.d. ones
    148.5 against 149.5; with the candidate table hoisted (`hoist_pairs`) deep trees 247.2-250.9 against 255.7-260.5
    us at B = 512 and 161.7-163.9 against 168.8-169.2 at B = 256, i.i.d. ones within 2 us (three A/Bs on an H100,
    2026-12-06 06:03-06:06). A function, as the other kernels have, so that `tools/with_knobs.py` can lay knobs over
    it for an A/B in whole rounds."""
    if budget > 128:
        return TreeBuildConfig(prune=2, exact_above=1, block_rows=256, merge_search=1, hoist_pairs=1)
    return TreeBuildConfig()


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
    label_ref,     # [bp] int32 the current beam's labels (ranks in lexicographic order)
    cand_score_ref,  # [cp] float32 the depth's candidate scores (NaN past C)
    cand_lex_ref,    # [cp] int32 and their lexicographic keys (parent's label, token rank)
    cand_idx_ref,    # [cp] int32 and their candidate index (prune: the kept candidates, compacted), or with
                     # hoist_pairs their pair (i, j) as i * 2^16 + j
    run_key_ref,   # [2 bp] int32 running global top B: keys, best first (two lists: depth parity)
    run_flat_ref,  # [2 bp] int32 and flat indices d * B + i
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
    prune: int,
    exact_above: int,
    fuse_above: bool,
    hoist_pairs: bool,
    running_bound: bool,
    merge_search: bool,
    interpret: bool,
):
    b_, k_, l_, c_ = budget, k, depth_limit, num_pairs
    t_ = budget + 1
    pos = jnp.arange(bp, dtype=jnp.int32)
    in_beam = pos < b_
    # Masked lanes of a scatter get an out-of-range index: the interpreter drops those writes (a masked
    # lane writing back the old value at a shared index could overwrite a real one); Triton masks them.
    bp_out, t_out = bp, t_

    def barrier():  # the interpreter runs a program as one sequential program and has no barrier
        if not interpret:
            plt.debug_barrier()

    # Nothing chosen yet; every depth's beam empty (-inf) until its places are written (with prune a depth may keep
    # fewer than B candidates: its beam's other rows stay -inf, and so do their children).
    def clear(e, _):
        node_ref[e, :] = jnp.full((bp,), -1, jnp.int32)
        score_ref[e, :] = jnp.full((bp,), _NEG_INF, jnp.float32)
        return 0

    lax.fori_loop(0, l_, clear, 0)

    # Depth 1 (index 0): the top-K in rank order, best first; positions K..B-1 empty (-inf). In rank order the
    # keys are sorted (lax.top_k's order), so it is the running list as it stands (list 0).
    score0 = jnp.where(pos < k_, lp_ref[0, jnp.minimum(pos, k_ - 1)], _NEG_INF)
    score_ref[0, :] = score0
    parent_ref[0, :] = jnp.zeros((bp,), jnp.int32)
    rank_ref[0, :] = pos
    label_ref[...] = pos
    run_key_ref[pl.ds(0, bp)] = total_order_key(score0)
    run_flat_ref[pl.ds(0, bp)] = pos
    barrier()

    run_blocks = bp // block_b

    def deeper_can_enter(d):
        """Whether a prefix deeper than depth d can still enter the running top B (after a barrier): its score is
        at most the depth-d beam's best (log-probs are <= 0) and it loses a tie to the shallower entries, so
        only if that best is above the running list's last entry."""
        return (d + 1 < l_) & (total_order_key(score_ref[d, 0]) > run_key_ref[lax.rem(d, 2) * bp + b_ - 1])

    def load_candidates(q, block, num):
        col = q * block + jnp.arange(block, dtype=jnp.int32)
        ok = col < num
        return (plt.load(cand_score_ref.at[pl.ds(q * block, block)], mask=ok, other=float("nan")),
                plt.load(cand_lex_ref.at[pl.ds(q * block, block)], mask=ok, other=0))

    def blocks(num, block):  # cdiv for a static or traced count
        return cdiv(num, block) if isinstance(num, int) else lax.div(num + block - 1, block)

    def next_depth(carry):
        d, _, *pairs = carry  # pairs: the candidate table, loaded once (hoist_pairs)
        prev, cur = lax.rem(d - 1, 2) * bp, lax.rem(d, 2) * bp  # the running lists read and written
        # 1. Every candidate's score and lexicographic key (parent's label, token rank), in (i, j) order.
        cand = jnp.arange(cp, dtype=jnp.int32)
        cand_ok = cand < c_
        pair_i, pair_j = pairs if hoist_pairs else (pair_ref[0, :], pair_ref[1, :])
        score = score_ref[d - 1, pair_i] + lp_ref[d, jnp.minimum(pair_j, k_ - 1)]  # left to right, as _build_one
        lex = label_ref[pair_i] * k_ + pair_j
        if prune:
            # Two bounds. The running list's last entry: a candidate at or below it can neither enter the list
            # (shallower entries win ties) nor have a descendant that does (log-probs are <= 0, and the list's last
            # only rises), so it is dropped whatever the depth's beam; on a flat depth this keeps none, and the loop
            # stops. And the B-th best candidate scores at least the last of the B children (i, 0) (they all score
            # at least its score: the beam is best first), or with prune 2, where the two keep more than exact_above
            # x B, the B-th best itself. The rest are kept in (i, j) order: every candidate ahead of a kept one is
            # kept, so places and ranks among the kept are those among all (labels only need the order), and a beam
            # row past the kept count stays -inf.
            run_last = run_key_ref[prev + b_ - 1]  # after the previous depth's barrier
            kept = cand_ok & (score >= score_ref[d - 1, b_ - 1] + lp_ref[d, 0])
            if running_bound:
                kept = kept & (total_order_key(score) > run_last)
            if prune == 2:
                def exact(_):  # C >= B real candidates, so the padding's lowest key is never the B-th largest
                    key = jnp.where(cand_ok, total_order_key(score), INT32_MIN)
                    return (key >= kth_largest(key, b_)).astype(jnp.int32)

                kept = kept & (lax.cond(jnp.sum(kept.astype(jnp.int32)) > exact_above * b_, exact,
                                        lambda _: jnp.ones_like(cand), None) != 0)
            flags = kept.astype(jnp.int32)
            slot = jnp.where(kept, jnp.cumsum(flags, axis=0) - flags, cp)
            num = jnp.sum(flags)
            plt.store(cand_score_ref.at[slot], score, mask=kept)
            plt.store(cand_lex_ref.at[slot], lex, mask=kept)
            plt.store(cand_idx_ref.at[slot], (pair_i << 16) | pair_j if hoist_pairs else cand, mask=kept)
        else:
            num = c_
            cand_score_ref[...] = jnp.where(cand_ok, score, jnp.nan)  # a padding candidate is never ahead
            cand_lex_ref[...] = lex
        barrier()

        # 2. Places in (score desc, key asc) order and (high 16 bits of the same sum) ranks in key order, the
        # children's labels; the first B candidates go straight to the new beam's rows, and the running list
        # is merged in the same step: a new entry's place in it is its beam place plus the running entries at
        # or above its key (shallower first on ties; within the beam, key order is place order: scores are
        # log-softmax outputs, so float order is total order), a running entry's its own plus the beam entries
        # above it, min(B, candidates above it) (the beam holds the B best).
        run_key, run_flat = run_key_ref[pl.ds(prev, bp)], run_flat_ref[pl.ds(prev, bp)]

        def place_running(beam_above):
            """The running entries' places in the merged list: their own plus the beam entries above them,
            min(B, candidates above them) [bp] (with prune: the kept ones, which are all the candidates above
            any entry that the B best are not all above)."""
            merged = pos + jnp.minimum(beam_above, b_)
            keep = in_beam & (merged < b_)
            at = jnp.where(keep, cur + merged, 2 * bp)
            plt.store(run_key_ref.at[at], run_key, mask=keep)
            plt.store(run_flat_ref.at[at], run_flat, mask=keep)

        def above_tile(q, cols):  # [bp, block_c] 1 where candidate column q * block_c + c is above running entry
            col_ok = (q * block_c + jnp.arange(block_c, dtype=jnp.int32)) < num
            return ((total_order_key(cols)[None, :] > run_key[:, None]) & col_ok[None, :]).astype(jnp.int32)

        def place_block(r, with_above: bool):
            row_idx = r * block_r + jnp.arange(block_r, dtype=jnp.int32)
            row_ok = row_idx < num
            rows, row_lex = load_candidates(r, block_r, num)

            def body(q, carry):
                acc, cols, col_lex, *above = carry  # above: the running entries' counts, with_above
                upcoming = load_candidates(q + 1, block_c, num)  # issued before the compares: its latency overlaps them
                col_idx = q * block_c + jnp.arange(block_c, dtype=jnp.int32)
                lex_less = (col_lex[None, :] < row_lex[:, None]) & (col_idx < num)[None, :]
                ahead = (cols[None, :] > rows[:, None]) | ((cols[None, :] == rows[:, None]) & lex_less)
                return (acc + ahead.astype(jnp.int32) + (lex_less.astype(jnp.int32) << 16), *upcoming,
                        *[a + above_tile(q, cols) for a in above])

            acc, _, _, *above = lax.fori_loop(
                0, blocks(num, block_c), body,
                (jnp.zeros((block_r, block_c), jnp.int32), *load_candidates(0, block_c, num),
                 *[jnp.zeros((bp, block_c), jnp.int32)] * with_above))
            packed = jnp.sum(acc, axis=1)
            place = packed & 0xFFFF
            keep = row_ok & (place < b_)
            at = jnp.where(keep, place, bp_out)
            depth_at = jnp.full((block_r,), d, jnp.int32)
            if prune:
                idx = plt.load(cand_idx_ref.at[pl.ds(r * block_r, block_r)], mask=row_ok, other=0)
                if hoist_pairs:  # the pair itself was kept: no gather from the table
                    pair_i, pair_j = idx >> 16, idx & 0xFFFF
                else:
                    pair_i, pair_j = pair_ref[0, idx], pair_ref[1, idx]
            else:
                pair_i, pair_j = pair_ref[0, pl.ds(r * block_r, block_r)], pair_ref[1, pl.ds(r * block_r, block_r)]
            plt.store(score_ref.at[depth_at, at], rows, mask=keep)
            plt.store(parent_ref.at[depth_at, at], pair_i, mask=keep)
            plt.store(rank_ref.at[depth_at, at], pair_j, mask=keep)
            plt.store(label_ref.at[at], packed >> 16, mask=keep)
            key = total_order_key(rows)
            if fuse_above:  # the running entries at or above each key, from the list in registers
                merged = place + jnp.sum(((run_key[None, :] >= key[:, None]) & in_beam[None, :]).astype(jnp.int32),
                                         axis=1)
            elif merge_search:  # the list is sorted (keys non-increasing)
                merged = place + count_sorted(lambda m: run_key_ref[prev + m], b_, key, strict=False)
            else:
                merged = place + count_ahead(key, row_idx, run_key_ref, lax.div(prev, block_b),
                                             lax.div(prev, block_b) + run_blocks, block=block_b, num_cols=prev + b_,
                                             tie="always", other=INT32_MIN, masked=True)
            keep = keep & (merged < b_)
            at = jnp.where(keep, cur + merged, 2 * bp)
            plt.store(run_key_ref.at[at], key, mask=keep)
            plt.store(run_flat_ref.at[at], d * b_ + place, mask=keep)
            if with_above:  # the running entries' writes go to other places of the list than the new entries'
                place_running(jnp.sum(above[0], axis=1))

        # No carry: inside the depth loop Triton's lowering cannot yield a literal.
        if fuse_above:  # the first row block runs whatever the count (with none kept it counts none above)
            place_block(0, True)
            lax.fori_loop(1, blocks(num, block_r), lambda r, _: place_block(r, False), None)
        elif merge_search:
            lax.fori_loop(0, blocks(num, block_r), lambda r, _: place_block(r, False), None)
            barrier()  # the beam's rows, best first (-inf past the kept count), for every thread's search
            place_running(count_sorted(lambda m: total_order_key(score_ref[d, m]), b_, run_key, strict=True))
        else:
            lax.fori_loop(0, blocks(num, block_r), lambda r, _: place_block(r, False), None)

            def above(q, acc):
                cols, _ = load_candidates(q, block_c, num)
                return acc + above_tile(q, cols)

            place_running(jnp.sum(lax.fori_loop(0, blocks(num, block_c), above,
                                                jnp.zeros((bp, block_c), jnp.int32)), axis=1))
        barrier()
        return d + 1, deeper_can_enter(d), *pairs

    # Depth after depth while a deeper prefix can still enter (a shallow tree stops early).
    pairs = (pair_ref[0, :], pair_ref[1, :]) if hoist_pairs else ()
    last, *_ = lax.while_loop(lambda carry: carry[1], next_depth, (jnp.int32(1), deeper_can_enter(0), *pairs))
    final = lax.rem(last - 1, 2) * bp  # the running list the last depth wrote

    # Nodes: node n + 1 is the running list's entry n.
    node_ok = in_beam
    flat = run_flat_ref[final + jnp.minimum(pos, b_ - 1)]
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


# ----------------------------------------------------------------------------------------------------
# pallas_call wrapper and public function


@functools.partial(jax.jit, static_argnames=("budget", "config", "interpret", "debug"))
def tree_build_pallas(top_lp, top_tok, root_tokens, *, budget: int, config: TreeBuildConfig | None = None,
                      interpret: bool = False, debug: bool = False) -> BuiltTree:
    """top_lp [b, L, K] float32 and top_tok [b, L, K] int32: every depth's top K = min(B, V) log-probs and
    tokens in rank order (the vocabulary top-k's output); root_tokens [b] int32; budget B (static,
    1 <= B <= MAX_BUDGET). Returns BuiltTree, equal to `ddtree_jax.tree._build_one` vmapped."""
    if not isinstance(budget, int) or isinstance(budget, bool) or not 1 <= budget <= MAX_BUDGET:
        raise ValueError(f"budget={budget!r}: the tree-build kernel takes 1 <= B <= {MAX_BUDGET}")
    config = default_config(budget) if config is None else config
    if top_lp.ndim != 3 or top_tok.shape != top_lp.shape:
        raise ValueError(f"top_lp and top_tok must both be [b, L, K], got {top_lp.shape} and {top_tok.shape}")
    b, depth_limit, k = top_lp.shape
    if k > budget:
        raise ValueError(f"K={k} top entries per depth: must be min(B, V) <= B={budget}")
    if root_tokens.shape != (b,):
        raise ValueError(f"root_tokens must be [b] = ({b},), got {root_tokens.shape}")
    table = candidate_table(budget, k)
    num_pairs = sum(min(k, budget // (i + 1)) for i in range(budget))
    bp, cp, t = next_pow2(budget), table.shape[1], budget + 1
    tp = next_pow2(t)
    kernel = functools.partial(
        _tree_build_kernel, budget=budget, k=k, depth_limit=depth_limit, num_pairs=num_pairs, bp=bp, cp=cp,
        tp=tp, block_c=min(config.block, cp), block_r=min(config.block_rows, cp), block_b=min(config.block, bp),
        block_t=min(config.block, tp), prune=config.prune, exact_above=config.exact_above,
        fuse_above=bool(config.fuse_above), hoist_pairs=bool(config.hoist_pairs) and bool(config.prune),
        running_bound=bool(config.running_bound), merge_search=bool(config.merge_search) and not config.fuse_above,
        interpret=interpret)

    def row(*shape):
        return pl.BlockSpec((None, *shape), lambda i: (i,) + (0,) * len(shape))

    out_dims = [((t,), jnp.int32), ((t,), jnp.int32), ((t,), jnp.int32), ((t,), jnp.bool_), ((t, t), jnp.bool_),
                ((t,), jnp.float32),
                ((depth_limit, bp), jnp.float32), ((depth_limit, bp), jnp.int32), ((depth_limit, bp), jnp.int32),
                ((depth_limit, bp), jnp.int32), ((bp,), jnp.int32), ((cp,), jnp.float32), ((cp,), jnp.int32),
                ((cp,), jnp.int32), ((2 * bp,), jnp.int32), ((2 * bp,), jnp.int32)]
    outs = pl.pallas_call(
        kernel_body(kernel, interpret),
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
