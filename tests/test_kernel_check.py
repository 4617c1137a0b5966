"""`python tools/kernel_check.py --smoke`: the kernel check script on tiny shapes, kernels interpreted on CPU."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import jax
import pytest

from pallas_kernels import tree_attention as ta

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))

import kernel_check  # noqa: E402


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("kernel_check")
    rc = kernel_check.main(["--out", str(out), "--smoke"])
    return rc, json.loads((out / "kernel_check.json").read_text()), (out / "kernel_check.md").read_text()


def test_smoke_runs_every_section_and_passes(smoke):
    rc, report, _ = smoke
    assert rc == 0
    records = report["records"]
    assert {r["section"] for r in records} == {"attention", "attention check", "accept"}
    assert not [r for r in records if r["status"] == "error"]
    assert all(r["check_ok"] for r in records if "check_ok" in r)
    ceilings = report["ceilings"]
    assert ceilings["copy_bytes_per_s"] > 0 and ceilings["bf16_flops_per_s"] > 0
    assert ceilings["bandwidth_bytes_per_s"] == max(ceilings.get(k, 0) for k in (
        "copy_bytes_per_s", "read_bytes_per_s", "gemv_bytes_per_s", "gemv_loop_bytes_per_s"))


def test_smoke_times_per_layer_against_the_floor(smoke):
    _, report, markdown = smoke
    shape = report["shape"]
    attention = [r for r in report["records"] if r["section"] == "attention"]
    # Every grid point has the kernel, the reference and both dot_product_attention variants.
    for s in shape["s"]:
        for t in shape["t"]:
            variants = {r["variant"] for r in attention if (r["s"], r["t"]) == (s, t)}
            assert variants == {"pallas", "reference (jnp, XLA)", "dot_product_attention[xla]",
                                "dot_product_attention[cudnn]"}
    # The cost of one smoke point written out (b 1, 4 query / 2 KV heads of 16, bf16), S = 64, T = 5: K/V cache
    # 2 * 64 * 2 * 16 * 2 = 8192 bytes, q + out + new K/V 5 * (2 * 4 + 2 * 2) * 16 * 2 = 1920, mask 25;
    # FLOPs 4 * 4 * 16 * 5 * (64 + 5) = 88320.
    assert kernel_check.attention_cost(shape, 1, 64, 5, "bfloat16") == (8192 + 1920 + 25, 88320)
    bandwidth, rate = report["ceilings"]["bandwidth_bytes_per_s"], report["ceilings"]["bf16_flops_per_s"]
    for r in attention:
        assert r["layers"] == shape["layers"] == report["layers"]
        assert r["floor_us"] == pytest.approx(max(r["bytes"] / bandwidth, r["flops"] / rate) * 1e6)
        if r["variant"] == "dot_product_attention[cudnn]":  # no GPU here: not applicable, not failed
            assert r["status"] == "n/a"
        else:
            assert r["status"] == "ok" and r["us"] >= 0 and r["ratio"] == pytest.approx(r["us"] / r["floor_us"])
    checks = [r for r in report["records"] if r["section"] == "attention check"]
    assert {r["dtype"] for r in checks} == {"bfloat16", "float32"}
    assert all(len(set(r["lengths"])) > 1 for r in checks)  # rows of different lengths
    accept = [r for r in report["records"] if r["section"] == "accept" and r["variant"] == "pallas"]
    assert accept and all(r["exact"] and r["count_ok"] for r in accept)
    assert "| S | T | floor us (bound) | pallas |" in markdown and "n/a" in markdown


def test_a_wrong_kernel_fails_the_check(tmp_path, monkeypatch):
    def wrong(*args, scale, interpret=False, config=None, **kwargs):  # the right math at the wrong scale
        return ta.tree_attention_reference(*args, scale=1.5 * scale, **kwargs)

    monkeypatch.setattr(ta, "tree_attention_pallas", wrong)
    assert kernel_check.main(["--out", str(tmp_path), "--smoke", "--only", "check"]) == 1
    records = json.loads((tmp_path / "kernel_check.json").read_text())["records"]
    assert records and all(r["check_ok"] is False for r in records)


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="checks the refusal without a GPU")
def test_refuses_without_gpu_unless_smoke(tmp_path, capsys):
    assert kernel_check.main(["--out", str(tmp_path)]) == 2
    assert "--smoke" in capsys.readouterr().err
