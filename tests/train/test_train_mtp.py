"""MTP head training (`train/mtp.py`): literal labels and weights, training rows equal to what inference
builds, and a short run on a tiny dense target whose export loads and decodes exactly as AR."""

from __future__ import annotations

import dataclasses
import functools
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ddtree_jax.checkpoint import load_mtp, load_target
from ddtree_jax.config import mtp_config
from ddtree_jax.engine import DecodeOptions, Mode, generate
from ddtree_jax.models import mtp, qwen3
from ddtree_jax.random_checkpoint import write_random_qwen3
from ddtree_jax.train import mtp as T
from ddtree_jax.train.drafter import Sequences

TINY = dict(vocab_size=48, hidden_size=32, intermediate_size=48, head_dim=16, num_attention_heads=4,
            num_key_value_heads=2, eos_token_id=None, bos_token_id=None)


def test_chain_labels_literal():
    """chain 3, x = 10..15 (length 6): anchor 2 -> labels [14 15 -] (weights 1, d, 0: x_6 is past the end);
    anchor 1 -> [13 14 15]; an anchor that is not ok weighs nothing; the chain's inputs are labels[:, :-1]."""
    d = 0.5
    tokens = jnp.arange(10, 16)[None, :].astype(jnp.int32)
    labels, weights = T.chain_labels(tokens, jnp.array([6]), jnp.array([[2, 1, 0]]), jnp.array([[True, True, False]]),
                                     chain=3, decay=d)
    np.testing.assert_array_equal(labels, [[14, 15, 0], [13, 14, 15], [12, 13, 14]])
    np.testing.assert_allclose(weights, [[1, d, 0], [1, d, d * d], [0, 0, 0]], rtol=1e-6)


def test_anchors_start_at_the_first_round():
    """A prompt of P tokens: the first round's last committed slot is P - 1; step 1's label x_{a+2} must exist."""
    rows = Sequences(np.zeros((2, 12), np.int32), np.array([4, 9]), np.array([12, 12]))
    anchors, ok = T.sample_anchors(jax.random.key(0), jax.tree.map(jnp.asarray, rows), 3)
    anchors, ok = np.asarray(anchors), np.asarray(ok)
    assert ok[0].all() and ((anchors[0] >= 3) & (anchors[0] <= 9)).all()
    assert sorted(anchors[1][ok[1]].tolist()) == [8, 9] and ok[1].sum() == 2  # only 8, 9 in [9 - 1, 12 - 3]


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory):
    return write_random_qwen3(tmp_path_factory.mktemp("mtp_train") / "target", seed=3, with_tokenizer=False,
                              std=0.3, **TINY)


@functools.partial(jax.jit, static_argnames="chain")
def inference_chain(head, target, tokens, hidden, a, chain_tokens, chain: int):
    """What a round computes after a committed prefix whose last slot is `a`: `mtp.ingest` of tokens 1 .. a + 1
    with the target's hidden states 0 .. a (a [1] int; the rest of the row is padding) into an empty cache, as
    prefill does; then step 1's logits from the kept output, and `draft_logits` with `chain_tokens` [1, chain - 1]
    and with the head's own argmaxes. Returns (step 1 [1, v], teacher-forced [1, chain, v], own [1, chain, v],
    argmax-fed [1, chain, v])."""
    w = tokens.shape[1]
    cache = mtp.ingest(head, target, jnp.roll(tokens, -1, axis=1), hidden, a + 1,
                       mtp.create_cache(head.config, 1, w + chain, jnp.float32))
    own = mtp.draft_logits(head, target, cache, chain)
    fed = mtp.draft_logits(head, target, cache, chain, tokens=jnp.argmax(own, -1)[:, :-1].astype(jnp.int32))
    return (qwen3.logits(target, cache.hidden), mtp.draft_logits(head, target, cache, chain, tokens=chain_tokens),
            own, fed)


def test_training_rows_are_what_inference_builds(tiny_target):
    """Row (sequence, a) of a training batch: its step-1 logits are the lm_head of what `mtp.ingest` keeps after
    the prefix, and its chain is `draft_logits` on that cache with the true tokens; fed the head's own argmaxes
    as tokens, `draft_logits` is the round's chain (no tokens given)."""
    target = load_target(tiny_target, jnp.float32)
    config = mtp_config(dataclasses.replace(target.config, mtp_num_hidden_layers=1))
    rng = np.random.default_rng(0)
    head = mtp.init_random(config, jnp.float32, seed=1)
    head = head.replace_flat({n: a + 0.05 * rng.standard_normal(a.shape).astype(np.float32)
                              for n, a in head.flat().items()})  # non-zero norms too
    tokens = jnp.asarray(rng.integers(0, 48, (2, 14)), jnp.int32)
    rows = Sequences(tokens, jnp.array([3, 5]), jnp.array([14, 11]))
    anchors = jnp.array([[2, 9], [4, 7]])
    hidden = jax.jit(T.target_hidden)(target, rows.tokens, rows.lengths)
    loss = jax.jit(functools.partial(T.rows_loss, chain=3, decay=0.8, dtype=jnp.float32))
    _, (logits, labels, weights) = loss(head, target, hidden, rows, anchors, jnp.ones((2, 2), bool))
    for r, (i, a) in enumerate([(0, 2), (0, 9), (1, 4), (1, 7)]):
        chain = tokens[i:i + 1, a + 2:a + 4]
        first, forced, own, fed = inference_chain(head, target, tokens[i:i + 1], hidden[i:i + 1], jnp.array([a]),
                                                  chain, chain=3)
        np.testing.assert_allclose(logits[r, 0], first[0], rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(logits[r], forced[0], rtol=1e-5, atol=1e-5)
        assert labels[r].tolist()[:2] == chain[0].tolist()
        np.testing.assert_array_equal(fed, own)
    np.testing.assert_allclose(weights[1], [1.0, 0.8, 0.64], rtol=1e-6)


def test_training_end_to_end(tiny_target, tmp_path):
    """30 steps on target-generated continuations: the loss falls; the export (a linked copy of the target with
    the head beside it) loads, its target is the original, and greedy `--mode mtp` on it equals AR."""
    out = tmp_path / "with_head"
    cfg = T.MTPTrainConfig(target=tiny_target, out=out, random_prompts=True, sequences=40, prompt_len=6, gen_len=24,
                           gen_batch=40, steps=30, batch=8, anchors=8, lr=3e-3, warmup=5, dtype="float32",
                           eval_every=1000, eval_decode=0, check_prompts=0, log_every=1, save_every=1000,
                           held_out=0.1)
    summary = T.train_mtp(cfg)
    log = json.loads((tmp_path / "with_head.train" / "log.json").read_text())
    losses = [h["loss"] for h in log["history"]]
    assert len(losses) == 30 and all(math.isfinite(x) for x in losses)
    assert np.mean(losses[-5:]) < 0.7 * np.mean(losses[:5]), losses
    assert (tmp_path / "with_head.train" / "loss.png").exists() and summary["steps"] == 30

    original = load_target(tiny_target, jnp.float32)
    target = load_target(out, jnp.float32)
    assert all(np.array_equal(np.asarray(a), np.asarray(original.flat()[n])) for n, a in target.flat().items())
    head = load_mtp(out, target.config, jnp.float32)
    assert head.config.num_layers == 1
    prompts = [[5, 9, 2, 7, 1, 3, 3, 8, 4], [11, 6]]
    ar = generate(target, prompts, DecodeOptions(max_new_tokens=24)).output_ids
    spec = generate(target, prompts, DecodeOptions(mode=Mode.MTP, max_new_tokens=24, mtp_steps=3), drafter=head)
    assert spec.output_ids == ar
    assert spec.tau > 1.2, spec.acceptance_lengths  # trained: drafts are accepted


def test_bad_settings_are_one_error_line(tiny_target, tmp_path, capsys):
    code = T.main(["--target", str(tiny_target), "--out", str(tmp_path / "o"), "--step-decay", "0"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err == ["error: --step-decay: expected a number in (0, 1], got 0.0"]
