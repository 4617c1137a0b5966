"""DFlash decoding is lossless: greedy equals AR token for token; sampling follows the AR distribution."""

from __future__ import annotations

import dataclasses
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ddtree_jax.checkpoint import load_drafter, load_target
from ddtree_jax.engine import DecodeOptions, Mode, generate
from ddtree_jax.models.contract import ForwardMeta
from ddtree_jax.models import target_family
from ddtree_jax.random_checkpoint import tiny_qwen3_config, write_random_dflash, write_random_qwen3
from ddtree_jax.sampling import SamplingConfig

PROMPTS = [[1, 2, 3, 4, 5, 6, 7], [3, 9]]


@pytest.fixture(scope="module")
def small_pair(tmp_path_factory):
    """A random target with a 16-token vocabulary and a random drafter: drafts match often enough that
    rounds accept 1, 2, 3... tokens, differently per row."""
    root = tmp_path_factory.mktemp("pair")
    target = load_target(write_random_qwen3(root / "t", seed=2, with_tokenizer=False, vocab_size=16), jnp.float32)
    drafter = load_drafter(write_random_dflash(root / "d", tiny_qwen3_config(vocab_size=16), seed=3),
                           target.config, jnp.float32)
    return target, drafter


@pytest.mark.parametrize("block_size", [2, 4, 7])
def test_greedy_equals_ar(small_pair, block_size):
    target, drafter = small_pair
    ar = generate(target, PROMPTS, DecodeOptions(max_new_tokens=40))
    spec = generate(target, PROMPTS, DecodeOptions(mode=Mode.DFLASH, max_new_tokens=40, block_size=block_size),
                    drafter=drafter)
    assert spec.output_ids == ar.output_ids
    lengths = [n for row in spec.acceptance_lengths for n in row]
    assert max(lengths) >= 2, "the drafter never agreed: the test would not exercise acceptance"
    assert all(1 <= n <= block_size for n in lengths)
    # The prefill emits one token; every round commits its length (the last one may be cut by the budget).
    assert all(sum(row) + 1 >= len(o) for row, o in zip(spec.acceptance_lengths, spec.output_ids))


def _eos_inside_an_accepted_round(spec):
    """(row, token): a token whose first occurrence in that row's output is an accepted draft, not the prefill's
    token nor a round's last token; None if no row has one."""
    for row, (out, rounds) in enumerate(zip(spec.output_ids, spec.acceptance_lengths)):
        ends = set(1 + np.cumsum(rounds))  # tokens emitted when each round ends (the prefill emits the first)
        for token in sorted(set(out)):
            first = out.index(token) + 1  # tokens emitted up to and including it
            if first > 1 and first not in ends:
                return row, token
    return None


def test_eos_inside_an_accepted_block_stops_like_ar(small_pair):
    target, drafter = small_pair
    options = DecodeOptions(mode=Mode.DFLASH, max_new_tokens=40, block_size=4)
    free = generate(target, PROMPTS, options, drafter=drafter)
    found = _eos_inside_an_accepted_round(free)
    assert found is not None, "no round accepted a draft before a token first appeared"
    row, eos = found
    ar = generate(target, PROMPTS, DecodeOptions(max_new_tokens=40, eos_ids=(eos,)))
    spec = generate(target, PROMPTS, dataclasses.replace(options, eos_ids=(eos,)), drafter=drafter)
    assert spec.output_ids == ar.output_ids
    assert spec.output_ids[row][-1] == eos and len(spec.output_ids[row]) < 40
    assert sum(spec.acceptance_lengths[row]) + 1 > len(spec.output_ids[row])  # the last round was cut at EOS


def _exact_three_token_distribution(target, prompt, vocab):
    """p(x1, x2, x3 | prompt) from the target's own softmax (any target family), [v, v, v], float64: every
    two-token continuation run from an empty cache in one forward pass."""
    family = target_family(target.config)
    seqs = np.array([prompt + [a, b] for a, b in itertools.product(range(vocab), repeat=2)])
    n, t = seqs.shape

    @jax.jit  # one program: a hybrid's forward dispatched op by op took ~25 s on a busy CPU
    def log_probs(params, tokens):
        out = family.forward(params, tokens, ForwardMeta.prompt(jnp.full((n,), t), t),
                             family.create_cache(params.config, n, t, jnp.float32))
        return jax.nn.log_softmax(family.logits(params, out.hidden), -1)

    logp = np.asarray(log_probs(target, jnp.asarray(seqs)), np.float64)
    p1 = np.exp(logp[0, t - 3])
    p2 = np.exp(logp[::vocab, t - 2]).reshape(vocab, vocab)  # rows: x1
    p3 = np.exp(logp[:, t - 1]).reshape(vocab, vocab, vocab)
    return p1[:, None, None] * p2[:, :, None] * p3


VOCAB8 = 8


def sampling_pair(tmp_path):
    """A peaked random target on an 8-token vocabulary (larger weights: tokens depend strongly on their
    prefix), a random drafter, a prompt, and the exact p(x1, x2, x3 | prompt) flattened [512]."""
    target = load_target(write_random_qwen3(tmp_path / "t", seed=5, with_tokenizer=False, vocab_size=VOCAB8,
                                            hidden_size=32, head_dim=8, std=0.4), jnp.float32)
    drafter = load_drafter(write_random_dflash(tmp_path / "d", tiny_qwen3_config(vocab_size=VOCAB8, hidden_size=32),
                                               seed=6, head_dim=8), target.config, jnp.float32)
    prompt = [1, 2, 3]
    exact = _exact_three_token_distribution(target, prompt, VOCAB8).ravel()
    return target, drafter, prompt, exact / exact.sum()  # renormalised: float32 softmax rounding


def chi2_pvalue(samples: np.ndarray, exact: np.ndarray) -> float:
    """Chi-square p-value of samples [n, 3] against `exact`; cells expecting < 5 are pooled into one."""
    from scipy import stats

    counts = np.bincount(samples @ np.array([VOCAB8 * VOCAB8, VOCAB8, 1]), minlength=VOCAB8 ** 3)
    expected = exact * len(samples)
    small = expected < 5
    return stats.chisquare(np.append(counts[~small], counts[small].sum()),
                           np.append(expected[~small], expected[small].sum())).pvalue


def test_sampling_follows_the_ar_distribution(tmp_path):
    """Chi-square goodness of fit of DFlash samples (x1, x2, x3) against the target's exact distribution.

    4000 samples over the 512 cells, cells with expected count < 5 pooled; alpha = 1e-3 with a fixed seed.
    Power: with the same number of samples, a sampler that gets the dependence between positions wrong
    (x2, x3 drawn without regard to x1) is rejected at p < 1e-6, as the negative control below checks.
    """
    target, drafter, prompt, exact = sampling_pair(tmp_path)
    n = 4000
    options = DecodeOptions(mode=Mode.DFLASH, max_new_tokens=3, block_size=4,
                            sampling=SamplingConfig(temperature=1.0))
    result = generate(target, [prompt] * n, options, drafter=drafter, seed=123)
    accepted = sum(m - 1 for row in result.acceptance_lengths for m in row)
    assert accepted > 500, "drafts were rarely accepted; the test would not exercise the match rule"
    assert chi2_pvalue(np.array(result.output_ids), exact) > 1e-3

    # Negative control: the same number of samples from a wrong rule (x2, x3 drawn ignoring x1) is rejected.
    rng = np.random.default_rng(0)
    marg1 = exact.reshape(VOCAB8, -1).sum(1)
    marg23 = exact.reshape(VOCAB8, -1).sum(0)
    x23 = rng.choice(VOCAB8 * VOCAB8, size=n, p=marg23)
    wrong = np.stack([rng.choice(VOCAB8, size=n, p=marg1), x23 // VOCAB8, x23 % VOCAB8], axis=1)
    assert chi2_pvalue(wrong, exact) < 1e-6
