"""pallas_kernels.launch: the launch signal around a compiled kernel's body (EARLY_LAUNCH), seen in the Triton
IR that jax lowers for CUDA on this machine (the signal runs on a GPU only: GPU-marked tests of every kernel)."""

from __future__ import annotations

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import launch
from pallas_kernels.rms_norm import add_rms_norm_pallas
from pallas_kernels.stream_matmul import stream_matmul_pallas
from pallas_kernels.tree_attention import tree_attention_pallas

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
import triton_offline  # noqa: E402

SIGNAL = "griddepcontrol.launch_dependents"


def _norm_ir() -> str:
    x, w = jnp.ones((2, 64), jnp.bfloat16), jnp.ones((64,), jnp.bfloat16)
    return triton_offline.triton_ir(lambda x, w: add_rms_norm_pallas(x, None, w, eps=1e-6, interpret=False), (x, w))


def test_signal_comes_first_in_compiled_kernels_for_hopper(monkeypatch):
    monkeypatch.setattr(launch, "early_launch_supported", lambda: True)
    monkeypatch.setattr(launch, "EARLY_LAUNCH", True)
    signalled = _norm_ir()
    monkeypatch.setattr(launch, "EARLY_LAUNCH", False)
    plain = _norm_ir()
    assert signalled.count(SIGNAL) == 1 and SIGNAL not in plain
    # issued before the kernel reads or writes anything, and the body inside is the same kernel
    assert signalled.index(SIGNAL) < min(signalled.index("tt.load"), signalled.index("tt.store"))
    for op in ("tt.load", "tt.store"):
        assert signalled.count(op) == plain.count(op) > 0, op


def test_no_signal_when_interpreted_or_where_the_gpu_lacks_it(monkeypatch):
    def body(*refs):
        pass

    monkeypatch.setattr(launch, "EARLY_LAUNCH", True)
    monkeypatch.setattr(launch, "early_launch_supported", lambda: True)
    assert launch.kernel_body(body, interpret=True) is body
    assert launch.kernel_body(body, interpret=False) is not body
    assert launch.kernel_body(body, interpret=False).__name__ == "body"  # traces keep the kernel's name
    monkeypatch.setattr(launch, "early_launch_supported", lambda: False)  # below sm_90, ROCm, CPU
    assert launch.kernel_body(body, interpret=False) is body
    monkeypatch.undo()
    assert not launch.early_launch_supported()  # this machine: no GPU
    assert SIGNAL not in _norm_ir()


def _with_and_without_signal(monkeypatch) -> dict:
    """A norm, a streamed projection (one row and 16) and the attention over a cache (16 masked new rows), each
    compiled and run with the signal and without: {on: [arrays]}."""
    rng = np.random.default_rng(0)
    normal = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)  # noqa: E731
    b, t, s, hq, n, d = 1, 16, 256, 8, 2, 128
    norm_args = (normal(3, 4096), normal(3, 4096), normal(4096))
    w = normal(4096, 4096)
    rows = [normal(1, 4096), normal(16, 4096)]
    attention_args = (normal(b, t, hq, d), normal(b, s, n, d), normal(b, s, n, d), jnp.array([200], jnp.int32),
                      normal(b, t, n, d), normal(b, t, n, d), jnp.tril(jnp.ones((t, t), bool))[None],
                      200 + jnp.arange(t, dtype=jnp.int32)[None])
    results = {}
    for on in (True, False):
        monkeypatch.setattr(launch, "EARLY_LAUNCH", on)
        jax.clear_caches()  # the kernels are jitted: the signal is decided when they are traced
        results[on] = [add_rms_norm_pallas(*norm_args, eps=1e-6),
                       *[stream_matmul_pallas(x, w) for x in rows],
                       tree_attention_pallas(*attention_args, scale=d ** -0.5)]
    return {on: [np.asarray(a, np.float32) for a in jax.tree.leaves(r)] for on, r in results.items()}


@pytest.mark.gpu
def test_signalled_kernels_give_the_unsignalled_bits(monkeypatch):
    if not launch.early_launch_supported():
        pytest.skip("this GPU does not take the signal (below sm_90)")
    results = _with_and_without_signal(monkeypatch)
    for signalled, plain in zip(results[True], results[False], strict=True):
        np.testing.assert_array_equal(signalled, plain)
