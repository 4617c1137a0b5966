"""Tree-masked attention of new tokens over the committed KV cache plus themselves (Pallas, Triton).

The contract is `ddtree_jax.models.layers.cached_attention`: queries of the T new tokens (tree nodes,
a chain, or one AR token) attend to the committed cache slots `[0, length)` of their row and to the
new tokens that `new_mask` allows (the ancestor mask of a tree). `tree_attention_reference` below
restates that math in plain jnp (independently: kernels never import the models).

Letters: b batch, t new tokens as queries, u new tokens as keys (u = t), s cache slots, n KV heads,
g query heads per KV head, d head dim, r = t * g rows of one KV head, c chunks.

How the kernel splits the work (flash-decoding: Dao et al., "Flash-Decoding for long-context
inference", 2023; the online softmax of FlashAttention-2, arXiv 2307.08691, Algorithm 1):
- one program takes one (row, KV head, block of rows, chunk). Its rows are (token, query head) pairs
  of one KV head, token-major (row = token * g + head in group), so every K/V block it loads serves
  all g query heads of the group (GQA) and all T tokens in the block;
- chunks 0..C-1 are slices of the committed cache (keys at slots < length); chunk C is the T new keys
  under `new_mask`. Each program writes its normalised partial output and its log-sum-exp;
  `_merge_partials` combines the C + 1 partials in a second, small kernel that writes the output in q's
  layout (in plain jnp that merge was three XLA kernels per layer). The cache split lets batch 1 fill the GPU.
  (The merge inside this kernel instead, by the program of a row block that arrives last on an atomic count, was
  slower on an H100, 2026-12-06: one program then merges what the merge kernel spreads over many; docs/kernels.md.)

Triton wants power-of-two tiles of at least 16 for dots: the wrapper pads the head dim to a power of two
(>= 16); query rows past t * g, key blocks past the cache length or past T are masked loads, so rows, S
and T need no padding (a padded copy of q cost one more kernel per layer, ~2 us on the H200).

The row-invariant kernel (`TreeAttentionConfig.row_invariant`, `ROW_INVARIANT_CONFIG`; issue 20) gives up the
separate new-token chunk for bitwise agreement with the AR step: see `_row_invariant_kernel`.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels._dispatch import (cdiv, check_knobs, core_count, next_pow2, resolve_implementation,
                                      resolve_interpret, round_up)
from pallas_kernels.launch import kernel_body

_NEG_INF = float("-inf")
_LOG2_E = 1.4426950408889634  # log2(e): exp(x) = exp2(x * log2 e)
_LN_2 = 0.6931471805599453  # ln(2)


@dataclasses.dataclass(frozen=True)
class TreeAttentionConfig:
    """Tuning knobs of the Pallas kernel (static; hashable, so usable as a jit static argument).

    block_q:    rows (token x query head of one KV head) per program; a power of two >= 16. Clamped
                to the padded row count.
    block_k:    cache keys per inner step; a power of two >= 16. Clamped to the padded cache size.
    block_u:    new-token keys per inner step; a power of two >= 16. Clamped to the padded T. Kept
                apart from block_k because Triton gives each of the two loops its own pipelined
                shared-memory buffers (stages x 2 x block x d each), which bounds programs per SM.
    num_chunks: cache chunks per (row, KV head, row block); None picks enough to give about one
                program per streaming multiprocessor and at most MAX_CHUNK_KEYS keys per chunk (never
                more chunks than key blocks).
    num_warps, num_stages: Triton's warps per program and software-pipelining depth. Three stages:
                the fastest of the swept configs on the H200 at S = 4096 and T = 16, 65 and 257
                (2026-12-01, `python tools/kernel_check.py --sweep`: 10-24% less than two).
    lean_steps: fewer instructions per score, for a kernel that Nsight Compute found latency-bound with
                few warps per scheduler (docs/performance.md, 2026-12-02): a chunk's whole cache blocks
                load and score without masks (its last, partial block keeps them), and the softmax runs
                in base 2 with log2(e) folded into the score scale (as FlashAttention does; `jnp.exp` is
                a multiply and a base-2 exponential on the GPU). No sliding window. On by default: in two
                bench A/Bs on the H200 (Qwen3-8B shape, 2026-12-02) the DDTree B = 64 round took 6.94 and
                6.96 ms with it against 7.14 and 7.08 without, the others within the spread.

    row_invariant: the row-invariant kernel (`_row_invariant_kernel`, issue 20): a row's arithmetic does not
                depend on the call's other rows, its token count, where the row sits or the cache's capacity, so a
                verified node gets the AR step's bits for the same prefix. Keys in absolute-position order, in
                blocks of block_k (not clamped) at fixed offsets and chunks of `chunk` positions, 16 rows per
                program (block_q and block_u unused), the new tokens' keys gathered per token at their positions
                (new tokens must have distinct positions along what each token sees, as tree paths and chains do).
                No sliding window.
    chunk:      the row-invariant kernel's cache chunk in positions, a multiple of block_k (None: ROW_INVARIANT_CHUNK);
                fixed, not derived from the capacity, which differs between AR and a verify (`engine.cache_shape`).
                The fast kernel takes `num_chunks` instead.
    """

    block_q: int = 64
    block_k: int = 64
    block_u: int = 32
    num_chunks: int | None = None
    num_warps: int = 4
    num_stages: int = 3
    lean_steps: bool = True
    row_invariant: bool = False
    chunk: int | None = None

    def __post_init__(self):
        check_knobs(self, pow2={"block_q": 16, "block_k": 16, "block_u": 16}, optional_counts=("num_chunks", "chunk"))
        for knob in ("lean_steps", "row_invariant"):
            if not isinstance(getattr(self, knob), bool):
                raise ValueError(f"TreeAttentionConfig.{knob}={getattr(self, knob)!r}: must be True or False")
        if self.row_invariant and self.num_chunks is not None:
            raise ValueError("TreeAttentionConfig.num_chunks: the row-invariant kernel's chunks are `chunk` positions")
        if self.chunk is not None and not self.row_invariant:
            raise ValueError(f"TreeAttentionConfig.chunk={self.chunk}: a knob of the row-invariant kernel only")
        if self.row_invariant and (self.chunk or ROW_INVARIANT_CHUNK) % self.block_k:
            raise ValueError(f"TreeAttentionConfig.chunk={self.chunk or ROW_INVARIANT_CHUNK} (positions) must be a "
                             f"multiple of block_k={self.block_k}")


# The most cache keys one program of the fast kernel walks when `num_chunks` is left to the layout: a long
# cache's few long chunks left the H200 idle. At the Qwen3-8B attention shape (36 layers, tools/kernel_check.py,
# 2026-12-04), us per layer with one wave of programs against chunks of 2048 keys: S = 32768, T = 17 87.9 against
# 57.2 and T = 65 227.8 against 179.4; at S = 8192, T = 65 (one wave: 3 chunks) 16 chunks of 512 keys took 62.2
# against 65.1; at S = 2048 one wave's chunks are this short already (16 chunks there were slower: 13.7 against
# 12.2 us at T = 17, 28.5 against 22.5 at T = 65).
MAX_CHUNK_KEYS = 2048

# The row-invariant kernel's cache chunk in positions: at 2048 positions and 8 KV heads, 64 programs for the AR
# step (the fast kernel takes ~one wave); the merge's unrolled loop stays at 128 partials up to 32768 positions.
ROW_INVARIANT_CHUNK = 256

# The row-invariant kernel's configuration: one stage (two double its shared memory, to 186 KB per program at
# T >= 16 with one program per SM: offline sm_90 compile, tools/triton_offline.py).
ROW_INVARIANT_CONFIG = TreeAttentionConfig(row_invariant=True, num_stages=1)


# ----------------------------------------------------------------------------------------------------
# Kernel body


def _scores(q, k, *, scale, precision):
    """q [bq, d] . k [bk, d]^T * scale -> [bq, bk] float32."""
    return lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=precision,
                           preferred_element_type=jnp.float32) * scale


def _values(p, v, *, precision):
    """p [bq, bk] f32 . v [bk, d] -> [bq, d] float32; the probabilities in v's dtype, as the reference does before
    its value einsum."""
    return lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())), precision=precision,
                           preferred_element_type=jnp.float32)


def _softmax_update(scores, m, l, *, base2: bool):
    """The online softmax's update by one block of (masked) scores [bq, bk]: -> (p [bq, bk] the block's
    unnormalised probabilities, alpha [bq] the factor of the earlier output, m_new, l_new)."""
    exp = jnp.exp2 if base2 else jnp.exp
    m_new = jnp.maximum(m, jnp.max(scores, axis=1))
    # A row that has seen nothing yet keeps m = -inf; shift by 0 there so exp gives 0, not NaN.
    shift = jnp.where(m_new == _NEG_INF, 0.0, m_new)
    p = exp(scores - shift[:, None])
    alpha = exp(m - shift)
    return p, alpha, m_new, alpha * l + jnp.sum(p, axis=1)


def _online_softmax_step(q, k, v, visible, carry, *, scale, precision, base2: bool = False):
    """One key block of the online softmax. q [bq, d], k/v [bk, d], visible [bq, bk] bool (None: every
    score counts); carry = (acc [bq, d] f32 unnormalised output, m [bq] running max (-inf: nothing seen),
    l [bq] sum). base2: `scale` includes log2(e), and m and the exponentials are in base 2."""
    acc, m, l = carry
    scores = _scores(q, k, scale=scale, precision=precision)
    if visible is not None:
        scores = jnp.where(visible, scores, _NEG_INF)
    p, alpha, m_new, l_new = _softmax_update(scores, m, l, base2=base2)
    return alpha[:, None] * acc + _values(p, v, precision=precision), m_new, l_new


def _tree_attention_kernel(
    # inputs
    q_ref,     # [t, n*g, d] every query of this batch row; a KV head's rows are token * g + head in group
    k_ref,     # [s, d] committed keys of this row and KV head
    v_ref,     # [s, d] committed values
    kn_ref,    # [t, d] the new tokens' keys
    vn_ref,    # [t, d] the new tokens' values
    mask_ref,  # [t, t] int8, 1 where query token i sees new token j
    pos_ref,   # [t] int32 positions of the new tokens
    len_ref,   # [] int32 committed slots of this row
    # outputs
    o_ref,     # [block_q, d] float32 this chunk's output, normalised within the chunk
    lse_ref,   # [block_q] float32 this chunk's log-sum-exp of scores (-inf: the chunk showed nothing)
    *,
    scale: float,
    window: int | None,
    num_chunks: int,
    chunk: int,
    block_q: int,
    block_k: int,
    block_u: int,
    group: int,
    num_new: int,
    num_slots: int,
    precision,
    lean: bool,
):
    kv_head, row_block, chunk_id = pl.program_id(1), pl.program_id(2), pl.program_id(3)
    d = q_ref.shape[-1]
    rows = row_block * block_q + jnp.arange(block_q, dtype=jnp.int32)
    row_ok = rows < num_new * group
    row_token = jnp.minimum(lax.div(rows, jnp.int32(group)), num_new - 1)  # clamped: padding rows stay in bounds
    # This block's rows gathered from q's own layout (a transposed copy of q was one more XLA kernel per layer);
    # masked: the last block may run past the rows.
    row_head = kv_head * group + lax.rem(rows, jnp.int32(group))
    q = plt.load(q_ref.at[row_token[:, None], row_head[:, None], jnp.arange(d)[None, :]], mask=row_ok[:, None],
                 other=0)
    row_pos = pos_ref[row_token] if window is not None else None
    # lean: scores in base 2 (log2 e folded into the scale); whole cache blocks without masks.
    step = functools.partial(_online_softmax_step, scale=scale * _LOG2_E if lean else scale, precision=precision,
                             base2=lean)
    init = (jnp.zeros((block_q, d), jnp.float32), jnp.full((block_q,), _NEG_INF, jnp.float32),
            jnp.zeros((block_q,), jnp.float32))

    def cache_chunk():
        length = jnp.minimum(len_ref[...], num_slots)
        start = chunk_id * chunk
        end = jnp.minimum(start + chunk, length)  # chunk is a multiple of block_k: blocks end at `end` or S
        first = jnp.int32(0)
        if window is not None:
            # Slots below the earliest row's window are hidden from every row: skip their blocks.
            lowest = jnp.min(jnp.where(row_ok, row_pos, jnp.iinfo(jnp.int32).max)) - (window - 1)
            first = lax.div(jnp.maximum(lowest - start, 0), jnp.int32(block_k))
        num_blocks = lax.div(jnp.maximum(end - start, 0) + (block_k - 1), jnp.int32(block_k))

        def body(i, carry):
            k0 = start + i * block_k
            cols = k0 + jnp.arange(block_k, dtype=jnp.int32)
            col_ok = cols < end
            k = plt.load(k_ref.at[pl.ds(k0, block_k), :], mask=col_ok[:, None], other=0)
            v = plt.load(v_ref.at[pl.ds(k0, block_k), :], mask=col_ok[:, None], other=0)
            visible = col_ok[None, :] & row_ok[:, None]
            if window is not None:
                visible = visible & (row_pos[:, None] - cols[None, :] < window)
            return step(q, k, v, visible, carry)

        if not lean or block_k > num_slots:  # (a cache shorter than one block has no whole block to load)
            return lax.fori_loop(first, jnp.maximum(num_blocks, first), body, init)

        def whole_block(i, carry):  # keys [k0, k0 + block_k) all inside [start, end): no masks
            k0 = start + i * block_k
            return step(q, k_ref[pl.ds(k0, block_k), :], v_ref[pl.ds(k0, block_k), :], None, carry)

        whole = lax.div(jnp.maximum(end - start, 0), jnp.int32(block_k))
        carry = lax.fori_loop(0, whole, whole_block, init)
        return lax.fori_loop(whole, num_blocks, body, carry)  # the partial last block, if any, masked

    def new_tokens():
        def body(i, carry):
            u0 = i * block_u
            cols = u0 + jnp.arange(block_u, dtype=jnp.int32)
            col_ok = cols < num_new
            col_token = jnp.minimum(cols, num_new - 1)
            k = plt.load(kn_ref.at[pl.ds(u0, block_u), :], mask=col_ok[:, None], other=0)
            v = plt.load(vn_ref.at[pl.ds(u0, block_u), :], mask=col_ok[:, None], other=0)
            # Gather the mask rows of each row's token (rows of one token share them).
            seen = mask_ref[row_token[:, None], col_token[None, :]]
            visible = (seen != 0) & col_ok[None, :] & row_ok[:, None]
            if window is not None:
                col_pos = pos_ref[col_token]
                visible = visible & (jnp.abs(row_pos[:, None] - col_pos[None, :]) < window)
            return step(q, k, v, visible, carry)

        return lax.fori_loop(0, cdiv(num_new, block_u), body, init)

    acc, m, l = lax.cond(chunk_id < num_chunks, cache_chunk, new_tokens)
    empty = l == 0.0
    l_safe = jnp.where(empty, 1.0, l)
    o_ref[...] = acc / l_safe[:, None]
    lse = (m + jnp.log2(l_safe)) * _LN_2 if lean else m + jnp.log(l_safe)  # natural units for the merge
    lse_ref[...] = jnp.where(empty, _NEG_INF, lse)


ROW_INVARIANT_ROWS = 16  # rows per program of the row-invariant kernel: one mma tile shape for every call


def _row_invariant_kernel(
    q_ref, k_ref, v_ref, kn_ref, vn_ref,  # as _tree_attention_kernel's
    anc_ref,   # [t, t] int32: entry (i, j) the new token that token i sees at position length + j (-1: none)
    pos_ref, len_ref,  # as _tree_attention_kernel's
    o_ref,     # [16, d] float32 this chunk's output, normalised within the chunk
    lse_ref,   # [16] float32 this chunk's log-sum-exp of scores (-inf: the chunk showed nothing)
    *,
    scale: float,
    num_chunks: int,
    chunk: int,
    block_k: int,
    group: int,
    num_new: int,
    num_slots: int,
    precision,
):
    """Every row's keys in absolute-position order, in blocks of `block_k` positions at fixed offsets and chunks
    of `chunk` positions: a key at position j < length is the cache's slot j, one at j >= length the new token the
    row sees at position j (its ancestor at depth j - length in a tree; `anc_ref`). A row therefore runs the same
    operations as the AR step of the same token over the same prefix (where those positions are already in the
    cache): the blocks below the committed length with one score matmul for all 16 rows (a row's scores do not
    depend on the tile's other rows), the blocks from it with each token's own keys gathered and multiplied
    separately, its rows picked. Both kinds of block end in the same operations (the value product picked by a
    `where`, then added: Triton would fold a bare `acc + dot` into the mma's accumulator, another rounding).
    Blocks past a row's own keys are all masked, which leaves (acc, m, l) unchanged bit for bit; so does a chunk
    past them (lse = -inf)."""
    kv_head, row_block, chunk_id = pl.program_id(1), pl.program_id(2), pl.program_id(3)
    rows_per = ROW_INVARIANT_ROWS
    d = q_ref.shape[-1]
    rows = row_block * rows_per + jnp.arange(rows_per, dtype=jnp.int32)
    row_ok = rows < num_new * group
    row_token = jnp.minimum(lax.div(rows, jnp.int32(group)), num_new - 1)
    row_head = kv_head * group + lax.rem(rows, jnp.int32(group))
    dcols = jnp.arange(d)[None, :]
    q = plt.load(q_ref.at[row_token[:, None], row_head[:, None], dcols], mask=row_ok[:, None], other=0)
    length = jnp.minimum(len_ref[...], num_slots)
    tp = next_pow2(num_new)
    new_idx = jnp.arange(tp, dtype=jnp.int32)
    new_pos = plt.load(pos_ref.at[jnp.minimum(new_idx, num_new - 1)], mask=new_idx < num_new, other=-1)
    last_pos = jnp.max(new_pos)  # the largest position any new token has
    scale2 = scale * _LOG2_E  # base-2 softmax, as the lean steps of the fast kernel
    acc0 = (jnp.zeros((rows_per, d), jnp.float32), jnp.full((rows_per,), _NEG_INF, jnp.float32),
            jnp.zeros((rows_per,), jnp.float32))

    first = chunk_id * (chunk // block_k)  # this chunk's blocks, in block units
    end = jnp.where(chunk_id < num_chunks - 1, first + chunk // block_k,  # the last chunk runs to the last key
                    lax.div(jnp.maximum(last_pos, 0), jnp.int32(block_k)) + 1)
    end = jnp.minimum(end, lax.div(jnp.maximum(last_pos, length - 1), jnp.int32(block_k)) + 1)
    whole = lax.div(length, jnp.int32(block_k))  # blocks entirely below the committed length

    def cache_block(i, carry):  # every key in the cache and seen by every row: one matmul for all rows
        acc, m, l = carry
        k0 = i * block_k
        if block_k <= num_slots:
            k, v = k_ref[pl.ds(k0, block_k), :], v_ref[pl.ds(k0, block_k), :]
        else:  # a cache shorter than one block has no whole block (this loop runs no step); loads that trace
            slot = jnp.minimum(k0 + jnp.arange(block_k), num_slots - 1)[:, None]
            k, v = plt.load(k_ref.at[slot, dcols]), plt.load(v_ref.at[slot, dcols])
        scores = _scores(q, k, scale=scale2, precision=precision)
        p, alpha, m, l = _softmax_update(scores, m, l, base2=True)
        pv = jnp.where(row_ok[:, None], _values(p, v, precision=precision), 0.0)  # as per_token_block's pick
        return alpha[:, None] * acc + pv, m, l

    # Tokens a tile of rows spans (rows are token-major, `group` per token).
    span = rows_per // group if rows_per % group == 0 else (rows_per - 1) // group + 2
    first_token = lax.div(row_block * rows_per, jnp.int32(group))

    def per_token_block(i, carry):  # keys from the committed length on: each token's own, in position order
        acc, m, l = carry
        cols = i * block_k + jnp.arange(block_k, dtype=jnp.int32)  # absolute positions
        cached = cols < length
        slot = jnp.minimum(cols, num_slots - 1)[:, None]
        depth = cols - length
        in_tree = (depth >= 0) & (depth < num_new)

        def token_keys(j, cache_ref, new_ref):
            """Token first_token + j's keys (or values) at the block's positions [block_k, d], which rows are its,
            and which positions it sees."""
            token = first_token + j
            source = plt.load(anc_ref.at[jnp.minimum(token, num_new - 1), jnp.clip(depth, 0, num_new - 1)],
                              mask=in_tree & (token < num_new), other=-1)
            found = source >= 0
            x = jnp.where(cached[:, None], plt.load(cache_ref.at[slot, dcols], mask=cached[:, None], other=0),
                          plt.load(new_ref.at[jnp.maximum(source, 0)[:, None], dcols], mask=found[:, None], other=0))
            return x, (row_token == token) & row_ok, cached | found

        scores = jnp.full((rows_per, block_k), _NEG_INF, jnp.float32)
        for j in range(span):
            k_token, mine, sees = token_keys(j, k_ref, kn_ref)
            scores = jnp.where(mine[:, None] & sees[None, :], _scores(q, k_token, scale=scale2, precision=precision),
                               scores)
        p, alpha, m, l = _softmax_update(scores, m, l, base2=True)
        pv = jnp.zeros((rows_per, d), jnp.float32)
        for j in range(span):  # the values in a second pass: one token's [block_k, d] tile live at a time
            v_token, mine, _ = token_keys(j, v_ref, vn_ref)
            pv = jnp.where(mine[:, None], _values(p, v_token, precision=precision), pv)
        return alpha[:, None] * acc + pv, m, l

    carry = lax.fori_loop(first, jnp.minimum(end, whole), cache_block, acc0)
    acc, m, l = lax.fori_loop(jnp.maximum(first, whole), end, per_token_block, carry)
    empty = l == 0.0
    l_safe = jnp.where(empty, 1.0, l)
    o_ref[...] = acc / l_safe[:, None]
    lse_ref[...] = jnp.where(empty, _NEG_INF, (m + jnp.log2(l_safe)) * _LN_2)


def _ancestor_table(new_mask, positions, lengths, num_slots: int) -> jax.Array:
    """[b, t, t] int32 for the row-invariant kernel: entry (i, j) the new token that token i sees (`new_mask`) at
    position length + j, -1 where it sees none (a scatter-max: the largest such index if several)."""
    b, t = positions.shape
    depth = positions - jnp.minimum(lengths, num_slots)[:, None]  # [b, u]
    sees = new_mask & ((depth >= 0) & (depth < t))[:, None, :]  # [b, i, u]
    source = jnp.where(sees, jnp.arange(t, dtype=jnp.int32)[None, None, :], -1)
    rows = jnp.arange(b)[:, None, None], jnp.arange(t)[None, :, None]
    return jnp.full((b, t, t), -1, jnp.int32).at[(*rows, jnp.clip(depth, 0, t - 1)[:, None, :])].max(source)


# ----------------------------------------------------------------------------------------------------
# pallas_call wrapper


def _check_shapes(q, k_cache, v_cache, cache_lengths, k_new, v_new, new_mask, positions):
    if q.ndim != 4:
        raise ValueError(f"q must be [b, t, heads, d], got shape {q.shape}")
    b, t, hq, d = q.shape
    if k_cache.ndim != 4 or k_cache.shape[0] != b or k_cache.shape[3] != d or v_cache.shape != k_cache.shape:
        raise ValueError(f"k_cache/v_cache must both be [b={b}, s, n, d={d}], got {k_cache.shape} and {v_cache.shape}")
    n = k_cache.shape[2]
    if hq % n:
        raise ValueError(f"query heads ({hq}) must be a multiple of KV heads ({n})")
    if k_new.shape != (b, t, n, d) or v_new.shape != (b, t, n, d):
        raise ValueError(f"k_new/v_new must be [b, t, n, d] = {(b, t, n, d)}, got {k_new.shape} and {v_new.shape}")
    if new_mask.shape != (b, t, t):
        raise ValueError(f"new_mask must be [b, t, t] = {(b, t, t)}, got {new_mask.shape}")
    if positions.shape != (b, t):
        raise ValueError(f"positions must be [b, t] = {(b, t)}, got {positions.shape}")
    if cache_lengths.shape != (b,):
        raise ValueError(f"cache_lengths must be [b] = {(b,)}, got {cache_lengths.shape}")
    dtypes = {x.dtype for x in (q, k_cache, v_cache, k_new, v_new)}
    if len(dtypes) != 1:  # a cast here would copy the whole cache on every call
        raise ValueError(f"q, k_cache, v_cache, k_new, v_new must share one dtype, got {sorted(map(str, dtypes))}")


def _layout(b: int, t: int, hq: int, n: int, s: int, d: int, config: TreeAttentionConfig) -> dict:
    """Static tile sizes and grid for one problem shape (all Python ints)."""
    group = hq // n
    rows = t * group
    block_q = ROW_INVARIANT_ROWS if config.row_invariant else min(config.block_q, max(16, next_pow2(rows)))
    # The row-invariant kernel's key blocks sit at fixed positions, whatever the capacity.
    block_k = config.block_k if config.row_invariant else min(config.block_k, max(16, next_pow2(s)))
    block_u = min(config.block_u, max(16, next_pow2(t)))
    row_blocks = cdiv(rows, block_q)
    if config.row_invariant:  # chunks of fixed positions (the capacity differs between AR and a verify)
        chunk = config.chunk or ROW_INVARIANT_CHUNK  # a multiple of block_k (the config checks)
        num_chunks = cdiv(s, chunk)
    else:
        num_chunks = config.num_chunks
        if num_chunks is None:  # about one wave of programs, and chunks of at most MAX_CHUNK_KEYS keys; the
            # new-token chunk adds one per (row, head, row block)
            num_chunks = max(cdiv(core_count(), b * n * row_blocks), cdiv(s, MAX_CHUNK_KEYS))
        num_chunks = max(1, min(num_chunks, cdiv(s, block_k)))
        chunk = round_up(cdiv(s, num_chunks), block_k)
        num_chunks = cdiv(s, chunk)  # no empty trailing chunks
    # Partial outputs per row: the cache's chunks and the new tokens' (the row-invariant kernel's last chunk
    # runs on past the cache to the new tokens' positions instead).
    num_splits = num_chunks if config.row_invariant else num_chunks + 1
    return dict(group=group, rows=rows, padded_rows=row_blocks * block_q, block_q=block_q, block_k=block_k,
                block_u=block_u, row_blocks=row_blocks, num_chunks=num_chunks, chunk=chunk, num_splits=num_splits,
                head_dim=max(16, next_pow2(d)))


def _tree_attention_partials(q, k_cache, v_cache, cache_lengths, k_new, v_new, new_mask, positions, *,
                             scale: float, sliding_window: int | None, config: TreeAttentionConfig,
                             interpret: bool, debug: bool = False):
    """Runs the kernel. Returns (o [c', b, n, padded rows, dp] f32, lse [c', b, n, padded rows] f32, layout dict)
    with c' = layout["num_splits"] partials: the cache's chunks, then the new tokens' (the row-invariant
    kernel's chunks cover both)."""
    _check_shapes(q, k_cache, v_cache, cache_lengths, k_new, v_new, new_mask, positions)
    b, t, hq, d = q.shape
    s, n = k_cache.shape[1], k_cache.shape[2]
    if s == 0:  # no committed slots at all: one empty slot keeps the grid and the loads well formed
        k_cache = jnp.zeros((b, 1, n, d), k_cache.dtype)
        v_cache = jnp.zeros((b, 1, n, d), v_cache.dtype)
        cache_lengths = jnp.zeros((b,), jnp.int32)
        s = 1
    lay = _layout(b, t, hq, n, s, d, config)
    dp, group = lay["head_dim"], lay["group"]

    def pad_d(x):
        return x if dp == d else jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, dp - d)])

    q, k_cache, v_cache, k_new, v_new = map(pad_d, (q, k_cache, v_cache, k_new, v_new))
    positions = positions.astype(jnp.int32)
    lengths = cache_lengths.astype(jnp.int32)
    # The fast kernel reads the mask; the row-invariant one each token's source per position (same block shape).
    seen = (_ancestor_table(new_mask, positions, lengths, s) if config.row_invariant else new_mask.astype(jnp.int8))
    window = None if sliding_window is None else int(sliding_window)
    num_splits = lay["num_splits"]
    precision = lax.Precision.HIGHEST if q.dtype == jnp.float32 else lax.Precision.DEFAULT

    if config.row_invariant:
        if window is not None:
            raise ValueError("TreeAttentionConfig.row_invariant takes no sliding window")
        kernel = functools.partial(
            _row_invariant_kernel, scale=float(scale), num_chunks=lay["num_chunks"], chunk=lay["chunk"],
            block_k=lay["block_k"], group=group, num_new=t, num_slots=s, precision=precision)
    else:
        kernel = functools.partial(
            _tree_attention_kernel, scale=float(scale), window=window, num_chunks=lay["num_chunks"],
            chunk=lay["chunk"], block_q=lay["block_q"], block_k=lay["block_k"], block_u=lay["block_u"],
            group=group, num_new=t, num_slots=s, precision=precision,
            lean=config.lean_steps and window is None)  # a window masks inside whole blocks too
    block_q = lay["block_q"]
    o, lse = pl.pallas_call(
        kernel_body(kernel, interpret),
        grid=(b, n, lay["row_blocks"], num_splits),
        in_specs=[
            pl.BlockSpec((None, t, hq, dp), lambda i, h, r, c: (i, 0, 0, 0)),  # q (the kernel gathers its rows)
            pl.BlockSpec((None, s, None, dp), lambda i, h, r, c: (i, 0, h, 0)),  # k_cache
            pl.BlockSpec((None, s, None, dp), lambda i, h, r, c: (i, 0, h, 0)),  # v_cache
            pl.BlockSpec((None, t, None, dp), lambda i, h, r, c: (i, 0, h, 0)),  # k_new
            pl.BlockSpec((None, t, None, dp), lambda i, h, r, c: (i, 0, h, 0)),  # v_new
            pl.BlockSpec((None, t, t), lambda i, h, r, c: (i, 0, 0)),  # new_mask (or the ancestor table)
            pl.BlockSpec((None, t), lambda i, h, r, c: (i, 0)),  # positions
            pl.BlockSpec((None,), lambda i, h, r, c: (i,)),  # cache_lengths
        ],
        out_specs=[
            pl.BlockSpec((None, None, None, block_q, dp), lambda i, h, r, c: (c, i, h, r, 0)),
            pl.BlockSpec((None, None, None, block_q), lambda i, h, r, c: (c, i, h, r)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((num_splits, b, n, lay["padded_rows"], dp), jnp.float32),
            jax.ShapeDtypeStruct((num_splits, b, n, lay["padded_rows"]), jnp.float32),
        ],
        compiler_params=plt.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages),
        interpret=interpret,
        debug=debug,
        name="tree_attention_row_invariant" if config.row_invariant else "tree_attention",
    )(q, k_cache, v_cache, k_new, v_new, seen, positions, lengths)
    return o, lse, lay


_MERGE_ROWS, _MERGE_COLS = 16, 32  # a merge program's tile: many programs, since one row block's partials of
# every chunk (at T = 16, 18 chunks x 64 rows x 128) took one program 5.5 us on the H200


def _merge_kernel(o_ref, lse_ref, out_ref, *, num_splits: int, group: int, heads: int, rows: int, d: int):
    """Log-sum-exp merge of one (row, KV head, row tile, column tile)'s partials: o_ref [c, mr, mc] and lse_ref
    [c, mr] f32 -> its part of out_ref [t * heads, d] (row = token * heads + query head), in out's dtype."""
    h, row_tile, col_tile = pl.program_id(1), pl.program_id(2), pl.program_id(3)
    mr, mc = o_ref.shape[1:]
    lse = [lse_ref[c, :] for c in range(num_splits)]
    top = lse[0]
    for c in range(1, num_splits):
        top = jnp.maximum(top, lse[c])
    top = jnp.where(top == _NEG_INF, 0.0, top)  # rows that saw nothing: all weights 0, output 0
    acc = jnp.zeros((mr, mc), jnp.float32)
    total = jnp.zeros(top.shape, jnp.float32)
    for c in range(num_splits):  # a fixed order
        weight = jnp.exp(lse[c] - top)
        acc += weight[:, None] * o_ref[c, :, :]
        total += weight
    out = acc / jnp.where(total == 0.0, 1.0, total)[:, None]
    row = row_tile * mr + jnp.arange(mr, dtype=jnp.int32)
    flat = lax.div(row, jnp.int32(group)) * heads + h * group + lax.rem(row, jnp.int32(group))
    cols = col_tile * mc + jnp.arange(mc, dtype=jnp.int32)
    plt.store(out_ref.at[flat[:, None], cols[None, :]], out.astype(out_ref.dtype),
              mask=(row < rows)[:, None] & (cols < d)[None, :])


def _merge_partials(o, lse, lay, out_shape, dtype, *, interpret: bool):
    """The chunks' partials o [c, b, n, R, dp], lse [c, b, n, R] -> [b, t, n*g, d] in `dtype`: one launch
    (`_merge_kernel`) writing the output in q's layout (in jnp it took XLA three kernels per layer)."""
    b, t, hq, d = out_shape
    num_splits, _, n, padded_rows, dp = o.shape
    mr, mc = min(_MERGE_ROWS, padded_rows), min(_MERGE_COLS, dp)  # both powers of two dividing theirs
    kernel = functools.partial(_merge_kernel, num_splits=num_splits, group=lay["group"], heads=hq, rows=lay["rows"],
                               d=d)
    out = pl.pallas_call(
        kernel_body(kernel, interpret),
        grid=(b, n, padded_rows // mr, dp // mc),
        in_specs=[pl.BlockSpec((num_splits, None, None, mr, mc), lambda i, h, r, c: (0, i, h, r, c)),
                  pl.BlockSpec((num_splits, None, None, mr), lambda i, h, r, c: (0, i, h, r))],
        out_specs=pl.BlockSpec((None, t * hq, d), lambda i, h, r, c: (i, 0, 0)),
        out_shape=jax.ShapeDtypeStruct((b, t * hq, d), dtype),
        compiler_params=plt.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name="tree_attention_merge",
    )(o, lse)
    return out.reshape(b, t, hq, d)


# ----------------------------------------------------------------------------------------------------
# Public functions


@functools.partial(jax.jit, static_argnames=("scale", "sliding_window", "config", "interpret", "debug"))
def tree_attention_pallas(q, k_cache, v_cache, cache_lengths, k_new, v_new, new_mask, positions, *,
                          scale: float, sliding_window: int | None = None,
                          config: TreeAttentionConfig | None = None, interpret: bool = False,
                          debug: bool = False) -> jax.Array:
    """The Pallas kernel; arguments and result as `tree_attention_reference`, plus the knobs.

    config: TreeAttentionConfig (None: defaults). interpret: run the kernel in the Pallas interpreter
    (CPU). debug: print the kernel's jaxpr and Triton IR.
    """
    config = TreeAttentionConfig() if config is None else config
    o, lse, lay = _tree_attention_partials(q, k_cache, v_cache, cache_lengths, k_new, v_new, new_mask,
                                           positions, scale=scale, sliding_window=sliding_window,
                                           config=config, interpret=interpret, debug=debug)
    return _merge_partials(o, lse, lay, q.shape, q.dtype, interpret=interpret)


def tree_attention(q, k_cache, v_cache, cache_lengths, k_new, v_new, new_mask, positions, *,
                   scale: float, sliding_window: int | None = None, implementation: str | None = None,
                   config: TreeAttentionConfig | None = None, interpret: bool | None = None) -> jax.Array:
    """Dispatcher: the Pallas kernel on a GPU, the reference elsewhere.

    implementation: None (see `pallas_kernels._dispatch`: argument, then $DDTREE_JAX_KERNELS, then the
    backend), "pallas" or "reference". interpret: None interprets the kernel where there is no GPU.
    Arguments and result as `tree_attention_reference`.
    """
    if resolve_implementation(implementation) == "reference":
        return tree_attention_reference(q, k_cache, v_cache, cache_lengths, k_new, v_new, new_mask, positions,
                                        scale=scale, sliding_window=sliding_window)
    return tree_attention_pallas(q, k_cache, v_cache, cache_lengths, k_new, v_new, new_mask, positions,
                                 scale=scale, sliding_window=sliding_window, config=config,
                                 interpret=resolve_interpret(interpret))


@functools.partial(jax.jit, static_argnames=("scale", "sliding_window"))
def tree_attention_reference(q, k_cache, v_cache, cache_lengths, k_new, v_new, new_mask, positions, *,
                             scale: float, sliding_window: int | None = None) -> jax.Array:
    """Attention of the new tokens over the committed cache plus themselves, in plain jnp.

    Args:
      q:              [b, t, n*g, d] queries of the new tokens.
      k_cache, v_cache: [b, s, n, d] committed K/V; slot j holds position j.
      cache_lengths:  [b] int, committed slots per row; slots >= length are ignored.
      k_new, v_new:   [b, t, n, d] K/V of the new tokens.
      new_mask:       [b, t, t] bool, which new tokens each new token sees (padding rows see only themselves).
      positions:      [b, t] int, the new tokens' positions (used only for the sliding window).
      scale:          softmax scale.
      sliding_window: keys with query_pos - key_pos >= window are hidden (|distance| among new tokens).
    Returns:
      [b, t, n*g, d] in q's dtype; scores and softmax in float32; a row that sees nothing gives zeros.
    """
    b, t, hq, d = q.shape
    s, n = k_cache.shape[1], k_cache.shape[2]
    qg = q.reshape(b, t, n, hq // n, d)
    f32 = jnp.float32
    logits_cache = jnp.einsum("btngd,bsnd->bngts", qg, k_cache, preferred_element_type=f32) * scale
    logits_new = jnp.einsum("btngd,bund->bngtu", qg, k_new, preferred_element_type=f32) * scale
    slot = jnp.arange(s)
    seen_cache = jnp.broadcast_to(slot[None, None, :] < cache_lengths[:, None, None], (b, t, s))
    seen_new = new_mask.astype(bool)
    if sliding_window is not None:
        seen_cache = seen_cache & (positions[:, :, None] - slot[None, None, :] < sliding_window)
        seen_new = seen_new & (jnp.abs(positions[:, :, None] - positions[:, None, :]) < sliding_window)
    logits = jnp.concatenate([logits_cache, logits_new], axis=-1)
    seen = jnp.concatenate([seen_cache, seen_new], axis=-1)[:, None, None]
    logits = jnp.where(seen, logits, -jnp.inf)
    probs = jnp.where(seen, jax.nn.softmax(logits, axis=-1, where=seen), 0.0)
    out = jnp.einsum("bngts,bsnd->btngd", probs[..., :s].astype(v_cache.dtype), v_cache, preferred_element_type=f32)
    out = out + jnp.einsum("bngtu,bund->btngd", probs[..., s:].astype(v_new.dtype), v_new, preferred_element_type=f32)
    return out.reshape(b, t, hq, d).astype(q.dtype)
