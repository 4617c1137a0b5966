"""Which implementation a kernel dispatcher runs: the Pallas kernel or the plain-jnp reference.

Order of precedence: the call's `implementation=` argument, then the `DDTREE_JAX_KERNELS` environment
variable (`pallas`, or `reference` with its alias `jax`), then the backend (Pallas on a GPU, the
reference elsewhere). The choice is made when the caller is traced, so a jitted function keeps the
implementation it was compiled with.

The package's public names for callers (`pallas_kernels.ENV_VAR`, `resolve_implementation`, `on_gpu`)
are re-exported by `pallas_kernels/__init__.py`; the rest of this module is the kernels' own plumbing.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

ENV_VAR = "DDTREE_JAX_KERNELS"
IMPLEMENTATIONS = ("pallas", "reference")
ALIASES = {"jax": "reference"}  # the application's name for the plain-JAX path


def on_gpu() -> bool:
    return jax.default_backend() == "gpu"


def resolve_implementation(implementation: str | None) -> str:
    """'pallas' or 'reference'; raises ValueError naming the argument or variable that is bad."""
    source = "implementation"
    if implementation is None:
        implementation = os.environ.get(ENV_VAR) or None
        source = f"${ENV_VAR}"
    if implementation is None:
        return "pallas" if on_gpu() else "reference"
    implementation = ALIASES.get(implementation, implementation)
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"{source}={implementation!r}: expected one of {', '.join(IMPLEMENTATIONS)}")
    return implementation


def resolve_interpret(interpret: bool | None) -> bool:
    """None means: interpret the kernel wherever there is no GPU to compile it for."""
    return (not on_gpu()) if interpret is None else bool(interpret)


def next_pow2(x: int) -> int:
    return 1 if x <= 1 else 1 << (x - 1).bit_length()


def is_pow2(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x > 0 and x & (x - 1) == 0


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def round_up(a: int, b: int) -> int:
    return cdiv(a, b) * b


def core_count(default: int = 132) -> int:
    """Streaming multiprocessors of the first device (132 on an H200), to size grids; `default` elsewhere."""
    try:
        count = getattr(jax.devices()[0], "core_count", None)
    except RuntimeError:
        count = None
    return int(count) if isinstance(count, int) and count > 0 else default


def check_knobs(config, *, pow2: dict[str, int], optional_counts: tuple[str, ...] = ()) -> None:
    """Validate a kernel's frozen knob dataclass, naming the bad value: each field of `pow2` a power of two
    >= its minimum, each of `optional_counts` None or an int >= 1, and `num_warps` / `num_stages` as Triton
    takes them."""
    owner = type(config).__name__
    for name, minimum in pow2.items():
        value = getattr(config, name)
        if not is_pow2(value) or value < minimum:
            at_least = f" >= {minimum}" if minimum > 1 else ""
            raise ValueError(f"{owner}.{name}={value!r}: must be a power of two{at_least}")
    for name in optional_counts:
        value = getattr(config, name)
        if value is not None and not (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
            raise ValueError(f"{owner}.{name}={value!r}: must be None or an int >= 1")
    if config.num_warps not in (1, 2, 4, 8, 16) or isinstance(config.num_warps, bool):
        raise ValueError(f"{owner}.num_warps={config.num_warps!r}: must be 1, 2, 4, 8 or 16")
    if not isinstance(config.num_stages, int) or isinstance(config.num_stages, bool) or config.num_stages < 1:
        raise ValueError(f"{owner}.num_stages={config.num_stages!r}: must be an int >= 1")


# Programmatic dependent launch (Hopper and later). XLA launches each kernel of a program as a dependent of the
# kernel before it and puts the wait for that kernel at its entry; without a signal the next kernel is placed on the
# multiprocessors only once every program of this one has exited. With EARLY_LAUNCH each Pallas kernel signals at
# its entry (`griddepcontrol.launch_dependents`), so the next kernel's programs are placed while this one runs and
# wait there. What a kernel reads is still ordered by the wait (XLA's, at its entry): the signal changes when a
# kernel is placed, never what it reads. Where the next kernel is not launched as a dependent the signal does nothing.
# H100s, 2026-12-06: the 8B AR step and DFlash round 1.0-1.5% faster, DDTree B = 15 / 64 0.4-0.7%, in every pair.
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
