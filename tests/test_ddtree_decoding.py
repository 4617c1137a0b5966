"""DDTree decoding: lossless against AR, the acceptance sequence of a straightforward reference, no host
transfers inside the decode loop."""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ddtree_jax.checkpoint import load_drafter, load_target
from ddtree_jax.engine import (FORCED_OUT, DecodeOptions, Mode, compile_generation, decode_loop, generate, prefill,
                               resolve_options)
from ddtree_jax.round import speculative_round
from ddtree_jax.models.contract import ForwardMeta
from ddtree_jax.models import dflash, qwen3
from ddtree_jax.random_checkpoint import tiny_qwen3_config, write_random_dflash, write_random_qwen3
from ddtree_jax.sampling import SamplingConfig
from conftest import YARN_ROPE_SCALING
from jaxprs import equations, pallas_call_names
from test_dflash_decoding import PROMPTS, _eos_inside_an_accepted_round, chi2_pvalue, sampling_pair
from test_tree import heap_tree


@pytest.fixture(scope="module")
def pair16(tmp_path_factory):
    root = tmp_path_factory.mktemp("pair16")
    target = load_target(write_random_qwen3(root / "t", seed=2, with_tokenizer=False, vocab_size=16), jnp.float32)
    drafter = load_drafter(write_random_dflash(root / "d", tiny_qwen3_config(vocab_size=16), seed=3),
                           target.config, jnp.float32)
    return target, drafter


@pytest.fixture(scope="module")
def ar_outputs(pair16):
    return generate(pair16[0], PROMPTS, DecodeOptions(max_new_tokens=40)).output_ids


# Budgets 1..256 with both block sizes at the budgets the issue names (1, 16, 64); each pair is a compile.
@pytest.mark.parametrize("budget,block_size", [(1, 4), (1, 16), (4, 4), (16, 4), (16, 16), (64, 4), (64, 16),
                                               (256, 16)])
def test_greedy_equals_ar(pair16, ar_outputs, budget, block_size):
    target, drafter = pair16
    spec = generate(target, PROMPTS, DecodeOptions(mode=Mode.DDTREE, max_new_tokens=40, block_size=block_size,
                                                   budget=budget), drafter=drafter)
    assert spec.output_ids == ar_outputs
    lengths = [n for row in spec.acceptance_lengths for n in row]
    assert all(1 <= n <= block_size for n in lengths)
    if budget >= 16:  # most rounds accept a draft, so path commits are exercised
        assert np.mean(lengths) > 1.5


@pytest.mark.parametrize("mode", [Mode.DFLASH, Mode.DDTREE])
def test_greedy_with_a_yarn_drafter_equals_ar(pair16, ar_outputs, tmp_path, mode):
    """pair16's drafter weights with YaRN RoPE in the older `rope_scaling` spelling (as Qwen3.6 drafters
    carry it): DFlash and DDTree still give AR's tokens, and drafts are accepted."""
    target = pair16[0]
    folder = write_random_dflash(tmp_path / "d", tiny_qwen3_config(vocab_size=16), seed=3,
                                 rope_scaling=YARN_ROPE_SCALING)
    drafter = load_drafter(folder, target.config, jnp.float32)
    assert drafter.config.rope.rope_type == "yarn"
    spec = generate(target, PROMPTS, DecodeOptions(mode=mode, max_new_tokens=40, block_size=4, budget=16),
                    drafter=drafter)
    assert spec.output_ids == ar_outputs
    assert max(n for row in spec.acceptance_lengths for n in row) >= 2


def test_eos_inside_an_accepted_path_stops_like_ar(pair16):
    target, drafter = pair16
    options = DecodeOptions(mode=Mode.DDTREE, max_new_tokens=40, block_size=4, budget=16)
    free = generate(target, PROMPTS, options, drafter=drafter)
    found = _eos_inside_an_accepted_round(free)
    assert found is not None
    row, eos = found
    ar = generate(target, PROMPTS, DecodeOptions(max_new_tokens=40, eos_ids=(eos,)))
    spec = generate(target, PROMPTS, dataclasses.replace(options, eos_ids=(eos,)), drafter=drafter)
    assert spec.output_ids == ar.output_ids and spec.output_ids[row][-1] == eos
    assert sum(spec.acceptance_lengths[row]) + 1 > len(spec.output_ids[row])  # the last round was cut at EOS


# ---- a straightforward reference round: no caches, the heap tree, a walk with full target passes


WIDTH = 64  # the reference pads every sequence to this width, so each function compiles once


@jax.jit
def _full_pass(target, drafter, tokens, length):
    """One uncached target pass over tokens [WIDTH] (valid up to length): next-token argmax after the last
    valid token, and the drafter's context K/V built from scratch from the taps of every valid token."""
    cache = qwen3.create_cache(target.config, 1, WIDTH, jnp.float32)
    out = qwen3.forward(target, tokens[None], ForwardMeta.prompt(length[None], WIDTH), cache,
                        tap_layers=drafter.config.target_layer_ids)
    nxt = jnp.argmax(qwen3.logits(target, out.hidden[0, length - 1]))
    draft_cache = dflash.ingest_context(drafter, out.taps, length[None],
                                        dflash.create_cache(drafter.config, 1, WIDTH + 16, jnp.float32))
    return nxt, draft_cache


_draft_logits = jax.jit(dflash.draft_logits)  # compiled once (op by op it took most of the reference's time)


def _pass(target, drafter, tokens):
    padded = np.zeros(WIDTH, np.int32)
    padded[:len(tokens)] = tokens
    nxt, cache = _full_pass(target, drafter, jnp.asarray(padded), jnp.asarray(len(tokens), jnp.int32))
    return int(nxt), cache


def reference_ddtree(target, drafter, prompt, budget, block_size, max_new):
    """Greedy DDTree as the paper describes it: the heap tree, then a walk that runs the target afresh
    (no cache) on the committed tokens plus the path so far; everything recomputed every round."""
    fed = list(prompt)
    bonus, _ = _pass(target, drafter, fed)
    emitted, lengths = [bonus], []
    while len(emitted) < max_new:
        _, cache = _pass(target, drafter, fed)
        block = jnp.asarray([[bonus] + [drafter.config.mask_token_id] * (block_size - 1)])
        log_probs = np.asarray(jax.nn.log_softmax(_draft_logits(drafter, target, block, cache)[0], -1))
        tree = heap_tree(log_probs, budget)
        path, nxt = (), _pass(target, drafter, fed + [bonus])[0]
        while path + (nxt,) in tree:
            path = path + (nxt,)
            nxt = _pass(target, drafter, fed + [bonus] + list(path))[0]
        lengths.append(1 + len(path))
        emitted += list(path) + [nxt]
        fed += [bonus] + list(path)
        bonus = nxt
    return emitted[:max_new], lengths


def test_acceptance_lengths_match_the_reference_round(tmp_path):
    target = load_target(write_random_qwen3(tmp_path / "t", seed=8, with_tokenizer=False, vocab_size=48),
                         jnp.float32)
    drafter = load_drafter(write_random_dflash(tmp_path / "d", tiny_qwen3_config(vocab_size=48), seed=9,
                                               block_size=8), target.config, jnp.float32)
    prompt, means = [5, 17, 33, 2], []
    for budget in (1, 16, 64):
        spec = generate(target, [prompt], DecodeOptions(mode=Mode.DDTREE, max_new_tokens=32, budget=budget),
                        drafter=drafter)
        ref_out, ref_lengths = reference_ddtree(target, drafter, prompt, budget, 8, 32)
        assert spec.acceptance_lengths[0] == ref_lengths, budget
        assert spec.output_ids[0] == ref_out
        means.append(np.mean(ref_lengths))
    assert means[0] < means[1] < means[2], means


def test_sampling_follows_the_ar_distribution(tmp_path):
    """As the DFlash test: chi-square of (x1, x2, x3) against the exact distribution, alpha 1e-3, seed fixed
    (the DFlash test's negative control shows the power of this check at this sample size)."""
    target, drafter, prompt, exact = sampling_pair(tmp_path)
    options = DecodeOptions(mode=Mode.DDTREE, max_new_tokens=3, block_size=4, budget=6,
                            sampling=SamplingConfig(temperature=1.0, top_k=0, top_p=1.0))
    result = generate(target, [prompt] * 4000, options, drafter=drafter, seed=321)
    assert sum(m - 1 for row in result.acceptance_lengths for m in row) > 1000
    assert chi2_pvalue(np.array(result.output_ids), exact) > 1e-3


def test_decode_loop_makes_no_host_transfers(pair16):
    target, drafter = pair16
    options = resolve_options(DecodeOptions(mode=Mode.DDTREE, max_new_tokens=30, budget=8), drafter)
    tokens, lengths = jnp.asarray([[1, 2, 3, 4]]), jnp.asarray([4])
    state = jax.jit(prefill, static_argnames=("capacity", "options"))(
        target, drafter, tokens, lengths, jax.random.key(0), capacity=64, options=options)
    loop = jax.jit(decode_loop, static_argnames=("options",))
    steps = jnp.asarray(100, jnp.int32)
    loop.lower(target, drafter, state, steps, options=options).compile()
    jaxpr = str(jax.make_jaxpr(lambda s: decode_loop(target, drafter, s, steps, options))(state))
    assert "callback" not in jaxpr and "while" in jaxpr
    with jax.transfer_guard("disallow"):
        final = loop(target, drafter, state, steps, options=options)
        final.step.block_until_ready()
    assert int(final.step) > 3 and bool(final.done.all())  # many rounds ran inside the one call


def test_tree_kernels_run_up_to_their_measured_budget(monkeypatch):
    """`round.propose` with the Pallas kernels: the tree-build kernel up to `round.TREE_BUILD_KERNEL_UP_TO` (512,
    its MAX_BUDGET), XLA's builder above it (lowered here, as `tools/with_knobs.py engine:tree_kernels_up_to=128`
    lowers it); the vocabulary top-k kernel up to `round.VOCAB_TOP_K_KERNEL_UP_TO` (512), XLA's top-k above it
    (lowered here)."""
    import ddtree_jax.round as rounds

    logits = jax.random.normal(jax.random.key(0), (1, 3, 4000), jnp.float32)
    last = jnp.array([1], jnp.int32)

    def kernels(budget: int) -> list[str]:
        options = DecodeOptions(mode=Mode.DDTREE, budget=budget, kernels="pallas")
        jaxpr = jax.make_jaxpr(lambda lg, lt: rounds.propose(lg, lt, options))(logits, last)
        return sorted(pallas_call_names(jaxpr))

    top_k = ["vocab_top_k_chunk_max", "vocab_top_k_compact", "vocab_top_k_select"]
    assert kernels(128) == ["tree_build", *top_k]
    assert kernels(200) == ["tree_build", *top_k]
    monkeypatch.setattr(rounds, "TREE_BUILD_KERNEL_UP_TO", 128)
    assert kernels(200) == top_k
    monkeypatch.setattr(rounds, "VOCAB_TOP_K_KERNEL_UP_TO", 128)
    assert kernels(200) == []


# ---- --budget auto: each round verifies one candidate (chain, 4, 16), chosen on device; always an exact round


AUTO = DecodeOptions(mode=Mode.DDTREE, max_new_tokens=40, block_size=4, budgets=(0, 4, 16), record_trees=True,
                      auto_scope="round")
# Seconds per round of (chain, 4, 16) and what pair16 then chooses (per row of 40 tokens): 16 in all 20 rounds; 16 in
# 16-18, 4 in 4, the chain once; 16 in the first round (the widest first), then the chain in ~35; the same.
AUTO_COSTS = [(1.0, 1.0, 1.2), (1.0, 1.0, 1.4), (1.0, 1.2, 2.0), (1.0, 1.3, 2.0)]


def test_auto_budget_greedy_equals_ar_whichever_budgets_it_chooses(pair16, ar_outputs):
    """Costs are an argument of the compiled loop (no recompile); every cost table gives AR's tokens, the
    choices differ between tables and inside one run, and one budget is recorded per round and per saved tree.
    With every other candidate priced out, auto runs exactly the fixed round of that budget: the same rounds,
    trees and accepted paths (the branch builds budget 4's own tree)."""
    target, drafter = pair16
    seen = []
    for i, costs in enumerate(AUTO_COSTS):
        spec = generate(target, PROMPTS, AUTO, drafter=drafter, round_costs=costs)
        assert spec.output_ids == ar_outputs, costs
        assert spec.round_costs == list(costs) and spec.calibration_seconds == 0
        assert i == 0 or spec.compile_seconds == 0
        assert [len(r) for r in spec.budgets_chosen] == [len(r) for r in spec.acceptance_lengths]
        assert sorted(spec.budgets_chosen[0] + spec.budgets_chosen[1]) == sorted(t["budget"] for t in spec.trees)
        seen.append({b for row in spec.budgets_chosen for b in row})
    assert set().union(*seen) == {0, 4, 16}, seen
    assert any(len(s) > 1 for s in seen), seen

    spec = generate(target, PROMPTS, AUTO, drafter=drafter, round_costs=[FORCED_OUT, 1.0, FORCED_OUT])
    ref = generate(target, PROMPTS, dataclasses.replace(AUTO, budgets=(), budget=4), drafter=drafter)
    assert spec.acceptance_lengths == ref.acceptance_lengths
    assert spec.budgets_chosen == [[4] * len(r) for r in ref.acceptance_lengths]
    assert [{**t, "budget": 4} for t in ref.trees] == spec.trees


def test_auto_budget_calibrates_once_and_caches_the_costs(pair16, ar_outputs, tmp_path, monkeypatch):
    """No costs given: measured with the compiled loop, written to the cache folder, read back next time."""
    monkeypatch.setenv("DDTREE_JAX_ROUND_COSTS", str(tmp_path / "costs"))
    target, drafter = pair16
    first = generate(target, PROMPTS, AUTO, drafter=drafter)
    assert first.output_ids == ar_outputs and first.calibration_seconds > 0
    assert len(first.round_costs) == 3 and all(c > 0 for c in first.round_costs)
    [entry] = (tmp_path / "costs").iterdir()
    assert json.loads(entry.read_text())["key"]["budgets"] == [0, 4, 16]
    again = generate(target, PROMPTS, AUTO, drafter=drafter)
    assert again.calibration_seconds == 0 and again.round_costs == first.round_costs
    assert again.output_ids == ar_outputs


def test_auto_per_call_runs_each_candidates_fixed_program_and_keeps_a_record(pair16, ar_outputs, tmp_path,
                                                                             monkeypatch):
    """Per call (the default scope): every call is exactly one candidate's fixed program (its rounds and trees, AR's
    tokens). From an empty record each of the first calls calibrates (every candidate runs on its prompts first:
    the record on disk gains a call of each, 80 tokens) and then runs the candidate of the best rate in the record;
    `recalibrate` starts from nothing, a record passed in is used as given (a calibrated one: no calibration);
    round costs, a per-round state and compiling the per-call options are refused."""
    monkeypatch.setenv("DDTREE_JAX_ROUND_COSTS", str(tmp_path / "c"))
    target, drafter = pair16
    options = dataclasses.replace(AUTO, auto_scope="call")
    for call in range(2):
        spec = generate(target, PROMPTS, options, drafter=drafter)
        [want] = {b for row in spec.budgets_chosen for b in row}
        fixed = generate(target, PROMPTS, options.candidate(want), drafter=drafter)
        assert spec.output_ids == ar_outputs and spec.acceptance_lengths == fixed.acceptance_lengths
        assert spec.trees == [{**t, "budget": want} for t in fixed.trees] and spec.round_costs is None
        [entry] = (tmp_path / "c").iterdir()
        kept = json.loads(entry.read_text())
        assert kept["calls"] == [call + 1] * 3 and kept["tokens"] == [80.0 * (call + 1)] * 3
        assert kept["paired"] == call + 1 and spec.calibration_seconds > 0 and kept == {**kept, **spec.auto_learned}
        assert AUTO.budgets.index(want) == int(np.argmax(np.array(kept["tokens"]) / np.array(kept["seconds"])))
    assert generate(target, PROMPTS, options, drafter=drafter, recalibrate=True).auto_learned["calls"] == [1, 1, 1]
    given = {"calls": [4, 4, 4], "tokens": [100.0, 300.0, 100.0], "seconds": [1.0, 1.0, 1.0], "paired": 4}
    spec = generate(target, PROMPTS, options, drafter=drafter, auto_learned=given)
    assert spec.budgets_chosen[0][0] == 4 and spec.auto_learned == {**given, "scope": "call"}
    assert spec.calibration_seconds == 0
    with pytest.raises(ValueError, match="per round only"):
        generate(target, PROMPTS, options, drafter=drafter, round_costs=[1.0, 1.0, 1.0])
    with pytest.raises(ValueError, match="expected a --budget auto per-call record"):
        generate(target, PROMPTS, options, drafter=drafter, auto_learned={"tokens": [1, 2, 3], "rows": [1, 1, 1]})
    with pytest.raises(ValueError, match="per round"):
        generate(target, PROMPTS, AUTO, drafter=drafter, round_costs=[1.0, 1.0, 1.0], auto_learned=given)
    with pytest.raises(ValueError, match="fixed programs"):
        compile_generation(target, PROMPTS, options, drafter=drafter)


def _primitives(jaxpr, skip=None) -> set[str]:
    """Every primitive in a jaxpr and the jaxprs inside it, but not inside the equation `skip`."""
    return {eqn.primitive.name for eqn, _ in equations(jaxpr, skip)}


def test_auto_budget_builds_a_tree_only_in_the_branches_that_verify_one(pair16):
    """The loop's program: the chain's loop of rounds, then one switch on the chosen candidate whose tree branches
    are loops of that candidate's rounds (the switch runs once per change of candidate, not every round) and
    whose chain branch passes the state on; the vocabulary top-k that every tree build starts with (`top_k`) is
    inside the tree branches and nowhere else, so a round that verifies the chain runs no top-k and no build (a
    DFlash round's work). Positive control: the check finds the top-k of a fixed DDTree round, and none in a
    DFlash round's."""
    target, drafter = pair16
    options = resolve_options(AUTO, drafter)
    state = jax.jit(prefill, static_argnames=("capacity", "options"))(
        target, drafter, jnp.asarray([[1, 2, 3, 4]]), jnp.asarray([4]), jax.random.key(0), capacity=64,
        options=options)
    steps = jnp.asarray(8, jnp.int32)
    jaxpr = jax.make_jaxpr(lambda s: decode_loop(target, drafter, s, steps, options))(state).jaxpr
    [switch] = [e for e, _ in equations(jaxpr) if e.primitive.name == "cond"
                and len(e.params["branches"]) == len(AUTO.budgets)]
    chain, *trees = switch.params["branches"]
    assert AUTO.budgets[0] == 0 and not chain.jaxpr.eqns  # the chain's rounds run before the switch
    assert all(any(e.primitive.name == "while" for e in b.jaxpr.eqns) for b in trees)
    assert all("top_k" in _primitives(b) for b in trees)
    outside = _primitives(jaxpr, skip=switch)  # the chain's loop: the draft's argmaxes, no top-k
    assert "top_k" not in outside and "argmax" in outside and "while" in outside

    def round_primitives(mode, budget):
        sub = dataclasses.replace(options, mode=mode, budget=budget, budgets=())
        return _primitives(jax.make_jaxpr(lambda s: speculative_round(target, drafter, s, sub))(state).jaxpr)

    assert "top_k" in round_primitives(Mode.DDTREE, 16) and "top_k" not in round_primitives(Mode.DFLASH, 64)


def test_auto_budget_sampling_follows_the_ar_distribution(tmp_path):
    """As the fixed-budget test, with costs under which the first round verifies the budget-6 tree (the widest: a
    decode that has learned nothing starts with it) and the later ones the chain (what round one revealed of
    every candidate's count tips it; budget 2 is priced out)."""
    target, drafter, prompt, exact = sampling_pair(tmp_path)
    options = DecodeOptions(mode=Mode.DDTREE, max_new_tokens=3, block_size=4, budgets=(0, 2, 6), auto_scope="round",
                            sampling=SamplingConfig(temperature=1.0, top_k=0, top_p=1.0))
    result = generate(target, [prompt] * 4000, options, drafter=drafter, seed=321, round_costs=[1.0, 4.0, 2.0])
    assert {b for row in result.budgets_chosen for b in row} == {0, 6}
    assert sum(m - 1 for row in result.acceptance_lengths for m in row) > 1000
    assert chi2_pvalue(np.array(result.output_ids), exact) > 1e-3
