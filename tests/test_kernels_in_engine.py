"""The Pallas kernels behind the engine (interpreted on CPU) give the tokens of the pure-JAX path: the tree
attention, the greedy acceptance, the tree build and the add + RMSNorm."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ddtree_jax.checkpoint import load_drafter, load_target
from ddtree_jax.engine import DecodeOptions, Mode, generate
from ddtree_jax.models.contract import Kernels, Runtime
from ddtree_jax.parallel import make_parallel
from ddtree_jax.random_checkpoint import (tiny_qwen3_5_config, tiny_qwen3_config, write_random_dflash,
                                         write_random_qwen3, write_random_qwen3_5)
from pallas_kernels import ENV_VAR


TWO_DEVICES = pytest.mark.skipif(len(jax.devices()) < 2, reason="tensor parallelism needs 2 devices (forced host "
                                 "devices on CPU)")
DENSE_TARGET = dict(vocab_size=64, num_attention_heads=8, num_key_value_heads=4, head_dim=8, intermediate_size=128)
HYBRID_LAYERS = dict(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"])
PROMPTS = [[1, 2, 3, 4, 5], [3, 9]]


@pytest.fixture(scope="module")
def dense_pair(tmp_path_factory):
    """(target folder, drafter folder, {mode: the pure-JAX path's output}): 8 query and 4 KV heads (split in two
    under tp), budget 6."""
    tmp = tmp_path_factory.mktemp("dense")
    t_dir = write_random_qwen3(tmp / "t", seed=4, with_tokenizer=False, **DENSE_TARGET)
    d_dir = write_random_dflash(tmp / "d", tiny_qwen3_config(**DENSE_TARGET), seed=5, block_size=4,
                                num_key_value_heads=4)
    target = load_target(t_dir, jnp.float32)
    drafter = load_drafter(d_dir, target.config, jnp.float32)
    return t_dir, d_dir, {mode: generate(target, PROMPTS, DecodeOptions(mode=mode, max_new_tokens=8, budget=6),
                                         drafter=drafter) for mode in (Mode.AR, Mode.DDTREE)}


@pytest.fixture(scope="module")
def hybrid_pair(tmp_path_factory):
    """(target folder, drafter folder, {mode: the pure-JAX path's output}): one layer of each kind and a one-layer
    drafter (each interpreted kernel is traced and compiled once per layer, so more layers of the same kinds cost
    compile time and show nothing more); budget 20: a verify of 21 nodes, two of the tree-rule kernel's row
    blocks."""
    tmp = tmp_path_factory.mktemp("hybrid")
    t_dir = write_random_qwen3_5(tmp / "t", seed=6, **HYBRID_LAYERS)
    d_dir = write_random_dflash(tmp / "d", tiny_qwen3_5_config(**HYBRID_LAYERS), seed=7, num_hidden_layers=1,
                                layer_types=["full_attention"])
    target = load_target(t_dir, jnp.float32)
    drafter = load_drafter(d_dir, target.config, jnp.float32)
    return t_dir, d_dir, {mode: generate(target, PROMPTS, DecodeOptions(mode=mode, max_new_tokens=6, budget=20),
                                         drafter=drafter) for mode in (Mode.AR, Mode.DDTREE)}


def assert_pallas_matches_jax(pair, max_new_tokens: int, budget: int):
    t_dir, d_dir, jax_outs = pair
    target = load_target(t_dir, jnp.float32)
    drafter = load_drafter(d_dir, target.config, jnp.float32)
    for mode, jax_out in jax_outs.items():
        pallas_out = generate(target, PROMPTS, DecodeOptions(mode=mode, max_new_tokens=max_new_tokens, budget=budget,
                                                             kernels="pallas"), drafter=drafter)
        assert pallas_out.output_ids == jax_out.output_ids
        assert pallas_out.acceptance_lengths == jax_out.acceptance_lengths


def assert_tp_matches_one_device(pair, max_new_tokens: int, budget: int):
    t_dir, d_dir, jax_outs = pair
    parallel = make_parallel(2, "tp")
    options = DecodeOptions(mode=Mode.DDTREE, max_new_tokens=max_new_tokens, budget=budget, kernels="pallas",
                            parallel=parallel)
    assert options.runtime == Runtime(Kernels.PALLAS, parallel.mesh)
    target = load_target(t_dir, jnp.float32, parallel=parallel)
    tp = generate(target, PROMPTS, options, drafter=load_drafter(d_dir, target.config, jnp.float32, parallel=parallel))
    assert tp.output_ids == jax_outs[Mode.DDTREE].output_ids
    assert tp.acceptance_lengths == jax_outs[Mode.DDTREE].acceptance_lengths


def test_ddtree_with_pallas_kernels_matches_jax(dense_pair):
    """The dense target's Pallas kernels (interpreted on CPU) give the pure-JAX path's tokens and acceptance, AR and
    DDTree."""
    assert_pallas_matches_jax(dense_pair, 8, 6)


@TWO_DEVICES
def test_ddtree_with_pallas_kernels_under_tp_matches_one_device(dense_pair):
    """The attention kernel under tensor parallelism (`shard_map` on each device's heads, 2 devices) gives one
    device's DDTree tokens and acceptance."""
    assert_tp_matches_one_device(dense_pair, 8, 6)


def test_hybrid_with_pallas_kernels_matches_jax(hybrid_pair):
    """Qwen3.5/3.6 hybrid: the zero-centred add + RMSNorm kernel (every layer), the tree attention (its
    full-attention layers) and the tree-rule kernel (its Gated DeltaNet layers' tree verify), interpreted, give the
    pure-JAX path's tokens, AR and DDTree."""
    assert_pallas_matches_jax(hybrid_pair, 6, 20)


@TWO_DEVICES
def test_hybrid_with_pallas_kernels_under_tp_matches_one_device(hybrid_pair):
    """Under tensor parallelism the tree-rule kernel runs under `shard_map` on each device's key heads and their
    value heads: DDTree on 2 devices gives one device's tokens and acceptance."""
    assert_tp_matches_one_device(hybrid_pair, 6, 20)


# ---- the default: "auto" kernels (Pallas on a GPU, pure JAX elsewhere)


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="what auto resolves to on a CPU")
def test_auto_kernels_resolve_to_jax_on_cpu(monkeypatch):
    from ddtree_jax.engine import resolve_options

    monkeypatch.delenv(ENV_VAR, raising=False)
    options = DecodeOptions(mode=Mode.DDTREE)
    assert options.kernels == "auto" and options.runtime == Runtime(Kernels.JAX, None)
    pinned = resolve_options(DecodeOptions(), None)
    assert pinned.kernels == "jax"  # compiled programs are keyed on what runs, not on "auto"
    for forced in ("jax", "pallas"):
        assert DecodeOptions(kernels=forced).runtime.kernels is Kernels(forced)
    # The environment variable of the kernel dispatchers overrides "auto" only.
    monkeypatch.setenv(ENV_VAR, "pallas")
    assert DecodeOptions().runtime.pallas and not DecodeOptions(kernels="jax").runtime.pallas
    for value in ("reference", "jax"):
        monkeypatch.setenv(ENV_VAR, value)
        assert not DecodeOptions().runtime.pallas and DecodeOptions(kernels="pallas").runtime.pallas
    monkeypatch.setenv(ENV_VAR, "triton")
    with pytest.raises(ValueError, match=ENV_VAR):
        DecodeOptions().runtime
    with pytest.raises(ValueError, match="'cuda'"):
        DecodeOptions(kernels="cuda")


def test_auto_kernels_on_a_gpu_keep_float32_on_the_jax_path(monkeypatch):
    import jax.numpy as jnp

    import pallas_kernels
    from ddtree_jax.engine import resolve_options

    monkeypatch.delenv(ENV_VAR, raising=False)
    monkeypatch.setattr(pallas_kernels, "on_gpu", lambda: True)
    assert resolve_options(DecodeOptions(), None, jnp.bfloat16).kernels == "pallas"
    assert resolve_options(DecodeOptions(), None, jnp.float32).kernels == "jax"  # Pallas f32 attention is slow
    assert resolve_options(DecodeOptions(kernels="pallas"), None, jnp.float32).kernels == "pallas"
    monkeypatch.setenv(ENV_VAR, "pallas")
    assert resolve_options(DecodeOptions(), None, jnp.float32).kernels == "pallas"


def test_generate_cli_kernels_flag():
    from ddtree_jax.generate import parse_args

    assert parse_args([]).kernels == "auto"
    assert parse_args(["--kernels", "pallas"]).kernels == "pallas"
    with pytest.raises(SystemExit):
        parse_args(["--kernels", "reference"])


@pytest.mark.gpu
def test_pallas_kernels_on_gpu_are_lossless(tmp_path, monkeypatch):
    """On a GPU the default ("auto") is the Pallas path for 16-bit weights. Greedy DFlash and DDTree
    (budgets 16, 64) with the Pallas kernels give AR's tokens (float32, kernels forced: "auto" keeps
    float32 on the pure-JAX path), and Pallas AR gives the pure-JAX AR's tokens."""
    from test_dflash_decoding import PROMPTS

    monkeypatch.delenv(ENV_VAR, raising=False)
    assert DecodeOptions().runtime.pallas
    target = load_target(write_random_qwen3(tmp_path / "t", seed=2, with_tokenizer=False, vocab_size=16), jnp.float32)
    drafter = load_drafter(write_random_dflash(tmp_path / "d", tiny_qwen3_config(vocab_size=16), seed=3),
                           target.config, jnp.float32)
    max_new = 32
    ar_jax = generate(target, PROMPTS, DecodeOptions(max_new_tokens=max_new, kernels="jax")).output_ids
    assert generate(target, PROMPTS, DecodeOptions(max_new_tokens=max_new, kernels="pallas")).output_ids == ar_jax
    for options in (DecodeOptions(mode=Mode.DFLASH, max_new_tokens=max_new, kernels="pallas"),
                    DecodeOptions(mode=Mode.DDTREE, max_new_tokens=max_new, budget=16, kernels="pallas"),
                    DecodeOptions(mode=Mode.DDTREE, max_new_tokens=max_new, budget=64, kernels="pallas")):
        spec = generate(target, PROMPTS, options, drafter=drafter)
        assert spec.output_ids == ar_jax, (options.mode, options.budget)
        assert max(n for row in spec.acceptance_lengths for n in row) > 1  # drafts were accepted


def test_row_invariant_ddtree_gives_the_ar_tokens_in_bf16(tmp_path):
    """Issue 20 through the engine (kernels interpreted, bf16): with `row_invariant`, greedy DDTree at B = 64 on a
    batch of 2 (130 rows per verify: two of the streaming kernel's row groups; the attention's ancestor table)
    gives AR's tokens; the prompt's pass is row-invariant too. (DFlash: the compiled GPU runs.)"""
    target = load_target(write_random_qwen3(tmp_path / "t", seed=8, with_tokenizer=False), jnp.bfloat16)
    drafter = load_drafter(write_random_dflash(tmp_path / "d", tiny_qwen3_config(), seed=9), target.config,
                           jnp.bfloat16)
    prompts = [[1, 2, 3, 4, 5, 6, 7], [3, 9, 27]]
    outputs = {}
    for mode in (Mode.AR, Mode.DDTREE):
        options = DecodeOptions(mode=mode, max_new_tokens=10, budget=64, kernels="pallas", row_invariant=True)
        outputs[mode] = generate(target, prompts, options, drafter=drafter).output_ids
    assert outputs[Mode.DDTREE] == outputs[Mode.AR]


def test_fused_kv_write_gives_the_same_tokens_and_writes_no_cache_after_the_layers(tmp_path, monkeypatch):
    """`layers.FUSED_KV_WRITE` (on by default): the q/k-norm-RoPE kernel writes an AR step's and a prefill's K/V
    into the caches itself, so the step's program has no dynamic-update-slice of a cache left (it had two per
    layer), and AR and DDTree give the same tokens, acceptance and logits bits as with the writes after the layers
    (kernels interpreted)."""
    import collections

    from ddtree_jax import engine
    from ddtree_jax.models import layers, qwen3
    from ddtree_jax.models.contract import ForwardMeta
    from jaxprs import equations

    t_dir = write_random_qwen3(tmp_path / "t", seed=4, with_tokenizer=False, vocab_size=64)
    d_dir = write_random_dflash(tmp_path / "d", tiny_qwen3_config(vocab_size=64), seed=5, block_size=4)
    target = load_target(t_dir, jnp.float32)
    drafter = load_drafter(d_dir, target.config, jnp.float32)
    prompts = [[1, 2, 3, 4, 5], [3, 9]]
    cache = qwen3.create_cache(target.config, 2, 32, jnp.float32)
    cache = cache.__class__(k=cache.k, v=cache.v, lengths=jnp.array([3, 7], jnp.int32))
    meta = ForwardMeta.step(jnp.array([3, 7]), jnp.array([True, True]))
    runtime = DecodeOptions(kernels="pallas").runtime
    step = jax.jit(lambda p, t: qwen3.forward(p, t, meta, cache, runtime=runtime))
    outputs, steps = {}, {}
    for fused in (False, True):
        monkeypatch.setattr(layers, "FUSED_KV_WRITE", fused)
        program = jax.make_jaxpr(lambda p, t: qwen3.forward(p, t, meta, cache, runtime=runtime))(target,
                                                                                                   jnp.array([[5], [6]]))
        updates = sum(eqn.primitive.name in ("dynamic_update_slice", "scatter") and "pallas_call" not in outer
                      for eqn, outer in equations(program))
        assert updates == (0 if fused else 2 * target.config.num_layers), fused
        jax.clear_caches()  # the flag is read when tracing: every program traced afresh
        monkeypatch.setattr(engine, "_COMPILED", collections.OrderedDict())
        steps[fused] = step(target, jnp.array([[5], [6]]))
        outputs[fused] = [generate(target, prompts, DecodeOptions(mode=mode, max_new_tokens=8, budget=6,
                                                                 kernels="pallas"), drafter=drafter)
                          for mode in (Mode.AR, Mode.DDTREE)]
    for a, b in zip(jax.tree.leaves(steps[False]), jax.tree.leaves(steps[True])):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    for a, b in zip(*outputs.values()):
        assert a.output_ids == b.output_ids and a.acceptance_lengths == b.acceptance_lengths


def test_commit_rows_kernel_gives_the_same_tokens(tmp_path, monkeypatch):
    """`round.COMMIT_ROWS_KERNEL`: a round's kept K/V written into every layer's K and V cache by one kernel
    (`pallas_kernels.commit_rows`, interpreted), and the drafter's new context K/V by another, give DFlash and
    DDTree (two prompts: a batch of two rows, a chain and accepted paths: a 16-token vocabulary, where random drafts
    agree) the tokens and acceptance of a write per array; each launch takes all 2 L arrays of its model."""
    import collections

    from ddtree_jax import engine
    from ddtree_jax import round as rounds
    from pallas_kernels import commit_rows as cr

    t_dir = write_random_qwen3(tmp_path / "t", seed=2, with_tokenizer=False, vocab_size=16)
    d_dir = write_random_dflash(tmp_path / "d", tiny_qwen3_config(vocab_size=16), seed=3)
    target = load_target(t_dir, jnp.float32)
    drafter = load_drafter(d_dir, target.config, jnp.float32)
    launches, kernel = [], cr.commit_rows_pallas
    monkeypatch.setattr(cr, "commit_rows_pallas", lambda caches, *a, **k: launches.append(len(caches))
                        or kernel(caches, *a, **k))
    outputs = {}
    for one_launch in (False, True):
        monkeypatch.setattr(rounds, "COMMIT_ROWS_KERNEL", one_launch)
        jax.clear_caches()  # the flag is read when tracing: every program traced afresh
        monkeypatch.setattr(engine, "_COMPILED", collections.OrderedDict())
        outputs[one_launch] = [generate(target, [[1, 2, 3, 4, 5, 6, 7], [3, 9]], DecodeOptions(
            mode=mode, max_new_tokens=40, budget=16, kernels="pallas"), drafter=drafter)
            for mode in (Mode.DFLASH, Mode.DDTREE)]
        # one for the target's K/V, one for the drafter's new context rows
        want = {2 * target.config.num_layers, 2 * drafter.config.num_layers}
        assert (launches and set(launches) == want) if one_launch else not launches
    for a, b in zip(*outputs.values()):
        assert a.output_ids == b.output_ids and a.acceptance_lengths == b.acceptance_lengths
    for result in outputs[True]:  # paths past the root kept, in both modes
        assert max(max(lengths) for lengths in result.acceptance_lengths) > 1


def _pair_and_ar_step(tmp_path):
    """A random target (vocabulary 64) and drafter (block 4), a one-row cache at length 3, the Pallas runtime and
    the target's AR step on it (params, tokens [1, 1] -> hidden): (target, drafter, cache, runtime, step)."""
    from ddtree_jax.models import qwen3
    from ddtree_jax.models.contract import ForwardMeta

    t_dir = write_random_qwen3(tmp_path / "t", seed=4, with_tokenizer=False, vocab_size=64)
    d_dir = write_random_dflash(tmp_path / "d", tiny_qwen3_config(vocab_size=64), seed=5, block_size=4)
    target = load_target(t_dir, jnp.float32)
    drafter = load_drafter(d_dir, target.config, jnp.float32)
    cache = qwen3.create_cache(target.config, 1, 32, jnp.float32)
    cache = cache.__class__(k=cache.k, v=cache.v, lengths=jnp.array([3], jnp.int32))
    runtime = DecodeOptions(kernels="pallas").runtime
    meta = ForwardMeta.step(jnp.array([3]), jnp.array([True]))
    return target, drafter, cache, runtime, lambda p, t: qwen3.forward(p, t, meta, cache, runtime=runtime).hidden


def test_dense_stream_max_rows_streams_small_calls_projections_not_the_lm_head(tmp_path, monkeypatch):
    """`layers.DENSE_STREAM_MAX_ROWS` (32 by default; weights of `DENSE_STREAM_MIN_BYTES`, lowered here to this
    model's): at 1, an AR step's dense projections (q|k|v, o, gate|up and down: four a layer) run the streaming kernel
    and the lm_head does not (gate|up with `GLU_IN_EPILOGUE` the SwiGLU in its epilogue: one split at this size); a
    call of two rows at 1, and any call at 0, run none. The step's hidden states stay within float32 rounding of XLA's
    GEMMs, and greedy AR and DDTree give the tokens and acceptance of XLA's GEMMs (kernels interpreted)."""
    import collections

    from ddtree_jax import engine
    from ddtree_jax.models import layers, qwen3
    from ddtree_jax.models.contract import ForwardMeta
    from jaxprs import pallas_call_names

    target, drafter, cache, runtime, step = _pair_and_ar_step(tmp_path)

    def streams(tokens):
        rows = tokens.shape[1]
        meta = ForwardMeta.step(jnp.array([3]), jnp.array([True])) if rows == 1 else ForwardMeta.prompt(
            jnp.array([rows]), rows)
        program = jax.make_jaxpr(lambda p, t: qwen3.logits(p, qwen3.forward(p, t, meta, cache, runtime=runtime).hidden,
                                                           runtime))(target, tokens)
        names = pallas_call_names(program)
        glu = sum(kernel.startswith("stream_matmul") and kernel.endswith("_glu") for kernel in names)
        assert glu == (target.config.num_layers if rows <= layers.DENSE_STREAM_MAX_ROWS else 0), names
        return sum("stream_matmul" in kernel for kernel in names)

    hidden, outputs = {}, {}
    monkeypatch.setattr(layers, "DENSE_STREAM_MIN_BYTES", 0)
    monkeypatch.setattr(layers, "GLU_IN_EPILOGUE", True)
    for max_rows in (0, 1):
        monkeypatch.setattr(layers, "DENSE_STREAM_MAX_ROWS", max_rows)
        assert streams(jnp.array([[5]])) == 4 * target.config.num_layers * max_rows, max_rows
        assert streams(jnp.array([[5, 6]])) == 0, max_rows
        jax.clear_caches()  # the knob is read when tracing: every program traced afresh
        monkeypatch.setattr(engine, "_COMPILED", collections.OrderedDict())
        hidden[max_rows] = np.asarray(jax.jit(step)(target, jnp.array([[5]])))
        outputs[max_rows] = [generate(target, [[1, 2, 3, 4, 5], [3, 9]], DecodeOptions(
            mode=mode, max_new_tokens=8, budget=6, kernels="pallas"), drafter=drafter) for mode in (Mode.AR, Mode.DDTREE)]
    assert not np.array_equal(hidden[0], hidden[1])  # another GEMM: the sums in another order
    np.testing.assert_allclose(hidden[1], hidden[0], rtol=1e-5, atol=1e-5)
    for a, b in zip(outputs[0], outputs[1]):
        assert a.output_ids == b.output_ids and a.acceptance_lengths == b.acceptance_lengths
    assert outputs[1][0].output_ids == outputs[1][1].output_ids  # DDTree gives AR's tokens
