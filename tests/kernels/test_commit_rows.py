"""The one-launch K/V commit (every layer's kept rows) and its reference against a NumPy restatement, interpreted on
CPU and compiled on a GPU (marked `gpu`)."""

from __future__ import annotations

import numpy as np
import jax.numpy as jnp
import pytest

from pallas_kernels import commit_rows as cr

INTERPRET = [pytest.param(True, id="interpret"), pytest.param(False, id="compiled", marks=pytest.mark.gpu)]


def _arrays(arrays, b, s, t, n, d, dtype, seed):
    rng = np.random.default_rng(seed)
    caches = [jnp.asarray(rng.standard_normal((b, s, n, d)), jnp.float32).astype(dtype) for _ in range(arrays)]
    rows = [jnp.asarray(rng.standard_normal((b, t, n, d)), jnp.float32).astype(dtype) for _ in range(arrays)]
    return caches, rows


def _numpy(caches, rows, starts, path):
    """cache[r, min(start, s - P) + i] = rows[r, path[r, i]], element by element."""
    out = [np.asarray(c, np.float32).copy() for c in caches]
    b, s = out[0].shape[:2]
    t = rows[0].shape[1]
    nodes = np.broadcast_to(np.arange(t), (b, t)) if path is None else np.asarray(path)
    for cache, new in zip(out, rows):
        new = np.asarray(new, np.float32)
        for r in range(b):
            at = min(int(starts[r]), s - nodes.shape[1])
            for i, node in enumerate(nodes[r]):
                cache[r, at + i] = new[r, node]
    return out


# (arrays, b, s, T, n, d, dtype, starts, path): a DFlash chain of one row (all T nodes in order); a DDTree path in
# two rows (one start past s - P: clamped); three KV heads of 24 (a row of 72 values, not a power of two).
CASES = [(4, 1, 16, 5, 2, 16, "bfloat16", [3], None),
         (6, 2, 12, 7, 2, 8, "bfloat16", [2, 10], [[0, 2, 3, 6], [0, 1, 4, 4]]),
         (2, 1, 9, 4, 3, 24, "float32", [0], [[0, 3, 3]])]


@pytest.mark.parametrize("interpret", INTERPRET)
@pytest.mark.parametrize("arrays,b,s,t,n,d,dtype,starts,path", CASES,
                         ids=["chain", "path-2rows-clamped", "n3-d24-float32"])
def test_writes_the_kept_rows_of_every_array(arrays, b, s, t, n, d, dtype, starts, path, interpret):
    caches, rows = _arrays(arrays, b, s, t, n, d, dtype, seed=arrays * s)
    starts = jnp.asarray(starts, jnp.int32)
    path = None if path is None else jnp.asarray(path, jnp.int32)
    want = _numpy(caches, rows, starts, path)
    for got in (cr.commit_rows_pallas(caches, rows, starts, path, interpret=interpret),
                cr.commit_rows_reference(caches, rows, starts, path)):
        assert len(got) == arrays
        for a, w in zip(got, want):
            assert a.shape == (b, s, n, d) and a.dtype == jnp.dtype(dtype)
            np.testing.assert_array_equal(np.asarray(a, np.float32), w)
    # Negative control: another path writes other rows.
    if path is not None:
        moved = cr.commit_rows_pallas(caches, rows, starts, path[:, ::-1], interpret=interpret)
        assert not all(np.array_equal(np.asarray(a, np.float32), w) for a, w in zip(moved, want))


def test_bad_inputs_say_what_was_expected():
    caches, rows = _arrays(2, 1, 8, 3, 2, 8, "float32", seed=1)
    starts = jnp.zeros((1,), jnp.int32)
    with pytest.raises(ValueError, match="one node array per cache: 2 caches, 1 node arrays"):
        cr.commit_rows_reference(caches, rows[:1], starts)
    with pytest.raises(ValueError, match=r"node arrays must be \[b, T, n, d\] = \[1, T, 2, 8\]"):
        cr.commit_rows_reference(caches, [r[..., :4] for r in rows], starts)
    with pytest.raises(ValueError, match=r"starts must be \[b\] = \[1\]"):
        cr.commit_rows_reference(caches, rows, jnp.zeros((2,), jnp.int32))
    with pytest.raises(ValueError, match=r"path must be \[b, P\] = \[1, P\]"):
        cr.commit_rows_reference(caches, rows, starts, jnp.zeros((2, 3), jnp.int32))
