"""Parsing HF config.json into Qwen3Config, and the errors for values we cannot run."""

from __future__ import annotations

import json

import numpy as np
import pytest

from ddtree_jax.config import ConfigError, load_target_config, parse_qwen3
from ddtree_jax.random_checkpoint import tiny_qwen3_config


def test_qwen3_8b_shapes():
    raw = tiny_qwen3_config(hidden_size=4096, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                            head_dim=128, intermediate_size=12288, vocab_size=151936, rope_theta=1e6,
                            eos_token_id=151645, tie_word_embeddings=False)
    c = parse_qwen3(raw)
    assert (c.num_groups, c.head_dim, c.rope.theta, c.eos_token_ids) == (4, 128, 1e6, (151645,))
    assert c.sliding_windows == (None,) * 36
    assert 8.1e9 < c.num_params() < 8.3e9  # Qwen3-8B has 8.19e9 parameters


def test_rope_parameters_and_legacy_fields_agree():
    new = parse_qwen3(tiny_qwen3_config(rope_parameters={"rope_type": "default", "rope_theta": 1234.0}))
    old = parse_qwen3(tiny_qwen3_config(rope_theta=1234.0))
    assert new.rope == old.rope
    linear = parse_qwen3(tiny_qwen3_config(rope_scaling={"type": "linear", "factor": 4.0}))
    base = parse_qwen3(tiny_qwen3_config()).rope  # same theta, no scaling
    np.testing.assert_allclose(linear.rope.inv_freq(16), base.inv_freq(16) / 4)


def test_sliding_window_layers_follow_hf_rules():
    assert parse_qwen3(tiny_qwen3_config(sliding_window=8)).sliding_windows == (None, None)  # use_sliding_window off
    c = parse_qwen3(tiny_qwen3_config(use_sliding_window=True, sliding_window=8, max_window_layers=1))
    assert c.sliding_windows == (None, 8)
    c = parse_qwen3(tiny_qwen3_config(use_sliding_window=True, sliding_window=8,
                                      layer_types=["sliding_attention", "full_attention"]))
    assert c.sliding_windows == (8, None)


@pytest.mark.parametrize("change,message", [
    (dict(model_type="qwen2"), "field 'model_type': expected 'qwen3', found 'qwen2'"),
    (dict(hidden_size="64"), "field 'hidden_size': expected an integer, found '64'"),
    (dict(num_key_value_heads=3), "field 'num_key_value_heads': 3 does not divide num_attention_heads=4"),
    (dict(head_dim=15), "field 'head_dim': expected an even number"),
    (dict(hidden_act="gelu"), "field 'hidden_act': expected 'silu', found 'gelu'"),
    (dict(attention_bias=True), "field 'attention_bias'"),
    (dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4}), "rope_type 'yarn' is not supported"),
    (dict(rope_scaling={"rope_type": "linear"}), "field 'factor': missing"),
    (dict(layer_types=["full_attention"]), "field 'layer_types': expected a list of 2 entries"),
    (dict(eos_token_id="x"), "field 'eos_token_id': expected a token id"),
])
def test_bad_values_name_the_field(change, message):
    with pytest.raises(ConfigError) as err:
        parse_qwen3(tiny_qwen3_config(**change), "some/config.json")
    assert str(err.value).startswith("some/config.json") and message in str(err.value)


def test_unreadable_config_file(tmp_path):
    with pytest.raises(ConfigError, match="config.json: not found"):
        load_target_config(tmp_path)
    (tmp_path / "config.json").write_text("{oops")
    with pytest.raises(ConfigError, match="config.json: not valid JSON"):
        load_target_config(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(tiny_qwen3_config()))
    assert load_target_config(tmp_path).num_layers == 2
