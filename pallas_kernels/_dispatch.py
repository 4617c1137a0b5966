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
