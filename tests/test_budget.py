"""`--budget auto`'s arithmetic on literal trees (`budget.py`'s worked example), its acceptance correction, the
candidate parser and the on-disk cost cache. The decoding itself (lossless, branches taken, calibration) is
tested in test_ddtree_decoding.py and test_hybrid_decoding.py."""

from __future__ import annotations

import dataclasses
import json

import jax.numpy as jnp
import numpy as np
import pytest

from ddtree_jax import budget as auto
from ddtree_jax.engine import DecodeOptions, Mode
from ddtree_jax.random_checkpoint import tiny_qwen3_config
from ddtree_jax.tree import DraftTree

LN = np.log


def literal_tree() -> DraftTree:
    """budget.py's example: root, then (depth, p) = (1, .5) (1, .3) (2, .25) (2, .15), best first."""
    depths = jnp.asarray([[0, 1, 1, 2, 2]])
    scores = jnp.asarray([[0.0, LN(.5), LN(.3), LN(.25), LN(.15)]], jnp.float32)
    parents = jnp.asarray([[0, 0, 0, 1, 1]])
    return DraftTree(tokens=jnp.zeros((1, 5), jnp.int32), parents=parents, depths=depths, valid=jnp.ones((1, 5), bool),
                     ancestor=jnp.ones((1, 5, 5), bool), scores=scores)


def learned(state: auto.BudgetState, candidate: int, share) -> auto.BudgetState:
    """The state with `candidate`'s share set to `share` [L] (room 1 at every depth)."""
    share = jnp.asarray(share, jnp.float32)
    return dataclasses.replace(state, gain=state.gain.at[candidate].set(share), room=state.room.at[candidate].set(1.0))


def test_reach_prediction_and_choice_of_the_worked_example():
    np.testing.assert_allclose(np.asarray(auto.tree_reach(literal_tree(), depths=3)), [[.8, .4, 0]], rtol=1e-6)
    probs = jnp.asarray([[[.5, .3, .2], [.5, .5, 0], [.25, .5, .25]]], jnp.float32)
    chain = auto.chain_reach(jnp.log(probs) + 3.0)  # logits: any shift per depth, the same probabilities
    np.testing.assert_allclose(np.asarray(chain), [[.5, .25, .125]], rtol=1e-6)
    state = learned(auto.BudgetState.start(1, 8, 2, 3), 1, [.6, .2, 0])
    reach = auto.predicted_reach(chain, (auto.CHAIN, 4), state)  # (chain, 4): 1.875 and 2.325 tokens
    np.testing.assert_allclose(np.asarray(reach[0]), [[.5, .25, .125], [.8, .4, .125]], rtol=1e-6)
    running = jnp.asarray([True])
    pick = lambda costs: int(auto.choose(reach, running, dataclasses.replace(state, costs=costs)))  # noqa: E731
    assert pick(jnp.asarray([1.0, 1.3])) == 0 and pick(jnp.asarray([1.0, 1.2])) == 1
    # Rows that are done do not vote: a done row that expects a lot from the tree changes nothing.
    two = jnp.concatenate([reach, jnp.asarray([[[0, 0, 0], [1, 1, 1]]], jnp.float32)])
    state2 = dataclasses.replace(auto.BudgetState.start(2, 8, 2, 3), costs=jnp.asarray([1.0, 1.3]))
    assert int(auto.choose(two, jnp.asarray([True, False]), state2)) == 0
    assert int(auto.choose(two, jnp.asarray([True, True]), state2)) == 1
    # An untried tree's share is 1: it expects all of the chain's shortfall and is tried first; a negative
    # share (a tree without the chain's deep nodes) predicts less than the chain, never below 0.
    fresh = auto.predicted_reach(chain, (auto.CHAIN, 4), auto.BudgetState.start(1, 8, 2, 3))
    np.testing.assert_allclose(np.asarray(fresh[0, 1]), [1, 1, 1])
    low = auto.predicted_reach(chain, (auto.CHAIN, 4), learned(auto.BudgetState.start(1, 8, 2, 3), 1, [0, -.1, -1]))
    np.testing.assert_allclose(np.asarray(low[0, 1]), [.5, .25 - .075, 0], rtol=1e-6)


def test_a_change_of_candidate_is_charged_its_cost():
    """The worked example at costs [1.0, 1.2] ms: the tree (2.325 tokens, 1.94 per ms) beats the chain (1.875 per
    ms) by 3.3%. After a chain round, with a change costing 0.1 ms, the tree's round counts 1.3 ms (1.79 per ms):
    the chain stays; after a tree round the chain would need 1.1 ms (1.70 per ms): the tree stays. With no last
    round (-1) or a free change, the better rate wins as before; observe records the candidate that ran."""
    probs = jnp.asarray([[[.5, .5], [.5, .5], [.5, .5]]], jnp.float32)
    chain = auto.chain_reach(jnp.log(probs))
    state = dataclasses.replace(learned(auto.BudgetState.start(1, 8, 2, 3), 1, [.6, .2, 0]),
                                costs=jnp.asarray([1.0, 1.2]), change_cost=jnp.asarray(0.1, jnp.float32))
    reach = auto.predicted_reach(chain, (auto.CHAIN, 4), state)
    running = jnp.asarray([True])
    pick = lambda **kw: int(auto.choose(reach, running, dataclasses.replace(state, **kw)))  # noqa: E731
    assert int(state.last) == -1 and pick() == 1
    assert pick(last=jnp.asarray(0)) == 0 and pick(last=jnp.asarray(1)) == 1
    assert pick(last=jnp.asarray(0), change_cost=jnp.asarray(0.0)) == 1
    ran = auto.observe(state, jnp.asarray(0), chain, chain, jnp.asarray([2]), running, jnp.asarray(0),
                       jnp.asarray([0]))
    assert int(ran.last) == 0
    idle = auto.observe(ran, jnp.asarray(1), chain, chain, jnp.asarray([0]), jnp.asarray([False]), jnp.asarray(4),
                        jnp.asarray([0]))
    assert int(idle.last) == 0  # a round in which no row ran changes nothing


def test_observe_learns_the_correction_and_the_share_per_candidate_and_depth():
    """Candidate 1 (budget 4) ran a tree of drafter reach [.8 .4 0] where the chain's was [.5 .25 .1]; the target
    grants depth 1 half as often as predicted (counts 2, 1: one row reaches depth 1, one does not): its correction
    at depth 1 falls below 1, depth 3 stays 1, and its share is (tree - chain) / (1 - chain), here
    [.6 .2 -.1 / .9]; candidate 0, which never ran, keeps correction 1; the round's budget is written at each
    running row's round index. The third row is done: it counts nowhere."""
    state = auto.BudgetState.start(3, 4, 2, 3)
    reach = jnp.asarray([[.8, .4, 0], [.8, .4, 0], [.9, .9, .9]], jnp.float32)
    chain = jnp.asarray([[.5, .25, .1], [.5, .25, .1], [.9, .9, .9]], jnp.float32)
    for _ in range(20):
        state = auto.observe(state, jnp.asarray(1), reach, chain, jnp.asarray([2, 1, 0]),
                             jnp.asarray([True, True, False]), jnp.asarray(4), jnp.asarray([1, 1, 0]))
    weight = 1 - auto.DECAY ** 20
    seen = np.asarray(state.seen)
    assert seen[1, 0] == pytest.approx(0.5 * weight, rel=1e-5) and seen[1, 1] == seen[1, 2] == 0
    np.testing.assert_allclose(np.asarray(state.expected)[1], np.array([.8, .4, 0]) * weight, rtol=1e-5)
    correction = np.asarray(state.correction)
    assert 0.6 < correction[1, 0] < 0.7 and correction[1, 1] < 0.2 and correction[1, 2] == 1
    np.testing.assert_array_equal(correction[0], 1.0)
    np.testing.assert_allclose(np.asarray(state.share)[1], [.3 / .5, .15 / .75, -.1 / .9], rtol=1e-5)
    assert np.asarray(state.chosen).tolist() == [[0, 4, 0, 0], [0, 4, 0, 0], [0, 0, 0, 0]]
    # A round in which no row runs changes nothing.
    idle = auto.observe(state, jnp.asarray(0), reach, chain, jnp.zeros(3, jnp.int32), jnp.zeros(3, bool),
                        jnp.asarray(0), jnp.zeros(3, jnp.int32))
    for field in ("seen", "expected", "gain", "room"):
        np.testing.assert_array_equal(np.asarray(getattr(idle, field)), np.asarray(getattr(state, field)))
    # Rounds that verify the chain: candidate 1's share moves back towards 1 by 1 - FORGET of the distance per
    # round (exploration), its correction stays; the chain's own averages learn.
    share = np.asarray(state.share)[1]
    after = state
    for _ in range(50):
        after = auto.observe(after, jnp.asarray(0), chain, chain, jnp.asarray([1, 1, 0]),
                             jnp.asarray([True, True, False]), jnp.asarray(0), jnp.asarray([1, 1, 0]))
    np.testing.assert_allclose(np.asarray(after.share)[1], 1 - (1 - share) * auto.FORGET ** 50, rtol=1e-4)
    np.testing.assert_allclose(np.asarray(after.correction)[1], correction[1], rtol=1e-6)
    assert np.asarray(after.correction)[0, 0] < 0.2  # the chain predicted .5 at depth 1 and got 0


@pytest.mark.parametrize("text,want", [("chain,16,64", (0, 16, 64)), ("64, 0 ,16", (0, 16, 64)), ("4,8", (4, 8))])
def test_parse_candidates(text, want):
    assert auto.parse_candidates(text) == want


@pytest.mark.parametrize("text", ["64", "chain", "a,b", "-1,4", "", "16,16"])
def test_parse_candidates_refuses(text):
    with pytest.raises(ValueError, match="expected"):
        auto.parse_candidates(text)


def test_options_take_auto_only_for_ddtree_and_are_as_wide_as_the_widest_candidate():
    options = DecodeOptions(mode=Mode.DDTREE, block_size=16, budgets=(0, 16, 64))
    assert options.auto_budget and options.verify_width == 65
    assert DecodeOptions(mode=Mode.DDTREE, block_size=16, budgets=(0, 8)).verify_width == 16  # the chain: bs
    assert options.candidate(0).mode is Mode.DFLASH and options.candidate(16).budget == 16
    assert not options.candidate(16).auto_budget
    with pytest.raises(ValueError, match="ddtree option"):
        DecodeOptions(mode=Mode.DFLASH, budgets=(0, 16))
    with pytest.raises(ValueError, match="ascending"):
        DecodeOptions(mode=Mode.DDTREE, budgets=(64, 16))


def test_cost_cache_round_trip_is_keyed_and_atomic(tmp_path, monkeypatch):
    monkeypatch.setenv(auto.COST_CACHE_ENV, str(tmp_path / "c"))
    from ddtree_jax.config import parse_qwen3

    config = parse_qwen3(tiny_qwen3_config())
    options = DecodeOptions(mode=Mode.DDTREE, block_size=4, budgets=(0, 4, 16))
    key = auto.cost_key(config, None, options, 2, 300, jnp.float32)
    assert key["context"] == 512 and key["batch"] == 2 and key["budgets"] == [0, 4, 16]
    assert auto.load_costs(key) is None
    path = auto.save_costs(key, [1e-3, 2e-3, 3e-3], 0.5e-3)
    assert path.parent == tmp_path / "c" and [p.name for p in path.parent.iterdir()] == [path.name]  # no temp left
    assert auto.load_costs(key) == ([1e-3, 2e-3, 3e-3], 0.5e-3)
    assert auto.load_costs({**key, "batch": 4}) is None  # another batch: another entry
    streamed = dataclasses.replace(options, fp8_matmul="stream")  # another FP8 matmul: another compiled round
    assert auto.load_costs(auto.cost_key(config, None, streamed, 2, 300, jnp.float32)) is None
    assert auto.load_costs({**key, "calibration": key["calibration"] - 1}) is None  # an older schedule's costs
    path.write_text(json.dumps({"key": key, "seconds": [1, -1, 2], "change_seconds": 0}))
    assert auto.load_costs(key) is None  # a broken entry is measured again, not used
    path.write_text(json.dumps({"key": key, "seconds": [1, 1, 2]}))
    assert auto.load_costs(key) is None  # no change cost: measured again
    path.write_text("{not json")
    assert auto.load_costs(key) is None
