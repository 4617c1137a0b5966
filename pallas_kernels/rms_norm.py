"""The residual add and the RMSNorm after it, in one kernel (Pallas, Triton): s = x + delta, y = norm(s).

Every decoder layer adds its attention and its MLP output into the residual stream and normalises the sum
for the next block. XLA ran that as two kernels for several rows (the add, then a Triton normalisation
fusion) and three for one row (the add, a full reduction, the scaling), about 1.4 us each on the H200:
~0.2 ms of an 8B AR step. Here one program per token row loads the row once, writes the sum and the
normalised row, and computes both exactly as the plain-jnp restatement `add_rms_norm_reference` does,
except for the order of the float32 sum of squares (a row's result never depends on the other rows, so a
token normalises the same way whether the call holds 1 row or 65).

Two scalings (HF's):
- "qwen3" (`Qwen3RMSNorm`): y = w * (s / rms(s)).astype(dtype), the product in x's dtype;
- "zero_centered" (`Qwen3_5RMSNorm`): y = (s / rms(s) * (1 + w)).astype(dtype), all in float32.
with rms(s) = sqrt(mean(s^2) + eps) over the row, in float32.

With `quantize_group` = g the normalised row comes back as FP8 W8A8 rows instead: float8_e4m3fn codes [..., e] and
float32 scales [..., e / g], one a group of g features (`stream_matmul.quantize_groups`), the bits of
`ddtree_jax.models.fp8.quantize_rows` on the normalised row, so that the FP8 projection after the norm streams them
as given (`stream_matmul`'s `x_scale`) instead of quantising each step's row tile itself.

Letters: r rows (batch x tokens), e features (the row), ep = e padded to a power of two (masked loads).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels._dispatch import check_knobs, next_pow2, resolve_implementation, resolve_interpret
from pallas_kernels.launch import kernel_body
from pallas_kernels.stream_matmul import quantize_groups

KINDS = ("qwen3", "zero_centered")  # HF's two RMSNorm scalings (`_scale`)


@dataclasses.dataclass(frozen=True)
class RMSNormConfig:
    """Tuning knobs (static, hashable). num_warps, num_stages: Triton's, for one program per row."""

    num_warps: int = 4
    num_stages: int = 1

    def __post_init__(self):
        check_knobs(self, pow2={})


def _scale(s, w, *, eps: float, width: int, kind: str, dtype):
    """The normalisation of float32 rows s [..., e] (padding entries 0; `width` the real e) by weight w [e], as HF
    scales, in `dtype`: with r = 1 / sqrt(mean(s^2) + eps), "qwen3" (`Qwen3RMSNorm`) w * (s * r).astype(dtype), the
    product in `dtype`; "zero_centered" (`Qwen3_5RMSNorm`) (s * r * (1 + w)).astype(dtype), all in float32."""
    rms_inv = lax.rsqrt(jnp.sum(s * s, axis=-1, keepdims=True) / width + eps)
    if kind == "qwen3":
        return (w.astype(dtype) * (s * rms_inv).astype(dtype)).astype(dtype)
    return (s * rms_inv * (1.0 + w.astype(jnp.float32))).astype(dtype)


def _bfloat16_bits(y32):
    """float32 values rounded to bfloat16's (to nearest, ties to even; finite values) by integer ops, still float32:
    a bfloat16 -> float32 conversion that XLA may not drop (XLA's CPU compiler, interpreting a kernel, may skip the
    rounding of a bfloat16 value it keeps in float32 within a fusion; Triton keeps it)."""
    bits = lax.bitcast_convert_type(y32, jnp.uint32)
    bits = (bits + jnp.uint32(0x7FFF) + ((bits >> 16) & jnp.uint32(1))) & jnp.uint32(0xFFFF0000)
    return lax.bitcast_convert_type(bits, jnp.float32)


def _fp8_rows(y, group: int):
    """Normalised rows y [..., e] in their dtype -> `stream_matmul.quantize_groups` of them (codes, scales): the
    bits of `quantize_rows` on y, its bfloat16 rounding made explicit (`_bfloat16_bits`)."""
    y32 = y.astype(jnp.float32)
    return quantize_groups(_bfloat16_bits(y32) if y.dtype == jnp.bfloat16 else y32, group)


def _kernel(*refs, eps: float, width: int, padded: int, kind: str, has_delta: bool, group: int | None):
    if has_delta:
        x_ref, delta_ref, w_ref, s_ref, *y_refs = refs
    else:
        x_ref, w_ref, *y_refs = refs
    cols = jnp.arange(padded, dtype=jnp.int32)
    ok = cols < width
    x = plt.load(x_ref.at[pl.ds(0, padded)], mask=ok, other=0)
    dtype = x.dtype
    if has_delta:
        delta = plt.load(delta_ref.at[pl.ds(0, padded)], mask=ok, other=0)
        x = (x.astype(jnp.float32) + delta.astype(jnp.float32)).astype(dtype)  # the add in x's dtype, as jnp's
        plt.store(s_ref.at[pl.ds(0, padded)], x, mask=ok)
    w = plt.load(w_ref.at[pl.ds(0, padded)], mask=ok, other=0)
    y = _scale(x.astype(jnp.float32), w, eps=eps, width=width, kind=kind, dtype=dtype)
    if group is None:
        plt.store(y_refs[0].at[pl.ds(0, padded)], y, mask=ok)
        return
    codes, scales = _fp8_rows(y, group)  # padding groups (past e) are zeros: scale 1, never stored
    plt.store(y_refs[0].at[pl.ds(0, padded)], codes, mask=ok)
    groups = jnp.arange(padded // group, dtype=jnp.int32)
    plt.store(y_refs[1].at[pl.ds(0, padded // group)], scales, mask=groups < width // group)


@functools.partial(jax.jit, static_argnames=("eps", "kind", "quantize_group", "config", "interpret"))
def add_rms_norm_pallas(x, delta, weight, *, eps: float, kind: str = "qwen3", quantize_group: int | None = None,
                        config: RMSNormConfig | None = None, interpret: bool = False):
    """The Pallas kernel; arguments and result as `add_rms_norm_reference`, plus the knobs."""
    config = RMSNormConfig() if config is None else config
    _check(x, delta, weight, kind, quantize_group)
    shape, e = x.shape, x.shape[-1]
    rows = x.reshape(-1, e)
    r = rows.shape[0]
    has_delta = delta is not None
    row_spec = pl.BlockSpec((None, e), lambda i: (i, 0))
    out_specs = [row_spec] * has_delta + [row_spec]
    out_shape = [jax.ShapeDtypeStruct((r, e), x.dtype)] * has_delta
    if quantize_group is None:
        out_shape.append(jax.ShapeDtypeStruct((r, e), x.dtype))
    else:  # the normalised row as FP8 codes and each group's scale
        out_specs.append(pl.BlockSpec((None, e // quantize_group), lambda i: (i, 0)))
        out_shape += [jax.ShapeDtypeStruct((r, e), jnp.float8_e4m3fn),
                      jax.ShapeDtypeStruct((r, e // quantize_group), jnp.float32)]
    kernel = functools.partial(_kernel, eps=float(eps), width=e, padded=max(16, next_pow2(e)), kind=kind,
                               has_delta=has_delta, group=quantize_group)
    outs = pl.pallas_call(
        kernel_body(kernel, interpret),
        grid=(r,),
        in_specs=[row_spec] * (1 + has_delta) + [pl.BlockSpec((e,), lambda i: (0,))],
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=plt.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages),
        interpret=interpret,
        name="add_rms_norm" + ("_fp8" if quantize_group else ""),
    )(rows, *([delta.reshape(r, e).astype(x.dtype)] if has_delta else []), weight)
    s = outs[0].reshape(shape) if has_delta else x
    normed = outs[has_delta:]
    if quantize_group is None:
        return s, normed[0].reshape(shape)
    return s, (normed[0].reshape(shape), normed[1].reshape(*shape[:-1], e // quantize_group))


@functools.partial(jax.jit, static_argnames=("eps", "kind", "quantize_group"))
def add_rms_norm_reference(x, delta, weight, *, eps: float, kind: str = "qwen3", quantize_group: int | None = None):
    """x [..., e] the residual stream, delta [..., e] what a block adds to it (None: nothing), weight [e].
    Returns (s, y): s = x + delta in x's dtype (x itself when delta is None) and y = the RMSNorm of s (`kind`, the
    module docstring), in x's dtype; with `quantize_group`, y as FP8 rows instead: (codes [..., e], scales
    [..., e / quantize_group]), `_fp8_rows`."""
    _check(x, delta, weight, kind, quantize_group)
    s = x if delta is None else x + delta.astype(x.dtype)
    s32 = s.astype(jnp.float32)
    rms_inv = lax.rsqrt(jnp.mean(s32 * s32, axis=-1, keepdims=True) + eps)
    if kind == "qwen3":
        y = weight.astype(x.dtype) * (s32 * rms_inv).astype(x.dtype)
    else:
        y = (s32 * rms_inv * (1.0 + weight.astype(jnp.float32))).astype(x.dtype)
    return s, (y if quantize_group is None else _fp8_rows(y, quantize_group))


def add_rms_norm(x, delta, weight, *, eps: float, kind: str = "qwen3", quantize_group: int | None = None,
                 implementation: str | None = None, config: RMSNormConfig | None = None, interpret: bool | None = None):
    """Dispatcher: the Pallas kernel on a GPU, the reference elsewhere (see `pallas_kernels.resolve_implementation`)."""
    if resolve_implementation(implementation) == "reference":
        return add_rms_norm_reference(x, delta, weight, eps=eps, kind=kind, quantize_group=quantize_group)
    return add_rms_norm_pallas(x, delta, weight, eps=eps, kind=kind, quantize_group=quantize_group, config=config,
                               interpret=resolve_interpret(interpret))


def _check(x, delta, weight, kind, quantize_group=None):
    if kind not in KINDS:
        raise ValueError(f"kind={kind!r}: expected one of {', '.join(KINDS)}")
    if quantize_group is not None and (quantize_group < 16 or quantize_group & (quantize_group - 1)
                                       or x.shape[-1] % quantize_group):
        raise ValueError(f"quantize_group={quantize_group}: must be a power of two >= 16 dividing the row's "
                         f"{x.shape[-1]} features")
    if x.ndim < 1 or weight.shape != (x.shape[-1],):
        raise ValueError(f"x must be [..., e] and weight [e], got {x.shape} and {weight.shape}")
    if delta is not None and delta.shape != x.shape:
        raise ValueError(f"delta must have x's shape {x.shape}, got {delta.shape}")


__all__ = ["KINDS", "RMSNormConfig", "add_rms_norm", "add_rms_norm_pallas", "add_rms_norm_reference"]
