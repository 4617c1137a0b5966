"""Static-capacity KV cache with per-row lengths.

A forward pass writes the K/V of its `t` new tokens into slots `[length, length + t)` of every row
("pending" rows) and leaves `lengths` alone; the caller then decides how many of them to keep
(`advance`). Slots at or beyond a row's length are free and hold garbage that later writes overwrite,
so a rejected draft needs no clean-up. Capacity must cover `length + t` for every call: the engine sizes
it as prompt + new tokens + the widest call, rounded up to a bucket.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    """K/V for every attention layer of one model.

    Fields:
      k, v:    per layer, device [b, s, n, d] in the model's dtype; slot j holds position j.
      lengths: device [b] int32, committed tokens per row.
    """

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]
    lengths: jax.Array

    @classmethod
    def create(cls, num_layers: int, batch: int, capacity: int, num_kv_heads: int, head_dim: int, dtype) -> "KVCache":
        shape = (batch, capacity, num_kv_heads, head_dim)
        zeros = tuple(jnp.zeros(shape, dtype) for _ in range(num_layers))
        return cls(k=zeros, v=tuple(jnp.zeros(shape, dtype) for _ in range(num_layers)),
                   lengths=jnp.zeros((batch,), jnp.int32))

    @property
    def batch(self) -> int:
        return self.lengths.shape[0]

    @property
    def capacity(self) -> int:
        return self.k[0].shape[1]


def write_pending(layer_cache: jax.Array, rows: jax.Array, lengths: jax.Array) -> jax.Array:
    """Write rows [b, t, n, d] into layer_cache [b, s, n, d] at slots [lengths[r], lengths[r] + t) per row."""
    def one_row(cache_row, new_row, start):
        return jax.lax.dynamic_update_slice(cache_row, new_row.astype(cache_row.dtype), (start, 0, 0))

    return jax.vmap(one_row)(layer_cache, rows, lengths)


def advance(cache: KVCache, counts: jax.Array) -> KVCache:
    """Commit the first `counts[r]` pending rows of each row r (counts [b] int)."""
    return dataclasses.replace(cache, lengths=cache.lengths + counts.astype(jnp.int32))


def commit_path(cache: KVCache, path: jax.Array, counts: jax.Array) -> KVCache:
    """Keep an accepted tree path: the pending rows at slots `lengths + path[r, i]` move to
    `lengths + i`, and `counts[r]` of them are committed.

    path [b, P] int32 node indices by depth (root first), counts [b]. Path indices never decrease and
    path[i] >= i (parents precede children), and every row is gathered before any is written, so the
    move is safe in place. Example: length 5, path [0 2 5] -> slots 5, 7, 10 move to 5, 6, 7.
    """
    rows = (cache.lengths[:, None] + path)[:, :, None, None]  # [b, P, 1, 1]

    def move(layer):
        kept = jnp.take_along_axis(layer, rows, axis=1)  # [b, P, n, d]
        return write_pending(layer, kept, cache.lengths)

    return KVCache(k=tuple(move(k) for k in cache.k), v=tuple(move(v) for v in cache.v),
                   lengths=cache.lengths + counts.astype(jnp.int32))


# ----------------------------------------------------------------------------------------------------
# Hybrid targets (Qwen3.5/3.6): recurrent state of the Gated DeltaNet layers beside the KV cache.


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RecurrentState:
    """The state of one Gated DeltaNet layer after the committed tokens of each row.

    Fields:
      state: device [b, Hv, Dk, Dv] float32, the delta-rule memory (read as `state^T k`).
      conv:  device [b, C, K - 1] in the model's dtype, the last K - 1 inputs of the depthwise causal
             conv (C = conv channels = 2 * key dim + value dim, K = conv kernel), oldest first; zeros
             before any token.
    """

    state: jax.Array
    conv: jax.Array

    @classmethod
    def create(cls, batch: int, num_value_heads: int, key_head_dim: int, value_head_dim: int, conv_dim: int,
               conv_kernel: int, dtype) -> "RecurrentState":
        return cls(state=jnp.zeros((batch, num_value_heads, key_head_dim, value_head_dim), jnp.float32),
                   conv=jnp.zeros((batch, conv_dim, conv_kernel - 1), dtype))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class HybridCache:
    """Caches of a hybrid target: K/V of its full-attention layers and states of its linear layers.

    Fields:
      kv:        KVCache with one layer per full-attention layer (config.attention_layers order); its
                 `lengths` are the committed tokens of each row for the whole model.
      recurrent: one RecurrentState per Gated DeltaNet layer (config.linear_layers order). Unlike K/V,
                 a forward pass advances these over its valid tokens (there are no "pending" states).
    """

    kv: KVCache
    recurrent: tuple[RecurrentState, ...]

    @property
    def lengths(self) -> jax.Array:
        return self.kv.lengths

    @property
    def batch(self) -> int:
        return self.kv.batch

    @property
    def capacity(self) -> int:
        return self.kv.capacity


def advance_hybrid(cache: HybridCache, counts: jax.Array) -> HybridCache:
    """Commit the first `counts[r]` pending K/V rows of each row r; recurrent states are already advanced."""
    return dataclasses.replace(cache, kv=advance(cache.kv, counts))
