"""The contract every target family meets, and the static runtime choices of a model call.

A target family (`qwen3`, `qwen3_5`; looked up by `models.target_family(config)`) is a module with

    abstract(config, dtype) -> ModelParams            shapes only, the target of a checkpoint load
    create_cache(config, batch, capacity, dtype)       an empty cache (KVCache, or HybridCache)
    forward(params, tokens, meta, cache, *, tap_layers=(), runtime=Runtime()) -> ForwardOut
    logits(params, hidden) -> float32 logits
    RECURRENT: bool                                    True where the cache holds recurrent states

The model never owns the cache or the loop: `forward` takes the committed cache and returns it with the
new tokens' K/V written as pending rows (lengths unchanged), or, for a verification tree, returns those K/V
beside the cache; the round decides what to keep (`ddtree_jax.cache`). `ForwardMeta` says where the new
tokens sit and what they see, for a prompt, one decode token or a verification tree alike, so every family's
forward reads the same arguments.
"""

from __future__ import annotations

import dataclasses
import enum
import os

import jax
import jax.numpy as jnp
import numpy as np

import pallas_kernels


class Kernels(str, enum.Enum):
    """Which implementation runs tree attention and greedy tree acceptance: the Pallas kernels
    (`pallas_kernels/`, interpreted where there is no GPU) or their pure-JAX references."""

    JAX = "jax"
    PALLAS = "pallas"


KERNEL_CHOICES = ("auto", "jax", "pallas")  # DecodeOptions.kernels and --kernels


def resolve_kernels(choice: str, dtype=None) -> Kernels:
    """The kernels a choice means here. "auto": $DDTREE_JAX_KERNELS if set (`pallas`; `reference` or
    `jax`), else Pallas on a GPU for 16-bit compute (`dtype` None or 2 bytes wide) and pure JAX otherwise:
    the float32 Pallas attention is many times slower than XLA's on the H200 (docs/kernels.md). "jax" and
    "pallas" are kept as given."""
    if choice not in KERNEL_CHOICES:
        raise ValueError(f"kernels must be one of {', '.join(map(repr, KERNEL_CHOICES))}, got {choice!r}")
    if choice != "auto":
        return Kernels(choice)
    if os.environ.get(pallas_kernels.ENV_VAR):
        return Kernels.PALLAS if pallas_kernels.resolve_implementation(None) == "pallas" else Kernels.JAX
    wide = dtype is not None and np.dtype(dtype).itemsize > 2
    return Kernels.PALLAS if pallas_kernels.on_gpu() and not wide else Kernels.JAX


class Fp8Matmul(str, enum.Enum):
    """How an FP8 projection (`layers.Linear` after `to_fp8`) multiplies: XLA's dequantise-then-matmul, or the
    weight-streaming matmul (`pallas_kernels.stream_matmul`), which reads the FP8 weight as it is stored and
    scales each block's partial sums inside the kernel, with the activations as they are (`STREAM`: the weights
    dequantised, exactly up to float32 sums) or quantised to FP8 per token and weight block's input features
    (`W8A8`: the arithmetic transformers and vLLM run the published FP8 checkpoints with on a GPU, FP8 tensor
    cores on both operands; `models.fp8.quantize_rows`, with power-of-two scales)."""

    DEQUANTIZE = "dequantize"
    STREAM = "stream"
    W8A8 = "w8a8"

    @property
    def streams(self) -> bool:
        return self is not Fp8Matmul.DEQUANTIZE


FP8_MATMUL_CHOICES = ("auto", "dequantize", "stream", "w8a8")  # DecodeOptions.fp8_matmul and --fp8-matmul


def resolve_fp8_matmul(choice: str, kernels: Kernels | str = Kernels.JAX) -> Fp8Matmul:
    """The FP8 matmul a choice means with these (resolved) kernels; this is the one place that decides "auto":
    "stream" with the Pallas kernels on a GPU, "dequantize" elsewhere. On the H200 the 36 projections of the
    Qwen3-8B shape as FP8 took 4.60 / 5.00 / 11.31 ms streamed against 13.03 / 13.12 / 13.98 ms dequantised by
    XLA, at 1 / 16 / 65 rows (tools/gpu_probe.py, 2026-12-02). "dequantize", "stream" and "w8a8" (another
    arithmetic: the activations quantised) are kept as given."""
    if choice not in FP8_MATMUL_CHOICES:
        raise ValueError(f"fp8_matmul must be one of {', '.join(map(repr, FP8_MATMUL_CHOICES))}, got {choice!r}")
    if choice != "auto":
        return Fp8Matmul(choice)
    return Fp8Matmul.STREAM if Kernels(kernels) is Kernels.PALLAS and pallas_kernels.on_gpu() else Fp8Matmul.DEQUANTIZE


@dataclasses.dataclass(frozen=True)
class Runtime:
    """Static choices of a traced model call (hashable: part of every compilation key).

    kernels: `Kernels.JAX` or `Kernels.PALLAS` (resolved, never "auto").
    tp_mesh: the tensor-parallel mesh whose "model" axis splits the heads; the Pallas attention then runs
             under `shard_map` on each device's heads (XLA partitions the pure-JAX path itself). None on
             one device and under data parallelism.
    fp8_matmul: `Fp8Matmul.DEQUANTIZE`, `STREAM` or `W8A8` (resolved, never "auto"): how FP8 projections
             multiply (`layers.fp8_linear` says where they stream); no effect on other weights.
    row_invariant: every row's arithmetic independent of the call's other rows, its row count and its place
             (issue 20), with the Pallas kernels: projections and the lm_head through the weight-streaming matmul
             in 16-row tiles (`layers.linear`, `layers.Linear`; on the H200, 2026-12-02, no row of a 16-row call
             differed from the row alone, where XLA's GEMM gave other bits for 4 of 16 rows at down_proj) and the
             attention through the row-invariant kernel (`layers.cached_attention`; not in sliding-window
             layers), for calls of any rows. So a verified node's logits are the AR step's bits on dense targets.
             `round.prefill` runs the prompt with it too (each mode compiles its own prefill program).
    """

    kernels: Kernels = Kernels.JAX
    tp_mesh: jax.sharding.Mesh | None = None
    fp8_matmul: Fp8Matmul = Fp8Matmul.DEQUANTIZE
    row_invariant: bool = False

    def __post_init__(self):
        object.__setattr__(self, "kernels", Kernels(self.kernels))
        object.__setattr__(self, "fp8_matmul", Fp8Matmul(self.fp8_matmul))
        if self.row_invariant and self.kernels is not Kernels.PALLAS:
            raise ValueError("row_invariant needs the Pallas kernels (--kernels pallas): the jnp path's matmuls and "
                             "attention reduce in orders XLA chooses per shape")
        if self.row_invariant and self.tp_mesh is not None:
            raise ValueError("row_invariant runs on one device or under data parallelism, not tensor parallelism (the "
                             "streaming matmul has no shard_map yet; XLA's split GEMMs are not row-invariant)")

    @property
    def pallas(self) -> bool:
        return self.kernels is Kernels.PALLAS


def causal_mask(valid: jax.Array, t: int) -> jax.Array:
    """[b, t, t] bool: token i sees tokens j <= i of its row; a padding token (i >= valid[r]) sees only itself.

    Example, t = 3, valid = [2]:  [[1,0,0], [1,1,0], [0,0,1]].
    """
    i = jnp.arange(t)[:, None]
    j = jnp.arange(t)[None, :]
    is_valid = i[None] < valid[:, None, None]
    return (j <= i)[None] & (is_valid | (i == j)[None])


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ForwardMeta:
    """Where the t new tokens of a forward sit and what they see (device arrays).

    Fields:
      positions: [b, t] int32, RoPE positions (and sliding windows): `length + i` for a prompt or a chain,
                 `length + depth` for tree nodes.
      new_mask:  [b, t, t] bool, which new tokens each new token sees besides the committed cache: causal
                 for a prompt, the ancestor mask for a tree (a padding token sees only itself).
      valid:     [b] int32, real tokens per row, a prefix (the rest is right padding, which leaves recurrent
                 states alone). Ignored in tree mode, where every node is real.
      parents:   None (the tokens extend each row as a chain), or [b, t] int32 parent node indices of a
                 verification tree (node 0 the root, its own parent; parents precede children): recurrent
                 layers then run along every node's root path and return per-node records
                 (`ForwardOut.nodes`).
    Worked example, a prompt of lengths [3, 2] padded to t = 3 on an empty cache: positions [[0 1 2],
    [0 1 2]], valid [3 2], row 1's token 2 sees only itself.
    """

    positions: jax.Array
    new_mask: jax.Array
    valid: jax.Array
    parents: jax.Array | None = None

    @classmethod
    def prompt(cls, lengths: jax.Array, t: int) -> "ForwardMeta":
        """Right-padded prompts of `lengths` [b] tokens on an empty cache."""
        b = lengths.shape[0]
        positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        return cls(positions=positions, new_mask=causal_mask(lengths, t), valid=lengths.astype(jnp.int32))

    @classmethod
    def step(cls, cache_lengths: jax.Array, running: jax.Array) -> "ForwardMeta":
        """One token per row after the committed ones; rows not `running` [b] bool leave recurrent states alone."""
        b = cache_lengths.shape[0]
        return cls(positions=cache_lengths[:, None].astype(jnp.int32), new_mask=jnp.ones((b, 1, 1), bool),
                   valid=running.astype(jnp.int32))

    @classmethod
    def tree(cls, cache_lengths: jax.Array, parents: jax.Array, depths: jax.Array,
             ancestor: jax.Array) -> "ForwardMeta":
        """The nodes of a draft tree hanging below each row's committed tokens (`tree.DraftTree` fields)."""
        b, t = parents.shape
        return cls(positions=(cache_lengths[:, None] + depths).astype(jnp.int32), new_mask=ancestor,
                   valid=jnp.full((b,), t, jnp.int32), parents=parents.astype(jnp.int32))

    @property
    def is_tree(self) -> bool:
        return self.parents is not None


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ForwardOut:
    """What a target's forward returns.

    hidden: [b, t, e] after the final norm.
    taps:   [b, t, len(tap_layers) * e], the outputs of the tapped decoder layers concatenated in the order
            asked (HF `hidden_states[l + 1]`), or None.
    cache:  chain mode: the input cache with the new tokens' K/V written as pending rows (lengths unchanged)
            and a hybrid's recurrent states advanced over the valid tokens; tree mode: the input cache as it
            was (the round writes what it keeps: `cache.commit_pending`, `cache.commit_recurrent`).
    pending: tree mode: the nodes' K/V per attention layer (`cache.PendingKV`); None otherwise.
    nodes:  tree mode on a recurrent family: one `cache.NodeStates` per recurrent layer, from which
            `cache.commit_recurrent` installs an accepted node's state; None otherwise.
    """

    hidden: jax.Array
    taps: jax.Array | None
    cache: object
    pending: object = None
    nodes: tuple | None = None
