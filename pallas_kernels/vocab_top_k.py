"""The top k of every row of a long float32 matrix (a drafter's per-depth log-probs over the vocabulary) in three
launches (Pallas, Triton; four with `threshold_once`), without sorting.

The contract is `lax.top_k` over the last axis as a CPU computes it: the same values, the same int32 indices,
the same order (value desc in XLA's total order of floats, lower index first among equals; on a GPU lax.top_k
with k <= 16 runs a kernel of its own that orders NaNs differently, and log-probabilities hold none). The
reference is a NumPy restatement of that order (tests/kernels/test_vocab_top_k.py), and
`ddtree_jax.tree.threshold_top_k` computes the same thing the same way in XLA operations (about ten launches,
~104-115 us for 15 rows of 151936 on the H200, 2026-12-02).

Letters: r rows, n entries per row, k kept, c chunk (a power of two), N = ceil(n / c) chunks, M candidate
slots, S segment (the entries one program reads), P = ceil(n / S) segments per row. Each row is spread over P
programs, because one program streaming a whole row was latency-bound (one program per row of 151936 took
~140-200 us on the H200: a few loads in flight per multiprocessor). In integer keys (`total_order_key`):

1. `_chunk_max_kernel`, grid (r, P): the maxima of the segment's chunks.
2. `_threshold_kernel`, grid (r,) (knob `threshold_once`; else each segment program of step 3 computes it):
   t = the k-th largest chunk maximum of the row (a 32-step bisection on the key bits over the row's maxima,
   held in registers): k different chunks hold an entry >= t, so every top-k entry is > t or == t.
3. `_compact_kernel`, grid (r, P): the segment's entries > t in index order into its M slots, and the indices
   of its first k entries == t (an exclusive prefix count per step, both counts packed in one int32 scan); with
   `skip_cold` only the chunks whose maximum reaches t are read, a chunk a step.
4. `_select_kernel`, grid (r,): the segments' entries > t gathered densely in segment order (index order
   again) and ranked by (key desc, slot asc), counting over the occupied slots only; the places they leave
   below k go to the row's first entries == t, in index order (they are among the segments' first k).

Exact whenever the entries > t fit: count = #(> t) <= M (ties at t, common when bf16 logits are cast up, take
no slots). The kernel returns the count, and the caller (`ddtree_jax.tree.kernel_top_k`) takes an exact
fallback for the whole batch when a row's count exceeds M (more than M entries crowded above t into fewer
than k chunks). Sizes: `kernel_sizes`.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels._counting import INT32_MIN, count_ahead, from_total_order_key, kth_largest, total_order_key
from pallas_kernels._dispatch import cdiv, check_knobs, next_pow2, resolve_interpret
from pallas_kernels.launch import kernel_body

MAX_K = 512  # the largest budget the tree-build kernel takes (its K = min(B, V)); M = 4 k slots at k >= 128


@dataclasses.dataclass(frozen=True)
class VocabTopKConfig:
    """Tuning knobs of the kernel (static, hashable).

    segment:    entries of a row per program of the two streaming launches (a power of two; rows shorter than
                it take one program). `default_config` chooses it by the row's length.
    step:       entries loaded per step inside a segment (a power of two).
    block:      columns of a counting tile (the selection).
    block_rows: rows of a counting tile.
    num_warps:  Triton's warps per program.
    num_stages: Triton's software pipelining of the streaming loads.
    threshold_once: 1: the threshold in a launch of its own, once per row (grid (r,)), read by the row's
                segment programs; 0: every segment program computes it (no launch, P times the work).
    split_select: 1: the selection over several programs per row (grid (r, M / block_rows)), each ranking one row
                block of the entries above t against all of them (one program per row ranks ~600 entries at
                K = 512, 39 us on the H200); 0: one program per row ranks them all, a row block after another.
    skip_cold:  1: the compaction reads a chunk at a time, only the chunks whose maximum reaches the threshold;
                2: the same chunks, listed first (one pass over the segment's maxima) and gathered `step` entries
                at a time (at K = 512 a segment holds 128 chunks of 64, about a quarter of them hot: one step
                instead of 128 dependent chunk steps); 0: every entry, `step` at a time.
    """

    segment: int = 8192
    step: int = 4096
    block: int = 64
    block_rows: int = 128
    num_warps: int = 8
    num_stages: int = 2
    threshold_once: int = 0
    skip_cold: int = 1
    split_select: int = 0

    def __post_init__(self):
        check_knobs(self, pow2={"segment": 16, "step": 16, "block": 16, "block_rows": 16})
        if self.step > 1 << 14:  # a step's two exclusive counts share one int32 scan (16 bits each)
            raise ValueError(f"VocabTopKConfig.step={self.step!r}: must be at most 16384")
        for name, values in (("threshold_once", (0, 1)), ("skip_cold", (0, 1, 2)), ("split_select", (0, 1))):
            if getattr(self, name) not in values or isinstance(getattr(self, name), bool):
                raise ValueError(f"VocabTopKConfig.{name}={getattr(self, name)!r}: must be one of {values}")


def default_config(n: int, k: int = 1) -> VocabTopKConfig:
    """The knobs for rows of n entries, k kept. Up to 16384 entries: segments of 2048 (a row over more programs: on
    the H200 15 rows of 8192 took 36.5-45.3 against 44.6-49.2 us with 8192, k = 16-64, side by side in one call of
    tools/topk_probe.py, 2026-12-04) and every chunk read (their chunks hold 16-32 entries, too few to skip a
    step's worth: the demo pair's tree rounds at V = 8192 ran 1-6% slower with `skip_cold`). Longer rows (the Qwen
    vocabulary): segments of 8192, the hot chunks listed and gathered 1024 entries a step (`skip_cold=2`), and above
    k = 128 the selection split over row blocks (`split_select`): 15 rows of 151936 with the log-softmax took 56.7 /
    55.6 us at k = 64 (deep / i.i.d. trees' logits) against 60.2 / 58.1 reading hot chunks one at a time, and 73.5 /
    72.3 at k = 512 against 119.0 / 118.2 (split selection alone at k = 64: 59.3 / 58.2, with the gathering 56.8 /
    60.2; an H100, 2026-12-06, docs/performance.md). Earlier, on the H200: skipping cold chunks at all took 77.1 ->
    55.9 us at k = 64; the threshold in its own launch cost more than it saved (60.3 us with both), and searching it
    2 or 4 bits a step saved nothing (a knob removed since; 2026-12-04 evening)."""
    if n <= 16384:
        return VocabTopKConfig(segment=2048, skip_cold=0)
    return VocabTopKConfig(skip_cold=2, step=1024, split_select=int(k > 128))


def kernel_sizes(n: int, k: int) -> tuple[int, int] | None:
    """(chunk c, slots M) for rows of n entries and k kept, or None where the kernel does not apply (k > MAX_K,
    or too short a row for the bound: fewer than max(4 k, 256) entries, or no more entries than slots).
    c: the largest power of two with at least max(4 k, 256) chunks, so that the k-th largest chunk maximum
    sits near the k-th largest entry (about 1.15 k entries of an i.i.d. row are >= it); M (the slots for the
    entries above it) = max(4 k, 512) rounded up to a power of two."""
    slots = next_pow2(max(4 * k, 512))
    if not 1 <= k <= MAX_K or n <= slots or n < max(4 * k, 256):
        return None
    chunk = 1 << ((n // max(4 * k, 256)).bit_length() - 1)
    return chunk, slots


def _segment_keys(x_ref, seg, s, *, n: int, segment: int, step: int):
    """Keys of entries [s * step, (s + 1) * step) of segment `seg` (row indices and validity too); past n the
    lowest key."""
    local = s * step + jnp.arange(step, dtype=jnp.int32)
    idx = seg * segment + local
    ok = idx < n
    v = plt.load(x_ref.at[pl.ds(s * step, step)], mask=ok, other=0.0)
    return idx, ok, jnp.where(ok, total_order_key(v), INT32_MIN)


def _chunk_max_kernel(x_ref, cmax_ref, *, n: int, chunk: int, segment: int, step: int):
    """x_ref [segment] one segment of a row; cmax_ref [segment // chunk] its chunks' maxima."""
    seg = pl.program_id(1)
    per_step = step // chunk

    def body(s, _):
        _, _, key = _segment_keys(x_ref, seg, s, n=n, segment=segment, step=step)
        cmax_ref[pl.ds(s * per_step, per_step)] = jnp.max(key.reshape(per_step, chunk), axis=1)
        return 0

    lax.fori_loop(0, segment // step, body, 0)


def _threshold_kernel(cmax_ref, t_ref, *, k: int, num_chunks: int, chunks_p: int):
    """cmax_ref [chunks_p] a row's chunk maxima (past num_chunks not read) -> t_ref [1] their k-th largest."""
    maxima = plt.load(cmax_ref.at[pl.ds(0, chunks_p)], mask=jnp.arange(chunks_p) < num_chunks, other=INT32_MIN)
    t_ref[0] = kth_largest(maxima, k)


def _compact_kernel(x_ref, cmax_ref, *refs, n: int, k: int, num_chunks: int, chunks_p: int, chunk: int, slots: int,
                    segment: int, step: int, threshold_given: bool, skip_cold: int, interpret: bool):
    """x_ref [segment]; cmax_ref [chunks_p] the row's chunk maxima (past num_chunks not read); refs: t_in_ref [1]
    the row's t where `threshold_given` (`_threshold_kernel`), then the outputs: this segment's entries > t in
    index order, keys and indices (above_key_ref, above_idx_ref [slots]; the first `slots` of them) and their
    count (above_count_ref [1], may exceed slots: the row overflows); the indices of its first k entries == t
    (tie_idx_ref [k]) and its count of them (tie_count_ref [1]); where t is computed here, t (t_ref [1]); with
    skip_cold 2, scratch: hot_ref [segment // chunk] the segment's hot chunks, in order.
    skip_cold: 1: walk the segment a chunk at a time and read only the chunks whose maximum reaches t (about a
    quarter of them at k = 64: no candidate lies in the others); 2: list those chunks first, then gather them
    `step` entries at a time (in chunk order: index order); 0: `step` entries at a time, all of them."""
    seg = pl.program_id(1)
    hot_ref = refs[-1] if skip_cold == 2 else None
    refs = refs[:-1] if skip_cold == 2 else refs
    if threshold_given:
        t_in_ref, above_key_ref, above_idx_ref, tie_idx_ref, above_count_ref, tie_count_ref = refs
        t = t_in_ref[0]
    else:
        above_key_ref, above_idx_ref, tie_idx_ref, above_count_ref, tie_count_ref, t_ref = refs
        maxima = plt.load(cmax_ref.at[pl.ds(0, chunks_p)], mask=jnp.arange(chunks_p) < num_chunks,
                          other=INT32_MIN)
        t = kth_largest(maxima, k)
        t_ref[0] = t

    def compact(s, size, carry):  # entries [s * size, (s + 1) * size) of the segment
        return compact_keys(*_segment_keys(x_ref, seg, s, n=n, segment=segment, step=size), carry)

    def compact_keys(idx, ok, key, carry):  # entries in index order; both exclusive counts in one scan (a step
        above_run, tie_run = carry          # holds at most 2^14 entries)
        above, tie = ok & (key > t), ok & (key == t)
        flags = above.astype(jnp.int32) | (tie.astype(jnp.int32) << 16)
        before = jnp.cumsum(flags, axis=0) - flags
        above_at, tie_at = above_run + (before & 0xFFFF), tie_run + (before >> 16)
        keep = above & (above_at < slots)
        at = jnp.where(keep, above_at, slots)  # masked lanes out of range: the interpreter drops those writes
        plt.store(above_key_ref.at[at], key, mask=keep)
        plt.store(above_idx_ref.at[at], idx, mask=keep)
        keep = tie & (tie_at < k)
        plt.store(tie_idx_ref.at[jnp.where(keep, tie_at, k)], idx, mask=keep)
        return above_run + jnp.sum(above.astype(jnp.int32)), tie_run + jnp.sum(tie.astype(jnp.int32))

    counts = (jnp.int32(0), jnp.int32(0))
    if skip_cold == 2:
        seg_chunks, per_step = segment // chunk, step // chunk
        hot = cmax_ref[pl.ds(seg * seg_chunks, seg_chunks)] >= t  # a chunk below t holds no entry > t or == t
        flags = hot.astype(jnp.int32)
        num_hot = jnp.sum(flags)
        at = jnp.where(hot, jnp.cumsum(flags, axis=0) - flags, seg_chunks)
        plt.store(hot_ref.at[at], jnp.arange(seg_chunks, dtype=jnp.int32), mask=hot)
        if not interpret:  # the interpreter runs a program as one sequential program and has no barrier
            plt.debug_barrier()

        def gathered_step(g, carry):  # hot chunks g * per_step .. (g + 1) * per_step - 1, `chunk` entries each
            lane = jnp.arange(step, dtype=jnp.int32)
            slot = g * per_step + lane // chunk
            listed = slot < num_hot
            local = plt.load(hot_ref.at[jnp.where(listed, slot, 0)], mask=listed, other=0) * chunk + lane % chunk
            idx = seg * segment + local
            ok = listed & (idx < n)
            v = plt.load(x_ref.at[local], mask=ok, other=0.0)
            return compact_keys(idx, ok, jnp.where(ok, total_order_key(v), INT32_MIN), carry)

        above, tie = lax.fori_loop(0, lax.div(num_hot + per_step - 1, per_step), gathered_step, counts)
    elif skip_cold:
        first = seg * (segment // chunk)

        def chunk_step(c, carry):
            hot = cmax_ref[first + c] >= t  # a chunk below t holds no entry > t or == t
            return lax.cond(hot, lambda cr: compact(c, chunk, cr), lambda cr: cr, carry)

        above, tie = lax.fori_loop(0, segment // chunk, chunk_step, counts)
    else:
        above, tie = lax.fori_loop(0, segment // step, lambda s, carry: compact(s, step, carry), counts)
    above_count_ref[0] = above
    tie_count_ref[0] = tie


def _segment_of(j, seg_start, valid):
    """For dense positions j [m] over segments laid end to end (seg_start [P] non-decreasing, valid [P]): the
    segment holding each (the last one starting at or before it: empty segments start where the next does)
    and the position inside it."""
    starts_before = (seg_start[None, :] <= j[:, None]) & valid[None, :]  # [m, P]
    seg = jnp.sum(starts_before.astype(jnp.int32), axis=1) - 1
    return seg, j - jnp.max(jnp.where(starts_before, seg_start[None, :], 0), axis=1)


def _select_kernel(above_key_ref, above_idx_ref, tie_idx_ref, above_count_ref, tie_count_ref, t_ref, values_ref,
                   indices_ref, count_ref, dense_key_ref, dense_idx_ref, *, k: int, slots: int, segments: int,
                   block: int, block_rows: int, split: bool, interpret: bool):
    """The segments' candidates (above_key_ref, above_idx_ref [P, slots], tie_idx_ref [P, k], the counts [next_pow2(P)],
    past P not read, and t_ref [next_pow2(P)] every segment's t, the same, or [1] the row's) -> values_ref [k]
    float32, indices_ref [k] int32, count_ref [1] the row's count of entries > t; scratch (global memory):
    dense_key_ref, dense_idx_ref [slots] (the program's own where `split`). The top k are the entries > t in (key
    desc, index asc) order, then as many of the entries == t as are missing, in index order. split: this program
    (grid axis 1) places row block q only; program 0 also writes the count and the ties' places (every program of
    the row writes places of its own, so none overwrites another's)."""
    segments_p = next_pow2(segments)
    seg_ids = jnp.arange(segments_p, dtype=jnp.int32)
    valid = seg_ids < segments
    above_count = plt.load(above_count_ref.at[pl.ds(0, segments_p)], mask=valid, other=0)
    above_start = jnp.cumsum(above_count, axis=0) - above_count
    total = jnp.sum(above_count)
    used = jnp.minimum(total, slots)
    first = pl.program_id(1) == 0 if split else True

    # The entries > t, densely in segment order (index order again).
    def gather(q):
        j = q * block_rows + jnp.arange(block_rows, dtype=jnp.int32)
        ok = j < used
        seg, pos = _segment_of(j, above_start, valid)
        seg, pos, at = jnp.where(ok, seg, 0), jnp.where(ok, pos, 0), jnp.where(ok, j, slots)
        plt.store(dense_key_ref.at[at], plt.load(above_key_ref.at[seg, pos], mask=ok, other=INT32_MIN), mask=ok)
        plt.store(dense_idx_ref.at[at], plt.load(above_idx_ref.at[seg, pos], mask=ok, other=0), mask=ok)

    # No carry: Triton's lowering of a loop with a traced trip count cannot yield a literal. With split, a program
    # whose row block holds no entry gathers none.
    row_blocks = cdiv(used, block_rows)
    lax.fori_loop(0, jnp.where(pl.program_id(1) < row_blocks, row_blocks, 0) if split else row_blocks,
                  lambda q, _: gather(q), None)
    if not interpret:  # the interpreter runs a program as one sequential program and has no barrier
        plt.debug_barrier()

    # Their first k places (slot order is index order; no entry == t is ahead of one > t).
    def place(q):
        row_idx = q * block_rows + jnp.arange(block_rows, dtype=jnp.int32)
        ok = row_idx < used
        rows = plt.load(dense_key_ref.at[pl.ds(q * block_rows, block_rows)], mask=ok, other=INT32_MIN)
        ahead = count_ahead(rows, row_idx, dense_key_ref, 0, cdiv(used, block), block=block, num_cols=used,
                            tie="index", other=INT32_MIN, masked=True)
        keep = ok & (ahead < k)
        at = jnp.where(keep, ahead, k)
        plt.store(values_ref.at[at], from_total_order_key(rows), mask=keep)
        plt.store(indices_ref.at[at], plt.load(dense_idx_ref.at[pl.ds(q * block_rows, block_rows)], mask=ok,
                                               other=0), mask=keep)

    if split:  # this program's row block, if it holds any entry
        q = pl.program_id(1)
        lax.fori_loop(q, jnp.minimum(q + 1, row_blocks), lambda q, _: place(q), None)
    else:
        lax.fori_loop(0, row_blocks, lambda q, _: place(q), None)

    # The count, and the places left, total..k-1: the first entries == t in index order (each segment kept its
    # first k).
    plt.store(count_ref.at[pl.ds(0, 1)], jnp.full((1,), total, jnp.int32), mask=jnp.full((1,), first))
    k_p = next_pow2(k)
    rank = jnp.arange(k_p, dtype=jnp.int32)
    tie_kept = jnp.minimum(plt.load(tie_count_ref.at[pl.ds(0, segments_p)], mask=valid, other=0), k)
    seg, pos = _segment_of(rank, jnp.cumsum(tie_kept, axis=0) - tie_kept, valid)
    ok = (total + rank < k) & first
    seg, pos, at = jnp.where(ok, seg, 0), jnp.where(ok, pos, 0), jnp.where(ok, total + rank, k)
    t = t_ref[0]
    plt.store(values_ref.at[at], from_total_order_key(jnp.full((k_p,), t, jnp.int32)), mask=ok)
    plt.store(indices_ref.at[at], plt.load(tie_idx_ref.at[seg, pos], mask=ok, other=0), mask=ok)


@functools.partial(jax.jit, static_argnames=("k", "config", "interpret", "debug"))
def vocab_top_k_pallas(x: jax.Array, k: int, *, config: VocabTopKConfig | None = None, interpret: bool = False,
                       debug: bool = False) -> tuple[jax.Array, jax.Array, jax.Array]:
    """x [..., n] float32 (n with `kernel_sizes(n, k)` not None). Returns (values [..., k] float32, indices
    [..., k] int32, count [...] int32): equal to `lax.top_k(x, k)` on every row whose count of entries above
    its threshold is at most M (`kernel_sizes`); a row with more holds garbage, and the caller falls back."""
    config = default_config(x.shape[-1], k) if config is None else config
    n = x.shape[-1]
    sizes = kernel_sizes(n, k)
    if sizes is None:
        raise ValueError(f"vocab_top_k: k={k} over rows of {n}: needs 1 <= k <= {MAX_K} and rows longer than "
                         f"max(4 k, 512)")
    chunk, slots = sizes
    lead = x.shape[:-1]
    rows = x.reshape(-1, n).astype(jnp.float32)
    r = rows.shape[0]

    def row(*shape):  # a row's whole array (in a grid (r, P) whatever the row's program)
        return pl.BlockSpec((None, *shape), lambda i, j=0: (i,) + (0,) * len(shape))

    segment = max(min(config.segment, next_pow2(n)), chunk)
    step = min(max(config.step, chunk), segment)
    segments = cdiv(n, segment)
    seg_chunks = segment // chunk
    num_chunks = segments * seg_chunks  # chunks past n hold only the lowest key
    params = plt.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages)
    x_spec = pl.BlockSpec((None, segment), lambda i, j: (i, j))

    cmax = pl.pallas_call(
        kernel_body(functools.partial(_chunk_max_kernel, n=n, chunk=chunk, segment=segment, step=step), interpret),
        grid=(r, segments), in_specs=[x_spec], out_specs=pl.BlockSpec((None, seg_chunks), lambda i, j: (i, j)),
        out_shape=jax.ShapeDtypeStruct((r, num_chunks), jnp.int32), compiler_params=params, interpret=interpret,
        debug=debug, name="vocab_top_k_chunk_max")(rows)

    chunks_p = next_pow2(num_chunks)
    if config.threshold_once:
        t = pl.pallas_call(
            kernel_body(functools.partial(_threshold_kernel, k=k, num_chunks=num_chunks, chunks_p=chunks_p),
                        interpret),
            grid=(r,), in_specs=[row(chunks_p)], out_specs=row(1), out_shape=jax.ShapeDtypeStruct((r, 1), jnp.int32),
            compiler_params=plt.CompilerParams(num_warps=config.num_warps, num_stages=1), interpret=interpret,
            debug=debug, name="vocab_top_k_threshold")(cmax)

    cand_spec = pl.BlockSpec((None, None, slots), lambda i, j: (i, j, 0))
    one_spec = pl.BlockSpec((None, None, 1), lambda i, j: (i, j, 0))
    per_segment = jax.ShapeDtypeStruct((r, segments, 1), jnp.int32)
    t_out = 0 if config.threshold_once else 1  # the compact's outputs of t (one per segment)
    hot_out = int(config.skip_cold == 2)  # its scratch list of hot chunks (per segment)
    compact = functools.partial(_compact_kernel, n=n, k=k, num_chunks=num_chunks, chunks_p=chunks_p, chunk=chunk,
                                slots=slots, segment=segment, step=step, threshold_given=bool(config.threshold_once),
                                skip_cold=config.skip_cold, interpret=interpret)
    above_key, above_idx, tie_idx, above_count, tie_count, *t_segments = pl.pallas_call(
        kernel_body(compact, interpret),
        grid=(r, segments),
        in_specs=[x_spec, pl.BlockSpec((None, chunks_p), lambda i, j: (i, 0)),
                  *[pl.BlockSpec((None, 1), lambda i, j: (i, 0))] * (1 - t_out)],
        out_specs=[cand_spec, cand_spec, pl.BlockSpec((None, None, k), lambda i, j: (i, j, 0)), one_spec, one_spec,
                   *[one_spec] * t_out, *[pl.BlockSpec((None, None, seg_chunks), lambda i, j: (i, j, 0))] * hot_out],
        out_shape=[jax.ShapeDtypeStruct((r, segments, slots), jnp.int32),
                   jax.ShapeDtypeStruct((r, segments, slots), jnp.int32),
                   jax.ShapeDtypeStruct((r, segments, k), jnp.int32), per_segment, per_segment,
                   *[per_segment] * t_out, *[jax.ShapeDtypeStruct((r, segments, seg_chunks), jnp.int32)] * hot_out],
        compiler_params=params, interpret=interpret, debug=debug, name="vocab_top_k_compact")(
            rows, cmax, *([t] if config.threshold_once else []))
    if t_out:
        t = t_segments[0].reshape(r, segments)

    segments_p = next_pow2(segments)
    block_rows = min(config.block_rows, slots)
    # With split_select a grid (r, M / block_rows): each program its row block, and dense scratch of its own.
    programs = slots // block_rows if config.split_select else 1

    scratch = jax.ShapeDtypeStruct((r, programs, slots), jnp.int32)
    scratch_spec = pl.BlockSpec((None, None, slots), lambda i, j=0: (i, j, 0))
    select = functools.partial(_select_kernel, k=k, slots=slots, segments=segments, block=min(config.block, slots),
                               block_rows=block_rows, split=bool(config.split_select), interpret=interpret)
    values, indices, count, *_ = pl.pallas_call(
        kernel_body(select, interpret),
        grid=(r, programs) if config.split_select else (r,),
        in_specs=[row(segments, slots), row(segments, slots), row(segments, k), row(segments_p), row(segments_p),
                  row(1 if config.threshold_once else segments_p)],
        out_specs=[row(k), row(k), row(1), scratch_spec, scratch_spec],
        out_shape=[jax.ShapeDtypeStruct((r, k), jnp.float32), jax.ShapeDtypeStruct((r, k), jnp.int32),
                   jax.ShapeDtypeStruct((r, 1), jnp.int32), scratch, scratch],
        compiler_params=plt.CompilerParams(num_warps=config.num_warps, num_stages=1), interpret=interpret,
        debug=debug, name="vocab_top_k_select")(above_key, above_idx, tie_idx, *(
            a.reshape(r, segments) for a in (above_count, tie_count)), t)
    return values.reshape(*lead, k), indices.reshape(*lead, k), count.reshape(lead)


def vocab_top_k(x: jax.Array, k: int, *, config: VocabTopKConfig | None = None,
                interpret: bool | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """`vocab_top_k_pallas`, interpreted where there is no GPU (interpret None). Its reference is `lax.top_k`."""
    return vocab_top_k_pallas(x, k, config=config, interpret=resolve_interpret(interpret))
