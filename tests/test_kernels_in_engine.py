"""The Pallas kernels behind the engine (interpreted on CPU) give the tokens of the pure-JAX path."""

from __future__ import annotations

import jax.numpy as jnp
import pytest

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


def test_pallas_under_tp_is_refused_clearly():
    with pytest.raises(ValueError, match="not yet under shard_map in tp"):
        DecodeOptions(kernels="pallas", parallel=make_parallel(2, "tp"))
