"""A hand-built target/drafter pair whose drafter is right only with the right mask token and tap layers.

Random drafters accept almost nothing, so they cannot show a doctor telling a good pair from a broken
one. Here every weight is set by hand (hidden 32, target 4 layers, vocab 16, drafter 1 layer, block 4):

- target: every token embeds as 10*e0 + 1*e2 (+ small noise on dims 9..); the mask token also has 1*e3.
  Attention writes nothing; layer l's MLP adds a marker ~1*e(4+l). lm_head row X = 40 * (0.5*e0 + e1 +
  e3), so the target always predicts X.
- drafter: `fc` turns tap slot j into (marker of layer ids[j]) - (marker of ids[j] + 1), which is ~1 only
  when the tap really is the output of layer ids[j] (HF hidden_states[l + 1]); summed into e1, with a
  constant 0.1*e0-per-tap into e8. Uniform attention (q = 0) carries the context's e1 into the block;
  the final norm keeps dims 1, 2, 3 only. lm_head row Z = 40 * 1.15*e2 competes with X, so the
  drafter says X only when the context signal (right tap layers) and the mask marker (right mask token)
  are both there.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ddtree_jax.checkpoint import save_hf
from ddtree_jax.random_checkpoint import tiny_dflash_config, tiny_qwen3_config

HIDDEN, LAYERS, VOCAB, X, Z = 32, 4, 16, 7, 11
MASK = VOCAB - 1
TAP_IDS = [1, 2]


def target_config() -> dict:
    return tiny_qwen3_config(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS, intermediate_size=8,
                             num_attention_heads=2, num_key_value_heads=1, head_dim=16, eos_token_id=None,
                             bos_token_id=None)


def drafter_config(**overrides) -> dict:
    config = tiny_dflash_config(target_config(), num_hidden_layers=1, layer_types=["full_attention"],
                                num_attention_heads=2, num_key_value_heads=1, head_dim=16, intermediate_size=8,
                                block_size=4)
    config["dflash_config"] = {"mask_token_id": MASK, "target_layer_ids": list(TAP_IDS)}
    config.update(overrides)
    return config


def _target_arrays(rng) -> dict[str, np.ndarray]:
    e = HIDDEN
    a = {"model.embed_tokens.weight": np.zeros((VOCAB, e)), "model.norm.weight": np.ones(e),
         "lm_head.weight": 0.02 * rng.standard_normal((VOCAB, e))}
    a["model.embed_tokens.weight"][:, 0] = 10.0
    a["model.embed_tokens.weight"][:, 2] = 1.0
    a["model.embed_tokens.weight"][:, 9:] = 0.3 * rng.standard_normal((VOCAB, e - 9))
    a["model.embed_tokens.weight"][MASK, 3] = 1.0
    # Scaled by 40 so the drafter is confident (p(X) ~ 0.98 when both signals are right): a chain of X
    # then outranks every alternative in a draft tree.
    a["lm_head.weight"][X, :4] = [20.0, 40.0, 0.0, 40.0]
    a["lm_head.weight"][Z, :4] = [0.0, 0.0, 46.0, 0.0]
    # n0 = the normalised e0 component seen by each MLP, about 10 / rms(x) = 5.5; silu(5.5) * 5.5 ~ 30.
    n0 = 10.0 / np.sqrt(103.0 / e)
    for layer in range(LAYERS):
        p = f"model.layers.{layer}."
        a[p + "input_layernorm.weight"] = np.ones(e)
        a[p + "post_attention_layernorm.weight"] = np.ones(e)
        a[p + "self_attn.q_proj.weight"] = 0.02 * rng.standard_normal((32, e))
        a[p + "self_attn.k_proj.weight"] = 0.02 * rng.standard_normal((16, e))
        a[p + "self_attn.v_proj.weight"] = 0.02 * rng.standard_normal((16, e))
        a[p + "self_attn.o_proj.weight"] = np.zeros((e, 32))
        a[p + "self_attn.q_norm.weight"] = np.ones(16)
        a[p + "self_attn.k_norm.weight"] = np.ones(16)
        gate, up, down = np.zeros((8, e)), np.zeros((8, e)), np.zeros((e, 8))
        gate[0, 0] = up[0, 0] = 1.0
        down[4 + layer, 0] = 1.0 / (n0 * n0 / (1 + np.exp(-n0)))
        a[p + "mlp.gate_proj.weight"], a[p + "mlp.up_proj.weight"], a[p + "mlp.down_proj.weight"] = gate, up, down
    return {k: v.astype(np.float32) for k, v in a.items()}


def _drafter_arrays(rng) -> dict[str, np.ndarray]:
    e = HIDDEN
    fc = np.zeros((e, len(TAP_IDS) * e))
    for j, layer in enumerate(TAP_IDS):
        fc[1, j * e + 4 + layer] = 1.0
        fc[1, j * e + 4 + layer + 1] = -1.0
        fc[8, j * e + 0] = 0.1
    norm = np.zeros(e)
    norm[[1, 2, 3]] = 1.0
    v = np.zeros((16, e))
    v[0, 1] = 1.0
    o = np.zeros((e, 32))
    o[1, 0] = 0.25  # the context's normalised e1 is ~4: the block gets ~1 * (share of context keys)
    p = "layers.0."
    a = {"fc.weight": fc, "hidden_norm.weight": np.ones(e), "norm.weight": norm,
         p + "input_layernorm.weight": np.ones(e), p + "post_attention_layernorm.weight": np.ones(e),
         p + "self_attn.q_proj.weight": np.zeros((32, e)), p + "self_attn.k_proj.weight": 0.02 * rng.standard_normal((16, e)),
         p + "self_attn.v_proj.weight": v, p + "self_attn.o_proj.weight": o,
         p + "self_attn.q_norm.weight": np.ones(16), p + "self_attn.k_norm.weight": np.ones(16),
         p + "mlp.gate_proj.weight": np.zeros((8, e)), p + "mlp.up_proj.weight": np.zeros((8, e)),
         p + "mlp.down_proj.weight": np.zeros((e, 8))}
    return {k: np.asarray(v, np.float32) for k, v in a.items()}


def write_signal_pair(folder: Path, **drafter_overrides) -> tuple[Path, Path]:
    """Write the pair under folder/target and folder/drafter; overrides change the drafter's config only."""
    rng = np.random.default_rng(0)
    target = save_hf(_target_arrays(rng), target_config(), folder / "target", force=True)
    drafter = save_hf(_drafter_arrays(rng), drafter_config(**drafter_overrides), folder / "drafter", force=True)
    return target, drafter
