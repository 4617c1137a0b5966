"""The same mesh code across two processes (jax.distributed on localhost, CPU collectives via gloo)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

from ddtree_jax.random_checkpoint import tiny_qwen3_config, write_random_dflash, write_random_qwen3

TARGET = dict(vocab_size=64, num_attention_heads=8, num_key_value_heads=4, head_dim=8, intermediate_size=128)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _gloo_available() -> bool:
    import jax

    return "jax_cpu_collectives_implementation" in jax.config.values


def _env() -> dict[str, str]:
    # One host device per process; conftest's XLA_FLAGS (its CPU compile flags) kept.
    flags = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=1").strip()
    return {**os.environ, "XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu"}


@pytest.fixture(scope="module")
def pair_and_single(tmp_path_factory):
    """(command line, the one-process run's output ids): the reference both layouts are held to, run once."""
    root = tmp_path_factory.mktemp("multiprocess")
    target = write_random_qwen3(root / "t", seed=4, with_tokenizer=False, **TARGET)
    drafter = write_random_dflash(root / "d", tiny_qwen3_config(**TARGET), seed=5, block_size=4)
    common = [sys.executable, "-m", "ddtree_jax.generate", "--target", str(target), "--drafter", str(drafter),
              "--prompt-ids", "1,2,3", "--json", "--max-new-tokens", "12", "--dtype", "float32", "--budget", "8"]
    single = subprocess.run(common, capture_output=True, text=True, timeout=300, env=_env())
    assert single.returncode == 0, single.stderr
    return common, json.loads(single.stdout)["output_ids"]


@pytest.mark.skipif(not _gloo_available(), reason="this JAX has no CPU collectives (gloo) for multi-process runs")
@pytest.mark.parametrize("parallel", ["tp", "dp"])
def test_two_processes_match_one(pair_and_single, parallel):
    common, single = pair_and_single
    port = _free_port()
    procs = [subprocess.Popen(common + ["--devices", "2", "--parallel", parallel, "--coordinator", f"127.0.0.1:{port}",
                                        "--num-processes", "2", "--process-id", str(i)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env()) for i in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err
        # gloo's C++ layer prints a connection line to stdout first; the report is the last line.
        assert json.loads(out.strip().splitlines()[-1])["output_ids"] == single
