"""pallas_kernels.launch: the launch signal around a compiled kernel's body (EARLY_LAUNCH), seen in the Triton
IR that jax lowers for CUDA on this machine (the signal runs on a GPU only: GPU-marked tests of every kernel)."""

from __future__ import annotations

import sys
from pathlib import Path

import jax.numpy as jnp

from pallas_kernels import launch
from pallas_kernels.rms_norm import add_rms_norm_pallas

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
