"""Drafter training at scale, end to end at tiny scale: extraction (interrupted and resumed, one device and
two) -> training from the shards on two devices -> export -> the doctor, and the shard stream on its own."""

from __future__ import annotations

import contextlib
import io
import json

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from ddtree_jax.train import drafter, extract, features

# 4 shards of 12 sequences of 8 + 24 tokens from random prompts. The target has 4 layers; the tap is the last
# one, so the doctor has one shifted wiring to try, not two (one compile less).
EXTRACT = ["--random-prompts", "--sequences", "48", "--prompt-len", "8", "--gen-len", "24", "--batch", "8",
           "--shard-sequences", "12", "--target-layer-ids", "3", "--dtype", "float32"]
TRAIN = ["--layers", "1", "--block-size", "4", "--intermediate", "64", "--batch", "8", "--anchors", "8", "--lr", "1e-2",
         "--warmup", "5", "--dtype", "float32", "--export-dtype", "float32", "--check-prompts", "0", "--log-every", "10",
         "--shuffle-shards", "2"]
EVAL_PROMPTS = ["def f(x):", "import os\n", "class Point:", "    return "]


def run_main(main, args) -> tuple[int, str]:
    """(exit status, stderr) of an entry point run in this process."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        rc = main([str(a) for a in args])
    return rc, err.getvalue()


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("error:")]


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    from ddtree_jax.random_checkpoint import write_random_qwen3

    # The vocabulary is the byte tokenizer's own (258), so the doctor has no extra mask row to try (one compile less).
    return write_random_qwen3(tmp_path_factory.mktemp("features_target") / "target", seed=1, num_hidden_layers=4,
                              vocab_size=258)


@pytest.fixture(scope="module")
def extracted(target, tmp_path_factory):
    """`whole`: one uninterrupted run on one device. `resumed`: a run stopped after one shard (plus a shard
    left half-written under its temporary name, as a kill leaves it), then finished on two devices."""
    root = tmp_path_factory.mktemp("features")
    whole, resumed = root / "whole", root / "resumed"
    assert run_main(extract.main, ["--target", target, "--out", whole, *EXTRACT])[0] == 0
    assert run_main(extract.main, ["--target", target, "--out", resumed, *EXTRACT, "--max-new-shards", "1"])[0] == 0
    first = (resumed / features.shard_name(0)).stat()
    (resumed / f".{features.shard_name(1)}.12345.tmp").write_bytes(b"half a shard")
    incomplete = run_main(drafter.main, ["--features", resumed, "--out", root / "never", *TRAIN])
    rc, log = run_main(extract.main, ["--target", target, "--out", resumed, *EXTRACT, "--devices", "2"])
    assert rc == 0, log
    return {"whole": whole, "resumed": resumed, "first_stat": first, "incomplete": incomplete, "resume_log": log}


def test_manifest_and_shards(extracted, target):
    from ddtree_jax.checkpoint import load_target
    from ddtree_jax.models import qwen3
    from ddtree_jax.models.contract import ForwardMeta

    manifest = json.loads((extracted["whole"] / features.MANIFEST).read_text())
    assert manifest["num_shards"] == 4 and [e["sequences"] for e in manifest["shards"]] == [12] * 4
    assert manifest["target_layer_ids"] == [3] and manifest["tap_width"] == 64 and manifest["sequence_width"] == 32
    assert manifest["arrays"]["taps"] == ["bfloat16", ["n", 32, 64]]
    shard = features.open_features(extracted["whole"]).load(3)
    assert shard["taps"].dtype == ml_dtypes.bfloat16 and shard["taps"].shape == (12, 32, 64)
    assert manifest["shards"][3]["tokens"] == int(shard["lengths"].sum()) == 12 * 32
    assert manifest["shards"][3]["generated_tokens"] == 12 * 24 and (shard["starts"] == 8).all()
    # Row 5 of shard 3 (sequence 41), against the target run on that row alone: the taps are the output of
    # layer 3 at every position, and the continuation is the target's greedy one.
    params = load_target(target, jnp.float32)

    @jax.jit
    def run(params, tokens):
        out = qwen3.forward(params, tokens, ForwardMeta.prompt(jnp.array([32]), 32),
                            qwen3.create_cache(params.config, 1, 32, jnp.float32), tap_layers=(2, 3))
        return out.taps[0], qwen3.logits(params, out.hidden)[0]

    taps, logits = run(params, jnp.asarray(shard["tokens"][5:6]))  # taps [32, 2 * 64]: layers 2 and 3
    stored = shard["taps"][5].astype(np.float32)
    np.testing.assert_allclose(stored, np.asarray(taps[:, 64:]), rtol=1e-2, atol=1e-3)
    np.testing.assert_array_equal(shard["tokens"][5, 8:], np.argmax(np.asarray(logits), -1)[7:31])
    assert not np.allclose(stored, np.asarray(taps[:, :64]), rtol=1e-2, atol=1e-3)  # another layer's output differs


def test_resume_finishes_what_an_uninterrupted_run_writes(extracted):
    whole, resumed = extracted["whole"], extracted["resumed"]
    assert "removed 1 partial shard(s)" in extracted["resume_log"]
    assert not list(resumed.glob(".*.tmp"))
    after = (resumed / features.shard_name(0)).stat()
    assert (after.st_ino, after.st_mtime_ns) == (extracted["first_stat"].st_ino, extracted["first_stat"].st_mtime_ns)
    a, b = features.open_features(whole), features.open_features(resumed)
    assert a.manifest["target"]["fingerprint"] == b.manifest["target"]["fingerprint"]
    for i in range(4):  # shard 0 on one device, 1-3 on two: the same sequences and taps
        x, y = a.load(i), b.load(i)
        for k in ("tokens", "starts", "lengths"):
            np.testing.assert_array_equal(x[k], y[k])
        np.testing.assert_allclose(x["taps"].astype(np.float32), y["taps"].astype(np.float32), rtol=1e-2, atol=1e-6)


def test_incomplete_or_mismatched_extractions_are_refused(extracted, target):
    rc, err = extracted["incomplete"]
    assert rc == 2 and len(error_lines(err)) == 1 and "incomplete (1 of 4 shards written)" in err
    before = (extracted["whole"] / features.MANIFEST).read_bytes()
    longer = ["25" if a == "24" else a for a in EXTRACT]  # --gen-len 25
    rc, err = run_main(extract.main, ["--target", target, "--out", extracted["whole"], *longer])
    assert rc == 2 and "gen_len = 24, this run has 25" in error_lines(err)[0]
    assert (extracted["whole"] / features.MANIFEST).read_bytes() == before


def test_sizes_printed():
    assert [extract.human_bytes(n) for n in (999, 51_100, 353.2e6, 24.2e9, 1.5e12)] == [
        "999 B", "51.1 KB", "353.2 MB", "24.2 GB", "1500.0 GB"]
    assert extract.sequence_bytes(320, 768) == 492_808  # the demo plan's: bf16 taps [320, 768], int32 tokens, 2 int32s


def test_bad_prompt_file_is_refused_before_any_work(target, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "def f():"}\n{"text": "no prompt key"}\n')
    rc, err = run_main(extract.main, ["--target", target, "--out", tmp_path / "out", "--prompts", prompts])
    assert rc == 2 and error_lines(err) == [f"error: {prompts}:2: expected a JSON object with one of 'prompt', "
                                            "'messages' or 'prompt_ids'"]
    assert not (tmp_path / "out").exists()


def test_fingerprint(target, tmp_path):
    from ddtree_jax.checkpoint import load_target
    from ddtree_jax.config import read_config_json
    from ddtree_jax.random_checkpoint import write_random_qwen3

    raw = read_config_json(target)
    f32, bf16 = (features.fingerprint(load_target(target, dt), raw) for dt in (jnp.float32, jnp.bfloat16))
    assert f32 == bf16  # the compute dtype does not matter
    other = write_random_qwen3(tmp_path / "other", seed=2, num_hidden_layers=4, vocab_size=258)  # other weights
    assert features.fingerprint(load_target(other, jnp.float32), read_config_json(other)) != f32


# ----------------------------------------------------------------------------------------------------
# Training from the shards


@pytest.fixture(scope="module")
def trained(extracted, target, tmp_path_factory):
    """40 steps on 2 devices with an evaluation every 20 (held-out loss and DFlash decoding of 4 prompts),
    and the first 4 of the same steps on one device."""
    root = tmp_path_factory.mktemp("train_features")
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in EVAL_PROMPTS))
    two, one = root / "two", root / "one"
    rc, err = run_main(drafter.main, ["--features", extracted["whole"], "--out", two, *TRAIN, "--devices", "2",
                                      "--steps", "40", "--eval-every", "20", "--eval-prompts", prompts,
                                      "--eval-decode", "4", "--eval-new-tokens", "16"])
    assert rc == 0, err
    rc, err1 = run_main(drafter.main, ["--features", extracted["whole"], "--out", one, *TRAIN, "--steps", "4",
                                       "--eval-sequences", "0", "--eval-decode", "0"])
    assert rc == 0, err1
    logs = {name: json.loads((root / f"{name}.train" / "log.json").read_text()) for name in ("two", "one")}
    return {"two": two, "prompts": prompts, "logs": logs, "stderr": err}


def test_two_devices_train_as_one(trained):
    two, one = trained["logs"]["two"]["history"], trained["logs"]["one"]["history"]
    assert len(two) == 40 and len(one) == 4
    for key in ("loss", "grad_norm"):
        np.testing.assert_allclose([h[key] for h in two[:4]], [h[key] for h in one], rtol=1e-4)
    assert len({round(h["loss"], 4) for h in one}) == 4  # the steps change the loss: the equality is not vacuous
    assert np.mean([h["loss"] for h in two[-5:]]) < 0.8 * np.mean([h["loss"] for h in two[:3]])


def test_acceptance_per_position_is_logged_and_plotted(trained):
    log = trained["logs"]["two"]
    evals = log["eval"]
    assert [e["step"] for e in evals] == [20, 40]
    for e in evals:
        assert len(e["position_acceptance"]) == 3 and 1.0 <= e["tau"] <= 4.0 and "loss" in e
    assert "position_acceptance [" in trained["stderr"]  # in the log lines
    png = (trained["two"].parent / "two.train" / "acceptance.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    assert "features" in log["meta"]["prompt_source"]


def test_the_doctor_prints_the_same_table(trained, target, capsys):
    from ddtree_jax import doctor

    log = trained["logs"]["two"]
    chosen = next(e for e in log["eval"] if e["step"] == log["meta"]["best_step"])
    assert max(chosen["position_acceptance"]) > 0  # something was learnt: the table is not all zeros
    rc = doctor.main(["--target", str(target), "--drafter", str(trained["two"]), "--prompts", str(trained["prompts"]),
                      "--num-prompts", "4", "--max-new-tokens", "16", "--dtype", "float32"])
    out = capsys.readouterr().out
    assert rc in (0, 1) and "greedy DFlash == AR: yes" in out
    table = out.split("acceptance per draft position:\n")[1].splitlines()[:3]
    assert table == doctor.acceptance_table(chosen["position_acceptance"])
    assert f"tau (tokens per round, bonus included): {chosen['tau']:.2f}" in out
    assert "\n".join(table) in trained["stderr"]  # the trainer printed it too


def test_features_of_another_target_are_refused(extracted, tmp_path):
    from ddtree_jax.random_checkpoint import write_random_qwen3

    other = write_random_qwen3(tmp_path / "other", seed=2, num_hidden_layers=4, vocab_size=258)
    rc, err = run_main(drafter.main, ["--features", extracted["whole"], "--target", other, "--out", tmp_path / "d",
                                      *TRAIN, "--steps", "1"])
    assert rc == 2 and len(error_lines(err)) == 1 and "fingerprint" in err
    assert not (tmp_path / "d").exists()


# ----------------------------------------------------------------------------------------------------
# The shard stream


@pytest.fixture(scope="module")
def numbered_shards(tmp_path_factory):
    """5 shards of 7 rows whose tokens say where they are: row r of shard s holds 100 * s + r (taps 10 * s + r)."""
    folder = tmp_path_factory.mktemp("numbered")
    entries = []
    for s in range(5):
        ids = 100 * s + np.arange(7)
        tokens = np.repeat(ids[:, None], 3, axis=1)
        taps = np.repeat((tokens % 100 + 10 * s)[..., None], 2, axis=2).astype(np.float32)  # exact in bf16
        entries.append(features.write_shard(folder, s, tokens, np.ones(7, np.int32), np.full(7, 3, np.int32), taps))
    features.write_json_atomic(folder / features.MANIFEST, {
        "format": features.FORMAT, "target": {"fingerprint": "x", "path": "x"}, "target_layer_ids": [0],
        "sequence_width": 3, "tap_width": 2, "num_shards": 5, "shards": entries})
    return features.open_features(folder)


def test_stream_visits_every_row_once_per_epoch_in_shuffled_windows(numbered_shards):
    stream = features.ShardStream(numbered_shards, [0, 1, 2, 3, 4], batch=4, window=2, seed=0)
    assert stream.batches_per_epoch == 8  # 35 rows: 8 batches of 4, 3 rows left over each epoch
    epoch = [stream.batch_at(i) for i in range(8)]
    ids = np.concatenate([b["tokens"][:, 0] for b in epoch])
    assert len(set(ids.tolist())) == 32 and set(ids.tolist()) <= {100 * s + r for s in range(5) for r in range(7)}
    assert not (np.diff(ids) > 0).all()  # shuffled
    for b in epoch:  # every field of a row comes from the same row
        np.testing.assert_array_equal(b["taps"][:, :, 0].astype(np.int32), b["tokens"] % 100 + b["tokens"] // 100 * 10)
    # The first 14 rows come from the first window: two shards, mixed.
    first = {int(i) // 100 for i in ids[:14]}
    assert len(first) == 2 and all(len({int(i) // 100 for i in b["tokens"][:, 0]}) <= 2 for b in epoch[:3])
    assert stream.max_loaded <= 6  # the windows a batch overlaps (at most 2) and the next one
    nxt = np.concatenate([stream.batch_at(8 + i)["tokens"][:, 0] for i in range(8)])
    assert not np.array_equal(nxt, ids)  # another order in the next epoch
    # A new stream (a resumed run) gives the same batch for the same step.
    again = features.ShardStream(numbered_shards, [0, 1, 2, 3, 4], batch=4, window=2, seed=0)
    np.testing.assert_array_equal(again.batch_at(11)["tokens"], stream.batch_at(11)["tokens"])
    stream.close()
    again.close()
    with pytest.raises(features.FeaturesError, match="batch 40 is larger than the 35"):
        features.ShardStream(numbered_shards, [0, 1, 2, 3, 4], batch=40, window=2, seed=0)


def test_shard_taps_are_zero_past_each_rows_length(tmp_path):
    tokens = np.array([[5, 6, 7], [8, 9, 0]], np.int32)  # the second row has 2 tokens
    taps = np.full((2, 3, 2), 1.5, np.float32)
    entry = features.write_shard(tmp_path, 0, tokens, np.array([1, 1]), np.array([3, 2]), taps)
    assert entry == {"file": "shard-00000.safetensors", "sequences": 2, "tokens": 5, "generated_tokens": 3,
                     "bytes": (tmp_path / "shard-00000.safetensors").stat().st_size}
    from safetensors.numpy import load_file

    stored = load_file(str(tmp_path / "shard-00000.safetensors"))["taps"].astype(np.float32)
    np.testing.assert_array_equal(stored[:, :, 0], [[1.5, 1.5, 1.5], [1.5, 1.5, 0.0]])
    assert not list(tmp_path.glob(".*"))  # no temporary file left
