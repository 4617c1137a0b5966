"""The benchmark command runs end to end on CPU (tiny shape, and real checkpoints); speed is not asserted."""

from __future__ import annotations

import json

import numpy as np
import pytest

from ddtree_jax.bench import DEFAULT_TAU, main, projected_tau


STAGES = ("draft", "tree", "verify", "accept", "commit")


def assert_stage_times(row, stages=STAGES):
    """Every stage timed: finite and >= 0 (a tiny stage's in-loop difference is clamped at 0 on a noisy CPU,
    `measure.timing.in_loop_seconds`), and together they took time."""
    times = [row[f"{k}_s"] for k in stages]
    assert all(0 <= t < float("inf") for t in times) and sum(times) > 0, times


def assert_round_times(rows):
    """Every row's round time finite and >= 0 (an in-loop difference, clamped at 0 when a busy CPU makes the
    one-round call the slower: `measure.timing.in_loop_seconds`; a tiny shape's round is below the CPU's noise, so
    a row of one may read 0), its call of one round took time, and each ratio to the floor is the round over the
    floor."""
    assert all(0 <= r["round_s"] < float("inf") and r["floor_s"] > 0 for r in rows)
    assert all(0 < r["round_call_s"] < float("inf") for r in rows)
    assert all(r["ratio_to_floor"] == r["round_s"] / r["floor_s"] for r in rows)


def test_shape_mode_writes_json_table_and_plot(tmp_path, capsys):
    """A dense shape's AR, DFlash and DDTree rows (one budget: a DDTree row at another, the hybrid's below)."""
    out = tmp_path / "out"
    assert main(["--shape", "tiny", "--context", "32", "--budgets", "16", "--repeats", "3", "--out", str(out)]) == 0
    report = json.loads((out / "bench.json").read_text())
    # The record's command reproduces the run and names no machine path (--out dropped).
    assert report["command"] == "python -m ddtree_jax.bench --shape tiny --context 32 --budgets 16 --repeats 3"
    assert [(r["mode"], r["budget"]) for r in report["rows"]] == [("ar", None), ("dflash", None), ("ddtree", 16)]
    assert_round_times(report["rows"])
    for r in report["rows"]:
        if r["mode"] != "ar":
            assert_stage_times(r)
    assert report["rows"][2]["verify_tokens"] == 17
    assert (out / "bench.png").stat().st_size > 1000 and "| ddtree | 16 | jax | 1 | 32 | 17 |" in (out / "bench.md").read_text()
    assert all(r["recurrent_state_bytes"] == 0 for r in report["rows"]) and not report["hybrid"]
    assert "Measured ceilings" in capsys.readouterr().out
    # split-K "auto" is XLA's choice off a GPU; the XLA flags of the run are kept; written atomically (no leftovers).
    assert {r["split_k"] for r in report["rows"]} == {"xla"} and "xla_flags" in report
    assert sorted(p.name for p in out.iterdir()) == ["bench.json", "bench.md", "bench.partial.json", "bench.png"]


def test_checkpoint_mode_reports_speedup_and_divergence(tmp_path, monkeypatch):
    """Checkpoint rows (AR, DFlash, DDTree at B = 4 and auto) on the hand-built pair, which accepts every draft; with
    --trace: a profiler trace of one more decode of the first prompt per row, after the timed ones and compiling
    nothing, and its round count (prefill emits the first of the 12 tokens: 3 rounds of 4 against 11 AR steps)."""
    from pairs import write_signal_pair

    monkeypatch.setenv("DDTREE_JAX_ROUND_COSTS", str(tmp_path / "costs"))
    target, drafter = write_signal_pair(tmp_path)
    prompts = tmp_path / "p.jsonl"
    long = [1 + i % 15 for i in range(40)]  # another prompt width: another program, warmed up untimed
    prompts.write_text('{"prompt_ids": [1, 2, 3]}\n{"prompt_ids": [4, 5]}\n' + json.dumps({"prompt_ids": long}) + "\n")
    out = tmp_path / "out"
    monkeypatch.chdir(tmp_path)  # checkpoint folders under the working directory are recorded relative to it
    from ddtree_jax import engine

    calls, generate = [], engine.generate

    def recording(target, prompts, options, **kw):  # which row decodes which prompts, and whether it compiled
        result = generate(target, prompts, options, **kw)
        calls.append((options.mode.value, options.budgets or options.budget, len(prompts[0]), result.compile_seconds))
        return result

    monkeypatch.setattr(engine, "generate", recording)
    traces = tmp_path / "traces"
    assert main(["--target", str(target), "--drafter", str(drafter), "--prompts", str(prompts), "--budgets", "4,auto",
                 "--budget-candidates", "chain,4", "--auto-scope", "round", "--max-new-tokens", "12", "--dtype",
                 "float32", "--trace", str(traces), "--out", str(out)]) == 0
    plan = [("ar", 64), ("dflash", 64), ("ddtree", 4), ("ddtree", (0, 4))]
    # Every row compiles and warms up first, on the first prompt and on the long one (its own programs); then
    # prompt by prompt every row in turn, none compiling again; then each row's traced decode of the first prompt.
    warm = [c for p in plan for c in (p, p)]
    assert [c[:2] for c in calls] == warm + plan * 4 and [c[2] for c in calls] == [3, 40] * 4 + [3] * 4 + [2] * 4 + \
        [40] * 4 + [3] * 4
    assert all(c[3] > 0 for c in calls[:8]) and all(c[3] == 0 for c in calls[8:])
    rows_traced = ("ar", "dflash", "ddtree4", "ddtreeauto_round")
    assert sorted(p.name for p in traces.iterdir()) == sorted(rows_traced)
    assert [json.loads((traces / row / "rounds.json").read_text())["rounds"] for row in rows_traced] == [11, 3, 3, 3]
    assert all(list((traces / row).glob("**/perfetto_trace.json.gz")) for row in rows_traced)
    record = json.loads((out / "bench.json").read_text())
    assert record["command"].endswith("--auto-scope round --max-new-tokens 12 --dtype float32 --trace DIR")
    assert (record["target"], record["drafter"]) == (str(target.relative_to(tmp_path)), str(drafter.relative_to(tmp_path)))
    rows = record["rows"]
    assert [(r["mode"], r["budget"]) for r in rows] == [("ar", None), ("dflash", None), ("ddtree", 4),
                                                        ("ddtree", "auto")]
    assert [r["tokens"] for r in rows] == [36] * 4  # 3 prompts x 12 tokens, no EOS in this vocabulary
    assert all(len(r["decode_s_by_prompt"]) == 3 and sum(r["decode_s_by_prompt"]) == r["decode_s"] for r in rows)
    assert rows[0]["tau"] == 1.0  # AR commits one token per round
    assert all(r["tau"] == 4.0 for r in rows[1:])  # the hand-built pair accepts every draft
    assert all(r["first_divergence"] is None for r in rows)
    auto = rows[3]
    assert auto["budget_candidates"] == [0, 4] and sum(auto["rounds_by_budget"].values()) == 9  # 3 x 3 rounds
    assert [len(r) for r in auto["budgets_by_round"]] == [3] * 3 and {b for r in auto["budgets_by_round"] for b in r} \
        <= {0, 4} and (out / "bench.png").read_bytes()[:4] == b"\x89PNG"
    assert len(auto["round_costs_s"]) == 2 and auto["auto_scope"] == "round"
    assert "ddtree auto per round: rounds by budget" in (out / "bench.md").read_text()
    # Without --row-invariant: recorded off per row, no note (test_checkpoint_mode_with_row_invariant_arithmetic).
    assert not any(r["row_invariant"] for r in rows) and "Row-invariant" not in (out / "bench.md").read_text()
    # One cost table per run: calibrated in the warm-up (an empty cost cache) and given to every prompt.
    assert auto["calibration_s"] > 0 and len(list((tmp_path / "costs").iterdir())) == 1


def test_checkpoint_mode_auto_per_call_starts_from_the_kept_record(tmp_path, monkeypatch, capsys):
    """The auto row per call (the default scope) on the hand-built pair: it runs the fixed rows' programs, one
    candidate per prompt, AR's tokens; with --recalibrate from an empty record, calibrating (both candidates on
    each of the four prompts), and the next run from the record the first one left, calibrating nothing. A bad
    scope is one error."""
    from pairs import write_signal_pair

    monkeypatch.setenv("DDTREE_JAX_ROUND_COSTS", str(tmp_path / "costs"))
    target, drafter = write_signal_pair(tmp_path)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt_ids": [1, 2, 3]}\n{"prompt_ids": [4, 5]}\n{"prompt_ids": [6]}\n{"prompt_ids": [7]}\n')
    argv = ["--target", str(target), "--drafter", str(drafter), "--prompts", str(prompts), "--budgets", "4,auto",
            "--budget-candidates", "chain,4", "--max-new-tokens", "12", "--dtype", "float32", "--num-prompts", "4"]
    runs = []
    for n, extra in enumerate((["--recalibrate"], [])):
        assert main(argv + extra + ["--out", str(tmp_path / f"out{n}")]) == 0
        runs.append(json.loads((tmp_path / f"out{n}" / "bench.json").read_text())["rows"])
    first, second = runs[0][3], runs[1][3]
    assert first["auto_scope"] == "call" and "round_costs_s" not in first and first["first_divergence"] is None
    assert first["record_calls_before"] == {"0": 0, "4": 0} and sum(first["calls_by_budget"].values()) == 4
    assert first["tokens"] == 48 and first["calibration_s"] > 0 and first["record_calls_after"] == {"0": 4, "4": 4}
    assert second["record_calls_before"] == first["record_calls_after"] and second["calibration_s"] == 0
    assert "ddtree auto per call: calls by budget" in (tmp_path / "out1" / "bench.md").read_text()
    assert main(argv + ["--auto-scope", "call,turn"]) == 2
    assert "--auto-scope takes a comma list of call, round, got 'call,turn'" in capsys.readouterr().err


def test_checkpoint_mode_with_row_invariant_arithmetic(tmp_path, monkeypatch):
    """--row-invariant with checkpoints (the Pallas kernels, interpreted): the rows decode with it (here the AR row
    alone; the DDTree tokens under it: test_kernels_in_engine), record it per row and note it under the table."""
    from pairs import write_signal_pair
    from pallas_kernels import ENV_VAR

    monkeypatch.setenv(ENV_VAR, "pallas")  # "auto" kernels: the Pallas ones, which --row-invariant needs

    target, drafter = write_signal_pair(tmp_path)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt_ids": [1, 2, 3]}\n')
    assert main(["--target", str(target), "--drafter", str(drafter), "--prompts", str(prompts), "--modes", "ar",
                 "--max-new-tokens", "4", "--dtype", "float32", "--row-invariant", "--out", str(tmp_path / "out")]) == 0
    record = json.loads((tmp_path / "out" / "bench.json").read_text())
    assert [(r["mode"], r["row_invariant"], r["tau"], r["tokens"]) for r in record["rows"]] == [("ar", True, 1.0, 4)]
    assert "Row-invariant arithmetic" in (tmp_path / "out" / "bench.md").read_text()
    assert record["command"].endswith("--dtype float32 --row-invariant")


def test_projected_tau_and_bad_flags(capsys):
    assert projected_tau(DEFAULT_TAU, "dflash", None) == 7.79
    assert projected_tau(DEFAULT_TAU, "ddtree", 128) == DEFAULT_TAU[64]
    assert projected_tau({**DEFAULT_TAU, 128: 11.0}, "ddtree", 128) == 11.0
    # Between listed budgets, linear in log2: 32 halfway between 16's 9.0 and 64's 10.73; 63 just below 64's;
    # outside the listed ones, the nearest.
    assert projected_tau(DEFAULT_TAU, "ddtree", 32) == pytest.approx((9.0 + 10.73) / 2)
    assert projected_tau(DEFAULT_TAU, "ddtree", 63) == pytest.approx(9.0 + 1.73 * np.log2(63 / 16) / 2)
    assert projected_tau(DEFAULT_TAU, "ddtree", 4) == 9.0 and projected_tau(DEFAULT_TAU, "ddtree", 1024) == 10.73
    assert main(["--shape", "tiny", "--budgets", "x"]) == 2
    assert main(["--shape", "tiny", "--target", "somewhere"]) == 2  # (no flags at all runs the demo pair)
    assert main(["--weights", "fp8", "--target", "somewhere"]) == 2
    assert "give either --shape" in capsys.readouterr().err
    assert main(["--shape", "tiny", "--budgets", "16,auto"]) == 2
    assert "--budgets auto needs checkpoints" in capsys.readouterr().err
    assert main(["--budgets", "auto", "--budget-candidates", "16"]) == 2
    assert "--budget-candidates: expected at least two" in capsys.readouterr().err
    # Without --target the demo target runs, with the --drafter given (as generate and the doctor do).
    assert main(["--drafter", "no_such_drafter", "--num-prompts", "1", "--max-new-tokens", "2"]) == 2
    assert "no_such_drafter" in capsys.readouterr().err


def test_shape_mode_under_tp(tmp_path):
    """A dense shape's AR row under tp on 2 devices (a DDTree row's stages under tp: the hybrid test below)."""
    out = tmp_path / "out"
    assert main(["--shape", "tiny", "--context", "16", "--modes", "ar", "--repeats", "1",
                 "--devices", "2", "--parallel", "tp", "--out", str(out)]) == 0
    report = json.loads((out / "bench.json").read_text())
    assert report["devices"] == 2 and report["parallel"] == "tp" and not report["hybrid"]
    assert report["kernel_launch_signal"] is False  # a CPU: no Pallas kernel compiled, no signal
    assert [r["mode"] for r in report["rows"]] == ["ar"]
    assert_round_times(report["rows"])


def test_hybrid_shape_mode_under_tp(tmp_path, recwarn):
    """`--shape tiny-hybrid --devices 2 --parallel tp`: a DDTree round of the hybrid with every layer split (2 key
    heads, 2 KV heads: nothing stays whole, so no warning)."""
    out = tmp_path / "out"
    assert main(["--shape", "tiny-hybrid", "--context", "16", "--budgets", "4", "--modes", "ddtree", "--repeats", "1",
                 "--devices", "2", "--parallel", "tp", "--out", str(out)]) == 0
    report = json.loads((out / "bench.json").read_text())
    assert report["devices"] == 2 and report["parallel"] == "tp" and report["hybrid"]
    [row] = report["rows"]
    assert (row["mode"], row["budget"], row["verify_tokens"]) == ("ddtree", 4, 5)
    assert_round_times([row])
    assert_stage_times(row)
    assert not [w for w in recwarn if "--parallel tp" in str(w.message)]


def test_hybrid_shape_mode_reports_recurrent_state_bytes(tmp_path):
    """`--shape tiny-hybrid`: a random Qwen3.5-style target (3 Gated DeltaNet layers + 1 gated attention layer)
    with a sliding-window + non-causal drafter; every DFlash/DDTree row carries the per-node recurrent states its
    verify keeps, equal to a hand count from the config and to what the verify forward really returns. In the same
    run (one hybrid's programs), AR and MTP rows (below)."""
    import jax
    import jax.numpy as jnp

    from ddtree_jax.config import parse_qwen3_5
    from ddtree_jax.measure import costs
    from ddtree_jax.models import qwen3_5
    from ddtree_jax.models.contract import ForwardMeta

    out = tmp_path / "out"
    assert main(["--shape", "tiny-hybrid", "--context", "24", "--modes", "ar,dflash,mtp,ddtree", "--budgets", "4",
                 "--mtp-steps", "2", "--tau", "mtp=2.5", "--repeats", "1", "--out", str(out)]) == 0
    report = json.loads((out / "bench.json").read_text())
    ar, dflash, mtp, ddtree = report["rows"]
    rows = [dflash, ddtree]
    assert report["hybrid"] and report["skipped"] == []
    assert [(r["mode"], r["budget"], r["verify_tokens"]) for r in report["rows"]] == [
        ("ar", None, 1), ("dflash", None, 16), ("mtp", None, 3), ("ddtree", 4, 5)]
    assert_round_times(report["rows"])
    for r in rows:
        assert_stage_times(r)

    # `--modes mtp`: a row of the hybrid's own (random) MTP head, m + 1 verified tokens, its weights counted once
    # per step in the floor, projected tokens/s only at a given tau; a dense shape is refused before any work.
    assert report["mtp_steps"] == 2
    assert_stage_times(mtp, ("draft", "verify", "accept", "commit"))
    if mtp["round_s"] > 0:  # else clamped on a busy CPU (assert_round_times)
        assert mtp["tokens_per_s_projected"] == pytest.approx(2.5 / mtp["round_s"])
    head = 2 * report["target_config"]["vocab_size"] * report["target_config"]["hidden_size"]  # bf16 lm_head
    # two sequential steps of the head, each through the lm_head, and the nodes' recurrent states
    assert mtp["floor_bytes"] - ar["floor_bytes"] == 2 * (report["mtp_bytes"] + head) + (
        mtp["floor_recurrent_bytes"] - ar["floor_recurrent_bytes"])
    assert main(["--shape", "tiny", "--modes", "mtp", "--out", str(tmp_path / "x")]) == 2

    # By hand from the config: per node and GDN layer a float32 key, written value and log decay per value
    # head, Hv x (Dk + Dv + 1), and a bf16 conv input of C = 2 * key heads * Dk + Hv * Dv channels; the
    # committed state is a float32 Hv x Dk x Dv state and a conv window of K - 1 inputs.
    c = report["target_config"]
    gdn = c["layer_types"].count("linear_attention")
    state = c["linear_num_value_heads"] * c["linear_key_head_dim"] * c["linear_value_head_dim"] * 4
    vectors = c["linear_num_value_heads"] * (c["linear_key_head_dim"] + c["linear_value_head_dim"] + 1) * 4
    channels = 2 * c["linear_num_key_heads"] * c["linear_key_head_dim"] + \
        c["linear_num_value_heads"] * c["linear_value_head_dim"]
    per_node = gdn * (vectors + channels * 2)
    assert per_node == 3 * (4 * 33 * 4 + 128 * 2) == report["recurrent_bytes_per_node"]
    committed = gdn * (state + channels * (c["linear_conv_kernel_dim"] - 1) * 2)
    assert report["recurrent_committed_bytes"] == committed
    for r in rows:
        assert r["recurrent_state_bytes"] == r["verify_tokens"] * per_node
        assert r["recurrent_state_mib"] == r["recurrent_state_bytes"] / 2**20
        # The floor moves them: committed state read and written, the node vectors written and read back.
        assert r["floor_recurrent_bytes"] == 2 * committed + 2 * r["verify_tokens"] * per_node
        # ... beside the weights (the target's but its untied embedding table, the drafter's, and the lm_head again
        # for the drafter's logits: table and head are each vocab x hidden bf16) and the K/V of the 24 context
        # tokens in the one full-attention layer.
        kv = 2 * c["layer_types"].count("full_attention") * 24 * c["num_key_value_heads"] * c["head_dim"] * 2
        assert r["floor_bytes"] == report["target_bytes"] + report["drafter_bytes"] + kv + r["floor_recurrent_bytes"]
        assert not c["tie_word_embeddings"]

    # The weights counted are the hybrid's own parameters (bf16), and the node states are what the verify returns.
    cfg = parse_qwen3_5(c)
    assert report["target_bytes"] == 2 * cfg.num_params()
    params = qwen3_5.abstract(cfg)
    cache = jax.eval_shape(lambda: qwen3_5.create_cache(cfg, 1, 64, jnp.bfloat16))
    t = 5
    tokens = jnp.zeros((1, t), jnp.int32)
    meta = ForwardMeta.tree(jnp.zeros((1,), jnp.int32), jnp.zeros((1, t), jnp.int32), jnp.zeros((1, t), jnp.int32),
                            jnp.tril(jnp.ones((1, t, t), bool)))
    fwd = jax.eval_shape(lambda p, k: qwen3_5.forward(p, tokens, meta, k), params, cache)
    kept = sum(a.size * a.dtype.itemsize for n in fwd.nodes for a in jax.tree.leaves(n))
    assert kept == costs.recurrent_node_bytes(cfg, t) == ddtree["recurrent_state_bytes"]

    table = (out / "bench.md").read_text()
    assert "recurrent state MiB |" in table.splitlines()[0]
    [line] = [x for x in table.splitlines() if x.startswith("| ddtree | 4 | jax | 1 | 24 | 5 |")]
    assert line.endswith(f"| {per_node * 5 / 2**20:.3f} |")


@pytest.mark.parametrize("shape", ["tiny", "demo"])
def test_floor_reads_the_head_once_per_logits_pass_and_not_the_embedding_table(shape):
    """A round's weight bytes, by hand from the config: AR reads the target's parameters but an untied embedding
    table (it gathers a row of it); DFlash and DDTree read the drafter's too and the lm_head a second time (the
    drafter's logits). With tied embeddings (the demo target) the table is the head: read by every logits pass."""
    import jax.numpy as jnp

    from ddtree_jax.measure import costs, workload
    from ddtree_jax.parallel import Parallel

    target, drafter = workload.random_pair(shape, Parallel(), jnp.bfloat16)
    cfg = target.config
    table = 2 * cfg.vocab_size * cfg.hidden_size
    weights = 2 * cfg.num_params() - (0 if cfg.tie_word_embeddings else table)
    assert cfg.tie_word_embeddings == (shape == "demo")
    for mode, tokens in (("ar", 1), ("dflash", 16), ("ddtree", 5)):
        terms = costs.floor_terms(target, drafter, mode, tokens, context=8)
        speculative = 0 if mode == "ar" else costs.param_bytes(drafter) + table
        assert terms["weight_bytes"] == weights + speculative

def test_shape_mode_in_float32_records_the_matmul_precision(tmp_path):
    """`--dtype float32` applies to `--shape` runs (weights and caches; the cost of true float32 on a GPU is
    measured this way), and the report records it with the resolved `--matmul-precision`."""
    import jax.numpy as jnp

    from ddtree_jax.engine import DecodeOptions, resolve_options
    from ddtree_jax.measure import costs, workload
    from ddtree_jax.parallel import Parallel

    out = tmp_path / "out"
    assert main(["--shape", "tiny", "--context", "16", "--modes", "ar", "--repeats", "1", "--dtype", "float32",
                 "--out", str(out)]) == 0
    report = json.loads((out / "bench.json").read_text())
    assert report["dtype"] == "float32" and report["matmul_precision"] == "highest" and len(report["rows"]) == 1
    target, drafter = workload.random_pair("tiny", Parallel(), jnp.float32)
    assert report["target_bytes"] == 4 * costs.param_count(target)
    options = resolve_options(DecodeOptions(), None, jnp.float32)
    state = workload.filled_state(target, drafter, 16, options, Parallel(), room_rounds=2)
    assert {a.dtype for a in state.cache.k + state.cache.v} == {jnp.dtype(jnp.float32)}


def test_shape_mode_with_fp8_weights_counts_fp8_bytes(tmp_path):
    """`--weights fp8`: the target's projections are float8_e4m3fn (a byte each) with float32 block scales, the
    rest bf16, and the floor moves those bytes (counted here by hand from the config). Run as the GPU runs
    compare the FP8 matmuls (`--fp8-matmul stream --kernels pallas`): each row records the choice."""
    out = tmp_path / "out"
    assert main(["--shape", "tiny", "--weights", "fp8", "--context", "16", "--modes", "ar", "--repeats", "1",
                 "--fp8-matmul", "stream", "--kernels", "pallas", "--out", str(out)]) == 0
    report = json.loads((out / "bench.json").read_text())
    c = report["target_config"]
    e, f, v, n, d = (c["hidden_size"], c["intermediate_size"], c["vocab_size"], c["num_hidden_layers"],
                     c["head_dim"])
    q, kv = c["num_attention_heads"] * d, c["num_key_value_heads"] * d
    projections = n * (2 * e * q + 2 * e * kv + 3 * e * f)  # q, o, k, v, gate, up, down: one byte per weight
    scales = n * 7 * 4  # the tiny shape's projections are one 128 x 128 block each: one float32 scale
    rest = 2 * (2 * v * e + n * (2 * e + 2 * d) + e)  # bf16 embedding, lm_head, norms
    assert report["weights"] == "fp8" and report["target_bytes"] == projections + scales + rest
    row = report["rows"][0]
    # the weights but the (untied) embedding table, of which a step gathers a row, and the K/V of 16 tokens
    assert not c["tie_word_embeddings"]
    assert row["floor_bytes"] == report["target_bytes"] - 2 * v * e + 2 * n * 16 * kv * 2
    assert row["fp8_matmul"] == "stream" and row["kernels"] == "pallas"
    assert "block-scaled FP8 (`--weights fp8`), multiplied by stream" in (out / "bench.md").read_text()
