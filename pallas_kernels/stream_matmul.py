"""Weight-streaming matmul for few rows (Pallas, Triton): y [t, n] = x [t, k] @ w [n, k]^T.

At decode time the rows are the tokens a call verifies (1 for AR, bs for DFlash, B + 1 for DDTree) and the
cost is reading w once: 16 GB per Qwen3-8B step. cuBLAS streams it at ~4.1 TB/s for one row but at ~3.2
TB/s for 65 (docs/performance.md). Here every row count runs the same streaming loop:

- one program owns `block_n` rows of w and one of `splits` slices of the k axis, and walks its slice in
  `block_k` steps (Triton pipelines the loads `num_stages` deep), multiplying each [block_n, block_k]
  weight tile by x^T's rows in power-of-two tiles >= 16 (65 rows as 64 + 16: padding to one power of two
  would multiply 128; 17 as one tile of 32, not 16 + 16) into float32 [block_n, tile] accumulators;
- the `splits` partial sums are added in a fixed order outside the kernel (split order, in float32, then one
  rounding; by XLA, or by a small Pallas kernel with `SPLIT_SUMS_KERNEL`), so that small matrices still give every
  streaming multiprocessor work (`splits` defaults to about two programs per multiprocessor); with one split the
  kernel writes y itself ([t, n] in its dtype: no XLA epilogue);
- more than GROUP_ROWS rows (a batch of trees under `Runtime.row_invariant`) go in groups of GROUP_ROWS, a grid
  axis: each group's programs stream the weight again (from L2 where its tiles are still there), and a row's
  arithmetic is the same in every group;
- x comes in unpadded: a row tile's rows past t are masked loads of zeros (a pad before the kernel was a launch of
  its own: its producer is mostly another Pallas kernel, into which XLA fuses nothing), and `fp8_bits`' scaling of
  x (below) is done on the loaded tile;
- with `glu` (w the packed gate|up [2 m, k], one split) each program streams its gate rows and the same up rows
  and writes `swiglu(gate, up)` [t, m].

Block-scaled FP8 weights (the published format, `ddtree_jax/models/fp8.py`): with `scale_inv` [ceil(n / bo),
ceil(k / bi)] and `block` (bo, bi), w is float8_e4m3fn and stays so in memory (half the bytes to stream); each
[block_n, block_k] tile (inside one scale block: block_n divides bo, block_k divides bi) is widened to x's dtype
in registers (exact: every e4m3 value is a bfloat16 one), multiplied into a float32 tile of partial sums, and that
tile times its block's scale is added to the accumulator: sum over blocks of s_b (sum over the block of q x),
which is the product with the dequantised weight up to float32 rounding.

Widening FP8 to bfloat16 (`fp8_bits`). Triton widens e4m3 to bfloat16 through float16: one conversion a pair to
float16 (F2FP), then one F2F a value to bfloat16 (its SASS for sm_90, tools/triton_offline.py); the CUDA guide's
throughput table gives such conversions 16 results per cycle per multiprocessor against 64 for integer logic,
where streaming an FP8 weight at the H200's bandwidth needs ~18 values per cycle (the FP8 kernel ran at ~2.7x its
floor, docs/performance.md). With `fp8_bits=1` the float16 pair is moved into bfloat16's fields by integer ops
instead (`_PLACE_ASM`: a shift and two masks a pair, no F2F). Moved unrebiased, the exponent keeps float16's bias
(15) where bfloat16 has 127: the tile is the weight times 2^-112, exactly, and normal (every e4m3 value, its
subnormals included, is a normal float16, so no subnormal reaches the multiply, which some flush: XLA's CPU dot
does). So that no product leaves float32's normal range, x comes in times 2^64 (exact below 2^64) and each tile's
partial sums are scaled back with the block's scale; a power of two scales every product alike, so the sums
round as the widened tile's do: the same bits as `fp8_bits=0` unless a product falls below float32's normal range
(under 2^-78 in the true units).

FP8 activations too (W8A8): x's rows quantised to float8_e4m3fn per row and input block of bi features
(`quantize_rows`: the per-token, per-128-feature dynamic quantisation of the published checkpoints' activations,
with power-of-two scales), either given (x float8_e4m3fn with its float32 scales `x_scale` [t, ceil(k / bi)]) or
done inside the kernel (`quantize_x`: x in its float dtype, block_k = bi, so that each step's row tile is one
group: its largest |x| per row, the scale from it, one multiply and one rounding per entry, the same bits as
`quantize_rows`; no launch of its own, and the rows' [t, k] tile is small beside the weight tile every program
streams). Then nothing is widened: each [block_n, block_k] weight tile and each row tile of FP8 x go to the
tensor cores (Hopper's FP8 wgmma), and the float32 tile of partial sums is scaled by the weight block's scale
times each row's scale before it is added: sum over blocks of s_b x_s[r] (sum over the block of q_w q_x). Hopper
accumulates FP8 products inside one instruction in fewer than float32's bits, so a block's partial sum may differ
from the exact one in its last bits (the tests' tolerance says how far); a row's arithmetic still depends on
nothing but that row.

Letters: t rows (tokens), tg rows per group, tp padded rows, k input features, n output features, s splits of k.
`stream_matmul_reference` is the plain-jnp restatement (float32 accumulation, result in x's dtype; an FP8
weight dequantised in float32 first).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels._dispatch import check_knobs, core_count, next_pow2, resolve_implementation, resolve_interpret
from pallas_kernels._fp8_dot import fp8_dot
from pallas_kernels.launch import kernel_body


GROUP_ROWS = 128  # the most rows one program multiplies (its accumulators: block_n x 128 float32)

# The partial sums of more than one split added by a small Pallas kernel of their own (`_sum_splits`: the same adds in
# split order, the same bits), not by the XLA fusion after the streaming kernel. Every Pallas kernel signals its
# dependents at its entry (`pallas_kernels.launch`) and XLA's fusions do not, so a fusion's successor is placed on
# the multiprocessors only once the fusion has ended: at the 8B AR step three of a layer's four XLA kernels are these
# sums. Off: on an H100 (2026-12-06, `python tools/with_knobs.py engine:split_sums_kernel=1 -m ddtree_jax.bench
# --shape qwen3-8b --budgets 64 ...`, alternating with the defaults, two runs each) the AR step took 5.97 / 5.94 ms
# against 5.91 / 6.03 (no gain), the DFlash round 7.86 / 7.87 against 7.63 / 7.61 (3% slower; untraced: the
# kernel's grid at 16 rows is 16-24 programs), B = 64 8.43 / 8.43 against 8.37 / 8.45; with SwiGLU in the epilogue
# too, the same.
SPLIT_SUMS_KERNEL = False


def fp8_row_scales(amax: jax.Array) -> tuple[jax.Array, jax.Array]:
    """float32 [...] each group's largest |x| -> (scale, inverse) float32 [...]: scale the least power of two at
    or above amax / 448 (1 for an all-zero group), inverse = 1 / scale, both exact (so that the quantisation
    x * inverse, exact, then one rounding to float8_e4m3fn, is the same bits in XLA and inside a kernel: no
    division, which Triton rounds approximately). Exponent and mantissa bits only: 448 = 1.75 x 2^8, so for
    amax = 1.m x 2^e the scale is 2^(e - 8), or 2^(e - 7) where 1.m > 1.75. Every x of the group then maps into
    [-448, 448] with the largest above 224: e4m3's relative precision is its mantissa's in every binade, so a
    power of two loses nothing against amax / 448 above e4m3's subnormals (at most one binade of those). Works
    on jnp arrays and inside Pallas kernels. Example: amax 448 -> 1, 449 -> 2, 1.0 -> 2^-8."""
    bits = lax.bitcast_convert_type(amax.astype(jnp.float32), jnp.int32)
    biased = ((bits >> 23) & 0xFF) - 8 + ((bits & 0x7FFFFF) > 0x600000).astype(jnp.int32)
    biased = jnp.clip(biased, 1, 253)  # normal scales and inverses (a subnormal amax: 2^-126, its x still fit)
    scale = lax.bitcast_convert_type(biased << 23, jnp.float32)
    inverse = lax.bitcast_convert_type((254 - biased) << 23, jnp.float32)
    zero = amax == 0
    return jnp.where(zero, 1.0, scale), jnp.where(zero, 1.0, inverse)


@functools.partial(jax.jit, static_argnames=("group",))
def quantize_rows(x: jax.Array, group: int) -> tuple[jax.Array, jax.Array]:
    """Activations [t, k] -> (float8_e4m3fn [t, k], float32 scales [t, ceil(k / group)]): each row's groups of
    `group` features (the last one partial where group does not divide k) scaled by `fp8_row_scales` of the
    group's largest |x|, x * inverse rounded to nearest (no clip needed: |x * inverse| <= 448, exactly). The
    dynamic per-token quantisation the W8A8 kernel applies (`quantize_x`), with `group` the weight block's input
    size (128); a row's result depends on that row alone. x = q * scale up to e4m3's rounding."""
    t, k = x.shape
    groups = -(-k // group)
    q, scale = quantize_groups(jnp.pad(x.astype(jnp.float32), ((0, 0), (0, groups * group - k))), group)
    return q[:, :k], scale


def quantize_groups(x: jax.Array, group: int) -> tuple[jax.Array, jax.Array]:
    """x [..., k], k a multiple of `group` -> (float8_e4m3fn codes [..., k], float32 scales [..., k / group]): each
    group's largest |x| gives its scale (`fp8_row_scales`), codes = x * inverse rounded once. jnp arrays and Pallas
    kernels alike (`quantize_rows`; the add + RMSNorm kernel's FP8 rows)."""
    x32 = x.astype(jnp.float32).reshape(*x.shape[:-1], x.shape[-1] // group, group)
    scale, inverse = fp8_row_scales(jnp.max(jnp.abs(x32), axis=-1))
    return (x32 * inverse[..., None]).astype(jnp.float8_e4m3fn).reshape(x.shape), scale


@dataclasses.dataclass(frozen=True)
class StreamMatmulConfig:
    """Tuning knobs (static, hashable).

    block_n:  weight rows per program; a power of two >= 16.
    block_k:  input features per step; a power of two >= 16.
    splits:   slices of the k axis (each its own program); None: chosen among the divisors of k / block_k
              (`balance`).
    balance:  how None splits are chosen: 0 about two programs per streaming multiprocessor; 1 the programs
              spread most evenly over the multiprocessors (the most even whole waves, within 3%; nearest two per
              multiprocessor among those): e.g. 80 weight blocks (a [5120, k] weight) in 8 splits (640 programs,
              5 waves of 132 less 20) where 0 takes 2 (160: 28 multiprocessors stream twice what the rest do);
              2 as 1 where 0's programs are at most two a multiprocessor (where an uneven share costs most: one
              multiprocessor streaming twice another's bytes), else as 0 (e.g. the 27B's gate|up in 544 programs,
              one split: as 1 it takes 4, whose partial sums at 16 rows are 8.9 MB).
    num_warps, num_stages: Triton's warps per program and software-pipelining depth.
    row_tile: None: the rows in tiles that are powers of two >= 16, largest first (65 rows as 64 + 16); a power of
              two >= 16: every tile that many rows, so that every row count multiplies with one mma shape (Triton
              takes Hopper's wgmma for 64-row tiles and mma.sync for 16-row ones; the row-invariant models take 16).
    fp8_bits: how FP8 tiles become bfloat16 when x is bfloat16 (module docstring): 0 Triton's conversions, 1 to
              float16 by Triton's, then into bfloat16's fields by integer ops. No effect otherwise.
    promote_k: with FP8 rows (`x_scale`), the most of a step's block_k inputs that Hopper's FP8 tensor cores sum in
              their own precision before the sum joins float32 (`pallas_kernels._fp8_dot`; >= 32); None: block_k,
              one promotion a step; 0: no FP8 wgmma, Pallas's own dot (Triton then multiplies float16 copies of
              both tiles with mma.sync: the same products in float32). No effect otherwise.
    max_stages: 0: `num_stages` as given; more: the deepest pipeline up to this many stages (never fewer than
              `num_stages`) with which every program of the grid still fits on the multiprocessors at once by shared
              memory (`fitting_stages`). A program keeps (stages - 1) steps' tiles in flight; at one row an FP8 step
              is half a bf16 one's bytes (8 KiB at 64 x 128), so at the default depth an FP8 grid has half the bytes
              in flight that a bf16 one has, and a stream bound by its loads' latency runs at what is in flight over
              that latency, not at the bandwidth. On an H100 `max_stages=8` made the 8B's FP8 rounds 2-7% slower
              (docs/performance.md, 2026-12-07); untimed on an H200.
    prefetch: 1: a step's small operands (an FP8 weight block's scale, FP8 rows' scales) are loaded one step
              ahead and carried into the next step. Triton's pipeliner copies the weight and row tiles ahead
              asynchronously (cp.async) but not these: each is a synchronous global load inside the loop (a scalar,
              or under 4 bytes a thread: too narrow for cp.async; the PTX of the sm_90 build,
              tools/triton_offline.py), whose latency every step waits out before its scaling. 0: loaded in the
              step that uses them. The same values either way: the same bits.
    """

    block_n: int = 64
    block_k: int = 128
    splits: int | None = None
    num_warps: int = 4
    num_stages: int = 4
    row_tile: int | None = None
    fp8_bits: int = 0
    promote_k: int | None = None
    balance: int = 0
    prefetch: int = 0
    max_stages: int = 0

    def __post_init__(self):
        check_knobs(self, pow2={"block_n": 16, "block_k": 16}, optional_counts=("splits",))
        if not isinstance(self.max_stages, int) or isinstance(self.max_stages, bool) or self.max_stages < 0:
            raise ValueError(f"StreamMatmulConfig.max_stages={self.max_stages!r}: must be an int >= 0")
        for knob, values in (("balance", (0, 1, 2)), ("prefetch", (0, 1))):
            if getattr(self, knob) not in values or isinstance(getattr(self, knob), bool):
                raise ValueError(f"StreamMatmulConfig.{knob}={getattr(self, knob)!r}: must be one of {values}")
        if self.row_tile is not None and (isinstance(self.row_tile, bool) or not isinstance(self.row_tile, int)
                                          or self.row_tile < 16 or self.row_tile & (self.row_tile - 1)):
            raise ValueError(f"StreamMatmulConfig.row_tile={self.row_tile!r}: must be None or a power of two >= 16")
        if self.fp8_bits not in (0, 1) or isinstance(self.fp8_bits, bool):
            raise ValueError(f"StreamMatmulConfig.fp8_bits={self.fp8_bits!r}: must be 0 or 1")
        if self.promote_k is not None and (isinstance(self.promote_k, bool) or not isinstance(self.promote_k, int)
                                           or (self.promote_k != 0 and self.promote_k < 32)):
            raise ValueError(f"StreamMatmulConfig.promote_k={self.promote_k!r}: must be None, 0 or an int >= 32")


# `fp8_bits=1`: a placed e4m3 tile is the weight times 2^PLACED_EXPONENT; x comes in times 2^X_PRESCALE_EXPONENT.
PLACED_EXPONENT = -112
X_PRESCALE_EXPONENT = 64
# On a GPU, a pair of e4m3 bytes (a 16-bit register: the multiply's operand layout holds k in pairs) at a time:
# converted to a float16 pair, each half s eeeee mmm0000000 becomes s 000 eeeee mmm 0000: an arithmetic shift by
# three of the pair keeps the high half's sign in place (the mask clears its copies); the low half's sign comes
# from the pair before the shift (the shift moves the high half's zero mantissa bits into the low half's top).
_PLACE_ASM = """{
.reg .b32 h, t;
cvt.rn.f16x2.e4m3x2 h, $1;
shr.s32 t, h, 3;
and.b32 t, t, 0x8FFF0FFF;
and.b32 h, h, 0x00008000;
or.b32 $0, t, h;
}"""


def _fp8_tile_as_bf16(w: jax.Array, asm: bool) -> jax.Array:
    """float8_e4m3fn [..] -> bfloat16 [..] equal to w x 2^PLACED_EXPONENT, through float16 and placed bits (e4m3's
    NaN becomes a finite value: a checkpoint holds none). `asm`: as PTX (compiled kernels); else the same bits by
    jnp ops."""
    if asm:
        return plt.elementwise_inline_asm(_PLACE_ASM, args=[lax.bitcast_convert_type(w, jnp.uint8)],
                                          constraints="=r,h", pack=2,
                                          result_shape_dtypes=[jax.ShapeDtypeStruct(w.shape, jnp.bfloat16)])[0]
    h = lax.bitcast_convert_type(w.astype(jnp.float16), jnp.uint16)
    return lax.bitcast_convert_type(((h >> 3) & 0x0FFF) | (h & 0x8000), jnp.bfloat16)


def _tile_starts(row_tiles: tuple[int, ...]) -> list[int]:
    """The first row of each row tile inside a group: (64, 16) -> [0, 64]."""
    return [sum(row_tiles[:i]) for i in range(len(row_tiles))]


def _row_tiles(t: int, row_tile: int | None = None) -> tuple[int, ...]:
    """t rows as row tiles that are powers of two >= 16, largest first, a rest of 17-32 rows in one tile of 32:
    65 -> (64, 16), 17 -> (32,), 49 -> (32, 32), 128 -> (128,). Padding t to one power of two would multiply 65
    rows as 128; these multiply 80. Two tiles of 16 ran 2.1x slower than one of 32 (12 Qwen3-8B layers' FP8
    projections at 17 rows on the H200: 3.57 against 1.68 ms; 1.43 ms at 16 rows, 2026-12-05, docs/performance.md).
    With `row_tile`, tiles of that many rows: 65 -> (16,) * 5 at 16."""
    if row_tile is not None:
        return (row_tile,) * -(-t // row_tile)
    tiles = []
    while t > 0:
        size = 32 if 16 < t <= 32 else max(16, 1 << (t.bit_length() - 1))  # the largest power of two <= t, >= 16
        tiles.append(size)
        t -= size
    return tuple(tiles)


def swiglu(gate: jax.Array, up: jax.Array) -> jax.Array:
    """SwiGLU's silu(gate) * up, elementwise in the inputs' dtype: silu in float32 then rounded to that dtype, the
    product in float32 then rounded (as PyTorch's bfloat16 ops round, and no rounding in float32). The one form of
    the Qwen MLP's activation, inside the streaming kernel's epilogue (`glu`) and outside it."""
    g = gate.astype(jnp.float32)
    silu = (g * (1.0 / (1.0 + jnp.exp(-g)))).astype(gate.dtype)
    return (silu.astype(jnp.float32) * up.astype(jnp.float32)).astype(gate.dtype)


def _kernel(x_ref, w_ref, *refs, block_k: int, steps: int, precision, scale_block: tuple[int, int] | None,
            row_tiles: tuple[int, ...], rows: int, fp8_bits: int, fp8_rows: bool, quantize_x: bool, promote_k: int,
            whole_out: bool, asm: bool, glu_rows: int | None, prefetch: int):
    # x_ref [t, k] all of x, unpadded (`rows` = t: a row tile's rows past t are masked loads of zeros, so no pad
    # launches before the kernel); w_ref [block_n, ks] weight rows, this split's k slice; o_ref [tg, block_n] f32,
    # this split's partial sums, or with one split (`whole_out`) o_ref [t, n] the result in its dtype;
    # with FP8 weights, s_ref [so, si] all the block scales (one scalar read per step); with FP8 rows too
    # (`fp8_rows`), xs_ref [si, tp] every row's scales, transposed so that a row tile's are one contiguous read; with
    # `quantize_x` the rows come in their float dtype and each step's tile (one group: block_k = bi) is quantised
    # here. The rows go in `row_tiles` (tg = their sum), each with its own accumulator; every weight tile is loaded
    # once for all. With `glu_rows` = m (SwiGLU, one split), a second weight ref holds the up rows (gate row + m)
    # of this program's gate rows, and the epilogue writes silu(gate) * up.
    w_refs = (w_ref, refs[0]) if glu_rows else (w_ref,)
    refs = refs[1:] if glu_rows else refs
    if fp8_rows and not quantize_x:
        s_ref, xs_ref, o_ref = refs
    else:
        s_ref, o_ref = refs if scale_block is not None else (None, *refs)
    block_n = w_ref.shape[0]
    if scale_block is not None:
        weight_scale_rows = [(j * (glu_rows or 0) + pl.program_id(0) * block_n) // scale_block[0]
                             for j in range(len(w_refs))]
        first_col = pl.program_id(1) * steps * block_k
    starts = _tile_starts(row_tiles)
    group_row = pl.program_id(2) * sum(row_tiles)  # this group's first row in x_ref and xs_ref
    split_col = pl.program_id(1) * steps * block_k  # this split's first column of x_ref

    def small_operands(i):  # step i's scales: (weight scales per w_ref, row scales per tile)
        scales, row_scales = (), ()
        if scale_block is not None:
            block_col = (first_col + i * block_k) // scale_block[1]
            scales = tuple(s_ref[row, block_col].astype(jnp.float32) for row in weight_scale_rows)
            if fp8_rows and not quantize_x:
                row_scales = tuple(xs_ref[block_col, pl.ds(group_row + start, size)]
                                   for start, size in zip(starts, row_tiles))
        return scales, row_scales

    def step(i, carry):
        accs, ahead = carry
        if prefetch:  # this step's were loaded by the step before; load the next step's now (the last: again)
            (scales, row_scales), ahead = ahead, small_operands(jnp.minimum(i + 1, steps - 1))
        else:
            scales, row_scales = small_operands(i)
        cols = pl.ds(i * block_k, block_k)
        ws = []
        for ref in w_refs:
            w = ref[:, cols]  # FP8 rows: FP8 as it is; FP8 widened in registers once for every row tile; else as it is
            ws.append(w if fp8_rows else _fp8_tile_as_bf16(w, asm) if fp8_bits else w.astype(x_ref.dtype))
        if fp8_bits:
            scales = tuple(scale * 2.0 ** -(PLACED_EXPONENT + X_PRESCALE_EXPONENT) for scale in scales)
        new = []
        for r, (start, size) in enumerate(zip(starts, row_tiles)):
            row_ok = group_row + start + jnp.arange(size, dtype=jnp.int32) < rows
            x = plt.load(x_ref.at[pl.ds(group_row + start, size), pl.ds(split_col + i * block_k, block_k)],
                         mask=jnp.broadcast_to(row_ok[:, None], (size, block_k)), other=0.0)
            if fp8_bits:
                x = x * jnp.asarray(2.0 ** X_PRESCALE_EXPONENT, x.dtype)  # exact below 2^64 (module docstring)
            if quantize_x:  # this tile is one group of each row: `quantize_rows`, inline
                x32 = x.astype(jnp.float32)
                x_scale, inverse = fp8_row_scales(jnp.max(jnp.abs(x32), axis=1))
                x = (x32 * inverse[:, None]).astype(jnp.float8_e4m3fn)
            elif fp8_rows:
                x_scale = row_scales[r]
            for j, w in enumerate(ws):
                scale = scales[j] if scales else None
                if fp8_rows:  # FP8 tensor cores, then the weight block's scale times each row's
                    tile = fp8_dot(w, x, promote_k) if promote_k else lax.dot_general(
                        w, x, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
                    tile = tile * (scale * x_scale)[None, :]
                else:
                    tile = lax.dot_general(w, x, (((1,), (1,)), ((), ())), precision=precision,
                                           preferred_element_type=jnp.float32)
                    tile = tile if scale is None else tile * scale
                new.append(accs[r * len(ws) + j] + tile)
        return tuple(new), ahead

    zeros = tuple(jnp.zeros((block_n, size), jnp.float32) for size in row_tiles for _ in w_refs)
    accs, _ = lax.fori_loop(0, steps, step, (zeros, small_operands(0) if prefetch else ()))
    for r, (start, size) in enumerate(zip(starts, row_tiles)):
        acc = accs[r * len(w_refs)]
        if whole_out:  # the result itself: rows past t left out, transposed, in the output's dtype
            y = acc.T.astype(o_ref.dtype)
            if glu_rows:
                y = swiglu(y, accs[r * 2 + 1].T.astype(o_ref.dtype))
            row_ok = group_row + start + jnp.arange(size, dtype=jnp.int32) < rows
            plt.store(o_ref.at[pl.ds(group_row + start, size), pl.ds(pl.program_id(0) * block_n, block_n)],
                      y, mask=jnp.broadcast_to(row_ok[:, None], (size, block_n)))
        else:
            o_ref[pl.ds(start, size), :] = acc.T


def fitted_config(n: int, k: int, block: tuple[int, int] | None = None,
                  config: StreamMatmulConfig | None = None) -> StreamMatmulConfig | None:
    """`config` (default: the defaults) with `block_n` and `block_k` lowered to the largest powers of two
    (>= 16) that divide n and k, and with FP8 weights the scale block (bo, bi), so that the kernel tiles a
    [n, k] weight; None where no such tile exists (n or k, or a scale block dim, not a multiple of 16).
    Example: n = 320, k = 64, block (128, 128): block_n 64 (divides 320 and 128), block_k 64."""
    config = StreamMatmulConfig() if config is None else config

    def largest(cap: int, *dims: int) -> int | None:
        size = cap
        while size >= 16 and any(d % size for d in dims):
            size //= 2
        return size if size >= 16 else None

    block_n = largest(config.block_n, n, *(block[:1] if block is not None else ()))
    block_k = largest(config.block_k, k, *(block[1:] if block is not None else ()))
    if block_n is None or block_k is None:
        return None
    splits = config.splits if config.splits is not None and k % (config.splits * block_k) == 0 else None
    return dataclasses.replace(config, block_n=block_n, block_k=block_k, splits=splits)


# Shared memory of one multiprocessor on sm_90 (H100, H200: 228 KiB), of which each resident program reserves 1 KiB.
SHARED_MEMORY_PER_CORE = 233472
SHARED_MEMORY_RESERVED = 1024


def fitting_stages(programs: int, stage_bytes: int, least: int, most: int, cores: int) -> int:
    """The most pipeline stages s in [least, most] with which `programs` programs of s x `stage_bytes` shared memory
    each all fit on `cores` multiprocessors at once (ceil(programs / cores) a multiprocessor, each program reserving
    SHARED_MEMORY_RESERVED more); `least` where none does. `stage_bytes` is one step's tiles (the weight tiles and
    the row tile as loaded), an upper bound of what Triton's pipeliner keeps a stage (sm_90 builds, 2026-12-07,
    `tools/triton_offline.py`: 10 KiB a stage for a 64 x 128 FP8 weight tile with 16 FP8 rows, exactly; 12 less 2
    KiB in all with 16 bfloat16 rows). Example: 384 programs (3 a multiprocessor of 132) of 10 KiB steps: 7 stages
    (3 x 71 KiB fit 228, 3 x 81 do not)."""
    per_core = -(-programs // cores)
    fits = [s for s in range(least, most + 1)
            if per_core * (s * stage_bytes + SHARED_MEMORY_RESERVED) <= SHARED_MEMORY_PER_CORE]
    return max(fits, default=least)


def _splits(k: int, n_blocks: int, config: StreamMatmulConfig) -> int:
    if config.splits is not None:
        if k % (config.splits * config.block_k):
            raise ValueError(f"k={k} does not divide into splits={config.splits} x block_k={config.block_k}")
        return config.splits
    steps, cores = k // config.block_k, core_count()
    divisors = [s for s in range(1, steps + 1) if steps % s == 0]
    want = max(1, round(2 * cores / n_blocks))
    about_two = max(s for s in divisors if s <= want)
    if not config.balance or (config.balance == 2 and n_blocks * about_two > 2 * cores):
        return about_two
    divisors = [s for s in divisors if s == 1 or steps // s >= 2]  # two steps a program at least: a pipeline

    def evenness(s):  # the programs over the multiprocessors' whole waves (1: every multiprocessor alike)
        programs = n_blocks * s
        return programs / (cores * -(-programs // cores))

    best = max(map(evenness, divisors))
    return min((s for s in divisors if evenness(s) >= best - 0.03), key=lambda s: (abs(n_blocks * s - 2 * cores), s))


@functools.partial(jax.jit, static_argnames=("block", "quantize_x", "config", "out_dtype", "glu", "interpret",
                                             "debug"))
def stream_matmul_pallas(x, w, scale_inv=None, *, block: tuple[int, int] | None = None, x_scale=None,
                         quantize_x: bool = False, config: StreamMatmulConfig | None = None, out_dtype=None,
                         glu: bool = False, interpret: bool = False, debug: bool = False) -> jax.Array:
    """The Pallas kernel; arguments and result as `stream_matmul_reference`, plus the knobs (with `quantize_x`,
    block_k must be the scale block's bi: a step's tile is one group). With `glu` and one split, each program
    streams its gate rows and the same up rows (block_n must divide m = n / 2) and writes `swiglu` of the two
    products: no launch after the kernel; with more splits the sums and `swiglu` follow in XLA."""
    config = StreamMatmulConfig() if config is None else config
    _check(x, w, scale_inv, block, x_scale, out_dtype, quantize_x, glu)
    fp8_rows = x_scale is not None or quantize_x
    t, k = x.shape
    n = w.shape[0] // 2 if glu else w.shape[0]  # the output features (glu: m, the gate rows)
    block_n = min(config.block_n, next_pow2(n))
    if n % block_n or k % config.block_k:
        raise ValueError(f"w [n, k] = {w.shape}: {'n / 2' if glu else 'n'} must divide by block_n={block_n} and k by "
                         f"block_k={config.block_k}")
    if block is not None and (block[0] % block_n or block[1] % config.block_k or (glu and n % block[0])):
        raise ValueError(f"FP8 scale blocks {tuple(block)}: block_n={block_n} and block_k={config.block_k} must "
                         "divide them (a tile inside one scale block)"
                         + (f", and they must divide m = {n} (glu: the up rows start a block)" if glu else ""))
    if quantize_x and config.block_k != block[1]:
        raise ValueError(f"quantize_x: block_k={config.block_k} must be the scale block's {block[1]} input features "
                         "(a step's tile is one group of each row)")
    groups = -(-t // GROUP_ROWS)
    row_tiles = _row_tiles(min(t, GROUP_ROWS), config.row_tile)
    tg = sum(row_tiles)  # rows per group
    tp = groups * tg
    splits = _splits(k, n // block_n, config)
    ks = k // splits
    precision = lax.Precision.HIGHEST if x.dtype == jnp.float32 else lax.Precision.DEFAULT
    fp8_bits = config.fp8_bits if block is not None and x.dtype == jnp.bfloat16 and not fp8_rows else 0
    fused_glu = glu and splits == 1
    if glu and not fused_glu:  # the partial sums of gate|up, summed in XLA, then the activation
        y = stream_matmul_pallas(x, w, scale_inv, block=block, x_scale=x_scale, quantize_x=quantize_x, config=config,
                                 out_dtype=out_dtype, interpret=interpret, debug=debug)
        return swiglu(y[:, :n], y[:, n:])
    in_specs = [pl.BlockSpec((t, k), lambda i, s, g: (0, 0)),  # all of x (each step loads its rows' tile, masked)
                pl.BlockSpec((block_n, ks), lambda i, s, g: (i, s))]  # w rows
    # The weight's dtype for x unless the weight is FP8 (then the tiles are widened to x's dtype, or x is FP8 too).
    operands = [x.astype(x.dtype if block is not None else w.dtype), w]
    if fused_glu:  # the same weight again: the up rows of this program's gate rows
        in_specs.append(pl.BlockSpec((block_n, ks), lambda i, s, g: (i + n // block_n, s)))
        operands.append(w)
    if block is not None:
        in_specs.append(pl.BlockSpec(scale_inv.shape, lambda i, s, g: (0, 0)))  # every scale (a scalar read per step)
        operands.append(scale_inv)
    if x_scale is not None:  # every row's scales, [si, tp] (padded rows' are zeros: their products are anyway)
        xs = jnp.pad(x_scale.astype(jnp.float32), [(0, tp - t), (0, 0)]).T
        in_specs.append(pl.BlockSpec(xs.shape, lambda i, s, g: (0, 0)))
        operands.append(xs)
    out_dtype = x.dtype if out_dtype is None else out_dtype
    whole_out = splits == 1  # the kernel writes y itself: no XLA epilogue (sum, slice, transposition, cast)
    if whole_out:
        out_spec, out_shape = pl.BlockSpec((t, n), lambda i, s, g: (0, 0)), jax.ShapeDtypeStruct((t, n), out_dtype)
    else:
        out_spec = pl.BlockSpec((None, tg, block_n), lambda i, s, g: (s, g, i))
        out_shape = jax.ShapeDtypeStruct((splits, tp, n), jnp.float32)
    num_stages = config.num_stages
    if config.max_stages > num_stages:  # one step's tiles: the weight's (gate and up with glu) and the rows' as loaded
        stage_bytes = config.block_k * ((2 if fused_glu else 1) * block_n * w.dtype.itemsize
                                        + tg * (1 if fp8_rows and not quantize_x else x.dtype.itemsize))
        num_stages = fitting_stages(n // block_n * splits * groups, stage_bytes, num_stages, config.max_stages,
                                    core_count())
    kernel = functools.partial(_kernel, block_k=config.block_k, steps=ks // config.block_k, precision=precision,
                               scale_block=None if block is None else tuple(block), row_tiles=row_tiles, rows=t,
                               fp8_bits=fp8_bits, fp8_rows=fp8_rows, quantize_x=quantize_x, whole_out=whole_out,
                               asm=not interpret, glu_rows=n if fused_glu else None, prefetch=config.prefetch,
                               promote_k=config.block_k if config.promote_k is None else config.promote_k)
    out = pl.pallas_call(
        kernel_body(kernel, interpret),
        grid=(n // block_n, splits, groups),
        in_specs=in_specs,
        out_specs=out_spec,
        out_shape=out_shape,
        compiler_params=plt.CompilerParams(num_warps=config.num_warps, num_stages=num_stages),
        interpret=interpret,
        debug=debug,
        name=("stream_matmul" if block is None else "stream_matmul_w8a8" if fp8_rows else "stream_matmul_fp8")
        + ("_glu" if fused_glu else ""),
    )(*operands)
    if whole_out:
        return out
    if SPLIT_SUMS_KERNEL:
        return _sum_splits(out, t, row_tiles, out_dtype, interpret=interpret)
    total = out[0]  # out [splits, tp, n]: added in split order in float32 (the same bits every call), rounded once
    for part in range(1, splits):
        total = total + out[part]
    return total[:t].astype(out_dtype)


def _sum_splits_kernel(partial_ref, out_ref, *, splits: int, tiles: tuple[tuple[int, int], ...], rows: int):
    # partial_ref [splits, tp, block] float32: every split's partial sums of these columns, rows in the streaming
    # kernel's tiles (`tiles`: (first row, rows) of each, powers of two, the ones that hold rows < `rows`); out_ref
    # [rows, block] in the result's dtype. Added in split order in float32, rounded once: the XLA epilogue's
    # arithmetic.
    for start, size in tiles:
        row_ok = start + jnp.arange(size, dtype=jnp.int32) < rows
        mask = jnp.broadcast_to(row_ok[:, None], (size, out_ref.shape[1]))  # padding rows: neither read nor written
        rows_at = pl.ds(jnp.int32(start), size)  # (a traced start: a last tile may reach past out_ref's rows, masked)
        total = plt.load(partial_ref.at[jnp.int32(0), rows_at, :], mask=mask, other=0.0)
        for part in range(1, splits):
            total = total + plt.load(partial_ref.at[jnp.int32(part), rows_at, :], mask=mask, other=0.0)
        plt.store(out_ref.at[rows_at, :], total.astype(out_ref.dtype), mask=mask)


def _sum_splits(partials: jax.Array, t: int, row_tiles: tuple[int, ...], out_dtype, *, interpret: bool) -> jax.Array:
    """partials [splits, tp, n] float32 (each group of rows in `row_tiles`; rows past t padding) -> [t, n] in
    out_dtype: their sum in split order, in a Pallas kernel of its own (`SPLIT_SUMS_KERNEL`), one program per block
    of columns."""
    splits, tp, n = partials.shape
    block = math.gcd(n, 4096 // max(row_tiles))  # a [tile, block] float32 sum in at most 32 registers a thread
    starts = _tile_starts(row_tiles)
    tiles = tuple((g + start, size) for g in range(0, tp, sum(row_tiles)) for start, size in zip(starts, row_tiles)
                  if g + start < t)
    return pl.pallas_call(
        kernel_body(functools.partial(_sum_splits_kernel, splits=splits, tiles=tiles, rows=t), interpret),
        grid=(n // block,),
        in_specs=[pl.BlockSpec((splits, tp, block), lambda j: (0, 0, j))],
        out_specs=pl.BlockSpec((t, block), lambda j: (0, j)),
        out_shape=jax.ShapeDtypeStruct((t, n), out_dtype),
        compiler_params=plt.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name="stream_matmul_split_sums",
    )(partials)


def stream_matmul(x, w, scale_inv=None, *, block: tuple[int, int] | None = None, x_scale=None,
                  quantize_x: bool = False, implementation: str | None = None, config: StreamMatmulConfig | None = None,
                  out_dtype=None, glu: bool = False, interpret: bool | None = None) -> jax.Array:
    """Dispatcher: the Pallas kernel on a GPU, the reference elsewhere (see `pallas_kernels.resolve_implementation`)."""
    if resolve_implementation(implementation) == "reference":
        return stream_matmul_reference(x, w, scale_inv, block=block, x_scale=x_scale, quantize_x=quantize_x,
                                       out_dtype=out_dtype, glu=glu)
    return stream_matmul_pallas(x, w, scale_inv, block=block, x_scale=x_scale, quantize_x=quantize_x, config=config,
                                out_dtype=out_dtype, glu=glu, interpret=resolve_interpret(interpret))


def _check(x, w, scale_inv=None, block=None, x_scale=None, out_dtype=None, quantize_x=False, glu=False):
    if x.ndim != 2 or w.ndim != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"x must be [t, k] and w [n, k], got {x.shape} and {w.shape}")
    if glu and w.shape[0] % 2:
        raise ValueError(f"glu: w must be gate|up, [2 m, k], got {w.shape}")
    if (scale_inv is None) != (block is None):
        raise ValueError("an FP8 weight needs both scale_inv and block; a dense one neither")
    if block is not None:
        want = tuple(-(-d // b) for d, b in zip(w.shape, block))
        if scale_inv.shape != want:
            raise ValueError(f"scale_inv must be [ceil(n / bo), ceil(k / bi)] = {want} for w {w.shape} and block "
                             f"{tuple(block)}, got {scale_inv.shape}")
    if quantize_x:
        if block is None or w.dtype != jnp.float8_e4m3fn or x.dtype == jnp.float8_e4m3fn or x_scale is not None:
            raise ValueError(f"quantize_x quantises float rows of x (x is {x.dtype}) for a block-scaled "
                             "float8_e4m3fn weight, without an x_scale")
        return
    if (x_scale is not None) != (x.dtype == jnp.float8_e4m3fn):
        raise ValueError(f"x_scale goes with float8_e4m3fn rows of x and only with them (x is {x.dtype}, x_scale "
                         f"{'given' if x_scale is not None else 'None'})")
    if x_scale is not None:
        want = (x.shape[0], -(-x.shape[1] // block[1])) if block is not None else None
        if block is None or w.dtype != jnp.float8_e4m3fn:
            raise ValueError("FP8 rows of x (x_scale) need a block-scaled float8_e4m3fn weight")
        if x_scale.shape != want:
            raise ValueError(f"x_scale must be [t, ceil(k / bi)] = {want} for x {x.shape} and block {tuple(block)}, "
                             f"got {x_scale.shape}")
        if out_dtype is None:
            raise ValueError("FP8 rows of x (x_scale) need an out_dtype")


@functools.partial(jax.jit, static_argnames=("block", "quantize_x", "out_dtype", "glu"))
def stream_matmul_reference(x, w, scale_inv=None, *, block: tuple[int, int] | None = None, x_scale=None,
                            quantize_x: bool = False, out_dtype=None, glu: bool = False) -> jax.Array:
    """x [t, k] @ w [n, k]^T -> [t, n] in `out_dtype` (default x's dtype), accumulated in float32 (w in its HF
    [out, in] layout). With `scale_inv` [ceil(n / bo), ceil(k / bi)] and `block` (bo, bi), w is block-scaled FP8
    and is dequantised in float32 first (w[r, c] x scale_inv[r // bo, c // bi]). With `x_scale` [t, ceil(k / bi)],
    x is float8_e4m3fn too (per row and input block) and is dequantised alike (x[r, c] x x_scale[r, c // bi]);
    `out_dtype` is then required. With `quantize_x`, x (float) is first quantised so (`quantize_rows`, groups of
    bi), its result in x's dtype unless `out_dtype` says otherwise. With `glu`, w is gate|up [2 m, k] and the
    result [t, m] is `swiglu` of the product's two halves."""
    _check(x, w, scale_inv, block, x_scale, out_dtype, quantize_x, glu)
    if glu:
        y = stream_matmul_reference(x, w, scale_inv, block=block, x_scale=x_scale, quantize_x=quantize_x,
                                    out_dtype=out_dtype)
        return swiglu(y[:, :w.shape[0] // 2], y[:, w.shape[0] // 2:])
    out_dtype = x.dtype if out_dtype is None else out_dtype
    if quantize_x:
        x, x_scale = quantize_rows(x, block[1])
    precision = lax.Precision.HIGHEST if x.dtype == jnp.float32 else lax.Precision.DEFAULT
    if block is not None:
        scales = jnp.repeat(jnp.repeat(scale_inv.astype(jnp.float32), block[0], axis=0), block[1], axis=1)
        w = w.astype(jnp.float32) * scales[:w.shape[0], :w.shape[1]]
        x = x.astype(jnp.float32)
        if x_scale is not None:
            x = x * jnp.repeat(x_scale.astype(jnp.float32), block[1], axis=1)[:, :x.shape[1]]
        return jnp.einsum("tk,nk->tn", x, w, precision=lax.Precision.HIGHEST).astype(out_dtype)
    return jnp.einsum("tk,nk->tn", x, w.astype(x.dtype), precision=precision,
                      preferred_element_type=jnp.float32).astype(out_dtype)


__all__ = ["StreamMatmulConfig", "fitted_config", "fp8_row_scales", "quantize_rows", "stream_matmul",
           "stream_matmul_pallas", "stream_matmul_reference", "swiglu"]
