"""float32 means float32 (issue 26): the Qwen3 target's float32 results through the engine's own code
(`round.prefill`, then a tree `round.verify`, options resolved as `generate` resolves them) against an
independent float64 NumPy reference, within 1e-5.

The shapes (hidden 256, head dim 64) are wide enough that TF32 (10-bit mantissa) misses the tolerance by far:
the reference computed with TF32-rounded matmul inputs shows it on any machine, and on a GPU (marked `gpu`)
the engine with `matmul_precision="default"` misses it too. The CPU twin validates the reference in CI.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file

from ddtree_jax import round as rnd
from ddtree_jax.checkpoint import load_target, write_hf_files
from ddtree_jax.engine import DecodeOptions, resolve_options
from ddtree_jax.random_checkpoint import random_qwen3_arrays, tiny_qwen3_config
from ddtree_jax.tree import build_tree
from test_dflash import rms_norm, rope, rope_frequencies

TOL = 1e-5
SHAPE = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
             num_hidden_layers=2, vocab_size=320)
PROMPT_LENGTHS = (23, 16)  # two rows, padded to one prompt width
WIDTH, CAPACITY, BUDGET, DEPTH = 32, 64, 7, 3


# ---- float64 reference, written from HF's Qwen3 description, sharing no code with the package


def tf32_matmul(a, b):
    """a @ b with both inputs rounded to TF32 (float32 with a 10-bit mantissa, to nearest even) first: what a
    GPU's tensor cores multiply when XLA's default precision lets them."""
    def tf32(x):
        bits = np.asarray(x, np.float32).view(np.uint32)
        bits = (bits + np.uint32(0xFFF) + ((bits >> np.uint32(13)) & np.uint32(1))) & np.uint32(0xFFFFE000)
        return bits.view(np.float32).astype(np.float64)

    return tf32(a) @ tf32(b)


def reference_forward(w, cfg, tokens, positions, visible, matmul=np.matmul):
    """w: HF weights (float64 dict); tokens [n] at positions [n]; visible [n, n] bool, token i attends to the
    tokens j with visible[i, j]. Returns (logits [n, v], per layer (k, v) [n, kv heads, d], k after RoPE)."""
    d, nq, nkv = cfg["head_dim"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    inv, scale = rope_frequencies(cfg, d)
    n = len(tokens)

    def linear(x, name):
        return matmul(x, w[name].T)

    h, kv = w["model.embed_tokens.weight"][tokens], []
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        x = rms_norm(h, w[p + "input_layernorm.weight"], cfg["rms_norm_eps"])
        q = rms_norm(linear(x, p + "self_attn.q_proj.weight").reshape(n, nq, d), w[p + "self_attn.q_norm.weight"],
                     cfg["rms_norm_eps"])
        k = rms_norm(linear(x, p + "self_attn.k_proj.weight").reshape(n, nkv, d), w[p + "self_attn.k_norm.weight"],
                     cfg["rms_norm_eps"])
        v = linear(x, p + "self_attn.v_proj.weight").reshape(n, nkv, d)
        q, k = rope(q, positions, inv, scale), rope(k, positions, inv, scale)
        kv.append((k, v))
        out = np.zeros((n, nq, d))
        for head in range(nq):
            group = head // (nq // nkv)
            s = np.where(visible, matmul(q[:, head], k[:, group].T) * d ** -0.5, -np.inf)
            pr = np.exp(s - s.max(-1, keepdims=True))
            out[:, head] = matmul(pr / pr.sum(-1, keepdims=True), v[:, group])
        h = h + linear(out.reshape(n, -1), p + "self_attn.o_proj.weight")
        y = rms_norm(h, w[p + "post_attention_layernorm.weight"], cfg["rms_norm_eps"])
        g, u = linear(y, p + "mlp.gate_proj.weight"), linear(y, p + "mlp.up_proj.weight")
        h = h + linear(g / (1 + np.exp(-g)) * u, p + "mlp.down_proj.weight")
    return linear(rms_norm(h, w["model.norm.weight"], cfg["rms_norm_eps"]), "lm_head.weight"), kv


def reference_row(w, cfg, prompt, tree_tokens, parents, depths, matmul=np.matmul):
    """The prompt, then the tree's nodes at positions len(prompt) + depth, each seeing the prompt and its own
    root path: (logits [len(prompt) + T, v], per layer (k, v))."""
    p, t = len(prompt), len(tree_tokens)
    ancestor = np.eye(t, dtype=bool)
    for i in range(1, t):  # parents precede children
        ancestor[i] |= ancestor[parents[i]]
    visible = np.zeros((p + t, p + t), bool)
    visible[:p, :p] = np.tril(np.ones((p, p), bool))
    visible[p:, :p] = True
    visible[p:, p:] = ancestor
    tokens = np.concatenate([prompt, tree_tokens])
    positions = np.concatenate([np.arange(p), p + np.asarray(depths)]).astype(np.float64)
    return reference_forward(w, cfg, tokens, positions, visible, matmul)


# ---- the engine's float32 path


@pytest.fixture(scope="module")
def wide_target(tmp_path_factory):
    folder = tmp_path_factory.mktemp("wide")
    cfg = tiny_qwen3_config(**SHAPE)
    arrays = random_qwen3_arrays(cfg, seed=4)
    # Rounding errors scale with magnitudes: a final norm of about 0.3 keeps the logits within about +-1, so
    # that float32's own error (about 1e-6 here) sits well below the 1e-5 tolerance and TF32's (about 1e-3)
    # well above it.
    arrays["model.norm.weight"] *= 0.3
    write_hf_files(folder, arrays, cfg)
    weights = {k: v.astype(np.float64) for k, v in load_file(str(folder / "model.safetensors")).items()}
    rng = np.random.default_rng(6)
    prompts = [rng.integers(0, SHAPE["vocab_size"], n) for n in PROMPT_LENGTHS]
    draft_logits = rng.standard_normal((len(prompts), DEPTH, SHAPE["vocab_size"])).astype(np.float32) * 3
    return load_target(folder, jnp.float32), cfg, weights, prompts, draft_logits


def engine_results(target, prompts, draft_logits, options: DecodeOptions) -> dict:
    """Prefill the prompts and verify one DDTree tree (built from `draft_logits`, rooted at each row's first
    token), as a round does: host arrays of the prefill's cache, its first tokens, the tree and its logits."""
    tokens = np.zeros((len(prompts), WIDTH), np.int32)
    for r, prompt in enumerate(prompts):
        tokens[r, :len(prompt)] = prompt
    state = jax.jit(rnd.prefill, static_argnames=("capacity", "options"))(
        target, None, jnp.asarray(tokens), jnp.asarray([len(p) for p in prompts], jnp.int32), jax.random.key(0),
        capacity=CAPACITY, options=options)
    tree = build_tree(jax.nn.log_softmax(jnp.asarray(draft_logits), -1), state.last_token, BUDGET)
    _, logits = jax.jit(rnd.verify, static_argnames=("tap_layers", "options"))(target, tree, state.cache, (),
                                                                             options=options)
    return dict(k=np.stack(state.cache.k), v=np.stack(state.cache.v), first=np.asarray(state.last_token),
                tokens=np.asarray(tree.tokens), parents=np.asarray(tree.parents), depths=np.asarray(tree.depths),
                valid=np.asarray(tree.valid), logits=np.asarray(logits))


def worst_errors(ours: dict, weights, cfg, prompts, matmul=np.matmul) -> dict:
    """Differences from the reference: the verify's logits (valid nodes), largest absolute difference; the
    prefill's K/V (every layer, valid slots), largest absolute difference over the tensor's largest magnitude
    (q/k norms make K reach about 4); and whether the first tokens are the reference's argmax."""
    worst = dict(prefill_kv=0.0, verify_logits=0.0)
    first_ok = True
    for r, prompt in enumerate(prompts):
        p, valid = len(prompt), ours["valid"][r]
        assert valid.all()  # random draft logits: every one of the B prefixes has a finite score
        logits, kv = reference_row(weights, cfg, prompt, ours["tokens"][r], ours["parents"][r], ours["depths"][r],
                                   matmul)
        for layer, (k, v) in enumerate(kv):
            for ref, got in ((k[:p], ours["k"][layer, r, :p]), (v[:p], ours["v"][layer, r, :p])):
                worst["prefill_kv"] = max(worst["prefill_kv"], float(np.abs(got - ref).max() / np.abs(ref).max()))
        worst["verify_logits"] = max(worst["verify_logits"], float(np.abs(ours["logits"][r] - logits[p:]).max()))
        first_ok &= int(ours["first"][r]) == int(np.argmax(logits[p - 1])) == int(ours["tokens"][r, 0])
    return dict(worst, first_ok=first_ok)


def check_float32(wide_target, kernels: str):
    target, cfg, weights, prompts, draft_logits = wide_target
    options = resolve_options(DecodeOptions(kernels=kernels), None, jnp.float32)
    assert options.matmul_precision == "highest"
    # The surrounding default is XLA's (TF32 for float32 on a GPU): only the engine's options can lift it.
    with jax.default_matmul_precision("default"):
        ours = engine_results(target, prompts, draft_logits, options)
    worst = worst_errors(ours, weights, cfg, prompts)
    assert worst["first_ok"]
    assert worst["prefill_kv"] < TOL and worst["verify_logits"] < TOL, worst
    # The tree has depth: its nodes' logits depend on their ancestors' K/V, not only on the prompt's.
    assert ours["depths"].max() >= 2
    return ours


def test_float32_matches_the_float64_reference(wide_target):
    """The CPU twin of the GPU test below (it runs on the default backend: the CPU in CI)."""
    ours = check_float32(wide_target, "auto")
    # Negative control: the same reference with TF32-rounded matmul inputs misses the tolerance by far,
    # so these shapes would show TF32 on a GPU.
    _, cfg, weights, prompts, _ = wide_target
    tf32 = worst_errors(ours, weights, cfg, prompts, matmul=tf32_matmul)
    assert tf32["prefill_kv"] > 10 * TOL and tf32["verify_logits"] > 10 * TOL, tf32


@pytest.mark.gpu
@pytest.mark.parametrize("kernels", ["auto", "pallas"])  # float32 "auto" is the pure-JAX path
def test_float32_on_gpu_matches_the_float64_reference(wide_target, kernels):
    assert jax.default_backend() == "gpu"
    check_float32(wide_target, kernels)
    # Negative control: XLA's default precision (TF32) on the same path misses the tolerance.
    target, cfg, weights, prompts, draft_logits = wide_target
    options = resolve_options(DecodeOptions(kernels=kernels, matmul_precision="default"), None, jnp.float32)
    worst = worst_errors(engine_results(target, prompts, draft_logits, options), weights, cfg, prompts)
    assert worst["verify_logits"] > 10 * TOL, worst
