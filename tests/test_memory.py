"""The memory estimate of a request, against sizes worked out by hand from the configs."""

from __future__ import annotations

import jax.numpy as jnp

from ddtree_jax.config import load_drafter_config, load_target_config, parse_dflash, parse_qwen3_5
from ddtree_jax.demo_pair import demo_drafter, demo_target
from ddtree_jax.engine import DecodeOptions, Mode, resolve_options
from ddtree_jax.memory import device_memory, estimate, format_bytes
from ddtree_jax.models import dflash, qwen3, qwen3_5
from ddtree_jax.parallel import make_parallel
from ddtree_jax.random_checkpoint import tiny_dflash_config, tiny_qwen3_5_config


def test_demo_pair_ddtree_float32():
    tc, dc = load_target_config(demo_target()), load_drafter_config(demo_drafter())
    target, drafter = qwen3.abstract(tc, jnp.float32), dflash.abstract(dc, tc.hidden_size, jnp.float32)
    options = resolve_options(DecodeOptions(mode=Mode.DDTREE, max_new_tokens=100, budget=64, kernels="jax"), drafter,
                              jnp.float32)
    need = estimate(target, drafter, options, batch=1, max_prompt_len=3)
    assert need.capacity == 256  # prompt bucket 32 + 100 new + 65 verified nodes = 197 -> a multiple of 128
    # layers x (K, V) x slots x kv heads x head_dim x float32, + the row's length (int32)
    assert need.kv_cache == 6 * 2 * 256 * 2 * 64 * 4 + 4
    assert need.drafter_cache == 2 * 2 * 256 * 2 * 64 * 4 + 4
    assert need.weights == (6_819_840 + 1_771_264) * 4  # the demo's parameter counts (assets/demo/summary.json)
    # float32 logits of the 65 nodes and the 15 drafted slots; the nodes' K/V (6 layers x K, V x 2 kv heads x
    # head_dim 64); one layer's attention scores of the widest call (the 65-node verify: 4 heads x 65 x (256
    # cached + 65 new)).
    assert need.verify_buffers == (65 + 15) * 8192 * 4 + 6 * 2 * 65 * 2 * 64 * 4 + 4 * 65 * (256 + 65) * 4
    assert need.recurrent == need.node_records == 0 and need.outputs == 2 * 100 * 4
    assert need.total == sum([need.weights, need.kv_cache, need.drafter_cache, need.verify_buffers, need.outputs])
    # AR: no drafter cache, one-token calls; a long prompt's prefill is the widest call.
    ar = estimate(target, drafter, resolve_options(DecodeOptions(max_new_tokens=100, kernels="jax"), None,
                                                   jnp.float32), batch=1, max_prompt_len=300)
    assert ar.capacity == 512 and ar.drafter_cache == 0 and ar.weights == 6_819_840 * 4  # 320 + 100 + 1 -> 512
    assert ar.verify_buffers == 8192 * 4 + 4 * 320 * (512 + 320) * 4


def test_hybrid_ddtree_bfloat16_over_two_dp_devices():
    tc = parse_qwen3_5(tiny_qwen3_5_config())
    dc = parse_dflash(tiny_dflash_config(tiny_qwen3_5_config()))
    target, drafter = qwen3_5.abstract(tc, jnp.bfloat16), dflash.abstract(dc, tc.hidden_size, jnp.bfloat16)
    options = resolve_options(DecodeOptions(mode=Mode.DDTREE, max_new_tokens=40, budget=7, kernels="jax",
                                            parallel=make_parallel(2, "dp")), drafter, jnp.bfloat16)
    need = estimate(target, drafter, options, batch=3, max_prompt_len=5)  # 3 rows over 2 devices: 2 per device
    assert need.capacity == 128
    assert need.kv_cache == 1 * 2 * 2 * 128 * 2 * 16 * 2 + 2 * 4  # one attention layer, 2 rows, bf16; lengths
    # 3 Gated DeltaNet layers x 2 rows x (4 value heads x 16 x 16 float32 + 128 conv channels x 3 bf16)
    assert need.recurrent == 3 * 2 * (4 * 16 * 16 * 4 + 128 * 3 * 2)
    # per node (8 of them): key 16 + value 16 + log decay 1 per value head in float32, and 128 conv inputs
    assert need.node_records == 3 * 2 * 8 * (4 * 33 * 4 + 128 * 2)


def test_device_memory_and_format():
    have, what = device_memory()
    assert have > 0 and what == "available host memory"  # the tests run on the CPU
    assert [format_bytes(n) for n in (512, 1536, 3 * 2**30)] == ["512 B", "1.5 KiB", "3.0 GiB"]
