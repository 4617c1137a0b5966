"""The cache's commit of a verification's K/V: the kept nodes land in order after the committed slots."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from ddtree_jax.cache import KVCache, PendingKV, commit_pending, write_pending


def _cache_and_pending():
    cache = KVCache.create(num_layers=2, batch=2, capacity=16, num_kv_heads=1, head_dim=2, dtype=jnp.float32)
    cache = KVCache(k=tuple(x - 1.0 for x in cache.k), v=tuple(x - 2.0 for x in cache.v),
                    lengths=jnp.asarray([5, 3], jnp.int32))
    # Node j of row r, layer l holds 100 r + 10 l + j (K) and its negation (V): 6 nodes.
    node = 100 * np.arange(2)[:, None] + np.arange(6)[None, :]
    k = tuple(jnp.asarray(np.broadcast_to((node + 10 * layer)[:, :, None, None], (2, 6, 1, 2)), jnp.float32)
              for layer in range(2))
    return cache, PendingKV(k=k, v=tuple(-x for x in k))


def test_a_tree_path_lands_in_order_and_counts_commit():
    cache, pending = _cache_and_pending()
    path = jnp.asarray([[0, 2, 5], [0, 1, 1]], jnp.int32)  # row 1: two accepted, padded with its deepest node
    out = commit_pending(cache, pending, jnp.asarray([3, 2]), path)
    np.testing.assert_array_equal(out.lengths, [8, 5])
    for layer in range(2):
        k, v = np.asarray(out.k[layer][..., 0, 0]), np.asarray(out.v[layer][..., 0, 0])
        np.testing.assert_array_equal(k[0, 5:8], [10 * layer + 0, 10 * layer + 2, 10 * layer + 5])
        np.testing.assert_array_equal(k[1, 3:5], [100 + 10 * layer, 100 + 10 * layer + 1])
        np.testing.assert_array_equal(v[0, 5:8], -k[0, 5:8])
        # Slots before each row's length are untouched.
        np.testing.assert_array_equal(k[0, :5], -1.0)
        np.testing.assert_array_equal(v[1, :3], -2.0)


def test_a_chain_writes_its_nodes_in_order():
    cache, pending = _cache_and_pending()
    out = commit_pending(cache, pending, jnp.asarray([2, 6]))
    np.testing.assert_array_equal(out.lengths, [7, 9])
    k = np.asarray(out.k[1][..., 0, 0])
    np.testing.assert_array_equal(k[0, 5:11], 10 + np.arange(6))
    np.testing.assert_array_equal(k[1, 3:9], 110 + np.arange(6))
    np.testing.assert_array_equal(k[1, :3], -1.0)


def test_write_pending_puts_rows_at_each_rows_length_one_row_or_many():
    """One row (a plain dynamic-update-slice) and two rows (vmapped) against NumPy slicing, a start near the end
    clamped so the rows fit (lax.dynamic_update_slice's rule), and a negative control."""
    rng = np.random.default_rng(0)
    cache = rng.standard_normal((2, 10, 2, 3)).astype(np.float32)
    rows = rng.standard_normal((2, 4, 2, 3)).astype(np.float32)
    for lengths, b in (([3], 1), ([8], 1), ([0, 5], 2), ([9, 2], 2)):
        want = cache[:b].copy()
        for r, length in enumerate(lengths):
            start = min(length, 10 - 4)
            want[r, start:start + 4] = rows[r]
        got = write_pending(jnp.asarray(cache[:b]), jnp.asarray(rows[:b]), jnp.asarray(lengths, jnp.int32))
        np.testing.assert_array_equal(np.asarray(got), want)
        assert not np.array_equal(np.asarray(got), cache[:b])
