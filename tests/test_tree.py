"""The device tree builder against a straightforward heap implementation of the paper's Algorithm 1: the same
prefixes in the same node order (the heap's pop order), ties included."""

from __future__ import annotations

import heapq

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ddtree_jax import tree as tree_module
from ddtree_jax.tree import ancestor_mask, build_tree, chunked_top_k, threshold_top_k, total_order_key

# build_tree as the engine runs it, in one compiled program: run op by op, each call dispatched (and compiled) a
# few hundred small programs, seconds per call on this CPU.
build_jit = jax.jit(build_tree, static_argnums=2, static_argnames=("top_k_chunk", "top_k"))


def heap_tree(log_probs: np.ndarray, budget: int) -> list[tuple[int, ...]]:
    """Algorithm 1: best-first over rank tuples; pop B times, push the next sibling and the first child.
    Returns the popped prefixes (as token tuples) in pop order.

    Ties pop in (depth, rank tuple) order. Scores are summed in float32 left to right, as on device.
    """
    depth_limit, vocab = log_probs.shape
    k = min(budget, vocab)
    order = np.argsort(-log_probs, axis=1, kind="stable")[:, :k]
    top = np.take_along_axis(log_probs, order, axis=1).astype(np.float32)

    def score(ranks):
        s = np.float32(0)
        for depth, rank in enumerate(ranks):
            s = np.float32(s + top[depth, rank])
        return s

    heap = [(-score((0,)), 1, (0,))]
    chosen = []
    while heap and len(chosen) < budget:
        neg, depth, ranks = heapq.heappop(heap)
        if not np.isfinite(neg):
            break
        chosen.append(tuple(int(order[d, r]) for d, r in enumerate(ranks)))
        if ranks[-1] + 1 < k:
            sibling = ranks[:-1] + (ranks[-1] + 1,)
            heapq.heappush(heap, (-score(sibling), depth, sibling))
        if depth < depth_limit:
            child = ranks + (0,)
            heapq.heappush(heap, (-score(child), depth + 1, child))
    return chosen


def device_tree_paths(log_probs: np.ndarray, budget: int) -> list[tuple[int, ...]]:
    """The prefix of every valid non-root node, in node order, after checking the tree's invariants."""
    tree = build_jit(jnp.asarray(log_probs)[None], jnp.array([7]), budget)
    tokens, parents, depths, valid, anc = (np.asarray(x[0]) for x in (tree.tokens, tree.parents, tree.depths,
                                                                       tree.valid, tree.ancestor))
    assert tokens[0] == 7 and parents[0] == 0 and depths[0] == 0
    paths = []
    for i in range(1, budget + 1):
        if not valid[i]:
            assert anc[i].sum() == 1 and anc[i, i]
            continue
        path, j = [], i
        while j != 0:
            assert parents[j] < j and depths[j] == depths[parents[j]] + 1  # parents precede children
            path.append(int(tokens[j]))
            j = parents[j]
        path = tuple(reversed(path))
        assert list(np.flatnonzero(anc[i])) == sorted(_ancestors(parents, i))
        paths.append(path)
    # Siblings carry distinct tokens.
    for p in set(parents[1:][valid[1:]]):
        kids = tokens[1:][(parents[1:] == p) & valid[1:]]
        assert len(kids) == len(set(kids.tolist()))
    return paths


def _ancestors(parents, i):
    out = {i}
    while i != 0:
        i = int(parents[i])
        out.add(i)
    return out


def _log_softmax(x):
    x = x - x.max(axis=-1, keepdims=True)
    return (x - np.log(np.exp(x).sum(axis=-1, keepdims=True))).astype(np.float32)


# Every vocabulary against budgets below, at and above it, at one depth, several depths and the 15 of a
# block-16 drafter (each case is its own compile, so the grid is thinned at the middle depth).
CASES = [(vocab, depth, budget) for vocab in (2, 7, 50, 700) for depth in (1, 4, 15)
         for budget in ((2, 16) if depth == 4 else (1, 3, 64, 512))
         if not (vocab == 700 and depth == 15 and budget == 512)]


@pytest.mark.parametrize("vocab,depth,budget", CASES)
def test_matches_heap_on_random_log_probs(vocab, depth, budget):
    rng = np.random.default_rng(vocab * 1000 + depth * 10 + budget)
    log_probs = _log_softmax(rng.standard_normal((depth, vocab)) * 2)
    assert device_tree_paths(log_probs, budget) == heap_tree(log_probs, budget)


@pytest.mark.parametrize("budget", [1, 5, 17, 100, 512])
def test_matches_heap_with_exact_ties(budget):
    """Log-probs from a few dyadic values: sums are exact in float32 and many prefixes tie."""
    rng = np.random.default_rng(budget)
    log_probs = -rng.integers(1, 5, size=(6, 12)).astype(np.float32) / 4
    assert device_tree_paths(log_probs, budget) == heap_tree(log_probs, budget)


def test_fewer_prefixes_than_budget_pads_with_invalid_nodes():
    log_probs = _log_softmax(np.random.default_rng(0).standard_normal((2, 3)))
    paths = device_tree_paths(log_probs, 20)  # only 3 + 9 prefixes exist
    assert len(paths) == 12 == len(heap_tree(log_probs, 20))


def test_budget_512_depth_15_large_vocab_is_the_top_prefixes():
    """The largest case: budget 512 over 15 depths of a 700-token vocabulary."""
    rng = np.random.default_rng(1)
    log_probs = _log_softmax(rng.standard_normal((15, 700)) * 3)
    assert device_tree_paths(log_probs, 512) == heap_tree(log_probs, 512)


def test_ancestor_mask_literal():
    mask = np.asarray(ancestor_mask(jnp.array([0, 0, 1, 0, 2]), jnp.ones(5, bool), 3)).astype(int)
    np.testing.assert_array_equal(mask, [[1, 0, 0, 0, 0],
                                         [1, 1, 0, 0, 0],
                                         [1, 1, 1, 0, 0],
                                         [1, 0, 0, 1, 0],
                                         [1, 1, 1, 0, 1]])


@pytest.mark.parametrize("max_depth", [0, 1, 3, 15])
def test_ancestor_mask_walks_max_depth_levels(max_depth):
    """Random trees (parents precede children), some padding nodes: row i holds i and its ancestors at most
    max_depth levels up; a padding node sees only itself."""
    rng = np.random.default_rng(max_depth)
    t = 40
    parents = np.array([0] + [int(rng.integers(0, i)) for i in range(1, t)])
    valid = rng.random(t) > 0.2
    valid[0] = True
    mask = np.asarray(ancestor_mask(jnp.asarray(parents), jnp.asarray(valid), max_depth))
    for i in range(t):
        expected, j = {i}, i
        for _ in range(max_depth):
            j = int(parents[j])
            expected.add(j)
        assert set(np.flatnonzero(mask[i]).tolist()) == (expected if valid[i] else {i})


def test_batched_rows_are_independent():
    rng = np.random.default_rng(3)
    lp = np.stack([_log_softmax(rng.standard_normal((5, 30))) for _ in range(3)])
    batched = build_jit(jnp.asarray(lp), jnp.array([1, 2, 3]), 24)
    for r in range(3):
        alone = build_jit(jnp.asarray(lp[r:r + 1]), jnp.array([r + 1]), 24)
        for field in ("tokens", "parents", "depths", "valid", "ancestor"):
            np.testing.assert_array_equal(getattr(batched, field)[r], getattr(alone, field)[0])


@pytest.mark.parametrize("n,k,chunk", [(1000, 16, 64), (1000, 63, 64), (997, 5, 100), (4096, 64, 512), (50, 7, 8)])
def test_chunked_top_k_equals_lax_top_k_with_ties_and_minus_inf(n, k, chunk):
    """Values from a few levels (many ties across and within chunks) and -inf entries: the same values
    and the same indices in the same order as one lax.top_k."""
    rng = np.random.default_rng(n + k)
    x = rng.integers(0, 6, size=(3, 4, n)).astype(np.float32)
    x[rng.random(x.shape) < 0.3] = -np.inf
    x[1, 2] = -np.inf  # a row of only -inf: lax.top_k returns its first k indices
    want_values, want_index = jax.lax.top_k(jnp.asarray(x), k)
    values, index = jax.jit(chunked_top_k, static_argnums=(1, 2))(jnp.asarray(x), k, chunk)
    np.testing.assert_array_equal(np.asarray(values), np.asarray(want_values))
    np.testing.assert_array_equal(np.asarray(index), np.asarray(want_index))


def test_chunked_top_k_check_can_fail():
    """Negative control: the same two stages with the candidates laid out rank-major (all chunks' best,
    then all chunks' second best, ...) pick the same values but break ties out of index order, which the
    test above would catch."""
    x = jnp.asarray(np.random.default_rng(0).integers(0, 3, size=(1, 512)).astype(np.float32))
    k, chunk = 16, 64
    values, within = jax.lax.top_k(x.reshape(1, 8, chunk), k)
    index = (within + jnp.arange(8)[:, None] * chunk).swapaxes(1, 2).reshape(1, -1)
    top, at = jax.lax.top_k(values.swapaxes(1, 2).reshape(1, -1), k)
    want_values, want_index = jax.lax.top_k(x, k)
    np.testing.assert_array_equal(np.asarray(top), np.asarray(want_values))
    assert not np.array_equal(np.asarray(jnp.take_along_axis(index, at, axis=1)), np.asarray(want_index))


@pytest.mark.parametrize("budget", [16, 100])
def test_tree_with_chunked_vocabulary_top_k_is_the_same_tree(budget):
    """One lax.top_k, chunked_top_k, threshold_top_k and the kernel (interpreted here; their fast paths at both
    budgets: about 1.2 K of 3000 entries are candidates, M = 512) give the same tree."""
    rng = np.random.default_rng(budget)
    lp = _log_softmax(rng.standard_normal((2, 6, 3000)) * 2)
    lp[0, :, 100:400] = lp[0, :, 100:101]  # exact ties across chunk borders
    one = build_jit(jnp.asarray(lp), jnp.array([1, 2]), budget, top_k_chunk=None, top_k="chunked")
    for kwargs in (dict(top_k_chunk=256, top_k="chunked"), dict(top_k="threshold"), dict(top_k="pallas")):
        two = build_jit(jnp.asarray(lp), jnp.array([1, 2]), budget, **kwargs)
        for field in ("tokens", "parents", "depths", "valid", "ancestor", "scores"):
            np.testing.assert_array_equal(np.asarray(getattr(two, field)), np.asarray(getattr(one, field)))


def test_a_smaller_budgets_tree_is_the_first_nodes_of_a_wider_one():
    """build_tree emits nodes in one total order that does not depend on the budget: budget B's tree is the first
    B + 1 nodes of any wider tree (ancestor mask cut along both node axes), with ties (rounded log-probs) and
    padding (a row with one finite token per depth has fewer prefixes than B)."""
    rng = np.random.default_rng(7)
    build = jax.jit(build_tree, static_argnums=2)
    for vocab, rounded in ((3, False), (40, True)):
        raw = rng.standard_normal((2, 5, vocab)) * 2
        raw[0, :, 1:] = -np.inf if vocab == 3 else raw[0, :, 1:]  # row 0 of the small vocabulary: 5 prefixes
        lp = jnp.asarray(_log_softmax(np.round(raw) if rounded else raw))
        wide = build(lp, jnp.array([1, 2]), 32)
        for budget in (1, 5, 16):
            want, t = build(lp, jnp.array([1, 2]), budget), budget + 1
            for field in ("tokens", "parents", "depths", "valid", "ancestor", "scores"):
                got = np.asarray(getattr(wide, field))[:, :t]
                got = got[:, :, :t] if field == "ancestor" else got
                np.testing.assert_array_equal(got, np.asarray(getattr(want, field)), err_msg=f"{vocab} {budget} {field}")


def _tie_rows(n: int, seed: int) -> np.ndarray:
    """[3, 4, n] float32 from a few levels (ties within and across chunks), 30% -inf, and special rows: all
    -inf, all equal, and +0.0 / -0.0 / +-inf / NaN mixed (lax.top_k orders them in XLA's total order)."""
    rng = np.random.default_rng(seed)
    x = rng.integers(0, 6, size=(3, 4, n)).astype(np.float32)
    x[rng.random(x.shape) < 0.3] = -np.inf
    x[1, 2] = -np.inf
    x[2, 0] = 1.5
    x[2, 1] = rng.choice(np.array([0.0, -0.0, np.inf, -np.inf, np.nan, -np.nan, 1.0], np.float32), size=n)
    return x


def _threshold(x, **kwargs):  # traced afresh every call, so a monkeypatched fallback takes effect
    return jax.jit(lambda a: threshold_top_k(a, **kwargs))(x)


def _assert_is_lax_top_k(x: np.ndarray, k: int, values, index) -> None:
    want_values, want_index = jax.lax.top_k(jnp.asarray(x), k)
    np.testing.assert_array_equal(np.asarray(total_order_key(values)), np.asarray(total_order_key(want_values)))
    np.testing.assert_array_equal(np.asarray(index), np.asarray(want_index))


@pytest.mark.parametrize("n,k,chunk,slots", [(1000, 16, 8, 64), (997, 5, 20, 24), (4096, 64, 8, 512)])
def test_threshold_top_k_equals_lax_top_k_with_ties_minus_inf_and_signed_zeros(n, k, chunk, slots, monkeypatch):
    """The fast path alone (the fallback is replaced by zeros, which would fail the comparison): the same
    values (bit for bit) and indices in the same order as one lax.top_k, ties, -inf and NaN included."""
    monkeypatch.setattr(tree_module, "chunked_top_k", lambda x, k, chunk: (jnp.zeros(x.shape[:-1] + (k,)),
                                                                           jnp.zeros(x.shape[:-1] + (k,), jnp.int32)))
    x = _tie_rows(n, n + k)
    values, index = _threshold(jnp.asarray(x), k=k, chunk=chunk, slots=slots)
    _assert_is_lax_top_k(x, k, values, index)


def test_threshold_top_k_falls_back_when_candidates_overflow(monkeypatch):
    """100 large entries in 13 consecutive chunks of 8 (fewer than k = 16 chunks): more than M - k = 48
    entries lie above the 16th largest chunk maximum, so the slots cannot hold the candidates. The real
    fallback gives lax.top_k's answer; a wrong one (zeros) shows through, so the fallback did run."""
    rng = np.random.default_rng(5)
    x = rng.standard_normal((2, 1000)).astype(np.float32)
    x[1, 300:400] = 10 + rng.standard_normal(100)
    values, index = _threshold(jnp.asarray(x), k=16, chunk=8, slots=64)
    _assert_is_lax_top_k(x, 16, values, index)
    monkeypatch.setattr(tree_module, "chunked_top_k", lambda x, k, chunk: (jnp.zeros(x.shape[:-1] + (k,)),
                                                                           jnp.zeros(x.shape[:-1] + (k,), jnp.int32)))
    values, index = _threshold(jnp.asarray(x), k=16, chunk=8, slots=64)
    assert not np.asarray(index).any() and not np.asarray(values).any()
    values, index = _threshold(jnp.asarray(x[:1]), k=16, chunk=8, slots=64)  # row 0 alone fits: fast path
    _assert_is_lax_top_k(x[:1], 16, values, index)


def test_kernel_top_k_falls_back_when_a_row_overflows(monkeypatch):
    """`kernel_top_k` (the Pallas kernel, interpreted here): a row whose 1000 large entries crowd into 32 chunks
    overflows the kernel's slots, and the batch takes the fallback, lax.top_k's answer; a wrong fallback (zeros)
    shows through, so it did run; without the crowded row the kernel's own answer stands."""
    rng = np.random.default_rng(6)
    x = rng.standard_normal((2, 8192)).astype(np.float32)
    x[1, 512:1512] = 10 + rng.standard_normal(1000)
    kernel = lambda a: jax.jit(lambda b: tree_module.kernel_top_k(b, 64))(a)  # traced afresh: the patch applies
    _assert_is_lax_top_k(x, 64, *kernel(jnp.asarray(x)))
    monkeypatch.setattr(tree_module, "chunked_top_k", lambda x, k, chunk: (jnp.zeros(x.shape[:-1] + (k,)),
                                                                           jnp.zeros(x.shape[:-1] + (k,), jnp.int32)))
    assert not np.asarray(kernel(jnp.asarray(x))[1]).any()
    _assert_is_lax_top_k(x[:1], 64, *kernel(jnp.asarray(x[:1])))
