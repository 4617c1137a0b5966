"""The q/k-norm + RoPE kernel and its reference against a float64 NumPy restatement of HF Qwen3's attention
prologue, interpreted on CPU and compiled on a GPU (marked `gpu`)."""

from __future__ import annotations

import functools

import numpy as np
import jax.numpy as jnp
import pytest

from ddtree_jax.config import RopeConfig
from ddtree_jax.models.layers import rope_cos_sin
from pallas_kernels import qk_norm_rope as qk

INTERPRET = [pytest.param(True, id="interpret"), pytest.param(False, id="compiled", marks=pytest.mark.gpu)]
# (rows shape, n KV heads, g query heads per KV head, d, dtype): one AR token of an 8B-like group, a tree's
# 65 tokens of 3 KV heads (not a power of two) with d = 24 (padded).
CASES = [((1, 1), 2, 4, 64, "bfloat16"), ((1, 65), 3, 2, 24, "float32"), ((2, 5), 1, 1, 16, "bfloat16")]
EPS = 1e-6


def _inputs(rows, n, g, d, dtype, seed):
    rng = np.random.default_rng(seed)
    qkv = jnp.asarray(2.0 * rng.standard_normal((*rows, n, g + 2, d)), jnp.float32).astype(dtype)
    q_w = jnp.asarray(1.0 + 0.3 * rng.standard_normal(d), jnp.float32).astype(dtype)
    k_w = jnp.asarray(1.0 + 0.3 * rng.standard_normal(d), jnp.float32).astype(dtype)
    positions = jnp.asarray(rng.integers(0, 4096, size=rows), jnp.int32).reshape(-1, rows[-1])
    cos, sin = rope_cos_sin(positions, RopeConfig(theta=1e6), d)
    return qkv, q_w, k_w, cos.reshape(*rows, d), sin.reshape(*rows, d)


def _float64(qkv, q_w, k_w, cos, sin):
    x = np.asarray(qkv, np.float64)
    c, s = np.asarray(cos, np.float64)[..., None, :], np.asarray(sin, np.float64)[..., None, :]
    d = x.shape[-1]

    def norm_rope(h, w):
        h = h / np.sqrt(np.mean(h * h, axis=-1, keepdims=True) + EPS) * np.asarray(w, np.float64)
        return h * c + np.concatenate([-h[..., d // 2:], h[..., :d // 2]], axis=-1) * s

    q = norm_rope(x[..., :-2, :].reshape(*x.shape[:-3], -1, d), q_w)
    return q, norm_rope(x[..., -2, :], k_w), x[..., -1, :]


@pytest.mark.parametrize("interpret", INTERPRET)
@pytest.mark.parametrize("rows,n,g,d,dtype", CASES, ids=[f"r{c[0]}-n{c[1]}-g{c[2]}-d{c[3]}-{c[4]}" for c in CASES])
def test_matches_float64(rows, n, g, d, dtype, interpret):
    args = _inputs(rows, n, g, d, dtype, seed=n * d)
    want = _float64(*args)
    tol = 1e-5 if dtype == "float32" else 5e-2
    for got in (qk.qk_norm_rope_pallas(*args, eps=EPS, interpret=interpret),
                qk.qk_norm_rope_reference(*args, eps=EPS)):
        for name, a, b in zip("qkv", got, want):
            assert a.shape == b.shape and a.dtype == jnp.dtype(dtype), name
            np.testing.assert_allclose(np.asarray(a, np.float64), b, atol=tol, rtol=tol, err_msg=name)
        np.testing.assert_array_equal(np.asarray(got[2], np.float64), want[2])  # values pass through unchanged


def test_rows_do_not_depend_on_the_call():
    """A token's q, k and v are the same bits alone and among 65 others."""
    qkv, q_w, k_w, cos, sin = _inputs((1, 65), 2, 4, 32, "bfloat16", seed=9)
    full = qk.qk_norm_rope_pallas(qkv, q_w, k_w, cos, sin, eps=EPS, interpret=True)
    one = qk.qk_norm_rope_pallas(qkv[:, 40:41], q_w, k_w, cos[:, 40:41], sin[:, 40:41], eps=EPS, interpret=True)
    for a, b in zip(one, full):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b[:, 40:41]))


def test_check_can_fail():
    """Negative control: swapping the q and k norm weights is caught by the same comparison."""
    qkv, q_w, k_w, cos, sin = _inputs((1, 3), 2, 2, 16, "float32", seed=10)
    want = _float64(qkv, q_w, k_w, cos, sin)
    got = qk.qk_norm_rope_pallas(qkv, k_w, q_w, cos, sin, eps=EPS, interpret=True)
    assert not np.allclose(np.asarray(got[0]), want[0], atol=1e-5, rtol=1e-5)


def test_bad_shapes_say_what_was_expected():
    qkv, q_w, k_w, cos, sin = _inputs((1, 2), 2, 2, 16, "float32", seed=11)
    with pytest.raises(ValueError, match=r"qkv must be \[\.\.\., n, g \+ 2, d\]"):
        qk.qk_norm_rope_reference(qkv[..., :2, :], q_w, k_w, cos, sin, eps=EPS)
    with pytest.raises(ValueError, match=r"q_weight and k_weight must be \[d\]"):
        qk.qk_norm_rope_reference(qkv, q_w[:8], k_w, cos, sin, eps=EPS)
    with pytest.raises(ValueError, match=r"cos and sin must be"):
        qk.qk_norm_rope_reference(qkv, q_w, k_w, cos[:, :1], sin, eps=EPS)


@pytest.mark.parametrize("interpret", INTERPRET)
def test_writes_keys_and_values_into_the_cache(interpret):
    """With the cache given, the kernel also writes each token's key and value at slot starts[row] + token (two
    rows at different starts, one at the cache's end), the rest of the cache untouched, and returns what it
    returns without (the reference does the same with dynamic_update_slice)."""
    rows, n, g, d, s = (2, 3), 2, 2, 16, 11
    qkv, q_w, k_w, cos, sin = _inputs(rows, n, g, d, "bfloat16", seed=12)
    rng = np.random.default_rng(13)
    k_cache = jnp.asarray(rng.standard_normal((2, s, n, d)), jnp.bfloat16)
    v_cache = jnp.asarray(rng.standard_normal((2, s, n, d)), jnp.bfloat16)
    starts = jnp.array([4, s - 3], jnp.int32)
    kernel = functools.partial(qk.qk_norm_rope_pallas, eps=EPS, interpret=interpret)
    reference = functools.partial(qk.qk_norm_rope_reference, eps=EPS)
    for fn in (kernel, reference):
        plain = fn(qkv, q_w, k_w, cos, sin)
        got = fn(qkv, q_w, k_w, cos, sin, k_cache, v_cache, starts)
        for a, b in zip(got[:3], plain):
            np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
        for cache, new, old in ((got[3], plain[1], k_cache), (got[4], plain[2], v_cache)):
            want = np.asarray(old, np.float32).copy()
            for r, at in enumerate(np.asarray(starts)):
                want[r, at:at + rows[1]] = np.asarray(new[r], np.float32)
            np.testing.assert_array_equal(np.asarray(cache, np.float32), want)
    with pytest.raises(ValueError, match="k_cache, v_cache and starts come together"):
        qk.qk_norm_rope_reference(qkv, q_w, k_w, cos, sin, k_cache, None, starts, eps=EPS)
    with pytest.raises(ValueError, match=r"the caches \[b, s >= t, n, d\]"):
        qk.qk_norm_rope_reference(qkv, q_w, k_w, cos, sin, k_cache[:, :2], v_cache[:, :2], starts, eps=EPS)
