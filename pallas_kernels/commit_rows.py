"""A round's kept K/V rows written into every layer's cache in one launch (Pallas, Triton).

A speculative round verifies T nodes and keeps P of them (a chain's first P, or a tree's accepted path); their
keys and values go to cache slots [start, start + P) of each row, in every attention layer, K and V: 2 L
arrays. Written by XLA that is one dynamic-update-slice kernel per array (72 at the Qwen3-8B shape: ~0.13 ms of a
DFlash or DDTree round on the H200, 2026-12-05, docs/performance.md); here one kernel writes them all. Its grid is
(array, batch row, kept row): each program copies one node's [n * d] row, and picks its array by a static branch
on the first grid index (a Pallas kernel cannot index a list of refs dynamically). The caches are aliased to the
outputs, so they are updated in place.

Letters: L arrays (layers x {K, V}), b batch rows, s cache slots, T verified nodes, P kept rows, n KV heads,
d head dim.

`commit_rows_reference` is the jnp statement (`lax.dynamic_update_slice` per array and row, a start past s - P
clamped to it as that clamps); the kernel gives the same arrays bit for bit (it moves bits; nothing is computed).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels._dispatch import next_pow2, resolve_implementation, resolve_interpret
from pallas_kernels.launch import kernel_body


def _kernel(starts_ref, path_ref, *refs, arrays: int, s: int, t: int, p: int, width: int):
    # starts_ref [b] int32; path_ref [b, P] int32 (node of each kept row); then the L node arrays [b * T, n * d],
    # the L caches [b * s, n * d] as inputs (aliased) and as outputs (two dims: 64-bit offsets into a large cache).
    rows_refs, out_refs = refs[:arrays], refs[2 * arrays:]
    array, row, kept = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    source = row * t + path_ref[row, kept]
    target = row * s + jnp.minimum(starts_ref[row], s - p) + kept  # dynamic_update_slice's clamp
    at = jnp.arange(next_pow2(width), dtype=jnp.int32)
    ok = at < width
    for j in range(arrays):
        @pl.when(array == j)
        def _(j=j):
            values = plt.load(rows_refs[j].at[jnp.broadcast_to(source, at.shape), at], mask=ok)
            plt.store(out_refs[j].at[jnp.broadcast_to(target, at.shape), at], values, mask=ok)


@functools.partial(jax.jit, static_argnames=("interpret",))
def commit_rows_pallas(caches, rows, starts, path=None, *, interpret: bool = False):
    """The Pallas kernel; arguments and result as `commit_rows_reference` (the caches aliased to the results:
    updated in place where the caller's buffers can be, as inside the decode loop)."""
    caches, rows = tuple(caches), tuple(rows)
    _check(caches, rows, starts, path)
    b, s, n, d = caches[0].shape
    t = rows[0].shape[1]
    if path is None:
        path = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    p = path.shape[1]
    arrays, width = len(caches), n * d

    def whole(shape):
        return pl.BlockSpec(shape, lambda *_: (0,) * len(shape))

    flat_rows = [r.reshape(b * t, width) for r in rows]
    flat_caches = [c.reshape(b * s, width) for c in caches]
    outs = pl.pallas_call(
        kernel_body(functools.partial(_kernel, arrays=arrays, s=s, t=t, p=p, width=width), interpret),
        grid=(arrays, b, p),
        in_specs=[whole((b,)), whole((b, p))] + [whole((b * t, width))] * arrays + [whole((b * s, width))] * arrays,
        out_specs=[whole((b * s, width))] * arrays,
        out_shape=[jax.ShapeDtypeStruct((b * s, width), c.dtype) for c in caches],
        input_output_aliases={2 + arrays + j: j for j in range(arrays)},
        compiler_params=plt.CompilerParams(num_warps=1, num_stages=1),
        interpret=interpret,
        name="commit_rows",
    )(starts.astype(jnp.int32), path.astype(jnp.int32), *flat_rows, *flat_caches)
    return tuple(out.reshape(b, s, n, d) for out in outs)


@jax.jit
def commit_rows_reference(caches, rows, starts, path=None):
    """caches: L arrays [b, s, n, d]; rows: L arrays [b, T, n, d] of the caches' dtypes; starts [b] int; path
    [b, P] int node indices (None: the T nodes in order, P = T). Returns the caches with cache[r, starts[r] + i] =
    rows[r, path[r, i]] for i < P (a start past s - P clamped to s - P, as `lax.dynamic_update_slice` clamps).
    Example: start 5, path [0 2 5] -> nodes 0, 2, 5 land in slots 5, 6, 7."""
    caches, rows = tuple(caches), tuple(rows)
    _check(caches, rows, starts, path)

    def write(cache, nodes):
        if path is not None:
            nodes = jnp.take_along_axis(nodes, path[:, :, None, None].astype(jnp.int32), axis=1)
        return jax.vmap(lambda c, x, start: lax.dynamic_update_slice(c, x, (start, 0, 0)))(
            cache, nodes, starts.astype(jnp.int32))

    return tuple(map(write, caches, rows))


def commit_rows(caches, rows, starts, path=None, *, implementation: str | None = None,
                interpret: bool | None = None):
    """Dispatcher: the Pallas kernel on a GPU, the reference elsewhere (`pallas_kernels.resolve_implementation`)."""
    if resolve_implementation(implementation) == "reference":
        return commit_rows_reference(caches, rows, starts, path)
    return commit_rows_pallas(caches, rows, starts, path, interpret=resolve_interpret(interpret))


def _check(caches, rows, starts, path):
    if not caches or len(caches) != len(rows):
        raise ValueError(f"one node array per cache: {len(caches)} caches, {len(rows)} node arrays")
    shape = caches[0].shape
    if len(shape) != 4 or any(c.shape != shape or c.dtype != caches[0].dtype for c in caches):
        raise ValueError(f"caches must be [b, s, n, d] of one shape and dtype, got "
                         f"{sorted({(c.shape, str(c.dtype)) for c in caches})}")
    b, s, n, d = shape
    t = rows[0].shape[1] if rows[0].ndim == 4 else None
    if any(r.ndim != 4 or r.shape != (b, t, n, d) or r.dtype != caches[0].dtype for r in rows):
        raise ValueError(f"node arrays must be [b, T, n, d] = [{b}, T, {n}, {d}] in {caches[0].dtype}, got "
                         f"{sorted({(r.shape, str(r.dtype)) for r in rows})}")
    if starts.shape != (b,):
        raise ValueError(f"starts must be [b] = [{b}], got {starts.shape}")
    p = t if path is None else path.shape[1]
    if path is not None and (path.ndim != 2 or path.shape[0] != b):
        raise ValueError(f"path must be [b, P] = [{b}, P], got {path.shape}")
    if p > s:
        raise ValueError(f"{p} kept rows do not fit {s} cache slots")


__all__ = ["commit_rows", "commit_rows_pallas", "commit_rows_reference"]
