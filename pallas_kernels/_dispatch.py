"""Which implementation a kernel dispatcher runs: the Pallas kernel or the plain-jnp reference.

Order of precedence: the call's `implementation=` argument, then the `DDTREE_JAX_KERNELS` environment
variable (`pallas`, or `reference` with its alias `jax`), then the backend (Pallas on a GPU, the
reference elsewhere). The choice is made when the caller is traced, so a jitted function keeps the
implementation it was compiled with.

The engine's own option (`ddtree_jax.engine.DecodeOptions.kernels`: "auto", "jax" or "pallas") resolves
through `resolve_kernels` below, by the same rule: "auto" is the variable if set, else the backend.
"""

from __future__ import annotations

import os

import jax
import numpy as np

ENV_VAR = "DDTREE_JAX_KERNELS"
IMPLEMENTATIONS = ("pallas", "reference")
ALIASES = {"jax": "reference"}  # the engine's name for the plain-JAX path
KERNEL_CHOICES = ("auto", "jax", "pallas")  # the engine's option (DecodeOptions.kernels, --kernels)


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


def resolve_kernels(kernels: str, dtype=None) -> str:
    """The engine's kernels, "jax" or "pallas". "auto": $DDTREE_JAX_KERNELS if set (pallas; reference or
    jax), else "pallas" on a GPU for 16-bit compute (`dtype` None or 2 bytes wide) and "jax" otherwise: the
    float32 Pallas attention is many times slower than XLA's on the H200 (docs/kernels.md). "jax" and
    "pallas" are kept as given."""
    if kernels not in KERNEL_CHOICES:
        raise ValueError(f"kernels must be one of {', '.join(KERNEL_CHOICES)}, got {kernels!r}")
    if kernels != "auto":
        return kernels
    if os.environ.get(ENV_VAR):
        return "pallas" if resolve_implementation(None) == "pallas" else "jax"
    wide = dtype is not None and np.dtype(dtype).itemsize > 2
    return "pallas" if on_gpu() and not wide else "jax"


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
