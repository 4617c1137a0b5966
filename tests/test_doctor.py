"""The doctor: a right pair passes; a miswired one is flagged with the field and value that fix it; a weak
one is called weak."""

from __future__ import annotations

import json
import shutil

import pytest

from ddtree_jax.demo_pair import demo_drafter
from ddtree_jax.doctor import Trial, diagnose, main, mask_like_tokens, position_acceptance
from pairs import MASK, TAP_IDS, write_signal_pair


def test_position_acceptance_literal():
    assert position_acceptance([[1, 3], [2]], 4) == [2 / 3, 1 / 3, 0.0]


def test_verdicts():
    assert diagnose([[1] * 9 + [2]], 4, True, None).verdict == "weak"  # 10% of rounds accept the first draft
    assert diagnose([[1] * 3 + [2]], 4, True, None).verdict == "ok"  # 25%
    given = [[1, 2, 3, 2]]  # first position 75%, tau 2.0
    close = Trial("f", 1, "", tau=2.2, first_position=0.8)  # +5 points, +10%: not clearly better
    assert diagnose(given, 4, True, None, [close]).verdict == "ok"
    for better in (Trial("f", 2, "", tau=2.3, first_position=0.5), Trial("f", 3, "", tau=1.0, first_position=0.85)):
        report = diagnose(given, 4, True, None, [close, better])
        assert report.verdict == "miswired" and report.fix == better and report.flagged


def test_right_pair_passes(tmp_path, capsys):
    target, drafter = write_signal_pair(tmp_path)
    assert main(["--target", str(target), "--drafter", str(drafter), "--dtype", "float32", "--plot",
                 str(tmp_path)]) == 2  # a folder where the PNG goes: refused before any work
    assert capsys.readouterr().err.startswith(f"error: --plot {tmp_path}: is a folder")
    plot = tmp_path / "acceptance.png"
    assert main(["--target", str(target), "--drafter", str(drafter), "--dtype", "float32", "--plot", str(plot)]) == 0
    out = capsys.readouterr().out
    assert "OK: acceptance looks healthy" in out and "greedy DFlash == AR: yes" in out
    assert "tau (tokens per round, bonus included): 4.00" in out
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and sorted(p.name for p in tmp_path.glob("*.png")) == [
        "acceptance.png"]  # no temporary file left


def test_shifted_tap_layers_are_flagged_with_the_fix(tmp_path, capsys):
    """Taps one layer too shallow: fixed by the +1 shift (the demo pair's test below needs the -1 shift). In this
    process (`python -m ddtree_jax.doctor` itself, its exit status included, runs in tests/train/test_train_demo.py)."""
    target, drafter = write_signal_pair(tmp_path, dflash_config={"mask_token_id": MASK,
                                                                 "target_layer_ids": [t - 1 for t in TAP_IDS]})
    code = main(["--target", str(target), "--drafter", str(drafter), "--dtype", "float32", "--json"])
    captured = capsys.readouterr()
    assert code == 1, captured.err
    report = json.loads(captured.out)
    assert report["verdict"] == "miswired" and report["flagged"]
    assert (report["fix"]["field"], report["fix"]["value"]) == ("dflash_config.target_layer_ids", TAP_IDS)
    assert report["lossless"]  # a miswired drafter is slow, never wrong


def test_wrong_mask_without_a_tokenizer_is_weak(tmp_path, capsys):
    """No tokenizer names a mask token here, so no alternative fixes it: weak, with the causes left to check."""
    target, drafter = write_signal_pair(tmp_path, dflash_config={"mask_token_id": 3, "target_layer_ids": TAP_IDS})
    assert main(["--target", str(target), "--drafter", str(drafter), "--dtype", "float32"]) == 1
    out = capsys.readouterr().out
    assert "WEAK: the first draft position is accepted in 0.0% of rounds" in out
    assert "dflash_config.mask_token_id" in out and "MISWIRED" not in out


def test_config_errors_exit_2(tmp_path, capsys):
    target, drafter = write_signal_pair(tmp_path, dflash_config={"mask_token_id": 99, "target_layer_ids": TAP_IDS})
    assert main(["--target", str(target), "--drafter", str(drafter)]) == 2
    assert "mask_token_id': 99 is not a row" in capsys.readouterr().err


def test_mask_like_tokens():
    from transformers import AutoTokenizer

    from ddtree_jax.demo_pair import demo_target

    tok = AutoTokenizer.from_pretrained(str(demo_target()))
    assert mask_like_tokens(tok, 8192) == {1: "'<|mask|>'"}  # not <|endoftext|> (id 0)
    # A vocabulary larger than the tokenizer's: its first extra row, where an added <|MASK|> lands (Qwen3's 151669).
    assert mask_like_tokens(tok, 8200)[8192] == "the first embedding row past the tokenizer's vocabulary"
    assert mask_like_tokens(None, 8192) == {}


# The shipped demo pair, as the issue found it: right, and with the two miswirings that used to pass.
# In one process, so the wirings the three runs share compile once.
def _demo_with(tmp_path, **dflash_config):
    folder = tmp_path / "drafter"
    shutil.copytree(demo_drafter(), folder)
    config = json.loads((folder / "config.json").read_text())
    config["dflash_config"].update(dflash_config)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_default_checks_the_shipped_demo_pair(capsys):
    code = main(["--dtype", "float32", "--json"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert "checks the demo pair" in captured.err
    report = json.loads(captured.out)
    assert report["verdict"] == "ok" and report["lossless"] and report["position_acceptance"][0] > 0.3
    assert [t["value"] for t in report["trials"][1:]] == [[0, 1, 2], [2, 3, 4]]  # the tap shifts were tried


@pytest.mark.parametrize("change,fix", [
    ({"mask_token_id": 5}, ("dflash_config.mask_token_id", 1)),
    ({"target_layer_ids": [2, 3, 4]}, ("dflash_config.target_layer_ids", [1, 2, 3])),
])
def test_miswired_demo_pair_is_flagged_with_the_fix(tmp_path, capsys, change, fix):
    from ddtree_jax.demo_pair import demo_prompts, demo_target

    drafter = _demo_with(tmp_path, **change)
    code = main(["--dtype", "float32", "--target", str(demo_target()), "--drafter", str(drafter), "--prompts",
                 str(demo_prompts())])
    out = capsys.readouterr().out
    assert code == 1, out
    assert "MISWIRED: with " in out and "OK:" not in out and "WEAK" not in out
    assert out.strip().endswith(f"Fix: set {fix[0]} to {json.dumps(fix[1])} in {drafter / 'config.json'}.")


def test_causal_and_window_alternatives_where_the_config_leaves_them_open():
    """Qwen3.6-27B-DFlash's layout (sliding layers, no is_causal): the first reference's non-causal reading
    and the unwindowed one are tried; with use_sliding_window off, the windowed one. None for full layers."""
    from ddtree_jax.config import parse_dflash, parse_qwen3
    from ddtree_jax.doctor import alternative_wirings
    from ddtree_jax.random_checkpoint import tiny_dflash_config, tiny_qwen3_config

    target_raw = tiny_qwen3_config(num_hidden_layers=4)
    target = parse_qwen3(target_raw)

    def tried(**overrides):
        raw = tiny_dflash_config(target_raw, **overrides)
        return {(field, json.dumps(value)): config for field, value, _, config in
                alternative_wirings(parse_dflash(raw), raw, target, None) if field != "dflash_config.target_layer_ids"}

    sliding = dict(layer_types=["sliding_attention", "full_attention"], sliding_window=8)
    given = parse_dflash(tiny_dflash_config(target_raw, use_sliding_window=True, **sliding))
    assert given.layer_causal == (True, False) and given.layer_windows == (8, None)
    found = tried(use_sliding_window=True, **sliding)
    assert set(found) == {("is_causal", "false"), ("use_sliding_window", "false")}
    assert found["is_causal", "false"].layer_causal == (False, False)
    assert found["use_sliding_window", "false"].layer_windows == (None, None)
    found = tried(use_sliding_window=False, **sliding)
    assert set(found) == {("is_causal", "false"), ("use_sliding_window", "true")}
    assert found["use_sliding_window", "true"].layer_windows == (8, None)
    assert set(tried(use_sliding_window=True, is_causal=True, **sliding)) == {("use_sliding_window", "false")}
    assert tried() == {}  # all full attention: nothing is open


def test_mtp_mode_reports_the_heads_acceptance(tmp_path, capsys):
    """`--mode mtp`: greedy MTP rounds of the target's own (here random) head against AR: lossless, one rate
    per draft step, WEAK with the head's own causes (no wirings to try); a target without a head, or a
    --drafter beside the demo target's head, is one error line before any weight is read."""
    from ddtree_jax.random_checkpoint import write_random_qwen3_5

    folder = write_random_qwen3_5(tmp_path / "t", seed=2, published=True, mtp_layers=1, hidden_size=32,
                                  intermediate_size=48, head_dim=16, linear_key_head_dim=8, linear_value_head_dim=8)
    assert main(["--target", str(folder), "--mode", "mtp", "--mtp-steps", "2", "--num-prompts", "2",
                 "--max-new-tokens", "8", "--dtype", "float32", "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert (report["mode"], report["verdict"], report["lossless"]) == ("mtp", "weak", True)
    assert len(report["position_acceptance"]) == 2 and len(report["trials"]) == 1
    assert report["causes"] and all("mask" not in c for c in report["causes"])
    headless = write_random_qwen3_5(tmp_path / "h", seed=2)
    assert main(["--target", str(headless), "--mode", "mtp"]) == 2
    assert "mtp_num_hidden_layers" in capsys.readouterr().err
    assert main(["--mode", "mtp", "--drafter", str(folder)]) == 2  # the demo target's own head: no drafter
    assert "without --drafter" in capsys.readouterr().err
    # No --target: the demo target's trained head, on its held-out prompts.
    assert main(["--mode", "mtp", "--num-prompts", "1", "--max-new-tokens", "8", "--dtype", "float32", "--json"]) in (0, 1)
    captured = capsys.readouterr()
    demo = json.loads(captured.out)
    assert (demo["mode"], demo["lossless"]) == ("mtp", True) and "demo target's MTP head" in captured.err
