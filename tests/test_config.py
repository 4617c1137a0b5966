"""Parsing HF config.json into Qwen3Config, and the errors for values we cannot run."""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest

from ddtree_jax.config import ConfigError, RopeConfig, load_target_config, parse_dflash, parse_qwen3, parse_qwen3_5
from ddtree_jax.random_checkpoint import tiny_dflash_config, tiny_qwen3_5_config, tiny_qwen3_config
from conftest import LLAMA3_ROPE_SCALING as LLAMA3, YARN_ROPE_SCALING as YARN, requires_torch


def test_qwen3_8b_shapes():
    raw = tiny_qwen3_config(hidden_size=4096, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                            head_dim=128, intermediate_size=12288, vocab_size=151936, rope_theta=1e6,
                            eos_token_id=151645, tie_word_embeddings=False)
    c = parse_qwen3(raw)
    assert (c.num_heads // c.num_kv_heads, c.head_dim, c.rope.theta, c.eos_token_ids) == (4, 128, 1e6, (151645,))
    assert c.sliding_windows == (None,) * 36
    assert 8.1e9 < c.num_params() < 8.3e9  # Qwen3-8B has 8.19e9 parameters


def test_rope_parameters_and_legacy_fields_agree():
    new = parse_qwen3(tiny_qwen3_config(rope_parameters={"rope_type": "default", "rope_theta": 1234.0}))
    old = parse_qwen3(tiny_qwen3_config(rope_theta=1234.0))
    assert new.rope == old.rope
    linear = parse_qwen3(tiny_qwen3_config(rope_scaling={"type": "linear", "factor": 4.0}))
    base = parse_qwen3(tiny_qwen3_config()).rope  # same theta, no scaling
    np.testing.assert_allclose(linear.rope.inv_freq(16), base.inv_freq(16) / 4)


PARSERS = {"qwen3": (parse_qwen3, tiny_qwen3_config), "qwen3_5": (parse_qwen3_5, tiny_qwen3_5_config),
           "dflash": (parse_dflash, lambda **kw: tiny_dflash_config(tiny_qwen3_config(), **kw))}


@pytest.mark.parametrize("params", [YARN, LLAMA3], ids=["yarn", "llama3"])
def test_rope_spellings_parse_alike(params):
    """transformers 5's `rope_parameters` (theta inside, or at the top level) and the older `rope_scaling`
    with `rope_type` or `type` give one RopeConfig, for targets, hybrids and drafters alike; a theta inside
    the rope object wins over the top level's."""
    legacy = {("type" if k == "rope_type" else k): v for k, v in params.items()}
    spellings = [dict(rope_parameters=dict(params, rope_theta=500.0), rope_theta=7.0),
                 dict(rope_parameters=dict(params), rope_theta=500.0),
                 dict(rope_parameters=None, rope_scaling=dict(params), rope_theta=500.0),
                 dict(rope_parameters=None, rope_scaling=legacy, rope_theta=500.0)]
    ropes = {parse(tiny(**s)).rope for parse, tiny in PARSERS.values() for s in spellings}
    assert len(ropes) == 1
    rope = ropes.pop()
    assert (rope.rope_type, rope.theta, rope.factor, rope.original_max_position_embeddings) == (
        params["rope_type"], 500.0, params["factor"], 64)


# Configs whose frequencies transformers' own `ROPE_INIT_FUNCTIONS` computes: (parser, config changes).
ROPE_CASES = {
    # Qwen3's model cards: factor 4 on 32768 while max_position_embeddings is 40960 (transformers warns and
    # uses the explicit factor).
    "yarn_qwen3_card": ("qwen3", dict(rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                                    "original_max_position_embeddings": 32768},
                                      max_position_embeddings=40960, rope_theta=1e6, head_dim=128)),
    "yarn_untruncated_betas": ("qwen3", dict(rope_parameters={
        "rope_type": "yarn", "rope_theta": 1e4, "factor": 8.0, "original_max_position_embeddings": 64,
        "truncate": False, "beta_fast": 16, "beta_slow": 2})),
    # No original_max_position_embeddings: transformers takes max_position_embeddings.
    "yarn_mscale": ("qwen3", dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 8.0,
                                                   "mscale": 0.7, "mscale_all_dim": 1.0})),
    "yarn_attention_factor": ("qwen3", dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 8.0,
                                                             "attention_factor": 0.9,
                                                             "original_max_position_embeddings": 100})),
    "yarn_partial_rotary": ("qwen3_5", dict(rope_parameters=dict(YARN, rope_theta=1e4, partial_rotary_factor=0.5))),
    "yarn_drafter_legacy": ("dflash", dict(rope_scaling={"type": "yarn", "factor": 4.0,
                                                         "original_max_position_embeddings": 64}, rope_theta=100.0)),
    "llama3_3_1": ("qwen3", dict(rope_scaling=dict(LLAMA3, original_max_position_embeddings=8192),
                                 rope_theta=500000.0, head_dim=128)),
    "llama3_partial_rotary": ("qwen3_5", dict(rope_parameters=dict(LLAMA3, rope_theta=1e4, partial_rotary_factor=0.5))),
    "linear": ("qwen3", dict(rope_parameters={"rope_type": "linear", "rope_theta": 5000.0, "factor": 2.0})),
}


@requires_torch
@pytest.mark.parametrize("case", sorted(ROPE_CASES))
def test_rope_frequencies_and_attention_factor_match_transformers(case):
    """Our inverse frequencies equal transformers' to float32 rounding (`pow` may round one ulp apart), and
    the factor on cos/sin exactly; each YaRN and llama3 case keeps some frequencies, divides some by
    `factor` and blends some, so every branch of the formulas is compared."""
    from transformers import Qwen3_5TextConfig, Qwen3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    family, changes = ROPE_CASES[case]
    parse, tiny = PARSERS[family]
    raw = tiny(**copy.deepcopy(changes))  # transformers fills rope dicts in place
    ours = parse(raw)
    dim = getattr(ours, "rotary_dim", ours.head_dim)
    hf_fields = {k: v for k, v in raw.items() if k not in ("architectures", "torch_dtype", "model_type")}
    hf_config = (Qwen3_5TextConfig if family == "qwen3_5" else Qwen3Config)(**hf_fields)
    want_inv, want_factor = ROPE_INIT_FUNCTIONS[ours.rope.rope_type](hf_config)
    inv = ours.rope.inv_freq(dim)
    assert inv.dtype == np.float32 and inv.shape == (dim // 2,)
    np.testing.assert_allclose(inv, want_inv.numpy(), rtol=3e-7, atol=0)
    assert ours.rope.attention_factor == want_factor
    if ours.rope.rope_type in ("yarn", "llama3"):
        share = inv / RopeConfig(theta=ours.rope.theta).inv_freq(dim)  # 1: kept, 1 / factor: scaled
        kept, scaled = np.isclose(share, 1), np.isclose(share, 1 / ours.rope.factor)
        assert kept.any() and scaled.any() and (~kept & ~scaled).any(), share


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
    (dict(rope_parameters={"rope_type": "dynamic", "rope_theta": 1e4, "factor": 4}),
     "field 'rope_parameters': rope_type 'dynamic' is not supported (supported: default, linear, yarn, llama3)"),
    (dict(rope_scaling={"type": "longrope", "factor": 4}),
     "field 'rope_scaling': rope_type 'longrope' is not supported"),
    (dict(rope_scaling={"rope_type": "linear"}), "rope_scaling: field 'factor': missing"),
    (dict(rope_scaling={"rope_type": "yarn", "original_max_position_embeddings": 64}), "field 'factor': missing"),
    (dict(rope_scaling=dict(YARN, truncate="yes")), "field 'truncate': expected true or false, found 'yes'"),
    (dict(rope_scaling=dict(YARN, beta_fast="x")), "field 'beta_fast': expected a finite number, found 'x'"),
    (dict(rope_scaling=dict(YARN, partial_rotary_factor=0.5)),
     "rope_scaling: field 'partial_rotary_factor': expected 1 (this model rotates whole heads), found 0.5"),
    (dict(rope_scaling={k: v for k, v in LLAMA3.items() if k != "low_freq_factor"}),
     "field 'low_freq_factor': missing"),
    (dict(rope_scaling=dict(LLAMA3, high_freq_factor=1.0)),
     "field 'high_freq_factor': expected more than low_freq_factor=1.0, found 1.0"),
    (dict(layer_types=["full_attention"]), "field 'layer_types': expected a list of 2 entries"),
    (dict(eos_token_id="x"), "field 'eos_token_id': expected a token id"),
])
def test_bad_values_name_the_field(change, message):
    with pytest.raises(ConfigError) as err:
        parse_qwen3(tiny_qwen3_config(**change), "some/config.json")
    assert str(err.value).startswith("some/config.json") and message in str(err.value)


@pytest.mark.parametrize("family", sorted(PARSERS))
def test_rope_types_that_change_with_length_are_refused(family):
    parse, tiny = PARSERS[family]
    for rope_type in ("dynamic", "longrope", "proportional"):
        with pytest.raises(ConfigError, match=f"^cfg.json: field 'rope_scaling': rope_type '{rope_type}' is not "
                                              "supported"):
            parse(tiny(rope_scaling={"rope_type": rope_type, "factor": 2.0}), "cfg.json")


def test_unreadable_config_file(tmp_path):
    with pytest.raises(ConfigError, match="config.json: not found"):
        load_target_config(tmp_path)
    (tmp_path / "config.json").write_text("{oops")
    with pytest.raises(ConfigError, match="config.json: not valid JSON"):
        load_target_config(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(tiny_qwen3_config()))
    assert load_target_config(tmp_path).num_layers == 2
