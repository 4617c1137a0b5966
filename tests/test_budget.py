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


def test_reach_and_choice_of_the_worked_example():
    reach = auto.tree_reach(literal_tree(), (1, 3, 4), depths=3)
    np.testing.assert_allclose(np.asarray(reach[0]), [[.5, 0, 0], [.8, .25, 0], [.8, .4, 0]], rtol=1e-6)
    chain = auto.chain_reach(jnp.log(jnp.asarray([[[.5, .3, .2], [.5, .5, 0], [.25, .5, .25]]], jnp.float32)))
    np.testing.assert_allclose(np.asarray(chain), [[.5, .25, .125]], rtol=1e-6)
    both = jnp.concatenate([chain[:, None], reach[:, 2:]], axis=1)  # (chain, 4): 1.875 and 2.2 tokens
    state = auto.BudgetState.start(1, 8, 2, 3)
    running = jnp.asarray([True])
    pick = lambda costs: int(auto.choose(both, running, dataclasses.replace(state, costs=costs)))  # noqa: E731
    assert pick(jnp.asarray([1.0, 1.2])) == 0 and pick(jnp.asarray([1.0, 1.1])) == 1
    # Rows that are done do not vote: a done row that expects a lot from the tree changes nothing.
    two = jnp.concatenate([both, jnp.asarray([[[0, 0, 0], [1, 1, 1]]], jnp.float32)])
    state2 = dataclasses.replace(auto.BudgetState.start(2, 8, 2, 3), costs=jnp.asarray([1.0, 1.2]))
    assert int(auto.choose(two, jnp.asarray([True, False]), state2)) == 0
    assert int(auto.choose(two, jnp.asarray([True, True]), state2)) == 1


def test_observe_corrects_an_overconfident_drafter_per_candidate_and_depth():
    """Candidate 1 (budget 4) predicts reach [.8 .4 0]; the target grants depth 1 half as often as predicted
    (counts 2, 1: one row reaches depth 1, one does not): its correction at depth 1 falls below 1, depth 3 stays
    1, and candidate 0, which never ran, keeps 1 everywhere; the round's budget is written at each running row's
    round index."""
    state = auto.BudgetState.start(3, 4, 2, 3)
    predicted = jnp.asarray([[.8, .4, 0], [.8, .4, 0], [.9, .9, .9]], jnp.float32)
    for _ in range(20):
        state = auto.observe(state, jnp.asarray(1), predicted, jnp.asarray([2, 1, 0]), jnp.asarray([True, True, False]),
                             jnp.asarray(4), jnp.asarray([1, 1, 0]))
    seen = np.asarray(state.seen)
    assert seen[1, 0] == pytest.approx(0.5 * (1 - auto.DECAY ** 20), rel=1e-5) and seen[1, 1] == seen[1, 2] == 0
    np.testing.assert_allclose(np.asarray(state.expected)[1], np.array([.8, .4, 0]) * (1 - auto.DECAY ** 20),
                               rtol=1e-5)
    correction = np.asarray(state.correction)
    assert 0.6 < correction[1, 0] < 0.7 and correction[1, 1] < 0.2 and correction[1, 2] == 1
    np.testing.assert_array_equal(correction[0], 1.0)
    assert np.asarray(state.chosen).tolist() == [[0, 4, 0, 0], [0, 4, 0, 0], [0, 0, 0, 0]]
    # A round in which no row runs changes nothing.
    idle = auto.observe(state, jnp.asarray(1), predicted, jnp.zeros(3, jnp.int32), jnp.zeros(3, bool), jnp.asarray(0),
                        jnp.zeros(3, jnp.int32))
    np.testing.assert_array_equal(np.asarray(idle.seen), seen)
    # The corrected candidate loses the choice it won before: at equal costs, 4's tree expected 1 + 1.2 tokens
    # against the chain's 1 + 1.0; corrected, about 1 + .8 x .65 + .4 x .1.
    reach = jnp.asarray([[[.6, .3, .1], [.8, .4, 0]]], jnp.float32)
    fresh = auto.BudgetState.start(1, 4, 2, 3)
    assert int(auto.choose(reach, jnp.asarray([True]), fresh)) == 1
    assert int(auto.choose(reach, jnp.asarray([True]), dataclasses.replace(state, costs=fresh.costs))) == 0


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
    path = auto.save_costs(key, [1e-3, 2e-3, 3e-3])
    assert path.parent == tmp_path / "c" and [p.name for p in path.parent.iterdir()] == [path.name]  # no temp left
    assert auto.load_costs(key) == [1e-3, 2e-3, 3e-3]
    assert auto.load_costs({**key, "batch": 4}) is None  # another batch: another entry
    path.write_text(json.dumps({"key": key, "seconds": [1, -1, 2]}))
    assert auto.load_costs(key) is None  # a broken entry is measured again, not used
    path.write_text("{not json")
    assert auto.load_costs(key) is None
