"""The benchmark command runs end to end on CPU (tiny shape, and real checkpoints); speed is not asserted."""

from __future__ import annotations

import json

from ddtree_jax.bench import DEFAULT_TAU, _projected_tau, main


def test_shape_mode_writes_json_table_and_plot(tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["--shape", "tiny", "--context", "32", "--budgets", "4,16", "--repeats", "2", "--out", str(out)]) == 0
    report = json.loads((out / "bench.json").read_text())
    assert [(r["mode"], r["budget"]) for r in report["rows"]] == [("ar", None), ("dflash", None), ("ddtree", 4),
                                                                  ("ddtree", 16)]
    for r in report["rows"]:
        assert r["round_s"] > 0 and r["floor_s"] > 0 and r["ratio_to_floor"] == r["round_s"] / r["floor_s"]
        if r["mode"] != "ar":
            assert all(r[f"{k}_s"] > 0 for k in ("draft", "tree", "verify", "accept", "commit"))
    assert report["rows"][3]["verify_tokens"] == 17
    assert (out / "bench.png").stat().st_size > 1000 and "| ddtree | 16 | 17 |" in (out / "bench.md").read_text()
    assert "Measured ceilings" in capsys.readouterr().out


def test_checkpoint_mode_reports_speedup_and_divergence(tmp_path):
    from pairs import write_signal_pair

    target, drafter = write_signal_pair(tmp_path)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt_ids": [1, 2, 3]}\n{"prompt_ids": [4, 5]}\n')
    out = tmp_path / "out"
    assert main(["--target", str(target), "--drafter", str(drafter), "--prompts", str(prompts), "--budgets", "4",
                 "--max-new-tokens", "12", "--dtype", "float32", "--out", str(out)]) == 0
    rows = json.loads((out / "bench.json").read_text())["rows"]
    assert [(r["mode"], r["budget"]) for r in rows] == [("ar", None), ("dflash", None), ("ddtree", 4)]
    assert rows[0]["speedup_over_ar"] == 1.0 and rows[0]["tau"] == 1.0
    assert rows[1]["tau"] == 4.0 and rows[2]["tau"] == 4.0  # the hand-built pair accepts every draft
    assert all(r["first_divergence"] is None for r in rows)


def test_projected_tau_and_bad_flags(capsys):
    assert _projected_tau(DEFAULT_TAU, "dflash", None) == 7.79
    assert _projected_tau(DEFAULT_TAU, "ddtree", 128) == DEFAULT_TAU[64]
    assert _projected_tau({**DEFAULT_TAU, 128: 11.0}, "ddtree", 128) == 11.0
    assert main(["--shape", "tiny", "--budgets", "x"]) == 2
    assert main([]) == 2
    assert "give either --shape" in capsys.readouterr().err


def test_shape_mode_under_tp(tmp_path):
    out = tmp_path / "out"
    assert main(["--shape", "tiny", "--context", "16", "--budgets", "8", "--modes", "ar,ddtree", "--repeats", "1",
                 "--devices", "2", "--parallel", "tp", "--out", str(out)]) == 0
    report = json.loads((out / "bench.json").read_text())
    assert report["devices"] == 2 and report["parallel"] == "tp" and len(report["rows"]) == 2
