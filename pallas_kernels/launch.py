"""Each kernel lets the next one be placed early: the launch signal of Hopper's programmatic dependent launch.

XLA launches each kernel of a program as a dependent of the kernel before it and puts the wait for that kernel
(`griddepcontrol.wait`) at its entry; without a signal the next kernel is placed on the multiprocessors only once
every program of this one has exited. With EARLY_LAUNCH every `pallas_call` of the package (through `kernel_body`)
signals at its entry (`griddepcontrol.launch_dependents`), so the next kernel's programs are placed while this one
runs and wait there. What a kernel reads stays ordered by its wait: the signal changes when a kernel is placed,
never what it reads, and where the next kernel is not launched as a dependent it does nothing.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

# H100s, 2026-12-06 (docs/performance.md): the 8B AR step and DFlash round 1.0-1.5% faster, DDTree B = 15 / 64
# 0.2-0.8%, in every pair; `tools/with_knobs.py engine:early_launch=0` runs without it.
EARLY_LAUNCH = True
_SIGNAL = "griddepcontrol.launch_dependents;\n\tmov.u32 $0, $1;"  # the 0 it is given, through the asm


def early_launch_supported() -> bool:
    """Whether the first device takes the signal: a CUDA GPU of compute capability 9.0 or more (ptxas rejects
    `griddepcontrol` below sm_90)."""
    try:
        device = jax.devices()[0]
    except RuntimeError:
        return False
    if device.platform != "gpu":
        return False
    try:
        return float(getattr(device, "compute_capability", "0")) >= 9.0
    except ValueError:  # a ROCm device names its architecture (gfx...)
        return False


def kernel_body(body, interpret: bool):
    """A Pallas kernel's body for `pl.pallas_call`: `body` itself, or (EARLY_LAUNCH, compiled for a GPU that takes
    it) `body` behind the launch signal. The body runs under `pl.when` on the 0 that the signal's asm passes
    through, so Triton keeps the asm (it sees no other effect of it) and issues it first."""
    if not EARLY_LAUNCH or interpret or not early_launch_supported():
        return body

    def signalled(*refs):
        (zero,) = plt.elementwise_inline_asm(_SIGNAL, args=[jnp.zeros((1,), jnp.int32)], constraints="=r,r",
                                             pack=1, result_shape_dtypes=[jax.ShapeDtypeStruct((1,), jnp.int32)])
        pl.when(jnp.max(zero) == 0)(lambda: body(*refs))

    name = getattr(body, "__name__", None) or body.func.__name__  # the kernel's name in traces (a partial's)
    signalled.__name__ = signalled.__qualname__ = name
    return signalled
