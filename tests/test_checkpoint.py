"""Strict checkpoint loading: each bad input ends in one clear error naming the file and the tensor."""

from __future__ import annotations

import json
import os
from pathlib import Path

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from ddtree_jax.checkpoint import CheckpointError, load_target, save_hf
from ddtree_jax.config import ConfigError
from ddtree_jax.random_checkpoint import random_qwen3_arrays, tiny_qwen3_config, write_random_qwen3


@pytest.fixture
def target(tmp_path) -> Path:
    return write_random_qwen3(tmp_path / "t", seed=3, with_tokenizer=False)


def _rewrite(folder: Path, edit) -> None:
    file = folder / "model.safetensors"
    tensors = load_file(str(file))
    edit(tensors)
    save_file(tensors, str(file))


def _edit_config(folder: Path, **changes) -> None:
    raw = json.loads((folder / "config.json").read_text())
    raw.update(changes)
    (folder / "config.json").write_text(json.dumps(raw))


def test_loads_in_the_requested_dtype(target):
    assert load_target(target, jnp.bfloat16).flat()["model.norm.weight"].dtype == jnp.bfloat16
    assert load_target(target, jnp.float32).flat()["model.norm.weight"].dtype == jnp.float32
    stored = load_file(str(target / "model.safetensors"))
    loaded = load_target(target, None).flat()
    assert set(loaded) == set(stored)
    for name, value in stored.items():
        np.testing.assert_array_equal(np.asarray(loaded[name]), value)


def test_missing_tensor(target):
    _rewrite(target, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(CheckpointError, match=r"model\.safetensors: tensor 'model\.layers\.1\.mlp\.up_proj\.weight' is missing"):
        load_target(target)


def test_unexpected_tensor(target):
    _rewrite(target, lambda t: t.update({"model.layers.9.extra.weight": np.zeros(3, np.float32)}))
    with pytest.raises(CheckpointError, match=r"model\.safetensors: unexpected tensor 'model\.layers\.9\.extra\.weight'"):
        load_target(target)


def test_shape_mismatch(target):
    _rewrite(target, lambda t: t.update({"model.norm.weight": np.ones(63, np.float32)}))
    with pytest.raises(CheckpointError, match=r"model\.safetensors: tensor 'model\.norm\.weight' has shape \(63,\), expected \(64,\)"):
        load_target(target)


def test_dtype_mismatch(target):
    _rewrite(target, lambda t: t.update({"model.norm.weight": np.ones(64, np.int32)}))
    with pytest.raises(CheckpointError, match=r"tensor 'model\.norm\.weight' has dtype I32, expected a floating-point dtype"):
        load_target(target)


def test_wrong_model_type(target):
    _edit_config(target, model_type="llama")
    with pytest.raises(ConfigError, match=r"config\.json: field 'model_type': 'llama' is not a supported target"):
        load_target(target)


def test_unsupported_rope_scaling(target):
    _edit_config(target, rope_scaling={"rope_type": "dynamic", "factor": 4.0})
    with pytest.raises(ConfigError, match=r"field 'rope_scaling': rope_type 'dynamic' is not supported"):
        load_target(target)


def test_truncated_file(target):
    file = target / "model.safetensors"
    os.truncate(file, file.stat().st_size - 1000)
    with pytest.raises(CheckpointError, match=r"model\.safetensors: truncated: tensor '[^']+' ends at data byte"):
        load_target(target)


def test_corrupt_header(target):
    (target / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all}")
    with pytest.raises(CheckpointError, match=r"model\.safetensors: not a readable safetensors file"):
        load_target(target)


def test_no_weights(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(tiny_qwen3_config()))
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        load_target(tmp_path)


def test_sharded_checkpoint_loads_and_index_is_checked(tmp_path):
    config = tiny_qwen3_config()
    arrays = random_qwen3_arrays(config, seed=5, dtype=ml_dtypes.bfloat16)
    folder = save_hf(arrays, config, tmp_path / "sharded", max_shard_bytes=20_000)
    shards = sorted(folder.glob("model-*-of-*.safetensors"))
    assert len(shards) > 2 and not (folder / "model.safetensors").exists()
    loaded = load_target(folder, None).flat()
    for name, value in arrays.items():
        assert loaded[name].dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(loaded[name]), value)

    index = json.loads((folder / "model.safetensors.index.json").read_text())
    name = "model.norm.weight"
    index["weight_map"][name] = shards[0].name if index["weight_map"][name] != shards[0].name else shards[1].name
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"tensor 'model\.norm\.weight' is listed in model\.safetensors\.index\.json but not in this file"):
        load_target(folder)


def test_tied_checkpoint_with_a_different_lm_head_is_refused(tmp_path):
    config = tiny_qwen3_config(tie_word_embeddings=True)
    arrays = random_qwen3_arrays(config, seed=6)
    same = save_hf({**arrays, "lm_head.weight": arrays["model.embed_tokens.weight"]}, config, tmp_path / "same")
    assert "lm_head.weight" not in load_target(same).flat()
    other = save_hf({**arrays, "lm_head.weight": arrays["model.embed_tokens.weight"] + 1}, config, tmp_path / "other")
    with pytest.raises(CheckpointError, match="'lm_head.weight' differs from 'model.embed_tokens.weight'"):
        load_target(other)


def test_cli_reports_one_error_line_and_exit_code_2(target, capsys):
    """In this process (`main`, as `python -m ddtree_jax.generate` calls it: an uncaught exception would fail the
    test as a traceback would; a fresh interpreter's output: tests/test_generate_cli.py's process tests)."""
    from ddtree_jax.generate import main

    _rewrite(target, lambda t: t.pop("model.norm.weight"))
    assert main(["--mode", "ar", "--target", str(target), "--prompt-ids", "1,2", "--json"]) == 2
    captured = capsys.readouterr()
    lines = [line for line in captured.err.splitlines() if line.strip()]
    assert lines == [f"error: {target / 'model.safetensors'}: tensor 'model.norm.weight' is missing (expected shape (64,))"]
    assert captured.out == ""


def test_saving_never_leaves_a_half_written_folder(tmp_path):
    config = tiny_qwen3_config()
    arrays = random_qwen3_arrays(config)
    out = save_hf(arrays, config, tmp_path / "out")
    with pytest.raises(CheckpointError, match="already exists"):
        save_hf(arrays, config, out)
    bad = dict(arrays, **{"model.norm.weight": object()})
    with pytest.raises(Exception):
        save_hf(bad, config, out, force=True)
    # The failed write left the old folder intact and no temporary folders behind.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    np.testing.assert_array_equal(load_target(out, None).flat()["model.norm.weight"], arrays["model.norm.weight"])
