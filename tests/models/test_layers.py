"""Packed projections (`layers.PackedProjections`) against the separate HF projections they hold; FP8 projections
(`layers.Linear`) on each of their matmul paths against a float64 product; dense projections streamed
(`layers.linear`, `Runtime.row_invariant`) against XLA's."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from ddtree_jax.config import Fp8Config
from ddtree_jax.models.contract import Fp8Matmul, Kernels, Runtime
from ddtree_jax.models.layers import (DENSE_STREAM_MAX_ROWS, STREAM_MAX_ROWS, Linear, PackedProjections, Part, apply_fp8,
                                     linear)
from jaxprs import equations
from pallas_kernels.stream_matmul import StreamMatmulConfig, fitted_config

# GQA with 2 KV heads of 3 query heads each, head dim 4, input 8: q has 24 rows, k and v 8 each.
N, M, D, E = 2, 3, 4, 8
PARTS = (Part("q_proj", M, ("q_heads", "embed"), N * M), Part("k_proj", 1, ("kv_heads", "embed"), N),
         Part("v_proj", 1, ("kv_heads", "embed"), N))


class Attention(nnx.Module):
    def __init__(self, rngs):
        self.qkv_proj = PackedProjections(E, N, D, PARTS, ("kv_heads", None, None, "embed"), dtype=jnp.float32,
                                          rngs=rngs)


def hf_weights(seed=0):
    rng = np.random.default_rng(seed)
    return {"q_proj": rng.standard_normal((N * M * D, E)), "k_proj": rng.standard_normal((N * D, E)),
            "v_proj": rng.standard_normal((N * D, E))}


def test_packed_rows_are_the_hf_rows_group_after_group():
    """Packed row (g, u, r) of part p is HF row (g * units_p + u) * R + r: checked entry by entry, written out
    from the layout rule (not from `pack`), and `unpack` gives the HF tensors back exactly."""
    module = Attention(nnx.Rngs(0)).qkv_proj
    hf = hf_weights()
    packed = module.pack(hf)
    assert packed.shape == (N, M + 2, D, E)
    for g in range(N):
        for r in range(D):
            for u in range(M):
                np.testing.assert_array_equal(packed[g, u, r], hf["q_proj"][(g * M + u) * D + r])
            np.testing.assert_array_equal(packed[g, M, r], hf["k_proj"][g * D + r])
            np.testing.assert_array_equal(packed[g, M + 1, r], hf["v_proj"][g * D + r])
    unpacked = module.unpack(packed)
    assert all(np.array_equal(unpacked[name], hf[name]) for name in hf)


def test_outputs_equal_the_separate_projections():
    """One matmul over the packed weight gives every part's output as x @ W_part.T (float64 NumPy reference);
    a packing that swapped k and v would fail."""
    module = Attention(nnx.Rngs(0)).qkv_proj
    hf = hf_weights(1)
    module.weight = nnx.Param(jnp.asarray(module.pack(hf), jnp.float32), axes=module.weight.axes)
    x = np.random.default_rng(2).standard_normal((2, 5, E))
    outs = module(jnp.asarray(x, jnp.float32), Runtime())
    for out, name in zip(outs, ("q_proj", "k_proj", "v_proj")):
        np.testing.assert_allclose(np.asarray(out), x @ hf[name].T, rtol=1e-5, atol=1e-5)


def _fp8(block, not_converted=()):
    return type("C", (), {"fp8": Fp8Config(block=block, not_converted=not_converted)})()


def test_fp8_packs_where_blocks_divide_the_rows():
    """Blocks whose rows divide R (4 x 4 here, R = D = 4): the packed weight becomes FP8 in place, and its parts
    (`unpack` of the weight and of the packed scales) are bit for bit what each HF part's own quantisation gives;
    one matmul then gives what the three FP8 Linears give, as they are and with the rows quantised (W8A8)."""
    module = Attention(nnx.Rngs(0))
    dense = module.qkv_proj.unpack(module.qkv_proj.weight[...])
    apply_fp8(module, _fp8((4, 4)))
    qkv = module.qkv_proj
    assert qkv.packed and qkv.block == (4, 4) and qkv.weight[...].dtype == jnp.float8_e4m3fn
    assert qkv.weight_scale_inv[...].shape == (N, M + 2, 1, E // 4)
    weights, scales = qkv.unpack(qkv.weight[...]), qkv.unpack(qkv.weight_scale_inv[...])
    x = jnp.asarray(np.random.default_rng(4).standard_normal((2, 3, E)), jnp.float32)
    for runtime in (Runtime(), Runtime(Kernels.JAX, fp8_matmul=Fp8Matmul.W8A8)):
        outs = qkv(x, runtime)
        for part, out in zip(PARTS, outs):
            alone = Linear(E, dense[part.name].shape[0], part.axes, dtype=jnp.float32, rngs=nnx.Rngs(0))
            alone.weight = nnx.Param(dense[part.name], axes=part.axes)
            alone.to_fp8((4, 4))
            np.testing.assert_array_equal(np.asarray(weights[part.name]).view(np.uint8),
                                          np.asarray(alone.weight[...]).view(np.uint8))
            np.testing.assert_array_equal(np.asarray(scales[part.name]), np.asarray(alone.weight_scale_inv[...]))
            np.testing.assert_allclose(np.asarray(out), np.asarray(alone(x, runtime)), rtol=1e-6, atol=1e-6)


def test_fp8_keeps_the_parts_apart_where_blocks_straddle_and_refuses_a_split_decision():
    """Blocks taller than R (8 rows, R = 4) would straddle units: the parts become separate Linears named as the
    HF parts, with the packed values; a quantization_config that converts q_proj but not k_proj is refused."""
    module = Attention(nnx.Rngs(0))
    before = module.qkv_proj.unpack(module.qkv_proj.weight[...])
    apply_fp8(module, _fp8((8, 4)))
    assert not module.qkv_proj.packed
    q = module.qkv_proj.q_proj
    assert q.weight[...].dtype == jnp.float8_e4m3fn and q.weight_scale_inv[...].shape == (N * M * D // 8, E // 4)
    np.testing.assert_allclose(np.asarray(q.dense_weight(jnp.float32)), np.asarray(before["q_proj"]), rtol=0.07,
                               atol=1e-3)
    with pytest.raises(ValueError, match="converts some of q_proj, k_proj, v_proj to FP8 but not all"):
        apply_fp8(Attention(nnx.Rngs(0)), _fp8((4, 4), not_converted=("k_proj",)))


# ---- FP8 projections: dequantised by XLA, or streamed by the Pallas matmul (`Runtime.fp8_matmul`)

STREAM = Runtime(Kernels.PALLAS, fp8_matmul=Fp8Matmul.STREAM)


def _fp8_linear(n_in: int, n_out: int, block: tuple[int, int]) -> Linear:
    """An FP8 Linear whose blocks' scales differ (rows scaled by 0.1 .. 10 before quantising)."""
    linear = Linear(n_in, n_out, ("embed", "mlp"), dtype=jnp.float32, rngs=nnx.Rngs(0))
    rows = np.random.default_rng(1).uniform(0.1, 10, size=(n_out, 1)).astype(np.float32)
    linear.weight = nnx.Param(linear.weight[...] * rows, axes=linear.weight.axes)
    linear.to_fp8(block)
    return linear


def _float64(linear: Linear, x) -> np.ndarray:
    """x @ W^T in float64, W = the FP8 weight times its block scales (each element's, written out here)."""
    q = np.asarray(linear.weight[...], np.float64)
    s = np.asarray(linear.weight_scale_inv[...], np.float64)
    bo, bi = linear.block
    w = np.array([[q[r, c] * s[r // bo, c // bi] for c in range(q.shape[1])] for r in range(q.shape[0])])
    return np.asarray(x, np.float64) @ w.T


def _kernel_calls(fn, *args) -> int:
    return sum(eqn.primitive.name == "pallas_call" for eqn, _ in equations(jax.make_jaxpr(fn)(*args)))


@pytest.mark.parametrize("n_in,n_out,block,rows,runtime,streams", [
    # 48 x 96 weight in 16 x 32 blocks, leading dims [2, 3]: the kernel, interpreted.
    (96, 48, (16, 32), (2, 3), STREAM, True),
    # The same weight and x on the default path, the jnp reference of the stream, and under a tp mesh: XLA's.
    (96, 48, (16, 32), (2, 3), Runtime(Kernels.PALLAS), False),
    (96, 48, (16, 32), (2, 3), Runtime(Kernels.JAX, fp8_matmul=Fp8Matmul.STREAM), False),
    (96, 48, (16, 32), (2, 3), "tp", False),
    # More rows than a decode call streams (a prefill), and out features the kernel cannot tile (24): XLA's.
    (96, 48, (16, 32), (1, STREAM_MAX_ROWS + 1), STREAM, False),
    (96, 24, (8, 32), (2, 3), STREAM, False),
], ids=["stream", "dequantize", "stream-reference", "stream-under-tp", "stream-many-rows", "stream-untileable"])
def test_fp8_linear_matches_the_dequantised_float64_product(n_in, n_out, block, rows, runtime, streams):
    """Every path of an FP8 Linear gives the float64 product with the dequantised weight (float32 rounding
    only), and the streaming kernel (a pallas_call) runs exactly where `Linear.stream_config` says it does."""
    if runtime == "tp":
        runtime = Runtime(Kernels.PALLAS, jax.make_mesh((1,), ("model",)), Fp8Matmul.STREAM)
    linear = _fp8_linear(n_in, n_out, block)
    x = jnp.asarray(np.random.default_rng(2).standard_normal((*rows, n_in)), jnp.float32)
    got = linear(x, runtime)
    assert got.shape == (*rows, n_out) and got.dtype == jnp.float32
    want = _float64(linear, x)
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    assert _kernel_calls(lambda v: linear(v, runtime), x) == int(streams)
    # Negative control: one block's scale changed shows through the same comparison.
    linear.weight_scale_inv = nnx.Param(linear.weight_scale_inv[...].at[0, 1].multiply(1.5),
                                        axes=linear.weight_scale_inv.axes)
    assert not np.allclose(np.asarray(linear(x, runtime), np.float64), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


W8A8 = Runtime(Kernels.PALLAS, fp8_matmul=Fp8Matmul.W8A8)


def _quantised_rows(x: np.ndarray, group: int) -> np.ndarray:
    """NumPy: each row's groups of `group` features quantised to FP8 and back in float64: the least power of two p
    with the group's largest |x| <= 448 p, ml_dtypes' rounding of x / p (exact), times p."""
    flat = np.asarray(x, np.float64).reshape(-1, x.shape[-1] // group, group)
    amax = np.abs(flat).max(axis=-1, keepdims=True)
    p = 2.0 ** np.ceil(np.log2(amax / 448))
    p = np.where(amax > 448 * p, 2 * p, np.where(amax <= 224 * p, p / 2, p))  # log2's rounding, corrected exactly
    codes = (flat / p).astype(np.float32).astype(ml_dtypes.float8_e4m3fn).astype(np.float64)
    return (codes * p).reshape(x.shape)


@pytest.mark.parametrize("block,rows,runtime,streams,outside,first_above", [
    ((16, 32), (2, 3), W8A8, True, False, 0),  # the kernel quantises its rows itself (a step is one group), interpreted
    ((16, 32), (2, 3), W8A8, True, True, 5),  # 6 rows > `W8A8_QUANTIZE_FIRST_ABOVE`: quantised first, then streamed
    ((16, 32), (2, 3), W8A8, True, False, 6),  # ... but not 6 rows at 6
    ((16, 96), (2, 3), W8A8, True, True, 0),  # groups of 96 span three 32-feature steps: quantised first, streamed
    ((16, 32), (2, 3), Runtime(Kernels.JAX, fp8_matmul=Fp8Matmul.W8A8), False, False, 0),  # its jnp reference
    ((16, 32), (1, STREAM_MAX_ROWS + 1), W8A8, False, True, 0),  # a prefill's rows: quantised, dequantised, XLA's
], ids=["w8a8", "w8a8-first-above", "w8a8-first-above-not", "w8a8-quantised-first", "w8a8-reference",
        "w8a8-many-rows"])
def test_w8a8_linear_quantises_each_row_then_multiplies(block, rows, runtime, streams, outside, first_above,
                                                         monkeypatch):
    """Under `Fp8Matmul.W8A8` every path gives the float64 product of each row's FP8 quantisation (NumPy,
    `_quantised_rows`, per group of the weight block's input size) with the dequantised weight; not the unquantised
    rows' product (what "stream" gives). The quantisation runs inside the kernel where a step is one group and the
    call has at most `layers.W8A8_QUANTIZE_FIRST_ABOVE` rows (0: any), else in XLA before it (a reduction outside
    the kernel)."""
    from ddtree_jax.models import layers

    monkeypatch.setattr(layers, "W8A8_QUANTIZE_FIRST_ABOVE", first_above)
    linear = _fp8_linear(96, 48, block)
    x = jnp.asarray(np.random.default_rng(3).standard_normal((*rows, 96)), jnp.float32)
    want = _float64(linear, _quantised_rows(np.asarray(x), block[1]))
    got = linear(x, runtime)
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    assert _kernel_calls(lambda v: linear(v, runtime), x) == int(streams)
    if runtime is W8A8:
        jaxpr = jax.make_jaxpr(lambda v: linear(v, runtime))(x)
        assert any(eqn.primitive.name == "reduce_max" and "pallas_call" not in outer
                   for eqn, outer in equations(jaxpr)) == outside
    unquantised = _float64(linear, x)
    assert not np.allclose(np.asarray(got, np.float64), unquantised, rtol=1e-3, atol=1e-3 * np.abs(want).max())


def test_stream_knobs_fit_the_weight_and_its_blocks():
    """`fitted_config` lowers the default tiles to what divides the weight and its scale blocks (by hand)."""
    assert fitted_config(4096, 12288, (128, 128)) == StreamMatmulConfig(block_n=64, block_k=128)
    assert fitted_config(320, 64, (128, 128)) == StreamMatmulConfig(block_n=64, block_k=64)
    assert fitted_config(48, 96, (16, 32)) == StreamMatmulConfig(block_n=16, block_k=32)
    assert fitted_config(24, 96, (8, 32)) is None and fitted_config(48, 40) is None


# ---- Dense projections streamed (`Runtime.row_invariant`): issue 20's row-invariant matmul

DENSE_STREAM = Runtime(Kernels.PALLAS, row_invariant=True)


@pytest.mark.parametrize("rows,runtime,min_bytes,streams", [
    ((2, 3), DENSE_STREAM, None, True),
    ((2, 3), Runtime(Kernels.PALLAS), 0, True),  # a small call: streamed (`DENSE_STREAM_MAX_ROWS`) ...
    ((2, 3), Runtime(Kernels.PALLAS), None, False),  # ... of a large enough weight (`DENSE_STREAM_MIN_BYTES`)
    ((1, DENSE_STREAM_MAX_ROWS + 1), Runtime(Kernels.PALLAS), 0, False),  # a larger call: XLA's GEMM
    ((2, 3), Runtime(Kernels.JAX), 0, False),  # no Pallas kernels: XLA's GEMM
    ((1, STREAM_MAX_ROWS + 1), DENSE_STREAM, None, True),  # more rows than one group: still streamed, in two groups
], ids=["stream", "small-call", "xla-small-weight", "xla-many-rows", "xla-jax-kernels", "stream-many-rows"])
def test_dense_projections_stream_where_chosen(rows, runtime, min_bytes, streams, monkeypatch):
    """A dense Linear, a packed q|k|v and float32 logits (`linear(..., out_dtype)`) give the float64 product on every
    path, and the streaming kernel runs exactly where `dense_stream_config` says (one pallas_call per projection)."""
    from ddtree_jax.models import layers

    if min_bytes is not None:  # these weights are a few KiB: below the default, so the small-call cases lower it
        monkeypatch.setattr(layers, "DENSE_STREAM_MIN_BYTES", min_bytes)
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.standard_normal((*rows, 32)), jnp.float32)
    dense = Linear(32, 48, ("embed", "mlp"), dtype=jnp.float32, rngs=nnx.Rngs(0))
    want = np.asarray(x, np.float64) @ np.asarray(dense.weight[...], np.float64).T
    np.testing.assert_allclose(np.asarray(dense(x, runtime), np.float64), want, rtol=1e-5, atol=1e-5)
    assert _kernel_calls(lambda v: dense(v, runtime), x) == int(streams)
    head = jnp.asarray(rng.standard_normal((64, 32)), jnp.bfloat16)  # an lm_head: bf16 in, float32 logits out
    logits = linear(x.astype(jnp.bfloat16), head, runtime, out_dtype=jnp.float32)
    assert logits.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(logits, np.float64), np.asarray(x.astype(jnp.bfloat16), np.float64)
                               @ np.asarray(head, np.float64).T, rtol=1e-5, atol=1e-4)
    # q|k|v of 2 KV heads of 3 query heads, head dim 8, input 16: a [2 * 5 * 8, 16] matrix the kernel tiles.
    packed = PackedProjections(16, N, 8, PARTS, ("kv_heads", None, None, "embed"), dtype=jnp.float32,
                               rngs=nnx.Rngs(0))
    xe = jnp.asarray(rng.standard_normal((*rows, 16)), jnp.float32)
    for got, (name, w) in zip(packed(xe, runtime), packed.unpack(packed.weight[...]).items()):
        np.testing.assert_allclose(np.asarray(got, np.float64), np.asarray(xe, np.float64)
                                   @ np.asarray(w, np.float64).T, rtol=1e-5, atol=1e-5, err_msg=name)
    assert _kernel_calls(lambda v: packed(v, runtime), xe) == int(streams)



def test_wider_calls_stream_with_their_own_knobs_where_chosen(monkeypatch):
    """`DENSE_STREAM_WIDE_MAX_ROWS`: calls past `DENSE_STREAM_MAX_ROWS` rows, up to it, stream with
    `DENSE_STREAM_WIDE_KNOBS` (fitted to the weight), smaller calls with `DENSE_STREAM_KNOBS`; at 0 (the default)
    the wider calls stay XLA's; past it, XLA's either way."""
    from ddtree_jax.models import layers

    monkeypatch.setattr(layers, "DENSE_STREAM_MIN_BYTES", 0)
    runtime, shape = Runtime(Kernels.PALLAS), (256, 512)
    assert layers.DENSE_STREAM_WIDE_MAX_ROWS == 0 and layers.dense_stream_config(shape, 65, runtime) is None
    monkeypatch.setattr(layers, "DENSE_STREAM_WIDE_MAX_ROWS", 65)
    monkeypatch.setattr(layers, "DENSE_STREAM_WIDE_KNOBS", StreamMatmulConfig(block_k=64, num_stages=3))
    small = layers.dense_stream_config(shape, layers.DENSE_STREAM_MAX_ROWS, runtime)
    wide = layers.dense_stream_config(shape, layers.DENSE_STREAM_MAX_ROWS + 1, runtime)
    assert (small.block_k, small.num_stages) == (128, 4) and (wide.block_k, wide.num_stages) == (64, 3)
    assert layers.dense_stream_config(shape, 65, runtime) == wide
    assert layers.dense_stream_config(shape, 66, runtime) is None
    assert layers.dense_stream_config(shape, 65, runtime, lm_head=True) is None
    # `DENSE_STREAM_WIDE_MAX_BYTES`: the wide calls of larger weights go back to XLA, the small calls stream still.
    nbytes = 256 * 512 * 2  # bf16
    monkeypatch.setattr(layers, "DENSE_STREAM_WIDE_MAX_BYTES", nbytes)
    assert layers.dense_stream_config(shape, 65, runtime) == wide
    monkeypatch.setattr(layers, "DENSE_STREAM_WIDE_MAX_BYTES", nbytes - 1)
    assert layers.dense_stream_config(shape, 65, runtime) is None
    assert layers.dense_stream_config(shape, layers.DENSE_STREAM_MAX_ROWS, runtime) == small


def test_row_invariant_streams_in_16_row_tiles_and_needs_the_pallas_kernels():
    """Every row count multiplies in 16-row tiles (one mma shape), dense and FP8 weights alike, however many rows;
    the jnp path cannot be row-invariant, nor XLA's split GEMMs under tensor parallelism, so the runtime refuses
    both."""
    from ddtree_jax.models.layers import dense_stream_config

    assert dense_stream_config((48, 32), 65, DENSE_STREAM).row_tile == 16
    assert dense_stream_config((48, 32), 8 * 257, DENSE_STREAM).row_tile == 16  # a batch of 8 trees of B = 256
    fp8_linear = Linear(32, 48, ("embed", "mlp"), dtype=jnp.float32, rngs=nnx.Rngs(0))
    fp8_linear.to_fp8((16, 16))
    assert fp8_linear.stream_config(65, DENSE_STREAM).row_tile == 16  # streamed although fp8_matmul is dequantize
    assert fp8_linear.stream_config(65, Runtime(Kernels.PALLAS, fp8_matmul=Fp8Matmul.STREAM)).row_tile is None
    # Past STREAM_MAX_ROWS rows FP8 streaming is XLA's (a speed choice); row-invariant calls stream any rows.
    assert fp8_linear.stream_config(STREAM_MAX_ROWS + 1, Runtime(Kernels.PALLAS, fp8_matmul=Fp8Matmul.STREAM)) is None
    assert fp8_linear.stream_config(STREAM_MAX_ROWS + 1, DENSE_STREAM).row_tile == 16
    with pytest.raises(ValueError, match="row_invariant needs the Pallas kernels"):
        Runtime(Kernels.JAX, row_invariant=True)
    with pytest.raises(ValueError, match="not tensor parallelism"):
        Runtime(Kernels.PALLAS, jax.make_mesh((1,), ("model",)), row_invariant=True)
