"""Block-scaled FP8 weights: the arithmetic of the published format (`config.Fp8Config` says which
projections use it).

A weight W [o, i] is stored as float8_e4m3fn Q [o, i] and float scales S [ceil(o / bo), ceil(i / bi)]
(`weight_scale_inv`) for blocks of bo x bi; W[r, c] = Q[r, c] * S[r // bo, c // bi], computed in float32
(as transformers' `Fp8Dequantize`). Edge blocks may be partial.

Worked example, o = 3, i = 5, block (2, 4): S is [2, 2]; rows 0-1 read S[0], row 2 S[1]; columns 0-3 read
S[:, 0], column 4 S[:, 1]; so W[2, 4] = Q[2, 4] * S[1, 1].
"""

from __future__ import annotations

import jax.numpy as jnp

from pallas_kernels import stream_matmul

FP8_DTYPE = jnp.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite float8_e4m3fn


def scale_shape(shape: tuple[int, int], block: tuple[int, int]) -> tuple[int, int]:
    """[o, i] weight -> its [ceil(o / bo), ceil(i / bi)] scales."""
    return -(-shape[0] // block[0]), -(-shape[1] // block[1])


def scale_axes(axes: tuple, shape: tuple[int, int], block: tuple[int, int]) -> tuple:
    """The scales' logical axes: the weight's where the weight dim is whole blocks, else None (replicated).

    Under tensor parallelism a dim of n blocks splits over N devices only when N divides n
    (`parallel.Parallel.param_spec`), and then each device's weight rows are exactly its scales' blocks.
    Elsewhere (a partial edge block) the scales stay replicated; XLA's partitioner still gives the same
    product, since the program is written for the whole array.
    """
    return tuple(a if dim % b == 0 else None for a, dim, b in zip(axes, shape, block))


def expand_scales(scale_inv, shape: tuple[int, int], block: tuple[int, int]):
    """scales [so, si] -> [o, i] float32, each weight element's block scale."""
    expanded = jnp.repeat(jnp.repeat(scale_inv.astype(jnp.float32), block[0], axis=0)[:shape[0]], block[1], axis=1)
    return expanded[:, :shape[1]]


def dequantize(weight, scale_inv, block: tuple[int, int], dtype):
    """FP8 weight [o, i] and its scales -> the dense weight [o, i] in `dtype` (the product in float32)."""
    return (weight.astype(jnp.float32) * expand_scales(scale_inv, weight.shape, block)).astype(dtype)


# The W8A8 activations' quantisation (per row and group of the block's input features, power-of-two scales): the
# rule the streaming kernel applies inside itself, defined beside it.
quantize_rows = stream_matmul.quantize_rows


def quantize(weight, block: tuple[int, int], scale_dtype=jnp.float32):
    """Dense weight [o, i] -> (float8_e4m3fn weight [o, i], scales [so, si] in `scale_dtype`).

    Each block's scale is its largest |w| / 448 (1 for an all-zero block), rounded to `scale_dtype`; the
    weight is divided by that stored scale, clipped to +-448 and rounded to nearest.
    """
    o, i = weight.shape
    so, si = scale_shape((o, i), block)
    w = weight.astype(jnp.float32)
    padded = jnp.pad(jnp.abs(w), ((0, so * block[0] - o), (0, si * block[1] - i)))
    amax = padded.reshape(so, block[0], si, block[1]).max(axis=(1, 3))
    scale = jnp.where(amax > 0, amax / FP8_MAX, 1.0).astype(scale_dtype)
    q = jnp.clip(w / expand_scales(scale, (o, i), block), -FP8_MAX, FP8_MAX).astype(FP8_DTYPE)
    return q, scale
