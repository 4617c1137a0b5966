"""Static-capacity KV cache with per-row lengths.

A forward pass over a prompt or one token writes the K/V of its `t` new tokens into slots
`[length, length + t)` of every row ("pending" rows) and leaves `lengths` alone; the caller then decides how
many of them to keep (`advance`). A verification returns its nodes' K/V beside the cache instead
(`PendingKV`), and the round writes the kept ones (`commit_pending`). Slots at or beyond a row's length are
free and hold garbage that later writes overwrite, so a rejected draft needs no clean-up. Capacity must cover
`length + t` for every call: the engine sizes it as prompt + new tokens + the widest call, rounded up to a
bucket.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from pallas_kernels.commit_rows import commit_rows


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
    """Write rows [b, t, n, d] into layer_cache [b, s, n, d] at slots [lengths[r], lengths[r] + t) per row
    (a start past s - t is clamped to it, as `lax.dynamic_update_slice` does)."""
    if layer_cache.shape[0] == 1:
        # One row: a plain in-place dynamic-update-slice. The vmapped form below becomes a scatter, which XLA
        # on the H200 ran as a bounds-checked select plus the update: two kernels per layer and array in the AR
        # step and the DFlash commit (docs/performance.md, 2026-12-02).
        start = jnp.zeros((), lengths.dtype)
        return jax.lax.dynamic_update_slice(layer_cache, rows.astype(layer_cache.dtype),
                                            (start, lengths[0], start, start))

    def one_row(cache_row, new_row, start):
        return jax.lax.dynamic_update_slice(cache_row, new_row.astype(cache_row.dtype), (start, 0, 0))

    return jax.vmap(one_row)(layer_cache, rows, lengths)


def advance(cache: "KVCache | HybridCache", counts: jax.Array) -> "KVCache | HybridCache":
    """Commit the first `counts[r]` pending K/V rows of each row r (counts [b] int). A hybrid's recurrent
    states need nothing: a chain-mode forward has already advanced them over its valid tokens."""
    if isinstance(cache, HybridCache):
        return dataclasses.replace(cache, kv=advance(cache.kv, counts))
    return dataclasses.replace(cache, lengths=cache.lengths + counts.astype(jnp.int32))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PendingKV:
    """The K/V a verification computed for its T nodes, per attention layer, kept out of the cache until the
    round knows which nodes it keeps (`commit_pending`): one gather-and-write per layer and array, where writing
    every node during the verify and moving the accepted ones afterwards took several small kernels
    (docs/performance.md).

    Fields:
      k, v: per attention layer, device [b, T, n, d] in the model's dtype, node order.
    """

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]


def write_layers(cache: KVCache, k_rows, v_rows, path: jax.Array | None = None, *,
                 one_launch: bool = False) -> KVCache:
    """Every layer's new K/V rows (k_rows, v_rows: per layer [b, T, n, d]) written into slots `[length, length +
    P)` of every row; lengths unchanged. path: [b, P] int32 node indices (a tree's accepted path, padded with its
    deepest node): node path[r, i] goes to slot `lengths[r] + i`; None: all T rows in order. `one_launch`: every
    layer's K and V by one Pallas kernel (`pallas_kernels.commit_rows`: the same arrays), not a gather-and-write per
    array."""
    if one_launch:
        layers, dtype = len(cache.k), cache.k[0].dtype
        rows = tuple(r.astype(dtype) for r in (*k_rows, *v_rows))
        written = commit_rows(cache.k + cache.v, rows, cache.lengths, path, implementation="pallas")
        return KVCache(k=written[:layers], v=written[layers:], lengths=cache.lengths)

    def write(layer, nodes):
        if path is not None:
            nodes = jnp.take_along_axis(nodes, path[:, :, None, None], axis=1)  # [b, P, n, d]
        return write_pending(layer, nodes, cache.lengths)

    return KVCache(k=tuple(map(write, cache.k, k_rows)), v=tuple(map(write, cache.v, v_rows)), lengths=cache.lengths)


def commit_pending(cache: KVCache, pending: PendingKV, counts: jax.Array, path: jax.Array | None = None, *,
                   one_launch: bool = False) -> KVCache:
    """Write the kept nodes' K/V into slots `[length, length + P)` of every row and commit `counts[r]` of them.

    counts [b] int. path: [b, P] int32 node indices by depth, root first (a tree's accepted path, padded with
    its deepest node): node path[r, i] goes to slot `lengths[r] + i`; None: a chain, whose nodes are in order,
    all T written (slots past a row's count are free again). Example: length 5, path [0 2 5], count 3 -> the
    K/V of nodes 0, 2, 5 land in slots 5, 6, 7. `one_launch`: `write_layers`'.
    """
    return advance(write_layers(cache, pending.k, pending.v, path, one_launch=one_launch), counts)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class MTPCache:
    """What a target's multi-token-prediction head keeps between rounds (`models/mtp.py`).

    Fields:
      kv:     KVCache of the head's decoder layer. Slot i holds the layer's K/V for the pair (the token at
              position i + 1, the target's final hidden state at position i), so its `lengths` equal the
              target's: the last slot pairs the newest emitted token (not yet fed to the target) with the
              target's hidden state at the last committed position.
      hidden: device [b, e] in the model's dtype: the head's output (after its final norm) at the last slot,
              whose logits are the next round's first draft and which feeds its second step.
    """

    kv: KVCache
    hidden: jax.Array

    @property
    def lengths(self) -> jax.Array:
        return self.kv.lengths


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

    @property
    def key_heads(self) -> int:
        """The layer's key heads Hk, from C = 2 Hk Dk + Hv Dv."""
        _, hv, dk, dv = self.state.shape
        return (self.conv.shape[1] - hv * dv) // (2 * dk)

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


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class NodeStates:
    """What one Gated DeltaNet layer leaves per node of a verified tree (T nodes), to install an accepted one.

    No node's Hv x Dk x Dv state is kept: `path_state` forms the state at the end of any root path from
    the committed state and these per-node vectors (`qwen3_5.tree_gated_delta_rule`).

    Fields (device):
      keys:      [b, T, Hv, Dk] float32, the node's L2-normalised key (repeated over value heads).
      values:    [b, T, Hv, Dv] float32, the value the node writes into the memory (v_new).
      log_decay: [b, T, Hv] float32, the log decay summed along the node's root path (G).
      inputs:    [b, T, C] in the model's dtype, the node's conv input (the in_proj_qkv output).

    Size per node per layer: Hv * (Dk + Dv + 1) * 4 + C * itemsize bytes (Qwen3.6-27B: 48 * 257 * 4 =
    48.2 KiB + 10240 * 2 = 20 KiB in bf16, against 3 MiB for a full state).
    """

    keys: jax.Array
    values: jax.Array
    log_decay: jax.Array
    inputs: jax.Array


def path_state(committed: jax.Array, nodes: NodeStates, path: jax.Array, counts: jax.Array) -> jax.Array:
    """The delta-rule memory after the first `counts[r]` nodes of `path` (a root path, root first).

    committed [b, Hv, Dk, Dv] float32 (the state before the root), path [b, P] node indices, counts [b] >= 1.
    With d the last node and G its log decay: exp(G_d) S0 + sum over the path's nodes j of
    exp(G_d - G_j) k_j v_j^T. Returns [b, Hv, Dk, Dv] float32.
    """
    rows = jnp.arange(path.shape[0])[:, None]
    on_path = jnp.arange(path.shape[1])[None, :] < counts[:, None]  # [b, P]
    deepest = jnp.take_along_axis(path, jnp.maximum(counts - 1, 0)[:, None], axis=1)[:, 0]
    g_last = nodes.log_decay[rows[:, 0], deepest]  # [b, Hv]
    g_path = nodes.log_decay[rows, path]  # [b, P, Hv]
    weight = jnp.where(on_path[..., None], jnp.exp(jnp.where(on_path[..., None], g_last[:, None] - g_path, 0.0)), 0.0)
    written = jnp.einsum("bph,bphk,bphv->bhkv", weight, nodes.keys[rows, path], nodes.values[rows, path])
    return jnp.exp(g_last)[..., None, None] * committed + written


def commit_recurrent(state: RecurrentState, nodes: NodeStates, path: jax.Array, counts: jax.Array) -> RecurrentState:
    """The state of one Gated DeltaNet layer after an accepted tree path.

    path [b, P] node indices by depth (root first, padded with the deepest node), counts [b] accepted
    nodes (>= 1; 0 keeps the committed state, for rows that are done). The recurrent state becomes the
    deepest accepted node's (`path_state`); the conv window the last K - 1 inputs of [committed window |
    path inputs].
    """
    counts = counts.astype(jnp.int32)
    installed = path_state(state.state, nodes, path, jnp.maximum(counts, 1))
    installed = jnp.where((counts > 0)[:, None, None, None], installed, state.state)
    kernel_1 = state.conv.shape[-1]
    along = jnp.take_along_axis(nodes.inputs, path[:, :, None], axis=1)  # [b, P, C]
    full = jnp.concatenate([jnp.swapaxes(state.conv, 1, 2), along.astype(state.conv.dtype)], axis=1)
    window = jax.vmap(lambda row, n: jax.lax.dynamic_slice_in_dim(row, n, kernel_1, axis=0))(full, counts)
    return RecurrentState(state=installed, conv=jnp.swapaxes(window, 1, 2))


def recurrent_node_bytes(config, nodes: int, dtype_bytes: int = 2) -> int:
    """Bytes of what a hybrid target keeps per node while it verifies `nodes` tokens as a tree (DDTree: B + 1
    nodes; DFlash: its chain of block-size nodes; AR keeps none, its one token updates the state in place),
    for the commit to form the accepted node's state. For every Gated DeltaNet layer and node
    (`cache.NodeStates`): the float32 key, written value and log decay, Hv x (Dk + Dv + 1) x 4, and the
    node's conv input, C x dtype_bytes (a node's conv window is its ancestors' inputs). 0 for an
    attention-only target. Qwen3.6-27B: 48 layers x (48 x 257 x 4 + 10240 x 2) = 3.2 MiB per node (a full
    Hv x Dk x Dv state per node, as verification kept until 2026-12-01, would be 144.9 MiB)."""
    if not getattr(config, "linear_layers", ()):  # attention only
        return 0
    vectors = config.linear_num_value_heads * (config.linear_key_head_dim + config.linear_value_head_dim + 1) * 4
    return nodes * len(config.linear_layers) * (vectors + config.linear_conv_dim * dtype_bytes)


def committed_recurrent_bytes(config, dtype_bytes: int = 2) -> int:
    """Bytes of a hybrid target's committed recurrent state per sequence: every Gated DeltaNet layer's float32
    state and its conv window (C x (K - 1) in the weights' dtype). 0 for an attention-only target."""
    if not getattr(config, "linear_layers", ()):  # attention only
        return 0
    state = config.linear_num_value_heads * config.linear_key_head_dim * config.linear_value_head_dim * 4
    window = config.linear_conv_dim * (config.linear_conv_kernel - 1) * dtype_bytes
    return len(config.linear_layers) * (state + window)
