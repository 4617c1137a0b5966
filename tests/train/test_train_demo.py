"""`python -m ddtree_jax.train.demo --scale tiny`: the whole pipeline on the CPU, as a script runs it."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo") / "run"
    proc = subprocess.run([sys.executable, "-m", "ddtree_jax.train.demo", "--out", str(out), "--scale", "tiny"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out, json.loads(proc.stdout), proc.stderr


def test_demo_writes_everything(demo):
    out, report, stderr = demo
    for name in ("tokenizer/tokenizer.json", "target/config.json", "target/tokenizer.json",
                 "target/generation_config.json", "drafter/config.json", "drafter/model.safetensors",
                 "prompts.jsonl", "target_loss.png", "drafter_loss.png", "summary.json",
                 "work/target/log.json", "work/drafter/log.json", "work/drafter/sequences.npz"):
        assert (out / name).exists(), name
    summary = json.loads((out / "summary.json").read_text())
    assert summary["safetensors_bytes"]["total"] == report["safetensors_bytes"]["total"] < 40 * 10**6
    assert report["decode_check"]["dflash"]["equals_ar"] and report["decode_check"]["ddtree"]["equals_ar"]
    prompts = [json.loads(line) for line in (out / "prompts.jsonl").read_text().splitlines()]
    assert prompts and all(set(p) == {"prompt"} for p in prompts)
    assert "step" in stderr  # progress is printed


def test_demo_pair_passes_the_doctor_checks(demo):
    out, _, _ = demo
    proc = subprocess.run([sys.executable, "-m", "ddtree_jax.doctor", "--target", str(out / "target"), "--drafter",
                           str(out / "drafter"), "--prompts", str(out / "prompts.jsonl"), "--dtype", "float32",
                           "--json"], capture_output=True, text=True, timeout=300)
    assert proc.returncode in (0, 1), proc.stderr  # the tiny run learns little: acceptance may be flagged
    assert json.loads(proc.stdout)["lossless"] is True
