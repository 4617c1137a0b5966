"""The Qwen3.5/3.6 hybrid target against transformers' own Qwen3_5ForCausalLM (float32, CPU)."""

from __future__ import annotations

import copy
import dataclasses
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ddtree_jax.cache import RecurrentState, advance
from ddtree_jax.checkpoint import load_target
from ddtree_jax.config import ConfigError, Qwen3_5Config, parse_qwen3_5
from ddtree_jax.models.contract import ForwardMeta
from ddtree_jax.models import qwen3_5
from pallas_kernels import tree_delta_rule
from conftest import YARN_ROPE_SCALING, chain_ordered, randomise_qwen3_5

torch = pytest.importorskip("torch", reason="PyTorch is not importable (the transformers parity oracle)")

TOL = 1e-4
VOCAB = 96
LAYER_TYPES = ["linear_attention", "linear_attention", "full_attention", "linear_attention"]

# Small hybrid shapes: GQA 4/2 with head_dim 16 and half of it rotated; GDN with 2 key heads repeated to 4
# value heads.
TEXT_CONFIG = dict(
    vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, layer_types=LAYER_TYPES, linear_conv_kernel_dim=4, linear_key_head_dim=8,
    linear_num_key_heads=2, linear_num_value_heads=4, linear_value_head_dim=8, rms_norm_eps=1e-6,
    max_position_embeddings=512, tie_word_embeddings=False,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
)


# YaRN over the half-rotated heads (rotary dim 8: one frequency kept, one blended, two divided by 4), with
# max_position_embeddings 512 disagreeing with 4 x 64 as Qwen's published configs do.
YARN_ROPE = dict(YARN_ROPE_SCALING, rope_theta=10000.0, partial_rotary_factor=0.5)


def _save_hf_model(folder, **changes):
    """(folder, torch model): a random Qwen3_5ForCausalLM (TEXT_CONFIG with `changes`) saved as a
    `qwen3_5_text` checkpoint."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    torch.manual_seed(0)
    config = copy.deepcopy(dict(TEXT_CONFIG, **changes))  # transformers fills rope dicts in place
    model = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**config)).float().eval()
    randomise_qwen3_5(model)
    model.save_pretrained(str(folder))
    return folder, model


@pytest.fixture(scope="module")
def hf_qwen3_5(tmp_path_factory):
    return _save_hf_model(tmp_path_factory.mktemp("hf_qwen3_5"))


@pytest.fixture(scope="module")
def params(hf_qwen3_5):
    return load_target(hf_qwen3_5[0], jnp.float32)


@pytest.fixture(scope="module", params=["rope_default", "rope_yarn"])
def hf_and_params(request, hf_qwen3_5, params, tmp_path_factory):
    """(torch model, our params) for the default model, and for the same weights with YARN_ROPE."""
    if request.param == "rope_default":
        return hf_qwen3_5[1], params
    folder, hf = _save_hf_model(tmp_path_factory.mktemp("hf_qwen3_5_yarn"), rope_parameters=YARN_ROPE)
    return hf, load_target(folder, jnp.float32)


@functools.partial(jax.jit, static_argnames=("capacity", "taps"))
def _prefill_jit(params, tokens, valid, capacity, taps):
    b, t = tokens.shape
    cache = qwen3_5.create_cache(params.config, b, capacity, jnp.float32)
    res = qwen3_5.forward(params, tokens, ForwardMeta.prompt(valid, t), cache, tap_layers=taps)
    return res, advance(res.cache, valid)


def _prefill(params, tokens: np.ndarray, lengths=None, capacity: int = 128, taps=()):
    """One call over the (right-padded) prompts; returns (ForwardOut, cache with the prompts committed)."""
    b, t = tokens.shape
    valid = jnp.full((b,), t, jnp.int32) if lengths is None else jnp.asarray(lengths, jnp.int32)
    return _prefill_jit(params, jnp.asarray(tokens), valid, capacity, taps)


@jax.jit
def _step_jit(params, cache, token):
    res = qwen3_5.forward(params, token[:, None], ForwardMeta.step(cache.lengths, jnp.ones(token.shape, bool)), cache)
    return res, advance(res.cache, jnp.ones((token.shape[0],), jnp.int32))


def _step(params, cache, token):
    """One decode step of one token per row (the recurrent form of the delta rule)."""
    return _step_jit(params, cache, jnp.asarray(token, jnp.int32))


def test_config_parses_both_model_types(hf_qwen3_5):
    folder, _ = hf_qwen3_5
    raw = json.loads((folder / "config.json").read_text())
    text = parse_qwen3_5(raw)
    assert isinstance(text, Qwen3_5Config) and text.hf_model_type == "qwen3_5_text"
    assert text.layer_types == tuple(LAYER_TYPES) and text.rotary_dim == 8
    assert text.attention_layers == (2,) and text.linear_layers == (0, 1, 3)
    wrapped = parse_qwen3_5({"model_type": "qwen3_5", "text_config": dict(raw, eos_token_id=5), "eos_token_id": 7})
    assert wrapped.hf_model_type == "qwen3_5" and wrapped.eos_token_ids == (5, 7)
    assert dataclasses.replace(text, hf_model_type="qwen3_5", eos_token_ids=(5, 7)) == wrapped
    params = qwen3_5.abstract(text, jnp.float32)
    assert sum(int(np.prod(a.shape)) for a in params.flat().values()) == text.num_params()


@pytest.mark.parametrize("change, field", [
    (dict(layer_types=["linear_attention", "sliding_attention", "full_attention", "linear_attention"]), "layer_types"),
    (dict(rope_parameters={"rope_type": "longrope", "rope_theta": 1e4, "factor": 2.0}), "rope_parameters"),
    (dict(linear_num_value_heads=3), "linear_num_value_heads"),
    (dict(attn_output_gate=False), "attn_output_gate"),
    (dict(rope_parameters={"rope_theta": 1e4, "partial_rotary_factor": 0.1}), "partial_rotary_factor"),
    (dict(hidden_size="32"), "hidden_size"),
])
def test_config_errors_name_the_file_and_field(change, field):
    raw = dict(TEXT_CONFIG, model_type="qwen3_5_text", **change)
    with pytest.raises(ConfigError, match=f"cfg.json.*'{field}'"):
        parse_qwen3_5(raw, "cfg.json")
    with pytest.raises(ConfigError, match=f"cfg.json: text_config.*'{field}'"):
        parse_qwen3_5({"model_type": "qwen3_5", "text_config": raw}, "cfg.json")


def test_prefill_and_32_decode_steps_match_transformers(hf_and_params):
    hf, params = hf_and_params
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, VOCAB, size=(1, 11))
    follow = rng.integers(0, VOCAB, size=(1, 32))
    with torch.no_grad():
        out = hf(torch.tensor(prompt), use_cache=True)
        hf_prefill, past, hf_steps = out.logits.numpy(), out.past_key_values, []
        for i in range(32):
            out = hf(torch.tensor(follow[:, i:i + 1]), past_key_values=past, use_cache=True)
            past = out.past_key_values
            hf_steps.append(out.logits.numpy()[:, 0])

    res, cache = _prefill(params, prompt)
    np.testing.assert_allclose(np.asarray(qwen3_5.logits(params, res.hidden)), hf_prefill, atol=TOL, rtol=0)
    for i in range(32):
        res, cache = _step(params, cache, follow[:, i])
        np.testing.assert_allclose(np.asarray(qwen3_5.logits(params, res.hidden))[:, 0], hf_steps[i], atol=TOL,
                                   rtol=0, err_msg=f"decode step {i}")


def test_prefill_over_several_chunks_matches_transformers(hf_qwen3_5, params):
    """A 150-token prompt: three 64-token chunks of the WY form on both sides."""
    _, hf = hf_qwen3_5
    ids = np.random.default_rng(9).integers(0, VOCAB, size=(1, 150))
    with torch.no_grad():
        want = hf(torch.tensor(ids)).logits.numpy()
    res, _ = _prefill(params, ids, capacity=160)
    np.testing.assert_allclose(np.asarray(qwen3_5.logits(params, res.hidden)), want, atol=TOL, rtol=0)


def test_bfloat16_runs_with_float32_states(hf_qwen3_5):
    """bf16 weights and activations: the recurrent state stays float32, the conv window takes the model dtype."""
    bf16 = load_target(hf_qwen3_5[0], jnp.bfloat16)
    ids = np.random.default_rng(10).integers(0, VOCAB, size=(2, 7))
    cache = qwen3_5.create_cache(bf16.config, 2, 16, jnp.bfloat16)
    res = qwen3_5.forward(bf16, jnp.asarray(ids), ForwardMeta.prompt(jnp.array([7, 4]), 7), cache)
    assert res.hidden.dtype == jnp.bfloat16
    assert res.cache.recurrent[0].state.dtype == jnp.float32 and res.cache.recurrent[0].conv.dtype == jnp.bfloat16
    assert np.isfinite(np.asarray(qwen3_5.logits(bf16, res.hidden))).all()


def test_greedy_tokens_equal_transformers_generate(hf_and_params):
    from transformers import GenerationConfig

    hf, params = hf_and_params
    prompt = np.random.default_rng(3).integers(0, VOCAB, size=(1, 9))
    n = 24
    with torch.no_grad():
        want = hf.generate(torch.tensor(prompt), generation_config=GenerationConfig(
            max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)).numpy()[0, prompt.shape[1]:]
    res, cache = _prefill(params, prompt)
    token = np.asarray(jnp.argmax(qwen3_5.logits(params, res.hidden[:, -1]), -1))
    got = [int(token[0])]
    for _ in range(n - 1):
        res, cache = _step(params, cache, token)
        token = np.asarray(jnp.argmax(qwen3_5.logits(params, res.hidden[:, -1]), -1))
        got.append(int(token[0]))
    assert got == want.tolist()


def test_chunked_prefill_equals_token_by_token_recurrence(params):
    """70 tokens (more than one 64-token chunk) in one call vs 70 single-token calls: same logits and states."""
    tokens = np.random.default_rng(4).integers(0, VOCAB, size=(1, 70))
    res, chunked = _prefill(params, tokens)
    cache = qwen3_5.create_cache(params.config, 1, 128, jnp.float32)
    for i in range(70):
        one, cache = _step(params, cache, tokens[:, i])
        np.testing.assert_allclose(np.asarray(one.hidden[:, 0]), np.asarray(res.hidden[:, i]), atol=TOL, rtol=0,
                                   err_msg=f"token {i}")
    for a, b in zip(chunked.recurrent, cache.recurrent):
        np.testing.assert_allclose(np.asarray(a.state), np.asarray(b.state), atol=TOL, rtol=0)
        np.testing.assert_allclose(np.asarray(a.conv), np.asarray(b.conv), atol=TOL, rtol=0)


def _delta_rule_inputs(rng, b: int, t: int, h: int, dk: int, dv: int, max_decay: float):
    """Random float32 q, k (L2-normalised), v, g (log decay in [-max_decay, 0]), beta in [0, 1] and a nonzero
    state, in that drawing order."""
    q, k = (jnp.asarray(rng.normal(size=(b, t, h, dk)), jnp.float32) for _ in range(2))
    k = k / jnp.linalg.norm(k, axis=-1, keepdims=True)
    v = jnp.asarray(rng.normal(size=(b, t, h, dv)), jnp.float32)
    g = jnp.asarray(-rng.uniform(0, max_decay, size=(b, t, h)), jnp.float32)
    beta = jnp.asarray(rng.uniform(0, 1, size=(b, t, h)), jnp.float32)
    state = jnp.asarray(rng.normal(size=(b, h, dk, dv)), jnp.float32)
    return q, k, v, g, beta, state


def test_delta_rule_chunked_equals_recurrent_with_padding():
    """The two free functions agree, also from a nonzero state and when trailing tokens have g = beta = 0."""
    t = 75
    q, k, v, g, beta, state = _delta_rule_inputs(np.random.default_rng(5), 2, t, 3, 8, 6, max_decay=1.0)
    out_c, s_c = qwen3_5.chunk_gated_delta_rule(q, k, v, g, beta, state)
    out_r, s_r = qwen3_5.recurrent_gated_delta_rule(q, k, v, g, beta, state)
    np.testing.assert_allclose(np.asarray(out_c), np.asarray(out_r), atol=1e-4, rtol=1e-4)
    np.testing.assert_allclose(np.asarray(s_c), np.asarray(s_r), atol=1e-4, rtol=1e-4)
    # Padding: tokens 50.. with g = beta = 0 leave the state at its value after 50 tokens.
    keep = (jnp.arange(t) < 50)[None, :, None]
    _, s_pad = qwen3_5.chunk_gated_delta_rule(q, k, v, jnp.where(keep, g, 0), jnp.where(keep, beta, 0), state)
    _, s_50 = qwen3_5.recurrent_gated_delta_rule(q[:, :50], k[:, :50], v[:, :50], g[:, :50], beta[:, :50], state)
    np.testing.assert_allclose(np.asarray(s_pad), np.asarray(s_50), atol=1e-4, rtol=1e-4)


def test_unit_lower_solve_on_cpu_is_forward_substitution_without_lapack():
    """The CPU path of the delta rule's triangular solve against float64 NumPy, with garbage on and above the
    diagonal (not read); and its program calls no LAPACK kernel (jaxlib 0.10.2's batched one deadlocks a
    host mesh: `qwen3_5.unit_lower_solve`)."""
    rng = np.random.default_rng(3)
    system = rng.normal(size=(2, 3, 9, 9)).astype(np.float32) * 0.3
    rhs = rng.normal(size=(2, 3, 9, 5)).astype(np.float32)
    unit = np.tril(system.astype(np.float64), -1) + np.eye(9)
    want = np.linalg.solve(unit, rhs.astype(np.float64))
    solve = jax.jit(qwen3_5.unit_lower_solve)
    np.testing.assert_allclose(np.asarray(solve(system, rhs)), want, atol=1e-5, rtol=1e-5)
    assert "custom-call" not in solve.lower(system, rhs).compile().as_text()  # (the LAPACK solve is one)
    # The GPU path (the LAPACK-backed solve here) gives the same.
    np.testing.assert_allclose(np.asarray(jax.lax.linalg.triangular_solve(
        jnp.asarray(unit, jnp.float32), rhs, left_side=True, lower=True, unit_diagonal=True)), want, atol=1e-5)


def _random_tree(rng, t: int, max_depth: int, padding: int):
    """parents, depths, valid of a random tree of t nodes (parents precede children), the last `padding` of
    them padding nodes (depth 0, parent 0, invalid)."""
    parents, depths = [0], [0]
    for _ in range(1, t - padding):
        parent = int(rng.choice([i for i in range(len(parents)) if depths[i] < max_depth]))
        parents.append(parent)
        depths.append(depths[parent] + 1)
    parents += [0] * padding
    depths += [0] * padding
    return np.array(parents), np.array(depths), np.arange(t) < t - padding


def test_tree_delta_rule_equals_the_recurrence_along_every_root_path():
    """The all-nodes-at-once tree rule (WY form with the ancestor mask) against the token-by-token rule run
    along each node's root path, from a nonzero state: every node's output, and the state that
    `cache.path_state` forms for it; a padding node starts from the committed state. Rows have different
    trees; the chain-ordered negative control gives other outputs."""
    from ddtree_jax.cache import NodeStates, path_state
    from ddtree_jax.tree import ancestor_mask

    rng = np.random.default_rng(11)
    b, t, h, dk, dv = 2, 40, 3, 8, 6
    trees = [_random_tree(rng, t, max_depth=7, padding=p) for p in (0, 3)]
    parents = jnp.asarray(np.stack([tr[0] for tr in trees]), jnp.int32)
    visible = jnp.stack([ancestor_mask(parents[r], jnp.asarray(trees[r][2]), t) for r in range(b)])
    q, k, v, g, beta, state = _delta_rule_inputs(rng, b, t, h, dk, dv, max_decay=1.5)
    out, keys, values, log_decay = qwen3_5.tree_gated_delta_rule(q, k, v, g, beta, state, visible)
    nodes = NodeStates(keys=keys, values=values, log_decay=log_decay, inputs=jnp.zeros((b, t, 1)))
    along_path = jax.jit(qwen3_5.recurrent_gated_delta_rule)  # one compile per path length
    state_of = jax.jit(lambda r, padded, n: path_state(state[r][None], jax.tree.map(lambda a: a[r][None], nodes),
                                                       padded, n))
    for r, (par, dep, _) in enumerate(trees):
        for node in range(t):
            path = [node]
            while dep[path[-1]] > 0:
                path.append(int(par[path[-1]]))
            path = path[::-1]
            want_out, want_state = along_path(*(x[r:r + 1, np.array(path)] for x in (q, k, v, g, beta)),
                                              state[r:r + 1])
            np.testing.assert_allclose(np.asarray(out[r, node]), np.asarray(want_out[0, -1]), atol=2e-5, rtol=0,
                                       err_msg=f"row {r} node {node}")
            padded = jnp.asarray(path + [path[-1]] * (9 - len(path)))[None]
            got_state = state_of(r, padded, jnp.asarray([len(path)]))
            np.testing.assert_allclose(np.asarray(got_state[0]), np.asarray(want_state[0]), atol=2e-5, rtol=0,
                                       err_msg=f"row {r} node {node}")
    wrong = chain_ordered(qwen3_5.tree_gated_delta_rule)(q, k, v, g, beta, state, visible)[0]
    assert float(jnp.abs(wrong - out).max()) > 1e-2


def test_batch_with_unequal_prompt_lengths_matches_rows_alone(params):
    rng = np.random.default_rng(6)
    lengths = [13, 6]
    prompts = [rng.integers(0, VOCAB, size=n) for n in lengths]
    width = max(lengths)
    tokens = np.zeros((2, width), np.int64)
    for r, p in enumerate(prompts):
        tokens[r, :len(p)] = p
    follow = rng.integers(0, VOCAB, size=(2, 5))
    res, cache = _prefill(params, tokens, lengths)
    batch_logits = np.asarray(qwen3_5.logits(params, res.hidden))
    batch_steps = []
    for i in range(5):
        out, cache = _step(params, cache, follow[:, i])
        batch_steps.append(np.asarray(qwen3_5.logits(params, out.hidden[:, 0])))
    for r, p in enumerate(prompts):
        alone, alone_cache = _prefill(params, p[None])
        np.testing.assert_allclose(batch_logits[r, :len(p)], np.asarray(qwen3_5.logits(params, alone.hidden))[0],
                                   atol=TOL, rtol=0, err_msg=f"row {r}")
        for i in range(5):
            out, alone_cache = _step(params, alone_cache, follow[r:r + 1, i])
            np.testing.assert_allclose(batch_steps[i][r], np.asarray(qwen3_5.logits(params, out.hidden[0, 0])),
                                       atol=TOL, rtol=0, err_msg=f"row {r} step {i}")


def test_hidden_state_taps_follow_hf_indexing(hf_qwen3_5, params):
    _, hf = hf_qwen3_5
    ids = np.random.default_rng(7).integers(0, VOCAB, size=(1, 9))
    with torch.no_grad():
        hs = hf(torch.tensor(ids), output_hidden_states=True).hidden_states
    layers = tuple(range(params.config.num_layers - 1))[::-1]  # HF's last entry has the final norm applied
    res, _ = _prefill(params, ids, taps=layers)
    e = params.config.hidden_size
    for j, layer in enumerate(layers):
        np.testing.assert_allclose(np.asarray(res.taps[..., j * e:(j + 1) * e]), hs[layer + 1].numpy(), atol=TOL,
                                   rtol=0, err_msg=f"layer {layer}")


def test_qwen3_5_vision_language_folder_loads_text_weights(hf_qwen3_5, params, tmp_path):
    """A `qwen3_5` folder (text weights under model.language_model., plus vision and MTP tensors) loads to the
    same parameters as the `qwen3_5_text` folder."""
    from safetensors.numpy import load_file, save_file

    folder, _ = hf_qwen3_5
    text_raw = json.loads((folder / "config.json").read_text())
    arrays = load_file(str(folder / "model.safetensors"))
    renamed = {("model.language_model." + n[len("model."):] if n.startswith("model.") else n): a
               for n, a in arrays.items()}
    renamed["model.visual.x.weight"] = np.ones((3, 2), np.float32)
    renamed["mtp.y.weight"] = np.ones((4,), np.float32)
    out = tmp_path / "vl"
    out.mkdir()
    save_file(renamed, str(out / "model.safetensors"), metadata={"format": "pt"})
    text_raw.pop("architectures", None)
    raw = {"model_type": "qwen3_5", "architectures": ["Qwen3_5ForConditionalGeneration"],
           "text_config": dict(text_raw, model_type="qwen3_5_text"), "vision_config": {"depth": 1},
           "tie_word_embeddings": False}
    (out / "config.json").write_text(json.dumps(raw))
    loaded = load_target(out, jnp.float32)
    assert loaded.config.hf_model_type == "qwen3_5"
    ids = np.random.default_rng(8).integers(0, VOCAB, size=(1, 10))
    a, _ = _prefill(params, ids)
    b, _ = _prefill(loaded, ids)
    np.testing.assert_array_equal(np.asarray(qwen3_5.logits(params, a.hidden)),
                                  np.asarray(qwen3_5.logits(loaded, b.hidden)))

    # Strictness stays for everything else: an unknown text tensor is refused, named as stored.
    renamed["model.language_model.extra.weight"] = np.ones((2,), np.float32)
    save_file(renamed, str(out / "model.safetensors"), metadata={"format": "pt"})
    from ddtree_jax.checkpoint import CheckpointError

    with pytest.raises(CheckpointError, match="unexpected tensor 'model.language_model.extra.weight'"):
        load_target(out, jnp.float32)
    del renamed["model.language_model.extra.weight"], renamed["model.language_model.norm.weight"]
    save_file(renamed, str(out / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="tensor 'model.language_model.norm.weight' is missing"):
        load_target(out, jnp.float32)


def test_recurrent_state_shapes(params):
    cache = qwen3_5.create_cache(params.config, 2, 16, jnp.float32)
    assert len(cache.kv.k) == 1 and len(cache.recurrent) == 3
    c = params.config
    assert isinstance(cache.recurrent[0], RecurrentState)
    assert cache.recurrent[0].state.shape == (2, 4, 8, 8) and cache.recurrent[0].state.dtype == jnp.float32
    assert cache.recurrent[0].conv.shape == (2, c.linear_conv_dim, 3)


def test_engine_ar_equals_the_step_loop(params):
    """engine.generate on a hybrid target (prefill, then one-token rounds) gives the tokens of the greedy
    prefill + decode-step loop above. (DFlash/DDTree on hybrids: tests/test_hybrid_decoding.py.)"""
    from ddtree_jax.engine import DecodeOptions, generate

    prompt = np.random.default_rng(11).integers(0, VOCAB, size=(1, 9))
    res, cache = _prefill(params, prompt)
    token = np.asarray(jnp.argmax(qwen3_5.logits(params, res.hidden[:, -1]), -1))
    want = [int(token[0])]
    for _ in range(11):
        res, cache = _step(params, cache, token)
        token = np.asarray(jnp.argmax(qwen3_5.logits(params, res.hidden[:, -1]), -1))
        want.append(int(token[0]))
    assert generate(params, prompt.tolist(), DecodeOptions(max_new_tokens=12)).output_ids == [want]


@pytest.mark.parametrize("n,block", [(37, 16), (37, 8), (16, 16), (qwen3_5.BLOCKED_SOLVE_ABOVE + 2, None)])
def test_blocked_unit_lower_solve_matches_float64(n, block):
    """The blocked solve (partial last block; a single block; and `unit_lower_solve` itself above
    BLOCKED_SOLVE_ABOVE, where it solves by blocks) against NumPy's float64 solve of the same unit lower system
    (its upper part and diagonal filled with junk the solve must not read)."""
    rng = np.random.default_rng(n)
    lower = np.tril(rng.normal(size=(3, n, n)) * 0.3, -1)
    rhs = rng.normal(size=(3, n, 5))
    junk = lower + np.triu(rng.normal(size=(3, n, n)) + 7.0)
    with jax.default_matmul_precision("highest"):
        args = jnp.asarray(junk, jnp.float32), jnp.asarray(rhs, jnp.float32)
        got = (qwen3_5.unit_lower_solve(*args) if block is None
               else qwen3_5.blocked_unit_lower_solve(*args, block))
    want = np.linalg.solve(lower + np.eye(n), rhs)
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kernels,t,uses_kernel", [("pallas", 5, True), ("pallas", tree_delta_rule.MAX_NODES, True),
                                                   ("jax", 5, False),
                                                   ("pallas", tree_delta_rule.MAX_NODES + 1, False)])
def test_tree_verify_takes_the_tree_rule_kernel_on_the_pallas_path(kernels, t, uses_kernel):
    """A Gated DeltaNet layer's tree mode runs `pallas_kernels.tree_delta_rule` on the Pallas path for trees of up to
    its MAX_NODES nodes, and the jnp WY form otherwise (the pure-JAX path; wider trees). Read from the traced
    program (the kernel's correctness is tests/kernels/test_tree_delta_rule.py's; the engine's tokens with it,
    tests/test_kernels_in_engine.py's)."""
    from flax import nnx

    from ddtree_jax.models.contract import Runtime
    from ddtree_jax.random_checkpoint import tiny_qwen3_5_config
    from jaxprs import pallas_call_names

    config = parse_qwen3_5(tiny_qwen3_5_config())
    layer = qwen3_5.GatedDeltaNet(config, dtype=jnp.float32, rngs=nnx.Rngs(0))
    hv, dk, dv = config.linear_num_value_heads, config.linear_key_head_dim, config.linear_value_head_dim
    state = RecurrentState(state=jnp.zeros((1, hv, dk, dv)),
                           conv=jnp.zeros((1, config.linear_conv_dim, config.linear_conv_kernel - 1)))
    parents = jnp.maximum(jnp.arange(t) - 1, 0)[None]
    visible = jnp.tril(jnp.ones((1, t, t), bool))
    jaxpr = jax.make_jaxpr(lambda x: layer(x, state, jnp.array([t]), parents, jnp.arange(t)[None], visible,
                                           runtime=Runtime(kernels))[0])(jnp.zeros((1, t, config.hidden_size)))
    names = pallas_call_names(jaxpr)
    # One launch ("tree_delta_rule") for one block of nodes, two ("_tiles", "_chain") past it.
    assert any(str(name).startswith("tree_delta_rule") for name in names) == uses_kernel, names
