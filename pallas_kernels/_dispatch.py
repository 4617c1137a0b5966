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
import numpy as np

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
