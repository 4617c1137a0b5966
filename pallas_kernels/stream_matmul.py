"""Weight-streaming matmul for few rows (Pallas, Triton): y [t, n] = x [t, k] @ w [n, k]^T.

At decode time the rows are the tokens a call verifies (1 for AR, bs for DFlash, B + 1 for DDTree) and the
cost is reading w once: 16 GB per Qwen3-8B step. cuBLAS streams it at ~4.1 TB/s for one row but at ~3.2
TB/s for 65 (docs/performance.md). Here every row count runs the same streaming loop:

- one program owns `block_n` rows of w and one of `splits` slices of the k axis, and walks its slice in
  `block_k` steps (Triton pipelines the loads `num_stages` deep), multiplying each [block_n, block_k]
  weight tile by the [block_k, tp] tile of x^T (tp = t padded to a power of two >= 16) into a float32
  [block_n, tp] accumulator;
- the `splits` partial sums are added in a fixed order outside the kernel (plain jnp), so that small
  matrices still give every streaming multiprocessor work (`splits` defaults to about two programs per
  multiprocessor).

Letters: t rows (tokens), tp padded rows, k input features, n output features, s splits of k.
`stream_matmul_reference` is the plain-jnp restatement (float32 accumulation, result in x's dtype).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels._dispatch import check_knobs, core_count, next_pow2, resolve_implementation, resolve_interpret


@dataclasses.dataclass(frozen=True)
class StreamMatmulConfig:
    """Tuning knobs (static, hashable).

    block_n:  weight rows per program; a power of two >= 16.
    block_k:  input features per step; a power of two >= 16.
    splits:   slices of the k axis (each its own program); None: enough for about two programs per streaming
              multiprocessor, among the divisors of k / block_k.
    num_warps, num_stages: Triton's warps per program and software-pipelining depth.
    """

    block_n: int = 64
    block_k: int = 128
    splits: int | None = None
    num_warps: int = 4
    num_stages: int = 4

    def __post_init__(self):
        check_knobs(self, pow2={"block_n": 16, "block_k": 16}, optional_counts=("splits",))


def _kernel(x_ref, w_ref, o_ref, *, block_k: int, steps: int, precision):
    # x_ref [tp, ks] rows of x, this split's k slice; w_ref [block_n, ks] weight rows; o_ref [block_n, tp] f32.
    def step(i, acc):
        cols = pl.ds(i * block_k, block_k)
        w = w_ref[:, cols]
        x = x_ref[:, cols]
        return acc + lax.dot_general(w, x, (((1,), (1,)), ((), ())), precision=precision,
                                     preferred_element_type=jnp.float32)

    o_ref[...] = lax.fori_loop(0, steps, step, jnp.zeros(o_ref.shape, jnp.float32))


def _splits(k: int, n_blocks: int, config: StreamMatmulConfig) -> int:
    if config.splits is not None:
        if k % (config.splits * config.block_k):
            raise ValueError(f"k={k} does not divide into splits={config.splits} x block_k={config.block_k}")
        return config.splits
    steps = k // config.block_k
    want = max(1, round(2 * core_count() / n_blocks))
    return max(s for s in range(1, steps + 1) if steps % s == 0 and s <= want)


@functools.partial(jax.jit, static_argnames=("config", "interpret", "debug"))
def stream_matmul_pallas(x, w, *, config: StreamMatmulConfig | None = None, interpret: bool = False,
                         debug: bool = False) -> jax.Array:
    """The Pallas kernel; arguments and result as `stream_matmul_reference`, plus the knobs."""
    config = StreamMatmulConfig() if config is None else config
    _check(x, w)
    t, k = x.shape
    n = w.shape[0]
    block_n = min(config.block_n, next_pow2(n))
    if n % block_n or k % config.block_k:
        raise ValueError(f"w [n, k] = {w.shape}: n must divide by block_n={block_n} and k by "
                         f"block_k={config.block_k}")
    tp = max(16, next_pow2(t))
    splits = _splits(k, n // block_n, config)
    ks = k // splits
    precision = lax.Precision.HIGHEST if x.dtype == jnp.float32 else lax.Precision.DEFAULT
    xp = jnp.pad(x.astype(w.dtype), [(0, tp - t), (0, 0)])
    partial_sums = pl.pallas_call(
        functools.partial(_kernel, block_k=config.block_k, steps=ks // config.block_k, precision=precision),
        grid=(n // block_n, splits),
        in_specs=[pl.BlockSpec((tp, ks), lambda i, s: (0, s)),  # x rows, this split's k slice
                  pl.BlockSpec((block_n, ks), lambda i, s: (i, s))],  # w rows
        out_specs=pl.BlockSpec((None, block_n, tp), lambda i, s: (s, i, 0)),
        out_shape=jax.ShapeDtypeStruct((splits, n, tp), jnp.float32),
        compiler_params=plt.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages),
        interpret=interpret,
        debug=debug,
        name="stream_matmul",
    )(xp, w)
    total = partial_sums[0]
    for s in range(1, splits):  # a fixed order, whatever t is
        total = total + partial_sums[s]
    return total[:, :t].T.astype(x.dtype)


def stream_matmul(x, w, *, implementation: str | None = None, config: StreamMatmulConfig | None = None,
                  interpret: bool | None = None) -> jax.Array:
    """Dispatcher: the Pallas kernel on a GPU, the reference elsewhere (see `pallas_kernels.resolve_implementation`)."""
    if resolve_implementation(implementation) == "reference":
        return stream_matmul_reference(x, w)
    return stream_matmul_pallas(x, w, config=config, interpret=resolve_interpret(interpret))


def _check(x, w):
    if x.ndim != 2 or w.ndim != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"x must be [t, k] and w [n, k], got {x.shape} and {w.shape}")


@jax.jit
def stream_matmul_reference(x, w) -> jax.Array:
    """x [t, k] @ w [n, k]^T -> [t, n] in x's dtype, accumulated in float32 (w in its HF [out, in] layout)."""
    _check(x, w)
    precision = lax.Precision.HIGHEST if x.dtype == jnp.float32 else lax.Precision.DEFAULT
    return jnp.einsum("tk,nk->tn", x, w.astype(x.dtype), precision=precision,
                      preferred_element_type=jnp.float32).astype(x.dtype)


__all__ = ["StreamMatmulConfig", "stream_matmul", "stream_matmul_pallas", "stream_matmul_reference"]
