"""The measurement tools under tools/ run on CPU and compute what they say they compute."""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))

import auto_counterfactual  # noqa: E402
import auto_projection  # noqa: E402
import barrier_probe  # noqa: E402
import bitwise_probe  # noqa: E402
import fa3_probe  # noqa: E402
import gdn_probe  # noqa: E402
import gpu_probe  # noqa: E402
import greedy_equality  # noqa: E402
import invariant_layers  # noqa: E402
import l2_probe  # noqa: E402
import loop_cost  # noqa: E402
import per_call_choice  # noqa: E402
import prune_counts  # noqa: E402
import round_attribution  # noqa: E402
import topk_probe  # noqa: E402
import tp_layout  # noqa: E402
import triton_offline  # noqa: E402
import w8a8_check  # noqa: E402
import trace_summary  # noqa: E402
import tree_temperature  # noqa: E402
import with_knobs  # noqa: E402
import with_tree_rule  # noqa: E402
from jaxprs import equations  # noqa: E402


def _write_trace(path: Path, kernels: list[tuple[float, float, str]]) -> None:
    """A Perfetto JSON as jax.profiler writes it: a GPU process with one stream, a host process with noise."""
    events = [{"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/device:GPU:0"}},
              {"ph": "M", "pid": 701, "name": "process_name", "args": {"name": "/host:CPU"}},
              {"ph": "X", "pid": 701, "tid": 5, "ts": 0.0, "dur": 999.0, "name": "PjitFunction(run)"}]
    events += [{"ph": "X", "pid": 1, "tid": 14, "ts": ts, "dur": dur, "name": name} for ts, dur, name in kernels]
    path.parent.mkdir(parents=True)
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)


def test_trace_summary_counts_gpu_kernels_per_round(tmp_path, capsys):
    # Two rounds: per round a 30-us matmul and two 2-us fusions, 1 us apart; a host event that must not count.
    kernels = []
    for start in (0.0, 100.0):
        kernels += [(start, 30.0, "gemm_fusion_dot_12"), (start + 31, 2.0, "loop_add_fusion_3"),
                    (start + 34, 2.0, "loop_add_fusion_7")]
    _write_trace(tmp_path / "ar-pallas" / "plugins" / "profile" / "x" / "perfetto_trace.json.gz", kernels)
    s = trace_summary.summarise(next(tmp_path.glob("ar-pallas/**/perfetto_trace.json.gz")), rounds=2)
    assert s["kernels_per_round"] == 3
    assert s["busy_ms_per_round"] == pytest.approx(34e-3)
    assert s["wall_ms_per_round"] == pytest.approx(136e-3 / 2)
    top = {k["name"]: k for k in s["top"]}
    assert set(top) == {"gemm_fusion_dot", "loop_add_fusion"}  # numeric suffixes grouped
    assert top["loop_add_fusion"]["count_per_round"] == 2 and top["gemm_fusion_dot"]["share_of_busy"] == pytest.approx(30 / 34)
    assert s["by_kind"]["matmul"]["ms_per_round"] == pytest.approx(30e-3)
    assert s["by_kind"]["other"] == {"count_per_round": 2, "ms_per_round": pytest.approx(4e-3)}
    assert [trace_summary.category(n) for n in ("nvjet_sm90_tss_128x72", "tree_attention_", "sort_44_1", "fusion")] \
        == ["matmul", "tree attention", "sort/top-k", "other"]
    assert top["loop_add_fusion"]["mean_us"] == 2.0 and top["gemm_fusion_dot"]["mean_us"] == 30.0
    by_kernel = trace_summary.summarise(next(tmp_path.glob("ar-pallas/**/perfetto_trace.json.gz")), rounds=2,
                                        by_kernel=True)  # each compiled kernel apart (a weight's shape, say)
    assert {k["name"]: k["count_per_round"] for k in by_kernel["top"]} == {
        "gemm_fusion_dot_12": 1, "loop_add_fusion_3": 1, "loop_add_fusion_7": 1}
    assert trace_summary.main([str(tmp_path), "--rounds", "2"]) == 0
    assert trace_summary.main([str(tmp_path), "--rounds", "2", "--by-kernel", "--json"]) == 0
    assert trace_summary.sequence(next(tmp_path.glob("ar-pallas/**/perfetto_trace.json.gz")), 2, 2) == [
        ("loop_add_fusion_7", 2.0), ("gemm_fusion_dot_12", 30.0)]  # launch order across the rounds
    assert trace_summary.main([str(tmp_path), "--rounds", "2", "--sequence", "1:3"]) == 0
    # The longest idle stretch: the first round's last fusion (ends at 36 us) to the second round's matmul (100).
    gaps = trace_summary.largest_gaps(next(tmp_path.glob("ar-pallas/**/perfetto_trace.json.gz")), 2)
    assert gaps[0] == {"us": 64.0, "at_us": 100.0, "index": 3, "before": "loop_add_fusion_7",
                       "after": "gemm_fusion_dot_12"}
    assert gaps[1]["us"] == 1.0
    assert trace_summary.main([str(tmp_path), "--rounds", "2", "--gaps", "3"]) == 0
    # A row's rounds.json (the bench's checkpoint mode) overrides --rounds: its 6 kernels over 3 rounds, not 2.
    (tmp_path / "ar-pallas" / "rounds.json").write_text('{"rounds": 3}')
    capsys.readouterr()
    assert trace_summary.main([str(tmp_path), "--rounds", "2", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["ar-pallas"]["kernels_per_round"] == 2


def test_greedy_equality_on_random_weights(tmp_path):
    out = tmp_path / "eq.json"
    assert greedy_equality.main(["--shape", "tiny", "--budgets", "4", "--max-new-tokens", "8", "--num-prompts", "2",
                                 "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert [(m["mode"], m["budget"]) for m in report["modes"]] == [("dflash", None), ("ddtree", 4)]
    for m in report["modes"]:  # a difference must come with its top-2 gap, and be a near-tie to pass
        assert m["equal_to_ar"] or (m["first_difference"] is not None and m["near_tie"])
    # In groups of one prompt per call: the same tokens (each compared with its own AR output), the same tau.
    grouped = tmp_path / "eq1.json"
    assert greedy_equality.main(["--shape", "tiny", "--budgets", "", "--max-new-tokens", "8", "--num-prompts", "2",
                                 "--batch", "1", "--out", str(grouped)]) == 0  # DFlash only: fewer compilations
    by_one = json.loads(grouped.read_text())
    assert (report["batch"], by_one["batch"]) == (2, 1)
    assert [(m["equal_to_ar"], m["tau"]) for m in by_one["modes"]] == [(m["equal_to_ar"], m["tau"])
                                                                      for m in report["modes"][:1]]
    assert greedy_equality.main(["--shape", "tiny", "--batch", "0"]) == 2
    assert greedy_equality.main(["--shape", "tiny", "--first-prompt", "-1"]) == 2


def test_loop_cost_runs_the_rounds_it_times(tmp_path, capsys):
    # The auto program forced to each candidate, calls of 0, 1 and 1 + 2 rounds, fresh and again: each call ran
    # exactly the rounds asked (EOS never ends a row here), and every figure is there.
    out = tmp_path / "cost.json"
    assert loop_cost.main(["--shape", "tiny", "--dtype", "float32", "--modes", "", "--auto", "chain,4",
                           "--rounds", "2", "--repeats", "1", "--out", str(out), "--trace", str(tmp_path / "tr")]) == 0
    report = json.loads(out.read_text())
    assert [r["program"] for r in report["rows"]] == ["auto[0,4]@chain", "auto[0,4]@4"]
    for row in report["rows"]:
        for kind in ("fresh", "again"):
            assert row[kind]["rounds"] == {"0": 0, "1": 1, "3": 3}
            assert all(s > 0 for s in row[kind]["seconds"].values())
    assert "auto[0,4]@4" in capsys.readouterr().out
    # One traced call of 1 + TRACE_ROUNDS rounds per program, in a folder named after it.
    assert sorted(p.name for p in (tmp_path / "tr").iterdir()) == ["auto_0_4_4", "auto_0_4_chain"]
    assert json.loads((tmp_path / "tr" / "auto_0_4_4" / "rounds.json").read_text()) == {"rounds": 3}
    assert report["command"] == ("python tools/loop_cost.py --shape tiny --dtype float32 --modes  --auto chain,4 "
                                 "--rounds 2 --repeats 1 --trace DIR")
    assert loop_cost.main(["--modes", "ar,0"]) == 2


def test_top2_gap_is_the_gap_of_the_next_token_logits():
    import jax
    import jax.numpy as jnp

    from ddtree_jax.engine import DecodeOptions, Mode, generate
    from ddtree_jax.measure.workload import random_pair
    from ddtree_jax.models import qwen3
    from ddtree_jax.models.contract import ForwardMeta
    from ddtree_jax.parallel import Parallel

    target, _ = random_pair("tiny", Parallel())
    prefix = [3, 1, 4, 1, 5, 9]
    gap = greedy_equality.top2_gap(target, prefix)
    # The same logits through the model's own forward of the whole prefix (jitted too: bf16 rounds by fusion).
    @jax.jit
    def last_logits(t, tokens):
        cache = qwen3.create_cache(target.config, 1, 128, jnp.bfloat16)
        out = qwen3.forward(t, tokens, ForwardMeta.prompt(jnp.asarray([len(prefix)]), len(prefix)), cache)
        return qwen3.logits(t, out.hidden[:, -1])[0]

    logits = last_logits(target, jnp.asarray([prefix], jnp.int32))
    top = jax.lax.top_k(logits, 2)[0]
    assert gap == pytest.approx(float(top[0] - top[1]), abs=1e-6) and gap >= 0
    # ... and the argmax there is what greedy AR emits next.
    ar = generate(target, [prefix], DecodeOptions(mode=Mode.AR, max_new_tokens=1)).output_ids[0][0]
    assert ar == int(jnp.argmax(logits))


def test_w8a8_check_prints_each_call_against_its_reference(capsys):
    """The W8A8 kernel's device smoke, interpreted at small shapes: two lines per promote_k and row count (the rows
    quantised first against the reference; quantised inside the kernel against that, bit for bit), and the exit
    status says whether every call matched."""
    assert w8a8_check.main(["--n", "256", "--k", "384", "--rows", "1,17", "--promote", "0,block"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("promote_k=")]
    assert [line.split(":")[0] for line in lines] == [
        f"promote_k={p} rows={r}{x}" for p in ("0", "block") for r in (1, 17) for x in ("", " quantize_x")]
    assert all(" 0 of " in line for line in lines if "quantize_x" in line)


def test_gpu_probe_smoke_forms_agree(tmp_path):
    """Every form at one token count (5 rows: the stream kernels' row tiles at any T,
    tests/kernels/test_stream_matmul.py) agrees with the models' layout."""
    assert gpu_probe.main(["--out", str(tmp_path), "--smoke", "--repeats", "2", "--tokens", "5",
                           "--forms", "hf,fused,io,stream,stream_fused,fp8,stream_fp8,stream_w8a8,stream_w8a8_apart,"
                                      "stream_fp8_fused,stream_w8a8_fused"]) == 0
    report = json.loads((tmp_path / "probe.json").read_text())
    rows = [r for r in report["rows"] if r["section"] == "projections"]
    assert {r["form"].split("[")[0] for r in rows} == {"hf", "fused", "io", "stream", "stream_fused", "fp8",
                                                      "stream_fp8", "stream_w8a8", "stream_w8a8_apart",
                                                      "stream_fp8_fused", "stream_w8a8_fused"}
    assert {r["tokens"] for r in rows} == {5}
    hf, fp8 = (next(r for r in rows if r["form"] == f) for f in ("hf", "fp8"))
    assert fp8["weight_bytes"] < 0.6 * hf["weight_bytes"]  # one byte a weight, plus the scales
    for r in rows:
        assert "error" not in r and r["ms"] >= 0 and r["x_floor"] == pytest.approx(r["ms"] / r["floor_ms"])
        if r["form"] != "hf":  # the same function as the models' layout, to bf16 rounding (and FP8 rows')
            assert r["rel_err_vs_hf"] < (8e-2 if "w8a8" in r["form"] else 2e-2)
    assert report["ceilings"]["bandwidth_bytes_per_s"] > 0


def test_gdn_probe_smoke_checks_every_variant(tmp_path, capsys):
    """tools/gdn_probe.py at tiny shapes and one T (16 nodes: two blocks of blocked8, one row block of the kernel;
    the kernel at other T: tests/kernels/test_tree_delta_rule.py): each solve against NumPy's float64 solve, the
    tree-rule kernel (interpreted) against the jnp rule, every variant timed; an unknown solve is one error line,
    exit 2."""
    assert gdn_probe.main(["--out", str(tmp_path), "--smoke", "--t", "16", "--solves", "trsm,blocked8", "--kernels",
                           "default", "--kernel-forms", "one,two,direct", "--repeats", "2"]) == 0
    rows = json.loads((tmp_path / "gdn_probe.json").read_text())["rows"]
    assert {(r["t"], r["variant"]) for r in rows} == {(16, v) for v in (
        "trsm", "blocked8", "rule_without_solve", "kernel_default_w8_vb64_s1_one", "kernel_default_w8_vb64_s1_two4",
        "kernel_default_w8_vb64_s1_direct_inv1")}
    for r in rows:
        assert "error" not in r and r["rule_us"] >= 0
        assert r.get("rel_err", 0) < 1e-5 and r.get("rel_err_out", 0) < 1e-4
        assert ("config" in r) == r["variant"].startswith("kernel_")  # with_tree_rule.py --best reads it
    capsys.readouterr()
    assert gdn_probe.main(["--out", str(tmp_path), "--solves", "lapack"]) == 2
    assert capsys.readouterr().err.startswith("error: --solves: unknown 'lapack'")


def test_topk_probe_times_and_checks_every_chunk(tmp_path):
    """Chunked, threshold and kernel (interpreted) trees against the first chunk's, the top-ks alone against
    lax.top_k, and the current builder against a baseline tree.py (here the same file: equal by construction, so
    a DIFFERENT would be the probe's own bug)."""
    assert topk_probe.main(["--out", str(tmp_path), "--vocab", "3000", "--budgets", "16", "--chunks", "0,64",
                            "--top-k", "threshold,chunked,pallas:step=1024", "--depths", "3", "--rounds", "1", "--passes", "2",
                            "--workers", "1", "--batch", "2"]) == 0
    report = json.loads((tmp_path / "topk_probe.json").read_text())
    assert report["batch"] == 2
    assert [(r["budget"], r["chunk"], r["impl"]) for r in report["records"]] == [
        (b, c, impl) for b in (16,) for c in (None, 64)
        for impl in ("current threshold", "current chunked", "current pallas", "top-k threshold", "top-k chunked",
                     "top-k pallas:step=1024")]
    assert all(r.get("same_tree", True) and r.get("same_top_k", True) and r["us"] >= 0 for r in report["records"])
    assert all("same_top_k" in r for r in report["records"] if r["impl"].startswith("top-k "))
    assert all(r["threshold_fits"] for r in report["records"])  # random logits: the fast path
    assert "| 3000 | 16 | 64 |" in (tmp_path / "topk_probe.md").read_text()
    baseline = Path(topk_probe.current.__file__)
    assert topk_probe.main(["--out", str(tmp_path), "--vocab", "300", "--budgets", "8", "--chunks", "auto",
                            "--top-k", "chunked", "--tree-build", "reference,pallas:block=16:block_rows=16",
                            "--depths", "3", "--rounds", "1", "--workers", "1", "--baseline", str(baseline),
                            "--peak", "20", "--trace", str(tmp_path / "tr")]) == 0
    report = json.loads((tmp_path / "topk_probe.json").read_text())
    traces = (tmp_path / "tr").glob("**/perfetto_trace.json.gz")
    assert [p.relative_to(tmp_path / "tr").parts[0] for p in traces] == ["300_8_chunked"]
    assert report["peak"] == 20 and str(tmp_path) not in report["command"]  # no machine path in the record
    assert [r["impl"] for r in report["records"]] == [
        "current chunked", "current chunked pallas:block=16:block_rows=16", "baseline", "top-k chunked"]
    assert all(r.get("same_tree", True) for r in report["records"])
    assert not report["records"][0]["threshold_fits"]  # 300 entries, 512 slots: no fast path


def test_topk_probe_top_k_check_sees_a_wrong_order(monkeypatch):
    """Negative control of the top-k check: a top-k whose ties go to the higher index (the lower index first is
    the contract) is caught on tied log-probs, and the right one passes."""
    logits = jnp.round(jax.random.normal(jax.random.key(0), (1, 2, 600)) * 2) / 2  # many exact ties
    assert topk_probe.same_top_k(8, 0, "chunked", logits)

    def ties_reversed(x, k, chunk):
        values, indices = jax.lax.top_k(x[..., ::-1], k)
        return values, x.shape[-1] - 1 - indices

    monkeypatch.setattr(topk_probe.current, "chunked_top_k", ties_reversed)
    assert not topk_probe.same_top_k(8, 0, "chunked", logits)


def test_tp_layout_counts_each_devices_share_from_shapes():
    """tiny-hybrid on 2 devices: every block holds half its bytes on a device except the norms (whole); by hand,
    per token, 2 all-reduces of e = 64 bf16 per layer (4 layers) and one all-gather of C = 128 channels per
    Gated DeltaNet layer (3), each device receiving 2 (N - 1) / N and (N - 1) / N of them."""
    report = tp_layout.layout("tiny-hybrid", 2)
    for block in ("embeddings", "linear_attn", "self_attn", "mlp"):
        b = report["blocks"][block]
        assert b["bytes_per_device"] * 2 == b["bytes"], block
    norms = report["blocks"]["norms"]
    assert norms["bytes_per_device"] == norms["bytes"] > 0
    assert report["all_reduces_per_token"] == 8 and report["all_reduce_received_per_token"] == 8 * 64 * 2
    assert report["all_gathers_per_token"] == 3 and report["all_gather_received_per_token"] == 3 * 128 * 2 / 2
    assert tp_layout.layout("tiny", 2)["all_gathers_per_token"] == 0


def test_bitwise_probe_smoke_and_its_comparison(tmp_path, capsys):
    """tools/bitwise_probe.py at tiny shapes (kernels interpreted): every part runs, the elementwise control is
    row-invariant; and the comparison flags a function whose rows depend on the other rows (a negative control)
    while passing one whose rows do not."""
    assert bitwise_probe.main(["--out", str(tmp_path), "--smoke", "--t", "5"]) == 0
    rows = json.loads((tmp_path / "bitwise_probe.json").read_text())["rows"]
    parts = {r["part"] for r in rows}
    assert {"elementwise", "matmul_xla:lm_head", "matmul_stream_one_split:down", "add_rms_norm", "attention",
            "gdn_rule"} <= parts
    for r in rows:
        assert "error" not in r and r["rows"] == 5, r
    assert [r["rows_differing"] for r in rows if r["part"] == "elementwise"] == [0]
    x = jnp.arange(12.0).reshape(4, 3)
    assert bitwise_probe.row_invariance(lambda x: x - x.mean(axis=0), x)["rows_differing"] == 4
    assert bitwise_probe.row_invariance(lambda x: x * 2.0, x) == {"rows": 4, "rows_differing": 0, "max_abs_diff": 0.0}
    capsys.readouterr()
    assert bitwise_probe.main(["--out", str(tmp_path), "--t", "a,b"]) == 2
    assert capsys.readouterr().err.startswith("error: --t: expected comma-separated integers")
    assert bitwise_probe.main(["--out", str(tmp_path), "--t", "5", "--parts", "attention,softmax"]) == 2
    assert capsys.readouterr().err.startswith("error: --parts: softmax names no part")


def test_auto_projection_on_random_weights(tmp_path, capsys):
    """tools/auto_projection.py: the chain, a fixed tree and auto emit the same greedy tokens (exit 0); each fixed
    mode's rounds are all its own budget and cost that many rounds; auto's rounds split over the candidates; bad
    --costs is one error line, exit 2."""
    out = tmp_path / "proj.json"
    assert auto_projection.main(["--shape", "tiny", "--costs", "chain=1e-3,4=1.2e-3", "--num-prompts", "2",
                                 "--max-new-tokens", "8", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["outputs_equal"] and [r["mode"] for r in report["rows"]] == ["chain", "4", "auto", "auto per call"]
    chain, tree, auto, per_call = report["rows"]
    assert chain["rounds_by_budget"] == {"0": chain["rounds"], "4": 0}
    assert tree["rounds_by_budget"] == {"0": 0, "4": tree["rounds"]}
    assert chain["projected_s"] == pytest.approx(chain["rounds"] * 1e-3)
    assert tree["projected_s"] == pytest.approx(tree["rounds"] * 1.2e-3)
    assert sum(auto["rounds_by_budget"].values()) == auto["rounds"]
    by_budget = auto["rounds_by_budget"]
    assert auto["projected_s"] == pytest.approx(1e-3 * by_budget["0"] + 1.2e-3 * by_budget["4"])
    # Per call from an empty record, both prompts calibrate (every candidate, paired; their seconds apart), then run
    # the candidate of fewer projected seconds so far (the same tokens): on prompt 0 alone, then on both.
    first = [chain["rounds_by_prompt"][0] * 1e-3, tree["rounds_by_prompt"][0] * 1.2e-3]
    assert per_call["rounds_by_prompt"][0] == (chain if first[0] <= first[1] else tree)["rounds_by_prompt"][0]
    faster = chain if chain["projected_s"] <= tree["projected_s"] else tree
    assert per_call["rounds_by_prompt"][1] == faster["rounds_by_prompt"][1]
    assert per_call["calibration_s"] == pytest.approx(chain["projected_s"] + tree["projected_s"])
    by_budget = per_call["rounds_by_budget"]
    assert per_call["projected_s"] == pytest.approx(1e-3 * by_budget["0"] + 1.2e-3 * by_budget["4"])
    capsys.readouterr()
    assert auto_projection.main(["--costs", "16=1e-3"]) == 2
    assert capsys.readouterr().err.startswith("error: --costs '16=1e-3'")


def test_per_call_choice_replays_the_prompts(tmp_path, capsys):
    """tools/per_call_choice.py: a chooser that runs one fixed program per prompt. A hand-worked replay (`once`
    tries each candidate once, then the fewest mean seconds); candidates that are all alike give exactly the best
    fixed total; a clearly faster candidate is found within a few prompts; a prior run's fastest is kept; an
    unknown candidate is one error line, exit 2."""
    seconds = np.array([[1.0, 1.0, 1.0, 1.0], [0.5, 2.0, 0.5, 0.5]])
    # Candidate 0 on prompt 0, 1 on prompt 1 (an unlucky 2.0), then 0 (mean 1.0 < 2.0) for the rest.
    assert per_call_choice.replay(seconds, np.arange(4), "once") == 1.0 + 2.0 + 1.0 + 1.0
    assert per_call_choice.replay(seconds, np.array([2, 3, 0, 1]), "once") == 1.0 + 0.5 + 0.5 + 2.0
    # The engine's decision (test_budget's worked case): 1, 0, 0, 1, the calibration runs left out.
    assert per_call_choice.replay(seconds, np.arange(4), "engine") == 0.5 + 1.0 + 1.0 + 0.5
    rng = np.random.default_rng(0)
    noise = rng.uniform(0.9, 1.1, size=64)

    def bench(per_prompt):
        rows = [{"mode": "dflash", "budget": None, "decode_s": float(sum(per_prompt[0])),
                 "decode_s_by_prompt": list(per_prompt[0])}]
        rows += [{"mode": "ddtree", "budget": b, "decode_s": float(sum(s)), "decode_s_by_prompt": list(s)}
                 for b, s in zip((15, 31), per_prompt[1:])]
        return {"rows": rows}

    alike = per_call_choice.evaluate(bench([noise, noise, noise]), None, "once", orders=5)
    assert alike["per_call_x_best_mean"] == pytest.approx(1.0) and alike["device_auto_x_best"] is None
    clear = per_call_choice.evaluate(bench([noise, 0.9 * noise, 0.6 * noise]), ["chain", "15", "31"], "lcb", orders=20)
    assert clear["fixed_x_best"] == pytest.approx({"chain": 0.6, "15": 0.6 / 0.9, "31": 1.0})
    assert 0.9 < clear["per_call_x_best_p5"] <= clear["per_call_x_best_mean"] < 1.0
    # A prior (an earlier run) whose fastest candidate is 15 keeps 15 for every prompt: 0.6 / 0.9 of the best.
    earlier = bench([noise, 0.5 * noise, 0.6 * noise])
    kept = per_call_choice.evaluate(bench([noise, 0.9 * noise, 0.6 * noise]), None, "once", orders=2, prior=earlier)
    assert kept["prior_pick"] == "15" and kept["prior_x_best"] == pytest.approx(0.6 / 0.9)
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(bench([noise, noise, noise])))
    capsys.readouterr()
    assert per_call_choice.main([str(path), "--candidates", "chain,99"]) == 2
    assert capsys.readouterr().err.startswith(f"error: {path}: candidates chain,99")


def test_auto_counterfactual_rules_and_trajectory(tmp_path, capsys):
    """tools/auto_counterfactual.py: Dinkelbach's rule on a hand-worked case (where the per-round best ratio loses);
    the trajectory's picks and counts are what the engine's compiled `--budget auto` loop chose and committed under
    the same costs; bad --costs is one error line, exit 2."""
    counts, costs = np.array([[1.0, 3.0], [4.0, 4.0]]), np.array([1.0, 2.0])
    rate, picks = auto_counterfactual.dinkelbach(counts, counts, costs)
    assert rate == pytest.approx(2.5) and picks.tolist() == [0, 0]  # the ratio rule: tree, chain -> 7/3
    assert auto_counterfactual.tokens_per_second(counts, costs, np.array([1, 0])) == pytest.approx(7 / 3)

    from ddtree_jax.engine import DecodeOptions, Mode, generate

    target, drafter, prompts, _ = auto_projection.load_pair("tiny", 2)
    seconds = [1e-3, 1.2e-3]  # auto runs both candidates here (checked below)
    got_counts, got_picks, predicted, exact = auto_counterfactual.trajectory(target, drafter, prompts, (0, 4),
                                                                             seconds, 8)
    options = DecodeOptions(mode=Mode.DDTREE, max_new_tokens=8, budgets=(0, 4), auto_scope="round")
    want_counts, want_picks, learned = [], [], None
    for prompt in prompts:  # what one prompt taught carries to the next, as in the tool
        result = generate(target, [prompt], options, drafter=drafter, round_costs=seconds, auto_learned=learned)
        learned = result.auto_learned
        want_counts += result.acceptance_lengths[0]
        want_picks += [(0, 4).index(b) for b in result.budgets_chosen[0]]
    assert got_picks.tolist() == want_picks and set(want_picks) == {0, 1}
    assert got_counts[np.arange(len(want_picks)), got_picks].tolist() == want_counts
    assert (got_counts >= 1).all() and predicted.shape == exact.shape == got_counts.shape
    capsys.readouterr()
    assert auto_counterfactual.main(["--costs", "4=1e-3"]) == 2
    assert capsys.readouterr().err.startswith("error: --costs '4=1e-3'")


def test_instructions_by_line_counts_each_lines_instructions(tmp_path):
    """tools/triton_offline.py --by-line: instructions counted under the line comment before them (labels, comments
    and blank lines not), most first, each line named by the file the IR's locations give it, with its text; a
    line no location names is shown bare."""
    source = tmp_path / "kernel.py"
    source.write_text("def k():\n    a = x + y\n    return a * 2\n")
    ir_text = (f'#loc = loc(unknown)\n#loc3 = loc("{source}":2:8)\n#loc7 = loc("{source}":3:11 to :16)\n'
               'module { tt.func @k() { tt.return } }\n')
    sass = """
        .text.k:
        //## File "<unknown>", line 2
        /*0000*/                   FADD R0, R1, R2 ;
        /*0010*/              @!P0 FADD R3, R1, R2 ;
.L_x_0:
        //## File "<unknown>", line 3
        /*0020*/                   FMUL R0, R0, 2 ;
        //## File "<unknown>", line 9
        /*0030*/                   EXIT ;
        /*0040*/                   BRA 0x40;
        /*0050*/                   NOP;
"""
    rows = triton_offline.instructions_by_line(sass, ir_text, top=3)
    assert [count for count, _ in rows] == [3, 2, 1]
    assert rows[0][1] == "line 9"
    assert rows[1][1].endswith("kernel.py:2: a = x + y") and rows[2][1].endswith("kernel.py:3: return a * 2")
    assert triton_offline.instructions_by_line(sass, ir_text, top=1) == rows[:1]


def test_prune_counts_against_a_direct_count(capsys):
    """tools/prune_counts.py: on hand-made rows (B = 3, three depths) the candidates, the two bounds' and the B-th
    best's counts, and the early stop, as counted by hand; and its table at a small vocabulary runs to the stop."""
    def row(*depths):
        return np.log(np.array(depths, np.float32) + 1e-30)

    # Candidates (i, j), (i + 1)(j + 1) <= 3: (0,0) (0,1) (0,2) (1,0) (2,0); beam .5 .3 .2; depth 2 .3 .3 .2.
    # Products .15 .15 .1 .09 .06: the bound (the worst child (2, 0): .06) keeps all 5, the 3rd best (.1) keeps 3;
    # the running top 3 is depth 1's (.5 .3 .2), above every product: none kept, and no deeper prefix can enter.
    rows, stop = prune_counts.kept_per_depth(row([0.5, 0.3, 0.2, 0], [0.3, 0.3, 0.2, 0.2], [0.9, 0.1, 0, 0]), 3)
    assert rows[0] == (2, 5, 5, 0, 3) and stop == 2  # (main prints the depths up to the stop)
    # Depth 2 .8 .1 .1: products .4 .05 .05 .24 .16; the bound (.16) keeps 3, of which 2 lie above the running
    # list's last (.2); the 3rd best is .16. The list becomes .5 .4 .3, the beam .4 .24 .16, its best above .3: depth
    # 3 (.9 .1 0) runs: products .36 .04 0 .216 .144, the bound (.144) keeps 3, one above .3; then the list's last
    # is .36, no longer below the beam's best: the stop.
    rows, stop = prune_counts.kept_per_depth(row([0.5, 0.3, 0.2, 0], [0.8, 0.1, 0.1, 0], [0.9, 0.1, 0, 0]), 3)
    assert rows == [(2, 5, 3, 2, 3), (3, 5, 3, 1, 3)] and stop == 3
    assert prune_counts.main(["--vocab", "500", "--budgets", "8", "--depths", "3", "--peak", "0"]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0].startswith("| peak | B | depth |") and table[-1].startswith("| 0 | 8 | stops after depth")


def test_tree_temperature_divides_only_ddtree_logits_by_each_depths_temperature(capsys):
    """tools/tree_temperature.py: a ramp 1:0.5 over three depths is 1, 0.75, 0.5; the wrapped propose gets DDTree's
    logits divided by them depth by depth and DFlash's as they were; a temperature of 0 is one error line, exit 2."""
    from types import SimpleNamespace

    from ddtree_jax.engine import Mode

    temps = tree_temperature.temperatures("1:0.5", 3)
    np.testing.assert_allclose(temps, [1.0, 0.75, 0.5])
    np.testing.assert_allclose(tree_temperature.temperatures("2", 3), [2.0, 2.0, 2.0])
    propose = tree_temperature.tempered(lambda logits, last_token, options: logits, temps)
    logits = jnp.arange(1.0, 25.0).reshape(2, 3, 4)
    got = propose(logits, None, SimpleNamespace(mode=Mode.DDTREE))
    np.testing.assert_allclose(got, np.asarray(logits) / np.array([1.0, 0.75, 0.5])[None, :, None], rtol=1e-6)
    np.testing.assert_array_equal(propose(logits, None, SimpleNamespace(mode=Mode.DFLASH)), logits)
    assert tree_temperature.main(["--temps", "1,0"]) == 2
    assert capsys.readouterr().err.strip() == "error: --temps/--ramps: 0: temperatures must be > 0"


def test_with_knobs_lays_knobs_over_each_kernels_defaults(tmp_path, monkeypatch, capsys):
    """tools/with_knobs.py: top_k and tree_build knobs laid over their default_config at every size, and the engine's
    budget limit for the tree kernels, seen by the module or script it runs; an unknown kernel, field or a value the
    config refuses is one error line, exit 2."""
    import ddtree_jax.round as rounds
    from pallas_kernels import tree_build, vocab_top_k

    monkeypatch.setattr(vocab_top_k, "default_config", vocab_top_k.default_config)  # restored after the test
    monkeypatch.setattr(tree_build, "default_config", tree_build.default_config)
    monkeypatch.setattr(rounds, "TREE_BUILD_KERNEL_UP_TO", rounds.TREE_BUILD_KERNEL_UP_TO)
    from ddtree_jax.models import layers
    monkeypatch.setattr(layers, "FUSED_KV_WRITE", layers.FUSED_KV_WRITE)
    monkeypatch.setattr(layers, "DENSE_STREAM_KNOBS", layers.DENSE_STREAM_KNOBS)
    monkeypatch.setattr(layers, "FP8_STREAM_KNOBS", layers.FP8_STREAM_KNOBS)
    monkeypatch.setattr(layers, "ATTENTION_CONFIG", layers.ATTENTION_CONFIG)
    script = tmp_path / "probe_knobs.py"
    script.write_text(
        "import sys\nfrom pallas_kernels import tree_build, vocab_top_k\nfrom ddtree_jax import round as rounds\n"
        "from ddtree_jax.models import layers\n"
        "print(vocab_top_k.default_config(8192).threshold_once, vocab_top_k.default_config(151936).threshold_once, "
        "vocab_top_k.default_config(8192).segment, tree_build.default_config(31).block_rows, "
        "tree_build.default_config(512).prune, rounds.TREE_BUILD_KERNEL_UP_TO, layers.FUSED_KV_WRITE, "
        "layers.DENSE_STREAM_KNOBS.block_n, layers.DENSE_STREAM_KNOBS.splits, layers.FP8_STREAM_KNOBS.balance, "
        "layers.FP8_STREAM_KNOBS.fp8_bits, (layers.ATTENTION_CONFIG or 0) and layers.ATTENTION_CONFIG.num_stages, "
        "sys.argv[1:])\n")
    assert (vocab_top_k.default_config(8192).threshold_once, tree_build.default_config(31).block_rows) == (0, 128)
    assert (tree_build.default_config(31).prune, tree_build.default_config(512).prune) == (1, 2)
    assert with_knobs.main(["top_k:threshold_once=1", "tree_build:block_rows=64",
                            "engine:tree_kernels_up_to=128,fused_kv_write=1", "dense_stream:block_n=16,splits=1",
                            "fp8_stream:balance=1", "attention:num_stages=2", "-m", str(script), "--y"]) == 0
    assert capsys.readouterr().out.strip() == "1 1 2048 64 2 128 True 16 1 1 1 2 ['--y']"  # fp8_bits=1 kept
    assert with_knobs.main(["engine:fused_kv_write=0", "-m", str(script)]) == 0  # a switch that is on by default
    assert capsys.readouterr().out.strip().split()[-7] == "False"
    assert with_knobs.parse_item("engine:dense_stream_max_rows=0") == ("engine", {"dense_stream_max_rows": 0})
    assert with_knobs.parse_item("engine:commit_rows_kernel=1") == ("engine", {"commit_rows_kernel": True})
    assert with_knobs.parse_item("engine:early_launch=0") == ("engine", {"early_launch": False})
    assert with_knobs.parse_item("engine:dense_stream_wide_max_bytes=40000000") == (
        "engine", {"dense_stream_wide_max_bytes": 40000000})
    for bad in ("topk:threshold_once=1", "top_k:one_launch=1", "tree_build:block_rows=48", "top_k:skip_cold=x",
                "engine:tree_kernels_up_to=0", "engine:up_to=512", "engine:fused_kv_write=2",
                "dense_stream:block_n=24", "fp8_stream:balance=3", "dense_stream_wide:prefetch=2",
                "attention:block_q=48", "attention:row_invariant=1,num_chunks=2"):
        assert with_knobs.main([bad, "-m", str(script)]) == 2
        assert capsys.readouterr().err.startswith(f"error: {bad!r}")
    assert with_knobs.main(["-m", str(script)]) == 2


def test_with_tree_rule_overrides_past_one_block_and_names_the_fastest(tmp_path, monkeypatch, capsys):
    """tools/with_tree_rule.py: KNOBS parsed (an unknown field or a non-integer is one error line, exit 2), laid over
    default_config past one block only, seen by the module it runs; --best picks the fastest error-free kernel row
    of a gdn_probe.json at T (exit 1 without one)."""
    from pallas_kernels import tree_delta_rule as tdr

    assert with_tree_rule.parse_knobs("unrolled_chain=1,value_block=32") == {"unrolled_chain": True, "value_block": 32}
    for bad in ("unroll=1", "value_block=big"):
        with pytest.raises(ValueError):
            with_tree_rule.parse_knobs(bad)
    monkeypatch.setattr(tdr, "default_config", tdr.default_config)  # restored after the test
    (tmp_path / "probe_config.py").write_text(
        "import sys\nfrom pallas_kernels import tree_delta_rule as tdr\n"
        "print(tdr.default_config(65).value_block, tdr.default_config(65).unrolled_chain, "
        "tdr.default_config(16).value_block, sys.argv[1:])\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert tdr.default_config(65).unrolled_chain  # so the override below changes it
    assert with_tree_rule.main(["unrolled_chain=0,value_block=32", "-m", "probe_config", "--x"]) == 0
    assert capsys.readouterr().out.strip() == "32 False 64 ['--x']"
    assert with_tree_rule.main(["value_block=24", "-m", "probe_config"]) == 2  # not a power of two: the config's check
    assert capsys.readouterr().err.startswith("error: KNOBS 'value_block=24'")
    rows = [{"t": 65, "variant": "trsm", "rule_us": 1.0},
            {"t": 65, "variant": "a", "rule_us": 50.0, "config": {"num_warps": 4, "unrolled_chain": True}},
            {"t": 65, "variant": "b", "rule_us": 40.0, "config": {"num_warps": 8, "unrolled_chain": False}},
            {"t": 65, "variant": "c", "error": "x", "config": {"num_warps": 2, "unrolled_chain": False}},
            {"t": 128, "variant": "d", "rule_us": 1.0, "config": {"num_warps": 2, "unrolled_chain": True}}]
    probe = tmp_path / "gdn_probe.json"
    probe.write_text(json.dumps({"rows": rows}))
    assert with_tree_rule.main(["--best", str(probe), "--t", "65"]) == 0
    assert capsys.readouterr().out.strip() == "num_warps=8,unrolled_chain=0"
    assert with_tree_rule.main(["--best", str(probe), "--t", "17"]) == 1


def test_invariant_layers_finds_the_first_differing_position_and_layer(random_target):
    """The comparison names the first position and layer whose bits differ (a one-ulp change in layer 1 of
    position 3), and on the tiny target with the row-invariant kernels (interpreted) chain verifies of 3 tokens
    give every position the AR steps' bits (one cache capacity: the kernel's rows over caches of other capacities,
    tests/kernels/test_tree_attention.py::test_row_invariant_rows_equal_the_ar_step_bitwise)."""
    from ddtree_jax.checkpoint import load_target
    from ddtree_jax.models.contract import Kernels, Runtime

    alone = [np.arange(8, dtype=np.float32) + 10 * i for i in range(5)]  # 5 positions, 2 layers of 4 features
    together = np.stack(alone[2:5])
    assert invariant_layers.first_difference(together, alone, 2, 2) is None
    together[1, 5] = np.nextafter(together[1, 5], np.float32(np.inf))
    position, layer, diff = invariant_layers.first_difference(together, alone, 2, 2)
    assert (position, layer) == (3, 1) and 0 < diff < 1e-5
    target = load_target(random_target, jnp.bfloat16)
    runtime = Runtime(Kernels.PALLAS, row_invariant=True)
    row = invariant_layers.compare(target, [5, 1, 7, 2], [3, 9, 4, 4, 8, 1, 2], runtime, 3, 32)
    assert row == {"chain": 3, "capacity": 32, "positions": 6, "first_difference": None}


def test_round_attribution_stand_in_tree_and_bad_swap(capsys):
    """The build's stand-in is the argmax chain (root first) padded with invalid nodes that see only themselves, at
    the budget's T = B + 1; an unknown --swap is one error line and exit 2, before anything is compiled."""
    rng = np.random.default_rng(0)
    lp = jnp.asarray(np.log(rng.dirichlet(np.ones(50), size=(2, 3))), jnp.float32)
    tree = round_attribution.chain_padded_tree(lp, jnp.array([5, 6], jnp.int32), 8)
    want_tokens = np.zeros((2, 9), np.int32)
    want_tokens[:, 0] = [5, 6]
    want_tokens[:, 1:4] = np.argmax(np.asarray(lp), axis=-1)
    np.testing.assert_array_equal(np.asarray(tree.tokens), want_tokens)
    np.testing.assert_array_equal(np.asarray(tree.valid), np.broadcast_to(np.arange(9) < 4, (2, 9)))
    chain = np.tril(np.ones((4, 4), bool))
    want_ancestor = np.eye(9, dtype=bool)
    want_ancestor[:4, :4] = chain
    np.testing.assert_array_equal(np.asarray(tree.ancestor), np.broadcast_to(want_ancestor, (2, 9, 9)))
    assert round_attribution.main(["--swap", "tree", "--modes", "16"]) == 2
    assert capsys.readouterr().err.startswith("error: --swap 'tree': expected one of none, fallback, build")


def test_l2_probe_smoke_times_every_form(tmp_path):
    """tools/l2_probe.py at a tiny shape, interpreted: every form timed, and the stand-in kernel really reads what it
    prefetches (a NaN in a prefetched row reaches its flag; none outside them) and chases its chain to the end."""
    assert l2_probe.main(["--out", str(tmp_path), "--smoke"]) == 0
    (record,) = json.loads((tmp_path / "l2_probe.json").read_text())["records"]
    forms = {"matmul_us", "matmul_hot_us", "host_us", "host+matmul_us", "host+prefetch_us", "host+prefetch+matmul_us"}
    assert {k for k in record if k.endswith("_us")} == forms | {"gain_us"}
    assert all(record[k] >= 0 for k in forms)
    assert record["gain_us"] == pytest.approx(record["host+matmul_us"] - record["host+prefetch+matmul_us"])
    chain = jnp.roll(jnp.arange(8, dtype=jnp.int32), -1)
    w = jnp.ones((32, 64), jnp.bfloat16).at[9, 3].set(jnp.nan)  # row 9: the third prefetch program's (rows 8-11)
    flags = l2_probe.host(chain, w, chase=7, fraction=0.5, interpret=True)  # rows 0-15: programs 1-4
    assert flags.shape == (5,) and int(flags[0]) == 7 and int(flags[3]) == 3
    quarter = l2_probe.host(chain, w, chase=7, fraction=0.25, interpret=True)  # rows 0-7: programs 1-2, no NaN
    assert quarter.shape == (3,) and int(quarter[0]) == 7 and 3 not in [int(v) for v in quarter]


def test_barrier_probe_smoke_times_every_form_and_checks_its_chain(tmp_path):
    """tools/barrier_probe.py at a tiny shape, interpreted: every form timed, each persistent config's chained result
    against XLA's (FMAs and tensor cores), and a wrong chain is seen: phases that read the layer's input instead of
    the last phase's output."""
    assert barrier_probe.main(["--out", str(tmp_path), "--smoke"]) == 0
    records = json.loads((tmp_path / "barrier_probe.json").read_text())["records"]
    assert [r["form"] for r in records] == ["empty", "barriers", "launches"] + ["persistent", "unsynced"] * 2
    assert all(r["us_per_layer"] >= 0 for r in records)
    checked = [r["check_rel_error"] for r in records if r["form"] == "persistent"]
    assert len(checked) == 2 and max(checked) < 1e-2  # the tensor cores' form rounds x to bf16
    (ws,) = barrier_probe.make_layers(barrier_probe.LAYER_SMOKE, 1, seed=7)
    x = jax.random.normal(jax.random.PRNGKey(2), (128,), jnp.float32)
    config = barrier_probe.PersistentConfig(8, 64, 4, 2)
    unsynced, _ = barrier_probe.persistent_layer(x, jnp.zeros((256,), jnp.float32), ws, jnp.zeros((1,), jnp.int32),
                                                 config=config, synced=False, interpret=True)
    want = barrier_probe.chain_reference(x, ws)
    np.testing.assert_allclose(unsynced[0], want[0], rtol=1e-5, atol=1e-5)  # its first phase reads x, as chained
    assert np.max(np.abs(np.asarray(unsynced[1]) - np.asarray(want[1]))) > 0.1


def test_barrier_probe_compiled_kernel_meets_three_times():
    """The persistent layer lowered for CUDA on this machine: three barriers between four phases, each one arrival
    (an acq_rel add of 1) and a loop polling by adds of 0 (one value for every thread), between CTA barriers;
    unsynced, none."""
    import triton_offline

    sds = jax.ShapeDtypeStruct
    args = [sds((4096,), jnp.float32), sds((12288,), jnp.float32),
            tuple(sds(s, jnp.bfloat16) for s in barrier_probe.LAYER_8B), sds((1,), jnp.int32)]

    def ir(synced):
        return triton_offline.triton_ir(
            lambda x, h, ws, c: barrier_probe.persistent_layer(x, h, ws, c, config=barrier_probe.PersistentConfig(),
                                                               synced=synced, interpret=False, programs=132), args)

    synced = ir(True)
    assert synced.count("tt.atomic_rmw add, acq_rel, gpu") == 6 and synced.count("scf.while") == 3
    assert synced.count("gpu.barrier") == 9  # before each arrival, in each poll, after each barrier
    assert "atomic_rmw" not in ir(False)


def _weight_copies(fn, *args, shape):
    """Equations of fn's jaxpr (nested ones too, kernels' bodies left out) that slice or copy out an array of
    `shape`'s size (an index of a stacked array slices [1, *shape] first)."""
    return [eqn.primitive.name for eqn, outer in equations(jax.make_jaxpr(fn)(*args))
            if "pallas_call" not in outer
            and eqn.primitive.name in ("slice", "dynamic_slice", "gather", "copy", "copy_p")
            and any(v.aval.size == np.prod(shape) for v in eqn.outvars)]


def test_l2_probe_passes_each_weight_as_it_is():
    """The probe's loop hands each kernel its weight as an operand of its own: a weight taken out of one stacked
    array by the loop index is copied whole before each call (the first device run of the probe timed those copies,
    2026-12-05 late). The check sees such a slice."""
    ws = tuple(jnp.ones((32, 128), jnp.bfloat16) for _ in range(3))
    x, chain = jnp.ones((1, 128), jnp.bfloat16), jnp.roll(jnp.arange(4, dtype=jnp.int32), -1)
    run = l2_probe.weight_loop(use_host=True, prefetch_fraction=1.0, use_matmul=True, hot=False, chase=3, chain=chain,
                               interpret=True)
    assert _weight_copies(lambda ws, x: run(2, ws, x), ws, x, shape=(32, 128)) == []
    stacked = jnp.stack(ws)
    sliced = lambda s, x: jax.lax.fori_loop(0, 3, lambda i, x: x + s[i][:1], x)  # noqa: E731
    assert _weight_copies(sliced, stacked, x, shape=(32, 128)) != []


def test_trace_summary_charges_a_kernel_placed_early_from_its_predecessors_end(tmp_path):
    """A kernel placed while the one before it runs (programmatic dependent launch) waits at its entry: its own time
    starts at that kernel's end. Here a 30-us projection, a norm placed at 10 us that ends at 35, a fusion 1 us after."""
    kernels = [(0.0, 30.0, "stream_matmul"), (10.0, 25.0, "add_rms_norm"), (36.0, 2.0, "loop_add_fusion_3")]
    path = tmp_path / "ar-pallas" / "plugins" / "profile" / "x" / "perfetto_trace.json.gz"
    _write_trace(path, kernels)
    assert trace_summary.gpu_kernels(path) == [(0.0, 30.0, "stream_matmul"), (30.0, 5.0, "add_rms_norm"),
                                               (36.0, 2.0, "loop_add_fusion_3")]
    s = trace_summary.summarise(path, rounds=1)
    assert s["busy_ms_per_round"] == pytest.approx(37e-3) and s["idle_ms_per_round"] == pytest.approx(1e-3)
    assert trace_summary.largest_gaps(path, 1)[0]["us"] == 1.0


def test_trace_summary_against_groups_the_swapped_kernels(tmp_path, capsys):
    """--against: two traces of one program, two projections swapped (a streamed one with its split sum against
    XLA's GEMM, and one against cuBLAS's), aligned on the kernels both run; each swap reported once a round with
    both sides' time, the largest difference first."""
    def layer(parts):
        kernels, t = [], 0.0
        for _ in range(2):  # two rounds of one layer each
            for name, us in parts:
                kernels.append((t, us, name))
                t += us + 1.0
        return kernels

    a = [("add_rms_norm_1", 2.0), ("stream_matmul__3", 10.0), ("loop_slice_fusion_5", 1.0), ("tree_attention_2", 6.0),
         ("add_rms_norm_1", 2.0), ("stream_matmul__4", 20.0)]
    b = [("add_rms_norm_1", 2.0), ("gemm_fusion_dot_7", 12.0), ("tree_attention_2", 6.0), ("add_rms_norm_1", 2.0),
         ("nvjet_sm90_x", 18.0)]
    for side, parts in (("on", a), ("off", b)):
        _write_trace(tmp_path / side / "dflash-pallas" / "plugins" / "x" / "perfetto_trace.json.gz", layer(parts))
    diffs = trace_summary.differences(next((tmp_path / "on").glob("**/perfetto_trace.json.gz")),
                                      next((tmp_path / "off").glob("**/perfetto_trace.json.gz")), rounds=2)
    assert [(g["after"], g["a"], g["b"], g["count"], g["a_us"], g["b_us"]) for g in diffs] == [
        ("add_rms_norm", ["stream_matmul__4"], ["nvjet_sm90_x"], 1, 20.0, 18.0),
        ("add_rms_norm", ["stream_matmul__3", "loop_slice_fusion_5"], ["gemm_fusion_dot_7"], 1, 11.0, 12.0)]
    assert trace_summary.main([str(tmp_path / "on"), "--rounds", "2", "--against", str(tmp_path / "off")]) == 0
    assert "stream_matmul__4  |  nvjet_sm90_x" in capsys.readouterr().out


def test_fa3_probe_smoke_times_the_tree_attention_and_records_what_cannot_run(tmp_path):
    """tools/fa3_probe.py --smoke on a CPU: the tree attention row timed (interpreted), jax's Mosaic GPU kernel's rows
    each carrying the reason it could not run (it needs a GPU), and no machine path in the record's command."""
    assert fa3_probe.main(["--out", str(tmp_path), "--smoke"]) == 0
    record = json.loads((tmp_path / "fa3_probe.json").read_text())
    rows = record["records"]
    assert [r["kernel"] for r in rows] == ["tree_attention", "fa3_mgpu", "fa3_mgpu", "fa3_mgpu"]
    assert rows[0]["us"] > 0 and "error" not in rows[0]
    assert all("error" in r and "us" not in r for r in rows[1:])
    assert record["command"] == "python tools/fa3_probe.py --out DIR --smoke"
