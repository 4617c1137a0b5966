"""The tree-build kernel against the XLA builder (`build_tree(..., implementation="reference")`, i.e. the vmapped
`tree._build_one`, itself checked against the heap Algorithm 1 in tests/test_tree.py): every DraftTree field equal,
bit for bit, on random log-softmax inputs, heavy ties, a vocabulary smaller than the budget (padding nodes), budgets
that are not powers of two, and depth 1.

Every kernel test class runs interpreted on CPU and compiled on a GPU (marked `gpu`, skipped without one).
"""

from __future__ import annotations

import dataclasses
import functools
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ddtree_jax.tree import build_tree, candidate_pairs
from pallas_kernels import tree_build as tb

INTERPRET = [pytest.param(True, id="interpret"), pytest.param(False, id="compiled", marks=pytest.mark.gpu)]
FIELDS = ("tokens", "parents", "depths", "valid", "ancestor", "scores")


@dataclasses.dataclass(frozen=True)
class Case:
    b: int
    depth: int  # L
    vocab: int
    budget: int
    levels: int | None = None  # log-probs rounded to multiples of 1 / levels: many exact ties
    peak: float = 0.0  # one token per depth this much likelier (in logits): a confident drafter's deep tree

    def __str__(self):
        return (f"b{self.b}-L{self.depth}-V{self.vocab}-B{self.budget}" + (f"-q{self.levels}" if self.levels else "")
                + (f"-peak{self.peak:g}" if self.peak else ""))


# Cases of equal (b, L, K, B) share the kernel's compilation (its input is the top-k), those of equal shapes the
# reference's.
CASES = [
    Case(2, 3, 50, 1),
    Case(2, 3, 300, 24),  # B not a power of two
    Case(2, 15, 1000, 64),
    Case(2, 15, 1000, 64, levels=1),  # ties everywhere
    Case(2, 15, 1000, 64, peak=12.0),  # every depth used: the depth loop runs to the end
    Case(2, 15, 1000, 16, peak=8.0),  # deep, and stopping early on some rows
    Case(2, 2, 5, 64),  # V < B: K = V, beam slots past K at -inf, and 5 + 25 finite prefixes < B: padding nodes
    Case(1, 2, 300, 128),
    # Above B = 128 the default prunes to the B-th best candidate itself (`prune=2`): flat log-probs (the bound of
    # `prune=1` keeps nearly every candidate there), a deep tree, and ties at the threshold.
    Case(1, 15, 4000, 512),
    Case(1, 15, 4000, 512, peak=12.0),
    Case(2, 15, 2000, 256, levels=1),
]


def log_probs(case: Case) -> jax.Array:
    rng = np.random.default_rng(zlib.crc32(str(case).encode()))
    logits = 2.0 * rng.normal(size=(case.b, case.depth, case.vocab))
    logits[:, np.arange(case.depth), (7 * np.arange(case.depth)) % case.vocab] += case.peak
    lp = jax.nn.log_softmax(jnp.asarray(logits, jnp.float32), -1)
    if case.levels:
        lp = jnp.round(lp * case.levels) / case.levels
    return lp


@functools.partial(jax.jit, static_argnames=("budget", "implementation", "interpret"))
def build(lp, roots, budget, implementation, interpret=None):
    return build_tree(lp, roots, budget, implementation=implementation, interpret=interpret)


def assert_same_tree(got, want):
    for field in FIELDS:
        np.testing.assert_array_equal(np.asarray(getattr(got, field)), np.asarray(getattr(want, field)),
                                      err_msg=field)


@pytest.mark.parametrize("interpret", INTERPRET)
class TestTreeBuildKernel:
    @pytest.mark.parametrize("case", CASES, ids=str)
    def test_matches_xla_builder(self, case: Case, interpret: bool):
        lp = log_probs(case)
        roots = jnp.arange(case.b, dtype=jnp.int32) + 5
        want = build(lp, roots, case.budget, "reference")
        got = build(lp, roots, case.budget, "pallas", interpret)
        assert_same_tree(got, want)
        if case.vocab < case.budget:  # the padding case has padding nodes
            assert not np.asarray(want.valid).all()
        if not (case.peak and case.budget == 64 or case.budget > 128):
            return
        top = np.sort(np.asarray(lp[0, :2]), axis=-1)[:, ::-1][:, :case.budget]  # depths 1 and 2, best first
        i, j = candidate_pairs(case.budget, case.budget)
        score = top[0, i] + top[1, j]  # depth 2's candidates (K = B here)
        bound = top[0, case.budget - 1] + top[1, 0]  # prune=1's: the worst of the B children (i, 0)
        if case.peak and case.budget == 64:  # the default prunes, and here not vacuously: at depth 2 at least two in
            # five candidates lie below the bound and are left out
            assert np.mean(score < bound) > 0.4
        if case.budget > 128:  # prune=2 by default: the bound of prune=1 alone keeps far more than the B best; with
            # ties, more than B candidates share the B-th best score (all kept). Since the running list's bound the
            # bisection runs only where both keep more than 2 B (test_the_bisection_keeps_a_depths_b_best_... runs it)
            best = np.sort(score)[::-1][case.budget - 1]
            assert np.sum(score >= bound) > 2 * np.sum(score >= best) or case.levels
            assert np.sum(score >= best) > case.budget if case.levels else np.sum(score >= best) == case.budget

    def test_a_perturbed_input_gives_another_tree(self, interpret: bool):
        """Negative control: the comparison sees a change of one log-prob (depth 1's best token made the worst),
        so the equal trees above are not vacuous."""
        case = CASES[1]
        lp = log_probs(case)
        roots = jnp.arange(case.b, dtype=jnp.int32) + 5
        perturbed = lp.at[0, 0, int(jnp.argmax(lp[0, 0]))].set(-50.0)
        got = build(perturbed, roots, case.budget, "pallas", interpret)
        with pytest.raises(AssertionError):
            assert_same_tree(got, build(lp, roots, case.budget, "reference"))
        assert_same_tree(got, build(perturbed, roots, case.budget, "reference"))


def assert_knobs_give_the_reference_tree(case: Case, config: tb.TreeBuildConfig, interpret: bool):
    """The kernel with `config` builds the XLA builder's tree for `case`."""
    lp = log_probs(case)
    roots = jnp.arange(case.b, dtype=jnp.int32) + 5
    got = jax.jit(functools.partial(build_tree, budget=case.budget, implementation="pallas", interpret=interpret,
                                    kernel_config=config))(lp, roots)
    assert_same_tree(got, build(lp, roots, case.budget, "reference"))


def test_narrow_tiles_give_the_same_tree():
    """The counting tiles are knobs: 16 x 16 tiles (18 row blocks of candidates at B = 64, many ties) give the
    default's tree, i.e. the XLA builder's."""
    assert_knobs_give_the_reference_tree(CASES[3], tb.TreeBuildConfig(block=16, block_rows=16), True)


@pytest.mark.parametrize("interpret", INTERPRET)
@pytest.mark.parametrize("case", [c for c in CASES if c.budget == 64], ids=str)
def test_unpruned_candidates_give_the_same_tree(case: Case, interpret: bool):
    """`prune=0` (the default prunes) counts every candidate: the same tree on shallow, tied, deep and padded
    inputs at B = 64."""
    assert_knobs_give_the_reference_tree(case, tb.TreeBuildConfig(prune=0), interpret)


@pytest.mark.parametrize("interpret", INTERPRET)
@pytest.mark.parametrize("case", [CASES[3], CASES[6], CASES[7]], ids=str)
def test_latency_knobs_give_the_same_tree(case: Case, interpret: bool):
    """`fuse_above=1` (the candidates above each running entry counted in the first row block's pass) with
    `hoist_pairs=1` (the candidate table loaded once, the kept candidates' pairs compacted): the same tree on tied
    and padded inputs at B = 64, and at B = 128 where a shallow tree keeps several row blocks."""
    assert_knobs_give_the_reference_tree(case, tb.TreeBuildConfig(fuse_above=1, hoist_pairs=1), interpret)


@pytest.mark.parametrize("interpret", INTERPRET)
@pytest.mark.parametrize("case", [CASES[3], CASES[4], CASES[6]], ids=str)
def test_exact_prune_gives_the_same_tree(case: Case, interpret: bool):
    """`prune=2` (the candidates at or above the B-th best score, by a bisection; the default above B = 128) at
    B = 64: the same tree on tied, deep and padded inputs (one beam slot past K at -inf, so -inf candidates)."""
    assert_knobs_give_the_reference_tree(case, tb.TreeBuildConfig(prune=2), interpret)


def at_the_running_lists_last(depth2: list[float]) -> jax.Array:
    """[1, 3, 64] log-probs in exact quarters for B = 16: depth 1's 16 tokens fill the running list from -0.25 down
    to -4.5 and -5 (its last), depth 2's best tokens are `depth2`, depth 3's best -0.5; the rest -30."""
    lp = np.full((1, 3, 64), -30.0, np.float32)
    lp[0, 0, :16] = [-0.25 * (k + 1) for k in range(14)] + [-4.5, -5.0]
    lp[0, 1, :len(depth2)] = depth2
    lp[0, 2, 0] = -0.5
    return jnp.asarray(lp)


@pytest.mark.parametrize("interpret", INTERPRET)
@pytest.mark.parametrize("prune", [1, 2])
def test_a_candidate_just_above_the_running_lists_last_enters(prune: int, interpret: bool):
    """The running list's last entry bounds the kept candidates (strictly: shallower entries win ties), exactly at
    its edge. B = 16, exact quarter sums: depth 1's 16 tokens fill the list down to -5 (its last) after -4.5; at
    depth 2 the best child scores -4.75, between the two, and enters in the last place; the next one ties the last
    (-5) and does not; depth 3's best grandchild (-5.25) no longer can."""
    budget, lp, roots = 16, at_the_running_lists_last([-4.5, -4.75]), jnp.array([5], jnp.int32)
    want = build(lp, roots, budget, "reference")
    depths = np.asarray(want.depths)[0]
    assert np.sum(depths == 2) == 1 and np.sum(depths == 1) == 15 and np.max(depths) == 2  # not vacuous
    got = jax.jit(functools.partial(build_tree, budget=budget, implementation="pallas", interpret=interpret,
                                    kernel_config=tb.TreeBuildConfig(prune=prune)))(lp, roots)
    assert_same_tree(got, want)


@pytest.mark.parametrize("interpret", INTERPRET)
def test_the_bisection_keeps_a_depths_b_best_and_their_ties(interpret: bool):
    """`prune=2`'s bisection (where the other bounds keep more than `exact_above` x B candidates): B = 16, depth 2's
    best tokens at -0.25, -0.5, ..., -4 (exact quarter sums, many ties): 49 of its 50 candidates lie above the
    running list's last entry (-5), so the bisection cuts them to the 16 best and their ties, and ten depth-2 nodes
    enter the tree (a cut to the best one fails here; one that keeps fewer than B but all ten is not wrong: a depth's
    B-th best and its parent cannot both be among the B best)."""
    budget, lp, roots = 16, at_the_running_lists_last([-0.25 * (k + 1) for k in range(16)]), jnp.array([5], jnp.int32)
    top = np.asarray(lp)[0, :2, :budget]  # depths 1 and 2, best first
    i, j = candidate_pairs(budget, budget)
    assert np.sum(top[0, i] + top[1, j] > top[0, -1]) == 49  # above the last entry, hence the bound of prune 1 too
    want = build(lp, roots, budget, "reference")
    assert np.sum(np.asarray(want.depths)[0] == 2) == 10  # not vacuous: a wrong cut would leave some out
    got = jax.jit(functools.partial(build_tree, budget=budget, implementation="pallas", interpret=interpret,
                                    kernel_config=tb.TreeBuildConfig(prune=2)))(lp, roots)
    assert_same_tree(got, want)


@pytest.mark.parametrize("interpret", INTERPRET)
@pytest.mark.parametrize("case,running_bound", [(CASES[3], 1), (CASES[3], 0), (CASES[6], 1), (CASES[9], 1),
                                               (CASES[10], 1)],
                         ids=lambda x: str(x) if isinstance(x, Case) else None)
def test_merge_by_search_gives_the_same_tree(case: Case, running_bound: int, interpret: bool):
    """`merge_search=1` (the running list's merge by binary search over both sorted lists):
    the same tree on tied inputs at B = 64 (also without the running list's bound, where candidates at or below its
    last entry are merged too), padded ones, a deep tree at B = 512 and ties at B = 256."""
    config = dataclasses.replace(tb.default_config(case.budget), merge_search=1, running_bound=running_bound)
    assert_knobs_give_the_reference_tree(case, config, interpret)


@pytest.mark.parametrize("interpret", INTERPRET)
@pytest.mark.parametrize("knobs", [{}, {"running_bound": 0}, {"merge_search": 1},
                                   {"merge_search": 1, "running_bound": 0}],
                         ids=lambda knobs: ",".join(f"{k}={v}" for k, v in knobs.items()) or "default")
def test_a_best_child_tying_the_running_lists_last_stays_out(knobs: dict, interpret: bool):
    """Depth 2 runs (depth 1's best, -0.25, is above the list's last, -5) but its best child ties that last entry
    exactly: the shallower entry keeps the place, whichever way the merge counts (with the running list's bound the
    child is not even kept; without it, it is placed first and must count all B entries at or above it)."""
    budget, lp, roots = 16, at_the_running_lists_last([-4.75]), jnp.array([5], jnp.int32)
    want = build(lp, roots, budget, "reference")
    assert np.max(np.asarray(want.depths)) == 1  # not vacuous: the tie went to depth 1
    config = dataclasses.replace(tb.default_config(budget), **knobs)
    got = jax.jit(functools.partial(build_tree, budget=budget, implementation="pallas", interpret=interpret,
                                    kernel_config=config))(lp, roots)
    assert_same_tree(got, want)


def test_count_sorted_against_numpy():
    """The search's count of a non-increasing list's entries above (strict) or at and above each key, against
    NumPy's, on lists with runs of equal entries, keys below, between, on and above them, lengths 1 to 513."""
    from pallas_kernels._counting import count_sorted

    rng = np.random.default_rng(0)
    for n in (1, 2, 3, 24, 64, 512, 513):
        entries = np.sort(rng.integers(-5, 5, n).astype(np.int32))[::-1]
        keys = rng.integers(-7, 7, 40).astype(np.int32)
        want = {strict: [np.sum(entries > key) if strict else np.sum(entries >= key) for key in keys]
                for strict in (True, False)}
        for strict in (True, False):
            got = count_sorted(lambda m: jnp.asarray(entries)[m], n, jnp.asarray(keys), strict=strict)
            np.testing.assert_array_equal(np.asarray(got), want[strict], err_msg=f"n={n} {strict=}")


def test_budget_above_the_kernel_maximum():
    """The kernel refuses B > MAX_BUDGET naming it; build_tree keeps those on the XLA builder."""
    budget = tb.MAX_BUDGET + 1
    top = jnp.zeros((1, 1, budget), jnp.float32)
    with pytest.raises(ValueError, match=f"budget={budget}"):
        tb.tree_build_pallas(top, top.astype(jnp.int32), jnp.zeros((1,), jnp.int32), budget=budget, interpret=True)
    lp = log_probs(Case(1, 2, 300, budget))
    roots = jnp.array([5], jnp.int32)
    assert_same_tree(build(lp, roots, budget, "pallas"), build(lp, roots, budget, "reference"))


@pytest.mark.parametrize("knobs,message", [
    ({"block": 24}, "block=24"), ({"block_rows": 8}, "block_rows=8"),
    ({"prune": 3}, "TreeBuildConfig.prune=3: must be 0, 1 or 2"),
    ({"exact_above": 3}, "TreeBuildConfig.exact_above=3: must be 1 or 2"),
    ({"fuse_above": 2}, "TreeBuildConfig.fuse_above=2: must be 0 or 1"),
    ({"hoist_pairs": -1}, "TreeBuildConfig.hoist_pairs=-1: must be 0 or 1")])
def test_config_is_validated(knobs: dict, message: str):
    with pytest.raises(ValueError, match=message):
        tb.TreeBuildConfig(**knobs)
