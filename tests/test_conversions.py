"""HF <-> orbax conversion: bit-exact round trip, verification, refusal to overwrite."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file

from conversions.convert import main as convert_main
from ddtree_jax.checkpoint import checkpoint_format, load_target, save_hf
from ddtree_jax.random_checkpoint import random_qwen3_arrays, tiny_qwen3_config


def _read_hf(folder):
    out = {}
    for file in sorted(folder.glob("*.safetensors")):
        out.update(load_file(str(file)))
    return out


def test_round_trip_is_bit_exact(tmp_path, capsys):
    config = tiny_qwen3_config(tie_word_embeddings=True)
    arrays = random_qwen3_arrays(config, seed=7, dtype=ml_dtypes.bfloat16)
    arrays["model.norm.weight"] = arrays["model.norm.weight"].astype(np.float32)  # mixed dtypes survive too
    src = save_hf(arrays, config, tmp_path / "hf")
    (src / "generation_config.json").write_text('{"eos_token_id": 5}')

    assert convert_main(["hf-to-orbax", str(src), str(tmp_path / "orbax"), "--verify"]) == 0
    assert "max |logit difference| = 0 (ok)" in capsys.readouterr().out
    assert checkpoint_format(tmp_path / "orbax") == "orbax"
    assert convert_main(["orbax-to-hf", str(tmp_path / "orbax"), str(tmp_path / "back"), "--max-shard-mb", "0"]) == 0

    back = _read_hf(tmp_path / "back")
    assert len(list((tmp_path / "back").glob("model-*-of-*.safetensors"))) == len(arrays)
    assert set(back) == set(arrays)
    for name, value in arrays.items():
        assert back[name].dtype == value.dtype, name
        assert back[name].tobytes() == value.tobytes(), name
    assert (tmp_path / "back" / "generation_config.json").read_text() == '{"eos_token_id": 5}'
    orbax_params = load_target(tmp_path / "orbax", None).flat()
    for name, value in arrays.items():
        assert np.asarray(orbax_params[name]).tobytes() == value.tobytes(), name


def test_refuses_to_overwrite_without_force(tmp_path, capsys):
    config = tiny_qwen3_config()
    src = save_hf(random_qwen3_arrays(config), config, tmp_path / "hf")
    (tmp_path / "orbax").mkdir()
    (tmp_path / "orbax" / "keep.txt").write_text("mine")
    assert convert_main(["hf-to-orbax", str(src), str(tmp_path / "orbax")]) == 2
    assert "already exists (pass --force to overwrite)" in capsys.readouterr().err
    assert (tmp_path / "orbax" / "keep.txt").read_text() == "mine"
    assert convert_main(["hf-to-orbax", str(src), str(tmp_path / "orbax"), "--force"]) == 0
    assert not (tmp_path / "orbax" / "keep.txt").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "orbax"]


def test_wrong_direction_is_a_clear_error(tmp_path):
    """`python -m conversions.convert` itself (a fresh interpreter: its exit status, and a stderr of one line with
    nothing printed at import); the refusals below call its `main` in this process."""
    config = tiny_qwen3_config()
    src = save_hf(random_qwen3_arrays(config), config, tmp_path / "hf")
    proc = subprocess.run([sys.executable, "-m", "conversions.convert", "orbax-to-hf", str(src), str(tmp_path / "x")],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    assert proc.stderr.strip() == (f"error: {src}: is a Hugging Face (safetensors) checkpoint, but orbax-to-hf "
                                   "reads an orbax one")


@pytest.mark.parametrize("where", ["under_a_file", "unwritable"])
def test_unwritable_destination_is_refused_before_reading(tmp_path, capsys, where):
    config = tiny_qwen3_config()
    src = save_hf(random_qwen3_arrays(config), config, tmp_path / "hf")
    (tmp_path / "file").write_text("x")
    # Root ignores permission bits, so the unwritable place is one no one can create files in.
    dst, message = {"under_a_file": (tmp_path / "file" / "out", f"{tmp_path / 'file'} is a file, not a folder"),
                    "unwritable": (Path("/proc/ddtree_jax_out"), "cannot write in /proc")}[where]
    assert convert_main(["hf-to-orbax", str(src), str(dst)]) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: DST {dst}: {message}"), captured.err
    assert captured.out == ""


def test_drafter_round_trip_and_verify(tmp_path, capsys):
    from ddtree_jax.random_checkpoint import write_random_dflash, write_random_qwen3

    target = write_random_qwen3(tmp_path / "t", with_tokenizer=False)
    drafter = write_random_dflash(tmp_path / "d", tiny_qwen3_config(), dtype=ml_dtypes.bfloat16)
    assert convert_main(["hf-to-orbax", str(drafter), str(tmp_path / "o"), "--verify"]) == 2
    assert "is a DFlash drafter; --verify needs --target DIR" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()  # refused before converting
    assert convert_main(["hf-to-orbax", str(drafter), str(tmp_path / "o"), "--verify", "--target", str(target)]) == 0
    assert "max |logit difference| = 0 (ok)" in capsys.readouterr().out
    assert convert_main(["orbax-to-hf", str(tmp_path / "o"), str(tmp_path / "back")]) == 0
    before, after = _read_hf(drafter), _read_hf(tmp_path / "back")
    assert set(before) == set(after)
    assert all(before[k].tobytes() == after[k].tobytes() and before[k].dtype == after[k].dtype for k in before)
