"""The DFlash drafter against an independent float64 NumPy reference of the same math."""

from __future__ import annotations

import dataclasses
import json

import jax.numpy as jnp
import numpy as np
import pytest

from ddtree_jax.checkpoint import load_drafter, load_target
from ddtree_jax.models import dflash
from ddtree_jax.random_checkpoint import tiny_qwen3_config, write_random_dflash, write_random_qwen3
from conftest import YARN_ROPE_SCALING


# ---- float64 reference, written from the reference drafter's description, sharing no code with the package


def rms_norm(x, w, eps=1e-6):
    return w * x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)


def rope_frequencies(cfg, d):
    """Inverse frequencies [d/2] and the cos/sin scale, from `rope_theta` and an optional YaRN `rope_scaling`
    (written from transformers' `_compute_yarn_parameters`: pair i keeps its frequency below pair `low`, is
    divided by `factor` above `high`, linear between; low/high are where a pair turns 32 and 1 times in the
    original context, rounded outwards; cos and sin scale by 0.1 ln(factor) + 1)."""
    theta, scaling = cfg["rope_theta"], cfg.get("rope_scaling")
    inv = 1.0 / theta ** (np.arange(0, d, 2) / d)
    if not scaling:
        return inv, 1.0
    assert scaling["rope_type"] == "yarn"
    assert set(scaling) == {"rope_type", "factor", "original_max_position_embeddings"}  # the defaults below
    factor, original = scaling["factor"], scaling["original_max_position_embeddings"]

    def turning(turns):  # the (fractional) pair index that turns `turns` times in the original context
        return d * np.log(original / (turns * 2 * np.pi)) / (2 * np.log(theta))

    low, high = max(np.floor(turning(32)), 0), min(np.ceil(turning(1)), d - 1)
    assert low < high
    scaled = np.clip((np.arange(d // 2) - low) / (high - low), 0, 1)  # 0: kept, 1: divided by factor
    return inv * (1 - scaled) + inv / factor * scaled, 0.1 * np.log(factor) + 1


def rope(x, pos, inv, scale):
    """x [t, heads, d], pos [t]: neox half rotation over the full head dim, cos and sin times `scale`."""
    d = x.shape[-1]
    ang = pos[:, None] * inv[None, :]
    cos, sin = (scale * f(np.concatenate([ang, ang], -1))[:, None] for f in (np.cos, np.sin))
    rot = np.concatenate([-x[..., d // 2:], x[..., :d // 2]], -1)
    return x * cos + rot * sin


def reference_draft_logits(w, tw, cfg, taps, block, start):
    """w/tw: drafter/target weights (float64 dicts); taps [start, F]: context rows for positions 0..start-1;
    block [bs] token ids at positions start..start+bs-1. Returns [bs-1, v]."""
    d, nq, nkv = cfg["head_dim"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    inv, scale = rope_frequencies(cfg, d)
    layer_types = cfg["layer_types"]
    window = cfg["sliding_window"] if cfg.get("use_sliding_window") else None
    ctx = rms_norm(taps @ w["fc.weight"].T, w["hidden_norm.weight"])
    bs = len(block)
    qpos = start + np.arange(bs)
    kpos = np.concatenate([np.arange(start), qpos])
    h = tw["model.embed_tokens.weight"][block]
    for i in range(cfg["num_hidden_layers"]):
        p = f"layers.{i}."
        sliding = layer_types[i] == "sliding_attention"
        causal = sliding if cfg.get("is_causal") is None else cfg["is_causal"]
        win = window if sliding else None
        x = rms_norm(h, w[p + "input_layernorm.weight"])
        q = rms_norm((x @ w[p + "self_attn.q_proj.weight"].T).reshape(bs, nq, d), w[p + "self_attn.q_norm.weight"])
        kv_in = np.concatenate([ctx, x])
        k = rms_norm((kv_in @ w[p + "self_attn.k_proj.weight"].T).reshape(-1, nkv, d), w[p + "self_attn.k_norm.weight"])
        v = (kv_in @ w[p + "self_attn.v_proj.weight"].T).reshape(-1, nkv, d)
        q, k = rope(q, qpos, inv, scale), rope(k, kpos, inv, scale)
        allowed = np.ones((bs, len(kpos)), bool)
        if causal:
            allowed &= kpos[None, :] <= qpos[:, None]
        if win is not None:
            allowed &= np.abs(qpos[:, None] - kpos[None, :]) < win
        out = np.zeros((bs, nq, d))
        for head in range(nq):
            kv = head // (nq // nkv)
            s = (q[:, head] @ k[:, kv].T) * d ** -0.5
            s = np.where(allowed, s, -np.inf)
            pr = np.exp(s - s.max(-1, keepdims=True))
            pr /= pr.sum(-1, keepdims=True)
            out[:, head] = pr @ v[:, kv]
        h = h + out.reshape(bs, -1) @ w[p + "self_attn.o_proj.weight"].T
        y = rms_norm(h, w[p + "post_attention_layernorm.weight"])
        g, u = y @ w[p + "mlp.gate_proj.weight"].T, y @ w[p + "mlp.up_proj.weight"].T
        h = h + (g / (1 + np.exp(-g)) * u) @ w[p + "mlp.down_proj.weight"].T
    h = rms_norm(h, w["norm.weight"])
    return h[1:] @ tw["lm_head.weight"].T


DRAFTER_VARIANTS = {
    "noncausal_full": dict(),
    "causal_sliding": dict(layer_types=["sliding_attention", "full_attention"], sliding_window=5,
                           use_sliding_window=True),
    "noncausal_sliding": dict(layer_types=["full_attention", "sliding_attention"], sliding_window=3,
                              use_sliding_window=True, is_causal=False),
    "all_causal": dict(is_causal=True, block_size=6),
    "yarn_rope_scaling": dict(rope_scaling=YARN_ROPE_SCALING),
}


@pytest.mark.parametrize("variant", sorted(DRAFTER_VARIANTS))
def test_drafter_matches_float64_reference(tmp_path, variant):
    target_cfg = tiny_qwen3_config(num_hidden_layers=3)
    target_dir = write_random_qwen3(tmp_path / "t", seed=0, with_tokenizer=False, num_hidden_layers=3)
    drafter_dir = write_random_dflash(tmp_path / "d", target_cfg, seed=1, **DRAFTER_VARIANTS[variant])
    target = load_target(target_dir, jnp.float32)
    drafter = load_drafter(drafter_dir, target.config, jnp.float32)
    cfg = json.loads((drafter_dir / "config.json").read_text())
    w = {k: np.asarray(v, np.float64) for k, v in drafter.flat().items()}
    tw = {k: np.asarray(v, np.float64) for k, v in target.flat().items()}
    bs = drafter.config.block_size
    features = len(drafter.config.target_layer_ids) * target.config.hidden_size
    rng = np.random.default_rng(2)

    # Two rows with different context lengths, fed in two chunks each (as prefill, then a round commit).
    first, second = [5, 2], [3, 4]
    total = max(a + b for a, b in zip(first, second))
    taps = rng.standard_normal((2, total, features)).astype(np.float32)
    cache = dflash.create_cache(drafter.config, 2, 32, jnp.float32)
    chunk1 = np.zeros((2, max(first), features), np.float32)
    chunk2 = np.zeros((2, 4, features), np.float32)
    for r in range(2):
        chunk1[r, :first[r]] = taps[r, :first[r]]
        chunk2[r, :second[r]] = taps[r, first[r]:first[r] + second[r]]
    cache = dflash.ingest_context(drafter, jnp.asarray(chunk1), jnp.asarray(first), cache)
    cache = dflash.ingest_context(drafter, jnp.asarray(chunk2), jnp.asarray(second), cache)
    blocks = rng.integers(0, 319, size=(2, bs))
    ours = np.asarray(dflash.draft_logits(drafter, target, jnp.asarray(blocks), cache))
    for r in range(2):
        n = first[r] + second[r]
        ref = reference_draft_logits(w, tw, cfg, taps[r, :n].astype(np.float64), blocks[r], n)
        np.testing.assert_allclose(ours[r], ref, atol=1e-5, rtol=0, err_msg=f"row {r}")
        if "rope_scaling" in cfg:  # negative control: YaRN moves the reference far beyond the tolerance
            plain = reference_draft_logits(w, tw, dict(cfg, rope_scaling=None), taps[r, :n].astype(np.float64),
                                           blocks[r], n)
            assert np.abs(plain - ref).max() > 1e-3


def test_wrong_semantics_are_caught_by_the_reference(tmp_path):
    """Negative control: ignoring a layer's causal/sliding rule changes the logits well beyond 1e-5."""
    target_cfg = tiny_qwen3_config(num_hidden_layers=3)
    target = load_target(write_random_qwen3(tmp_path / "t", with_tokenizer=False, num_hidden_layers=3), jnp.float32)
    drafter = load_drafter(write_random_dflash(tmp_path / "d", target_cfg, seed=1,
                                               **DRAFTER_VARIANTS["causal_sliding"]), target.config, jnp.float32)
    taps = jnp.asarray(np.random.default_rng(0).standard_normal((1, 9, 128)), jnp.float32)
    cache = dflash.ingest_context(drafter, taps, jnp.array([9]), dflash.create_cache(drafter.config, 1, 32, jnp.float32))
    block = jnp.asarray([[5, 6, 7, 8]])
    right = dflash.draft_logits(drafter, target, block, cache)
    wrong_cfg = dataclasses.replace(drafter.config, layer_causal=(False, False), layer_windows=(None, None))
    wrong = dflash.draft_logits(dataclasses.replace(drafter, config=wrong_cfg), target, block, cache)
    assert float(jnp.abs(right - wrong).max()) > 1e-3
