"""Qwen3 attention's step between the q|k|v projection and the attention, in one kernel (Pallas, Triton):
split the packed projection, RMSNorm every query and key head (`q_norm`, `k_norm`), rotate both (RoPE,
neox halves, the whole head), pass the values through.

XLA ran this as three to five small kernels per layer (a slice, float32 converts, the two norms with their
rotations), about 1.3 us each on the H200: ~0.2 ms of an 8B AR step. One program per token row
here reads its row of the projection once and writes q, k and v. A row's result never depends on the
other rows (greedy equality between AR and a tree verify needs that of every per-token kernel).

Arithmetic as HF's Qwen3 (and `add_rms_norm_reference`'s "qwen3" kind) in x's dtype: normed = w *
(x / rms(x)).astype(dtype), rms over the head in float32; then rotated = normed * cos + rotate_half(normed)
* sin with cos/sin cast to x's dtype first; the products and the sum are taken in float32 and rounded once.

With the KV cache given (`k_cache`, `v_cache` [b, s, n, d] and `starts` [b]), the kernel also writes each
token's key and value into it, at slot starts[b] + its token index, in place (the caches are aliased to two more
outputs): what `lax.dynamic_update_slice` after it did as two more kernels per layer in an AR step. The caller
clamps the starts as that did (a start past s - t is s - t), and reads the committed slots only from the caches
it gets back, so that XLA updates them in place.

Letters: r rows (batch x tokens), b batch, t tokens a row, s cache slots, n KV heads, g query heads per KV head,
u = g + 2 units of d per KV head in the packed projection (g query heads, then the key, then the value), d head
dim (even), hp/np heads padded to powers of two, dp likewise.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels._dispatch import next_pow2, resolve_implementation, resolve_interpret
from pallas_kernels.launch import kernel_body


def _norm_rope(x, x_rot, w, w_rot, cos, sin, *, eps: float, d: int, dtype):
    """x [heads, dp] one row's heads (float32 of x's dtype), x_rot the same at the rotate-half partner
    column, w/w_rot the norm weight there; cos/sin [dp] float32 (sin already signed for rotate_half)."""
    rinv = lax.rsqrt(jnp.sum(x * x, axis=1, keepdims=True) / d + eps)
    normed = (w.astype(dtype) * (x * rinv).astype(dtype)).astype(jnp.float32)
    partner = (w_rot.astype(dtype) * (x_rot * rinv).astype(dtype)).astype(jnp.float32)
    cos = cos.astype(dtype).astype(jnp.float32)
    sin = sin.astype(dtype).astype(jnp.float32)
    return (normed * cos[None, :] + partner * sin[None, :]).astype(dtype)


def _kernel(qkv_ref, qw_ref, kw_ref, cos_ref, sin_ref, *refs, eps: float, n: int, g: int, d: int, t: int,
            s: int | None):
    # qkv_ref [n * u * d] this row's packed projection; q_ref [n * g * d], k_ref/v_ref [n * d]; cos/sin [d]; with
    # the cache (s slots): starts_ref [b], then the caches [b * s, n * d] as inputs (aliased) and as outputs (two
    # dims, so that Pallas takes 64-bit offsets into a large cache).
    if s is None:
        q_ref, k_ref, v_ref = refs
        slot = None
    else:
        starts_ref, _, _, q_ref, k_ref, v_ref, k_cache_ref, v_cache_ref = refs
        row = pl.program_id(0)
        batch_row, token = lax.div(row, jnp.int32(t)), lax.rem(row, jnp.int32(t))
        slot = batch_row * s + starts_ref[batch_row] + token  # this token's row of the caches
    u, dp = g + 2, max(16, next_pow2(d))
    half = d // 2
    col = jnp.arange(dp, dtype=jnp.int32)
    col_ok = col < d
    partner = jnp.where(col < half, col + half, col - half)
    partner = jnp.where(col_ok, partner, 0)
    cos = plt.load(cos_ref.at[col], mask=col_ok, other=0.0)
    sin = plt.load(sin_ref.at[col], mask=col_ok, other=0.0)
    sin = jnp.where(col < half, -sin, sin)  # rotate_half: (-x2, x1)
    dtype = q_ref.dtype

    def heads(count, unit_of, weight_ref, out_ref, cache_ref=None):
        hp = max(2, next_pow2(count))
        head = jnp.arange(hp, dtype=jnp.int32)
        ok = (head < count)[:, None] & col_ok[None, :]
        base = unit_of(jnp.minimum(head, count - 1)) * d
        x = plt.load(qkv_ref.at[base[:, None] + col[None, :]], mask=ok, other=0).astype(jnp.float32)
        x_rot = plt.load(qkv_ref.at[base[:, None] + partner[None, :]], mask=ok, other=0).astype(jnp.float32)
        w = plt.load(weight_ref.at[col], mask=col_ok, other=0)
        w_rot = plt.load(weight_ref.at[partner], mask=col_ok, other=0)
        out = _norm_rope(x, x_rot, w[None, :], w_rot[None, :], cos, sin, eps=eps, d=d, dtype=dtype)
        plt.store(out_ref.at[head[:, None] * d + col[None, :]], out, mask=ok)
        if cache_ref is not None:
            at = head[:, None] * d + col[None, :]
            plt.store(cache_ref.at[jnp.broadcast_to(slot, at.shape), at], out, mask=ok)

    heads(n * g, lambda h: lax.div(h, jnp.int32(g)) * u + lax.rem(h, jnp.int32(g)), qw_ref, q_ref)
    heads(n, lambda h: h * u + g, kw_ref, k_ref, None if s is None else k_cache_ref)
    # Values pass through.
    hp = max(2, next_pow2(n))
    head = jnp.arange(hp, dtype=jnp.int32)
    ok = (head < n)[:, None] & col_ok[None, :]
    v = plt.load(qkv_ref.at[(jnp.minimum(head, n - 1) * u + g + 1)[:, None] * d + col[None, :]], mask=ok, other=0)
    plt.store(v_ref.at[head[:, None] * d + col[None, :]], v, mask=ok)
    if s is not None:
        at = head[:, None] * d + col[None, :]
        plt.store(v_cache_ref.at[jnp.broadcast_to(slot, at.shape), at], v, mask=ok)


@functools.partial(jax.jit, static_argnames=("eps", "num_warps", "interpret"))
def qk_norm_rope_pallas(qkv, q_weight, k_weight, cos, sin, k_cache=None, v_cache=None, starts=None, *, eps: float,
                        num_warps: int = 4, interpret: bool = False) -> tuple[jax.Array, ...]:
    """The Pallas kernel; arguments and result as `qk_norm_rope_reference`."""
    _check(qkv, q_weight, k_weight, cos, sin, k_cache, v_cache, starts)
    *lead, n, u, d = qkv.shape
    g = u - 2
    r = qkv.size // (n * u * d)
    cached = k_cache is not None

    def row(width):
        return pl.BlockSpec((None, width), lambda i: (i, 0))

    def whole(*shape):
        return pl.BlockSpec(shape, lambda i: (0,) * len(shape))

    in_specs = [row(n * u * d), whole(d), whole(d), row(d), row(d)]
    out_specs = [row(n * g * d), row(n * d), row(n * d)]
    out_shape = [jax.ShapeDtypeStruct((r, n * g * d), qkv.dtype), jax.ShapeDtypeStruct((r, n * d), qkv.dtype),
                 jax.ShapeDtypeStruct((r, n * d), qkv.dtype)]
    operands = [qkv.reshape(r, n * u * d), q_weight, k_weight, cos.reshape(r, d).astype(jnp.float32),
                sin.reshape(r, d).astype(jnp.float32)]
    b, s = (k_cache.shape[0], k_cache.shape[1]) if cached else (None, None)
    if cached:
        rows = (b * s, n * d)
        in_specs += [whole(b), whole(*rows), whole(*rows)]
        out_specs += [whole(*rows), whole(*rows)]
        out_shape += [jax.ShapeDtypeStruct(rows, k_cache.dtype)] * 2
        operands += [starts.astype(jnp.int32), k_cache.reshape(rows), v_cache.reshape(rows)]
    kernel = functools.partial(_kernel, eps=float(eps), n=n, g=g, d=d, t=lead[-1] if cached else 1, s=s)
    outs = pl.pallas_call(
        kernel_body(kernel, interpret),
        grid=(r,),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        input_output_aliases={6: 3, 7: 4} if cached else {},
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="qk_norm_rope",
    )(*operands)
    q, k, v = outs[0].reshape(*lead, n * g, d), outs[1].reshape(*lead, n, d), outs[2].reshape(*lead, n, d)
    if not cached:
        return q, k, v
    return q, k, v, outs[3].reshape(k_cache.shape), outs[4].reshape(v_cache.shape)


@functools.partial(jax.jit, static_argnames=("eps",))
def qk_norm_rope_reference(qkv, q_weight, k_weight, cos, sin, k_cache=None, v_cache=None, starts=None, *,
                           eps: float) -> tuple[jax.Array, ...]:
    """qkv [..., n, g + 2, d] the packed projection of some tokens (per KV head: g query heads, the key, the
    value); q_weight/k_weight [d] the q_norm/k_norm weights; cos/sin [..., d] float32 per token (neox halves,
    `models.layers.rope_cos_sin`). Returns q [..., n * g, d] and k [..., n, d], RMS-normed and rotated, and
    v [..., n, d], in qkv's dtype. With k_cache, v_cache [b, s, n, d] and starts [b] int32 (qkv then [b, t, n,
    g + 2, d], starts[r] + t <= s), also the caches with every row's t keys and values written at slots
    [starts[r], starts[r] + t): (q, k, v, k_cache, v_cache)."""
    _check(qkv, q_weight, k_weight, cos, sin, k_cache, v_cache, starts)
    *lead, n, u, d = qkv.shape
    dtype = qkv.dtype

    def norm(x, w):
        x32 = x.astype(jnp.float32)
        return w.astype(dtype) * (x32 * lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)).astype(dtype)

    def rope(x):
        c, s = cos[..., None, :].astype(dtype), sin[..., None, :].astype(dtype)
        return x * c + jnp.concatenate([-x[..., d // 2:], x[..., :d // 2]], axis=-1) * s

    q = rope(norm(qkv[..., :u - 2, :], q_weight).reshape(*lead, n * (u - 2), d))
    k = rope(norm(qkv[..., u - 2, :], k_weight))
    v = qkv[..., u - 1, :]
    if k_cache is None:
        return q, k, v

    def write(cache, rows):
        zero = jnp.zeros((), jnp.int32)
        return jax.vmap(lambda c, x, at: lax.dynamic_update_slice(c, x.astype(c.dtype), (at, zero, zero)))(
            cache, rows, starts.astype(jnp.int32))

    return q, k, v, write(k_cache, k), write(v_cache, v)


def qk_norm_rope(qkv, q_weight, k_weight, cos, sin, k_cache=None, v_cache=None, starts=None, *, eps: float,
                 implementation: str | None = None, interpret: bool | None = None) -> tuple[jax.Array, ...]:
    """Dispatcher: the Pallas kernel on a GPU, the reference elsewhere (see `pallas_kernels.resolve_implementation`)."""
    if resolve_implementation(implementation) == "reference":
        return qk_norm_rope_reference(qkv, q_weight, k_weight, cos, sin, k_cache, v_cache, starts, eps=eps)
    return qk_norm_rope_pallas(qkv, q_weight, k_weight, cos, sin, k_cache, v_cache, starts, eps=eps,
                               interpret=resolve_interpret(interpret))


def _check(qkv, q_weight, k_weight, cos, sin, k_cache=None, v_cache=None, starts=None):
    if qkv.ndim < 3 or qkv.shape[-2] < 3 or qkv.shape[-1] % 2:
        raise ValueError(f"qkv must be [..., n, g + 2, d] with g >= 1 and d even, got {qkv.shape}")
    d = qkv.shape[-1]
    if q_weight.shape != (d,) or k_weight.shape != (d,):
        raise ValueError(f"q_weight and k_weight must be [d] = ({d},), got {q_weight.shape} and {k_weight.shape}")
    if cos.shape != qkv.shape[:-3] + (d,) or sin.shape != cos.shape:
        raise ValueError(f"cos and sin must be [..., d] = {qkv.shape[:-3] + (d,)}, got {cos.shape} and {sin.shape}")
    if (k_cache is None) != (v_cache is None) or (k_cache is None) != (starts is None):
        raise ValueError("k_cache, v_cache and starts come together")
    if k_cache is not None:
        b, t, n = qkv.shape[0], qkv.shape[1], qkv.shape[-3]
        if qkv.ndim != 5 or k_cache.ndim != 4 or k_cache.shape[0] != b or k_cache.shape[2:] != (n, d) \
                or v_cache.shape != k_cache.shape or k_cache.shape[1] < t or starts.shape != (b,):
            raise ValueError(f"with a cache, qkv must be [b, t, n, g + 2, d], the caches [b, s >= t, n, d] and starts "
                             f"[b]; got qkv {qkv.shape}, caches {k_cache.shape} and {v_cache.shape}, starts "
                             f"{starts.shape}")


__all__ = ["qk_norm_rope", "qk_norm_rope_pallas", "qk_norm_rope_reference"]
