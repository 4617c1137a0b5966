"""The decoding rule: greedy, and temperature / top-k / top-p against transformers' own warpers."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ddtree_jax.sampling import SamplingConfig, decode_tokens, warp_logits


def test_greedy_is_argmax():
    logits = jax.random.normal(jax.random.key(0), (3, 5, 50))
    np.testing.assert_array_equal(decode_tokens(logits, jax.random.key(1), SamplingConfig()),
                                  np.argmax(np.asarray(logits), -1))


def test_top_p_literal():
    logits = jnp.log(jnp.array([[0.05, 0.5, 0.15, 0.3]]))
    keep = lambda p: np.isfinite(np.asarray(warp_logits(logits, SamplingConfig(1.0, 0, p))))[0].tolist()
    assert keep(0.7) == [False, True, False, True]
    assert keep(0.81) == [False, True, True, True]
    assert keep(0.4) == [False, True, False, False]


def test_top_k_keeps_ties_like_hf():
    logits = jnp.array([[1.0, 3.0, 2.0, 2.0, 0.0]])
    kept = np.isfinite(np.asarray(warp_logits(logits, SamplingConfig(1.0, 2, 1.0))))[0].tolist()
    assert kept == [False, True, True, True, False]


@pytest.mark.parametrize("temperature,top_k,top_p", [(0.7, 0, 1.0), (1.0, 5, 1.0), (1.3, 0, 0.8), (0.9, 12, 0.6)])
def test_warpers_match_transformers(temperature, top_k, top_p):
    torch = pytest.importorskip("torch", reason="PyTorch is not importable (the transformers parity oracle)")
    from transformers.generation.logits_process import (TemperatureLogitsWarper, TopKLogitsWarper,
                                                        TopPLogitsWarper)

    logits = np.random.default_rng(0).normal(size=(4, 64)).astype(np.float32) * 3
    scores = torch.tensor(logits)
    scores = TemperatureLogitsWarper(temperature)(None, scores)
    if top_k:
        scores = TopKLogitsWarper(top_k)(None, scores)
    if top_p < 1.0:
        scores = TopPLogitsWarper(top_p)(None, scores)
    ours = np.asarray(warp_logits(jnp.asarray(logits), SamplingConfig(temperature, top_k, top_p)))
    theirs = scores.numpy()
    np.testing.assert_array_equal(np.isfinite(ours), np.isfinite(theirs))
    np.testing.assert_allclose(ours[np.isfinite(ours)], theirs[np.isfinite(theirs)], rtol=1e-6)


def test_samples_follow_the_warped_distribution():
    logits = jnp.log(jnp.array([0.4, 0.3, 0.2, 0.1]))
    config = SamplingConfig(temperature=1.0, top_k=3)
    n = 20000
    draws = decode_tokens(jnp.broadcast_to(logits, (n, 4)), jax.random.key(7), config)
    freq = np.bincount(np.asarray(draws), minlength=4) / n
    expected = np.array([0.4, 0.3, 0.2, 0.0]) / 0.9
    assert freq[3] == 0
    # 5 standard errors: a wrong renormalisation (e.g. 0.4 instead of 0.444) fails by far.
    np.testing.assert_allclose(freq, expected, atol=5 * np.sqrt(0.25 / n))


def test_invalid_settings_are_refused():
    with pytest.raises(ValueError, match="top_p must be in"):
        SamplingConfig(1.0, 0, 0.0)
    with pytest.raises(ValueError, match="temperature must be"):
        SamplingConfig(-1.0)
