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

delta may also come as a streamed projection's partial sums over its k splits, not yet added
(`pallas_kernels.stream_matmul.SplitSums`, [s, rp, e] float32 with rp >= r): each program adds its row's s
partials in split order in float32 and rounds once to x's dtype, as `SplitSums.total` does (the same bits),
so that no launch between the projection and this kernel sums them.

Letters: r rows (batch x tokens), e features (the row), ep = e padded to a power of two (masked loads), s splits.
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
from pallas_kernels._rms import KINDS, rms_inverse, scale_rows
from pallas_kernels.stream_matmul import SplitSums, sum_in_split_order


@dataclasses.dataclass(frozen=True)
class RMSNormConfig:
    """Tuning knobs (static, hashable). num_warps, num_stages: Triton's, for one program per row."""

    num_warps: int = 4
    num_stages: int = 1

    def __post_init__(self):
        check_knobs(self, pow2={})


def _scale(s, w, *, eps: float, width: int, kind: str, dtype):
    """The normalisation of float32 rows s [..., e] (padding entries 0) by weight w [e]; result in `dtype`."""
    return scale_rows(s, rms_inverse(s, eps=eps, width=width), w, kind=kind, dtype=dtype)


def _kernel(*refs, eps: float, width: int, padded: int, kind: str, has_delta: bool, delta_splits: int):
    if has_delta:
        x_ref, delta_ref, w_ref, s_ref, y_ref = refs
    else:
        x_ref, w_ref, y_ref = refs
    cols = jnp.arange(padded, dtype=jnp.int32)
    ok = cols < width
    x = plt.load(x_ref.at[pl.ds(0, padded)], mask=ok, other=0)
    dtype = x.dtype
    if has_delta:
        if delta_splits:  # delta_ref [s, e]: this row's partial sums, added in split order (`SplitSums.total`)
            delta = sum_in_split_order([plt.load(delta_ref.at[jnp.int32(s), pl.ds(0, padded)], mask=ok, other=0)
                                        for s in range(delta_splits)]).astype(dtype)
        else:
            delta = plt.load(delta_ref.at[pl.ds(0, padded)], mask=ok, other=0)
        x = (x.astype(jnp.float32) + delta.astype(jnp.float32)).astype(dtype)  # the add in x's dtype, as jnp's
        plt.store(s_ref.at[pl.ds(0, padded)], x, mask=ok)
    w = plt.load(w_ref.at[pl.ds(0, padded)], mask=ok, other=0)
    y = _scale(x.astype(jnp.float32), w, eps=eps, width=width, kind=kind, dtype=dtype)
    plt.store(y_ref.at[pl.ds(0, padded)], y, mask=ok)


@functools.partial(jax.jit, static_argnames=("eps", "kind", "config", "interpret"))
def add_rms_norm_pallas(x, delta, weight, *, eps: float, kind: str = "qwen3", config: RMSNormConfig | None = None,
                        interpret: bool = False) -> tuple[jax.Array, jax.Array]:
    """The Pallas kernel; arguments and result as `add_rms_norm_reference`, plus the knobs."""
    config = RMSNormConfig() if config is None else config
    _check(x, delta, weight, kind)
    shape, e = x.shape, x.shape[-1]
    rows = x.reshape(-1, e)
    r = rows.shape[0]
    has_delta = delta is not None
    row_spec = pl.BlockSpec((None, e), lambda i: (i, 0))
    delta_splits = delta.partials.shape[0] if isinstance(delta, SplitSums) else 0
    if delta_splits:
        delta_in, delta_spec = delta.partials, pl.BlockSpec((delta_splits, None, e), lambda i: (0, i, 0))
    elif has_delta:
        delta_in, delta_spec = delta.reshape(r, e).astype(x.dtype), row_spec
    outs = pl.pallas_call(
        functools.partial(_kernel, eps=float(eps), width=e, padded=max(16, next_pow2(e)), kind=kind,
                          has_delta=has_delta, delta_splits=delta_splits),
        grid=(r,),
        in_specs=[row_spec] + ([delta_spec] if has_delta else []) + [pl.BlockSpec((e,), lambda i: (0,))],
        out_specs=[row_spec] * (2 if has_delta else 1),
        out_shape=[jax.ShapeDtypeStruct((r, e), x.dtype)] * (2 if has_delta else 1),
        compiler_params=plt.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages),
        interpret=interpret,
        name="add_rms_norm",
    )(rows, *([delta_in] if has_delta else []), weight)
    if has_delta:
        return outs[0].reshape(shape), outs[1].reshape(shape)
    return x, outs[0].reshape(shape)


@functools.partial(jax.jit, static_argnames=("eps", "kind"))
def add_rms_norm_reference(x, delta, weight, *, eps: float, kind: str = "qwen3") -> tuple[jax.Array, jax.Array]:
    """x [..., e] the residual stream, delta [..., e] what a block adds to it (None: nothing; or its unsummed
    `SplitSums` [s, rp, e], rp >= the rows of x), weight [e]. Returns (s, y): s = x + delta in x's dtype (x itself
    when delta is None) and y = the RMSNorm of s (`kind`, the module docstring), in x's dtype."""
    _check(x, delta, weight, kind)
    if isinstance(delta, SplitSums):
        delta = delta.total(x.size // x.shape[-1]).reshape(x.shape)
    s = x if delta is None else x + delta.astype(x.dtype)
    s32 = s.astype(jnp.float32)
    rms_inv = lax.rsqrt(jnp.mean(s32 * s32, axis=-1, keepdims=True) + eps)
    if kind == "qwen3":
        return s, weight.astype(x.dtype) * (s32 * rms_inv).astype(x.dtype)
    return s, (s32 * rms_inv * (1.0 + weight.astype(jnp.float32))).astype(x.dtype)


def add_rms_norm(x, delta, weight, *, eps: float, kind: str = "qwen3", implementation: str | None = None,
                 config: RMSNormConfig | None = None, interpret: bool | None = None) -> tuple[jax.Array, jax.Array]:
    """Dispatcher: the Pallas kernel on a GPU, the reference elsewhere (see `pallas_kernels.resolve_implementation`)."""
    if resolve_implementation(implementation) == "reference":
        return add_rms_norm_reference(x, delta, weight, eps=eps, kind=kind)
    return add_rms_norm_pallas(x, delta, weight, eps=eps, kind=kind, config=config,
                               interpret=resolve_interpret(interpret))


def _check(x, delta, weight, kind):
    if kind not in KINDS:
        raise ValueError(f"kind={kind!r}: expected one of {', '.join(KINDS)}")
    if x.ndim < 1 or weight.shape != (x.shape[-1],):
        raise ValueError(f"x must be [..., e] and weight [e], got {x.shape} and {weight.shape}")
    if isinstance(delta, SplitSums):
        parts = delta.partials
        if parts.ndim != 3 or parts.shape[1] < x.size // max(x.shape[-1], 1) or parts.shape[2] != x.shape[-1] \
                or parts.dtype != jnp.float32 or delta.dtype != x.dtype:
            raise ValueError(f"delta's partial sums must be float32 [s, rows >= {x.size // max(x.shape[-1], 1)}, "
                             f"{x.shape[-1]}] rounded to x's {x.dtype}, got {parts.dtype} {parts.shape} rounded "
                             f"to {delta.dtype}")
    elif delta is not None and delta.shape != x.shape:
        raise ValueError(f"delta must have x's shape {x.shape}, got {delta.shape}")


__all__ = ["KINDS", "RMSNormConfig", "add_rms_norm", "add_rms_norm_pallas", "add_rms_norm_reference", "rms_inverse",
           "scale_rows"]
