"""The decoding rule: greedy, and temperature / top-k / top-p against transformers' own warpers."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ddtree_jax.sampling import TOP_P_CANDIDATES, SamplingConfig, decode_tokens, top_p_keep, warp_logits


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
    with pytest.raises(ValueError, match=r"top_p: expected a number in \(0, 1\]"):
        SamplingConfig(1.0, 0, 0.0)
    with pytest.raises(ValueError, match="temperature: expected >= 0"):
        SamplingConfig(-1.0)


def sorted_top_p(logits: np.ndarray, top_p: float) -> np.ndarray:
    """The top-p rule by a stable descending sort in float64 (the definition `top_p_keep` must meet)."""
    order = np.argsort(-logits, axis=-1, kind="stable")
    s = np.take_along_axis(logits, order, -1).astype(np.float64)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    keep = np.zeros(logits.shape, bool)
    np.put_along_axis(keep, order, np.cumsum(p, -1) - p < top_p, -1)
    return keep


def candidates_hold(logits: np.ndarray, top_p: float) -> bool:
    """Whether every row's TOP_P_CANDIDATES most likely tokens hold top_p of the mass (the top-k path)."""
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return bool((np.sort(p, -1)[:, ::-1][:, :TOP_P_CANDIDATES].sum(-1) >= top_p).all())


# top_p_keep as sampling runs it, compiled with its top_p a constant: op by op, its 60 calls below dispatched
# thousands of small programs.
top_p_keep_jit = jax.jit(top_p_keep, static_argnums=1)


def test_top_p_equals_the_sorted_rule_on_both_paths():
    """Random rows, rounded ones (ties, -0.0), -inf entries; both the top-k path and the threshold search."""
    rng = np.random.default_rng(0)
    paths = set()
    for trial in range(60):
        v = [5, 64, 100, 1000][trial % 4]
        logits = (rng.normal(size=(3, v)) * [0.1, 1.0, 3.0, 10.0][trial // 4 % 4]).astype(np.float32)
        if trial % 3 == 0:
            logits = np.round(logits)
        if trial % 5 == 0:
            logits[:, :v // 2] = -np.inf
        top_p = [0.1, 0.5, 0.9, 0.99][trial // 16 % 4]
        paths.add(candidates_hold(logits, top_p))
        np.testing.assert_array_equal(np.asarray(top_p_keep_jit(jnp.asarray(logits), top_p)),
                                      sorted_top_p(logits, top_p), err_msg=f"trial {trial}")
    assert paths == {True, False}  # both paths were taken


def chi_square_p(draws: np.ndarray, expected: np.ndarray) -> float:
    """p-value of the draws under `expected` probabilities; a draw where `expected` is 0 gives 0."""
    from scipy.stats import chisquare

    counts = np.bincount(draws, minlength=expected.size)
    if counts[expected == 0].any():
        return 0.0
    support = expected > 0
    return float(chisquare(counts[support], expected[support] / expected[support].sum() * counts.sum()).pvalue)


@pytest.mark.parametrize("heavy,weight,tail,top_p", [
    (10, 0.08, 500, 0.75),  # 10 heavy tokens hold the nucleus: read from the top-k candidates
    (80, 0.01, 200, 0.795),  # an 80-token nucleus (ties all): past the 64 candidates, the threshold search
])
def test_top_p_samples_follow_the_nucleus(heavy, weight, tail, top_p):
    probs = np.concatenate([np.full(heavy, weight), np.full(tail, (1 - heavy * weight) / tail)])
    logits = np.log(probs).astype(np.float32)[None]
    assert candidates_hold(logits, top_p) == (heavy <= TOP_P_CANDIDATES)
    n = 40000
    draws = np.asarray(decode_tokens(jnp.broadcast_to(jnp.asarray(logits[0]), (n, probs.size)), jax.random.key(3),
                                     SamplingConfig(temperature=1.0, top_p=top_p)))
    kept = sorted_top_p(logits, top_p)[0]
    assert kept.sum() == heavy  # the boundary token (the last heavy one) is in
    assert chi_square_p(draws, np.where(kept, probs, 0.0)) > 1e-3
    # Negative controls: the nucleus one token short (mass including the token < top_p), and no top-p at all.
    short = kept & (np.cumsum(probs) < top_p)
    assert short.sum() == heavy - 1
    assert chi_square_p(draws, np.where(short, probs, 0.0)) < 1e-6
    assert chi_square_p(draws, probs) < 1e-6
