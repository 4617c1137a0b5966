"""Target/drafter compatibility: each check fails with a message naming the field, the value and the expectation."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from ddtree_jax.checkpoint import CheckpointError, load_drafter, save_hf
from ddtree_jax.config import ConfigError, load_target_config, parse_dflash
from ddtree_jax.random_checkpoint import (random_dflash_arrays, tiny_dflash_config, tiny_qwen3_config,
                                          write_random_dflash, write_random_qwen3)

TARGET = tiny_qwen3_config()  # 2 layers, hidden 64, vocab 320


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory) -> Path:
    return write_random_qwen3(tmp_path_factory.mktemp("t") / "t", with_tokenizer=False)


def _drafter(tmp_path, **overrides) -> Path:
    return write_random_dflash(tmp_path / "d", TARGET, **overrides)


@pytest.mark.parametrize("overrides,message", [
    (dict(dflash_config={"mask_token_id": 320, "target_layer_ids": [0, 1]}),
     "field 'dflash_config.mask_token_id': 320 is not a row of the target's embedding (expected 0..319)"),
    (dict(dflash_config={"mask_token_id": 5, "target_layer_ids": [0, 2]}),
     "field 'dflash_config.target_layer_ids': 2 is not a target layer (expected 0..1; found [0, 2])"),
    (dict(num_target_layers=36),
     "field 'num_target_layers': 36, but the target has 2 layers"),
])
def test_config_checks(tmp_path, target_dir, overrides, message):
    drafter = _drafter(tmp_path, **overrides)
    with pytest.raises(ConfigError) as err:
        load_drafter(drafter, load_target_config(target_dir))
    assert message in str(err.value) and str(drafter / "config.json") in str(err.value)


def test_layer_mismatch_can_be_allowed(tmp_path, target_dir):
    drafter = _drafter(tmp_path, num_target_layers=36)
    assert load_drafter(drafter, load_target_config(target_dir), allow_layer_mismatch=True).config.num_target_layers == 36


def test_hidden_size_and_vocab_must_match(tmp_path, target_dir):
    target = load_target_config(target_dir)
    wide = save_hf(random_dflash_arrays(tiny_dflash_config(TARGET, hidden_size=48), 64), tiny_dflash_config(
        TARGET, hidden_size=48), tmp_path / "wide")
    with pytest.raises(ConfigError, match="field 'hidden_size': 48, expected the target's hidden_size 64"):
        load_drafter(wide, target)
    other_vocab = tiny_dflash_config(TARGET, vocab_size=400)
    folder = save_hf(random_dflash_arrays(other_vocab, 64), other_vocab, tmp_path / "vocab")
    with pytest.raises(ConfigError, match="field 'vocab_size': 400, expected the target's vocab_size 320"):
        load_drafter(folder, target)


def test_fc_width_must_be_taps_times_target_hidden(tmp_path, target_dir):
    config = tiny_dflash_config(TARGET)
    arrays = random_dflash_arrays(config, 64)
    arrays["fc.weight"] = np.zeros((64, 3 * 64), np.float32)  # trained on three taps, config lists two
    folder = save_hf(arrays, config, tmp_path / "fc")
    with pytest.raises(CheckpointError, match=r"tensor 'fc.weight' takes 192 input features, but "
                                              r"len\(target_layer_ids\)=2 taps x the target's hidden_size 64 = 128"):
        load_drafter(folder, load_target_config(target_dir))


@pytest.mark.parametrize("change,message", [
    (dict(architectures=["Qwen3ForCausalLM"]), "field 'architectures': expected a list holding 'DFlashDraftModel'"),
    (dict(dflash_config=None), "field 'dflash_config': missing"),
    (dict(block_size=None), "field 'block_size'"),
    (dict(dflash_config={"target_layer_ids": [1]}), "dflash_config: field 'mask_token_id': missing"),
    (dict(dflash_config={"mask_token_id": 3, "target_layer_ids": []}), "field 'target_layer_ids': expected a non-empty"),
    (dict(is_causal="yes"), "field 'is_causal': expected true, false or null"),
])
def test_drafter_config_fields(change, message):
    raw = tiny_dflash_config(TARGET)
    for key, value in change.items():
        if value is None:
            raw.pop(key)
        else:
            raw[key] = value
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse_dflash(raw)


def test_block_size_inside_dflash_config_and_layer_rules():
    raw = tiny_dflash_config(TARGET, layer_types=["sliding_attention", "full_attention"], sliding_window=64,
                             use_sliding_window=True)
    raw.pop("block_size")
    raw["dflash_config"]["block_size"] = 8
    c = parse_dflash(raw)
    assert c.block_size == 8 and c.layer_causal == (True, False) and c.layer_windows == (64, None)
    c = parse_dflash({**raw, "is_causal": False})
    assert c.layer_causal == (False, False)


def test_cli_refuses_a_bad_pair_before_loading_weights(tmp_path, target_dir, capsys):
    """In this process (`main`, as `python -m ddtree_jax.generate` calls it)."""
    from ddtree_jax.generate import main

    drafter = _drafter(tmp_path, dflash_config={"mask_token_id": 999, "target_layer_ids": [0, 1]})
    (drafter / "model.safetensors").write_bytes(b"not even read")
    assert main(["--target", str(target_dir), "--drafter", str(drafter), "--mode", "dflash", "--prompt-ids",
                 "1,2"]) == 2
    assert capsys.readouterr().err.strip() == (f"error: {drafter / 'config.json'}: field 'dflash_config.mask_token_id': "
                                               "999 is not a row of the target's embedding (expected 0..319)")
