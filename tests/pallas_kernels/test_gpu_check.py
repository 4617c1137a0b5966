"""`python -m pallas_kernels.gpu_check --smoke`: the GPU check script on tiny shapes, kernels interpreted on CPU."""

from __future__ import annotations

import json

import jax
import pytest

from pallas_kernels import gpu_check
from pallas_kernels import tree_attention as ta


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_check")
    rc = gpu_check.main(["--out", str(out), "--smoke"])
    return rc, json.loads((out / "gpu_check.json").read_text()), (out / "gpu_check.md").read_text()


def test_smoke_runs_every_section_and_passes(smoke):
    rc, report, _ = smoke
    assert rc == 0
    records = report["records"]
    assert {r["section"] for r in records} == {"attention", "attention check", "accept"}
    assert not [r for r in records if r["status"] == "error"]
    assert all(r["check_ok"] for r in records if "check_ok" in r)
    ceilings = report["ceilings"]
    assert ceilings["copy_bytes_per_s"] > 0 and ceilings["bf16_flops_per_s"] > 0
    assert ceilings["bandwidth_bytes_per_s"] == max(ceilings[k] for k in ("copy_bytes_per_s", "read_bytes_per_s",
                                                                         "gemv_bytes_per_s"))


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
    for r in attention:
        assert r["layers"] == shape["layers"] == report["layers"]
        bytes_, flops = gpu_check.attention_cost(shape, r["b"], r["s"], r["t"], "bfloat16")
        floor = max(bytes_ / report["ceilings"]["bandwidth_bytes_per_s"], flops / report["ceilings"]["bf16_flops_per_s"])
        assert r["floor_us"] == pytest.approx(floor * 1e6)
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
    assert gpu_check.main(["--out", str(tmp_path), "--smoke", "--only", "check"]) == 1
    records = json.loads((tmp_path / "gpu_check.json").read_text())["records"]
    assert records and all(r["check_ok"] is False for r in records)


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="checks the refusal without a GPU")
def test_refuses_without_gpu_unless_smoke(tmp_path, capsys):
    assert gpu_check.main(["--out", str(tmp_path)]) == 2
    assert "--smoke" in capsys.readouterr().err
