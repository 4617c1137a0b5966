"""The doctor passes a right pair and flags one whose mask token or tap layers were changed."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from ddtree_jax.doctor import diagnose, main, position_acceptance
from pairs import MASK, TAP_IDS, write_signal_pair


def test_position_acceptance_literal():
    assert position_acceptance([[1, 3], [2]], 4) == [2 / 3, 1 / 3, 0.0]


def test_flag_threshold():
    assert diagnose([[1] * 9 + [2]], 4, True, None).flagged  # 10% of rounds accept the first draft
    assert not diagnose([[1] * 3 + [2]], 4, True, None).flagged  # 25%


def test_right_pair_passes(tmp_path, capsys):
    target, drafter = write_signal_pair(tmp_path)
    assert main(["--target", str(target), "--drafter", str(drafter), "--dtype", "float32"]) == 0
    out = capsys.readouterr().out
    assert "OK: acceptance looks healthy" in out and "greedy DFlash == AR: yes" in out
    assert "tau (tokens per round, bonus included): 4.00" in out


@pytest.mark.parametrize("dflash_config,why", [
    ({"mask_token_id": 3, "target_layer_ids": TAP_IDS}, "wrong mask token"),
    ({"mask_token_id": MASK, "target_layer_ids": [t - 1 for t in TAP_IDS]}, "layer ids off by one"),
    ({"mask_token_id": MASK, "target_layer_ids": [t + 1 for t in TAP_IDS]}, "layer ids one too deep"),
])
def test_broken_pairs_are_flagged(tmp_path, dflash_config, why):
    target, drafter = write_signal_pair(tmp_path, dflash_config=dflash_config)
    proc = subprocess.run([sys.executable, "-m", "ddtree_jax.doctor", "--target", str(target), "--drafter",
                           str(drafter), "--dtype", "float32", "--json"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, (why, proc.stderr)
    report = json.loads(proc.stdout)
    assert report["flagged"] and report["position_acceptance"][0] < 0.2
    assert any("mask_token_id" in c for c in report["causes"]) and any("off by one" in c for c in report["causes"])
    assert report["lossless"]  # a bad drafter is slow, never wrong


def test_config_errors_exit_2(tmp_path, capsys):
    target, drafter = write_signal_pair(tmp_path, dflash_config={"mask_token_id": 99, "target_layer_ids": TAP_IDS})
    assert main(["--target", str(target), "--drafter", str(drafter)]) == 2
    assert "mask_token_id': 99 is not a row" in capsys.readouterr().err


def test_default_checks_the_shipped_demo_pair(capsys):
    code = main(["--num-prompts", "2", "--max-new-tokens", "24", "--dtype", "float32", "--json"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert "checks the demo pair" in captured.err
    report = json.loads(captured.out)
    assert report["lossless"] and report["position_acceptance"][0] > 0.3  # a trained drafter
