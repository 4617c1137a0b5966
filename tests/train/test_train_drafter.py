"""DFlash drafter training: the recipe's labels and weights, training == inference, and a short run."""

from __future__ import annotations

import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ddtree_jax.config import check_pair, parse_dflash
from ddtree_jax.models import dflash
from ddtree_jax.train import drafter as D

MASK = 99


# ----------------------------------------------------------------------------------------------------
# Recipe facts


@pytest.mark.parametrize("layers, taps, expected", [
    (36, 5, [1, 9, 17, 25, 33]),   # Qwen3-4B/8B-DFlash-b16
    (64, 5, [1, 16, 31, 46, 61]),  # Qwen3.6-27B-DFlash
    (32, 5, [1, 8, 15, 22, 29]),   # Qwen3.5-4B-DFlash
    (40, 5, [1, 10, 19, 28, 37]),  # Qwen3.5-35B-A3B-DFlash
    (6, 3, [1, 2, 3]),
    (4, 1, [2]),
    (3, 2, [0, 2]),
])
def test_target_layer_ids_as_published(layers, taps, expected):
    assert D.build_target_layer_ids(layers, taps) == expected


def test_default_taps_and_gamma():
    assert [D.default_num_taps(n) for n in (2, 4, 6, 8, 36)] == [1, 1, 3, 5, 5]
    assert D.loss_gamma(16) == 7.0 and D.loss_gamma(8) == 3.5
    w = D.position_weights(16, 7.0)
    assert w.shape == (15,) and w[0] == 1.0
    np.testing.assert_allclose(w, [math.exp(-(k - 1) / 7) for k in range(1, 16)], rtol=1e-6)


def test_blocks_labels_weights_literal():
    """bs 4, x = 10..17 (length 8): anchor 2 -> block [12 M M M], labels [13 14 15]; anchor 6 -> labels
    [17, -, -] (past the end: weight 0); a row whose anchor is not ok weighs nothing."""
    g = 2.0
    tokens = jnp.arange(10, 18)[None, :].astype(jnp.int32)
    block, labels, weights = D.block_inputs(tokens, jnp.array([8]), jnp.array([[2, 6, 3]]),
                                            jnp.array([[True, True, False]]), block_size=4, mask_token_id=MASK,
                                            gamma=g)
    np.testing.assert_array_equal(block, [[12, MASK, MASK, MASK], [16, MASK, MASK, MASK], [13, MASK, MASK, MASK]])
    np.testing.assert_array_equal(labels, [[13, 14, 15], [17, 0, 0], [14, 15, 16]])
    e1, e2 = math.exp(-1 / g), math.exp(-2 / g)
    np.testing.assert_allclose(weights, [[1, e1, e2], [1, 0, 0], [0, 0, 0]], rtol=1e-6)


def test_anchors_stay_among_generated_tokens():
    starts, lengths = jnp.array([3, 5, 0]), jnp.array([12, 9, 12])
    anchors, ok = D.sample_anchors(jax.random.key(0), starts, lengths, 12, 4)
    anchors, ok = np.asarray(anchors), np.asarray(ok)
    for r in range(3):
        good = anchors[r][ok[r]]
        assert len(set(good)) == len(good)
        assert ((good >= int(starts[r])) & (good <= int(lengths[r]) - 2)).all()
    assert ok[0].all() and ok[2].all() and ok[1].sum() == 3  # row 1 has only anchors 5, 6, 7


def test_config_dict_is_the_published_layout(random_target):
    from ddtree_jax.config import load_target_config

    target = load_target_config(random_target)
    raw = D.drafter_config_dict(target, num_layers=2, block_size=8, mask_token_id=257, target_layer_ids=[0, 1])
    assert raw["architectures"] == ["DFlashDraftModel"] and raw["block_size"] == 8
    assert raw["dflash_config"] == {"mask_token_id": 257, "target_layer_ids": [0, 1]}
    assert raw["num_target_layers"] == target.num_layers and raw["layer_types"] == ["full_attention"] * 2
    config = parse_dflash(raw)
    check_pair(target, config)
    assert config.hidden_size == target.hidden_size and config.vocab_size == target.vocab_size


# ----------------------------------------------------------------------------------------------------
# Training computes exactly what inference computes


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """A random 4-layer target (no tokenizer), greedy data from it, and a random drafter with a causal
    sliding-window layer and a full layer, two taps, block 4."""
    from ddtree_jax.checkpoint import load_target
    from ddtree_jax.random_checkpoint import write_random_qwen3

    folder = write_random_qwen3(tmp_path_factory.mktemp("pair") / "target", seed=3, with_tokenizer=False,
                                num_hidden_layers=4, std=0.1)
    target = load_target(folder, jnp.float32)
    raw = D.drafter_config_dict(target.config, num_layers=2, block_size=4, mask_token_id=target.config.vocab_size - 1,
                                target_layer_ids=[1, 3], intermediate_size=48, dtype="float32")
    raw.update(layer_types=["sliding_attention", "full_attention"], use_sliding_window=True, sliding_window=6)
    config = parse_dflash(raw)
    drafter = dflash.init_random(config, target.config.hidden_size, jnp.float32, seed=5)
    # Bigger weights than the 0.02 init, so the drafter's logits differ visibly between contexts.
    drafter = drafter.replace_flat({n: a * (1.0 if "norm" in n else 4.0) for n, a in drafter.flat().items()})
    prompts = D.random_prompts(target.config.vocab_size, 2, 5, seed=0, exclude=(config.mask_token_id,))
    data = D.generate_sequences(target, prompts, 12, batch=2)
    return folder, target, drafter, data


def test_training_loss_equals_inference_cross_entropy(pair):
    from ddtree_jax.engine import DecodeOptions, Mode, prefill

    _, target, drafter, data = pair
    config = drafter.config
    bs, gamma = config.block_size, 1.5
    tokens, lengths = jnp.asarray(data.tokens), jnp.asarray(data.lengths)
    assert tokens.shape == (2, 17)
    anchors = jnp.array([[5, 9], [6, 15]])  # 15: only slot 1 is inside the sequence
    ok = jnp.ones_like(anchors, bool)
    taps = jax.jit(D.target_taps, static_argnums=3)(target, tokens, lengths, config.target_layer_ids)
    rows_loss = jax.jit(D.rows_loss, static_argnames=("gamma", "dtype"))
    loss, (logits, labels, weights) = rows_loss(drafter, target, taps, tokens, lengths, anchors, ok, gamma=gamma,
                                                dtype=jnp.float32)
    # Eager op-by-op dispatch is slow on CPU; jit changes nothing in the arithmetic.
    ingest, draft = jax.jit(dflash.ingest_context), jax.jit(dflash.draft_logits)
    engine_prefill = jax.jit(prefill, static_argnames=("capacity", "options"))

    manual_num = manual_den = 0.0
    options = DecodeOptions(mode=Mode.DFLASH, block_size=bs, max_new_tokens=4)
    for r, (i, a) in enumerate([(0, 5), (0, 9), (1, 6), (1, 15)]):
        block = jnp.array([[int(tokens[i, a])] + [config.mask_token_id] * (bs - 1)])
        # Inference, literally: ingest the context before the anchor into an empty cache, then one block pass.
        cache = ingest(drafter, taps[i:i + 1, :a], jnp.array([a]), dflash.create_cache(config, 1, 32, jnp.float32))
        inference = draft(drafter, target, block, cache)[0]
        np.testing.assert_allclose(logits[r], inference, atol=2e-5, rtol=1e-5)
        # The engine: prefill a prompt of the first `a` tokens (right-padded, as `generate` pads unequal
        # prompts); its bonus is x_a (greedy data) and its drafter cache is what the first round drafts from.
        state = engine_prefill(target, drafter, tokens[i:i + 1], jnp.array([a]), jax.random.key(0), capacity=64,
                               options=options)
        assert int(state.last_token[0]) == int(tokens[i, a])
        engine = draft(drafter, target, block, state.draft_cache)[0]
        np.testing.assert_allclose(logits[r], engine, atol=2e-5, rtol=1e-5)
        # The recipe's loss, by hand: slot k labelled x_{a+k}, weight exp(-(k-1)/gamma), inside the sequence.
        logp = jax.nn.log_softmax(np.asarray(inference, np.float64), axis=-1)
        for k in range(1, bs):
            if a + k < int(lengths[i]):
                w = math.exp(-(k - 1) / gamma)
                assert int(labels[r, k - 1]) == int(tokens[i, a + k])
                assert float(weights[r, k - 1]) == pytest.approx(w, rel=1e-6)
                manual_num += -w * float(logp[k - 1, int(tokens[i, a + k])])
                manual_den += w
            else:
                assert float(weights[r, k - 1]) == 0.0
        # Negative: one more context row (the anchor's own taps, the block one position later) is a different
        # computation, so the equalities above are not vacuous.
        shifted = ingest(drafter, taps[i:i + 1, :a + 1], jnp.array([a + 1]), dflash.create_cache(config, 1, 32,
                                                                                                   jnp.float32))
        assert not np.allclose(draft(drafter, target, block, shifted)[0], inference, atol=1e-3)
    assert float(loss) == pytest.approx(manual_num / manual_den, rel=1e-5)


# ----------------------------------------------------------------------------------------------------
# A short run on a tokenizer-free random target


@pytest.fixture(scope="module")
def trained(pair, tmp_path_factory):
    folder = pair[0]
    out = tmp_path_factory.mktemp("drafter") / "drafter"
    cfg = D.DrafterTrainConfig(target=folder, out=out, block_size=4, layers=1, intermediate_size=64, sequences=48,
                               prompt_len=6, gen_len=24, gen_batch=48, steps=40, batch=8, anchors=8, lr=1e-2,
                               warmup=5, eval_every=20, save_every=20, log_every=10, dtype="float32",
                               check_prompts=3, check_new_tokens=16, eval_decode=3, eval_new_tokens=16)
    return folder, out, D.train_drafter(cfg)


def test_weighted_loss_falls(trained):
    _, out, summary = trained
    log = json.loads((out.parent / "drafter.train" / "log.json").read_text())
    losses = [h["loss"] for h in log["history"]]
    assert len(losses) == 40 and all(math.isfinite(x) for x in losses)
    # A trainer that does not learn stays near ln(320) = 5.8 here. 40 steps from random weights took the loss
    # down by at least 30% with the earlier draw, by 29.6% since q|k|v and gate|up are drawn packed.
    assert np.mean(losses[-5:]) < 0.75 * np.mean(losses[:3])
    evals = log["eval"]
    assert [e["step"] for e in evals] == [20, 40] and evals[-1]["loss"] < np.mean(losses[:3])
    assert len(evals[-1]["slot_accuracy"]) == 3 and 1.0 <= evals[-1]["tau_est"] <= 4.0
    assert summary["check"]["greedy_dflash_equals_ar"] is True
    assert summary["gamma"] == D.loss_gamma(4) and log["meta"]["prompt_source"] == "random token ids"


def test_export_loads_with_load_drafter(trained):
    from ddtree_jax.checkpoint import load_drafter, load_target

    folder, out, _ = trained
    raw = json.loads((out / "config.json").read_text())
    target = load_target(folder, jnp.float32)
    assert raw["dflash_config"]["mask_token_id"] == target.config.vocab_size - 1  # no tokenizer: the last row
    assert raw["dflash_config"]["target_layer_ids"] == D.build_target_layer_ids(4, 1) == [2]
    drafter = load_drafter(out, target.config, None)
    assert all(a.dtype == jnp.bfloat16 for a in drafter.flat().values())
    assert drafter.config.block_size == 4 and drafter.config.num_target_layers == 4

