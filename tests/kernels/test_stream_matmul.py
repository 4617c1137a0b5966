"""The weight-streaming matmul kernel against a float64 NumPy product, interpreted on CPU and compiled on a GPU."""

from __future__ import annotations

import dataclasses

import jax
import ml_dtypes
import numpy as np
import jax.numpy as jnp
import pytest

from pallas_kernels import stream_matmul as sm

INTERPRET = [pytest.param(True, id="interpret"), pytest.param(False, id="compiled", marks=pytest.mark.gpu)]
# (t, n, k, dtype, config): one row (AR), a DFlash block, a DDTree tree (odd: rows in tiles of 64 + 16), rows in
# three tiles (64 + 32 + 16), explicit and automatic splits, rows in groups.
CASES = [(1, 64, 256, "float32", sm.StreamMatmulConfig(block_n=32, block_k=64, splits=2)),
         (100, 32, 128, "float32", sm.StreamMatmulConfig(block_n=16, block_k=64)),
         (16, 128, 256, "bfloat16", sm.StreamMatmulConfig(block_n=64, block_k=64)),
         (65, 64, 512, "float32", sm.StreamMatmulConfig(block_n=16, block_k=128, splits=4)),
         (5, 48, 128, "bfloat16", sm.StreamMatmulConfig(block_n=16, block_k=32, splits=1)),
         (65, 32, 128, "bfloat16", sm.StreamMatmulConfig(block_n=16, block_k=64, row_tile=16)),  # 5 tiles of 16
         # more rows than a group (GROUP_ROWS): two groups of 8 x 16 rows; three groups of one 128-row tile
         (150, 32, 128, "bfloat16", sm.StreamMatmulConfig(block_n=16, block_k=64, row_tile=16)),
         (300, 16, 64, "float32", sm.StreamMatmulConfig(block_n=16, block_k=32))]


def _inputs(t, n, k, dtype, seed):
    rng = np.random.default_rng(seed)
    return (jnp.asarray(rng.standard_normal((t, k)), jnp.float32).astype(dtype),
            jnp.asarray(rng.standard_normal((n, k)) / np.sqrt(k), jnp.float32).astype(dtype))


@pytest.mark.parametrize("interpret", INTERPRET)
@pytest.mark.parametrize("t,n,k,dtype,config", CASES, ids=[f"t{c[0]}-n{c[1]}-k{c[2]}-{c[3]}" for c in CASES])
def test_matches_float64_product(t, n, k, dtype, config, interpret):
    x, w = _inputs(t, n, k, dtype, seed=t + n + k)
    want = np.asarray(x, np.float64) @ np.asarray(w, np.float64).T
    got = sm.stream_matmul_pallas(x, w, config=config, interpret=interpret)
    assert got.shape == (t, n) and got.dtype == jnp.dtype(dtype)
    tol = 1e-5 if dtype == "float32" else 2e-2
    np.testing.assert_allclose(np.asarray(got, np.float64), want, atol=tol, rtol=tol)
    ref = sm.stream_matmul_reference(x, w)
    np.testing.assert_allclose(np.asarray(ref, np.float64), want, atol=tol, rtol=tol)


@pytest.mark.parametrize("interpret", INTERPRET)
def test_a_row_gets_the_same_bits_in_every_call_under_row_tile(interpret):
    """Issue 20: with `row_tile`, a row's product does not depend on how many rows the call holds or where the row
    sits (one row, a tree of 17, a batch of trees past one group), in bf16."""
    x, w = _inputs(150, 64, 256, "bfloat16", seed=11)
    config = sm.StreamMatmulConfig(block_n=32, block_k=64, row_tile=16)
    whole = np.asarray(sm.stream_matmul_pallas(x, w, config=config, interpret=interpret), np.float32)
    for start, rows in ((0, 1), (140, 1), (130, 17)):
        part = sm.stream_matmul_pallas(x[start:start + rows], w, config=config, interpret=interpret)
        np.testing.assert_array_equal(np.asarray(part, np.float32), whole[start:start + rows])


# (t, n, k, dtype, config) with more than one split: one row, 17 rows (a tile of 32), a tree of 65 (64 + 16), rows
# past one group (tiles of 16)
SPLIT_SUM_CASES = [(1, 64, 256, "bfloat16", sm.StreamMatmulConfig(block_n=32, block_k=64, splits=2)),
                   (17, 128, 384, "bfloat16", sm.StreamMatmulConfig(block_n=64, block_k=64, splits=3)),
                   (65, 64, 512, "float32", sm.StreamMatmulConfig(block_n=16, block_k=128, splits=4)),
                   (150, 32, 128, "bfloat16", sm.StreamMatmulConfig(block_n=16, block_k=32, splits=2, row_tile=16))]


@pytest.mark.parametrize("interpret", INTERPRET)
def test_split_sums_kernel_gives_the_epilogue_bits(monkeypatch, interpret):
    """`SPLIT_SUMS_KERNEL`: the partial sums added by a Pallas kernel of their own give the bits of XLA's epilogue
    (the same adds in split order), and the kernel is really there (two pallas_calls against one)."""
    for t, n, k, dtype, config in SPLIT_SUM_CASES:
        x, w = _inputs(t, n, k, dtype, seed=t + k)
        got, calls = {}, {}
        for on in (False, True):
            monkeypatch.setattr(sm, "SPLIT_SUMS_KERNEL", on)
            jax.clear_caches()  # the knob is read when the kernel's program is traced
            calls[on] = str(jax.make_jaxpr(lambda x, w: sm.stream_matmul_pallas(x, w, config=config,
                                                                                 interpret=interpret))(x, w))
            got[on] = np.asarray(sm.stream_matmul_pallas(x, w, config=config, interpret=interpret), np.float32)
        assert calls[False].count("pallas_call[") == 1 and calls[True].count("pallas_call[") == 2
        assert got[True].shape == (t, n)
        np.testing.assert_array_equal(got[True], got[False])


def test_row_tiles():
    """Rows go in power-of-two tiles >= 16, largest first, a rest of 17-32 rows in one tile of 32 (never two of
    16); with `row_tile`, in tiles of that many rows."""
    assert [sm._row_tiles(t) for t in (1, 16, 17, 32, 33, 49, 65, 81, 100, 128)] == [
        (16,), (16,), (32,), (32,), (32, 16), (32, 32), (64, 16), (64, 32), (64, 32, 16), (128,)]
    for t in range(1, 129):  # cover t, no two 16-row tiles
        tiles = sm._row_tiles(t)
        assert t <= sum(tiles) < t + 32 and tiles.count(16) <= 1 and list(tiles) == sorted(tiles, reverse=True)
    assert [sm._row_tiles(t, 16) for t in (1, 16, 17, 65)] == [(16,), (16,), (16, 16), (16,) * 5]
    assert sm._row_tiles(65, 32) == (32, 32, 32)


def test_check_can_fail():
    """Negative control: a product with one weight row changed is caught by the same comparison."""
    x, w = _inputs(3, 32, 64, "float32", seed=1)
    want = np.asarray(x, np.float64) @ np.asarray(w, np.float64).T
    got = sm.stream_matmul_pallas(x, w.at[7, 5].add(0.5), config=sm.StreamMatmulConfig(block_n=16, block_k=32),
                                  interpret=True)
    assert not np.allclose(np.asarray(got), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("k,n_blocks,two_per_core,even,even_where_few", [
    (4096, 64, 4, 4, 4),     # 8B o_proj: 256 programs either way (2 waves of 132 less 8)
    (4096, 96, 2, 4, 4),     # 8B q|k|v: 192 programs leave 72 multiprocessors one program; 384 are 3 waves less 12
    (4096, 384, 1, 1, 1),    # 8B gate|up: 384 programs in one split
    (17408, 80, 2, 8, 8),    # 27B down_proj: 160 programs (28 multiprocessors stream two) against 640 (5 waves less 20)
    (5120, 544, 1, 4, 1)])   # 27B gate|up: 544 programs (4 waves and 16) against 2176 (17 waves less 68); past 264
def test_splits_by_rule(monkeypatch, k, n_blocks, two_per_core, even, even_where_few):
    """`splits=None`: about two programs per multiprocessor (balance 0), or the programs spread most evenly over
    132 multiprocessors' whole waves, nearest two a multiprocessor among those within 3% (balance 1), or that only
    where balance 0 gives at most 264 programs (balance 2); the counts worked out by hand."""
    monkeypatch.setattr(sm, "core_count", lambda: 132)
    assert sm._splits(k, n_blocks, sm.StreamMatmulConfig()) == two_per_core
    assert sm._splits(k, n_blocks, sm.StreamMatmulConfig(balance=1)) == even
    assert sm._splits(k, n_blocks, sm.StreamMatmulConfig(balance=2)) == even_where_few


@pytest.mark.parametrize("programs,stage_bytes,want", [
    (384, 10240, 7),   # 8B gate|up at one row, FP8 rows: 3 a multiprocessor, 3 x 71 KiB fit 228, 3 x 81 do not
    (192, 10240, 8),   # 8B q|k|v: 2 a multiprocessor, 2 x 81 KiB
    (192, 18432, 6),   # its 65-row verify (row tiles 64 + 16): 2 x 109 KiB fit, 2 x 127 do not
    (1000, 40960, 4)])  # 8 a multiprocessor fit at no depth: `least`
def test_fitting_stages_by_hand(programs, stage_bytes, want):
    assert sm.fitting_stages(programs, stage_bytes, 4, 8, 132) == want


def test_max_stages_reaches_the_compiler(monkeypatch):
    """The depth `fitting_stages` gives is the one the kernel is compiled with (the product is the same at any
    depth: `num_stages` changes when loads are issued, not what is summed)."""
    seen = []
    original = sm.plt.CompilerParams
    monkeypatch.setattr(sm.plt, "CompilerParams", lambda **kw: seen.append(kw["num_stages"]) or original(**kw))
    monkeypatch.setattr(sm, "core_count", lambda: 132)
    x, w = _inputs(1, 64, 256, "bfloat16", seed=6)
    for config in (sm.StreamMatmulConfig(block_n=16, block_k=64), sm.StreamMatmulConfig(block_n=16, block_k=64,
                                                                                         max_stages=6)):
        got = sm.stream_matmul_pallas.__wrapped__(x, w, config=config, interpret=True)  # traced anew: no jit cache
        np.testing.assert_allclose(np.asarray(got, np.float64),
                                   np.asarray(x, np.float64) @ np.asarray(w, np.float64).T, atol=2e-2, rtol=2e-2)
    # 16 programs (4 row blocks x 4 splits) of 4 KiB steps (16 x 64 bf16 weights, 16 x 64 bf16 rows): one a
    # multiprocessor, 6 stages fit
    assert seen == [4, 6]


def test_balanced_splits_give_the_product():
    x, w = _inputs(3, 96, 512, "float32", seed=5)
    config = sm.StreamMatmulConfig(block_n=32, block_k=64, balance=1)
    assert sm._splits(512, 3, config) > 1
    got = sm.stream_matmul_pallas(x, w, config=config, interpret=True)
    np.testing.assert_allclose(np.asarray(got, np.float64), np.asarray(x, np.float64) @ np.asarray(w, np.float64).T,
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("field,value", [("block_n", 8), ("block_k", 48), ("splits", 0), ("num_warps", 3),
                                         ("num_stages", 0), ("row_tile", 8), ("row_tile", 24),
                                         ("fp8_bits", 2), ("promote_k", 16), ("promote_k", -1), ("balance", 3),
                                         ("prefetch", 2), ("max_stages", -1)])
def test_bad_config_names_the_value(field, value):
    with pytest.raises(ValueError, match=rf"StreamMatmulConfig\.{field}={value!r}"):
        sm.StreamMatmulConfig(**{field: value})


def test_bad_shapes_say_what_was_expected():
    x, w = _inputs(2, 32, 64, "float32", seed=2)
    with pytest.raises(ValueError, match=r"x must be \[t, k\]"):
        sm.stream_matmul_reference(x, w[:, :32])
    with pytest.raises(ValueError, match="block_k"):
        sm.stream_matmul_pallas(x, w, config=sm.StreamMatmulConfig(block_k=128), interpret=True)


# Block-scaled FP8 weights (ddtree_jax/models/fp8.py's format): (t, n, k, x dtype, block, config). One row with
# tiles smaller than the scale blocks and two splits; a DDTree tree in float32 with tiles equal to the blocks, in one
# split (the kernel writes the result itself); a
# weight whose last scale row is a partial block (rows 128..191), with three splits of one block each.
FP8_CASES = [(1, 256, 512, "bfloat16", (128, 128), sm.StreamMatmulConfig(block_n=64, block_k=64, splits=2)),
             (65, 128, 256, "float32", (128, 128), sm.StreamMatmulConfig(block_n=64, block_k=128, splits=1,
                                                                        num_stages=2)),
             (5, 192, 384, "bfloat16", (128, 128), sm.StreamMatmulConfig(block_n=64, block_k=128, splits=3))]


def _fp8_inputs(t, n, k, dtype, block, seed):
    from ddtree_jax.models import fp8

    rng = np.random.default_rng(seed)
    dense = rng.standard_normal((n, k)) / np.sqrt(k) * rng.uniform(0.1, 10, size=(n, 1))  # scales differ by row
    q, scale = fp8.quantize(jnp.asarray(dense, jnp.float32), block)
    x = jnp.asarray(rng.standard_normal((t, k)), jnp.float32).astype(dtype)
    # float64 restatement of the dequantised weight: each element times its block's scale.
    w64 = np.asarray(q, np.float64) * np.repeat(np.repeat(np.asarray(scale, np.float64), block[0], 0), block[1], 1)[:n, :k]
    return x, q, scale, w64


@pytest.mark.parametrize("interpret", INTERPRET)
@pytest.mark.parametrize("t,n,k,dtype,block,config", FP8_CASES,
                         ids=[f"t{c[0]}-n{c[1]}-k{c[2]}-{c[3]}" for c in FP8_CASES])
def test_fp8_weights_match_the_dequantised_float64_product(t, n, k, dtype, block, config, interpret):
    x, q, scale, w64 = _fp8_inputs(t, n, k, dtype, block, seed=t + n)
    want = np.asarray(x, np.float64) @ w64.T
    got = sm.stream_matmul_pallas(x, q, scale, block=block, config=config, interpret=interpret)
    assert got.shape == (t, n) and got.dtype == jnp.dtype(dtype) and q.dtype == jnp.float8_e4m3fn
    tol = 1e-5 if dtype == "float32" else 2e-2
    scale_of_out = np.abs(want).max()
    np.testing.assert_allclose(np.asarray(got, np.float64), want, atol=tol * scale_of_out, rtol=tol)
    ref = sm.stream_matmul_reference(x, q, scale, block=block)
    np.testing.assert_allclose(np.asarray(ref, np.float64), want, atol=tol * scale_of_out, rtol=tol)
    if dtype == "bfloat16":  # the tiles placed by bits (fp8_bits=1) multiply to the widened tiles' bits
        placed = sm.stream_matmul_pallas(x, q, scale, block=block, config=dataclasses.replace(config, fp8_bits=1),
                                         interpret=interpret)
        np.testing.assert_array_equal(np.asarray(placed, np.float32), np.asarray(got, np.float32))
    # Negative control: one block's scale changed shows through.
    wrong = sm.stream_matmul_pallas(x, q, scale.at[0, 1].multiply(1.5), block=block, config=config,
                                    interpret=interpret)
    assert not np.allclose(np.asarray(wrong, np.float64), want, atol=tol * scale_of_out, rtol=tol)


def _finite_e4m3_codes() -> np.ndarray:
    """The 254 bytes that are finite float8_e4m3fn values (both zeros, the subnormals, +-448), as uint8."""
    codes = np.arange(256, dtype=np.uint8)
    return codes[np.isfinite(codes.view(ml_dtypes.float8_e4m3fn).astype(np.float64))]


def test_fp8_bits_place_every_e4m3_value():
    """`fp8_bits=1`'s placement (the jnp form that interpreted kernels run) turns each finite e4m3 code into its
    value (ml_dtypes' decoding) times 2^PLACED_EXPONENT, exactly."""
    codes = _finite_e4m3_codes()
    got = sm._fp8_tile_as_bf16(jnp.asarray(codes.view(ml_dtypes.float8_e4m3fn)), asm=False)
    assert got.dtype == jnp.bfloat16
    want = codes.view(ml_dtypes.float8_e4m3fn).astype(np.float64) * 2.0 ** sm.PLACED_EXPONENT
    np.testing.assert_array_equal(np.asarray(got).astype(np.float64), want)
    np.testing.assert_array_equal(np.signbit(np.asarray(got).astype(np.float64)), np.signbit(want))


@pytest.mark.parametrize("interpret", INTERPRET)
@pytest.mark.parametrize("fp8_bits", [0, 1])
def test_fp8_kernel_widens_every_e4m3_value_exactly(fp8_bits, interpret):
    """x = the identity, so that each output is one weight times its block's scale: every finite e4m3 code
    (subnormals and +-448 included) comes out as its value times the scale rounded once to float32, whichever way
    the tiles become bfloat16 (on a GPU, `fp8_bits=1` runs the PTX placement)."""
    n, k, block = 32, 128, (16, 128)
    codes = np.resize(_finite_e4m3_codes(), n * k).reshape(n, k)
    q = jnp.asarray(codes.view(ml_dtypes.float8_e4m3fn))
    scale = jnp.asarray([[0.37], [2.0 ** -7]], jnp.float32)  # one scale per 16 weight rows
    x = jnp.eye(k, dtype=jnp.bfloat16)
    got = sm.stream_matmul_pallas(x, q, scale, block=block, out_dtype=jnp.float32, interpret=interpret,
                                  config=sm.StreamMatmulConfig(block_n=16, block_k=64, splits=1, fp8_bits=fp8_bits))
    values = codes.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    want = values * np.repeat(np.asarray(scale), block[0], axis=0)  # one float32 rounding per entry
    np.testing.assert_array_equal(np.asarray(got), want.T)


# FP8 rows too (W8A8, `x_scale`): (t, n, k, out dtype, config). One row with tiles half a scale block in two splits;
# a DDTree tree (64 + 16 rows); 17 rows (one tile of 32) with promote_k 32 in three splits; rows past one group;
# a DFlash block through Pallas's own dot (promote_k 0).
W8A8_CASES = [(1, 256, 512, "bfloat16", sm.StreamMatmulConfig(block_n=64, block_k=64, splits=2)),
              (65, 128, 256, "float32", sm.StreamMatmulConfig(block_n=64, block_k=128)),
              (17, 192, 384, "float32", sm.StreamMatmulConfig(block_n=64, block_k=128, splits=3, promote_k=32)),
              (150, 64, 256, "bfloat16", sm.StreamMatmulConfig(block_n=32, block_k=64, row_tile=16)),
              (16, 128, 256, "float32", sm.StreamMatmulConfig(block_n=64, block_k=128, promote_k=0))]  # Pallas's dot


def _w8a8_inputs(t, n, k, seed):
    """FP8 rows (ml_dtypes' rounding of normal values) with scales per row and 128 features, an FP8 weight, and
    the float64 restatement of the product of the two dequantised."""
    _, q, scale, w64 = _fp8_inputs(t, n, k, "float32", (128, 128), seed)
    rng = np.random.default_rng(seed + 1)
    codes = (rng.standard_normal((t, k)) * 100).clip(-448, 448).astype(ml_dtypes.float8_e4m3fn)
    x_scale = rng.uniform(2.0 ** -10, 2.0 ** -4, size=(t, -(-k // 128))).astype(np.float32)
    x64 = codes.astype(np.float64) * np.repeat(x_scale.astype(np.float64), 128, axis=1)[:, :k]
    return jnp.asarray(codes), jnp.asarray(x_scale), q, scale, x64 @ w64.T


@pytest.mark.parametrize("interpret", INTERPRET)
@pytest.mark.parametrize("t,n,k,out_dtype,config", W8A8_CASES,
                         ids=[f"t{c[0]}-n{c[1]}-k{c[2]}-{c[3]}" for c in W8A8_CASES])
def test_fp8_rows_match_the_dequantised_float64_product(t, n, k, out_dtype, config, interpret):
    """FP8 rows with their scales times an FP8 weight: the float64 product of both dequantised (on a GPU the
    blocks' partial sums come from FP8 tensor cores, which sum in fewer bits than float32: 1e-3 of the output's
    scale), and each row's result its own (one row's scales changed moves that row alone)."""
    x, x_scale, q, scale, want = _w8a8_inputs(t, n, k, seed=t + k)
    got = sm.stream_matmul_pallas(x, q, scale, block=(128, 128), x_scale=x_scale, out_dtype=out_dtype,
                                  config=config, interpret=interpret)
    assert got.shape == (t, n) and got.dtype == jnp.dtype(out_dtype)
    tol = 2e-2 if out_dtype == "bfloat16" else 1e-5 if interpret else 1e-3
    scale_of_out = np.abs(want).max()
    np.testing.assert_allclose(np.asarray(got, np.float64), want, atol=tol * scale_of_out, rtol=tol)
    ref = sm.stream_matmul_reference(x, q, scale, block=(128, 128), x_scale=x_scale, out_dtype=out_dtype)
    np.testing.assert_allclose(np.asarray(ref, np.float64), want, atol=tol * scale_of_out, rtol=tol)
    moved = sm.stream_matmul_pallas(x, q, scale, block=(128, 128), x_scale=x_scale.at[t - 1, 0].multiply(2.0),
                                    out_dtype=out_dtype, config=config, interpret=interpret)
    np.testing.assert_array_equal(np.asarray(moved[:t - 1], np.float32), np.asarray(got[:t - 1], np.float32))
    assert not np.allclose(np.asarray(moved[t - 1], np.float64), want[t - 1], atol=tol * scale_of_out, rtol=tol)


# Rows quantised inside the kernel (`quantize_x`): (t, n, k, x dtype, config), every step one group (block_k = 128);
# the last in one split (the kernel writes the result itself) over two groups of rows.
QUANTIZE_X_CASES = [(1, 256, 512, "bfloat16", sm.StreamMatmulConfig(block_k=128, splits=2)),
                    (65, 128, 384, "float32", sm.StreamMatmulConfig(block_n=64, block_k=128)),
                    (17, 192, 256, "bfloat16", sm.StreamMatmulConfig(block_n=64, block_k=128, promote_k=32)),
                    (150, 64, 256, "bfloat16", sm.StreamMatmulConfig(block_n=32, block_k=128, row_tile=16,
                                                                     splits=1))]


@pytest.mark.parametrize("interpret", INTERPRET)
@pytest.mark.parametrize("t,n,k,x_dtype,config", QUANTIZE_X_CASES,
                         ids=[f"t{c[0]}-n{c[1]}-k{c[2]}-{c[3]}" for c in QUANTIZE_X_CASES])
def test_rows_quantised_inside_the_kernel_are_quantize_rows(t, n, k, x_dtype, config, interpret):
    """`quantize_x`: the kernel quantises each step's row tile itself, bit for bit as `quantize_rows` (its FP8 rows
    and scales given through `x_scale` to the same kernel give the same bits; rows of very different sizes, a zero
    row, one group of a row scaled up), and the result is the float64 product of both dequantised within a share
    of the sum of the products' magnitudes (on a GPU the FP8 tensor cores' summation)."""
    rng = np.random.default_rng(t + k)
    x = rng.standard_normal((t, k)) * rng.uniform(0.01, 100, size=(t, 1))
    x[0, :128] *= 1000.0
    if t > 2:
        x[1] = 0.0
    x = jnp.asarray(x, x_dtype)
    _, q, scale, _ = _fp8_inputs(t, n, k, "float32", (128, 128), seed=k)
    got = sm.stream_matmul_pallas(x, q, scale, block=(128, 128), quantize_x=True, config=config, interpret=interpret)
    assert got.shape == (t, n) and got.dtype == x.dtype
    xq, xs = sm.quantize_rows(x, 128)
    given = sm.stream_matmul_pallas(xq, q, scale, block=(128, 128), x_scale=xs, out_dtype=x.dtype, config=config,
                                    interpret=interpret)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(given, np.float32))
    # Against NumPy's float64 product of both dequantised (not XLA's on a GPU, which rewrites a dot of converted FP8
    # into an FP8 GEMM of its own: ~1% off here, H100, 2026-12-05), within a share of the sum of |products| (a
    # summation's own error bound: FP8 tensor cores sum a block in fewer bits than float32, which these rows'
    # spread of 10^5 between groups exposes where the sum cancels; 9.5e-4 of it measured there in bf16).
    xq64 = np.asarray(xq, np.float64) * np.repeat(np.asarray(xs, np.float64), 128, axis=1)[:, :k]
    w64 = np.asarray(q, np.float64) * np.repeat(np.repeat(np.asarray(scale, np.float64), 128, 0), 128, 1)[:n, :k]
    want, bound = xq64 @ w64.T, np.abs(xq64) @ np.abs(w64).T
    tol = 1e-2 if x_dtype == "bfloat16" else 1e-5 if interpret else 2e-3
    assert np.all(np.abs(np.asarray(got, np.float64) - want) <= tol * bound)



@pytest.mark.parametrize("interpret", INTERPRET)
@pytest.mark.parametrize("form", ["fp8_bits", "x_scale", "quantize_x"])
def test_prefetched_small_operands_give_the_same_bits(form, interpret):
    """`prefetch=1` (a step's scales loaded by the step before) gives the bits of loading them in their own step:
    FP8 weights (widened by bits), FP8 rows given with their scales, rows quantised inside; two splits of four steps
    each, so that a step taking its neighbour's scale (each block's scale differs) would change the product."""
    t, n, k = 3, 128, 1024
    config = sm.StreamMatmulConfig(block_n=64, block_k=128, splits=2)
    x, q, scale, _ = _fp8_inputs(t, n, k, "bfloat16", (128, 128), seed=4)
    if form == "x_scale":
        x, x_scale, q, scale, _ = _w8a8_inputs(t, n, k, seed=4)
        args, kwargs = (x, q, scale), dict(block=(128, 128), x_scale=x_scale, out_dtype=jnp.float32)
    else:
        args, kwargs = (x, q, scale), dict(block=(128, 128), quantize_x=form == "quantize_x")
        config = dataclasses.replace(config, fp8_bits=int(form == "fp8_bits"))
    got = {prefetch: np.asarray(sm.stream_matmul_pallas(*args, config=dataclasses.replace(config, prefetch=prefetch),
                                                        interpret=interpret, **kwargs), np.float32)
           for prefetch in (0, 1)}
    np.testing.assert_array_equal(got[1], got[0])
    want = np.asarray(sm.stream_matmul_reference(*args, **kwargs), np.float32)
    np.testing.assert_allclose(got[1], want, atol=2e-2 * np.abs(want).max(), rtol=2e-2)

def test_fp8_rows_bad_arguments_say_what_was_expected():
    x, x_scale, q, scale, _ = _w8a8_inputs(2, 128, 256, seed=5)
    with pytest.raises(ValueError, match=r"x_scale must be \[t, ceil\(k / bi\)\] = \(2, 2\)"):
        sm.stream_matmul_reference(x, q, scale, block=(128, 128), x_scale=x_scale[:, :1], out_dtype=jnp.float32)
    with pytest.raises(ValueError, match="x_scale goes with float8_e4m3fn rows"):
        sm.stream_matmul_reference(x, q, scale, block=(128, 128), out_dtype=jnp.float32)
    with pytest.raises(ValueError, match="x_scale goes with float8_e4m3fn rows"):
        sm.stream_matmul_reference(x.astype(jnp.float32), q, scale, block=(128, 128), x_scale=x_scale)
    with pytest.raises(ValueError, match="need an out_dtype"):
        sm.stream_matmul_reference(x, q, scale, block=(128, 128), x_scale=x_scale)
    with pytest.raises(ValueError, match="need a block-scaled float8_e4m3fn weight"):
        sm.stream_matmul_reference(x, q.astype(jnp.float32), x_scale=x_scale, out_dtype=jnp.float32)
    dense = x.astype(jnp.float32)
    with pytest.raises(ValueError, match="quantize_x quantises float rows of x"):
        sm.stream_matmul_reference(x, q, scale, block=(128, 128), quantize_x=True)  # rows already FP8
    with pytest.raises(ValueError, match="quantize_x quantises float rows of x"):
        sm.stream_matmul_reference(dense, q, scale, block=(128, 128), x_scale=x_scale, quantize_x=True)
    with pytest.raises(ValueError, match="quantize_x: block_k=64 must be the scale block's 128 input features"):
        sm.stream_matmul_pallas(dense, q, scale, block=(128, 128), quantize_x=True,
                                config=sm.StreamMatmulConfig(block_k=64), interpret=True)


def test_fp8_bad_scales_and_tiles_say_what_was_expected():
    x, q, scale, _ = _fp8_inputs(2, 256, 256, "bfloat16", (128, 128), seed=3)
    with pytest.raises(ValueError, match=r"scale_inv must be \[ceil\(n / bo\), ceil\(k / bi\)\] = \(2, 2\)"):
        sm.stream_matmul_reference(x, q, scale[:1], block=(128, 128))
    with pytest.raises(ValueError, match="needs both scale_inv and block"):
        sm.stream_matmul_reference(x, q, scale)
    with pytest.raises(ValueError, match="must divide them"):
        sm.stream_matmul_pallas(x, q, scale, block=(128, 128), config=sm.StreamMatmulConfig(block_k=256),
                                interpret=True)


# (t, m, k, dtype, block, config): SwiGLU's gate|up [2 m, k] streamed with the activation in the kernel's epilogue
# (one split) or after the split sums (two): dense float32 (AR) and bf16 (a DFlash block), FP8 weights (rows in two
# tiles), W8A8 with the rows quantised inside the kernel.
GLU_CASES = [(1, 64, 256, "float32", None, sm.StreamMatmulConfig(block_n=32, block_k=64, splits=1)),
             (16, 64, 256, "bfloat16", None, sm.StreamMatmulConfig(block_n=16, block_k=64, splits=1)),
             (5, 64, 256, "bfloat16", None, sm.StreamMatmulConfig(block_n=32, block_k=64, splits=2)),
             (17, 128, 256, "bfloat16", (128, 128), sm.StreamMatmulConfig(block_n=64, block_k=128, splits=1)),
             ("w8a8", 128, 256, "bfloat16", (128, 128), sm.StreamMatmulConfig(block_n=64, block_k=128, splits=1))]


@pytest.mark.parametrize("interpret", INTERPRET)
@pytest.mark.parametrize("t,m,k,dtype,block,config", GLU_CASES,
                         ids=[f"t{c[0]}-m{c[1]}-{c[3]}-{'fp8' if c[4] else 'dense'}-s{c[5].splits}" for c in GLU_CASES])
def test_glu_is_swiglu_of_the_two_products(t, m, k, dtype, block, config, interpret):
    """`glu`: silu(x @ gate^T) * (x @ up^T) of a packed gate|up weight, against float64 NumPy; fused (one split,
    a kernel of its own name) it is `swiglu` of the kernel's own two products bit for bit where interpreted (the
    same float32 accumulators; compiled, Triton's exp may round the silu's last bit otherwise)."""
    import jax

    from jaxprs import pallas_call_names

    w8a8 = t == "w8a8"
    t = 3 if w8a8 else t
    if block is None:
        x, w = _inputs(t, 2 * m, k, dtype, seed=t + m)
        scale, w64, kw = None, np.asarray(w, np.float64), {}
    else:
        x, w, scale, w64 = _fp8_inputs(t, 2 * m, k, dtype, block, seed=t + m)
        kw = {"block": block, "quantize_x": w8a8}
    call = jax.jit(lambda x, w, scale, glu: sm.stream_matmul_pallas(x, w, scale, config=config, glu=glu,
                                                                     interpret=interpret, **kw), static_argnums=3)
    got = call(x, w, scale, True)
    assert got.shape == (t, m) and got.dtype == jnp.dtype(dtype)
    names = pallas_call_names(jax.make_jaxpr(call, static_argnums=3)(x, w, scale, True))
    assert any(name.endswith("_glu") for name in names) == (config.splits == 1), names
    both = call(x, w, scale, False)
    assert both.shape == (t, 2 * m)
    unfused = sm.swiglu(both[:, :m], both[:, m:])
    if interpret:
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(unfused, np.float32))
    ref = sm.stream_matmul_reference(x, w, scale, glu=True, **kw)
    xq = np.asarray(x, np.float64)
    if w8a8:  # the rows as the kernel quantises them
        q, s = sm.quantize_rows(x, block[1])
        xq = np.asarray(q, np.float64) * np.repeat(np.asarray(s, np.float64), block[1], axis=1)[:, :k]
    y = xq @ w64.T
    g, u = y[:, :m], y[:, m:]
    silu = g / (1 + np.exp(-g))
    want = silu * u
    # What the plain product tests accept of each product (float32: 1e-5 of its largest; bf16 and FP8: 2e-2, W8A8's
    # Hopper FP8 accumulation included), carried through silu(g) * u (|silu'| < 1.1), plus the bf16 roundings.
    product_error = (1e-5 if dtype == "float32" else 2e-2) * np.abs(y).max()
    bound = product_error * (1.1 * np.abs(u) + np.abs(silu)) + (1e-5 if dtype == "float32" else 1e-2) * np.abs(want)
    for value in (got, ref, unfused):
        error = np.abs(np.asarray(value, np.float64) - want)
        assert np.all(error <= bound), (np.unravel_index(np.argmax(error - bound), want.shape), error.max())
    # Negative control: gate and up swapped is another function.
    swapped = call(x, jnp.concatenate([w[m:], w[:m]]), scale if scale is None else jnp.concatenate(
        [scale[scale.shape[0] // 2:], scale[:scale.shape[0] // 2]]), True)
    assert not np.all(np.abs(np.asarray(swapped, np.float64) - want) <= bound)


def test_swiglu_rounds_like_torch_bfloat16():
    """`swiglu` in bf16: silu computed in float32 and rounded, then the product rounded (PyTorch's bf16 ops), from a
    float64 restatement of those two roundings."""
    rng = np.random.default_rng(3)
    gate = jnp.asarray(rng.standard_normal(4096) * 4, jnp.float32).astype(jnp.bfloat16)
    up = jnp.asarray(rng.standard_normal(4096), jnp.float32).astype(jnp.bfloat16)
    g, u = np.asarray(gate, np.float64), np.asarray(up, np.float64)
    silu = np.asarray(jnp.asarray(g / (1 + np.exp(-g)), jnp.float32).astype(jnp.bfloat16), np.float64)
    want = np.asarray(jnp.asarray(silu * u, jnp.float32).astype(jnp.bfloat16), np.float32)
    got = np.asarray(sm.swiglu(gate, up), np.float32)
    assert (got != want).mean() < 0.01  # float32 exp against float64's: a rare last bit before a rounding
    np.testing.assert_allclose(got, want, rtol=1e-2, atol=1e-3)


