"""`--mode mtp`: the target's own multi-token-prediction head drafts, on random Qwen3.5/3.6 hybrid checkpoints
in the published layout (`mtp.*` beside `model.language_model.*`). Greedy output equals AR token for token
(m = 1, 3, 5 steps, batch 2, EOS inside an accepted block); the head's cache, committed round by round,
drafts exactly what the head run afresh over the committed sequence drafts; at temperature 1 the samples
follow the target's exact distribution (chi-square), which emitting the drafts unverified fails."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ddtree_jax import engine
from ddtree_jax import round as rnd
from ddtree_jax.checkpoint import load_mtp, load_target
from ddtree_jax.engine import DecodeOptions, Mode, generate
from ddtree_jax.models import mtp, qwen3_5, target_family
from ddtree_jax.models.contract import ForwardMeta
from ddtree_jax.random_checkpoint import write_random_qwen3_5
from ddtree_jax.sampling import SamplingConfig
from test_dflash_decoding import VOCAB8, _eos_inside_an_accepted_round, _exact_three_token_distribution, chi2_pvalue

LAYER_TYPES = ["linear_attention", "linear_attention", "full_attention", "linear_attention"]
TEXT = dict(hidden_size=32, intermediate_size=48, head_dim=16, linear_key_head_dim=8, linear_value_head_dim=8,
            layer_types=LAYER_TYPES)
PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [3, 9, 4]]  # unequal lengths, batch 2
MAX_NEW = 40


@functools.partial(jax.jit, static_argnames="steps")
def fresh_drafts(target, head, sequences, lengths, steps: int):
    """The head's drafts after each row's committed `lengths` tokens, from empty caches: the target over
    sequences[:, :lengths] (the next token, the round's root, sits at index lengths), the head over every
    position paired with the next token, then `steps` draft steps. Returns [b, steps] int32. Jitted: run op by
    op it compiled hundreds of small programs, and jaxlib 0.10.2's CPU compiler segfaulted in one of them in
    two full suite runs (tests/conftest.py)."""
    b, w = sequences.shape
    out = qwen3_5.forward(target, sequences, ForwardMeta.prompt(lengths, w),
                          qwen3_5.create_cache(target.config, b, w, jnp.float32))
    cache = mtp.ingest(head, target, jnp.roll(sequences, -1, axis=1), out.hidden, lengths,
                       mtp.create_cache(head.config, b, w + steps, jnp.float32))
    return jnp.argmax(mtp.draft_logits(head, target, cache, steps), axis=-1)


def fitted_head(target, head, sequences):
    """`head` with its `fc` refitted by least squares so that its first step maps (token i + 1, target hidden
    state at i) to the target's hidden state at i + 1 on these sequences, and its decoder layer's residual
    writes scaled by 0.1 (still on): random heads are rarely accepted, this one often is, so the rounds
    commit chains of every length."""
    def zero_centred(x, w):
        return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + 1e-6) * (1.0 + w)

    weights = {n: np.asarray(a, np.float64) for n, a in head.flat().items()}
    embed = np.asarray(target.flat()["model.embed_tokens.weight"], np.float64)
    width = max(map(len, sequences))
    padded = np.array([s + [0] * (width - len(s)) for s in sequences], np.int32)
    lengths = jnp.asarray([len(s) for s in sequences], jnp.int32)
    family = target_family(target.config)  # a Qwen3.5 hybrid here; a dense Qwen3 in test_mtp_dense
    hidden = np.asarray(jax.jit(lambda t, x: family.forward(
        t, x, ForwardMeta.prompt(lengths, width),
        family.create_cache(t.config, len(sequences), width, jnp.float32)).hidden)(target, padded), np.float64)
    features, goals = [], []
    for r, s in enumerate(sequences):
        for i in range(len(s) - 2):
            features.append(np.concatenate([zero_centred(embed[s[i + 1]], weights["mtp.pre_fc_norm_embedding.weight"]),
                                            zero_centred(hidden[r, i], weights["mtp.pre_fc_norm_hidden.weight"])]))
            goals.append(hidden[r, i + 1])
    fc = np.linalg.lstsq(np.array(features), np.array(goals), rcond=None)[0].T
    flat = dict(head.flat(), **{"mtp.fc.weight": jnp.asarray(fc, jnp.float32)})
    for name in ("mtp.layers.0.self_attn.o_proj.weight", "mtp.layers.0.mlp.down_proj.weight"):
        flat[name] = flat[name] * 0.1
    return head.replace_flat(flat)


@pytest.fixture(scope="module")
def mtp_pair(tmp_path_factory):
    """(target, fitted head, AR outputs): a random hybrid on a 16-token vocabulary with a one-layer MTP head,
    written in the published layout and loaded from it."""
    folder = write_random_qwen3_5(tmp_path_factory.mktemp("mtp_pair") / "t", seed=2, published=True, mtp_layers=1,
                                  vocab_size=16, **TEXT)
    target = load_target(folder, jnp.float32)
    head = load_mtp(folder, target.config, jnp.float32)
    ar = generate(target, PROMPTS, DecodeOptions(max_new_tokens=MAX_NEW)).output_ids
    return target, fitted_head(target, head, [p + o for p, o in zip(PROMPTS, ar)]), ar


@pytest.fixture(scope="module")
def free_runs(mtp_pair):
    """The greedy MTP run for m steps (every round's chain and accepted path recorded), once per m."""
    target, head, _ = mtp_pair
    runs = {}

    def run(m: int):
        if m not in runs:
            runs[m] = generate(target, PROMPTS, DecodeOptions(mode=Mode.MTP, max_new_tokens=MAX_NEW, mtp_steps=m,
                                                              record_trees=True), drafter=head)
        return runs[m]

    return run


@pytest.mark.parametrize("m", [1, 3])  # one draft, and a chain of drafts (the Qwen3.6 head's default 3)
def test_greedy_equals_ar(mtp_pair, free_runs, m):
    spec = free_runs(m)
    assert spec.output_ids == mtp_pair[2]
    lengths = [n for row in spec.acceptance_lengths for n in row]
    assert all(1 <= n <= m + 1 for n in lengths)
    assert max(lengths) >= min(m + 1, 3), "no round accepted a chain of drafts: the commit would go untested"
    assert all(sum(row) + 1 >= len(o) for row, o in zip(spec.acceptance_lengths, spec.output_ids))


@pytest.mark.parametrize("m", [1, 3])
def test_eos_inside_an_accepted_block_stops_like_ar(mtp_pair, free_runs, m):
    """EOS is a token first emitted as an accepted draft (not a round's last token): the round that emits it
    drops what it committed after it, as AR stops there."""
    target, head, _ = mtp_pair
    found = _eos_inside_an_accepted_round(free_runs(m))
    assert found is not None, "no round accepted a draft before a token first appeared"
    row, eos = found
    ar = generate(target, PROMPTS, DecodeOptions(max_new_tokens=MAX_NEW, eos_ids=(eos,)))
    spec = generate(target, PROMPTS, DecodeOptions(mode=Mode.MTP, max_new_tokens=MAX_NEW, mtp_steps=m,
                                                   eos_ids=(eos,)), drafter=head)
    assert spec.output_ids == ar.output_ids
    assert spec.output_ids[row][-1] == eos and len(spec.output_ids[row]) < MAX_NEW
    assert sum(spec.acceptance_lengths[row]) + 1 > len(spec.output_ids[row])  # the last round was cut at EOS


def test_committed_cache_drafts_what_a_fresh_head_drafts(mtp_pair, free_runs):
    """Every round's drafts (recorded trees) equal the head's drafts after running afresh over the sequence
    committed before the round (the target's hidden states of a fresh forward): what each commit keeps (the
    head's K/V of the accepted positions with the verified hidden states, and its output at the last) is
    what the next round's first step needs. Rounds that accepted 0 .. m drafts are among them."""
    target, head, _ = mtp_pair
    m = 3
    spec = free_runs(m)
    assert {len(t["accepted"]) for t in spec.trees} >= {1, 2, 3}
    full = [p + o for p, o in zip(PROMPTS, spec.output_ids)]
    width = max(t["start"] for t in spec.trees) + 1
    sequences = np.zeros((len(spec.trees), width), np.int32)
    for i, tree in enumerate(spec.trees):
        start = tree["start"]
        sequences[i, :start + 1] = full[tree["row"]][:start + 1]
        assert sequences[i, start] == tree["tokens"][0]  # the round's root: the newest emitted token
    starts = jnp.asarray([t["start"] for t in spec.trees], jnp.int32)
    drafts = np.asarray(fresh_drafts(target, head, jnp.asarray(sequences), starts, steps=m))
    assert drafts.tolist() == [t["tokens"][1:] for t in spec.trees]


def test_tensor_parallel_equals_ar(mtp_pair):
    """On two devices with the heads split (the head's cache and its draft buffers too), the same tokens.
    Data parallelism, and both layouts on the Pallas kernels, give them too (run by hand, not here: CI time)."""
    from ddtree_jax.parallel import make_parallel, shard_params

    target, head, ar = mtp_pair
    parallel = make_parallel(2, "tp")
    target, head = shard_params(target, parallel), shard_params(head, parallel)
    spec = generate(target, PROMPTS, DecodeOptions(mode=Mode.MTP, max_new_tokens=MAX_NEW, parallel=parallel),
                    drafter=head)
    assert spec.output_ids == ar


def test_options_name_what_mtp_needs(mtp_pair):
    target, head, _ = mtp_pair
    with pytest.raises(ValueError, match="mtp_steps must be >= 1"):
        DecodeOptions(mode=Mode.MTP, mtp_steps=0)
    with pytest.raises(ValueError, match="needs a drafter"):
        engine.resolve_options(DecodeOptions(mode=Mode.MTP), None)
    with pytest.raises(ValueError, match="mode ddtree needs a DFlash drafter, not this drafter"):
        engine.resolve_options(DecodeOptions(mode=Mode.DDTREE), head)
    options = engine.resolve_options(DecodeOptions(mode=Mode.MTP, mtp_steps=4), head)
    assert (options.block_size, options.verify_width) == (5, 5)


# ---- sampling (T = 1): samples follow the target's exact distribution

SAMPLES = 2000  # as the hybrid DFlash and DDTree checks (test_hybrid_decoding)


@pytest.fixture(scope="module")
def sampling_pair(tmp_path_factory):
    """A peaked random hybrid on an 8-token vocabulary with a random MTP head, a prompt and the exact
    p(x1, x2, x3 | prompt) flattened [512]."""
    folder = write_random_qwen3_5(tmp_path_factory.mktemp("mtp_sampling") / "t", seed=5, published=True,
                                  mtp_layers=1, std=0.4, vocab_size=VOCAB8, **TEXT)
    target = load_target(folder, jnp.float32)
    head = load_mtp(folder, target.config, jnp.float32)
    prompt = [1, 2, 3]
    exact = _exact_three_token_distribution(target, prompt, VOCAB8).ravel()
    return target, head, prompt, exact / exact.sum()  # renormalised: float32 softmax rounding


SAMPLING = DecodeOptions(mode=Mode.MTP, max_new_tokens=3, mtp_steps=2, sampling=SamplingConfig(temperature=1.0))


def _sample(pair, seed: int, n: int):
    target, head, prompt, _ = pair
    result = generate(target, [prompt] * n, SAMPLING, drafter=head, seed=seed)
    return np.array(result.output_ids), sum(k - 1 for row in result.acceptance_lengths for k in row)


def test_sampling_follows_the_target_distribution(sampling_pair):
    """Chi-square of (x1, x2, x3) at T = 1 against the exact distribution: 512 cells, cells expecting < 5
    pooled, alpha 1e-3, fixed seed."""
    samples, accepted = _sample(sampling_pair, seed=123, n=SAMPLES)
    assert accepted > 250, "drafts were rarely accepted; the test would not exercise the match rule"
    assert chi2_pvalue(samples, sampling_pair[3]) > 1e-3


@pytest.fixture
def drafts_matched_against_themselves(monkeypatch):
    """A wrong accept rule: every draft is compared with the chain's own next token instead of the target's
    sample, so every draft is accepted and emitted unverified (only the last node's sample is the target's).
    The rule is read when tracing: every trace and compilation is dropped before and after."""
    def fresh():
        jax.clear_caches()
        engine._COMPILED.clear()

    right = rnd.accept_tree
    fresh()
    monkeypatch.setattr(rnd, "accept_tree", lambda tree, decoded, path_len: right(
        tree, jnp.concatenate([tree.tokens[:, 1:], decoded[:, -1:]], axis=1), path_len))
    yield
    monkeypatch.undo()
    fresh()


def test_unverified_drafts_fail_the_sampling_check(sampling_pair, drafts_matched_against_themselves):
    """Negative control (last in this module: it drops every compilation): with the drafts emitted
    unverified, x2 and x3 are the head's argmaxes, not samples of the target, and the chi-square check
    above rejects them at p < 1e-6 with 1000 samples."""
    samples, _ = _sample(sampling_pair, seed=123, n=1000)
    assert chi2_pvalue(samples, sampling_pair[3]) < 1e-6


def test_pallas_kernels_give_the_jax_tokens(mtp_pair):
    """The head's layer on the Pallas path (add + RMSNorm kernels, tree attention; interpreted here) drafts and
    verifies as the pure-JAX path does: the same tokens and the same acceptance (a fitted head, so drafts are
    accepted)."""
    target, head, ar = mtp_pair
    options = DecodeOptions(mode=Mode.MTP, mtp_steps=3, max_new_tokens=MAX_NEW)
    jax_run = generate(target, PROMPTS, options, drafter=head)
    pallas_run = generate(target, PROMPTS, dataclasses.replace(options, kernels="pallas"), drafter=head)
    assert pallas_run.output_ids == jax_run.output_ids == ar
    assert pallas_run.acceptance_lengths == jax_run.acceptance_lengths
    assert max(n for row in pallas_run.acceptance_lengths for n in row) > 1

