"""Building blocks shared by the Qwen targets and the DFlash drafter.

Weights keep the Hugging Face layout (`[out, in]` for projections, `[v, e]` for embeddings), with no
transposes, except that the projections of one input are packed into one weight (`PackedProjections`:
q|k|v, gate|up), whose HF tensors `ModelParams.flat` gives back by name. Every parameter carries `axes`
metadata (logical axis names) from which the parallel layer derives partition specs.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

from ddtree_jax.models import fp8
from ddtree_jax.models.contract import Fp8Matmul, Runtime
from pallas_kernels.qk_norm_rope import qk_norm_rope
from pallas_kernels.rms_norm import add_rms_norm
from pallas_kernels.stream_matmul import StreamMatmulConfig, fitted_config, stream_matmul, swiglu
from pallas_kernels.tree_attention import ROW_INVARIANT_CONFIG, TreeAttentionConfig, tree_attention

from ddtree_jax.config import RopeConfig

NORMAL_STD = 0.02
# The most rows (tokens x batch) an FP8 projection streams under `Fp8Matmul.STREAM`, a speed choice: the kernel
# keeps a float32 [block_n, rows] accumulator per program and is written for decode calls (one token, a DFlash
# block, a tree of B <= 127 at batch 1; tools/gpu_probe.py timed its dense form up to 128 rows,
# docs/performance.md). Calls with more rows (a prompt's prefill, wider trees, large batches) multiply as XLA does
# (the weights dequantised first). Under `Runtime.row_invariant` every call streams, whatever its rows (in groups
# of `pallas_kernels.stream_matmul.GROUP_ROWS`): a verify of a batch of trees must multiply as its AR steps do.
STREAM_MAX_ROWS = 128


# The streaming kernel's knobs for FP8 projections (tiles fitted to each weight by `fitted_config`). `fp8_bits=1`
# widens without F2F conversions (`pallas_kernels.stream_matmul`'s docstring), the same bits as 0: on the H200
# (2026-12-05) 12 layers' FP8 projections took 1.384 / 1.323 / 2.461 ms at 1 / 16 / 65 rows against 1.528 / 1.542
# / 2.833 with 0, and the Qwen3-8B FP8 rounds AR 5.43 ms (5.62), DFlash 6.63 (6.82), B = 64 9.49 (10.73).
# `prefetch=1` loads each step's block scales a step ahead (the same bits): on the H200 (2026-12-05 night, four
# alternating pairs over two calls, `python tools/with_knobs.py fp8_stream:prefetch=1 -m ddtree_jax.bench --shape
# qwen3-8b --weights fp8 --fp8-matmul w8a8 ...`) the W8A8 AR step 3.48-3.63 ms (mean 3.57) against 3.58-3.74
# (3.65), DFlash 4.78-4.93 (4.86) against 4.89-5.04 (4.94): ~2%, at the edge of the runs' ~1% spread.
FP8_STREAM_KNOBS = StreamMatmulConfig(fp8_bits=1, prefetch=1)

# The AR step's (and a prefill's) new K/V written into the cache by the q/k-norm-RoPE kernel itself
# (`pallas_kernels.qk_norm_rope` with the cache aliased), not by two dynamic-update-slice kernels per layer after
# the layers (on the H200 ~0.1 ms of kernels an 8B AR step, 2026-12-02). The same bits either way. On: on an H100
# (2026-12-05, alternating on one machine, `python tools/with_knobs.py engine:fused_kv_write=1 -m ddtree_jax.bench
# --shape qwen3-8b --kernels pallas ...` against the plain bench) the bf16 8B AR step took 6.16-6.19 ms against
# 6.28-6.29 (four and three runs), DFlash and DDTree B = 15 rounds 0.3-0.4% less: XLA updates the aliased caches
# in place inside the decode loop.
FUSED_KV_WRITE = True

# The fast attention kernel's knobs (None: its defaults). The kernel in one launch without the chunks' merge (a
# `single_pass` knob, removed since) was slower on the H200 at every point timed (2026-12-05): 7.8 against 6.3 us at
# S = 256, T = 1 (a demo cache) and 29.7 against 9.5 at S = 2048, T = 1 (too few programs once the keys are not
# split into chunks). The chunks merged inside the kernel by the program of a row block that arrives last on an
# atomic count (`merge_in_kernel`, removed; its code in git history at 23923ba) was slower on an H100 (2026-12-06):
# 12.9 / 27.5 / 25.6 against 9.1 / 11.1 / 22.1 us a layer at S = 2048 and T = 1 / 16 / 65 (one program merges
# what the merge kernel spreads over many). `tools/with_knobs.py attention:KNOB=N` lays knobs over this in rounds.
ATTENTION_CONFIG: TreeAttentionConfig | None = None

# The streaming kernel's row tile under `Runtime.row_invariant`: one mma shape (Triton's mma.sync on Hopper) for
# every row count, where power-of-two tiles would multiply 64 of 65 rows with wgmma and a lone row with mma.sync.
ROW_INVARIANT_ROW_TILE = 16

# Dense (bf16) projections of calls of at most this many rows through the streaming kernel on the Pallas path (one
# device), not XLA's GEMMs; 0: none. The lm_head stays XLA's (at the bandwidth ceiling) except under
# `Runtime.row_invariant`. On the H200 (2026-12-05, bf16 Qwen3-8B shape, `python tools/with_knobs.py
# engine:dense_stream_max_rows=N -m ddtree_jax.bench --shape qwen3-8b --kernels pallas ...` between default runs on
# one machine) 16 and 32 rows took DFlash rounds (the drafter's block and the 16-row verify) 5.96-6.09 ms against
# 6.33-6.43, DDTree B = 15 6.08-6.13 against 6.26-6.35 and B = 31 6.35-6.41 against 6.49-6.53; the AR step the same
# within the spread (4.62-4.68 against 4.65-4.73); 64 rows were slower (B = 63: 7.09-7.15 against 6.71).
DENSE_STREAM_MAX_ROWS = 32
# ... and only weights of at least this many bytes: the streaming is timed on weights of 32-168 MB (the 8B's
# projections and its drafter's); small ones (the demo pair's, a hybrid's per-head gates) keep XLA's GEMM, untimed
# streamed, where a launch's latency and the split sums' add would dominate. At the Qwen3.6-27B shape the DFlash
# round was slower streamed in both pairs of runs taken (H200, 2026-12-05: 18.48 ms against 17.81 off; that night
# 18.17 against 17.69, `python tools/with_knobs.py engine:dense_stream_max_rows=0 -m ddtree_jax.bench --shape
# qwen3.6-27b --modes dflash ...`); not yet changed for it: which of its weights lose is not measured (its
# 5120-row weights run 160 programs, 1.2 waves of 132 multiprocessors; `balance=1` below did not mend it).
DENSE_STREAM_MIN_BYTES = 16 << 20
# ... with these knobs (tiles fitted to each weight by `fitted_config`). `balance=1` (k split so that the programs
# spread evenly over the multiprocessors: e.g. the 27B's down_proj in 8 splits, not 2) stays off: on the H200
# (2026-12-05 night, `python tools/with_knobs.py dense_stream:balance=1 -m ddtree_jax.bench ...`) the 8B AR step
# 4.74 ms against 4.73, DFlash 6.07 against 6.06, B = 64 6.59 against 6.68 (one run each), and the 27B's DFlash
# round slower, 18.77 against 18.17 (its 16-row gate|up then in 4 splits: partial sums of 34816 features).
# `balance=2` (even splits only where the default gives at most two programs a multiprocessor: the 27B's 5120-row
# weights, not its gate|up) is not yet timed: `python tools/with_knobs.py dense_stream:balance=2 -m ...`.
DENSE_STREAM_KNOBS = StreamMatmulConfig()
# Dense projections of calls of more than DENSE_STREAM_MAX_ROWS rows, up to this many, streamed too, with their own
# knobs (a DDTree verify of B = 64: 65 rows); 0: none (XLA's GEMMs, cuBLAS's at 65 rows). On an H100 (2026-12-05
# night, `python tools/gpu_probe.py --layers 12 --tokens 16,65 --forms fused,stream_fused --stream-configs ...`: 12
# Qwen3-8B layers' packed projections) 64 x 64 tiles (the row tile's 64 + 16 rows a step in half the shared memory
# of 64 x 128: three programs per multiprocessor, not one) took 1.879 and 1.902 ms at 65 rows against XLA's 2.008
# and 2.036 (64 x 128 tiles 1.993, 1.947), but 1.806 at 16 rows against 64 x 128's 1.637. In the rounds on the
# same machine it lost (`python tools/with_knobs.py engine:dense_stream_wide_max_rows=65 -m ddtree_jax.bench --shape
# qwen3-8b --modes ddtree --budgets 64 ...`, alternating): B = 64 8.76 and 8.63 ms against 8.33 and 8.37. Off.
DENSE_STREAM_WIDE_MAX_ROWS = 0
DENSE_STREAM_WIDE_KNOBS = StreamMatmulConfig(block_k=64)
# ... and of those weights only the ones of at most this many bytes (None: any). In the H200's B = 64 trace
# (2026-12-05 evening, `docs/data/trace_summary_qwen3_8b_h200_2026-12-05_evening.json`) cuBLAS's 65-row kernels
# streamed the 8B's gate|up at 3.8 TB/s but q|k|v, o_proj and down_proj at 2.1-3.6 (docs/performance.md, 2026-12-06
# night), while a streamed projection's split sums grow with its output features (gate|up: 65 x 24576 float32
# partials a split). A cap keeps the wide streaming to the shorter weights (`engine:dense_stream_wide_max_bytes=N`:
# 40000000 o_proj alone, 110000000 all but gate|up). On an H100 (2026-12-06 night) neither gained: the 8B's B = 63 /
# 64 rounds 0-4% slower, the 27B's B = 63 2.5% slower at 110 MB; the H200 has not timed it.
DENSE_STREAM_WIDE_MAX_BYTES: int | None = None

# SwiGLU's silu(gate) * up computed in the epilogue of a streamed gate|up projection (`stream_matmul`'s `glu`: each
# program streams its gate rows and the same up rows, one split), not by an XLA kernel of its own after it (36 a
# step at the Qwen3-8B shape, ~0.06 ms of the H200's AR step and 0.09 of a DFlash round, 2026-12-05 traces). Off: on
# an H100 (2026-12-05, `python tools/with_knobs.py engine:glu_in_epilogue=1 -m ddtree_jax.bench --shape qwen3-8b
# ...` between plain runs) full-height tiles (64 gate and 64 up rows a program) took the bf16 8B DFlash round to
# 8.32 ms against 7.98-8.05, and half-height ones (`_glu_tiles`) 7.87-7.97 against 7.93-7.96 (AR 6.20-6.28 against
# 6.12-6.28): no gain beyond the spread.
GLU_IN_EPILOGUE = False


# W8A8's rows for q|k|v and gate|up quantised by the add + RMSNorm kernel before them (`pallas_kernels.rms_norm`'s
# `quantize_group`: FP8 codes and each group's scale, `QuantizedRows`) and streamed as given (`stream_matmul`'s
# `x_scale`), instead of each streaming program quantising every step's row tile itself (`quantize_x`: a
# cross-warp reduction, a conversion, a store and a barrier in every step of every program). The same bits
# (`quantize_rows`' power-of-two scales either way). On since 2026-12-06: on an H100 (docs/performance.md; `python
# tools/with_knobs.py engine:w8a8_rows_from_norm=1 -m ddtree_jax.bench --shape qwen3-8b --weights fp8 --fp8-matmul
# w8a8 ...`, alternating) the 8B FP8 B = 64 round took 6.90 / 6.93 ms against 7.11 / 7.03 (its 65 rows otherwise
# quantised first by an XLA fusion before q|k|v and gate|up, `W8A8_QUANTIZE_FIRST_ABOVE`), the DFlash round 5.71 /
# 5.69 against 5.71 / 5.69, and on 2026-12-05 late the AR step 4.16 / 4.13 against 4.11 / 4.16 and DFlash 5.83 /
# 5.72 against 5.74 / 5.83: a gain where a verify's rows would be quantised first, nothing lost elsewhere. The hybrid
# (qwen3_5: a full-attention layer's q|k|v, every layer's gate|up) since 2026-12-06 evening: the Qwen3.6-27B's W8A8
# AR step 13.09 / 13.15 ms against 13.95 / 14.04, DFlash 16.54 / 16.52 against 17.62 / 17.66, B = 63 20.63 / 20.72
# against 21.02 / 21.21 (an H100, alternating). Not yet timed on an H200.
W8A8_ROWS_FROM_NORM = True

# W8A8's rows of a streamed call of more than this many rows quantised once, first (`fp8.quantize_rows`, an XLA
# fusion), and streamed as given (`x_scale`), not inside the streaming kernel (`quantize_x`: every program quantises
# each step's row tile itself, a reduction across the tile's columns per row); 0: inside the kernel at any row
# count. The same bits either way (tests/kernels/test_stream_matmul.py). Offline for sm_90 at 65 rows (`python
# tools/triton_offline.py --quick --only w8a8 --by-line 8`) the in-kernel form takes 100 KiB of shared memory (2
# programs a multiprocessor) and ~365 more instructions a step, against 72 KiB (3) given FP8 rows. 16: on an H100
# (2026-12-06, docs/performance.md) 12 layers' packed W8A8 projections took 1.565 ms at 65 rows quantised first
# against 2.669 inside (1.332 against 1.146 at 16 rows, where the kernel's own quantisation wins), and alternating
# in the rounds (`python tools/with_knobs.py engine:w8a8_quantize_first_above=16 -m ddtree_jax.bench --weights fp8
# --fp8-matmul w8a8 ...`) the 8B FP8 B = 64 round 7.21 / 7.20 ms against 11.01 / 10.84 and the Qwen3.6-27B's B = 63
# 21.46 against 30.50, DFlash and B = 15 (16 rows) unchanged.
W8A8_QUANTIZE_FIRST_ABOVE = 16


@functools.partial(jax.tree_util.register_dataclass, data_fields=["codes", "scales"], meta_fields=["dtype"])
@dataclasses.dataclass(frozen=True)
class QuantizedRows:
    """An RMSNorm's output as W8A8 rows (`W8A8_ROWS_FROM_NORM`): codes [..., e] float8_e4m3fn, scales [..., e / g]
    float32 (one per group of g input features: `ddtree_jax.models.fp8.quantize_rows`' bits), and `dtype`, the
    norm output's dtype (the projection's result's). Only an FP8 projection that streams W8A8 takes them
    (`fp8_linear`)."""

    codes: jax.Array
    scales: jax.Array
    dtype: object

    @property
    def shape(self) -> tuple[int, ...]:
        return self.codes.shape


def dense_stream_config(weight_shape: tuple[int, int], rows: int, runtime: Runtime, *, dtype=jnp.bfloat16,
                        lm_head: bool = False, glu: bool = False) -> StreamMatmulConfig | None:
    """The streaming kernel's knobs for a dense [out, in] weight on `rows` rows if it streams, else None: under
    `Runtime.row_invariant` (any number of rows, the lm_head too; never with a tensor-parallel mesh, which `Runtime`
    refuses), or, not the lm_head, for at most `DENSE_STREAM_MAX_ROWS` rows (`DENSE_STREAM_KNOBS`), or more up to
    `DENSE_STREAM_WIDE_MAX_ROWS` (`DENSE_STREAM_WIDE_KNOBS`, weights of at most `DENSE_STREAM_WIDE_MAX_BYTES`), on the
    Pallas path without a tensor-parallel mesh and a weight of at least `DENSE_STREAM_MIN_BYTES` (in `dtype`, what the
    kernel reads); for a weight the kernel tiles (`fitted_config`: out and in features multiples of 16; `glu`: the
    weight is gate|up, tiled by its halves)."""
    n, k = weight_shape[0] // 2 if glu else weight_shape[0], weight_shape[1]
    if runtime.row_invariant:
        return fitted_config(n, k, config=_glu_tiles(StreamMatmulConfig(row_tile=ROW_INVARIANT_ROW_TILE), glu))
    nbytes = math.prod(weight_shape) * jnp.dtype(dtype).itemsize
    wide = rows > DENSE_STREAM_MAX_ROWS
    if (lm_head or rows > max(DENSE_STREAM_MAX_ROWS, DENSE_STREAM_WIDE_MAX_ROWS) or not runtime.pallas
            or runtime.tp_mesh is not None or nbytes < DENSE_STREAM_MIN_BYTES
            or (wide and DENSE_STREAM_WIDE_MAX_BYTES is not None and nbytes > DENSE_STREAM_WIDE_MAX_BYTES)):
        return None
    knobs = DENSE_STREAM_WIDE_KNOBS if wide else DENSE_STREAM_KNOBS
    return fitted_config(n, k, config=_glu_tiles(knobs, glu))


def _glu_tiles(config: StreamMatmulConfig, glu: bool) -> StreamMatmulConfig:
    """With `glu` a program streams block_n gate rows and as many up rows: half the tile's rows of each (at least
    16), so that it streams the bytes of one plain program (twice the tiles in shared memory ran slower on an H100,
    2026-12-05)."""
    return dataclasses.replace(config, block_n=max(16, config.block_n // 2)) if glu else config


def linear(x: jax.Array, weight: jax.Array, runtime: Runtime, *, out_dtype=None,
           lm_head: bool = False, glu: bool = False) -> jax.Array:
    """x [..., in] times a dense weight [out, in] (HF layout) transposed -> [..., out] in `out_dtype` (default x's
    dtype). XLA's GEMM, or where `dense_stream_config` gives knobs `pallas_kernels.stream_matmul` (the Pallas kernel
    on the Pallas path, its jnp reference otherwise), accumulating in float32. `lm_head`: the weight is the
    vocabulary projection (`dense_stream_config`). `glu`: the weight is SwiGLU's gate|up [2 m, in] and the result
    `swiglu` of the two halves, [..., m] (streamed: in the kernel's epilogue)."""
    rows = math.prod(x.shape[:-1])
    config = dense_stream_config(weight.shape, rows, runtime, dtype=x.dtype, lm_head=lm_head, glu=glu)
    if config is None:
        y = jnp.einsum("...i,oi->...o", x, weight.astype(x.dtype), preferred_element_type=out_dtype)
        return swiglu(*jnp.split(y, 2, axis=-1)) if glu else y
    y = stream_matmul(x.reshape(rows, x.shape[-1]), weight.astype(x.dtype), config=config, out_dtype=out_dtype,
                      implementation="pallas" if runtime.pallas else "reference", glu=glu)
    return y.reshape(*x.shape[:-1], y.shape[-1])


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
    dequantised on every call, or streamed as FP8 (`runtime.fp8_matmul`, `__call__`)."""

    def __init__(self, in_features: int, out_features: int, axes: tuple[str | None, str | None], *, dtype, rngs,
                 groups: int | None = None):
        init = "normal" if rngs is not None else "zeros"  # no rngs: a placeholder to be assigned
        self.weight = param(rngs, (out_features, in_features), dtype, axes, init, groups)
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

    def __call__(self, x: jax.Array, runtime: Runtime) -> jax.Array:
        """x [..., in] -> [..., out] in x's dtype: a dense weight as `linear` multiplies, an FP8 one as
        `fp8_linear` does."""
        if self.block is None:
            return linear(x, self.weight[...], runtime)
        return fp8_linear(x, self.weight[...], self.weight_scale_inv[...], self.block, runtime)

    def stream_config(self, rows: int, runtime: Runtime) -> StreamMatmulConfig | None:
        """`fp8_stream_config` for this weight (None while it is dense)."""
        return None if self.block is None else fp8_stream_config(self.weight[...].shape, self.block, rows, runtime)


def fp8_stream_config(weight_shape: tuple[int, int], block: tuple[int, int], rows: int,
                      runtime: Runtime, *, glu: bool = False) -> StreamMatmulConfig | None:
    """The streaming kernel's knobs for an FP8 weight [out, in] in `block`s on `rows` rows if it streams, else None.
    It streams under `runtime.row_invariant` (any rows, in 16-row tiles) or where `runtime.fp8_matmul` streams
    (`STREAM`, `W8A8`) with rows <= STREAM_MAX_ROWS, without a tensor-parallel mesh (there the weight and its
    scales are split, and XLA partitions the dequantise path; no `shard_map` of the kernel yet), for a weight the
    kernel tiles (`fitted_config`: out and in features multiples of 16; `glu`: gate|up, tiled by its halves)."""
    streams = runtime.row_invariant or (runtime.fp8_matmul.streams and rows <= STREAM_MAX_ROWS)
    if not streams or runtime.tp_mesh is not None:
        return None
    tile = dataclasses.replace(FP8_STREAM_KNOBS, row_tile=ROW_INVARIANT_ROW_TILE if runtime.row_invariant else None)
    return fitted_config(weight_shape[0] // 2 if glu else weight_shape[0], weight_shape[1], block,
                         config=_glu_tiles(tile, glu))


def fp8_linear(x: jax.Array, weight: jax.Array, scale_inv: jax.Array, block: tuple[int, int],
               runtime: Runtime, *, glu: bool = False) -> jax.Array:
    """x [..., in] times a block-scaled FP8 weight [out, in] (scales [ceil(out / bo), ceil(in / bi)]) transposed ->
    [..., out] in x's dtype (`glu`: gate|up, `linear`'s).

    XLA multiplies x by the weight dequantised in float32, then cast to x's dtype, except where `fp8_stream_config`
    gives knobs: then `pallas_kernels.stream_matmul` multiplies x in its dtype by the FP8 weight as stored,
    accumulating in float32 (the Pallas kernel on the Pallas path, `runtime.kernels`; its jnp reference, which
    dequantises in float32 first, otherwise). With `runtime.fp8_matmul` W8A8 each row of x is quantised to FP8 per
    group of the block's input features (`fp8.quantize_rows`): inside the streaming kernel where its step is one
    group (`quantize_x`: no launch of its own) and the call has at most `W8A8_QUANTIZE_FIRST_ABOVE` rows (0: any),
    else first, then streamed with its scales (FP8 tensor cores), or where nothing streams, dequantised again to
    x's dtype and multiplied as above: the same products up to that rounding (none in float32) and the order of
    float32 sums. x may come quantised already (`QuantizedRows`, the norm's)."""
    rows = math.prod(x.shape[:-1])
    config = fp8_stream_config(weight.shape, block, rows, runtime, glu=glu)
    w8a8 = runtime.fp8_matmul is Fp8Matmul.W8A8
    if isinstance(x, QuantizedRows):  # W8A8 rows the norm before quantised (`add_and_norm`)
        quantize_x, dtype = False, x.dtype
        rows_x, x_scale = x.codes.reshape(rows, x.shape[-1]), x.scales.reshape(rows, -1)
    else:
        quantize_x = (w8a8 and config is not None and config.block_k == block[1]
                      and not 0 < W8A8_QUANTIZE_FIRST_ABOVE < rows)
        dtype, rows_x, x_scale = x.dtype, x.reshape(rows, x.shape[-1]), None
        if w8a8 and not quantize_x:
            rows_x, x_scale = fp8.quantize_rows(rows_x, block[1])
    if config is None:
        if x_scale is not None:
            x = fp8.dequantize(rows_x, x_scale, (1, block[1]), dtype).reshape(x.shape)
        y = jnp.einsum("...i,oi->...o", x, fp8.dequantize(weight, scale_inv, block, dtype))
        return swiglu(*jnp.split(y, 2, axis=-1)) if glu else y
    y = stream_matmul(rows_x, weight, scale_inv, block=block, x_scale=x_scale, quantize_x=quantize_x, glu=glu,
                      implementation="pallas" if runtime.pallas else "reference", config=config, out_dtype=dtype)
    return y.reshape(*x.shape[:-1], y.shape[-1])


def apply_fp8(module: nnx.Module, config) -> nnx.Module:
    """Make FP8 every `Linear` of `module` that `config.fp8` (a `config.Fp8Config`, or None) converts, by its
    dotted name; returns `module`."""
    if getattr(config, "fp8", None) is None:
        return module
    for path, child in list(nnx.iter_modules(module)):
        name = ".".join(str(p) for p in path)
        if isinstance(child, PackedProjections):
            # HF names of the parts: siblings of the packed module.
            parent = name.rpartition(".")[0]
            names = [f"{parent}.{part.name}" if parent else part.name for part in child.parts]
            converted = {config.fp8.converts(n) for n in names}
            if len(converted) > 1:
                raise ValueError(f"quantization_config converts some of {', '.join(names)} to FP8 but not all; "
                                 "projections of one input must agree")
            if converted == {True} and child.fp8_packs(config.fp8.block):
                child.to_fp8(config.fp8.block)
            elif converted == {True}:
                child.keep_apart()
                for part in child.parts:
                    getattr(child, part.name).to_fp8(config.fp8.block)
        elif isinstance(child, Linear) and config.fp8.converts(name):
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

    kind = "qwen3"  # `pallas_kernels.rms_norm`'s name for this scaling

    def __init__(self, dim: int, eps: float, axis_name: str = "embed", *, dtype, rngs=None):
        self.weight = param(rngs, (dim,), dtype, (axis_name,), "ones")
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return self.weight[...].astype(x.dtype) * normed.astype(x.dtype)


def fuses_kv_write(attn, runtime: Runtime) -> bool:
    """Whether `project_qk_norm_rope` writes the new K/V into the cache itself (`FUSED_KV_WRITE`, on the Pallas
    path with one device and a packed projection: its kernel's path)."""
    return FUSED_KV_WRITE and runtime.pallas and runtime.tp_mesh is None and attn.qkv_proj.packed


def project_qk_norm_rope(attn, x: jax.Array, cos: jax.Array, sin: jax.Array, runtime: Runtime,
                         cache: tuple[jax.Array, jax.Array, jax.Array] | None = None) -> tuple[jax.Array, ...]:
    """Qwen3 attention's q, k, v of x [b, t, e]: the packed q|k|v projection, `attn.q_norm` / `attn.k_norm` per
    head and RoPE (cos/sin [b, t, d], the whole head) on q and k. Returns q [b, t, n*g, d], k and v [b, t, n, d].
    On the Pallas path with one device and a packed projection, one kernel after the matmul
    (`pallas_kernels.qk_norm_rope`: XLA ran three to five); else the jnp ops of the modules. With `cache` =
    (k_cache, v_cache [b, s, n, d], starts [b]) where `fuses_kv_write`, the kernel also writes k and v into the
    caches at slots [starts, starts + t) and (q, k, v, k_cache, v_cache) come back."""
    b, t, _ = x.shape
    d = attn.head_dim
    if runtime.pallas and runtime.tp_mesh is None and attn.qkv_proj.packed:
        return qk_norm_rope(attn.qkv_proj.packed_output(x, runtime), attn.q_norm.weight[...],
                            attn.k_norm.weight[...], cos, sin, *(cache or ()), eps=attn.q_norm.eps,
                            implementation="pallas")
    q, k, v = attn.qkv_proj(x, runtime)
    q = apply_rope(attn.q_norm(q.reshape(b, t, -1, d)), cos, sin)
    k = apply_rope(attn.k_norm(k.reshape(b, t, -1, d)), cos, sin)
    return q, k, v.reshape(b, t, -1, d)


def add_and_norm(norm, x: jax.Array, delta: jax.Array | None, runtime: Runtime,
                 into: "PackedProjections | None" = None) -> tuple[jax.Array, jax.Array | QuantizedRows]:
    """The residual stream after a block and the next norm of it: (s, norm(s)) with s = x + delta (x when delta is
    None), x/delta [..., e]. `norm` is an RMSNorm module with `kind`, `eps` and `weight`. On the Pallas path one
    kernel (`pallas_kernels.rms_norm`: XLA ran two or three per norm), replicated under tensor parallelism (the
    stream is); else the jnp ops of `x + delta` and `norm`. `into`: the projection that alone takes norm(s); where
    it streams W8A8 and `W8A8_ROWS_FROM_NORM` is on, norm(s) comes back as `QuantizedRows` (the norm kernel's FP8
    codes and scales)."""
    rows = math.prod(x.shape[:-1])
    group = into.fp8_rows_group(rows, runtime) if W8A8_ROWS_FROM_NORM and into is not None and runtime.pallas else None
    if group is not None:  # the projection's W8A8 rows quantised here (`QuantizedRows`)
        s, (codes, scales) = add_rms_norm(x, delta, norm.weight[...], eps=norm.eps, kind=norm.kind,
                                          quantize_group=group, implementation="pallas")
        return s, QuantizedRows(codes, scales, x.dtype)
    if not runtime.pallas:
        s = x if delta is None else x + delta
        return s, norm(s)
    fused = functools.partial(add_rms_norm, eps=norm.eps, kind=norm.kind, implementation="pallas")
    if runtime.tp_mesh is not None:
        fused = jax.shard_map(fused, mesh=runtime.tp_mesh, in_specs=(P(), P(), P()), out_specs=(P(), P()),
                              check_vma=False)
    return fused(x, delta, norm.weight[...])


@dataclasses.dataclass(frozen=True)
class Part:
    """One HF projection inside `PackedProjections`: its module `name` (a sibling of the packed module in the
    HF names), its `units` of R rows in every group, and its own `axes` and `groups` (`Linear`), which it
    takes back when FP8 keeps it apart."""

    name: str
    units: int
    axes: tuple[str | None, str | None]
    groups: int | None = None


class PackedProjections(nnx.Module):
    """Projections of one input held as one weight and run as one matmul: one pass over the weights instead
    of one per projection (on the H200 at Qwen3-8B shapes: the AR step 5.36 -> 5.22 ms, the DDTree B = 64
    round 8.88 -> 8.32 ms, docs/performance.md).

    The weight is [G, U, R, in] with logical axes `axes`; U is the parts' units summed. Part p holds units
    [u_p, u_p + units_p) of every group, and its HF weight [G * units_p * R, in] is those rows group after
    group: HF row (g * units_p + u) * R + r is packed row (g, u_p + u, r). So a tensor-parallel split of G
    keeps whole groups: every device gets its own heads of every part. Examples: GQA's q|k|v with n KV heads
    of m query heads, head dim d: G = n, R = d, parts q (m units), k (1), v (1); SwiGLU's gate|up: G = 1,
    R = the intermediate size, parts gate (1), up (1).

    Calling it returns every part's output [..., G * units_p * R] as that part's own `Linear` would (the same
    features in the same order). FP8 (`apply_fp8`): where the scale blocks' rows divide R (`fp8_packs`: every
    block lies inside one unit of one group, e.g. Qwen3-8B's 128-row heads and 12288-row MLP halves in 128 x 128
    blocks) the packed weight becomes FP8 with its scales packed alike, `weight_scale_inv` [G, U, R / bo,
    ceil(in / bi)], and still runs as one matmul; elsewhere the parts become separate `Linear`s under this module,
    named as the parts (`keep_apart`: their scale blocks would straddle the groups). `ModelParams.flat` names the
    parameters as HF does either way.
    """

    def __init__(self, in_features: int, groups: int, rows: int, parts: tuple[Part, ...],
                 axes: tuple[str | None, ...], *, dtype, rngs):
        self.parts = tuple(parts)
        units = sum(part.units for part in parts)
        # `groups` for the tp rule: G whole groups when G is ruled (so a warning counts heads, not features).
        self.weight = param(rngs, (groups, units, rows, in_features), dtype, axes, "normal",
                            groups if axes[0] is not None else None)
        self.block = None  # (bo, bi) once the packed weight is FP8

    @property
    def packed(self) -> bool:
        return hasattr(self, "weight")

    def __call__(self, x: jax.Array, runtime: Runtime) -> tuple[jax.Array, ...]:
        """x [..., in] -> one output [..., G * units_p * R] per part, in x's dtype. `runtime` says how FP8 weights
        multiply (`fp8_linear`)."""
        if not self.packed:
            return tuple(getattr(self, part.name)(x, runtime) for part in self.parts)
        y = self.packed_output(x, runtime)
        outs, start = [], 0
        for part in self.parts:
            outs.append(y[..., start:start + part.units, :].reshape(*x.shape[:-1], -1))
            start += part.units
        return tuple(outs)

    def packed_output(self, x: jax.Array, runtime: Runtime) -> jax.Array:
        """x [..., in] -> every part's output unsplit, [..., G, U, R] in x's dtype (while `packed`); the weight as
        one [G U R, in] matrix where it streams (`dense_stream_config`) or is FP8 (`fp8_linear`)."""
        weight = self.weight[...]
        g, u, r, n_in = weight.shape
        if self.block is not None:
            scale = self.weight_scale_inv[...]
            y = fp8_linear(x, weight.reshape(g * u * r, n_in), scale.reshape(-1, scale.shape[-1]), self.block, runtime)
        elif self.streams(math.prod(x.shape[:-1]), runtime, x.dtype):
            y = linear(x, weight.reshape(g * u * r, n_in), runtime)
        else:
            return jnp.einsum("...i,guri->...gur", x, weight.astype(x.dtype))
        return y.reshape(*x.shape[:-1], g, u, r)

    def swiglu_output(self, x: jax.Array, runtime: Runtime) -> jax.Array:
        """`swiglu(gate, up)` of a projection of two parts (SwiGLU's gate|up), [..., R] in x's dtype: in the
        streaming kernel's epilogue where the packed weight streams (`linear` / `fp8_linear` with `glu`), else after
        the parts' outputs."""
        if GLU_IN_EPILOGUE and self.packed and self.weight.shape[:2] == (1, 2):
            weight = self.weight[...].reshape(-1, self.weight.shape[-1])
            if self.block is not None:
                scale = self.weight_scale_inv[...]
                return fp8_linear(x, weight, scale.reshape(-1, scale.shape[-1]), self.block, runtime, glu=True)
            if dense_stream_config(weight.shape, math.prod(x.shape[:-1]), runtime, dtype=x.dtype, glu=True):
                return linear(x, weight, runtime, glu=True)
        return swiglu(*self(x, runtime))

    def streams(self, rows: int, runtime: Runtime, dtype) -> bool:
        """Whether a call of `rows` rows multiplies the packed weight in the streaming kernel (`packed_output`)."""
        if not self.packed:
            return False
        g, u, r, n_in = self.weight.shape
        if self.block is not None:
            return fp8_stream_config((g * u * r, n_in), self.block, rows, runtime) is not None
        return dense_stream_config((g * u * r, n_in), rows, runtime, dtype=dtype) is not None

    def fp8_rows_group(self, rows: int, runtime: Runtime) -> int | None:
        """The input features a group of FP8 rows spans where a call of `rows` rows streams the packed FP8 weight
        W8A8 with each step one group (the rows the kernel would quantise itself, which the norm before may hand
        quantised: `QuantizedRows`), else None."""
        if not self.packed or self.block is None or runtime.fp8_matmul is not Fp8Matmul.W8A8:
            return None
        g, u, r, n_in = self.weight.shape
        config = fp8_stream_config((g * u * r, n_in), self.block, rows, runtime)
        return self.block[1] if config is not None and config.block_k == self.block[1] else None

    def fp8_packs(self, block: tuple[int, int]) -> bool:
        """Whether FP8 blocks of `block` keep this module packed: their rows divide R, so each lies inside one unit
        of one group (the HF scale rows of a part are then its units' rows over bo, group after group)."""
        return self.packed and self.weight.shape[2] % block[0] == 0

    def to_fp8(self, block: tuple[int, int]) -> None:
        """Quantise the packed weight in place into FP8 blocks of `block` (`fp8_packs` must hold): the blocks the
        parts' HF weights have, so the parts' HF scales are `unpack` of the packed ones."""
        if not self.fp8_packs(block):
            raise ValueError(f"FP8 blocks {tuple(block)} do not divide the packed rows ({self.weight.shape[2]})")
        g, u, r, n_in = self.weight.shape
        axes, groups = self.weight.axes, getattr(self.weight, "groups", None)
        weight, scale = fp8.quantize(self.weight[...].reshape(g * u * r, n_in), block)
        self.weight = nnx.Param(weight.reshape(g, u, r, n_in), axes=axes, groups=groups)
        scale_axes = (*axes[:3], fp8.scale_axes(axes[3:], (n_in,), block[1:])[0])
        self.weight_scale_inv = nnx.Param(scale.reshape(g, u, r // block[0], -1), axes=scale_axes, groups=groups)
        self.block = tuple(block)

    def unpack(self, weight) -> dict[str, object]:
        """A packed [G, U, rows, last] array (an array or a ShapeDtypeStruct): the weight [G, U, R, in], or FP8
        scales [G, U, R / bo, ceil(in / bi)] -> {part name: its HF array [G * units * rows, last]}."""
        g, _, rows, last = weight.shape
        out, start = {}, 0
        for part in self.parts:
            shape = (g * part.units * rows, last)
            out[part.name] = (jax.ShapeDtypeStruct(shape, weight.dtype) if isinstance(weight, jax.ShapeDtypeStruct)
                              else weight[:, start:start + part.units].reshape(shape))
            start += part.units
        return out

    def pack(self, weights: dict[str, object]):
        """{part name: HF array} (NumPy or JAX arrays; weights, or FP8 scales) -> the packed array [G, U, rows,
        last], `unpack`'s inverse."""
        g = self.weight.shape[0]
        xp = np if all(isinstance(w, np.ndarray) for w in weights.values()) else jnp
        parts = [weights[part.name] for part in self.parts]
        return xp.concatenate([xp.reshape(w, (g, part.units, -1, w.shape[-1])) for part, w in zip(self.parts, parts)],
                              axis=1)

    def keep_apart(self) -> None:
        """Hold the parts as separate `Linear`s (named as the parts) with the packed weight's values."""
        weight = self.weight
        for part, w in self.unpack(weight[...]).items():
            spec = next(p for p in self.parts if p.name == part)
            linear = Linear(w.shape[1], w.shape[0], spec.axes, dtype=w.dtype, rngs=None, groups=spec.groups)
            linear.weight = nnx.Param(w, axes=spec.axes, groups=spec.groups)
            setattr(self, part, linear)
        del self.weight


class SwiGLU(nnx.Module):
    """Qwen MLP: down(silu(gate(x)) * up(x)) (`swiglu`), gate|up packed (`PackedProjections`)."""

    def __init__(self, hidden: int, intermediate: int, *, dtype, rngs):
        parts = (Part("gate_proj", 1, ("mlp", "embed")), Part("up_proj", 1, ("mlp", "embed")))
        self.gate_up_proj = PackedProjections(hidden, 1, intermediate, parts, (None, None, "mlp", "embed"),
                                              dtype=dtype, rngs=rngs)
        self.down_proj = Linear(intermediate, hidden, ("embed", "mlp"), dtype=dtype, rngs=rngs)

    def __call__(self, x: jax.Array, runtime: Runtime) -> jax.Array:
        """x [..., e] -> [..., e]."""
        return self.down_proj(self.gate_up_proj.swiglu_output(x, runtime), runtime)


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
    # The row-invariant kernel has no sliding window: a windowed layer keeps the fast kernel.
    invariant = runtime.row_invariant and sliding_window is None
    attend = functools.partial(tree_attention, scale=scale, sliding_window=sliding_window,
                               implementation=implementation,
                               config=ROW_INVARIANT_CONFIG if invariant else ATTENTION_CONFIG)
    args = (q, k_cache, v_cache, cache_lengths, k_new, v_new, new_mask, positions)
    mesh = runtime.tp_mesh
    if not runtime.pallas or mesh is None or k_cache.shape[2] % mesh.size:
        return attend(*args)
    heads, rep = P(None, None, "model", None), P()
    sharded = jax.shard_map(attend, mesh=mesh, in_specs=(heads, heads, heads, rep, heads, heads, rep, rep),
                            out_specs=heads, check_vma=False)
    return sharded(*args)
