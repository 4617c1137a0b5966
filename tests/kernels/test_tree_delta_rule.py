"""The Gated DeltaNet tree-rule kernel against an independent float64 NumPy recurrence (each node's state is its
parent's advanced over the node, from the initial state at the root) and against the model's jnp WY form
(`qwen3_5.tree_gated_delta_rule`): outputs, written values and root-path log decays, on chains and random trees
across the 16-row blocks, batch rows with different trees, and grouped key heads.

Every kernel test class runs interpreted on CPU and compiled on a GPU (marked `gpu`, skipped without one).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from ddtree_jax.models import qwen3_5
from pallas_kernels import tree_delta_rule as tdr

INTERPRET = [pytest.param(True, id="interpret"), pytest.param(False, id="compiled", marks=pytest.mark.gpu)]
KEY_HEADS, VALUE_HEADS, DK, DV = 2, 4, 16, 32


def random_parents(rng, t: int, chain: bool) -> np.ndarray:
    return np.maximum(np.arange(t) - 1, 0) if chain else np.array([0] + [int(rng.integers(0, i)) for i in range(1, t)])


def ancestor_mask(parents: np.ndarray) -> np.ndarray:
    visible = np.eye(len(parents), dtype=bool)
    for i in range(1, len(parents)):
        visible[i] |= visible[parents[i]]
    return visible


def inputs(t: int, seed: int, chain: bool = False, batch: int = 2):
    """q, k [b, T, Hk, K] (L2-normalised; q scaled), v [b, T, H, V], g <= 0, beta in (0, 1), S0, and per row its
    own tree's parents [b, T] and ancestor mask [b, T, T]."""
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(batch, t, KEY_HEADS, DK))
    q = q / np.linalg.norm(q, axis=-1, keepdims=True) * DK ** -0.5
    k = rng.normal(size=(batch, t, KEY_HEADS, DK))
    k = k / np.linalg.norm(k, axis=-1, keepdims=True)
    v = rng.normal(size=(batch, t, VALUE_HEADS, DV))
    g = -np.abs(rng.normal(size=(batch, t, VALUE_HEADS))) * 0.3
    beta = 1 / (1 + np.exp(-rng.normal(size=(batch, t, VALUE_HEADS))))
    s0 = rng.normal(size=(batch, VALUE_HEADS, DK, DV)) * 0.3
    parents = np.stack([random_parents(rng, t, chain) for _ in range(batch)])
    visible = np.stack([ancestor_mask(p) for p in parents])
    return (q, k, v, g, beta, s0), parents, visible


def near_parallel_inputs(t: int, seed: int):
    """A chain whose keys are nearly parallel, beta 0.99 and decays near 1: A's entries near 1, where the inverse
    of I + A cancels heavily (a float32 product form of the inverse loses ~3 digits here)."""
    rng = np.random.default_rng(seed)
    k = rng.normal(size=(1, 1, KEY_HEADS, DK)) + 0.01 * rng.normal(size=(1, t, KEY_HEADS, DK))
    k = k / np.linalg.norm(k, axis=-1, keepdims=True)
    v = rng.normal(size=(1, t, VALUE_HEADS, DV))
    g = -np.abs(rng.normal(size=(1, t, VALUE_HEADS))) * 0.01
    s0 = rng.normal(size=(1, VALUE_HEADS, DK, DV)) * 0.3
    parents = random_parents(None, t, True)[None]
    return (k * DK ** -0.5, k, v, g, np.full(g.shape, 0.99), s0), parents, ancestor_mask(parents[0])[None]


def recurrence_float64(q, k, v, g, beta, s0, parents):
    """Node by node: S_i = e^{g_i} S_parent + k_i d_i^T with d_i = beta_i (v_i - (e^{g_i} S_parent)^T k_i) (the
    written value), out_i = S_i^T q_i, G_i = g_i + G_parent; the root (node 0) starts from S0."""
    b, t, hk, _ = q.shape
    h = v.shape[2]
    group = h // hk
    out, written, cum = np.zeros(v.shape), np.zeros(v.shape), np.zeros(g.shape)
    for r in range(b):
        states = {}
        for i in range(t):
            for head in range(h):
                parent_state = s0[r, head] if i == 0 else states[parents[r, i], head]
                parent_cum = 0.0 if i == 0 else cum[r, parents[r, i], head]
                kh, qh = k[r, i, head // group], q[r, i, head // group]
                decayed = np.exp(g[r, i, head]) * parent_state
                d = beta[r, i, head] * (v[r, i, head] - decayed.T @ kh)
                states[i, head] = decayed + np.outer(kh, d)
                out[r, i, head] = states[i, head].T @ qh
                written[r, i, head] = d
                cum[r, i, head] = parent_cum + g[r, i, head]
    return out, written, cum


def run_kernel(args, visible, interpret, precision="highest", config=None):
    q, k, v, g, beta, s0 = (jnp.asarray(x, jnp.float32) for x in args)
    return tdr.tree_delta_rule(q, k, v, g, beta, s0, jnp.asarray(visible), precision=precision, config=config,
                               interpret=interpret)


def run_model_rule(args, visible):
    q, k, v, g, beta, s0 = (jnp.asarray(x, jnp.float32) for x in args)
    group = VALUE_HEADS // KEY_HEADS
    out, _, written, cum = qwen3_5.tree_gated_delta_rule(jnp.repeat(q, group, 2), jnp.repeat(k, group, 2), v, g, beta,
                                                         s0, jnp.asarray(visible))
    return out, written, cum


# T = 1; a chain of 16 (one whole block, DFlash's verify); 17 and 40 (a partial block after whole ones), random
# trees; 65 (DDTree B = 64: five blocks, the "every node" side padded to 128).
CASES = [(1, False), (16, True), (17, False), (40, False), (65, False)]


# The forms: one launch (each program walks its head's blocks, reading earlier ones back), two launches (all
# tiles and diagonal inverses first, then the chain with the solved rows in registers), the chain in a device loop
# over the blocks or unrolled (`default_config` up to UNROLLED_MAX_NODES), and the direct form (node 0 alone, then
# the other nodes at once through their system's whole inverse).
FORMS = [pytest.param({"two_launch": False, "unrolled_chain": False, "direct": False}, id="one-launch"),
         pytest.param({"two_launch": True, "unrolled_chain": False, "direct": False}, id="two-launch"),
         pytest.param({"two_launch": True, "unrolled_chain": True, "direct": False}, id="two-launch-unrolled"),
         pytest.param({"two_launch": False, "unrolled_chain": False, "direct": True}, id="direct")]
# The two-launch chain's other knobs, each at a width whose chain walks several blocks: the initial state's terms
# by XLA (T = 17: two blocks, rolled; T = 65: five, unrolled), blocks of 32 rows (T = 65: three, rolled and
# unrolled).
CHAIN_VARIANTS = [pytest.param(17, {"s0_in_xla": True, "unrolled_chain": False}, id="17-s0-xla"),
                  pytest.param(65, {"s0_in_xla": True, "unrolled_chain": True}, id="65-s0-xla-unrolled"),
                  pytest.param(65, {"unrolled_chain": False, "block_rows": 32}, id="65-rows32"),
                  pytest.param(65, {"unrolled_chain": True, "block_rows": 32}, id="65-rows32-unrolled")]


@pytest.mark.parametrize("interpret", INTERPRET)
@pytest.mark.parametrize("form", FORMS)
class TestTreeDeltaRuleKernel:
    @pytest.mark.parametrize("t,chain", CASES, ids=[f"T{t}{'-chain' if c else ''}" for t, c in CASES])
    def test_matches_the_float64_recurrence_and_the_model_rule(self, t, chain, form, interpret):
        args, parents, visible = inputs(t, seed=t, chain=chain)
        config = dataclasses.replace(tdr.default_config(t), **form)
        got = [np.asarray(x, np.float64) for x in run_kernel(args, visible, interpret, config=config)]
        want = recurrence_float64(*args, parents)
        for name, x, y in zip(("out", "v_new", "G"), got, want):
            np.testing.assert_allclose(x, y, rtol=2e-4, atol=2e-5, err_msg=name)
        for name, x, y in zip(("out", "v_new", "G"), got, run_model_rule(args, visible)):
            np.testing.assert_allclose(x, np.asarray(y), rtol=1e-4, atol=1e-5, err_msg=f"{name} vs the jnp rule")

    def test_value_columns_split_over_programs(self, form, interpret):
        """value_block 16 runs each head's 32 value columns in two programs, each solving its own columns: the
        same results as the float64 recurrence."""
        args, parents, visible = inputs(40, seed=11)
        config = tdr.TreeDeltaRuleConfig(value_block=16, **form)
        got = run_kernel(args, visible, interpret, config=config)
        for name, x, y in zip(("out", "v_new", "G"), got, recurrence_float64(*args, parents)):
            np.testing.assert_allclose(np.asarray(x, np.float64), y, rtol=2e-4, atol=2e-5, err_msg=name)

    def test_near_parallel_keys(self, form, interpret):
        """The diagonal blocks' inverse stays float32-exact where I + A is ill-conditioned (the product form of
        the inverse, tried, is off by ~1e-3 in v_new here)."""
        args, parents, visible = near_parallel_inputs(40, seed=0)
        config = dataclasses.replace(tdr.default_config(40), **form)
        got = run_kernel(args, visible, interpret, config=config)
        for name, x, y in zip(("out", "v_new", "G"), got, recurrence_float64(*args, parents)):
            np.testing.assert_allclose(np.asarray(x, np.float64), y, rtol=2e-4, atol=2e-5, err_msg=name)

    def test_the_tree_shapes_the_result(self, form, interpret):
        """Negative control: the same inputs under another tree (a chain) give other outputs, so the agreement
        above is the tree's, not the inputs' alone."""
        args, parents, visible = inputs(40, seed=3)
        chain = np.broadcast_to(ancestor_mask(random_parents(None, 40, True)), visible.shape)
        config = dataclasses.replace(tdr.default_config(40), **form)
        tree_out = np.asarray(run_kernel(args, visible, interpret, config=config)[0])
        chain_out = np.asarray(run_kernel(args, chain, interpret, config=config)[0])
        assert not np.allclose(tree_out, chain_out, rtol=1e-3, atol=1e-4)
        np.testing.assert_allclose(chain_out, recurrence_float64(*args, np.broadcast_to(
            random_parents(None, 40, True), parents.shape))[0], rtol=2e-4, atol=2e-5)


@pytest.mark.parametrize("interpret", INTERPRET)
@pytest.mark.parametrize("t,form", CHAIN_VARIANTS)
def test_chain_variants_match_the_float64_recurrence(t, form, interpret):
    """The chain's knobs on random trees past one block (a partial last block) and on near-parallel keys."""
    config = tdr.TreeDeltaRuleConfig(two_launch=True, **form)
    for args, parents, visible in (inputs(t, seed=t), near_parallel_inputs(t, seed=1)):
        got = run_kernel(args, visible, interpret, config=config)
        for name, x, y in zip(("out", "v_new", "G"), got, recurrence_float64(*args, parents)):
            np.testing.assert_allclose(np.asarray(x, np.float64), y, rtol=2e-4, atol=2e-5, err_msg=name)


@pytest.mark.parametrize("interpret", INTERPRET)
def test_direct_form_where_node_0_is_not_every_node_s_ancestor(interpret):
    """The direct form solves node 0 first and takes its term off every row below it: in a forest whose second
    root (node 1) heads half the nodes, those rows must not see node 0. Against the model's jnp rule, and a
    negative control: the single tree with node 1 under node 0 gives other outputs."""
    args, parents, _ = inputs(20, seed=7, batch=1)
    forest = parents.copy()
    forest[0, 1] = 1  # node 1 its own root: its subtree stops at it
    visible = np.eye(20, dtype=bool)
    for i in range(1, 20):
        if forest[0, i] != i:
            visible[i] |= visible[forest[0, i]]
    assert not visible[1:, 0].all() and visible[1:, 0].any()
    config = tdr.TreeDeltaRuleConfig(direct=True)
    got = run_kernel(args, visible[None], interpret, config=config)
    for name, x, y in zip(("out", "v_new", "G"), got, run_model_rule(args, visible[None])):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-4, atol=1e-5, err_msg=name)
    tree = run_kernel(args, ancestor_mask(parents[0])[None], interpret, config=config)[0]
    assert not np.allclose(np.asarray(tree), np.asarray(got[0]), rtol=1e-3, atol=1e-4)


def test_default_precision_is_close():
    """"default" (TF32 on a GPU's tensor cores; exact float32 in the interpreter) stays within TF32 rounding."""
    args, parents, visible = inputs(17, seed=5, batch=1)
    got = np.asarray(run_kernel(args, visible, True, precision="default")[0])
    np.testing.assert_allclose(got, recurrence_float64(*args, parents)[0], rtol=2e-2, atol=2e-3)


def test_refuses_what_it_does_not_take():
    args, _, visible = inputs(5, seed=1, batch=1)
    assert tdr.supports(tdr.MAX_NODES, 128, 128) and not tdr.supports(tdr.MAX_NODES + 1, 128, 128)
    assert not tdr.supports(5, 96, 128)
    q, k, v, g, beta, s0 = (jnp.asarray(x, jnp.float32) for x in args)
    with pytest.raises(ValueError, match="Hk dividing H"):
        tdr.tree_delta_rule(q, k, v[:, :, :3], g[..., :3], beta[..., :3], s0[:, :3], jnp.asarray(visible),
                            interpret=True)
    with pytest.raises(ValueError, match="precision='fast'"):
        tdr.tree_delta_rule(q, k, v, g, beta, s0, jnp.asarray(visible), precision="fast", interpret=True)
    with pytest.raises(ValueError, match="num_warps=3"):
        tdr.TreeDeltaRuleConfig(num_warps=3)
    with pytest.raises(ValueError, match="value_block=8"):
        tdr.TreeDeltaRuleConfig(value_block=8)
    with pytest.raises(ValueError, match="tile_warps=3"):
        tdr.TreeDeltaRuleConfig(tile_warps=3)
    with pytest.raises(ValueError, match="direct and two_launch"):
        tdr.TreeDeltaRuleConfig(direct=True, two_launch=True)
    with pytest.raises(ValueError, match="inverse_passes=2"):
        tdr.TreeDeltaRuleConfig(direct=True, inverse_passes=2)
    with pytest.raises(ValueError, match="block_rows=32 is a knob of the two-launch form"):
        tdr.TreeDeltaRuleConfig(block_rows=32)
    with pytest.raises(ValueError, match="block_rows=24"):
        tdr.TreeDeltaRuleConfig(two_launch=True, block_rows=24)
