"""Building blocks shared by the Qwen targets and the DFlash drafter.

Weights keep the Hugging Face layout (`[out, in]` for projections, `[v, e]` for embeddings), so names
and arrays map one to one between safetensors and the NNX state, with no transposes. Every parameter
carries `axes` metadata (logical axis names) from which the parallel layer derives partition specs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from ddtree_jax.config import RopeConfig

NORMAL_STD = 0.02


def _param(rngs: nnx.Rngs | None, shape: tuple[int, ...], dtype, axes: tuple[str | None, ...], init: str):
    """A parameter with logical `axes`; `init` is 'normal' (std NORMAL_STD), 'ones' or 'zeros'."""
    if init == "normal":
        value = jax.random.normal(rngs.params(), shape, jnp.float32) * NORMAL_STD
    elif init == "ones":
        value = jnp.ones(shape, jnp.float32)
    else:
        value = jnp.zeros(shape, jnp.float32)
    return nnx.Param(value.astype(dtype), axes=axes)


class Linear(nnx.Module):
    """Bias-free projection with an HF-layout weight `[out, in]`."""

    def __init__(self, in_features: int, out_features: int, axes: tuple[str | None, str | None], *, dtype, rngs):
        self.weight = _param(rngs, (out_features, in_features), dtype, axes, "normal")

    def __call__(self, x: jax.Array) -> jax.Array:
        """x [..., in] -> [..., out] in x's dtype."""
        return jnp.einsum("...i,oi->...o", x, self.weight[...].astype(x.dtype))


class Embedding(nnx.Module):
    """Token embedding table `[v, e]`, also usable as a tied output head."""

    def __init__(self, vocab: int, hidden: int, *, dtype, rngs):
        self.weight = _param(rngs, (vocab, hidden), dtype, ("vocab", "embed"), "normal")

    def __call__(self, tokens: jax.Array) -> jax.Array:
        """tokens [b, t] int -> [b, t, e]."""
        return jnp.take(self.weight[...], tokens, axis=0)


class RMSNorm(nnx.Module):
    """HF Qwen3 RMSNorm: normalise in float32, cast back, then scale by the weight (init 1)."""

    def __init__(self, dim: int, eps: float, axis_name: str = "embed", *, dtype, rngs=None):
        self.weight = _param(rngs, (dim,), dtype, (axis_name,), "ones")
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return self.weight[...].astype(x.dtype) * normed.astype(x.dtype)


class SwiGLU(nnx.Module):
    """Qwen MLP: down(silu(gate(x)) * up(x))."""

    def __init__(self, hidden: int, intermediate: int, *, dtype, rngs):
        self.gate_proj = Linear(hidden, intermediate, ("mlp", "embed"), dtype=dtype, rngs=rngs)
        self.up_proj = Linear(hidden, intermediate, ("mlp", "embed"), dtype=dtype, rngs=rngs)
        self.down_proj = Linear(intermediate, hidden, ("embed", "mlp"), dtype=dtype, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


def rope_cos_sin(positions: jax.Array, rope: RopeConfig, rotary_dim: int) -> tuple[jax.Array, jax.Array]:
    """positions [b, t] int -> cos, sin [b, t, rotary_dim] float32 (halves repeated, neox style), both times
    the rope's attention factor (YaRN's; 1 otherwise), as transformers scales them."""
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(rope.inv_freq(rotary_dim))
    angles = jnp.concatenate([angles, angles], axis=-1)
    return jnp.cos(angles) * rope.attention_factor, jnp.sin(angles) * rope.attention_factor


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x [b, t, heads, d]; rotate the pairs (i, i + d/2) (HF `rotate_half`). cos/sin [b, t, d] float32.

    cos/sin are cast to x's dtype first, as HF does, so bf16 runs round the same way.
    """
    cos, sin = cos[:, :, None, :].astype(x.dtype), sin[:, :, None, :].astype(x.dtype)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rotated * sin


def cached_attention(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    cache_lengths: jax.Array,
    k_new: jax.Array,
    v_new: jax.Array,
    new_mask: jax.Array,
    positions: jax.Array,
    *,
    scale: float,
    sliding_window: int | None = None,
    kernels: str = "jax",
) -> jax.Array:
    """Attention of new tokens over the committed cache plus the new tokens themselves.

    kernels "jax" runs the pure-JAX path below; "pallas" the tree-attention kernel of
    `pallas_kernels.tree_attention`, which meets the same contract (interpreted where there is no GPU);
    ("pallas", mesh) runs that kernel under `shard_map` on each device's own heads of a tp mesh.

    Args:
      q:             [b, t, n*g, d] queries of the new tokens (RoPE applied).
      k_cache, v_cache: [b, s, n, d] committed K/V; slot j holds position j.
      cache_lengths: [b] int, committed slots per row; slots >= length are ignored.
      k_new, v_new:  [b, u=t, n, d] K/V of the new tokens (RoPE applied).
      new_mask:      [b, t, u] bool, which new tokens each new token sees (causal for a prompt or a chain,
                     the ancestor mask for a tree; padding rows see only themselves).
      positions:     [b, t] int, the new tokens' positions (for the sliding window).
      scale:         softmax scale, head_dim ** -0.5 for Qwen.
      sliding_window: keys with `query_pos - key_pos >= window` are hidden, as in HF.
    Returns:
      [b, t, n*g, d] in q's dtype. Scores and softmax are float32.
    """
    impl, mesh = (kernels, None) if isinstance(kernels, str) else kernels
    if impl == "pallas":
        return _pallas_attention(q, k_cache, v_cache, cache_lengths, k_new, v_new, new_mask, positions,
                                 scale=scale, sliding_window=sliding_window, tp_mesh=mesh)
    b, t, hq, d = q.shape
    s, n = k_cache.shape[1], k_cache.shape[2]
    qg = q.reshape(b, t, n, hq // n, d)
    f32 = jnp.float32
    scores_cache = jnp.einsum("btngd,bsnd->bngts", qg, k_cache, preferred_element_type=f32) * scale
    scores_new = jnp.einsum("btngd,bund->bngtu", qg, k_new, preferred_element_type=f32) * scale

    slots = jnp.arange(s)
    visible_cache = jnp.broadcast_to(slots[None, None, :] < cache_lengths[:, None, None], (b, t, s))
    visible_new = new_mask
    if sliding_window is not None:
        visible_cache = visible_cache & (positions[:, :, None] - slots[None, None, :] < sliding_window)
        # |distance|: a non-causal block also hides keys more than a window ahead (as the reference).
        visible_new = visible_new & (jnp.abs(positions[:, :, None] - positions[:, None, :]) < sliding_window)

    scores = jnp.concatenate([scores_cache, scores_new], axis=-1)
    visible = jnp.concatenate([visible_cache, visible_new], axis=-1)[:, None, None]
    scores = jnp.where(visible, scores, -jnp.inf)
    # A row that sees nothing (never the case for valid tokens) gets zeros instead of NaNs.
    probs = jax.nn.softmax(scores, axis=-1, where=visible)
    probs = jnp.where(visible, probs, 0.0)
    out = jnp.einsum("bngts,bsnd->btngd", probs[..., :s].astype(v_cache.dtype), v_cache, preferred_element_type=f32)
    out = out + jnp.einsum("bngtu,bund->btngd", probs[..., s:].astype(v_new.dtype), v_new, preferred_element_type=f32)
    return out.reshape(b, t, hq, d).astype(q.dtype)


def _pallas_attention(q, k_cache, v_cache, cache_lengths, k_new, v_new, new_mask, positions, *, scale: float,
                      sliding_window: int | None, tp_mesh=None) -> jax.Array:
    """The Pallas tree-attention kernel; on a tp mesh, under shard_map over the local heads.

    Heads split over the mesh axis 'model' for q [b, t, hq, d] and K/V [b, s|t, n, d]; lengths, mask and
    positions are replicated. GQA groups stay whole because query heads are kv-head-major. When the KV
    heads do not divide by the mesh size, the kernel runs unsplit.
    """
    import functools

    from pallas_kernels.tree_attention import tree_attention_pallas

    kernel = functools.partial(tree_attention_pallas, scale=scale, sliding_window=sliding_window,
                               interpret=jax.default_backend() != "gpu")
    if tp_mesh is None or k_cache.shape[2] % tp_mesh.size:
        return kernel(q, k_cache, v_cache, cache_lengths, k_new, v_new, new_mask, positions)
    from jax.sharding import PartitionSpec as P

    heads, rep = P(None, None, "model", None), P()
    sharded = jax.shard_map(kernel, mesh=tp_mesh, in_specs=(heads, heads, heads, rep, heads, heads, rep, rep),
                            out_specs=heads, check_vma=False)
    return sharded(q, k_cache, v_cache, cache_lengths, k_new, v_new, new_mask, positions)
