"""Order by counting inside a Triton program: a float's total-order integer key, the k-th largest of a vector
by a bisection on its bits, the count of a block of rows' predecessors among a column array, tile by tile, and
the same count by binary search where the columns are sorted.
Shared by the kernels that rank without sorting (`tree_build`, `vocab_top_k`); the application's own total-order
key is `ddtree_jax.tree.total_order_key` (kernels import nothing from the application, so the two meet in the
tests)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

INT32_MIN = int(np.iinfo(np.int32).min)


def total_order_key(x):
    """float32 -> int32 whose integer order is XLA's total order of floats (-NaN < -inf < ... < -0.0 < +0.0 <
    ... < +inf < +NaN), the order of lax.top_k and sort: non-negative floats keep their bits, negative ones flip
    all but the sign bit. Its own inverse on the bits (`from_total_order_key`)."""
    bits = lax.bitcast_convert_type(x, jnp.int32)
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


def from_total_order_key(key):
    return lax.bitcast_convert_type(key ^ ((key >> 31) & 0x7FFFFFFF), jnp.float32)


def kth_largest(values, k: int):
    """The k-th largest of an int32 vector (with multiplicity; k <= its length), by deciding its bits from the
    top: the largest u (as an unsigned pattern of the sign-flipped key) with at least k values >= it. (Deciding
    2 or 4 bits a step, one 2-D count each, was no faster on the H200: 2026-12-04.)"""
    answer = jnp.int32(0)
    for bit in range(31, -1, -1):
        candidate = answer | jnp.int32(np.int32(np.uint32(1 << bit).view(np.int32)))
        enough = jnp.sum((values >= (candidate ^ INT32_MIN)).astype(jnp.int32)) >= k
        answer = jnp.where(enough, candidate, answer)
    return answer ^ INT32_MIN


def count_ahead(rows, row_idx, col_ref, lo, hi, *, block: int, num_cols, tie: str, other, masked: bool):
    """rows [r] values (row_idx [r] their indices in col_ref's index space); columns: blocks [lo, hi) of
    `block` entries of col_ref [>= hi * block], entries >= num_cols read as `other`. Per row, the number of
    columns ahead of it in (value desc, index asc) order, where a tie counts if `tie` is "always" (every column
    comes first), "never" (every column comes later) or "index" (compare indices). masked: also test
    index < num_cols (for integer values, where `other` may tie). lo, hi and num_cols may be traced."""

    def load(q):
        col_idx = q * block + jnp.arange(block, dtype=jnp.int32)
        return plt.load(col_ref.at[pl.ds(q * block, block)], mask=col_idx < num_cols, other=other)

    def body(q, carry):
        acc, cols = carry
        upcoming = load(q + 1)  # issued before this block's compares use `cols`: its latency overlaps them
        col_idx = q * block + jnp.arange(block, dtype=jnp.int32)
        c, r = cols[None, :], rows[:, None]
        if tie == "always":
            ahead = c >= r
        elif tie == "never":
            ahead = c > r
        else:
            ahead = (c > r) | ((c == r) & (col_idx[None, :] < row_idx[:, None]))
        if masked:
            ahead = ahead & (col_idx < num_cols)[None, :]
        return acc + ahead.astype(jnp.int32), upcoming

    acc, _ = lax.fori_loop(lo, hi, body, (jnp.zeros((rows.shape[0], block), jnp.int32), load(lo)))
    return jnp.sum(acc, axis=1)


def count_sorted(load, n: int, keys, *, strict: bool):
    """keys [r] int32; load(m [r] int32 in [0, n)) -> the keys at positions m of a list of n sorted non-increasing.
    Per key, the number of the list's entries > it (strict) or >= it: a binary search, ceil(log2(n + 1)) dependent
    gathers instead of n compares per key. (Narrowing the count 16- or 32-fold a step, up to 31 independent gathers
    each, took 13-19% longer at B = 512 on deep trees on two H100s, 2026-12-06: the scattered gathers cost more
    than the steps saved. A first step over 16-64 entries shared by all keys, [r, 16-64] compares in registers,
    was slower too.)"""
    count = jnp.zeros_like(keys)
    values = n + 1  # the count lies in [count, count + values)
    while values > 1:
        stride = -(-values // 2)
        pos = count + stride - 1  # if this entry is ahead, so is every one before it (the list is sorted)
        entry, live = load(jnp.minimum(pos, n - 1)), pos < n
        count = count + jnp.where(live & ((entry > keys) if strict else (entry >= keys)), stride, 0)
        values = stride  # past the probe if it is ahead (at most values - stride left), else before it
    return count
