"""The weight-streaming matmul kernel against a float64 NumPy product, interpreted on CPU and compiled on a GPU."""

from __future__ import annotations

import numpy as np
import jax.numpy as jnp
import pytest

from pallas_kernels import stream_matmul as sm

INTERPRET = [pytest.param(True, id="interpret"), pytest.param(False, id="compiled", marks=pytest.mark.gpu)]
# (t, n, k, dtype, config): one row (AR), a DFlash block, a DDTree tree (odd), explicit and automatic splits.
CASES = [(1, 64, 256, "float32", sm.StreamMatmulConfig(block_n=32, block_k=64, splits=2)),
         (16, 128, 256, "bfloat16", sm.StreamMatmulConfig(block_n=64, block_k=64)),
         (65, 64, 512, "float32", sm.StreamMatmulConfig(block_n=16, block_k=128, splits=4)),
         (5, 48, 128, "bfloat16", sm.StreamMatmulConfig(block_n=16, block_k=32, splits=1))]


def _inputs(t, n, k, dtype, seed):
    rng = np.random.default_rng(seed)
    return (jnp.asarray(rng.standard_normal((t, k)), jnp.float32).astype(dtype),
            jnp.asarray(rng.standard_normal((n, k)) / np.sqrt(k), jnp.float32).astype(dtype))


@pytest.mark.parametrize("interpret", INTERPRET)
@pytest.mark.parametrize("t,n,k,dtype,config", CASES, ids=[f"t{c[0]}-n{c[1]}-k{c[2]}-{c[3]}" for c in CASES])
def test_matches_float64_product(t, n, k, dtype, config, interpret):
    x, w = _inputs(t, n, k, dtype, seed=t + n + k)
    want = np.asarray(x, np.float64) @ np.asarray(w, np.float64).T
    got = sm.stream_matmul_pallas(x, w, config=config, interpret=interpret)
    assert got.shape == (t, n) and got.dtype == jnp.dtype(dtype)
    tol = 1e-5 if dtype == "float32" else 2e-2
    np.testing.assert_allclose(np.asarray(got, np.float64), want, atol=tol, rtol=tol)
    ref = sm.stream_matmul_reference(x, w)
    np.testing.assert_allclose(np.asarray(ref, np.float64), want, atol=tol, rtol=tol)


def test_check_can_fail():
    """Negative control: a product with one weight row changed is caught by the same comparison."""
    x, w = _inputs(3, 32, 64, "float32", seed=1)
    want = np.asarray(x, np.float64) @ np.asarray(w, np.float64).T
    got = sm.stream_matmul_pallas(x, w.at[7, 5].add(0.5), config=sm.StreamMatmulConfig(block_n=16, block_k=32),
                                  interpret=True)
    assert not np.allclose(np.asarray(got), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("field,value", [("block_n", 8), ("block_k", 48), ("splits", 0), ("num_warps", 3),
                                         ("num_stages", 0)])
def test_bad_config_names_the_value(field, value):
    with pytest.raises(ValueError, match=rf"StreamMatmulConfig\.{field}={value!r}"):
        sm.StreamMatmulConfig(**{field: value})


def test_bad_shapes_say_what_was_expected():
    x, w = _inputs(2, 32, 64, "float32", seed=2)
    with pytest.raises(ValueError, match=r"x must be \[t, k\]"):
        sm.stream_matmul_reference(x, w[:, :32])
    with pytest.raises(ValueError, match="block_k"):
        sm.stream_matmul_pallas(x, w, config=sm.StreamMatmulConfig(block_k=128), interpret=True)
