"""`python -m ddtree_jax.generate` end to end, as a user runs it.

Most runs call the command's own `main(argv)` in this process (`run_cli`): its flags, exit status, stdout and
stderr, without paying a fresh interpreter's imports (about 5 s a run) for each. The tests about the process
itself run `python -m ddtree_jax.generate` as a subprocess (`run_process`): the README's command, the requests
refused before any allocation, one bad flag's exit status and single error line, and the advisory that
transformers prints at import.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import stat
import subprocess
import sys
import time

import pytest

from conftest import requires_torch
from ddtree_jax.demo_pair import demo_target

JSON_KEYS = {"mode", "output_ids", "text", "acceptance_lengths", "tau", "new_tokens", "decode_seconds",
             "tokens_per_second", "prefill_seconds", "compile_seconds",
             "matmul_precision", "split_k", "fp8_matmul", "row_invariant"}
SUMMARY = re.compile(r"^\[(ar|dflash block=\d+|ddtree B=(\d+|auto( \((chain|\d+)(, \d+)*\))?)|mtp steps=\d+)\] "
                     r"\d+ tokens, (\d+\.\d\d tokens per round \(tau\), )?decode \d+\.\d\d s( = \d+ tokens/s)?; "
                     r"compile \d+\.\d s(; --budget auto calibration \d+\.\d\d s)?$")


def run_process(*args, env=None, timeout=600):
    """`python -m ddtree_jax.generate ARGS` in a fresh interpreter."""
    return subprocess.run([sys.executable, "-m", "ddtree_jax.generate", *map(str, args)], capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, **(env or {})})


def run_cli(*args, env=None):
    """`main(ARGS)` in this process, as `python -m ddtree_jax.generate` calls it: its exit status and what it wrote
    to stdout and stderr (an uncaught exception propagates and fails the test, as a traceback would)."""
    from ddtree_jax.generate import main

    out, err, saved = io.StringIO(), io.StringIO(), {k: os.environ.get(k) for k in env or {}}
    os.environ.update(env or {})
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main([str(a) for a in args])
            except SystemExit as e:  # argparse's own errors
                code = e.code
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return subprocess.CompletedProcess(["generate", *map(str, args)], code, out.getvalue(), err.getvalue())


def run_ar(*args, **kwargs):
    return run_cli("--mode", "ar", *args, **kwargs)


@requires_torch
def test_greedy_json_equals_transformers_generate(tmp_path):
    import torch
    from transformers import GenerationConfig, Qwen3ForCausalLM

    from conftest import HF_VARIANTS, build_hf_qwen3

    folder = build_hf_qwen3(tmp_path / "hf", seed=11, **HF_VARIANTS["gqa_untied"])
    prompt = [17, 4, 250, 99, 3]
    proc = run_cli("--target", folder, "--prompt-ids", ",".join(map(str, prompt)), "--mode", "ar", "--json",
                   "--ignore-eos", "--dtype", "float32", "--max-new-tokens", 40)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    hf = Qwen3ForCausalLM.from_pretrained(str(folder), dtype="float32").eval()
    config = GenerationConfig(max_new_tokens=40, do_sample=False, eos_token_id=None, pad_token_id=0)
    with torch.no_grad():
        expected = hf.generate(torch.tensor([prompt]), generation_config=config)[0, len(prompt):].tolist()
    assert len(expected) == 40
    assert report["output_ids"] == expected


def test_json_report_with_text_prompt(random_target):
    from transformers import AutoTokenizer

    proc = run_ar("--target", random_target, "--prompt", "def add(a, b):", "--json", "--max-new-tokens", 12,
                   "--ignore-eos", "--dtype", "float32")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert set(report) == JSON_KEYS
    assert report["mode"] == "ar" and report["new_tokens"] == len(report["output_ids"]) == 12
    assert report["acceptance_lengths"] == [1] * 11 and report["tau"] == 1.0
    assert report["decode_seconds"] > 0 and report["tokens_per_second"] > 0
    tok = AutoTokenizer.from_pretrained(str(random_target))
    assert report["text"] == tok.decode(report["output_ids"], skip_special_tokens=True)


def test_streams_text_and_stops_at_eos(random_target, tmp_path):
    # Make EOS a token the model emits greedily, so the stop is exercised through the CLI.
    free = json.loads(run_ar("--target", random_target, "--prompt-ids", "5,6,7", "--json", "--ignore-eos",
                              "--max-new-tokens", 20, "--dtype", "float32").stdout)["output_ids"]
    eos = free[4]
    (tmp_path / "t").mkdir()
    for item in random_target.iterdir():
        (tmp_path / "t" / item.name).write_bytes(item.read_bytes())
    (tmp_path / "t" / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    report = json.loads(run_ar("--target", tmp_path / "t", "--prompt-ids", "5,6,7", "--json", "--max-new-tokens", 20,
                                "--dtype", "float32").stdout)
    assert report["output_ids"] == free[:free.index(eos) + 1]
    streamed = run_ar("--target", tmp_path / "t", "--prompt", "x = 1", "--max-new-tokens", 8)
    assert streamed.returncode == 0, streamed.stderr
    summary = streamed.stderr.strip().splitlines()[-1]
    assert SUMMARY.match(summary) and summary.startswith("[ar] 8 tokens, decode"), summary


def test_readme_command_prints_what_ar_prints(tmp_path):
    """The README's first command, as a new user runs it on a CPU (default dtype: float32 there), prints the
    same text as --mode ar (run in this process: `main`), and ends with the summary line of the demo pair's
    DDTree with `--budget auto` (the default): a new record, so it calibrated, and names the budget it ran."""
    readme = ("--prompt", "def fibonacci(n):")
    proc = run_process(*readme, env={"DDTREE_JAX_ROUND_COSTS": str(tmp_path)})  # a user's first run: no record
    assert proc.returncode == 0, proc.stderr
    assert "runs the demo pair" in proc.stderr
    summary = proc.stderr.strip().splitlines()[-1]
    assert SUMMARY.match(summary) and summary.startswith("[ddtree B=auto (") and "calibration" in summary, summary
    # A trained drafter: a random one accepts almost nothing (tau ~1); this pair measured 3.15 at 64 tokens.
    assert float(summary.split("tokens, ")[1].split(" tokens per round")[0]) >= 2.0
    ar = run_cli("--mode", "ar", *readme)
    assert ar.returncode == 0, ar.stderr
    assert ar.stderr.strip().splitlines()[-1].startswith("[ar] 64 tokens, decode")
    assert proc.stdout == ar.stdout
    assert "def" in proc.stdout or "return" in proc.stdout or '"""' in proc.stdout  # Python-like text


@pytest.mark.parametrize("args,message", [
    (["--prompt-ids", "1,x"], "--prompt-ids: expected comma-separated integers"),
    (["--prompt-ids", "1,99999"], "token id 99999 is outside the vocabulary"),
    (["--max-new-tokens", "0", "--prompt-ids", "1"], "--max-new-tokens: expected >= 1"),
    (["--top-p", "0", "--temperature", "1", "--prompt-ids", "1"], "--top-p: expected a number in (0, 1]"),
    (["--temperature", "-1", "--prompt-ids", "1"], "--temperature: expected >= 0"),
    (["--stream-every", "0", "--prompt-ids", "1"], "--stream-every: expected >= 1, got 0"),
    (["--stream-every", "-1", "--prompt-ids", "1"], "--stream-every: expected >= 1, got -1"),
    (["--chat", "--prompt", "hi"], "has no chat template (drop --chat)"),
    (["--budget", "big", "--prompt-ids", "1"], "--budget: expected an integer >= 1 or auto, got 'big'"),
    (["--prompt-ids", "1", "--max-new-tokens", "5000"],
     "1 prompt tokens + --max-new-tokens 5000 = 5001 tokens: beyond the target's max_position_embeddings 4096"),
])
def test_bad_input_exits_2_with_one_line(random_target, args, message):
    proc = run_ar("--target", random_target, *args)
    assert proc.returncode == 2
    assert proc.stderr.strip().startswith("error: ") and message in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr


def test_bad_input_from_the_command_line_exits_2_with_one_line(random_target):
    """The same through `python -m ddtree_jax.generate` (the process's exit status, its whole stderr: no warning
    or traceback beside the error line), for one case that reads the target's config."""
    proc = run_process("--mode", "ar", "--target", random_target, "--prompt-ids", "1,99999")
    assert proc.returncode == 2
    assert proc.stderr.strip().startswith("error: ") and "token id 99999 is outside the vocabulary" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr


@pytest.mark.parametrize("args,message", [
    (["--budget", "0"], "--budget: expected >= 1, got 0"),
    (["--budget", "auto", "--budget-candidates", "chain"], "--budget-candidates: expected at least two distinct budgets"),
    (["--budget", "auto", "--budget-candidates", "chain,x"], "--budget-candidates: expected a comma list of budgets"),
    (["--budget", "auto", "--budget-candidates=-4,16"], "--budget-candidates: expected at least two distinct"),
])
def test_bad_budget_flags_are_bad_input(args, message):
    """The flag checks `main` turns into one `error:` line and exit status 2 (as the case above shows)."""
    from ddtree_jax.cli import BadInput
    from ddtree_jax.generate import check_flags, parse_args

    with pytest.raises(BadInput, match="^" + re.escape(message)):
        check_flags(parse_args(args))


def test_long_requests_fail_in_seconds_before_allocating():
    """The issue's 10M new tokens on the demo pair: beyond its 4096 positions. With --allow-long-context, a
    billion (the cache alone would need terabytes): refused from the config shapes, before any weight or cache is
    allocated, in seconds (the bound is generous for a loaded CI machine). The first in this process (`main`), the
    second in its own (were its cache allocated, it would take the process down)."""
    proc = run_cli("--prompt", "def f():", "--max-new-tokens", 10_000_000)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (
        "error: 3 prompt tokens + --max-new-tokens 10000000 = 10000003 tokens: beyond the target's "
        f"max_position_embeddings 4096 ({demo_target() / 'config.json'}); ask for fewer tokens, or pass "
        "--allow-long-context to go past it")
    start = time.perf_counter()
    proc = run_process("--prompt", "def f():", "--max-new-tokens", 10**9, "--allow-long-context", timeout=120)
    assert time.perf_counter() - start < 60
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.strip().splitlines() if not line.startswith("note: ")]
    assert [line.split(":")[0] for line in lines] == ["warning", "error"]  # past the positions, then the memory
    assert "Traceback" not in proc.stderr
    assert re.match(r"error: 3 prompt tokens \+ --max-new-tokens 1000000000 = 1000000003 tokens need about "
                    r"[\d.]+ GiB \(KV cache [\d.]+ GiB.*\), but the device has [\d.]+ [GMK]iB \(available host "
                    r"memory\); ask for fewer tokens$", lines[-1]), lines[-1]


def test_output_paths_are_checked_before_work_and_written_with_normal_permissions(tmp_path, capsys):
    from ddtree_jax.generate import main

    (tmp_path / "file").write_text("x")
    for path, message in ((tmp_path, "is a folder (expected a file name)"),
                          (tmp_path / "file" / "trees.jsonl", f"{tmp_path / 'file'} is a file, not a folder"),
                          ("/proc/ddtree_jax/trees.jsonl", "cannot write in /proc")):
        assert main(["--save-trees", str(path)]) == 2
        assert capsys.readouterr().err.strip().splitlines()[-1].startswith(f"error: --save-trees {path}: {message}")
    trees = tmp_path / "new" / "trees.jsonl"
    assert main(["--save-trees", str(trees), "--max-new-tokens", "4", "--block-size", "32", "--budget", "63"]) == 0
    assert "warning: --block-size 32 is above the drafter's block_size 16" in capsys.readouterr().err
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(trees.stat().st_mode) == 0o666 & ~umask  # not mkstemp's 0600
    assert json.loads(trees.read_text().splitlines()[0])["round"] == 0


def test_transformers_torch_advisory_is_silenced(random_target):
    """With PyTorch absent (as in a plain install), transformers' 'PyTorch was not found' advisory stays quiet."""
    # Not inherited from this process (importing ddtree_jax.cli here sets it), so the CLI has to set it itself.
    env = {k: v for k, v in os.environ.items() if k != "TRANSFORMERS_NO_ADVISORY_WARNINGS"}
    code = ("import sys, runpy; sys.modules['torch'] = None; "
            "sys.argv = ['generate', '--target', sys.argv[1], '--mode', 'ar', '--chat', '--prompt', 'hi']; "
            "runpy.run_module('ddtree_jax.generate', run_name='__main__')")
    proc = subprocess.run([sys.executable, "-c", code, str(random_target)], capture_output=True, text=True,
                          timeout=300, env=env)
    assert "has no chat template" in proc.stderr  # it got as far as loading the tokenizer
    assert "PyTorch" not in proc.stderr, proc.stderr
    control = subprocess.run([sys.executable, "-c", "import sys; sys.modules['torch'] = None; import transformers"],
                             capture_output=True, text=True, timeout=300, env=env)
    assert "PyTorch was not found" in control.stderr  # what the advisory looks like where nothing silences it


def test_prompt_without_tokenizer_is_refused(tmp_path):
    from ddtree_jax.random_checkpoint import write_random_qwen3

    folder = write_random_qwen3(tmp_path / "t", with_tokenizer=False)
    proc = run_ar("--target", folder, "--prompt", "hi")
    assert proc.returncode == 2
    assert "has no tokenizer.json or tokenizer_config.json, so prompts must be token ids (--prompt-ids" in proc.stderr
    ok = run_ar("--target", folder, "--prompt-ids", "1,2", "--json", "--max-new-tokens", 3)
    assert ok.returncode == 0 and "text" not in json.loads(ok.stdout)


def test_dflash_mode_reports_rounds_and_matches_ar(tmp_path):
    from pairs import write_signal_pair

    target, drafter = write_signal_pair(tmp_path)
    common = ["--target", target, "--prompt-ids", "1,2,3", "--json", "--max-new-tokens", 21, "--dtype", "float32"]
    ar = json.loads(run_ar(*common).stdout)
    proc = run_cli(*common, "--mode", "dflash", "--drafter", drafter)
    assert proc.returncode == 0, proc.stderr
    spec = json.loads(proc.stdout)
    assert spec["mode"] == "dflash" and spec["output_ids"] == ar["output_ids"]
    assert spec["acceptance_lengths"] == [4] * 5 and spec["tau"] == 4.0
    two = json.loads(run_cli(*common, "--mode", "dflash", "--drafter", drafter, "--block-size", 2).stdout)
    assert two["acceptance_lengths"] == [2] * 10 and two["output_ids"] == ar["output_ids"]
    missing = run_cli(*common, "--mode", "dflash")
    assert missing.returncode == 2 and "--mode dflash needs --drafter DIR (or --mode ar)" in missing.stderr


def test_ddtree_mode_json_and_saved_trees(tmp_path):
    from pairs import X, write_signal_pair

    target, drafter = write_signal_pair(tmp_path)
    trees = tmp_path / "out" / "trees.jsonl"
    proc = run_cli("--target", target, "--drafter", drafter, "--prompt-ids", "1,2,3", "--json", "--max-new-tokens", 13,
                   "--dtype", "float32", "--budget", 5, "--save-trees", trees)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["mode"] == "ddtree" and report["budget"] == 5 and report["block_size"] == 4
    assert report["acceptance_lengths"] == [4, 4, 4] and report["acceptance_histogram"] == [0, 0, 0, 3]
    rows = [json.loads(line) for line in trees.read_text().splitlines()]
    assert [r["round"] for r in rows] == [0, 1, 2] and [r["start"] for r in rows] == [3, 7, 11]
    for r in rows:
        assert len(r["tokens"]) == 6 and [r["tokens"][i] for i in r["accepted"][1:]] == [X, X, X]
        assert r["depths"][0] == 0 and r["parents"][0] == 0 and all(p < i for i, p in enumerate(r["parents"]) if i)
        assert [r["depths"][i] for i in r["accepted"]] == [0, 1, 2, 3]
    bad = run_ar("--target", target, "--prompt-ids", "1", "--save-trees", trees)
    assert bad.returncode == 2 and "--save-trees: needs --mode ddtree, dflash or mtp" in bad.stderr


def test_auto_budget_json_and_saved_trees_record_the_budget_of_every_round(tmp_path):
    """--budget auto on the signal pair (a confident drafter: the tree of 5 accepts as much as the chain, 4 tokens
    a round, whichever it takes): per round it calibrates into the cost cache, reports the candidates, costs and the
    budget of each round, and saves it with each tree; per call (the default) it calibrates both candidates (an
    empty record), runs one and reports the record it keeps."""
    from pairs import write_signal_pair

    target, drafter = write_signal_pair(tmp_path)
    trees, cache = tmp_path / "trees.jsonl", tmp_path / "costs"
    args = ["--target", target, "--drafter", drafter, "--prompt-ids", "1,2,3", "--json", "--max-new-tokens", 13,
            "--dtype", "float32", "--budget", "auto", "--budget-candidates", "chain,5", "--save-trees", trees]
    proc = run_cli(*args, env={"DDTREE_JAX_ROUND_COSTS": str(tmp_path / "records")})
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["auto_scope"] == "call" and "round_costs_s" not in report and report["calibration_seconds"] > 0
    assert "; --budget auto calibration " in proc.stderr.splitlines()[-1]
    [chosen] = set(report["budgets_chosen"])
    assert chosen in (0, 5) and len(report["budgets_chosen"]) == 3
    assert report["auto_record"] == {"scope": "call", "calls": [1, 1], "tokens": [13.0, 13.0], "paired": 1,
                                     "seconds": report["auto_record"]["seconds"]}
    assert [json.loads(line)["budget"] for line in trees.read_text().splitlines()] == [chosen] * 3
    proc = run_cli(*args, "--auto-scope", "round", env={"DDTREE_JAX_ROUND_COSTS": str(cache)})
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["budget"] == "auto" and report["budget_candidates"] == [0, 5] and report["auto_scope"] == "round"
    assert len(report["round_costs_s"]) == 2 and report["calibration_seconds"] > 0 and len(list(cache.iterdir())) == 1
    assert report["acceptance_lengths"] == [4, 4, 4] and len(report["budgets_chosen"]) == 3
    assert set(report["budgets_chosen"]) <= {0, 5}
    rows = [json.loads(line) for line in trees.read_text().splitlines()]
    assert [r["budget"] for r in rows] == report["budgets_chosen"]
    assert [len(r["tokens"]) for r in rows] == [6 if b else 4 for b in report["budgets_chosen"]]


def test_mtp_mode_json_and_one_error_without_a_head(tmp_path, random_target):
    """--mode mtp drafts with the target's own head (a random hybrid in the published layout); a target
    without one, or a --drafter beside it, is one error line before any weight is read."""
    from ddtree_jax.random_checkpoint import write_random_qwen3_5

    folder = write_random_qwen3_5(tmp_path / "t", seed=3, published=True, mtp_layers=1, with_tokenizer=True)
    proc = run_cli("--target", folder, "--mode", "mtp", "--mtp-steps", 2, "--prompt-ids", "1,2,3", "--json",
                   "--max-new-tokens", 8, "--dtype", "float32")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert set(report) == JSON_KEYS | {"block_size", "acceptance_histogram", "mtp_steps"}
    assert (report["mode"], report["mtp_steps"], report["block_size"], report["new_tokens"]) == ("mtp", 2, 3, 8)
    assert sum(report["acceptance_histogram"]) == len(report["acceptance_lengths"])
    assert SUMMARY.match(proc.stderr.strip().splitlines()[-1]), proc.stderr
    for args, message in [((random_target,), "a qwen3 target has no multi-token-prediction head"),
                          ((folder, "--drafter", folder), "--drafter: not used by --mode mtp")]:
        bad = run_cli("--target", *args, "--mode", "mtp", "--prompt-ids", "1")
        assert bad.returncode == 2 and message in bad.stderr, bad.stderr
        assert len(bad.stderr.strip().splitlines()) == 1 and "Traceback" not in bad.stderr


def test_row_invariant_without_the_pallas_kernels_is_one_error_line(capsys, monkeypatch):
    """--row-invariant needs the Pallas kernels and no tensor parallelism: where --kernels resolves to jax (a CPU),
    or with --devices 2 (tp), one error line, exit 2, before any checkpoint is read."""
    from ddtree_jax.generate import main
    from pallas_kernels import ENV_VAR

    monkeypatch.delenv(ENV_VAR, raising=False)
    assert main(["--row-invariant", "--kernels", "jax", "--target", "/nonexistent"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "error: --row-invariant: needs the Pallas kernels (--kernels pallas); --kernels jax means jax here"]
    assert main(["--row-invariant", "--kernels", "pallas", "--devices", "2", "--target", "/nonexistent"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "error: --row-invariant: one device or --parallel dp (its matmuls are not split over devices)"]
