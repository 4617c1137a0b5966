"""Tensor- and data-parallel execution on forced host devices: token-identical to one device."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from ddtree_jax.checkpoint import load_drafter, load_target
from ddtree_jax.engine import DecodeOptions, Mode, generate
from ddtree_jax.parallel import make_parallel
from ddtree_jax.random_checkpoint import tiny_qwen3_config, write_random_dflash, write_random_qwen3

TARGET = dict(vocab_size=64, num_attention_heads=8, num_key_value_heads=4, head_dim=8, intermediate_size=128)
PROMPTS = [[1, 2, 3, 4, 5, 6, 7], [3, 9], [11, 12, 13]]

pytestmark = pytest.mark.skipif(len(jax.devices()) < 4, reason="needs 4 (forced host) devices")
MODES = [mode for mode in Mode if mode is not Mode.MTP]  # a Qwen3 target has no MTP head (test_mtp_decoding)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("par")
    target = write_random_qwen3(root / "t", seed=4, with_tokenizer=False, **TARGET)
    drafter = write_random_dflash(root / "d", tiny_qwen3_config(**TARGET), seed=5, block_size=4)
    return target, drafter


@pytest.fixture(scope="module")
def single_outputs(folders):
    target = load_target(folders[0], jnp.float32)
    drafter = load_drafter(folders[1], target.config, jnp.float32)
    out = {}
    for mode in MODES:
        options = DecodeOptions(mode=mode, max_new_tokens=16, budget=8)
        out[mode] = generate(target, PROMPTS, options, drafter=drafter)
    return out


# Every mode on 4 devices (one KV head per device under tp); DDTree on 2 as well.
@pytest.mark.parametrize("mode,parallel_mode,devices", [
    pytest.param(mode, parallel_mode, devices, id=f"{mode.value}-{parallel_mode}-{devices}")
    for mode in MODES for parallel_mode in ("tp", "dp") for devices in (2, 4)
    if devices == 4 or mode == Mode.DDTREE])
def test_token_identical_to_one_device(folders, single_outputs, devices, parallel_mode, mode):
    parallel = make_parallel(devices, parallel_mode)
    target = load_target(folders[0], jnp.float32, parallel=parallel)
    drafter = load_drafter(folders[1], target.config, jnp.float32, parallel=parallel)
    options = DecodeOptions(mode=mode, max_new_tokens=16, budget=8, parallel=parallel)
    result = generate(target, PROMPTS, options, drafter=drafter)
    assert result.output_ids == single_outputs[mode].output_ids
    assert result.acceptance_lengths == single_outputs[mode].acceptance_lengths


def test_tp_devices_hold_only_their_shards(folders):
    parallel = make_parallel(4, "tp")
    target = load_target(folders[0], jnp.float32, parallel=parallel)
    flat = target.flat()
    # [out, in] weights: q/k/v, gate/up and the vocab tables split on dim 0; o/down on dim 1.
    split = {"model.layers.0.self_attn.q_proj.weight": 0, "model.layers.0.self_attn.k_proj.weight": 0,
             "model.layers.0.mlp.gate_proj.weight": 0, "model.layers.1.mlp.up_proj.weight": 0,
             "model.embed_tokens.weight": 0, "lm_head.weight": 0,
             "model.layers.0.self_attn.o_proj.weight": 1, "model.layers.1.mlp.down_proj.weight": 1}
    for name, dim in split.items():
        array = flat[name]
        shards = array.addressable_shards
        assert len(shards) == 4 and len({s.device for s in shards}) == 4, name
        for shard in shards:
            expected = list(array.shape)
            expected[dim] //= 4
            assert list(shard.data.shape) == expected, name
        # Together the shards are the whole tensor, without overlap.
        starts = sorted(s.index[dim].start for s in shards)
        assert starts == [i * array.shape[dim] // 4 for i in range(4)], name
    norm = flat["model.norm.weight"]
    assert all(s.data.shape == norm.shape for s in norm.addressable_shards)  # small: replicated


def test_dp_splits_rows_and_pads_to_the_device_count(folders, single_outputs):
    parallel = make_parallel(2, "dp")
    target = load_target(folders[0], jnp.float32, parallel=parallel)
    result = generate(target, PROMPTS, DecodeOptions(max_new_tokens=16, parallel=parallel))
    assert len(result.output_ids) == 3 and result.output_ids == single_outputs[Mode.AR].output_ids


def test_too_many_devices_is_a_clear_error():
    with pytest.raises(ValueError, match=r"--devices 64: only \d+ device\(s\) are visible"):
        make_parallel(64, "tp")


def test_tp_program_all_reduces_and_dp_does_not(folders):
    """The partitioned decode loop really is split: tp all-reduces the partial sums after attention and
    after the MLP of every layer; dp only reduces the loop's all-rows-done flag."""
    from ddtree_jax import engine

    engine._COMPILED.clear()  # only this test's programs (earlier tests compile other dp/tp loops)
    texts = {}
    for mode in ("tp", "dp"):
        parallel = make_parallel(2, mode)
        target = load_target(folders[0], jnp.float32, parallel=parallel)
        generate(target, PROMPTS, DecodeOptions(max_new_tokens=4, parallel=parallel))
        texts[mode] = [c.as_text() for key, c in engine._COMPILED.items()
                       if key[0] == "decode_loop" and f"'{mode}'" in str(key[3])]
    layers = 2
    count = lambda text: text.count(" all-reduce(")  # noqa: E731
    assert texts["tp"] and all(count(t) >= 2 * layers for t in texts["tp"])
    assert texts["dp"] and all(count(t) < 2 * layers for t in texts["dp"])
