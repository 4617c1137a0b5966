"""The vocabulary top-k kernel against its reference, lax.top_k's order on a CPU (NumPy here): the same values (bit
for bit, in XLA's total order of floats) and the same indices in the same order, over rows with ties within and
across chunks, -inf, a row of only -inf, a row of one value, signed zeros, +-inf and NaN, at k = 16, 64, 128 and
512 (the tree-build kernel's largest budget) and row lengths that are not multiples of the kernel's step; and the
candidate count that tells the caller to fall back.

Every test runs interpreted on CPU and compiled on a GPU (marked `gpu`, skipped without one).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import _counting as counting
from pallas_kernels import vocab_top_k as vtk

INTERPRET = [pytest.param(True, id="interpret"), pytest.param(False, id="compiled", marks=pytest.mark.gpu)]


def rows_with_ties(n: int, seed: int) -> np.ndarray:
    """[2, 4, n] float32: row 0 normal draws with a block of exact ties across chunk borders; row 1 a few levels
    (ties everywhere, nine at the top), then rows of only -inf, of one value, and of signed zeros, +-inf, NaN."""
    rng = np.random.default_rng(seed)
    x = np.empty((2, 4, n), np.float32)
    x[0] = rng.standard_normal((4, n)) * 3
    x[0, 1, n // 3: n // 3 + 200] = x[0, 1, n // 3]
    x[1] = rng.integers(0, 6, size=(4, n))
    x[1][rng.random((4, n)) < 0.3] = -np.inf
    x[1, 0] = rng.integers(0, 5, size=n)
    x[1, 0, rng.choice(n, size=9, replace=False)] = 5  # fewer than k at the top: tied entries above the threshold
    x[1, 1] = -np.inf
    x[1, 2] = 1.5
    x[1, 3] = rng.choice(np.array([0.0, -0.0, np.inf, -np.inf, np.nan, -np.nan, 1.0], np.float32), size=n)
    return x


def top_k_in_total_order(x: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """NumPy: the k first entries of each row in (value desc in XLA's total order of floats, index asc) order, the
    order of lax.top_k on a CPU and of XLA's sort. (On a GPU lax.top_k with k <= 16 runs a kernel of its own whose
    order of NaNs differs, so the reference is this.)"""
    bits = x.view(np.int32).astype(np.int64)
    key = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # the total order as integers
    flat_key, flat_x = key.reshape(-1, x.shape[-1]), x.reshape(-1, x.shape[-1])
    index = np.stack([np.lexsort((np.arange(x.shape[-1]), -row))[:k] for row in flat_key])
    values = np.take_along_axis(flat_x, index, axis=1)
    return values.reshape(*x.shape[:-1], k), index.reshape(*x.shape[:-1], k).astype(np.int32)


def assert_is_lax_top_k(x, k, values, indices):
    want_values, want_indices = top_k_in_total_order(x, k)
    as_bits = lambda v: np.asarray(v).view(np.int32)  # NaN and signed zeros compared bit for bit
    np.testing.assert_array_equal(as_bits(values), as_bits(want_values))
    np.testing.assert_array_equal(np.asarray(indices), want_indices)


def test_reference_is_lax_top_k_on_the_cpu():
    """The NumPy reference agrees with lax.top_k where that follows the total order (the CPU), NaNs included."""
    x = rows_with_ties(600, 1)
    for k in (5, 64):
        want_values, want_indices = jax.lax.top_k(jax.device_put(jnp.asarray(x), jax.devices("cpu")[0]), k)
        values, indices = top_k_in_total_order(x, k)
        np.testing.assert_array_equal(values.view(np.int32), np.asarray(want_values).view(np.int32))
        np.testing.assert_array_equal(indices, np.asarray(want_indices))


# The defaults (`default_config`: segments of 2048 and every chunk read up to 16384 entries; above, segments of 8192,
# the hot chunks gathered 1024 entries a step, and at k > 128 the selection split over row blocks) and small segments (a row over many programs, each streaming several steps; the row's first
# k ties spread over segments) with the threshold in its own launch and cold chunks skipped, and with the hot chunks
# listed and gathered a step at a time (8-32 chunks a step here, several steps where k is large), ranked by a program
# per row block of 64 (several blocks at every k here, and programs with none).
CONFIGS = [pytest.param(None, id="default"),
           pytest.param(vtk.VocabTopKConfig(segment=1024, step=256, threshold_once=1, skip_cold=1),
                        id="small"),
           pytest.param(vtk.VocabTopKConfig(segment=1024, step=256, skip_cold=2, split_select=1, block_rows=64),
                        id="gathered-split")]


def test_kth_largest():
    """The threshold's search against NumPy's sort: int32 keys across the whole range (both extremes, negatives
    whose unsigned patterns sort above the positives', many equal values), k from 1 to all."""
    rng = np.random.default_rng(1)
    info = np.iinfo(np.int32)
    values = np.concatenate([rng.integers(info.min, info.max, 200, endpoint=True, dtype=np.int32),
                             np.array([info.min, info.min, info.max, -1, 0, 0, 1], np.int32),
                             np.full(49, 12345, np.int32)])
    rng.shuffle(values)
    descending = np.sort(values)[::-1]
    for k in (1, 2, 3, 40, 120, 200, len(values)):
        assert int(jax.jit(counting.kth_largest, static_argnums=1)(jnp.asarray(values), k)) == descending[k - 1], k


@pytest.mark.parametrize("interpret", INTERPRET)
@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("n,k", [(8192, 16), (5003, 64), (20000, 128), (30011, 512)])
def test_equals_lax_top_k(n, k, config, interpret):
    x = rows_with_ties(n, n + k)
    values, indices, count = vtk.vocab_top_k(jnp.asarray(x), k, config=config, interpret=interpret)
    chunk, slots = vtk.kernel_sizes(n, k)
    assert count.shape == x.shape[:-1] and np.all(np.asarray(count) <= slots)  # no row took garbage
    assert_is_lax_top_k(x, k, values, indices)


@pytest.mark.parametrize("interpret", INTERPRET)
@pytest.mark.parametrize("config", CONFIGS)
def test_overflowing_row_is_reported(config, interpret):
    """Row 1 holds 1000 large entries in 32 consecutive chunks (fewer than k = 64 chunks): more than M of them lie
    above the 64th largest chunk maximum, so its count exceeds the slots (the caller's signal to fall back); row 0
    still comes out exact."""
    n, k = 8192, 64
    chunk, slots = vtk.kernel_sizes(n, k)
    rng = np.random.default_rng(3)
    x = rng.standard_normal((2, n)).astype(np.float32)
    x[1, 512:512 + 1000] = 10 + rng.standard_normal(1000)
    assert 1000 // chunk < k
    values, indices, count = vtk.vocab_top_k(jnp.asarray(x), k, config=config, interpret=interpret)
    assert int(count[0]) <= slots < int(count[1])
    assert_is_lax_top_k(x[:1], k, values[:1], indices[:1])


def test_sizes_and_bad_arguments():
    assert vtk.kernel_sizes(151936, 64) == (512, 512)  # 297 chunks >= 4 k: the bound's margin
    assert vtk.kernel_sizes(151936, 128) == (256, 512)
    assert vtk.kernel_sizes(8192, 16) == (32, 512)
    assert vtk.kernel_sizes(151936, 256) == (128, 1024) and vtk.kernel_sizes(151936, 512) == (64, 2048)
    assert vtk.kernel_sizes(512, 16) is None and vtk.kernel_sizes(151936, vtk.MAX_K + 1) is None
    assert vtk.kernel_sizes(2048, 512) is None  # no more entries than the 2048 slots
    with pytest.raises(ValueError, match=f"k={vtk.MAX_K + 1}"):
        vtk.vocab_top_k(jnp.zeros((1, 151936)), vtk.MAX_K + 1, interpret=True)
    with pytest.raises(ValueError, match="VocabTopKConfig.step"):
        vtk.VocabTopKConfig(step=1000)
    with pytest.raises(ValueError, match="VocabTopKConfig.step=32768: must be at most 16384"):
        vtk.VocabTopKConfig(step=32768)
    with pytest.raises(ValueError, match=r"VocabTopKConfig.threshold_once=2: must be one of \(0, 1\)"):
        vtk.VocabTopKConfig(threshold_once=2)
    with pytest.raises(ValueError, match=r"VocabTopKConfig.skip_cold=3: must be one of \(0, 1, 2\)"):
        vtk.VocabTopKConfig(skip_cold=3)
