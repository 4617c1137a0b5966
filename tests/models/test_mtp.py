"""The Qwen3.5/3.6 multi-token-prediction head against an independent float64 NumPy reference of its steps,
and its loading from checkpoints in the published layout."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file

from ddtree_jax import round as rnd
from ddtree_jax.checkpoint import CheckpointError, load_mtp, load_target, read_arrays
from ddtree_jax.config import ConfigError, MTPConfig, load_target_config
from ddtree_jax.models import qwen3_5
from ddtree_jax.models.contract import ForwardMeta
from ddtree_jax.random_checkpoint import write_random_qwen3, write_random_qwen3_5

TOL = 1e-5
TEXT = dict(vocab_size=48, hidden_size=32, intermediate_size=48, head_dim=16, num_attention_heads=4,
            num_key_value_heads=2, linear_key_head_dim=8, linear_value_head_dim=8,
            layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5})


@pytest.fixture(scope="module")
def published(tmp_path_factory):
    """A random hybrid target with a random one-layer MTP head, in the published `qwen3_5` layout."""
    return write_random_qwen3_5(tmp_path_factory.mktemp("mtp") / "t", seed=4, published=True, mtp_layers=1,
                                std=0.2, **TEXT)


@pytest.fixture(scope="module")
def pair(published):
    target = load_target(published, jnp.float32)
    return target, load_mtp(published, target.config, jnp.float32)


# ---- float64 reference, written from the head's description (vLLM's qwen3_5_mtp.py), sharing no code with
# the package


def zero_centred_norm(x, w, eps=1e-6):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * (1.0 + w)


def partial_rope(x, position, rotary_dim, theta):
    """x [heads, d] at one position: neox rotation (pairs (i, i + r/2)) of the first r dims, the rest as is."""
    r = rotary_dim
    angles = position / theta ** (np.arange(0, r, 2) / r)
    cos, sin = np.cos(np.concatenate([angles, angles])), np.sin(np.concatenate([angles, angles]))
    head = x[:, :r]
    rotated = np.concatenate([-head[:, r // 2:], head[:, :r // 2]], axis=-1)
    return np.concatenate([head * cos + rotated * sin, x[:, r:]], axis=-1)


def reference_step(w, tw, cfg, token, hidden, position, past):
    """One MTP step: token (int) and hidden [e] at `position`; past: list of (k, v) [kv heads, d] of the
    head's earlier positions 0 .. position - 1, to which this step's (k, v) is appended. Returns (the head's
    output after its final norm [e], float64 logits [v])."""
    d, nq, nkv, eps = cfg["head_dim"], cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["rms_norm_eps"]
    rotary = int(d * cfg["rope_parameters"]["partial_rotary_factor"])
    theta = cfg["rope_parameters"]["rope_theta"]
    p = "mtp.layers.0."
    e = zero_centred_norm(tw["model.embed_tokens.weight"][token], w["mtp.pre_fc_norm_embedding.weight"], eps)
    h = zero_centred_norm(hidden, w["mtp.pre_fc_norm_hidden.weight"], eps)
    x = np.concatenate([e, h]) @ w["mtp.fc.weight"].T
    a = zero_centred_norm(x, w[p + "input_layernorm.weight"], eps)
    q_gate = (a @ w[p + "self_attn.q_proj.weight"].T).reshape(nq, 2 * d)
    q, gate = q_gate[:, :d], q_gate[:, d:].reshape(-1)
    q = partial_rope(zero_centred_norm(q, w[p + "self_attn.q_norm.weight"], eps), position, rotary, theta)
    k = (a @ w[p + "self_attn.k_proj.weight"].T).reshape(nkv, d)
    k = partial_rope(zero_centred_norm(k, w[p + "self_attn.k_norm.weight"], eps), position, rotary, theta)
    v = (a @ w[p + "self_attn.v_proj.weight"].T).reshape(nkv, d)
    past.append((k, v))
    keys, values = np.stack([kv[0] for kv in past]), np.stack([kv[1] for kv in past])  # [n_past + 1, nkv, d]
    group = nq // nkv
    out = np.zeros((nq, d))
    for head in range(nq):
        scores = keys[:, head // group] @ q[head] / np.sqrt(d)
        probs = np.exp(scores - scores.max())
        out[head] = (probs / probs.sum()) @ values[:, head // group]
    x = x + (out.reshape(-1) / (1.0 + np.exp(-gate))) @ w[p + "self_attn.o_proj.weight"].T
    m = zero_centred_norm(x, w[p + "post_attention_layernorm.weight"], eps)
    gate_mlp, up = m @ w[p + "mlp.gate_proj.weight"].T, m @ w[p + "mlp.up_proj.weight"].T
    x = x + (gate_mlp / (1.0 + np.exp(-gate_mlp)) * up) @ w[p + "mlp.down_proj.weight"].T
    out = zero_centred_norm(x, w["mtp.norm.weight"], eps)
    return out, out @ tw["lm_head.weight"].T


def reference_drafts(w, tw, cfg, sequence, target_hidden, steps):
    """The head over a committed sequence and its drafts, as vLLM's proposer runs it: position i pairs
    sequence[i + 1] with the target's hidden state at i (sequence ends with the newest emitted token, which
    the target has not seen: len(sequence) = len(target_hidden) + 1); draft 1 is the logits of the last such
    position; each later step pairs the previous draft with the previous step's output, one position on.
    Returns float64 logits [steps, v]."""
    past, n = [], len(target_hidden)
    for i in range(n):
        out, logits = reference_step(w, tw, cfg, sequence[i + 1], target_hidden[i], i, past)
    all_logits = [logits]
    for j in range(1, steps):
        out, logits = reference_step(w, tw, cfg, int(np.argmax(all_logits[-1])), out, n - 1 + j, past)
        all_logits.append(logits)
    return np.stack(all_logits)


def test_prefill_and_draft_match_the_float64_reference(pair, published):
    """The engine's prefill (the head over the prompt, paired with the next tokens and the first emitted
    one) and its draft stage (m = 4 chained steps) against the reference, two rows of unequal length."""
    target, head = pair
    raw = json.loads((published / "config.json").read_text())["text_config"]
    f64 = lambda flat: {n: np.asarray(a, np.float64) for n, a in flat.items()}  # noqa: E731
    w, tw = f64(head.flat()), f64(target.flat())
    prompts = [[3, 17, 5, 40, 22, 9, 31], [8, 2, 44]]
    width, steps = 8, 4
    tokens = np.zeros((2, width), np.int32)
    for r, p in enumerate(prompts):
        tokens[r, :len(p)] = p
    lengths = jnp.asarray([len(p) for p in prompts], jnp.int32)
    options = rnd.DecodeOptions(mode=rnd.Mode.MTP, mtp_steps=steps, block_size=steps + 1, max_new_tokens=8,
                                kernels="jax", matmul_precision="highest")
    state = jax.jit(rnd.prefill, static_argnames=("capacity", "options"))(
        target, head, jnp.asarray(tokens), lengths, jax.random.key(0), capacity=32, options=options)
    logits = np.asarray(jax.jit(rnd.draft, static_argnames="options")(
        head, target, state.last_token, state.draft_cache, options))
    hidden = np.asarray(qwen3_5.forward(target, jnp.asarray(tokens), ForwardMeta.prompt(lengths, width),
                                        qwen3_5.create_cache(target.config, 2, width, jnp.float32)).hidden, np.float64)
    assert state.draft_cache.lengths.tolist() == [len(p) for p in prompts]  # as long as the target's cache
    for r, p in enumerate(prompts):
        want = reference_drafts(w, tw, raw, p + [int(state.last_token[r])], hidden[r, :len(p)], steps)
        np.testing.assert_allclose(logits[r], want, atol=TOL, rtol=0, err_msg=f"row {r}")
        assert np.argmax(logits[r], -1).tolist() == np.argmax(want, -1).tolist()


def test_the_reference_tells_the_pairing_apart(pair, published):
    """Negative control: pairing each position's hidden state with its own token (not the next one), as a
    head shifted by one would, moves the reference's logits far beyond the tolerance."""
    target, head = pair
    raw = json.loads((published / "config.json").read_text())["text_config"]
    w = {n: np.asarray(a, np.float64) for n, a in head.flat().items()}
    tw = {n: np.asarray(a, np.float64) for n, a in target.flat().items()}
    rng = np.random.default_rng(0)
    sequence, hidden = [3, 17, 5, 40, 22], rng.standard_normal((4, 32))
    right = reference_drafts(w, tw, raw, sequence, hidden, 2)
    wrong = reference_drafts(w, tw, raw, [0] + sequence[:-1], hidden, 2)
    assert np.abs(right - wrong).max() > 100 * TOL


# ---- loading


def test_published_layout_loads_the_head_and_skips_it_for_the_target(pair, published):
    target, head = pair
    stored = load_file(str(published / "model.safetensors"))
    assert "model.visual.patch_embed.proj.weight" in stored and "mtp.fc.weight" in stored
    assert isinstance(head.config, MTPConfig) and head.config.num_layers == 1
    assert set(head.flat()) == {n for n in stored if n.startswith("mtp.")}
    for name, value in head.flat().items():
        assert np.array_equal(np.asarray(value), stored[name]), name
    assert not any(n.startswith("mtp.") for n in target.flat())
    assert head.flat()["mtp.fc.weight"].shape == (32, 64)  # [H, 2H]: embedding first, then hidden


def test_orbax_conversion_keeps_the_head(published, pair, tmp_path):
    """HF (published layout) -> orbax keeps the head, which loads from there; a `qwen3_5_text` folder goes
    HF -> orbax -> HF bit-exactly, `mtp.*` included."""
    from conversions.convert import convert

    orbax = convert("hf-to-orbax", published, tmp_path / "orbax")
    target = load_target(orbax, jnp.float32)
    head = load_mtp(orbax, target.config, jnp.float32)
    for name, value in pair[1].flat().items():
        assert np.array_equal(np.asarray(head.flat()[name]), np.asarray(value)), name
    arrays, _ = read_arrays(orbax)
    assert {n for n in arrays if n.startswith("mtp.")} == set(head.flat())

    text = write_random_qwen3_5(tmp_path / "text", seed=1, mtp_layers=1, **TEXT)
    back = convert("orbax-to-hf", convert("hf-to-orbax", text, tmp_path / "text_orbax"), tmp_path / "back")
    before, after = load_file(str(text / "model.safetensors")), load_file(str(back / "model.safetensors"))
    assert set(before) == set(after) and any(n.startswith("mtp.") for n in after)
    assert all(before[n].tobytes() == after[n].tobytes() for n in before)


def test_a_target_without_a_head_is_one_clear_error(tmp_path):
    dense = write_random_qwen3(tmp_path / "dense", with_tokenizer=False)
    with pytest.raises(ConfigError, match="a qwen3 target has no multi-token-prediction head"):
        load_mtp(dense, load_target_config(dense))
    hybrid = write_random_qwen3_5(tmp_path / "hybrid", **TEXT)
    with pytest.raises(ConfigError, match="'mtp_num_hidden_layers' is missing or 0"):
        load_mtp(hybrid, load_target_config(hybrid))
    # The config promises a head that the files do not hold (a stripped conversion, say).
    stripped = write_random_qwen3_5(tmp_path / "stripped", **TEXT)
    config = json.loads((stripped / "config.json").read_text())
    (stripped / "config.json").write_text(json.dumps(dict(config, mtp_num_hidden_layers=1)))
    with pytest.raises(CheckpointError, match=r"holds no 'mtp\.\*' tensors"):
        load_mtp(stripped, load_target_config(stripped))
