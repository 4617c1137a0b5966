"""Packed projections (`layers.PackedProjections`) against the separate HF projections they hold."""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ddtree_jax.config import Fp8Config
from ddtree_jax.models.layers import PackedProjections, Part, apply_fp8

# GQA with 2 KV heads of 3 query heads each, head dim 4, input 8: q has 24 rows, k and v 8 each.
N, M, D, E = 2, 3, 4, 8
PARTS = (Part("q_proj", M, ("q_heads", "embed"), N * M), Part("k_proj", 1, ("kv_heads", "embed"), N),
         Part("v_proj", 1, ("kv_heads", "embed"), N))


class Attention(nnx.Module):
    def __init__(self, rngs):
        self.qkv_proj = PackedProjections(E, N, D, PARTS, ("kv_heads", None, None, "embed"), dtype=jnp.float32,
                                          rngs=rngs)


def hf_weights(seed=0):
    rng = np.random.default_rng(seed)
    return {"q_proj": rng.standard_normal((N * M * D, E)), "k_proj": rng.standard_normal((N * D, E)),
            "v_proj": rng.standard_normal((N * D, E))}


def test_packed_rows_are_the_hf_rows_group_after_group():
    """Packed row (g, u, r) of part p is HF row (g * units_p + u) * R + r: checked entry by entry, written out
    from the layout rule (not from `pack`), and `unpack` gives the HF tensors back exactly."""
    module = Attention(nnx.Rngs(0)).qkv_proj
    hf = hf_weights()
    packed = module.pack(hf)
    assert packed.shape == (N, M + 2, D, E)
    for g in range(N):
        for r in range(D):
            for u in range(M):
                np.testing.assert_array_equal(packed[g, u, r], hf["q_proj"][(g * M + u) * D + r])
            np.testing.assert_array_equal(packed[g, M, r], hf["k_proj"][g * D + r])
            np.testing.assert_array_equal(packed[g, M + 1, r], hf["v_proj"][g * D + r])
    unpacked = module.unpack(packed)
    assert all(np.array_equal(unpacked[name], hf[name]) for name in hf)


def test_outputs_equal_the_separate_projections():
    """One matmul over the packed weight gives every part's output as x @ W_part.T (float64 NumPy reference);
    a packing that swapped k and v would fail."""
    module = Attention(nnx.Rngs(0)).qkv_proj
    hf = hf_weights(1)
    module.weight = nnx.Param(jnp.asarray(module.pack(hf), jnp.float32), axes=module.weight.axes)
    x = np.random.default_rng(2).standard_normal((2, 5, E))
    outs = module(jnp.asarray(x, jnp.float32))
    for out, name in zip(outs, ("q_proj", "k_proj", "v_proj")):
        np.testing.assert_allclose(np.asarray(out), x @ hf[name].T, rtol=1e-5, atol=1e-5)


def test_fp8_keeps_the_parts_apart_and_refuses_a_split_decision():
    """FP8 parts become separate Linears named as the HF parts (their scales may straddle groups), with the
    packed values; a quantization_config that converts q_proj but not k_proj is refused."""
    module = Attention(nnx.Rngs(0))
    before = module.qkv_proj.unpack(module.qkv_proj.weight[...])
    apply_fp8(module, type("C", (), {"fp8": Fp8Config(block=(4, 4), not_converted=())})())
    assert not module.qkv_proj.packed
    q = module.qkv_proj.q_proj
    assert q.weight[...].dtype == jnp.float8_e4m3fn and q.weight_scale_inv[...].shape == (N * M * D // 4, E // 4)
    np.testing.assert_allclose(np.asarray(q.dense_weight(jnp.float32)), np.asarray(before["q_proj"]), rtol=0.07,
                               atol=1e-3)
    with pytest.raises(ValueError, match="converts some of q_proj, k_proj, v_proj to FP8 but not all"):
        apply_fp8(Attention(nnx.Rngs(0)), type("C", (), {"fp8": Fp8Config(block=(4, 4), not_converted=("k_proj",))})())
