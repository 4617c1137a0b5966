"""The tree-attention kernel against its plain-jnp reference (the models' own jnp path), and that reference
against an independent float64 NumPy restatement (one softmax over the cache and the new keys together).

Every kernel test class runs interpreted on CPU (interpret=True) and compiled on a GPU (interpret=False,
marked `gpu`, skipped without one). Inputs are fresh random arrays; masks are ancestor masks of random
trees (parents precede children) with padding nodes that see only themselves.
"""

from __future__ import annotations

import dataclasses
import functools
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import ENV_VAR
from pallas_kernels import tree_attention as ta

INTERPRET = [pytest.param(True, id="interpret"), pytest.param(False, id="compiled", marks=pytest.mark.gpu)]


@dataclasses.dataclass(frozen=True)
class Case:
    t: int  # new tokens
    n: int  # KV heads
    g: int  # query heads per KV head
    s: int  # cache slots
    lengths: tuple[int, ...]  # committed slots per row (batch = len(lengths))
    d: int = 32
    window: int | None = None
    dtype: str = "float32"
    valid: int | None = None  # tree nodes that are real (the rest are padding); None = all
    config: ta.TreeAttentionConfig = ta.TreeAttentionConfig(block_q=16, block_k=16)

    def __str__(self):
        return (f"t{self.t}-n{self.n}g{self.g}-s{self.s}-len{'_'.join(map(str, self.lengths))}-d{self.d}"
                f"-w{self.window}-{self.dtype}" + ("-lean" if self.config.lean_steps else "")
                + ("-row-invariant" if self.config.row_invariant else ""))


CASES = [
    # Without lean_steps (the default since 2026-12-02; a sliding window turns it off too):
    # AR step: one token; a row with an empty cache; S=37 is not a multiple of block_k=16; 3 chunks.
    Case(t=1, n=2, g=1, s=37, lengths=(0, 37),
         config=ta.TreeAttentionConfig(block_q=16, block_k=16, num_chunks=3, lean_steps=False)),
    # Small tree, GQA 4, two padding nodes, head dim not a power of two (padded to 32).
    Case(t=5, n=2, g=4, s=50, lengths=(13, 50), d=24, valid=3, config=ta.TreeAttentionConfig(lean_steps=False)),
    # GQA 8 with the sliding window; rows of lengths 0 and 29 over 45 slots; chunks chosen automatically.
    Case(t=17, n=1, g=8, s=45, lengths=(0, 29), window=6, config=ta.TreeAttentionConfig(block_q=32, block_k=16)),
    # 65 nodes x 4 heads = 260 rows: several row blocks; window wider than the cache.
    Case(t=65, n=1, g=4, s=20, lengths=(20, 3), d=16, window=40, valid=50,
         config=ta.TreeAttentionConfig(block_q=64, block_k=16, num_chunks=2)),
    # bf16, MHA, 4 KV heads (block sizes clamp to the problem).
    Case(t=17, n=4, g=1, s=100, lengths=(100, 61), dtype="bfloat16", config=ta.TreeAttentionConfig(lean_steps=False)),
    # lean_steps (whole blocks unmasked, base-2 softmax): a row with an empty cache, a chunk that is one partial
    # block, chunks of whole blocks plus a partial one (length 50 = 3 x 16 + 2), an empty chunk (length 7).
    Case(t=1, n=2, g=1, s=37, lengths=(0, 37),
         config=ta.TreeAttentionConfig(block_q=16, block_k=16, num_chunks=3, lean_steps=True)),
    Case(t=65, n=1, g=4, s=50, lengths=(50, 7), d=16, valid=50,
         config=ta.TreeAttentionConfig(block_q=64, block_k=16, num_chunks=2, lean_steps=True)),
    Case(t=17, n=4, g=1, s=100, lengths=(100, 61), dtype="bfloat16", config=ta.TreeAttentionConfig()),  # the default
    # lean_steps with a cache shorter than one key block (block_k 32 over 20 slots: no whole block).
    Case(t=5, n=2, g=4, s=20, lengths=(13, 20), d=24,
         config=ta.TreeAttentionConfig(block_q=16, block_k=32, lean_steps=True)),
    # The row-invariant kernel: the AR step (an empty cache; a full one), a tree with padding nodes and a head dim
    # padded to 32 whose deepest nodes run past the cache's last chunk, 65 nodes over 3 chunks in bf16.
    Case(t=1, n=2, g=1, s=37, lengths=(0, 37), config=ta.TreeAttentionConfig(block_k=16, row_invariant=True)),
    Case(t=5, n=2, g=4, s=50, lengths=(13, 48), d=24, valid=3,
         config=ta.TreeAttentionConfig(block_k=16, row_invariant=True)),
    Case(t=65, n=1, g=4, s=40, lengths=(33, 0), d=16, dtype="bfloat16",
         config=ta.TreeAttentionConfig(block_k=16, chunk=16, row_invariant=True, num_stages=1)),
]


def random_tree(rng: np.random.Generator, t: int, valid: int | None):
    """(ancestor mask [t, t] bool, depths [t]) of a random tree whose first `valid` nodes are real."""
    valid = t if valid is None else valid
    parents = np.zeros(t, np.int64)
    depths = np.zeros(t, np.int64)
    mask = np.eye(t, dtype=bool)
    for i in range(1, valid):
        parents[i] = rng.integers(0, i)
        depths[i] = depths[parents[i]] + 1
        mask[i] = mask[parents[i]]
        mask[i, i] = True
    return mask, depths


def make_inputs(case: Case, seed: int):
    rng = np.random.default_rng(seed)
    b, hq = len(case.lengths), case.n * case.g
    dtype = jnp.dtype(case.dtype)

    def normal(*shape):
        return jnp.asarray(rng.normal(size=shape), jnp.float32).astype(dtype)

    masks, positions = [], []
    for length in case.lengths:
        mask, depths = random_tree(rng, case.t, case.valid)
        masks.append(mask)
        positions.append(length + depths)  # a tree node sits at start + depth, as in the verify step
    return dict(q=normal(b, case.t, hq, case.d), k_cache=normal(b, case.s, case.n, case.d),
                v_cache=normal(b, case.s, case.n, case.d), cache_lengths=jnp.asarray(case.lengths, jnp.int32),
                k_new=normal(b, case.t, case.n, case.d), v_new=normal(b, case.t, case.n, case.d),
                new_mask=jnp.asarray(np.stack(masks)), positions=jnp.asarray(np.stack(positions), jnp.int32))


@functools.partial(jax.jit, static_argnames=("scale", "sliding_window", "config", "interpret"))
def kernel_with_partials(q, k_cache, v_cache, cache_lengths, k_new, v_new, new_mask, positions, *, scale,
                         sliding_window, config, interpret):
    """What tree_attention_pallas computes, plus the raw per-chunk outputs (to check every element is written)."""
    o, lse, lay = ta._tree_attention_partials(q, k_cache, v_cache, cache_lengths, k_new, v_new, new_mask, positions,
                                              scale=scale, sliding_window=sliding_window, config=config,
                                              interpret=interpret)
    return ta._merge_partials(o, lse, lay, q.shape, q.dtype, interpret=interpret), o, lse


def tolerance(dtype: str) -> dict:
    return dict(atol=2e-5, rtol=2e-5) if dtype == "float32" else dict(atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("interpret", INTERPRET)
class TestTreeAttentionKernel:
    @pytest.mark.parametrize("case", CASES, ids=str)
    def test_matches_reference(self, case: Case, interpret: bool):
        x = make_inputs(case, seed=zlib.crc32(str(case).encode()))
        scale = case.d ** -0.5
        out, o, lse = kernel_with_partials(**x, scale=scale, sliding_window=case.window, config=case.config,
                                           interpret=interpret)
        ref = ta.tree_attention_reference(**x, scale=scale, sliding_window=case.window)
        assert out.shape == x["q"].shape and out.dtype == x["q"].dtype
        # The interpreter fills output buffers with NaN: none left means every partial was written.
        assert not np.isnan(np.asarray(o)).any() and not np.isnan(np.asarray(lse)).any()
        lay = ta._layout(len(case.lengths), case.t, case.n * case.g, case.n, case.s, case.d, case.config)
        splits = lay["num_chunks"] + (0 if case.config.row_invariant else 1)  # the new tokens' own chunk
        assert o.shape == (splits, len(case.lengths), case.n, lay["padded_rows"], lay["head_dim"])
        np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32), **tolerance(case.dtype))

    def test_public_entry_and_stale_slots(self, interpret: bool):
        """Slots at or past a row's length hold NaN (stale or never written): the kernel must not read them."""
        case = Case(t=5, n=2, g=4, s=40, lengths=(0, 17), window=None,
                    config=ta.TreeAttentionConfig(block_q=16, block_k=16, num_chunks=2))
        x = make_inputs(case, seed=3)
        slot = np.arange(case.s)[None, :, None, None]
        stale = slot >= np.asarray(case.lengths)[:, None, None, None]
        dirty = dict(x, k_cache=jnp.where(stale, jnp.nan, x["k_cache"]),
                     v_cache=jnp.where(stale, jnp.nan, x["v_cache"]))
        clean = dict(x, k_cache=jnp.where(stale, 0.0, x["k_cache"]), v_cache=jnp.where(stale, 0.0, x["v_cache"]))
        out = ta.tree_attention_pallas(**dirty, scale=0.3, config=case.config, interpret=interpret)
        ref = ta.tree_attention_reference(**clean, scale=0.3)
        assert not np.isnan(np.asarray(out)).any()
        np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=2e-5, rtol=2e-5)

    def test_row_that_sees_nothing_is_zero(self, interpret: bool):
        """A token with an empty cache and an all-False mask row gets zeros (the reference's rule), not NaN."""
        case = Case(t=5, n=1, g=4, s=20, lengths=(0, 20))
        x = make_inputs(case, seed=4)
        x["new_mask"] = x["new_mask"].at[0, 2, :].set(False)
        out = ta.tree_attention_pallas(**x, scale=0.5, config=case.config, interpret=interpret)
        ref = ta.tree_attention_reference(**x, scale=0.5)
        assert np.all(np.asarray(out[0, 2]) == 0.0) and np.abs(np.asarray(out[0, 1])).sum() > 0
        np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=2e-5, rtol=2e-5)

    def test_no_cache_slots(self, interpret: bool):
        """A cache of capacity 0 (prefill from nothing): only the new tokens are attended."""
        case = Case(t=5, n=2, g=2, s=0, lengths=(0,))
        x = make_inputs(case, seed=5)
        out = ta.tree_attention_pallas(**x, scale=0.5, config=case.config, interpret=interpret)
        ref = ta.tree_attention_reference(**x, scale=0.5)
        np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=2e-5, rtol=2e-5)


def ar_step_inputs(x: dict, row: int, node: int, extra_slots: int = 0) -> dict:
    """The AR step that decoded `node` of batch row `row`'s tree: its ancestors written into the cache at their
    positions, the cache's length at the node's position, the node alone as the new token (the other batch row:
    its own first node, over its own cache); the cache `extra_slots` (NaN) longer, as an AR cache's capacity
    differs from a verify's (`engine.cache_shape`)."""
    mask, pos = np.asarray(x["new_mask"]), np.asarray(x["positions"])
    pad = [(0, 0), (0, extra_slots), (0, 0), (0, 0)]
    k_cache = np.pad(np.asarray(x["k_cache"], np.float32), pad, constant_values=np.nan).astype(x["k_cache"].dtype)
    v_cache = np.pad(np.asarray(x["v_cache"], np.float32), pad, constant_values=np.nan).astype(x["v_cache"].dtype)
    lengths = np.array(x["cache_lengths"])
    picks = []
    for r in range(mask.shape[0]):
        i = node if r == row else 0
        if r == row:
            for a in np.nonzero(mask[r, i])[0]:
                if a != i:
                    k_cache[r, pos[r, a]], v_cache[r, pos[r, a]] = x["k_new"][r, a], x["v_new"][r, a]
            lengths[r] = pos[r, i]
        picks.append(i)
    take = np.asarray(picks)[:, None]

    def pick(a):
        return jnp.take_along_axis(a, jnp.asarray(take).reshape(-1, 1, *([1] * (a.ndim - 2))), axis=1)

    return dict(q=pick(x["q"]), k_cache=jnp.asarray(k_cache), v_cache=jnp.asarray(v_cache),
                cache_lengths=jnp.asarray(lengths, jnp.int32), k_new=pick(x["k_new"]), v_new=pick(x["v_new"]),
                new_mask=jnp.ones((mask.shape[0], 1, 1), bool), positions=pick(x["positions"]))


@pytest.mark.parametrize("interpret", INTERPRET)
def test_row_invariant_rows_equal_the_ar_step_bitwise(interpret: bool):
    """Issue 20: every node of a tree verified in one call gets the bits of the AR step that decodes it over the
    same prefix (its ancestors then in the cache, whose capacity differs), in bf16; slots past a length hold NaN,
    which no row reads. Row 0's paths cross a key block (length 45, blocks of 16), so the AR step scores whole
    cache blocks where the verify gathers per token. Negative control: the fast kernel (the new tokens in a chunk
    of their own, chunks from the capacity) gives other bits for some rows."""
    case = Case(t=17, n=2, g=4, s=70, lengths=(45, 22), dtype="bfloat16")  # partial key blocks; 3 chunks
    x = make_inputs(case, seed=7)
    assert np.asarray(x["positions"])[0].max() >= 48  # the premise: some path crosses the block at 48
    slot = np.arange(case.s)[None, :, None, None]
    stale = slot >= np.asarray(case.lengths)[:, None, None, None]
    x = dict(x, k_cache=jnp.where(stale, jnp.nan, x["k_cache"]), v_cache=jnp.where(stale, jnp.nan, x["v_cache"]))
    configs = {"row-invariant": ta.TreeAttentionConfig(block_k=16, chunk=32, row_invariant=True, num_stages=1),
               "fast": ta.TreeAttentionConfig(block_q=16, block_k=16, num_chunks=2)}
    differing = {}
    for name, config in configs.items():
        tree = np.asarray(ta.tree_attention_pallas(**x, scale=0.3, config=config, interpret=interpret), np.float32)
        assert not np.isnan(tree).any()
        differing[name] = 0
        for row in range(len(case.lengths)):
            for node in range(case.t):
                ar = ta.tree_attention_pallas(**ar_step_inputs(x, row, node, extra_slots=37), scale=0.3, config=config,
                                              interpret=interpret)
                differing[name] += not np.array_equal(np.asarray(ar[row, 0], np.float32), tree[row, node])
    assert differing["row-invariant"] == 0
    assert differing["fast"] > 0


def test_row_invariant_takes_no_window():
    x = make_inputs(Case(t=5, n=1, g=4, s=20, lengths=(7,)), seed=1)
    with pytest.raises(ValueError, match="no sliding window"):
        ta.tree_attention_pallas(**x, scale=0.5, sliding_window=4, config=ta.ROW_INVARIANT_CONFIG, interpret=True)


def numpy_attention(x: dict, scale: float, window: int | None) -> np.ndarray:
    """Float64, one (row, query token, query head) at a time: the keys it may see are the committed slots
    j < length (at position j) and the new tokens its mask allows (at their positions), joined into one list,
    each dropped by the sliding window (query_pos - key_pos >= window for cached keys, |distance| >= window
    among new tokens); one softmax over that list; zeros if it is empty."""
    a = {k: np.asarray(jnp.asarray(v, jnp.float32), np.float64) if k not in ("new_mask", "cache_lengths", "positions")
         else np.asarray(v) for k, v in x.items()}
    b, t, hq, d = a["q"].shape
    n = a["k_cache"].shape[2]
    out = np.zeros((b, t, hq, d))
    for r in range(b):
        for i in range(t):
            pos = a["positions"][r, i]
            cached = [j for j in range(a["cache_lengths"][r]) if window is None or pos - j < window]
            new = [j for j in range(t) if a["new_mask"][r, i, j]
                   and (window is None or abs(pos - a["positions"][r, j]) < window)]
            for h in range(hq):
                kv = h // (hq // n)
                keys = np.concatenate([a["k_cache"][r, cached, kv], a["k_new"][r, new, kv]]).reshape(-1, d)
                values = np.concatenate([a["v_cache"][r, cached, kv], a["v_new"][r, new, kv]]).reshape(-1, d)
                if not len(keys):
                    continue
                scores = keys @ a["q"][r, i, h] * scale
                p = np.exp(scores - scores.max())
                out[r, i, h] = p @ values / p.sum()
    return out


class TestReference:
    @pytest.mark.parametrize("case", CASES, ids=str)
    def test_reference_matches_numpy(self, case: Case):
        x = make_inputs(case, seed=11)
        ref = ta.tree_attention_reference(**x, scale=0.2, sliding_window=case.window)
        np.testing.assert_allclose(np.asarray(ref, np.float64), numpy_attention(x, 0.2, case.window),
                                   **tolerance(case.dtype))

    def test_mask_matters(self):
        """Negative check of the test inputs: a different ancestor mask changes the output."""
        case = Case(t=17, n=1, g=4, s=20, lengths=(5,))
        x = make_inputs(case, seed=12)
        causal = dict(x, new_mask=jnp.asarray(np.tril(np.ones((1, 17, 17), bool))))
        a = ta.tree_attention_reference(**x, scale=0.5)
        c = ta.tree_attention_reference(**causal, scale=0.5)
        assert not np.allclose(np.asarray(a), np.asarray(c), atol=1e-3)


class TestDispatchAndConfig:
    def test_dispatcher(self, monkeypatch):
        case = Case(t=5, n=1, g=4, s=20, lengths=(7,))
        x = make_inputs(case, seed=21)
        ref = ta.tree_attention_reference(**x, scale=0.5)
        monkeypatch.delenv(ENV_VAR, raising=False)
        np.testing.assert_array_equal(np.asarray(ta.tree_attention(**x, scale=0.5, implementation="reference")),
                                      np.asarray(ref))
        monkeypatch.setenv(ENV_VAR, "pallas")  # on CPU the dispatcher interprets the kernel
        forced = ta.tree_attention(**x, scale=0.5, config=case.config)
        np.testing.assert_allclose(np.asarray(forced), np.asarray(ref), atol=2e-5, rtol=2e-5)
        monkeypatch.setenv(ENV_VAR, "triton")
        with pytest.raises(ValueError, match=ENV_VAR):
            ta.tree_attention(**x, scale=0.5)
        with pytest.raises(ValueError, match="implementation='cuda'"):
            ta.tree_attention(**x, scale=0.5, implementation="cuda")

    @pytest.mark.parametrize("field,value", [("block_q", 8), ("block_q", 48), ("block_k", 0), ("block_k", True),
                                             ("block_u", 24), ("num_chunks", 0), ("num_warps", 3), ("num_stages", 0),
                                             ("lean_steps", 1), ("row_invariant", "yes")])
    def test_bad_config_names_the_value(self, field, value):
        with pytest.raises(ValueError, match=rf"TreeAttentionConfig\.{field}={value!r}"):
            ta.TreeAttentionConfig(**{field: value})

    def test_bad_shapes(self):
        x = make_inputs(Case(t=5, n=2, g=4, s=20, lengths=(3,)), seed=0)
        with pytest.raises(ValueError, match="new_mask"):
            ta.tree_attention_pallas(**dict(x, new_mask=x["new_mask"][:, :4]), scale=0.5, interpret=True)
        with pytest.raises(ValueError, match="multiple of KV heads"):
            ta.tree_attention_pallas(**dict(x, q=x["q"][:, :, :7]), scale=0.5, interpret=True)
        with pytest.raises(ValueError, match="share one dtype"):
            ta.tree_attention_pallas(**dict(x, q=x["q"].astype(jnp.bfloat16)), scale=0.5, interpret=True)


def test_default_chunks_fill_one_wave_and_cap_long_chunks(monkeypatch):
    """num_chunks None: enough chunks for about one program per multiprocessor (132 here), and chunks of at most
    MAX_CHUNK_KEYS keys: at the Qwen3-8B shape (32 query heads over 8 KV heads, T = 65: 260 rows, 5 blocks of 64)
    ceil(132 / 40) = 4 chunks at S = 2048 (512 keys each), 32768 / 2048 = 16 at S = 32768; T = 1 (one row block)
    asks ceil(132 / 8) = 17 at S = 2048, which chunks of whole 64-key blocks (128 keys) make 16, and 24 at
    S = 49152 (49152 / 2048 above the 17)."""
    monkeypatch.setattr(ta, "core_count", lambda: 132)
    config = ta.TreeAttentionConfig()

    def chunks(t, s):
        lay = ta._layout(1, t, 32, 8, s, 128, config)
        return lay["num_chunks"], lay["chunk"]

    assert ta.MAX_CHUNK_KEYS == 2048
    assert chunks(65, 2048) == (4, 512)
    assert chunks(65, 32768) == (16, 2048)
    assert chunks(1, 2048) == (16, 128)  # 17 asked: chunks of ceil(2048 / 17) rounded up to 128 keys, so 16
    assert chunks(1, 49152) == (24, 2048)
