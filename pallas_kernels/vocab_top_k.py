"""The top k of every row of a long float32 matrix (a drafter's per-depth log-probs over the vocabulary) in one
launch (Pallas, Triton), without sorting.

The contract is `lax.top_k` over the last axis: the same values, the same int32 indices, the same order (value
desc in XLA's total order of floats, lower index first among equals). `lax.top_k` is this kernel's reference
(tests/kernels/test_vocab_top_k.py), and `ddtree_jax.tree.threshold_top_k` computes the same thing the same way
in XLA operations (about ten launches where this is one; on the H200 the XLA version took ~120 us for 15 rows of
151936, most of it launches and a cumsum over the whole vocabulary).

Letters: r rows, n entries per row, k kept, c chunk (a power of two), N = ceil(n / c) chunks (Np the power of
two at or above), M candidate slots. One program per row (grid (r,)), in integer keys (`total_order_key`):

1. Chunk maxima, one pass over the row in steps of `step` entries ([step // c, c] tiles, reduced along c).
2. t = the k-th largest chunk maximum, by counting (for each maximum, how many are >= it): k different chunks
   hold an entry >= t, so every top-k entry is > t or == t.
3. The candidates, a second pass: every entry > t and the first k entries == t, written in index order into M
   slots (an exclusive prefix count per step, both counts packed in one int32 scan, plus the running totals).
4. The top k of the candidates by (key desc, slot asc), counting over the occupied slots only; slot order is
   index order, so this is lax.top_k's order.

Exact whenever the candidates fit: count = #(> t) + min(#(== t), k) <= M. The kernel returns the count, and
the caller (`ddtree_jax.tree.build_tree`'s "pallas" top-k) takes an exact fallback for the whole batch when a
row's count exceeds M (e.g. more than M - k entries crowded above t into fewer than k chunks). Sizes:
`kernel_sizes`.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels._counting import INT32_MIN, count_ahead, from_total_order_key, total_order_key
from pallas_kernels._dispatch import cdiv, check_knobs, next_pow2, resolve_interpret

MAX_K = 128  # the chunk-maxima count grows as (4 k)^2 per row; larger k stays on the XLA paths


@dataclasses.dataclass(frozen=True)
class VocabTopKConfig:
    """Tuning knobs of the kernel (static, hashable).

    step:       entries of a row loaded per step of the two passes (a power of two, at least the chunk).
    block:      columns of a counting tile (steps 2 and 4).
    block_rows: rows of a counting tile.
    num_warps:  Triton's warps per program (one program per row).
    num_stages: Triton's software pipelining of the passes' loads.
    """

    step: int = 4096
    block: int = 64
    block_rows: int = 128
    num_warps: int = 8
    num_stages: int = 2

    def __post_init__(self):
        check_knobs(self, pow2={"step": 16, "block": 16, "block_rows": 16})


def kernel_sizes(n: int, k: int) -> tuple[int, int] | None:
    """(chunk c, slots M) for rows of n entries and k kept, or None where the kernel does not apply (k > MAX_K,
    or too short a row for the bound: fewer than 4 k chunks of one entry, or no more entries than slots).
    c: the largest power of two with at least max(4 k, 256) chunks, so that the k-th largest chunk maximum
    sits near the k-th largest entry (about 1.15 k entries of an i.i.d. row are >= it); M = max(4 k, 512),
    a power of two for the powers of two k of the engine's budgets."""
    slots = next_pow2(max(4 * k, 512))
    if not 1 <= k <= MAX_K or n <= slots or n < max(4 * k, 256):
        return None
    chunk = 1 << ((n // max(4 * k, 256)).bit_length() - 1)
    return chunk, slots


def _vocab_top_k_kernel(x_ref, values_ref, indices_ref, count_ref, cmax_ref, slot_key_ref, slot_idx_ref, *,
                        n: int, k: int, chunk: int, num_chunks: int, chunks_p: int, slots: int, step: int,
                        block: int, block_rows: int, interpret: bool):
    """x_ref [>= n] float32 one row; values_ref [k] float32, indices_ref [k] int32, count_ref [1] int32;
    scratch (global memory): cmax_ref [chunks_p] int32, slot_key_ref / slot_idx_ref [slots] int32."""

    def barrier():  # the interpreter runs a program as one sequential program and has no barrier
        if not interpret:
            plt.debug_barrier()

    def row_keys(s):  # keys of entries [s * step, (s + 1) * step): past n the lowest key
        idx = s * step + jnp.arange(step, dtype=jnp.int32)
        ok = idx < n
        v = plt.load(x_ref.at[pl.ds(s * step, step)], mask=ok, other=0.0)
        return idx, ok, jnp.where(ok, total_order_key(v), INT32_MIN)

    # 1. Chunk maxima (chunks past N hold only masked entries: the lowest key).
    per_step = step // chunk

    def chunk_max(s, _):
        _, _, key = row_keys(s)
        cmax_ref[pl.ds(s * per_step, per_step)] = jnp.max(key.reshape(per_step, chunk), axis=1)
        return 0

    lax.fori_loop(0, cdiv(chunks_p * chunk, step), chunk_max, 0)

    # Empty slots: the lowest key, after every candidate (they fill slots 0..count-1).
    def clear(q, _):
        slot_key_ref[pl.ds(q * block, block)] = jnp.full((block,), INT32_MIN, jnp.int32)
        slot_idx_ref[pl.ds(q * block, block)] = jnp.zeros((block,), jnp.int32)
        return 0

    lax.fori_loop(0, slots // block, clear, 0)
    barrier()

    # 2. t: the largest chunk maximum with at least k chunk maxima >= it.
    def threshold(q, t):
        row_idx = q * block_rows + jnp.arange(block_rows, dtype=jnp.int32)
        rows = plt.load(cmax_ref.at[pl.ds(q * block_rows, block_rows)], mask=row_idx < num_chunks, other=INT32_MIN)
        at_least = count_ahead(rows, row_idx, cmax_ref, 0, cdiv(num_chunks, block), block=block,
                               num_cols=num_chunks, tie="always", other=INT32_MIN, masked=True)
        return jnp.maximum(t, jnp.max(jnp.where((at_least >= k) & (row_idx < num_chunks), rows, INT32_MIN)))

    t = lax.fori_loop(0, cdiv(num_chunks, block_rows), threshold, jnp.int32(INT32_MIN))

    # 3. Candidates into slots, in index order. Both exclusive counts in one scan (a step holds < 2^15 entries).
    def compact(s, carry):
        above_run, tie_run = carry
        idx, ok, key = row_keys(s)
        above, tie = ok & (key > t), ok & (key == t)
        flags = above.astype(jnp.int32) | (tie.astype(jnp.int32) << 16)
        before = jnp.cumsum(flags, axis=0) - flags
        above_before, tie_before = above_run + (before & 0xFFFF), tie_run + (before >> 16)
        keep = above | (tie & (tie_before < k))
        slot = above_before + jnp.minimum(tie_before, k)
        keep = keep & (slot < slots)
        at = jnp.where(keep, slot, slots)  # masked lanes out of range: the interpreter drops those writes
        plt.store(slot_key_ref.at[at], key, mask=keep)
        plt.store(slot_idx_ref.at[at], idx, mask=keep)
        return above_run + jnp.sum(above.astype(jnp.int32)), tie_run + jnp.sum(tie.astype(jnp.int32))

    above_total, tie_total = lax.fori_loop(0, cdiv(n, step), compact, (jnp.int32(0), jnp.int32(0)))
    count = above_total + jnp.minimum(tie_total, k)
    count_ref[0] = count
    barrier()

    # 4. The first k places among the occupied slots (empty ones are never ahead of an occupied one).
    used = jnp.minimum(count, slots)

    def place(q):
        row_idx = q * block_rows + jnp.arange(block_rows, dtype=jnp.int32)
        ok = row_idx < used
        rows = plt.load(slot_key_ref.at[pl.ds(q * block_rows, block_rows)], mask=ok, other=INT32_MIN)
        ahead = count_ahead(rows, row_idx, slot_key_ref, 0, cdiv(used, block), block=block, num_cols=used,
                            tie="index", other=INT32_MIN, masked=True)
        keep = ok & (ahead < k)
        at = jnp.where(keep, ahead, k)
        plt.store(values_ref.at[at], from_total_order_key(rows), mask=keep)
        plt.store(indices_ref.at[at], plt.load(slot_idx_ref.at[pl.ds(q * block_rows, block_rows)], mask=ok,
                                               other=0), mask=keep)

    # No carry: Triton's lowering of a loop with a traced trip count cannot yield a literal.
    lax.fori_loop(0, cdiv(used, block_rows), lambda q, _: place(q), None)


@functools.partial(jax.jit, static_argnames=("k", "config", "interpret", "debug"))
def vocab_top_k_pallas(x: jax.Array, k: int, *, config: VocabTopKConfig | None = None, interpret: bool = False,
                       debug: bool = False) -> tuple[jax.Array, jax.Array, jax.Array]:
    """x [..., n] float32 (n with `kernel_sizes(n, k)` not None). Returns (values [..., k] float32, indices
    [..., k] int32, count [...] int32): equal to `lax.top_k(x, k)` on every row whose candidate count is at
    most M (`kernel_sizes`); a row with more holds garbage, and the caller falls back."""
    config = VocabTopKConfig() if config is None else config
    n = x.shape[-1]
    sizes = kernel_sizes(n, k)
    if sizes is None:
        raise ValueError(f"vocab_top_k: k={k} over rows of {n}: needs 1 <= k <= {MAX_K} and rows longer than "
                         f"max(4 k, 512)")
    chunk, slots = sizes
    step = max(config.step, chunk)
    lead = x.shape[:-1]
    rows = x.reshape(-1, n).astype(jnp.float32)
    r = rows.shape[0]
    num_chunks = cdiv(n, chunk)
    chunks_p = next_pow2(num_chunks)
    block = min(config.block, slots)
    kernel = functools.partial(
        _vocab_top_k_kernel, n=n, k=k, chunk=chunk, num_chunks=num_chunks, chunks_p=max(chunks_p, step // chunk),
        slots=slots, step=step, block=block, block_rows=min(config.block_rows, slots), interpret=interpret)
    padded_n = cdiv(n, step) * step  # the row's block: loads past n are masked
    cmax_len = max(chunks_p, step // chunk)

    def row(size):
        return pl.BlockSpec((None, size), lambda i: (i, 0))

    values, indices, count, *_ = pl.pallas_call(
        kernel,
        grid=(r,),
        in_specs=[row(padded_n)],
        out_specs=[row(k), row(k), row(1), row(cmax_len), row(slots), row(slots)],
        out_shape=[jax.ShapeDtypeStruct((r, k), jnp.float32), jax.ShapeDtypeStruct((r, k), jnp.int32),
                   jax.ShapeDtypeStruct((r, 1), jnp.int32), jax.ShapeDtypeStruct((r, cmax_len), jnp.int32),
                   jax.ShapeDtypeStruct((r, slots), jnp.int32), jax.ShapeDtypeStruct((r, slots), jnp.int32)],
        compiler_params=plt.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages),
        interpret=interpret,
        debug=debug,
        name="vocab_top_k",
    )(rows)
    return values.reshape(*lead, k), indices.reshape(*lead, k), count.reshape(lead)


def vocab_top_k(x: jax.Array, k: int, *, config: VocabTopKConfig | None = None,
                interpret: bool | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """`vocab_top_k_pallas`, interpreted where there is no GPU (interpret None). Its reference is `lax.top_k`."""
    return vocab_top_k_pallas(x, k, config=config, interpret=resolve_interpret(interpret))
