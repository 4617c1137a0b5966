"""The Qwen3 target against transformers' own Qwen3ForCausalLM (float32, CPU)."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from ddtree_jax.checkpoint import load_target
from ddtree_jax.config import RopeConfig
from ddtree_jax.models import qwen3
from ddtree_jax.models.contract import ForwardMeta
from ddtree_jax.cache import advance

torch = pytest.importorskip("torch", reason="PyTorch is not importable (the transformers parity oracle)")

TOL = 1e-4


def _hf_logits(model, ids: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor(ids)).logits.float().numpy()


def test_prefill_and_32_decode_steps_match_transformers(hf_qwen3):
    folder, hf = hf_qwen3
    params = load_target(folder, jnp.float32)
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, 256, size=(1, 11))
    follow = rng.integers(0, 256, size=(1, 32))

    # transformers: prefill, then one token at a time through its own cache.
    with torch.no_grad():
        out = hf(torch.tensor(prompt), use_cache=True)
        hf_prefill = out.logits.numpy()
        past, hf_steps = out.past_key_values, []
        for i in range(32):
            out = hf(torch.tensor(follow[:, i:i + 1]), past_key_values=past, use_cache=True)
            past = out.past_key_values
            hf_steps.append(out.logits.numpy()[:, 0])

    cache = qwen3.create_cache(params.config, 1, 64, jnp.float32)
    t = prompt.shape[1]
    res = qwen3.forward(params, jnp.asarray(prompt), ForwardMeta.prompt(jnp.array([t]), t), cache)
    np.testing.assert_allclose(np.asarray(qwen3.logits(params, res.hidden)), hf_prefill, atol=TOL, rtol=0)
    cache = advance(res.cache, jnp.array([t]))
    for i in range(32):
        res = qwen3.forward(params, jnp.asarray(follow[:, i:i + 1]), ForwardMeta.step(cache.lengths, jnp.array([True])),
                            cache)
        cache = advance(res.cache, jnp.array([1]))
        np.testing.assert_allclose(np.asarray(qwen3.logits(params, res.hidden))[:, 0], hf_steps[i], atol=TOL, rtol=0,
                                   err_msg=f"decode step {i}")


@pytest.mark.parametrize("hf_qwen3", ["rope_yarn", "rope_llama3"], indirect=True)
def test_scaled_rope_parity_is_not_vacuous(hf_qwen3):
    """Negative control for the YaRN and llama3 variants: the same weights with plain RoPE, or YaRN without
    its attention factor on cos/sin, miss transformers' logits by far more than the tolerance."""
    folder, hf = hf_qwen3
    params = load_target(folder, jnp.float32)
    ids = np.random.default_rng(5).integers(0, 256, size=(1, 11))  # the prefill test's shapes: no new compiles
    want = _hf_logits(hf, ids)

    def logits_with(rope: RopeConfig) -> np.ndarray:
        p = dataclasses.replace(params, config=dataclasses.replace(params.config, rope=rope))
        cache = qwen3.create_cache(p.config, 1, 64, jnp.float32)
        res = qwen3.forward(p, jnp.asarray(ids), ForwardMeta.prompt(jnp.array([11]), 11), cache)
        return np.asarray(qwen3.logits(p, res.hidden))

    rope = params.config.rope
    np.testing.assert_allclose(logits_with(rope), want, atol=TOL, rtol=0)
    wrong = [RopeConfig(theta=rope.theta)]  # plain RoPE
    if rope.rope_type == "yarn":
        wrong.append(dataclasses.replace(rope, attention_factor=1.0))  # YaRN's frequencies, cos/sin unscaled
    for bad in wrong:
        assert np.abs(logits_with(bad) - want).max() > 100 * TOL, bad


def test_hidden_state_taps_follow_hf_indexing(hf_qwen3):
    folder, hf = hf_qwen3
    params = load_target(folder, jnp.float32)
    ids = np.random.default_rng(1).integers(0, 256, size=(1, 9))
    with torch.no_grad():
        hs = hf(torch.tensor(ids), output_hidden_states=True).hidden_states
    layers = tuple(range(params.config.num_layers - 1))  # HF's last entry has the final norm applied
    cache = qwen3.create_cache(params.config, 1, 16, jnp.float32)
    res = qwen3.forward(params, jnp.asarray(ids), ForwardMeta.prompt(jnp.array([9]), 9), cache,
                        tap_layers=layers[::-1])
    e = params.config.hidden_size
    for j, layer in enumerate(layers[::-1]):
        np.testing.assert_allclose(np.asarray(res.taps[..., j * e:(j + 1) * e]), hs[layer + 1].numpy(), atol=TOL, rtol=0)


def test_batch_with_unequal_prompt_lengths_matches_rows_run_alone(hf_qwen3):
    folder, hf = hf_qwen3
    params = load_target(folder, jnp.float32)
    rng = np.random.default_rng(2)
    lengths = [7, 3, 12]
    prompts = [rng.integers(0, 256, size=n) for n in lengths]
    width = max(lengths)
    tokens = np.zeros((3, width), np.int64)
    for r, p in enumerate(prompts):
        tokens[r, :len(p)] = p
    cache = qwen3.create_cache(params.config, 3, 32, jnp.float32)
    valid = jnp.array(lengths)
    res = qwen3.forward(params, jnp.asarray(tokens), ForwardMeta.prompt(valid, width), cache)
    ours = np.asarray(qwen3.logits(params, res.hidden))
    for r, p in enumerate(prompts):
        np.testing.assert_allclose(ours[r, :len(p)], _hf_logits(hf, p[None])[0], atol=TOL, rtol=0, err_msg=f"row {r}")


@pytest.mark.parametrize("compiled", [pytest.param(False, id="interpret"),
                                      pytest.param(True, id="compiled", marks=pytest.mark.gpu)])
def test_row_invariant_verify_gives_the_ar_step_logits_bitwise(random_target, compiled):
    """Issue 20: with `Runtime.row_invariant`, every node of a draft tree verified in one bf16 forward gets the
    logits, bit for bit, of the AR steps that decode its root path one token at a time over the same prompt
    (interpreted kernels on CPU; compiled on a GPU)."""
    import jax

    from ddtree_jax.models.contract import Kernels, Runtime
    from ddtree_jax.tree import ancestor_mask
    from pallas_kernels import on_gpu

    if compiled != on_gpu():
        pytest.skip("the compiled kernels need a GPU; on a GPU the interpreted run adds nothing")
    params = load_target(random_target, jnp.bfloat16)
    runtime = Runtime(Kernels.PALLAS, row_invariant=True)
    prompt = jnp.asarray([[5, 1, 7, 2, 9, 4, 4, 8, 3]])
    cache = qwen3.create_cache(params.config, 1, 48, jnp.bfloat16)
    prefill = qwen3.forward(params, prompt, ForwardMeta.prompt(jnp.asarray([9]), 9), cache, runtime=runtime)
    cache = advance(prefill.cache, jnp.asarray([9]))
    parents = np.array([0, 0, 0, 1, 2, 3, 3, 5])  # root; two children; grandchildren; a depth-4 branch
    depths = np.array([0, 1, 1, 2, 2, 3, 3, 4])
    tokens = jnp.asarray([[4, 11, 3, 8, 8, 1, 14, 6]])
    mask = ancestor_mask(jnp.asarray(parents), jnp.ones(8, bool), 8)[None]
    meta = ForwardMeta.tree(cache.lengths, jnp.asarray(parents)[None], jnp.asarray(depths)[None], mask)
    tree = jax.jit(lambda p, c: qwen3.logits(p, qwen3.forward(p, tokens, meta, c, runtime=runtime).hidden,
                                             runtime))(params, cache)

    @jax.jit
    def step(p, token, c):  # the AR step: one token, written into the cache
        out = qwen3.forward(p, token, ForwardMeta.step(c.lengths, jnp.asarray([True])), c, runtime=runtime)
        return qwen3.logits(p, out.hidden, runtime), advance(out.cache, jnp.asarray([1]))

    for node in range(8):
        path = [node]
        while path[-1] != 0:
            path.append(int(parents[path[-1]]))
        ar_cache = cache
        for n in path[::-1]:
            ar, ar_cache = step(params, tokens[:, n:n + 1], ar_cache)
        np.testing.assert_array_equal(np.asarray(ar[0, 0]), np.asarray(tree[0, node]), err_msg=f"node {node}")
