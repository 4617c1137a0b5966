"""Block-scaled FP8 checkpoints (Qwen's published `quant_method: fp8` layout): weights stay float8_e4m3fn,
the models decode as transformers does on the dequantised float32 weights, DFlash and DDTree on them equal
AR; the converter, the orbax round trip, tensor parallelism and the errors.

Two FP8 checkpoints of one random float32 target, made independently: `quantize-fp8` (float32 scales, one
file, the config listing `modules_to_not_convert`) and a few lines of NumPy below (bfloat16 scales, two
shards and an index, no `modules_to_not_convert`, as Qwen3-8B-FP8's config). The oracle reads their files
with PyTorch's safetensors, dequantises them in PyTorch and runs transformers' Qwen3ForCausalLM.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file

from conversions.convert import main as convert_main
from ddtree_jax.checkpoint import CheckpointError, load_drafter, load_target, read_arrays, save_hf
from ddtree_jax.config import ConfigError, Fp8Config, parse_qwen3, parse_qwen3_5
from ddtree_jax.engine import DecodeOptions, Mode, generate
from ddtree_jax.models import qwen3
from ddtree_jax.models.contract import ForwardMeta
from ddtree_jax.random_checkpoint import (tiny_qwen3_5_config, tiny_qwen3_config, write_random_dflash,
                                          write_random_qwen3, write_random_qwen3_5)

TOL = 1e-4
BLOCK = 128
# hidden 256 = 2 blocks; q 128 = 1; k/v 64 and the MLP's 320 end in partial blocks. Vocabulary 16, so a
# random drafter's drafts are often accepted.
SHAPE = dict(vocab_size=16, hidden_size=256, intermediate_size=320, num_attention_heads=4, num_key_value_heads=2,
             head_dim=32)
PUBLISHED = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [BLOCK, BLOCK]}
PROMPTS = [[1, 2, 3, 4, 5, 6, 7], [3, 9]]
NEW_TOKENS = 12


def numpy_fp8(w: np.ndarray, block: int, scale_dtype, scales: np.ndarray | None = None):
    """Quantise [o, i] float32 into float8_e4m3fn blocks of block x block: scale = the block's largest |w| / 448
    rounded to `scale_dtype` (or the given `scales`), q = w / scale rounded to nearest. -> (q, scales)."""
    rows, cols = -(-w.shape[0] // block), -(-w.shape[1] // block)
    given = scales is not None
    scales = scales if given else np.ones((rows, cols), scale_dtype)
    q = np.zeros(w.shape, ml_dtypes.float8_e4m3fn)
    for r in range(rows):
        for c in range(cols):
            tile = (slice(r * block, (r + 1) * block), slice(c * block, (c + 1) * block))
            if not given:
                scales[r, c] = np.abs(w[tile]).max() / np.float32(448)
            q[tile] = np.clip(w[tile] / np.float32(scales[r, c]), -448, 448).astype(ml_dtypes.float8_e4m3fn)
    return q, scales


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict:
    """The float32 source and the FP8 checkpoints (paths), and the NumPy-made tensors ("numpy_arrays")."""
    root = tmp_path_factory.mktemp("fp8")
    f32 = write_random_qwen3(root / "f32", seed=1, with_tokenizer=False, **SHAPE)
    assert convert_main(["quantize-fp8", str(f32), str(root / "converted")]) == 0
    raw = json.loads((f32 / "config.json").read_text())
    arrays = load_file(str(f32 / "model.safetensors"))
    for name in [n for n in arrays if n.endswith("_proj.weight")]:
        arrays[name], arrays[name + "_scale_inv"] = numpy_fp8(arrays[name], BLOCK, ml_dtypes.bfloat16)
    save_hf(arrays, {**raw, "quantization_config": PUBLISHED}, root / "numpy", max_shard_bytes=200_000)
    assert len(list((root / "numpy").glob("model-*-of-*.safetensors"))) > 1  # sharded, with an index
    drafter = write_random_dflash(root / "d32", tiny_qwen3_config(**SHAPE), seed=3)
    assert convert_main(["quantize-fp8", str(drafter), str(root / "drafter")]) == 0
    return {"f32": f32, "converted": root / "converted", "numpy": root / "numpy", "drafter": root / "drafter",
            "numpy_arrays": arrays}


def torch_dequantized(folder: Path, block: tuple[int, int] = (BLOCK, BLOCK)) -> dict:
    """Every tensor of an FP8 folder read by PyTorch, FP8 weights times their block scales in float32."""
    import torch
    from safetensors.torch import load_file as torch_load

    tensors = {}
    for file in sorted(folder.glob("*.safetensors")):
        tensors.update(torch_load(str(file)))
    out = {}
    for name, t in tensors.items():
        scale = tensors.get(name + "_scale_inv")
        if name.endswith("_scale_inv"):
            continue
        if scale is None:
            out[name] = t.float()
        else:
            assert t.dtype == torch.float8_e4m3fn, name
            rows, cols = t.shape
            s = scale.float().repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]
            out[name] = t.float() * s
    return out


def hf_model(folder: Path, weights: dict):
    import transformers

    raw = json.loads((folder / "config.json").read_text())
    for key in ("architectures", "torch_dtype", "quantization_config"):
        raw.pop(key, None)
    model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**raw)).float().eval()
    model.load_state_dict(weights, strict=True)
    return model


def hf_logits(model, ids: np.ndarray) -> np.ndarray:
    import torch

    with torch.no_grad():
        return model(torch.tensor(ids)).logits.numpy()


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(hf_logits(model, np.array([ids]))[0, -1].argmax()))
    return ids[len(prompt):]


@jax.jit
def prompt_logits(params, ids: jax.Array) -> jax.Array:
    """float32 logits [1, t, v] of a one-row prompt [1, t]."""
    t = ids.shape[1]
    cache = qwen3.create_cache(params.config, 1, 32, jnp.float32)
    out = qwen3.forward(params, ids, ForwardMeta.prompt(jnp.array([t]), t), cache)
    return qwen3.logits(params, out.hidden)


def test_weights_stay_fp8_in_memory(folders):
    """Every projection but lm_head is float8_e4m3fn on the device, with float32 scales, whatever the compute
    dtype, with the bytes the NumPy quantiser made; embeddings, lm_head and norms take the requested dtype."""
    stored = folders["numpy_arrays"]
    for dtype in (jnp.bfloat16, jnp.float32):
        flat = load_target(folders["numpy"], dtype).flat()
        assert set(flat) == set(stored)
        for name, a in flat.items():
            if name.endswith("_proj.weight"):
                assert a.dtype == jnp.float8_e4m3fn, name
                assert np.asarray(a).tobytes() == stored[name].tobytes(), name
            elif name.endswith("_scale_inv"):
                assert a.dtype == jnp.float32 and stored[name].dtype == ml_dtypes.bfloat16, name
                np.testing.assert_array_equal(np.asarray(a), stored[name].astype(np.float32))
            else:
                assert a.dtype == dtype, name
    assert sum(n.endswith("_scale_inv") for n in flat) == 2 * 7  # 2 layers x q, k, v, o, gate, up, down


@pytest.mark.parametrize("which", ["converted", "numpy"])
def test_decodes_as_transformers_on_the_dequantised_weights(folders, which):
    """float32 compute: logits within 1e-4 of transformers' on the dequantised float32 weights, and the same
    greedy tokens. Negative control: transformers on the unquantised weights is far off, so the FP8
    checkpoint really differs from its float32 source."""
    folder = folders[which]
    hf = hf_model(folder, torch_dequantized(folder))
    params = load_target(folder, jnp.float32)
    ids = np.random.default_rng(0).integers(0, SHAPE["vocab_size"], size=(1, 11))
    ours = np.asarray(prompt_logits(params, jnp.asarray(ids)))
    np.testing.assert_allclose(ours, hf_logits(hf, ids), atol=TOL, rtol=0)
    source = hf_model(folders["f32"], torch_dequantized(folders["f32"]))
    assert np.abs(ours - hf_logits(source, ids)).max() > 100 * TOL

    result = generate(params, PROMPTS, DecodeOptions(max_new_tokens=NEW_TOKENS))
    assert result.output_ids == [hf_greedy(hf, p, NEW_TOKENS) for p in PROMPTS]


@pytest.fixture(scope="module")
def pair(folders) -> tuple:
    """(FP8 target, FP8 drafter, greedy AR tokens of PROMPTS on the default path: XLA dequantises), float32."""
    target = load_target(folders["converted"], jnp.float32)
    drafter = load_drafter(folders["drafter"], target.config, jnp.float32)
    return target, drafter, generate(target, PROMPTS, DecodeOptions(max_new_tokens=NEW_TOKENS)).output_ids


def test_dflash_and_ddtree_on_fp8_equal_ar(pair):
    """FP8 target and FP8 drafter: greedy DFlash and DDTree give AR's tokens, with drafts accepted."""
    target, drafter, ar = pair
    assert drafter.flat()["fc.weight"].dtype == jnp.float8_e4m3fn
    for mode in (Mode.DFLASH, Mode.DDTREE):
        spec = generate(target, PROMPTS, DecodeOptions(mode=mode, max_new_tokens=NEW_TOKENS, budget=16),
                        drafter=drafter)
        assert spec.output_ids == ar, mode
        assert max(n for row in spec.acceptance_lengths for n in row) >= 2, mode


def _stream_kernel_calls(jaxpr, name: str = "stream_matmul_fp8") -> int:
    """How many FP8 streaming-matmul kernels (`pallas_call`s named `name`) a program holds."""
    from jaxprs import pallas_call_names

    return sum(name in kernel for kernel in pallas_call_names(jaxpr))


def test_streamed_fp8_matmul_gives_the_dequantize_tokens(pair):
    """`fp8_matmul="stream"` with the Pallas kernels (interpreted): each of the 14 FP8 projections of an AR step's
    target forward is the streaming kernel (none with "dequantize": the negative control; the kernel on FP8 rows
    with "w8a8"), and greedy DDTree on the
    FP8 target and drafter gives the dequantize path's AR tokens, with drafts accepted."""
    target, drafter, ar = pair
    cache = qwen3.create_cache(target.config, 1, 32, jnp.float32)
    meta = ForwardMeta.step(jnp.array([3]), jnp.array([True]))
    for fp8_matmul, calls, w8a8_calls in (("stream", 2 * 7, 0), ("dequantize", 0, 0), ("w8a8", 0, 2 * 7)):
        runtime = DecodeOptions(kernels="pallas", fp8_matmul=fp8_matmul).runtime
        step = jax.make_jaxpr(lambda p, t: qwen3.forward(p, t, meta, cache, runtime=runtime).hidden)
        program = step(target, jnp.array([[5]]))
        assert _stream_kernel_calls(program) == calls, fp8_matmul
        assert _stream_kernel_calls(program, "stream_matmul_w8a8") == w8a8_calls, fp8_matmul
    # DDTree alone (its prefill, verify and drafter stream): the AR step's program is read above, and an AR decode
    # here doubled the test's time (compiling the interpreted kernels).
    options = DecodeOptions(mode=Mode.DDTREE, max_new_tokens=NEW_TOKENS, budget=4, kernels="pallas", fp8_matmul="stream")
    got = generate(target, PROMPTS, options, drafter=drafter)
    assert got.output_ids == ar
    assert max(n for row in got.acceptance_lengths for n in row) >= 2


def _fp8_bf16_step(tmp_path, family: str = "qwen3"):
    """A random Qwen3 (or Qwen3.5-style hybrid, `family` "qwen3_5") quantised to FP8 in 16 x 32 blocks (q|k|v and
    gate|up packed), loaded in bf16, its model module, a one-row cache and an AR step's meta at position 3:
    (target, module, cache, meta)."""
    from ddtree_jax.models import qwen3_5

    if family == "qwen3":
        module, src = qwen3, write_random_qwen3(tmp_path / "f32", seed=6, with_tokenizer=False, vocab_size=64)
    else:
        module, src = qwen3_5, write_random_qwen3_5(tmp_path / "f32", seed=6, vocab_size=64)
    assert convert_main(["quantize-fp8", str(src), str(tmp_path / "fp8"), "--block", "16,32"]) == 0
    target = load_target(tmp_path / "fp8", jnp.bfloat16)
    return (target, module, module.create_cache(target.config, 1, 32, jnp.bfloat16),
            ForwardMeta.step(jnp.array([3]), jnp.array([True])))


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5"])
def test_w8a8_rows_from_the_norm_give_the_same_bits(tmp_path, monkeypatch, family):
    """`layers.W8A8_ROWS_FROM_NORM` (on by default): under W8A8 the add + RMSNorm kernel before q|k|v and gate|up
    hands them FP8 rows (codes and scales, `QuantizedRows`), which the streaming kernel takes as given instead of
    quantising each step's tile: an AR step's program runs the quantising norm kernel before every layer's gate|up
    and every full-attention layer's q|k|v (not before a Gated DeltaNet's four projections), and its hidden states
    and caches keep their bits (bf16, kernels interpreted). Under W8A16 nothing changes."""
    from jaxprs import pallas_call_names

    from ddtree_jax.models import layers

    target, module, cache, meta = _fp8_bf16_step(tmp_path, family)
    config = target.config
    attention_layers = len(getattr(config, "attention_layers", range(config.num_layers)))
    for fp8_matmul in ("w8a8", "stream"):
        runtime = DecodeOptions(kernels="pallas", fp8_matmul=fp8_matmul).runtime
        outs = {}
        for from_norm in (False, True):
            monkeypatch.setattr(layers, "W8A8_ROWS_FROM_NORM", from_norm)
            step = lambda p, t: module.forward(p, t, meta, cache, runtime=runtime)  # noqa: E731
            names = pallas_call_names(jax.make_jaxpr(step)(target, jnp.array([[5]])))
            quantising = sum(name == "add_rms_norm_fp8" for name in names)
            want = config.num_layers + attention_layers if from_norm and fp8_matmul == "w8a8" else 0
            assert quantising == want, names
            out = jax.jit(step)(target, jnp.array([[5]]))
            outs[from_norm] = [np.asarray(leaf, np.float32) for leaf in jax.tree.leaves(out)]  # hidden, caches
        for a, b in zip(outs[False], outs[True]):
            np.testing.assert_array_equal(a, b)


def test_packed_fp8_projections_stream_as_one_matmul_each(tmp_path):
    """Blocks of 16 x 32 divide the heads (16) and the MLP halves: q|k|v and gate|up stay packed as FP8, so an AR
    step streams four FP8 matmuls a layer (not seven) and runs the Pallas q/k-norm-and-RoPE kernel on the packed
    output; its hidden states are the dequantise path's (kernels interpreted); an orbax copy loads the same."""
    src = write_random_qwen3(tmp_path / "f32", seed=5, with_tokenizer=False, vocab_size=64)
    assert convert_main(["quantize-fp8", str(src), str(tmp_path / "fp8"), "--block", "16,32"]) == 0
    target = load_target(tmp_path / "fp8", jnp.float32)
    cache = qwen3.create_cache(target.config, 1, 32, jnp.float32)
    meta = ForwardMeta.step(jnp.array([3]), jnp.array([True]))
    hidden = {}
    for fp8_matmul in ("stream", "dequantize"):
        runtime = DecodeOptions(kernels="pallas", fp8_matmul=fp8_matmul).runtime
        step = lambda p, t: qwen3.forward(p, t, meta, cache, runtime=runtime).hidden  # noqa: E731
        program = jax.make_jaxpr(step)(target, jnp.array([[5]]))
        layers = target.config.num_layers
        assert _stream_kernel_calls(program) == (4 * layers if fp8_matmul == "stream" else 0), fp8_matmul
        assert _stream_kernel_calls(program, "qk_norm_rope") == layers, fp8_matmul
        hidden[fp8_matmul] = np.asarray(jax.jit(step)(target, jnp.array([[5]])))
    np.testing.assert_allclose(hidden["stream"], hidden["dequantize"], rtol=1e-5, atol=1e-5)
    # An orbax copy packs the HF weights and scales back into the same held arrays.
    assert convert_main(["hf-to-orbax", str(tmp_path / "fp8"), str(tmp_path / "orbax")]) == 0
    again = load_target(tmp_path / "orbax", jnp.float32)
    for name, array in target.state_flat().items():
        assert np.asarray(again.state_flat()[name]).tobytes() == np.asarray(array).tobytes(), name


@pytest.mark.parametrize("k", [256, 300])  # group 128 divides k, or the row ends in a partial group
def test_quantize_rows_is_each_row_groups_own_quantisation(k):
    """Each row's groups of 128, restated in NumPy: the scale is the least power of two p with the largest |x| <= 448 p
    (1 for an all-zero group), q = x / p rounded to nearest (ml_dtypes; exact division by a power of two), so the
    group's largest |x| / p lies in (224, 448]; and x = q p within e4m3's rounding (half a unit in its 3-bit mantissa)
    wherever the code is normal."""
    from ddtree_jax.models import fp8

    rng = np.random.default_rng(k)
    x = (rng.standard_normal((4, k)) * rng.uniform(0.01, 100, size=(4, 1))).astype(np.float32)
    x[1, :128] = 0
    x[2, :128] = np.linspace(-448, 448, 128)  # the largest exactly 448: scale 1
    x[3, 5] = 449.0  # just above: scale 2
    q, scale = fp8.quantize_rows(jnp.asarray(x), 128)
    assert q.dtype == jnp.float8_e4m3fn and scale.shape == (4, -(-k // 128)) and scale.dtype == jnp.float32
    for r in range(4):
        for c in range(0, k, 128):
            group = x[r, c:c + 128].astype(np.float64)
            amax = np.abs(group).max()
            if amax == 0:
                want = 1.0
            else:
                j = int(np.ceil(np.log2(amax / 448)))
                want = min(2.0 ** i for i in (j - 1, j, j + 1) if amax <= 448 * 2.0 ** i)
            assert float(scale[r, c // 128]) == want, (r, c)
            codes = np.asarray(q[r, c:c + 128]).astype(np.float64)
            np.testing.assert_array_equal(np.asarray(q[r, c:c + 128]).view(np.uint8),
                                          (group / want).astype(np.float32).astype(ml_dtypes.float8_e4m3fn)
                                          .view(np.uint8))
            if amax > 0:
                assert 224 < amax / want <= 448 and 224 <= np.abs(codes).max() <= 448
                normal = np.abs(codes) >= 2.0 ** -6
                assert np.all(np.abs(codes * want - group)[normal] <= np.abs(group)[normal] * 2.0 ** -4)
    assert float(scale[2, 0]) == 1.0 and float(scale[3, 0]) == 2.0


def test_w8a8_dflash_and_ddtree_equal_its_own_ar(pair):
    """`fp8_matmul="w8a8"` (each token's activations quantised to FP8 first; the jnp path): greedy DFlash and
    DDTree give the AR tokens of the same arithmetic, with drafts accepted; its logits are not the dequantize
    path's (the quantisation is there)."""
    target, drafter, _ = pair
    ar = generate(target, PROMPTS, DecodeOptions(max_new_tokens=NEW_TOKENS, fp8_matmul="w8a8"))
    for mode in (Mode.DFLASH, Mode.DDTREE):
        spec = generate(target, PROMPTS, DecodeOptions(mode=mode, max_new_tokens=NEW_TOKENS, budget=16,
                                                       fp8_matmul="w8a8"), drafter=drafter)
        assert spec.output_ids == ar.output_ids, mode
        assert max(n for row in spec.acceptance_lengths for n in row) >= 2, mode
    cache = qwen3.create_cache(target.config, 1, 32, jnp.float32)
    hidden = {m: qwen3.forward(target, jnp.array([[5, 7, 2]]), ForwardMeta.prompt(jnp.array([3]), 3), cache,
                               runtime=DecodeOptions(fp8_matmul=m).runtime).hidden for m in ("w8a8", "dequantize")}
    assert not np.allclose(np.asarray(hidden["w8a8"]), np.asarray(hidden["dequantize"]), atol=1e-3)


def test_converter_writes_the_published_layout_and_orbax_keeps_it(folders, tmp_path):
    """quantize-fp8 writes the published config, and the NumPy quantiser's blocks: float32 scales within one
    rounding of largest |w| / 448 (XLA divides by a constant as a multiply by its reciprocal), weights divided
    by them bit for bit. HF -> orbax -> HF keeps every FP8 weight and scale bit-exact."""
    converted = folders["converted"]
    config = json.loads((converted / "config.json").read_text())
    assert config["quantization_config"] == {**PUBLISHED, "modules_to_not_convert": ["lm_head", "model.embed_tokens"]}
    header = json.loads((converted / "model.safetensors").read_bytes()[8:][:int.from_bytes(
        (converted / "model.safetensors").read_bytes()[:8], "little")])
    source = load_file(str(folders["f32"] / "model.safetensors"))
    arrays, _ = read_arrays(converted)
    for name, w in source.items():
        if name.endswith("_proj.weight"):
            assert header[name]["dtype"] == "F8_E4M3" and header[name + "_scale_inv"]["dtype"] == "F32", name
            scales = arrays[name + "_scale_inv"]
            np.testing.assert_allclose(scales, numpy_fp8(w, BLOCK, np.float32)[1], rtol=2**-23, atol=0)
            assert arrays[name].tobytes() == numpy_fp8(w, BLOCK, np.float32, scales)[0].tobytes(), name
        else:
            assert arrays[name].tobytes() == w.tobytes(), name

    assert convert_main(["hf-to-orbax", str(converted), str(tmp_path / "orbax")]) == 0
    assert convert_main(["orbax-to-hf", str(tmp_path / "orbax"), str(tmp_path / "back")]) == 0
    for folder in (tmp_path / "orbax", tmp_path / "back"):
        back, raw = read_arrays(folder)
        assert raw["quantization_config"] == config["quantization_config"]
        assert set(back) == set(arrays)
        for name, a in arrays.items():
            assert np.asarray(back[name]).dtype == a.dtype and np.asarray(back[name]).tobytes() == a.tobytes(), name


@pytest.mark.skipif(len(jax.devices()) < 4, reason="needs 4 (forced host) devices")
def test_tensor_parallel_shards_scales_with_whole_blocks(tmp_path):
    """Under tp a scale dim splits with its weight where each device's rows are whole blocks (the packed gate|up on
    its rows, down on its columns) and stays replicated elsewhere (o_proj; the packed q|k|v, whose 2 KV heads do
    not split over 4 devices, is replicated whole with its scales); either way the logits are one device's."""
    from jax.sharding import PartitionSpec as P

    from ddtree_jax.parallel import make_parallel

    src = write_random_qwen3(tmp_path / "f32", seed=4, with_tokenizer=False, vocab_size=64)
    assert convert_main(["quantize-fp8", str(src), str(tmp_path / "fp8"), "--block", "16,32"]) == 0
    single = load_target(tmp_path / "fp8", jnp.float32)
    sharded = load_target(tmp_path / "fp8", jnp.float32, parallel=make_parallel(4, "tp"))
    specs = {n: a.sharding.spec for n, a in sharded.state_flat().items() if n.startswith("model.layers.0.")}
    layer = "model.layers.0."
    assert specs[layer + "mlp.gate_up_proj.weight"] == P(None, None, "model", None)
    assert specs[layer + "mlp.gate_up_proj.weight_scale_inv"] == P(None, None, "model", None)
    assert specs[layer + "mlp.down_proj.weight_scale_inv"] == P(None, "model")
    assert specs[layer + "self_attn.qkv_proj.weight"] == P(None, None, None, None)  # 2 whole KV heads, 4 devices
    assert specs[layer + "self_attn.qkv_proj.weight_scale_inv"] == P(None, None, None, None)
    assert specs[layer + "self_attn.o_proj.weight"] == P(None, "model")
    assert specs[layer + "self_attn.o_proj.weight_scale_inv"] == P(None, None)
    ids = jnp.asarray(np.random.default_rng(1).integers(0, 64, size=(1, 11)))
    np.testing.assert_allclose(np.asarray(prompt_logits(sharded, ids)), np.asarray(prompt_logits(single, ids)),
                               atol=1e-5, rtol=0)


def test_hybrid_fp8_matches_transformers(tmp_path):
    """A Qwen3.5-style hybrid through quantize-fp8 (blocks 16 x 32): the Gated DeltaNet's in_proj_a/in_proj_b,
    A_log, dt_bias and conv1d stay float32, its other projections and the gated attention's are FP8 (q|k|v and
    gate|up packed as FP8, the blocks dividing their rows), and the prefill logits are transformers' on the
    dequantised weights."""
    import torch
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    from conftest import randomise_qwen3_5
    from ddtree_jax.models import qwen3_5

    torch.manual_seed(0)
    raw = tiny_qwen3_5_config(vocab_size=96)
    raw.pop("architectures"), raw.pop("torch_dtype")
    model = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**raw)).float().eval()
    randomise_qwen3_5(model)
    model.save_pretrained(str(tmp_path / "f32"))
    assert convert_main(["quantize-fp8", str(tmp_path / "f32"), str(tmp_path / "fp8"), "--block", "16,32"]) == 0
    params = load_target(tmp_path / "fp8", jnp.float32)
    dtypes = {n.removeprefix("model.layers.0.linear_attn."): a.dtype for n, a in params.flat().items()
              if n.startswith("model.layers.0.linear_attn.")}
    assert {n for n, d in dtypes.items() if d == jnp.float8_e4m3fn} == {"in_proj_qkv.weight", "in_proj_z.weight",
                                                                       "out_proj.weight"}
    assert dtypes["in_proj_a.weight"] == dtypes["A_log"] == dtypes["conv1d.weight"] == jnp.float32
    assert params.flat()["model.layers.3.self_attn.q_proj.weight"].dtype == jnp.float8_e4m3fn
    held = params.state_flat()  # 16-row blocks divide every head and MLP half: q|k|v and gate|up stay packed, FP8
    for name in ("model.layers.3.self_attn.qkv_proj", "model.layers.0.mlp.gate_up_proj"):
        assert held[name + ".weight"].dtype == jnp.float8_e4m3fn and held[name + ".weight_scale_inv"].ndim == 4, name
    model.load_state_dict(torch_dequantized(tmp_path / "fp8", (16, 32)), strict=True)
    ids = np.random.default_rng(2).integers(0, 96, size=(1, 9))

    @jax.jit
    def logits(params, ids):
        cache = qwen3_5.create_cache(params.config, 1, 16, jnp.float32)
        return qwen3_5.logits(params, qwen3_5.forward(params, ids, ForwardMeta.prompt(jnp.array([9]), 9), cache).hidden)

    with torch.no_grad():
        want = model(torch.tensor(ids)).logits.numpy()
    np.testing.assert_allclose(np.asarray(logits(params, jnp.asarray(ids))), want, atol=TOL, rtol=0)


# ---- which projections are FP8, and the errors


def test_modules_to_not_convert_follows_transformers():
    """`Fp8Config.converts` decides as transformers' `should_convert_module` (prefix to a name boundary, regex,
    suffix) on a table of patterns and names; a qwen3_5 wrapper's patterns name 'model.language_model.'."""
    from transformers.quantizers.quantizers_utils import should_convert_module

    patterns = [["model.layers.1"], ["model.layers.*.mlp"], ["mlp.gate"], ["up_proj"],
                ["lm_head", "model.embed_tokens"], [r"model\.layers\.[02]\.self_attn"], []]
    names = ["model.layers.1.mlp.up_proj", "model.layers.11.mlp.up_proj", "model.layers.0.mlp.gate_proj",
             "model.layers.2.self_attn.q_proj", "model.layers.3.self_attn.o_proj", "lm_head"]
    decisions = {}
    for skip in patterns:
        for name in names:
            decisions[tuple(skip), name] = Fp8Config(not_converted=tuple(skip)).converts(name)
            assert decisions[tuple(skip), name] == should_convert_module(name, skip), (skip, name)
    assert len(set(decisions.values())) == 2  # the table has both answers
    skip = ["lm_head", "model.language_model.layers.0.linear_attn.in_proj_a", r"model\.language_model\.layers\.1"]
    wrapper = {"model_type": "qwen3_5", "text_config": tiny_qwen3_5_config(),
               "quantization_config": {**PUBLISHED, "modules_to_not_convert": skip}}
    fp8 = parse_qwen3_5(wrapper).fp8
    assert not fp8.converts("model.layers.0.linear_attn.in_proj_a")
    assert fp8.converts("model.layers.0.linear_attn.in_proj_b")
    assert not fp8.converts("model.layers.1.mlp.up_proj") and fp8.converts("model.layers.2.mlp.up_proj")


@pytest.mark.parametrize("field,value,message", [
    ("quant_method", "awq", "field 'quant_method': 'awq' is not supported (expected 'fp8'"),
    ("fmt", "e5m2", "field 'fmt': 'e5m2' is not supported (expected 'e4m3'"),
    ("activation_scheme", "static", "field 'activation_scheme': 'static' is not supported (expected 'dynamic'"),
    ("scale_fmt", "ue8m0", "field 'scale_fmt': 'ue8m0' is not supported (expected 'float'"),
    ("weight_block_size", [128], "field 'weight_block_size': expected [rows, columns], two positive integers, "
                                 "found [128]"),
    ("weight_block_size", [128, 0], "found [128, 0]"),
    ("weight_block_size", None, "found None (per-tensor scales are not supported)"),
    ("modules_to_not_convert", "lm_head", "field 'modules_to_not_convert': expected a list of module names"),
    ("modules_to_not_convert", ["lm_head", "layers.(0"], "'layers.(0' is not a valid pattern"),
], ids=["quant_method", "fmt", "activation_scheme", "scale_fmt", "block_1d", "block_0", "block_null", "skip_string",
        "skip_bad_regex"])
def test_unsupported_quantization_config_is_one_clear_error(field, value, message):
    raw = tiny_qwen3_config(quantization_config={**PUBLISHED, field: value})
    with pytest.raises(ConfigError) as e:
        parse_qwen3(raw, "DIR/config.json")
    assert str(e.value).startswith("DIR/config.json: quantization_config: ") and message in str(e.value)


def test_unsupported_fmt_on_the_command_line_is_one_error_line_and_exit_2(folders, tmp_path, capsys):
    import shutil

    bad = Path(shutil.copytree(folders["converted"], tmp_path / "bad"))
    raw = json.loads((bad / "config.json").read_text())
    raw["quantization_config"]["fmt"] = "e5m2"
    (bad / "config.json").write_text(json.dumps(raw))
    assert convert_main(["hf-to-orbax", str(bad), str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err == (f"error: {bad / 'config.json'}: quantization_config: field 'fmt': 'e5m2' is "
                                       "not supported (expected 'e4m3': float8_e4m3fn weights)\n")


def _edited_copy(folder: Path, out: Path, edit) -> Path:
    arrays, raw = read_arrays(folder)
    edit(arrays)
    return save_hf(arrays, raw, out)


SCALE = "model.layers.0.mlp.up_proj.weight_scale_inv"
WEIGHT = "model.layers.0.mlp.up_proj.weight"


@pytest.mark.parametrize("edit,message", [
    pytest.param( lambda a: a.pop(SCALE), f"tensor '{SCALE}' is missing (expected shape (3, 2))", id="missing_scale"),
    pytest.param(lambda a: a.update({SCALE: np.ones((2, 2), np.float32)}),
                 f"tensor '{SCALE}' has shape (2, 2), expected (3, 2) from config.json", id="misshaped_scale"),
    pytest.param(lambda a: a.update({WEIGHT: a[WEIGHT].astype(ml_dtypes.bfloat16)}),
                 f"tensor '{WEIGHT}' has dtype BF16, expected float8_e4m3fn (config.json's quantization_config "
                 "makes this projection FP8)", id="bf16_weight"),
    pytest.param(lambda a: a.update({"lm_head.weight": a["lm_head.weight"].astype(ml_dtypes.float8_e4m3fn)}),
                 "tensor 'lm_head.weight' has dtype F8_E4M3, expected a floating-point dtype", id="fp8_lm_head"),
])
def test_bad_fp8_tensors_are_one_error_line_and_exit_2(folders, tmp_path, capsys, edit, message):
    bad = _edited_copy(folders["converted"], tmp_path / "bad", edit)
    with pytest.raises(CheckpointError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_target(bad, jnp.float32)
    assert convert_main(["hf-to-orbax", str(bad), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"error: {bad / 'model.safetensors'}: ") and message in err, err
    assert not (tmp_path / "out").exists()


def test_quantize_fp8_refuses_bad_requests_before_writing(folders, tmp_path, capsys):
    cases = [(["quantize-fp8", str(folders["converted"]), str(tmp_path / "a")],
              "already has a quantization_config (quant_method 'fp8'); quantize-fp8 reads a 16- or 32-bit checkpoint"),
             (["quantize-fp8", str(folders["f32"]), str(tmp_path / "b"), "--block", "128"],
              "--block takes two positive integers ROWS,COLS, got '128'"),
             (["quantize-fp8", str(folders["f32"]), str(folders["converted"])], "already exists (pass --force")]
    for argv, message in cases:
        assert convert_main(argv) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("error: ") and message in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == []
