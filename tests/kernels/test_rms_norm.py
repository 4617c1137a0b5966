"""The add + RMSNorm kernel and its reference against a float64 NumPy restatement of HF's RMSNorms, interpreted
on CPU and compiled on a GPU (marked `gpu`)."""

from __future__ import annotations

import functools

import numpy as np
import jax
import jax.numpy as jnp
import pytest

from pallas_kernels import rms_norm as rn

INTERPRET = [pytest.param(True, id="interpret"), pytest.param(False, id="compiled", marks=pytest.mark.gpu)]
# (rows shape, e, dtype, kind, with delta): one AR row, a tree's 65 rows of a width that is not a power of two.
CASES = [((1, 1), 256, "bfloat16", "qwen3", True),
         ((2, 65), 96, "float32", "zero_centered", True),
         ((3,), 160, "bfloat16", "zero_centered", False),
         ((1, 4), 64, "float32", "qwen3", False)]
EPS = 1e-6


def _inputs(rows, e, dtype, seed):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(3.0 * rng.standard_normal((*rows, e)), jnp.float32).astype(dtype)
    delta = jnp.asarray(rng.standard_normal((*rows, e)), jnp.float32).astype(dtype)
    weight = jnp.asarray(1.0 + 0.3 * rng.standard_normal(e), jnp.float32).astype(dtype)
    return x, delta, weight


def _float64(x, delta, weight, kind):
    """HF's arithmetic in float64: the sum, then x / rms(x) scaled by w (qwen3) or (1 + w) (zero_centered)."""
    s = np.asarray(x, np.float64) if delta is None else np.asarray(x + delta, np.float64)  # the add rounds in x's dtype
    normed = s / np.sqrt(np.mean(s * s, axis=-1, keepdims=True) + EPS)
    w = np.asarray(weight, np.float64)
    return s, normed * (w if kind == "qwen3" else 1.0 + w)


@pytest.mark.parametrize("interpret", INTERPRET)
@pytest.mark.parametrize("rows,e,dtype,kind,with_delta", CASES, ids=[f"r{c[0]}-e{c[1]}-{c[2]}-{c[3]}-{c[4]}"
                                                                    for c in CASES])
def test_matches_float64(rows, e, dtype, kind, with_delta, interpret):
    x, delta, weight = _inputs(rows, e, dtype, seed=e)
    delta = delta if with_delta else None
    want_s, want_y = _float64(x, delta, weight, kind)
    tol = 1e-5 if dtype == "float32" else 2e-2
    for s, y in (rn.add_rms_norm_pallas(x, delta, weight, eps=EPS, kind=kind, interpret=interpret),
                 rn.add_rms_norm_reference(x, delta, weight, eps=EPS, kind=kind)):
        assert s.shape == y.shape == x.shape and s.dtype == y.dtype == x.dtype
        np.testing.assert_array_equal(np.asarray(s, np.float64), want_s)  # the add: exact, in x's dtype
        np.testing.assert_allclose(np.asarray(y, np.float64), want_y, atol=tol, rtol=tol)


def test_rows_do_not_depend_on_the_call():
    """A row normalises to the same bits alone and among 65 others (what greedy equality between AR and a tree
    verify needs of it)."""
    x, delta, weight = _inputs((1, 65), 256, "bfloat16", seed=3)
    s_all, y_all = rn.add_rms_norm_pallas(x, delta, weight, eps=EPS, interpret=True)
    s_one, y_one = rn.add_rms_norm_pallas(x[:, 17:18], delta[:, 17:18], weight, eps=EPS, interpret=True)
    np.testing.assert_array_equal(np.asarray(s_one), np.asarray(s_all[:, 17:18]))
    np.testing.assert_array_equal(np.asarray(y_one), np.asarray(y_all[:, 17:18]))


def test_check_can_fail():
    """Negative control: a changed weight entry is caught by the same comparison."""
    x, delta, weight = _inputs((1, 2), 64, "float32", seed=4)
    _, want_y = _float64(x, delta, weight, "qwen3")
    _, got = rn.add_rms_norm_pallas(x, delta, weight.at[5].add(0.5), eps=EPS, interpret=True)
    assert not np.allclose(np.asarray(got), want_y, atol=1e-5, rtol=1e-5)


def test_dispatcher_and_bad_input():
    x, delta, weight = _inputs((2,), 32, "float32", seed=5)
    _, y = rn.add_rms_norm(x, delta, weight, eps=EPS, implementation="reference")
    np.testing.assert_array_equal(np.asarray(y), np.asarray(rn.add_rms_norm_reference(x, delta, weight, eps=EPS)[1]))
    with pytest.raises(ValueError, match="kind='layer'"):
        rn.add_rms_norm_reference(x, delta, weight, eps=EPS, kind="layer")
    with pytest.raises(ValueError, match=r"weight \[e\]"):
        rn.add_rms_norm_reference(x, delta, weight[:16], eps=EPS)
    with pytest.raises(ValueError, match="delta must have x's shape"):
        rn.add_rms_norm_reference(x, delta[:1], weight, eps=EPS)
    with pytest.raises(ValueError, match=r"RMSNormConfig\.num_warps=3"):
        rn.RMSNormConfig(num_warps=3)
    s, _ = jax.jit(lambda a: rn.add_rms_norm(a, None, weight, eps=EPS, implementation="reference"))(x)
    np.testing.assert_array_equal(np.asarray(s), np.asarray(x))  # nothing added: the stream passes through


@pytest.mark.parametrize("interpret", INTERPRET)
@pytest.mark.parametrize("e,dtype,kind", [(384, "bfloat16", "qwen3"), (320, "bfloat16", "zero_centered"),
                                          (128, "float32", "qwen3")])
def test_quantized_rows_are_quantize_rows_of_the_normalised_rows(e, dtype, kind, interpret):
    """`quantize_group`: the normalised rows come back as FP8 codes and a scale per group, the bits of
    `fp8.quantize_rows` on the rows the same kernel normalises (groups of 128 and 64, e not a power of two, rows of
    very different sizes and a zero group), beside the same residual sum; the codes dequantise to the rows within
    half an e4m3 step."""
    from ddtree_jax.models import fp8

    rng = np.random.default_rng(e)
    group = 64 if e == 320 else 128
    x = rng.standard_normal((4, e)) * np.array([[0.01], [1.0], [30.0], [1.0]])
    x[3, :group] = 0.0  # with delta 0 there: a zero group
    x = jnp.asarray(x, dtype)
    delta = jnp.asarray(rng.standard_normal((4, e)), dtype).at[3, :group].set(0)
    weight = jnp.asarray(1.0 + 0.3 * rng.standard_normal(e), dtype)
    call = functools.partial(rn.add_rms_norm_pallas, eps=1e-6, kind=kind, interpret=interpret)
    s, (codes, scales) = call(x, delta, weight, quantize_group=group)
    s_plain, y = call(x, delta, weight)
    assert codes.dtype == jnp.float8_e4m3fn and codes.shape == x.shape and scales.shape == (4, e // group)
    want_codes, want_scales = fp8.quantize_rows(y, group)
    np.testing.assert_array_equal(np.asarray(s, np.float32), np.asarray(s_plain, np.float32))
    np.testing.assert_array_equal(np.asarray(codes, np.float32), np.asarray(want_codes, np.float32))
    np.testing.assert_array_equal(np.asarray(scales), np.asarray(want_scales))
    assert np.asarray(scales)[3, 0] == 1.0 and not np.asarray(codes, np.float32)[3, :group].any()
    step = np.repeat(np.asarray(scales, np.float64), group, axis=1)  # a code's unit in the row's units
    back, y64 = np.asarray(codes, np.float64) * step, np.asarray(y, np.float64)
    # half a step of e4m3: 2^-4 of the value where normal, 2^-10 of the scale among its subnormals
    assert np.all(np.abs(back - y64) <= np.maximum(np.abs(y64) * 2.0 ** -4, step * 2.0 ** -10))
    ref_s, (ref_codes, _) = rn.add_rms_norm_reference(x, delta, weight, eps=1e-6, kind=kind, quantize_group=group)
    assert ref_codes.dtype == jnp.float8_e4m3fn and ref_codes.shape == x.shape
    with pytest.raises(ValueError, match="quantize_group=48: must be a power of two >= 16 dividing"):
        call(x, delta, weight, quantize_group=48)
