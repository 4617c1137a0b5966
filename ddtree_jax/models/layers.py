"""Building blocks shared by the Qwen targets and the DFlash drafter.

Weights keep the Hugging Face layout (`[out, in]` for projections, `[v, e]` for embeddings), so names
and arrays map one to one between safetensors and the NNX state, with no transposes. Every parameter
carries `axes` metadata (logical axis names) from which the parallel layer derives partition specs.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from ddtree_jax.models import fp8
from ddtree_jax.models.contract import Runtime
from pallas_kernels.tree_attention import tree_attention

from ddtree_jax.config import RopeConfig

NORMAL_STD = 0.02


def param(rngs: nnx.Rngs | None, shape: tuple[int, ...], dtype, axes: tuple[str | None, ...], init: str,
          groups: int | None = None):
    """A parameter with logical `axes`; `init` is 'normal' (std NORMAL_STD), 'ones' or 'zeros'. `groups`: the
    number of whole heads (or head groups) its tensor-parallel axis is made of, which a split must not cut
    (`parallel.Parallel.param_spec`); None: that axis's own size."""
    if init == "normal":
        value = jax.random.normal(rngs.params(), shape, jnp.float32) * NORMAL_STD
    elif init == "ones":
        value = jnp.ones(shape, jnp.float32)
    else:
        value = jnp.zeros(shape, jnp.float32)
    return nnx.Param(value.astype(dtype), axes=axes, groups=groups)


class Linear(nnx.Module):
    """Bias-free projection with an HF-layout weight `[out, in]`; after `to_fp8`, a block-scaled FP8 one: a
    float8_e4m3fn `weight` and its float32 `weight_scale_inv` [ceil(out / bo), ceil(in / bi)] (`models/fp8.py`),
    dequantised on every call."""

    def __init__(self, in_features: int, out_features: int, axes: tuple[str | None, str | None], *, dtype, rngs,
                 groups: int | None = None):
        self.weight = param(rngs, (out_features, in_features), dtype, axes, "normal", groups)
        self.block = None  # (bo, bi) once FP8

    def to_fp8(self, block: tuple[int, int]) -> None:
        """Quantise the weight in place into FP8 blocks of `block` (random init; shapes for loading)."""
        axes, groups = self.weight.axes, getattr(self.weight, "groups", None)
        weight, scale = fp8.quantize(self.weight[...], block)
        self.weight = nnx.Param(weight, axes=axes, groups=groups)
        self.weight_scale_inv = nnx.Param(scale, axes=fp8.scale_axes(axes, weight.shape, block))
        self.block = tuple(block)

    def dense_weight(self, dtype) -> jax.Array:
        """The weight [out, in] in `dtype` (an FP8 weight dequantised in float32, then cast)."""
        if self.block is None:
            return self.weight[...].astype(dtype)
        return fp8.dequantize(self.weight[...], self.weight_scale_inv[...], self.block, dtype)

    def __call__(self, x: jax.Array) -> jax.Array:
        """x [..., in] -> [..., out] in x's dtype."""
        return jnp.einsum("...i,oi->...o", x, self.dense_weight(x.dtype))


def apply_fp8(module: nnx.Module, config) -> nnx.Module:
    """Make FP8 every `Linear` of `module` that `config.fp8` (a `config.Fp8Config`, or None) converts, by its
    dotted name; returns `module`."""
    if getattr(config, "fp8", None) is None:
        return module
    for path, child in nnx.iter_modules(module):
        if isinstance(child, Linear) and config.fp8.converts(".".join(str(p) for p in path)):
            child.to_fp8(config.fp8.block)
    return module


class Embedding(nnx.Module):
    """Token embedding table `[v, e]`, also usable as a tied output head."""

    def __init__(self, vocab: int, hidden: int, *, dtype, rngs):
        self.weight = param(rngs, (vocab, hidden), dtype, ("vocab", "embed"), "normal")

    def __call__(self, tokens: jax.Array) -> jax.Array:
        """tokens [b, t] int -> [b, t, e]."""
        return jnp.take(self.weight[...], tokens, axis=0)


class RMSNorm(nnx.Module):
    """HF Qwen3 RMSNorm: normalise in float32, cast back, then scale by the weight (init 1)."""

    def __init__(self, dim: int, eps: float, axis_name: str = "embed", *, dtype, rngs=None):
        self.weight = param(rngs, (dim,), dtype, (axis_name,), "ones")
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


def cached_attention(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, cache_lengths: jax.Array,
                     k_new: jax.Array, v_new: jax.Array, new_mask: jax.Array, positions: jax.Array, *, scale: float,
                     sliding_window: int | None = None, runtime: Runtime = Runtime()) -> jax.Array:
    """Attention of new tokens over the committed cache plus the new tokens themselves: the models' one
    call of `pallas_kernels.tree_attention.tree_attention`, whose arguments and result it has (q [b, t, n*g, d],
    K/V cache [b, s, n, d], lengths [b], new K/V [b, t, n, d], new_mask [b, t, t], positions [b, t] ->
    [b, t, n*g, d]). `runtime.kernels` picks the Pallas kernel or its pure-JAX reference (which is the
    models' jnp path, not a copy of it). Under tensor parallelism the kernel runs under `shard_map` on each
    device's own heads (q heads are kv-head-major, so GQA groups stay whole); when the KV heads do not
    divide by the mesh size it runs unsplit. XLA partitions the reference itself.
    """
    implementation = "pallas" if runtime.pallas else "reference"
    attend = functools.partial(tree_attention, scale=scale, sliding_window=sliding_window,
                               implementation=implementation)
    args = (q, k_cache, v_cache, cache_lengths, k_new, v_new, new_mask, positions)
    mesh = runtime.tp_mesh
    if not runtime.pallas or mesh is None or k_cache.shape[2] % mesh.size:
        return attend(*args)
    heads, rep = P(None, None, "model", None), P()
    sharded = jax.shard_map(attend, mesh=mesh, in_specs=(heads, heads, heads, rep, heads, heads, rep, rep),
                            out_specs=heads, check_vma=False)
    return sharded(*args)
