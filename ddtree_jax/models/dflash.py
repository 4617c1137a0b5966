"""DFlash block-diffusion drafter (HF `DFlashDraftModel`) as NNX modules and pure functions.

Semantics, as the reference drafter:
- Context features: the target's decoder-layer outputs at `target_layer_ids` (HF `hidden_states[l + 1]`),
  concatenated, then `fc`, then `hidden_norm`.
- In every layer the context enters only as extra K/V through that layer's own `k_proj`/`v_proj`
  (k_norm, RoPE at the context positions); queries come only from the block.
- The block `[bonus, mask x (bs - 1)]` at positions `start .. start + bs - 1` sees all cached context and
  the whole block, or, on causal layers, the block up to itself; sliding windows on absolute positions.
- The drafter's own RoPE theta, full rotary, 1-D positions. Logits for block slots `1 .. bs - 1` through
  the target's `lm_head`; the block embeddings come from the target's `embed_tokens`.

The context K/V do not depend on the block, so they are written to the drafter's cache as soon as the
target has produced them (`ingest_context`); `draft_logits` then reads only cached context plus the
block, and the cache never holds block rows. Parameter names are the checkpoint's ('layers.0.mlp...',
'fc.weight', 'hidden_norm.weight', 'norm.weight').
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from ddtree_jax.cache import KVCache, advance, write_layers
from ddtree_jax.config import DFlashConfig
from ddtree_jax.models import qwen3
from ddtree_jax.models.contract import Runtime
from ddtree_jax.models.layers import (Linear, RMSNorm, add_and_norm, apply_rope, cached_attention, project_qk_norm_rope,
                                      rope_cos_sin)
from ddtree_jax.models.params import ModelParams, abstract_params, random_params


class DFlashDraftModel(nnx.Module):
    """Decoder layers (Qwen3 layout) plus the context fusion `fc` + `hidden_norm` and the final `norm`."""

    def __init__(self, config: DFlashConfig, target_hidden_size: int, *, dtype=jnp.bfloat16, rngs: nnx.Rngs):
        e = config.hidden_size
        taps = len(config.target_layer_ids)
        self.layers = nnx.List([qwen3.DecoderLayer(config, dtype=dtype, rngs=rngs) for _ in range(config.num_layers)])
        self.fc = Linear(taps * target_hidden_size, e, ("embed", "taps"), dtype=dtype, rngs=rngs)
        self.hidden_norm = RMSNorm(e, config.rms_norm_eps, dtype=dtype)
        self.norm = RMSNorm(e, config.rms_norm_eps, dtype=dtype)


def build(config: DFlashConfig, target_hidden_size: int, dtype=jnp.bfloat16):
    return lambda rngs: DFlashDraftModel(config, target_hidden_size, dtype=dtype, rngs=rngs)


def abstract(config: DFlashConfig, target_hidden_size: int, dtype=jnp.bfloat16) -> ModelParams:
    return abstract_params(build(config, target_hidden_size, dtype), config)


def init_random(config: DFlashConfig, target_hidden_size: int, dtype=jnp.bfloat16, seed: int = 0) -> ModelParams:
    return random_params(build(config, target_hidden_size, dtype), config, seed)


def create_cache(config: DFlashConfig, batch: int, capacity: int, dtype) -> KVCache:
    """Context-only K/V: slot j holds the context row of position j."""
    return KVCache.create(config.num_layers, batch, capacity, config.num_kv_heads, config.head_dim, dtype)


def ingest_context(params: ModelParams, taps: jax.Array, counts: jax.Array, cache: KVCache,
                   runtime: Runtime = Runtime(), *, one_launch: bool = False) -> KVCache:
    """Project new context rows into every layer's K/V and commit them.

    Args:
      taps:   [b, c, len(target_layer_ids) * e_target] target taps of the newly committed tokens, in order;
              row r holds `counts[r]` valid rows at positions `cache.lengths[r] + i`.
      counts: [b] int.
      runtime: the static choices of the call (`models.contract.Runtime`); here only FP8 projections read it.
      one_launch: the K/V written by one kernel for every layer (`cache.write_layers`).
    Returns the cache with `counts[r]` more context rows per row.
    """
    config: DFlashConfig = params.config
    model = params.module()
    b, c, _ = taps.shape
    ctx = model.hidden_norm(model.fc(taps.astype(cache.k[0].dtype), runtime))
    positions = cache.lengths[:, None] + jnp.arange(c, dtype=jnp.int32)[None, :]
    cos, sin = rope_cos_sin(positions, config.rope, config.head_dim)
    new_k, new_v = [], []
    for i, layer in enumerate(model.layers):
        attn = layer.self_attn
        # q|k|v are packed; the queries of context rows are not used (a few rows: XLA's cost is the weight pass).
        _, k, v = attn.qkv_proj(ctx, runtime)
        k = attn.k_norm(k.reshape(b, c, -1, config.head_dim))
        v = v.reshape(b, c, -1, config.head_dim)
        new_k.append(apply_rope(k, cos, sin))
        new_v.append(v)
    return advance(write_layers(cache, new_k, new_v, one_launch=one_launch), counts)


def block_mask(batch: int, block_size: int, causal: bool) -> jax.Array:
    """[b, bs, bs] bool: the whole block (non-causal layers) or slots up to the query (causal layers)."""
    mask = jnp.tril(jnp.ones((block_size, block_size), bool)) if causal else jnp.ones((block_size, block_size), bool)
    return jnp.broadcast_to(mask, (batch, block_size, block_size))


def draft_hidden(params: ModelParams, target: ModelParams, block_tokens: jax.Array, cache: KVCache,
                 runtime: Runtime = Runtime()) -> jax.Array:
    """Run the block over the cached context; block_tokens [b, bs] at positions `cache.lengths + i`.

    Returns the final-normed hidden states [b, bs, e] of every block slot (slot 0 included).
    """
    config: DFlashConfig = params.config
    model = params.module()
    b, bs = block_tokens.shape
    h = target.module().model.embed_tokens(block_tokens).astype(cache.k[0].dtype)
    positions = cache.lengths[:, None] + jnp.arange(bs, dtype=jnp.int32)[None, :]
    cos, sin = rope_cos_sin(positions, config.rope, config.head_dim)
    d = config.head_dim
    delta = None  # what the previous layer's MLP adds to the stream: added by the next norm's call
    for i, layer in enumerate(model.layers):
        with jax.named_scope(f"draft_layer_{i}"):
            attn = layer.self_attn
            h, x = add_and_norm(layer.input_layernorm, h, delta, runtime, into=attn.qkv_proj)
            q, k, v = project_qk_norm_rope(attn, x, cos, sin, runtime)
            out = cached_attention(q, cache.k[i], cache.v[i], cache.lengths, k, v,
                                   block_mask(b, bs, config.layer_causal[i]), positions,
                                   scale=d ** -0.5, sliding_window=config.layer_windows[i], runtime=runtime)
            attn_out = attn.o_proj(out.reshape(b, bs, -1), runtime)
            h, x = add_and_norm(layer.post_attention_layernorm, h, attn_out, runtime, into=layer.mlp.gate_up_proj)
            delta = layer.mlp(x, runtime)
    return add_and_norm(model.norm, h, delta, runtime)[1]


def draft_logits(params: ModelParams, target: ModelParams, block_tokens: jax.Array, cache: KVCache,
                 runtime: Runtime = Runtime()) -> jax.Array:
    """float32 logits [b, bs - 1, v] for block slots 1 .. bs - 1 through the target's lm_head."""
    return qwen3.logits(target, draft_hidden(params, target, block_tokens, cache, runtime)[:, 1:], runtime)
