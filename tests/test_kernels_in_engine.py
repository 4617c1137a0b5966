"""The Pallas kernels behind the engine (interpreted on CPU) give the tokens of the pure-JAX path."""

from __future__ import annotations

import jax.numpy as jnp

from ddtree_jax.checkpoint import load_drafter, load_target
from ddtree_jax.engine import DecodeOptions, Mode, generate
from ddtree_jax.parallel import make_parallel
from ddtree_jax.random_checkpoint import tiny_qwen3_config, write_random_dflash, write_random_qwen3


def test_ddtree_with_pallas_kernels_matches_jax(tmp_path):
    target = load_target(write_random_qwen3(tmp_path / "t", seed=2, with_tokenizer=False, vocab_size=16), jnp.float32)
    drafter = load_drafter(write_random_dflash(tmp_path / "d", tiny_qwen3_config(vocab_size=16), seed=3),
                           target.config, jnp.float32)
    prompts = [[1, 2, 3, 4, 5], [3, 9]]
    for mode in (Mode.AR, Mode.DDTREE):
        options = DecodeOptions(mode=mode, max_new_tokens=8, budget=6)
        jax_out = generate(target, prompts, options, drafter=drafter)
        pallas_out = generate(target, prompts, DecodeOptions(mode=mode, max_new_tokens=8, budget=6, kernels="pallas"),
                              drafter=drafter)
        assert pallas_out.output_ids == jax_out.output_ids
        assert pallas_out.acceptance_lengths == jax_out.acceptance_lengths


def test_pallas_attention_under_tp_shard_map_matches_one_device(tmp_path):
    target_kw = dict(vocab_size=64, num_attention_heads=8, num_key_value_heads=4, head_dim=8, intermediate_size=128)
    t_dir = write_random_qwen3(tmp_path / "t", seed=4, with_tokenizer=False, **target_kw)
    d_dir = write_random_dflash(tmp_path / "d", tiny_qwen3_config(**target_kw), seed=5, block_size=4,
                                num_key_value_heads=4)
    prompts = [[1, 2, 3, 4, 5], [3, 9]]
    target = load_target(t_dir, jnp.float32)
    single = generate(target, prompts, DecodeOptions(mode=Mode.DDTREE, max_new_tokens=8, budget=6),
                      drafter=load_drafter(d_dir, target.config, jnp.float32))
    parallel = make_parallel(2, "tp")
    options = DecodeOptions(mode=Mode.DDTREE, max_new_tokens=8, budget=6, kernels="pallas", parallel=parallel)
    assert options.attention_kernels == ("pallas", parallel.mesh)
    target = load_target(t_dir, jnp.float32, parallel=parallel)
    tp = generate(target, prompts, options, drafter=load_drafter(d_dir, target.config, jnp.float32, parallel=parallel))
    assert tp.output_ids == single.output_ids and tp.acceptance_lengths == single.acceptance_lengths
