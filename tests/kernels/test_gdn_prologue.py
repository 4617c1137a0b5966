"""The Gated DeltaNet prologue kernel (conv over each node's root path, SiLU, q/k norms, gates) against its jnp
reference, the reference against an independent float64 NumPy statement (each node's conv reads the last taps of
its root path's inputs, the committed window above the root), and the model's tree branch with the kernel against
its jnp form.

Every kernel test class runs interpreted on CPU and compiled on a GPU (marked `gpu`, skipped without one).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import gdn_prologue as gp

INTERPRET = [pytest.param(True, id="interpret"), pytest.param(False, id="compiled", marks=pytest.mark.gpu)]
TAPS = 4


def random_forest(rng, t: int, batch: int):
    """parents [b, T] (-1 at a root) and depths [b, T]: random trees, several roots a row (a root reads only the
    committed window; a node at depth 1 or 2 reads both), parents before children."""
    parents, depths = np.full((batch, t), -1, np.int32), np.zeros((batch, t), np.int32)
    for row in range(batch):
        for i in range(1, t):
            p = int(rng.integers(-1, i))
            parents[row, i], depths[row, i] = p, (0 if p < 0 else depths[row, p] + 1)
    return parents, depths


def inputs(t: int, key_heads: int, value_heads: int, dim: int, dtype, seed: int, batch: int = 2):
    rng = np.random.default_rng(seed)
    channels = (2 * key_heads + value_heads) * dim
    parents, depths = random_forest(rng, t, batch)
    normal = lambda *shape: jnp.asarray(rng.normal(size=shape), dtype)  # noqa: E731
    return (normal(batch, t, channels), normal(batch, channels, TAPS - 1), normal(channels, TAPS) * 0.5,
            jnp.asarray(parents), jnp.asarray(depths), normal(batch, t, value_heads), normal(batch, t, value_heads),
            normal(value_heads), normal(value_heads))


def float64_statement(mixed, window, conv_w, parents, depths, a, b, a_log, dt_bias, key_heads, dim):
    """Node by node in float64: the conv over the last TAPS inputs of the node's root path (window first)."""
    mixed, window, conv_w, a, b, a_log, dt_bias = (np.asarray(x, np.float64) for x in
                                                    (mixed, window, conv_w, a, b, a_log, dt_bias))
    batch, t, _ = mixed.shape
    y = np.zeros_like(mixed)
    for row in range(batch):
        for i in range(t):
            path, node = [], i
            while node >= 0 and len(path) < TAPS:
                path.append(mixed[row, node])
                node = parents[row, node] if depths[row, node] > 0 else -1
            seq = list(window[row].T) + path[::-1]  # oldest first
            conv = sum(conv_w[:, j] * seq[len(seq) - TAPS + j] for j in range(TAPS))
            y[row, i] = conv / (1 + np.exp(-conv))
    kd = key_heads * dim
    unit = lambda x: x / np.sqrt(np.sum(x * x, axis=-1, keepdims=True) + gp.NORM_EPS)  # noqa: E731
    q = unit(y[..., :kd].reshape(batch, t, key_heads, dim)) * dim ** -0.5
    k = unit(y[..., kd:2 * kd].reshape(batch, t, key_heads, dim))
    v = y[..., 2 * kd:].reshape(batch, t, -1, dim)
    g = -np.exp(a_log) * np.log1p(np.exp(a + dt_bias))
    return q, k, v, g, 1 / (1 + np.exp(-b))


def test_reference_equals_the_float64_root_path_statement():
    args = inputs(21, key_heads=2, value_heads=4, dim=16, dtype=jnp.float32, seed=1)
    assert int(jnp.max(args[4])) >= TAPS  # some nodes read no window, some part of it, roots all of it
    got = gp.gdn_prologue_reference(*args, key_heads=2, key_dim=16, value_dim=16)
    want = float64_statement(*args, key_heads=2, dim=16)
    for name, g, w in zip(("q", "k", "v", "g", "beta"), got, want):
        np.testing.assert_allclose(np.asarray(g, np.float64), w, rtol=2e-5, atol=2e-5, err_msg=name)


@pytest.mark.parametrize("interpret", INTERPRET)
@pytest.mark.parametrize("t,key_heads,value_heads,dim,dtype", [
    (1, 1, 3, 16, jnp.float32), (21, 2, 4, 16, jnp.float32), (21, 2, 4, 16, jnp.bfloat16),
    pytest.param(64, 16, 48, 128, jnp.bfloat16, id="qwen3.6-27b-b63", marks=pytest.mark.gpu)])
def test_kernel_matches_reference(interpret, t, key_heads, value_heads, dim, dtype):
    """Every output of every node, trees with several roots; bf16 within a rounding of y (the conv's float32 sum
    may round to the other bf16 neighbour)."""
    args = inputs(t, key_heads, value_heads, dim, dtype, seed=t)
    shapes = dict(key_heads=key_heads, key_dim=dim, value_dim=dim)
    got = gp.gdn_prologue_pallas(*args, **shapes, interpret=interpret)
    want = gp.gdn_prologue_reference(*args, **shapes)
    tol = 1e-5 if dtype == jnp.float32 else 2e-2
    for name, g, w in zip(("q", "k", "v", "g", "beta"), got, want):
        assert g.shape == w.shape and g.dtype == jnp.float32, name
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=tol, atol=tol, err_msg=name)


def test_rejects_unequal_head_dims_and_wide_trees():
    assert gp.supports(gp.MAX_NODES, 128, 128) and not gp.supports(gp.MAX_NODES + 1, 128, 128)
    assert not gp.supports(16, 128, 64) and not gp.supports(16, 24, 24)
    args = inputs(3, key_heads=1, value_heads=2, dim=16, dtype=jnp.float32, seed=0)
    with pytest.raises(ValueError, match="window"):
        gp.gdn_prologue_pallas(args[0], args[1][..., :1], *args[2:], key_heads=1, key_dim=16, value_dim=16,
                               interpret=True)


def test_the_models_tree_branch_with_the_kernel_equals_its_jnp_form(monkeypatch):
    """A Gated DeltaNet layer's tree verify (`qwen3_5.PROLOGUE_KERNEL` on the Pallas path: interpreted here, compiled
    on a GPU) gives its jnp form's outputs and node records: the wiring (the conv weight's taps, the window, the
    gates' inputs) is the model's."""
    from flax import nnx

    from ddtree_jax.cache import RecurrentState
    from ddtree_jax.config import parse_qwen3_5
    from ddtree_jax.models import qwen3_5
    from ddtree_jax.models.contract import Runtime
    from ddtree_jax.random_checkpoint import tiny_qwen3_5_config

    config = parse_qwen3_5(tiny_qwen3_5_config())
    layer = qwen3_5.GatedDeltaNet(config, dtype=jnp.float32, rngs=nnx.Rngs(3))
    rng = np.random.default_rng(7)
    for name in ("A_log", "dt_bias"):  # not their inits (zeros, ones): every gate input matters
        getattr(layer, name)[...] = jnp.asarray(rng.normal(size=getattr(layer, name).shape) * 0.5, jnp.float32)
    t, hv = 9, config.linear_num_value_heads
    dk, dv = config.linear_key_head_dim, config.linear_value_head_dim
    state = RecurrentState(state=jnp.asarray(rng.normal(size=(1, hv, dk, dv)) * 0.1, jnp.float32),
                           conv=jnp.asarray(rng.normal(size=(1, config.linear_conv_dim, config.linear_conv_kernel - 1)),
                                            jnp.float32))
    parents, depths = random_forest(rng, t, 1)
    visible = np.eye(t, dtype=bool)[None].repeat(1, 0)
    for i in range(t):
        if parents[0, i] >= 0:
            visible[0, i] |= visible[0, parents[0, i]]
    x = jnp.asarray(rng.normal(size=(1, t, config.hidden_size)), jnp.float32)

    def run(kernel: bool):
        monkeypatch.setattr(qwen3_5, "PROLOGUE_KERNEL", kernel)
        return layer(x, state, jnp.array([t]), jnp.asarray(parents), jnp.asarray(depths), jnp.asarray(visible),
                     runtime=Runtime("pallas"))

    (out, _, nodes), (want_out, _, want_nodes) = run(True), run(False)
    np.testing.assert_allclose(np.asarray(out), np.asarray(want_out), rtol=1e-4, atol=1e-5)
    for got, want in zip(jax.tree.leaves(nodes), jax.tree.leaves(want_nodes)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-5)
