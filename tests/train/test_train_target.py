"""Target pretraining on a tiny config: the loss falls, checkpoints resume, the HF export loads and generates."""

from __future__ import annotations

import json
import math
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from ddtree_jax.train import common
from ddtree_jax.train.target import TargetShape, TargetTrainConfig, round_vocab, train_target, windows

VOCAB = 320
SHAPE = TargetShape(hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=16, intermediate_size=64)
MAX_SHARD = 24_000  # above the largest tensor (the 20 KB embedding), below the total


def _config(tmp: Path, steps: int) -> TargetTrainConfig:
    return TargetTrainConfig(out=tmp / "target", tokenizer=tmp / "tok", shape=SHAPE, steps=steps, batch=8, seq_len=32,
                             lr=1e-2, warmup=5, eval_every=20, save_every=20, log_every=5, eval_batches=2,
                             dtype="float32", max_files=8, max_shard_bytes=MAX_SHARD, sample_prompt=None)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    from ddtree_jax.train import corpus
    from ddtree_jax.train.tokenizer import train_tokenizer

    tmp = tmp_path_factory.mktemp("target_train")
    train, _ = corpus.split_files(corpus.list_files())
    train_tokenizer(corpus.iter_texts(train[:8]), tmp / "tok", vocab_size=VOCAB)
    summary = train_target(_config(tmp, 40))
    return tmp, summary


def _log(tmp: Path) -> dict:
    return json.loads((tmp / "target.train" / "log.json").read_text())


def test_loss_falls(trained):
    tmp, summary = trained
    losses = [h["loss"] for h in _log(tmp)["history"]]
    assert len(losses) == 40 and all(math.isfinite(x) for x in losses)
    assert losses[0] > math.log(VOCAB) - 0.3  # starts near uniform
    assert np.mean(losses[-5:]) < losses[0] - 1.0
    assert summary["held_out_loss"] < math.log(VOCAB) - 0.5
    assert (tmp / "target.train" / "loss.png").stat().st_size > 1000


def test_export_is_a_sharded_hf_checkpoint_that_loads(trained):
    from ddtree_jax.checkpoint import load_target
    from ddtree_jax.config import generation_eos_ids, load_target_config

    tmp, summary = trained
    out = tmp / "target"
    shards = sorted(out.glob("*.safetensors"))
    assert len(shards) > 1 and (out / "model.safetensors.index.json").exists()
    assert all(f.stat().st_size <= MAX_SHARD + 4096 for f in shards)
    config = load_target_config(out)
    assert config.vocab_size == round_vocab(VOCAB) == 320 and config.tie_word_embeddings
    assert config.eos_token_ids == (0,) and generation_eos_ids(out) == (0,)
    raw = json.loads((out / "config.json").read_text())
    assert raw["torch_dtype"] == "bfloat16" and raw["architectures"] == ["Qwen3ForCausalLM"]
    params = load_target(out, None)
    flat = params.flat()
    assert all(a.dtype == jnp.bfloat16 for a in flat.values())
    assert set(flat) == {n for n in json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]}
    assert summary["params"] == params.config.num_params()
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (out / name).exists()


def test_generate_cli_runs_the_export(trained, capsys):
    """`generate` (its `main`, in this process) on the exported checkpoint and its tokenizer."""
    from ddtree_jax.generate import main

    tmp, _ = trained
    code = main(["--mode", "ar", "--target", str(tmp / "target"), "--prompt", "def f(x):", "--json",
                 "--max-new-tokens", "8", "--ignore-eos", "--dtype", "float32"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    report = json.loads(captured.out)
    assert report["new_tokens"] == 8 and isinstance(report["text"], str)


def test_resume_continues_from_the_last_checkpoint(trained):
    tmp, _ = trained
    assert sorted(int(p.name) for p in (tmp / "target.train" / "checkpoints").iterdir() if p.name.isdigit()) == [20, 40]
    before = _log(tmp)["history"]
    summary = train_target(_config(tmp, 48))
    history = _log(tmp)["history"]
    assert summary["steps"] == 48
    assert [h["step"] for h in history] == list(range(1, 49))
    assert history[:40] == before  # resumed, not retrained
    assert json.loads((tmp / "target.train" / "run.json").read_text())["total_steps"] == 48


def test_windows_and_schedule():
    stream = np.arange(100, dtype=np.int32)
    w = windows(stream, 4, 10, np.random.default_rng(0))
    assert w.shape == (4, 10) and all((np.diff(row) == 1).all() for row in w)
    s = common.Schedule(peak=1.0, warmup=4, total=14, min_ratio=0.1)
    assert [s(i) for i in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert s(4) == pytest.approx(1.0) and s(9) == pytest.approx(0.55) and s(14) == pytest.approx(0.1)
    assert s(100) == pytest.approx(0.1)
