"""Qwen3 dense target (HF `model_type: qwen3`) as Flax NNX modules and a pure forward function.

The module tree mirrors HF's `Qwen3ForCausalLM`, so the NNX state path of every parameter is its HF
safetensors name ('model.layers.3.self_attn.k_norm.weight', ...), except q|k|v and gate|up, each packed into
one weight (`layers.PackedProjections`; `ModelParams.flat` gives the HF tensors). The modules hold parameters
and do the arithmetic of one call; the decode loop, sampling and cache commits live in the engine.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from ddtree_jax.cache import KVCache, PendingKV, write_pending
from ddtree_jax.config import Qwen3Config
from ddtree_jax.models.contract import ForwardMeta, ForwardOut, Runtime
from ddtree_jax.models.layers import (Embedding, Linear, PackedProjections, Part, RMSNorm, SwiGLU, add_and_norm,
                                      cached_attention, fuses_kv_write, linear, project_qk_norm_rope,
                                      rope_cos_sin)
from ddtree_jax.models.params import ModelParams, abstract_params, random_params

RECURRENT = False  # attention only: the cache is a KVCache


class Attention(nnx.Module):
    """GQA self-attention with per-head q_norm/k_norm before RoPE; q|k|v packed by KV-head group."""

    def __init__(self, config: Qwen3Config, *, dtype, rngs):
        e, d = config.hidden_size, config.head_dim
        h, n = config.num_heads, config.num_kv_heads
        parts = (Part("q_proj", h // n, ("q_heads", "embed"), h), Part("k_proj", 1, ("kv_heads", "embed"), n),
                 Part("v_proj", 1, ("kv_heads", "embed"), n))
        self.qkv_proj = PackedProjections(e, n, d, parts, ("kv_heads", None, None, "embed"), dtype=dtype, rngs=rngs)
        self.o_proj = Linear(h * d, e, ("embed", "q_heads"), dtype=dtype, rngs=rngs, groups=h)
        self.q_norm = RMSNorm(d, config.rms_norm_eps, "head_dim", dtype=dtype)
        self.k_norm = RMSNorm(d, config.rms_norm_eps, "head_dim", dtype=dtype)
        self.head_dim = d

    def __call__(self, x, cos, sin, k_cache, v_cache, cache_lengths, meta: ForwardMeta, *,
                 sliding_window: int | None, runtime: Runtime, write_starts: jax.Array | None = None):
        """x [b, t, e], cos/sin [b, t, d] -> (out [b, t, e], k_new [b, t, n, d], v_new [b, t, n, d], written):
        written None, or where `write_starts` [b] is given and `fuses_kv_write`, the caches (k, v [b, s, n, d])
        with the new K/V written at slots [write_starts, write_starts + t) by the q/k-norm-RoPE kernel (the
        attention then reads the committed slots from them: the caches are updated in place)."""
        b, t, _ = x.shape
        d = self.head_dim
        written = None
        if write_starts is not None and fuses_kv_write(self, runtime):
            q, k, v, k_cache, v_cache = project_qk_norm_rope(self, x, cos, sin, runtime,
                                                             cache=(k_cache, v_cache, write_starts))
            written = (k_cache, v_cache)
        else:
            q, k, v = project_qk_norm_rope(self, x, cos, sin, runtime)
        out = cached_attention(q, k_cache, v_cache, cache_lengths, k, v, meta.new_mask, meta.positions,
                               scale=d ** -0.5, sliding_window=sliding_window, runtime=runtime)
        return self.o_proj(out.reshape(b, t, -1), runtime), k, v, written


class DecoderLayer(nnx.Module):
    def __init__(self, config: Qwen3Config, *, dtype, rngs):
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype)
        self.self_attn = Attention(config, dtype=dtype, rngs=rngs)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype)
        self.mlp = SwiGLU(config.hidden_size, config.intermediate_size, dtype=dtype, rngs=rngs)


class Qwen3Model(nnx.Module):
    def __init__(self, config: Qwen3Config, *, dtype, rngs):
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size, dtype=dtype, rngs=rngs)
        self.layers = nnx.List([DecoderLayer(config, dtype=dtype, rngs=rngs) for _ in range(config.num_layers)])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype)


class Qwen3ForCausalLM(nnx.Module):
    def __init__(self, config: Qwen3Config, *, dtype=jnp.bfloat16, rngs: nnx.Rngs):
        self.model = Qwen3Model(config, dtype=dtype, rngs=rngs)
        if not config.tie_word_embeddings:
            self.lm_head = Linear(config.hidden_size, config.vocab_size, ("vocab", "embed"), dtype=dtype, rngs=rngs)


def build(config: Qwen3Config, dtype=jnp.bfloat16):
    return lambda rngs: Qwen3ForCausalLM(config, dtype=dtype, rngs=rngs)


def abstract(config: Qwen3Config, dtype=jnp.bfloat16) -> ModelParams:
    return abstract_params(build(config, dtype), config)


def init_random(config: Qwen3Config, dtype=jnp.bfloat16, seed: int = 0) -> ModelParams:
    return random_params(build(config, dtype), config, seed)


def create_cache(config: Qwen3Config, batch: int, capacity: int, dtype) -> KVCache:
    return KVCache.create(config.num_layers, batch, capacity, config.num_kv_heads, config.head_dim, dtype)


def forward(params: ModelParams, tokens: jax.Array, meta: ForwardMeta, cache: KVCache, *,
            tap_layers: tuple[int, ...] = (), runtime: Runtime = Runtime()) -> ForwardOut:
    """Run the target on new tokens (the family contract, `models/contract.py`).

    tokens [b, t] int; meta: positions and the new tokens' mask (`valid` does not matter to an attention-only
    model: every token sees the committed cache and the new tokens its mask allows; `parents` given, a tree,
    the new K/V come back as `ForwardOut.pending` instead of written into the cache);
    cache: committed K/V; tap_layers: decoder layer ids whose outputs to return (static).
    """
    config: Qwen3Config = params.config
    model = params.module()
    check_tap_layers(tap_layers, config.num_layers)
    x = model.model.embed_tokens(tokens)
    cos, sin = rope_cos_sin(meta.positions, config.rope, config.head_dim)
    new_k, new_v, written, taps = [], [], [], {}
    # Where the rows go in the caches (a call that writes them): `write_pending`'s slots, clamped as it clamps.
    starts = None if meta.is_tree else jnp.minimum(cache.lengths, cache.capacity - tokens.shape[1]).astype(jnp.int32)
    delta = None  # what the previous layer's MLP adds to the stream: added by the next norm's call
    for i, layer in enumerate(model.model.layers):
        with jax.named_scope(f"layer_{i}"):
            x, h = add_and_norm(layer.input_layernorm, x, delta, runtime, into=layer.self_attn.qkv_proj)
            if i - 1 in tap_layers:
                taps[i - 1] = x
            attn_out, k, v, caches = layer.self_attn(h, cos, sin, cache.k[i], cache.v[i], cache.lengths, meta,
                                                     sliding_window=config.sliding_windows[i], runtime=runtime,
                                                     write_starts=starts)
            x, h = add_and_norm(layer.post_attention_layernorm, x, attn_out, runtime, into=layer.mlp.gate_up_proj)
            delta = layer.mlp(h, runtime)
        new_k.append(k)
        new_v.append(v)
        written.append(caches)
    x, hidden = add_and_norm(model.model.norm, x, delta, runtime)
    if config.num_layers - 1 in tap_layers:
        taps[config.num_layers - 1] = x
    tapped = jnp.concatenate([taps[i] for i in tap_layers], axis=-1) if tap_layers else None
    if meta.is_tree:  # the round writes the nodes it keeps
        return ForwardOut(hidden=hidden, taps=tapped, cache=cache, pending=PendingKV(k=tuple(new_k), v=tuple(new_v)))
    new_k = [w[0] if w else write_pending(layer, rows, cache.lengths) for layer, rows, w in zip(cache.k, new_k, written)]
    new_v = [w[1] if w else write_pending(layer, rows, cache.lengths) for layer, rows, w in zip(cache.v, new_v, written)]
    return ForwardOut(hidden=hidden, taps=tapped, cache=dataclasses.replace(cache, k=tuple(new_k), v=tuple(new_v)))


def check_tap_layers(tap_layers: tuple[int, ...], num_layers: int) -> None:
    for layer_id in tap_layers:
        if not 0 <= layer_id < num_layers:
            raise ValueError(f"tap layer {layer_id} is outside 0..{num_layers - 1}")


def logits(params: ModelParams, hidden: jax.Array, runtime: Runtime = Runtime()) -> jax.Array:
    """hidden [..., e] -> float32 logits [..., v] through lm_head (or the tied embedding), multiplied as
    `layers.linear` says."""
    model = params.module()
    if params.config.tie_word_embeddings:
        weight = model.model.embed_tokens.weight[...].astype(hidden.dtype)
    else:
        weight = model.lm_head.dense_weight(hidden.dtype)
    return linear(hidden, weight, runtime, out_dtype=jnp.float32, lm_head=True)
