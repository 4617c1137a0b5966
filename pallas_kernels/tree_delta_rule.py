"""The gated delta rule over the nodes of a draft tree (Pallas, Triton): one launch per layer, or two.

The contract is `ddtree_jax.models.qwen3_5.tree_gated_delta_rule` (the chunked WY form with the tree's
ancestor relation in place of causal order): per value head h, with G_i = sum over node i's root path P(i) of g,
L_ij = exp(G_i - G_j) for j in P(i) (0 elsewhere) and A = strict(diag(beta) K K^T * L),

    (I + A) [U | W] = [diag(beta) V | diag(beta exp(G)) K],   v_new = U - W S0,
    out = (Q exp(G)) S0 + (Q K^T * L) v_new.

The kernel solves the one system those two make, (I + A) v_new = diag(beta) (V - exp(G) K S0): its right-hand
side is V columns wide, not K + V, and a block of value columns needs only its own columns of S0 and v_new.

The reference is that function in plain jnp (the CPU tests also check both against a float64 node-by-node
recurrence along each root path); kernels never import the application, so the two meet in the tests.

Why a kernel: XLA runs the rule as ~15 kernels per layer, among them a batched cuBLAS triangular solve that
walks its n rows one after another; on the H200 at the Qwen3.6-27B shape (48 value heads, head dims 128) the rule
took 35 us per layer at T = 16 and 92 us at T = 65, 30 and 51 us of it the solve (tools/gdn_probe.py,
2026-12-02): 48 layers make that 1.7 and 4.4 ms of a round. This kernel took 5-12 us at T = 16 (7 in the 27B
round's trace), 64-68 at T = 65 and 108-118 at T = 128 (XLA: 35-40, 90-99, 120-137); the model calls it for every
tree it takes. The first kernel (one program per head, K + V wide, unrolled block loops) took 13.4 us at T = 16
but 140-194 at T = 65. What bounds it now: each program's blocks run one after another, each waiting on loads
of the earlier blocks' rows (unrolled block loops, which could overlap those loads, measured 433 against 75 us
at T = 65 in a variant of this kernel).

One program per (batch row, value head, block of value columns), grid (b, H, V / value_block). Nodes are taken in
row blocks of 16, in node order (parents precede children, so a block's rows depend only on earlier rows and on
themselves), in a device loop; for block r:
  1. G of its rows from the ancestor mask (float32 sums over blocks <= r);
  2. the right-hand side, and the output's S0 term, from the block's rows and its columns of S0;
  3. per earlier block c (a device loop): A's 16 x 16 tile (r, c) times c's v_new off the right-hand side, and
     (Q K^T * L)'s tile times it onto the output (`exp` only where j is on i's path);
  4. the 16 x 16 diagonal block's inverse (substitution inside 4 x 4 blocks, then two block merges), v_new of the
     block, the diagonal's output term.
v_new and G of solved blocks are read back from the outputs (L2-resident) after a CTA barrier. The programs of one
head repeat steps 1, 3's A tiles and 4's inverse (16-wide, cheap) to run the value columns in parallel.

The two-launch form (`TreeDeltaRuleConfig.two_launch`; the default past DIRECT_MAX_NODES) takes everything that
does not depend on solved rows out of that chain: G by XLA (elementwise sums), then `_tiles_kernel` (every 16 x 16
tile of A and Q K^T * L and every diagonal inverse, one program each), then `_chain_kernel` (the blocks in order
with the solved rows of v_new in registers).

The direct form (`TreeDeltaRuleConfig.direct`; the default from 17 to DIRECT_MAX_NODES = 33 nodes) has no chain:
node 0 alone (a one-row block needs no inverse), then nodes 1 .. T-1 as one block through the whole inverse of
their system, formed by substitution and block merges (`_direct_kernel`). A DDTree verify of B + 1 nodes at B = 16
or 32 is one row and one block where the block forms walk two or three blocks, the last holding one node.

Letters: b batch, T nodes (at most MAX_NODES), H value heads, Hk key heads (value head h reads key head
h // (H / Hk)), K key dim, V value dim.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels._dispatch import cdiv, check_knobs, next_pow2, resolve_interpret
from pallas_kernels.launch import kernel_body

MAX_NODES = 128  # every node's keys, values and mask row fit one program; wider trees stay on the XLA path
BLOCK = 16  # node rows per block: Triton's smallest matmul side
# The most nodes `default_config` unrolls the chain for: timed at 65 (DDTree B = 64); at 128 nodes the unrolled
# chain spills (16 bytes per thread, sm_90 offline compile) and is untimed, so wider trees keep the device loop.
UNROLLED_MAX_NODES = 5 * BLOCK
# The most nodes `default_config` gives the direct form: node 0 and a block of 32 (timed at 17 and 33; at 65 its
# 64 x 64 inverse made it slower than the two-launch form).
DIRECT_MAX_NODES = 2 * BLOCK + 1

_DN = (((1,), (0,)), ((), ()))  # a [m, k] @ [k, n]
_DN_T = (((1,), (1,)), ((), ()))  # a [m, k] @ b[n, k]^T


def supports(t: int, key_dim: int, value_dim: int) -> bool:
    """Whether the kernel takes T nodes with these head dims (1 <= T <= MAX_NODES; powers of two >= 16)."""
    return 1 <= t <= MAX_NODES and all(d >= 16 and not d & (d - 1) for d in (key_dim, value_dim))


@dataclasses.dataclass(frozen=True)
class TreeDeltaRuleConfig:
    """Tuning knobs of the kernel (static, hashable).

    num_warps:    Triton's warps per program.
    num_stages:   Triton's software pipelining of the block loop. 1 for the one-launch form (it stores and reloads
                  rows across barriers); the two-launch chain's loads depend on nothing solved, but 2 (prefetching
                  the next block) was slower on the H200 (60.6 against 56.9 us per layer at T = 65).
    value_block:  value columns per program (a power of two >= 16; the value dim when larger): more programs per
                  head for wide trees, each repeating the 16-wide tiles of A and the diagonal inverse.
    two_launch:   the two-launch form: every 16 x 16 tile of A and Q K^T and every diagonal inverse first, one
                  program each, then the chain over the blocks with the solved rows in registers (its loads no
                  longer wait on earlier blocks). `default_config` takes it past one block.
    tile_warps:   Triton's warps per program of the two-launch form's first launch (one tile each).
    s0_in_xla:    the two-launch form with the initial state's terms (diag(beta)(V - e^G K S0) and e^G Q S0, every
                  node at once) computed by XLA before the chain, so the chain loads two [16, V block] rows per
                  block instead of q, k, v rows and the [K, V block] state (32 KB) and skips two matmuls. Slower
                  on the H200 (T = 65: 50.7-70.1 us per layer against 37.2-64.3 without; the extra XLA pass).
    unrolled_chain: the two-launch form's chain with its blocks unrolled in Python (at most MAX_NODES / 16 = 8):
                  each solved block its own tile, so a block multiplies only the tiles of A and Q K^T it needs
                  (the device loop multiplies whole [16, width] row blocks) and inserts nothing. `default_config`
                  takes it up to UNROLLED_MAX_NODES.
    direct:       the direct form (`_direct_kernel`): one launch, no chain of blocks. Node 0 is solved alone (a
                  one-row block needs no inverse), then every other node at once with the whole inverse of its
                  [P, P] system (P = T - 1 rounded up to a power of two >= 16), formed by block merges: a tree of
                  65 nodes (DDTree B = 64) is one row and one block of 64, where the block forms need five
                  blocks in a chain, the fifth for the 65th node alone.
    block_rows:   the two-launch form's node rows per block (a power of two >= 16): fewer, wider blocks make a
                  shorter chain (T = 65: three blocks of 32 rows against five of 16), each with a wider diagonal
                  inverse and tiles.
    inverse_passes: the direct form's block merges at the "default" precision on a GPU: 0 float32 products
                  (exact; FMA, slow at P = 64), 1 TF32, 3 TF32 in three passes (~float32). At "highest" and in
                  the interpreter always float32.
    """

    num_warps: int = 8
    num_stages: int = 1
    value_block: int = 64
    two_launch: bool = False
    tile_warps: int = 4
    s0_in_xla: bool = False
    unrolled_chain: bool = False
    direct: bool = False
    inverse_passes: int = 0
    block_rows: int = BLOCK

    def __post_init__(self):
        check_knobs(self, pow2={"value_block": 16, "tile_warps": 1, "block_rows": BLOCK})
        if self.block_rows != BLOCK and not self.two_launch:
            raise ValueError(f"TreeDeltaRuleConfig.block_rows={self.block_rows} is a knob of the two-launch form "
                             "(two_launch=True)")
        for knob in ("s0_in_xla", "unrolled_chain"):
            if getattr(self, knob) and not self.two_launch:
                raise ValueError(f"TreeDeltaRuleConfig.{knob} is a knob of the two-launch form (two_launch=True)")
        if self.direct and self.two_launch:
            raise ValueError("TreeDeltaRuleConfig.direct and two_launch are two forms: take one")
        if self.inverse_passes not in (0, 1, 3):
            raise ValueError(f"TreeDeltaRuleConfig.inverse_passes={self.inverse_passes}: expected 0 (float32 "
                             "products), 1 (TF32) or 3 (TF32 in three passes)")


def default_config(t: int, precision: str = "default") -> TreeDeltaRuleConfig:
    """The knobs for T nodes at a matmul `precision` ("default" or "highest", as the kernel takes it), 64 value
    columns per program: the one-launch form with 8 warps for one block; the direct form with 8 warps up to
    DIRECT_MAX_NODES at the default precision; past it (and at "highest") the two-launch form with 8 warps, its
    chain unrolled up to UNROLLED_MAX_NODES at the default precision. On the H200 at the Qwen3.6-27B shape
    (tools/gdn_probe.py), us per layer at T = 16 / 65 / 128 with 64 columns (2026-12-02, two calls, the second
    with this inverse): 4 warps 22.3, 11.1 / 64.1, 67.9 / 108, 118; 8 warps 5.1, 12.2 / 83.9, 77.2 / 133, 137.
    32 columns: 13-21 / 71-147 / 124-263; 128 columns with 4 warps: 14 / 578 / 867. At T = 16 on 2026-12-04
    (two calls) 4 warps 8.0, 9.6 against 8 warps 10.9, 11.5, but the DFlash round's trace gives 8 warps 7.3 us
    per layer: unchanged."""
    if t <= BLOCK:
        return TreeDeltaRuleConfig(num_warps=8)
    # Up to 33 nodes the direct form: node 0 alone, then one block of at most 32 through its whole inverse. H200,
    # 27B shape (tools/gdn_probe.py, 2026-12-04, two calls), us per layer: T = 17 8 warps 13.3, 15.7 (4 warps
    # 17.5, 14.4) against the unrolled two-launch form's 17.0-21.2; T = 33 24.0 (4 warps 30.5) against 29.8-31.6.
    # At T = 65 (a block of 64) it took 70.7-73.3 against 37.3-50.3: the 64 x 64 inverse's merges, dependent dots
    # of ~2 us each (TF32; in three passes 93.9-106.2), and 0.6 KB of spills. At the "highest" precision it
    # spills 6-8 KB (sm_90 offline compile, tools/triton_offline.py): the two-launch form there.
    if t <= DIRECT_MAX_NODES and precision == "default":
        return TreeDeltaRuleConfig(num_warps=8, direct=True, inverse_passes=1)
    # Past it the two-launch form: its chain loads nothing that depends on solved rows. H200, 27B shape
    # (tools/gdn_probe.py, 2026-12-02), us per layer at T = 65 / 128: one launch 71.1 / 117.7, two launches
    # 56.9 / 94.0 with one stage, 60.6 / 100.4 with two. The chain unrolled (evening, T = 65, 4 warps, one stage):
    # 37.2 us with 64 value columns, 38.9 with 32, against 49.7-64.3 rolled; 8 warps 41.0-43.9. On 2026-12-04 at
    # T = 65 8 warps took 37.3 and 43.5 against 4 warps' 50.3 and 45.1, and in the 27B's B = 64 round its chain
    # 0.976 ms (two calls) against 4 warps' 1.147 (48 layers): 8 warps. Blocks of 32 rows (block_rows): 43.5-48.9.
    # At the "highest" precision (float32 products: three TF32 passes each) the unrolled chain spills ~8 KB.
    unrolled = t <= UNROLLED_MAX_NODES and precision == "default"
    return TreeDeltaRuleConfig(num_warps=8, two_launch=True, unrolled_chain=unrolled)


# Helpers of both forms. Rows and columns are node indices; `t` the node count (rows >= t are padding).
def _rows_of(ref, rows, ok, t: int):  # [n, D] rows of a [T, D] ref; indices clamped (in bounds), masked rows 0
    cols = jnp.arange(ref.shape[-1])
    return plt.load(ref.at[jnp.minimum(rows, t - 1)[:, None], cols[None, :]], mask=ok[:, None], other=0.0)


def _per_node(ref, rows, ok, t: int):  # [n] entries of a [T] ref
    return plt.load(ref.at[jnp.minimum(rows, t - 1)], mask=ok, other=0.0)


# Masked lanes of a store get an out-of-range row: the interpreter drops those writes (a masked lane writing back
# the old value at a shared clamped row could overwrite a real one); Triton masks them.
def _store_rows(ref, rows, ok, x, t: int):
    cols = jnp.arange(ref.shape[-1])
    plt.store(ref.at[jnp.where(ok, rows, t)[:, None], cols[None, :]], x.astype(ref.dtype), mask=ok[:, None])


def _mask_of(vis_ref, rows, cols, ok_rows, ok_cols, t: int):  # [n, m] bool: visible[rows, cols]
    clamp = lambda x: jnp.minimum(x, t - 1)  # noqa: E731
    return plt.load(vis_ref.at[clamp(rows)[:, None], clamp(cols)[None, :]],
                    mask=ok_rows[:, None] & ok_cols[None, :], other=0) != 0


def _decay(visible, cum_rows, cum_cols):  # L on visible pairs, 0 elsewhere (exp only where visible)
    return jnp.where(visible, jnp.exp(jnp.where(visible, cum_rows[:, None] - cum_cols[None, :], 0.0)), 0.0)


def _dot(a, b, precision, dims=_DN):
    return lax.dot_general(a, b, dims, precision=precision, preferred_element_type=jnp.float32)


def _exact_dot(a, b):  # float32 products whatever the kernel's precision (the inverse's merges, row selections)
    return _dot(a, b, lax.Precision.HIGHEST)


def _unit_lower_inverse(d, merge=None):
    """(I + d)^-1 for a strictly lower [n, n] d (n a power of two >= 4): forward substitution inside its 4 x 4
    diagonal blocks at once (4 steps: row s of each block is final once the rows above it are subtracted; every
    later row of the block then subtracts d[:, s] times it), then block merges, X <- X - X E X with E the lower
    off-diagonal blocks of the 8s, the 16s, ... ((I + X E)^-1 = I - X E as (X E)^2 = 0), each product by `merge`
    (float32-exact by default). As exact as substitution; the product form (I - d)(I + d^2)(I + d^4)(I + d^8)
    loses ~4 digits to cancellation on near-parallel keys."""
    merge = _exact_dot if merge is None else merge
    n = d.shape[0]
    index = jnp.arange(n)
    within_row, within_col = index[:, None], index[None, :]
    same_4 = (within_row // 4) == (within_col // 4)

    def substitute(s, inv):
        pivots = within_row % 4 == s  # row s of each 4-block
        row_s = jnp.where(same_4, jnp.sum(jnp.where(pivots, inv, 0.0), axis=0)[None, :], 0.0)  # [n, n]
        col_s = jnp.sum(jnp.where(within_col == (within_row // 4) * 4 + s, d, 0.0), axis=1)  # [n]
        return inv - jnp.where(within_row % 4 > s, col_s[:, None], 0.0) * row_s

    inv = lax.fori_loop(0, 4, substitute, (within_row == within_col).astype(jnp.float32))
    half = 4
    while half < n:
        off = jnp.where(((within_row // half) == (within_col // half) + 1) & (within_row // half % 2 == 1), d, 0.0)
        inv = inv - merge(merge(inv, off), inv)
        half *= 2
    return inv


def _kernel(q_ref, k_ref, v_ref, g_ref, beta_ref, vis_ref, s0_ref,  # inputs
            out_ref, vnew_ref, cum_ref,  # outputs (v_new and G also read back: earlier blocks' solved rows)
            *, t: int, precision, interpret: bool):
    """The one-launch form: each program runs its head's blocks in order, reading earlier blocks back."""
    f32 = jnp.float32
    block = jnp.arange(BLOCK)
    rows_of, per_node = functools.partial(_rows_of, t=t), functools.partial(_per_node, t=t)
    mask_of = functools.partial(_mask_of, vis_ref, t=t)
    dot = lambda a, b, dims=_DN: _dot(a, b, precision, dims)  # noqa: E731

    def one_block(r, carry):
        rows = r * BLOCK + block
        ok = rows < t

        def root_path_sum(c, cum):  # G_i over block c's columns (ancestors lie in blocks <= r)
            cols = c * BLOCK + block
            g_c = per_node(g_ref, cols, cols < t)
            return cum + jnp.sum(jnp.where(mask_of(rows, cols, ok, cols < t), g_c[None, :], 0.0), axis=1)

        cum_r = lax.fori_loop(0, r + 1, root_path_sum, jnp.zeros((BLOCK,), f32))
        q_r = rows_of(q_ref, rows, ok).astype(f32)
        k_r = rows_of(k_ref, rows, ok).astype(f32)
        beta_r = per_node(beta_ref, rows, ok)
        kb_r = k_r * beta_r[:, None]
        s0 = s0_ref[...]  # [K, V block]
        decay_r = jnp.exp(cum_r)[:, None]
        rhs = beta_r[:, None] * (rows_of(v_ref, rows, ok).astype(f32) - decay_r * dot(k_r, s0))  # [16, V block]
        out_r = dot(q_r * decay_r, s0)

        def earlier_block(c, acc):  # subtract A's tile (r, c) times c's v_new; add c's part of the output
            rhs, out_r = acc
            cols = c * BLOCK + block
            all_ok = cols < t
            k_c = rows_of(k_ref, cols, all_ok).astype(f32)
            vnew_c = rows_of(vnew_ref, cols, all_ok)
            l_rc = _decay(mask_of(rows, cols, ok, all_ok), cum_r, per_node(cum_ref, cols, all_ok))
            return (rhs - dot(dot(kb_r, k_c, _DN_T) * l_rc, vnew_c),
                    out_r + dot(dot(q_r, k_c, _DN_T) * l_rc, vnew_c))

        rhs, out_r = lax.fori_loop(0, r, earlier_block, (rhs, out_r))
        l_rr = _decay(mask_of(rows, rows, ok, ok), cum_r, cum_r)
        d = jnp.where(block[None, :] < block[:, None], dot(kb_r, k_r, _DN_T) * l_rr, 0.0)  # [16, 16]
        vnew_r = dot(_unit_lower_inverse(d), rhs)
        out_r += dot(dot(q_r, k_r, _DN_T) * l_rr, vnew_r)
        _store_rows(vnew_ref, rows, ok, vnew_r, t)
        _store_rows(out_ref, rows, ok, out_r, t)
        plt.store(cum_ref.at[jnp.where(ok, rows, t)], cum_r, mask=ok)
        if not interpret:  # later blocks read these rows back (the interpreter runs a program sequentially)
            plt.debug_barrier()
        return carry

    lax.fori_loop(0, cdiv(t, BLOCK), one_block, 0)


def _tiles_kernel(q_ref, k_ref, cum_ref, beta_ref, vis_ref,  # inputs
                  a_ref, qk_ref, inv_ref,  # outputs: [n, n] tiles (n = TreeDeltaRuleConfig.block_rows)
                  *, t: int, precision):
    """The two-launch form's first launch, one program per (row, value head, row block r, column block c): A's and
    (Q K^T * L)'s n x n tiles (r, c), zeros where c > r (no ancestors there) or past the nodes, and for c = r
    the diagonal block's inverse. Light programs (no S0): many stay resident per multiprocessor."""
    r, c = pl.program_id(2), pl.program_id(3)
    n = a_ref.shape[-1]

    @pl.when(c > r)
    def _():
        a_ref[...] = jnp.zeros(a_ref.shape, a_ref.dtype)
        qk_ref[...] = jnp.zeros(qk_ref.shape, qk_ref.dtype)

    @pl.when(c <= r)
    def _():
        f32 = jnp.float32
        block = jnp.arange(n)
        rows, cols = r * n + block, c * n + block
        ok, ok_c = rows < t, cols < t
        k_c = _rows_of(k_ref, cols, ok_c, t).astype(f32)
        beta_r = _per_node(beta_ref, rows, ok, t)
        l_rc = _decay(_mask_of(vis_ref, rows, cols, ok, ok_c, t), _per_node(cum_ref, rows, ok, t),
                      _per_node(cum_ref, cols, ok_c, t))
        a = jnp.where(cols[None, :] < rows[:, None],
                      _dot(_rows_of(k_ref, rows, ok, t).astype(f32) * beta_r[:, None], k_c, precision, _DN_T) * l_rc,
                      0.0)
        a_ref[...] = a
        qk_ref[...] = _dot(_rows_of(q_ref, rows, ok, t).astype(f32), k_c, precision, _DN_T) * l_rc

        @pl.when(c == r)
        def _():
            inv_ref[...] = _unit_lower_inverse(a)


def _chain_kernel(*refs, t: int, precision, s0_given: bool, unrolled: bool):
    """The two-launch form's second launch, one program per (row, value head, block of value columns): the blocks
    in order, each v_new_r = inv_r (rhs_r - A[r, :] v_new) with rhs_r = diag(beta) (V - e^G K S0) of its rows, and
    out_r = e^G Q S0 + (Q K^T * L)[r, :] v_new. A block's loads and its S0 terms depend on nothing solved: only
    matmuls with the solved rows chain one block to the next.

    refs: q, k, v, G, beta, S0 (the S0 terms computed here) or, with `s0_given` (`TreeDeltaRuleConfig.s0_in_xla`),
    rhs0 = diag(beta) (V - e^G K S0) and qs0 = e^G Q S0 [T, V block]; then the tiles A, Q K^T * L [rows, width] and
    the diagonal inverses [rows, n] (n rows per block, `TreeDeltaRuleConfig.block_rows`); then the outputs out,
    v_new. The blocks run in a device loop holding every solved row in one [width, V block] register tile (rows of
    unsolved blocks zero, so whole row blocks of A and Q K^T multiply it; each block's rows go in by an exact
    one-hot product), or with `unrolled` (`TreeDeltaRuleConfig.unrolled_chain`) in Python, each solved block its
    own [n, V block] tile, so block r multiplies only its r tiles of A and r + 1 of Q K^T and nothing is inserted
    (its tiles need not span a power of two)."""
    if s0_given:
        rhs_ref, qs0_ref, a_ref, qk_ref, inv_ref, out_ref, vnew_ref = refs
    else:
        q_ref, k_ref, v_ref, cum_ref, beta_ref, s0_ref, a_ref, qk_ref, inv_ref, out_ref, vnew_ref = refs
    f32 = jnp.float32
    width, n = a_ref.shape[-1], inv_ref.shape[-1]  # the rolled chain's width: a power of two >= the padded nodes
    block = jnp.arange(n)

    def s0_terms(rows, ok):  # (rhs0, qs0) of a block's rows, [n, V block]
        if s0_given:
            return _rows_of(rhs_ref, rows, ok, t), _rows_of(qs0_ref, rows, ok, t)
        beta_r = _per_node(beta_ref, rows, ok, t)
        decay_r = jnp.exp(_per_node(cum_ref, rows, ok, t))[:, None]
        s0 = s0_ref[...]  # [K, V block], from L1/L2 each block
        rhs = beta_r[:, None] * (_rows_of(v_ref, rows, ok, t).astype(f32)
                                 - decay_r * _dot(_rows_of(k_ref, rows, ok, t).astype(f32), s0, precision))
        return rhs, _dot(_rows_of(q_ref, rows, ok, t).astype(f32) * decay_r, s0, precision)

    if unrolled:
        solved = []
        for r in range(cdiv(t, n)):
            rows = r * n + block
            ok = rows < t
            at = pl.ds(r * n, n)
            rhs, qs0 = s0_terms(rows, ok)
            for c, vnew_c in enumerate(solved):
                rhs = rhs - _dot(a_ref[at, pl.ds(c * n, n)], vnew_c, precision)
            solved.append(_dot(inv_ref[at, :], rhs, precision))
            out_r = qs0
            for c, vnew_c in enumerate(solved):
                out_r = out_r + _dot(qk_ref[at, pl.ds(c * n, n)], vnew_c, precision)
            _store_rows(vnew_ref, rows, ok, solved[-1], t)
            _store_rows(out_ref, rows, ok, out_r, t)
        return

    def one_block(r, solved):  # solved: [width, V block], v_new of blocks < r, zeros after
        rows = r * n + block
        ok = rows < t
        at = pl.ds(r * n, n)
        rhs, qs0 = s0_terms(rows, ok)
        vnew_r = _dot(inv_ref[at, :], rhs - _dot(a_ref[at, :], solved, precision), precision)
        place = (jnp.arange(width)[:, None] == rows[None, :]).astype(f32)  # [width, n] one-hot
        solved = solved + _exact_dot(place, vnew_r)
        _store_rows(vnew_ref, rows, ok, vnew_r, t)
        _store_rows(out_ref, rows, ok, qs0 + _dot(qk_ref[at, :], solved, precision), t)
        return solved

    lax.fori_loop(0, cdiv(t, n), one_block, jnp.zeros((width, vnew_ref.shape[-1]), f32))


def _direct_kernel(q_ref, k_ref, v_ref, g_ref, beta_ref, vis_ref, s0_ref,  # inputs
                   out_ref, vnew_ref, cum_ref,  # outputs
                   *, t: int, precision, merge_precision):
    """The direct form, one program per (row, value head, block of value columns): node 0 alone, in a 16-row tile
    whose other rows are masked (zeros), then nodes 1 .. T-1 in one block of P rows,

        v_new_0 = beta_0 (v_0 - e^G_0 S0^T k_0),
        (I + A_rr) v_new_r = diag(beta) (V_r - e^G K_r S0) - A_r0 v_new_0,   v_new_r = (I + A_rr)^-1 (...),

    the whole inverse formed from the block's A (substitution and block merges, `_unit_lower_inverse`), then
    out = e^G Q S0 + (Q K^T * L) v_new over both blocks. Nothing waits on a solved block but the block after
    node 0 (whose term is one [P, 16] x [16, V block] product). Node 0 needs no particular place in the tree:
    a row not below it has A_r0 = 0."""
    f32 = jnp.float32
    p = next_pow2(max(t - 1, BLOCK))
    first, rows = jnp.arange(BLOCK), 1 + jnp.arange(p)
    ok0, ok = first == 0, rows < t
    rows_of, per_node = functools.partial(_rows_of, t=t), functools.partial(_per_node, t=t)
    mask_of = functools.partial(_mask_of, vis_ref, t=t)
    dot = lambda a, b, dims=_DN: _dot(a, b, precision, dims)  # noqa: E731
    merge = lambda a, b: _dot(a, b, merge_precision)  # noqa: E731

    # G: node 0's own, and every other node's over node 0 and the block.
    g0, g_r = per_node(g_ref, first, ok0), per_node(g_ref, rows, ok)
    vis_00, vis_r0, vis_rr = mask_of(first, first, ok0, ok0), mask_of(rows, first, ok, ok0), mask_of(rows, rows, ok, ok)
    cum0 = jnp.sum(jnp.where(vis_00, g0[None, :], 0.0), axis=1)  # [16], node 0's at index 0
    cum_r = (jnp.sum(jnp.where(vis_r0, g0[None, :], 0.0), axis=1)
             + jnp.sum(jnp.where(vis_rr, g_r[None, :], 0.0), axis=1))  # [P]
    s0 = s0_ref[...]  # [K, V block]

    # Node 0 (rows 1..15 of its tile are zeros: beta 0 there, so v_new 0).
    k0 = rows_of(k_ref, first, ok0).astype(f32)
    decay0 = jnp.exp(cum0)[:, None]
    vnew0 = per_node(beta_ref, first, ok0)[:, None] * (rows_of(v_ref, first, ok0).astype(f32) - decay0 * dot(k0, s0))
    q0 = rows_of(q_ref, first, ok0).astype(f32)
    out0 = dot(q0 * decay0, s0) + dot(dot(q0, k0, _DN_T) * _decay(vis_00, cum0, cum0), vnew0)
    _store_rows(vnew_ref, first, ok0, vnew0, t)
    _store_rows(out_ref, first, ok0, out0, t)
    plt.store(cum_ref.at[jnp.where(ok0, first, t)], cum0, mask=ok0)

    # The block: the key rows' products first (their [P, K] tile then dies), then the query rows'.
    decay_r = jnp.exp(cum_r)[:, None]
    l_r0, l_rr = _decay(vis_r0, cum_r, cum0), _decay(vis_rr, cum_r, cum_r)
    beta_r = per_node(beta_ref, rows, ok)
    k_r = rows_of(k_ref, rows, ok).astype(f32)
    kb_r = k_r * beta_r[:, None]
    index = jnp.arange(p)
    a = jnp.where(index[None, :] < index[:, None], dot(kb_r, k_r, _DN_T) * l_rr, 0.0)  # [P, P]
    rhs = (beta_r[:, None] * (rows_of(v_ref, rows, ok).astype(f32) - decay_r * dot(k_r, s0))
           - dot(dot(kb_r, k0, _DN_T) * l_r0, vnew0))  # [P, V block]
    q_r = rows_of(q_ref, rows, ok).astype(f32)
    out_r = dot(q_r * decay_r, s0) + dot(dot(q_r, k0, _DN_T) * l_r0, vnew0)
    qk_rr = dot(q_r, k_r, _DN_T) * l_rr
    vnew_r = dot(_unit_lower_inverse(a, merge), rhs)
    _store_rows(vnew_ref, rows, ok, vnew_r, t)
    _store_rows(out_ref, rows, ok, out_r + dot(qk_rr, vnew_r), t)
    plt.store(cum_ref.at[jnp.where(ok, rows, t)], cum_r, mask=ok)


def _initial_state_terms(q, k, v, cum, beta, state, precision):
    """The two-launch form's S0 terms for every node in XLA: (diag(beta) (V - e^G K S0), e^G Q S0), [b, T, H, V]
    float32 each; value head h reads key head h // (H / Hk)."""
    b, t, hk, dk = q.shape
    h, dv = v.shape[2], v.shape[3]
    by_group = state.reshape(b, hk, h // hk, dk, dv)

    def times_state(x):  # [b, T, Hk, K] -> [b, T, H, V]
        return jnp.einsum("btgk,bgjkv->btgjv", x.astype(jnp.float32), by_group, precision=precision,
                          preferred_element_type=jnp.float32).reshape(b, t, h, dv)

    decay = jnp.exp(cum)[..., None]
    return beta[..., None] * (v.astype(jnp.float32) - decay * times_state(k)), decay * times_state(q)


@functools.partial(jax.jit, static_argnames=("precision", "config", "interpret", "debug"))
def tree_delta_rule_pallas(q, k, v, g, beta, initial_state, visible, *, precision: str = "highest",
                           config: TreeDeltaRuleConfig | None = None, interpret: bool = False, debug: bool = False):
    """q, k [b, T, Hk, K] (Hk divides H: value head h reads key head h // (H / Hk)), v [b, T, H, V], g and beta
    [b, T, H], initial_state [b, H, K, V], visible [b, T, T] bool; all but visible float32 (q, k, v may be
    lower precision: they are widened). T <= MAX_NODES; K, V powers of two >= 16.
    Returns (out [b, T, H, V], v_new [b, T, H, V], G [b, T, H]), float32: `tree_gated_delta_rule`'s out,
    written values and root-path log decays. precision: the matmuls' ("highest": float32 products; "default":
    the GPU's tensor-core float32 (TF32), as XLA's float32 dots at the default precision)."""
    b, t, hk, dk = q.shape
    config = default_config(t, precision) if config is None else config
    h, dv = v.shape[2], v.shape[3]
    if k.shape != q.shape or v.shape[:2] != (b, t) or h % hk:
        raise ValueError(f"q and k must be [b, T, Hk, K] and v [b, T, H, V] with Hk dividing H; got q {q.shape}, "
                         f"k {k.shape}, v {v.shape}")
    if g.shape != (b, t, h) or beta.shape != (b, t, h) or initial_state.shape != (b, h, dk, dv) \
            or visible.shape != (b, t, t):
        raise ValueError(f"g, beta [b, T, H] = {(b, t, h)}, initial_state {(b, h, dk, dv)}, visible {(b, t, t)}; got "
                         f"{g.shape}, {beta.shape}, {initial_state.shape}, {visible.shape}")
    if not supports(t, dk, dv):
        raise ValueError(f"T={t} nodes, K={dk}, V={dv}: the kernel takes 1 <= T <= {MAX_NODES} and head dims that "
                         "are powers of two >= 16")
    group = h // hk
    if precision not in ("highest", "default"):
        raise ValueError(f"precision={precision!r}: expected 'highest' or 'default'")
    matmul_precision = lax.Precision[precision.upper()]
    vb = min(config.value_block, dv)
    # Index maps take (row, head, ...): the one-launch grid is (b, H, V blocks), the tile launch's (b, H, r, c).
    key_spec = pl.BlockSpec((None, t, None, dk), lambda i, j, *_: (i, 0, j // group, 0))
    value_rows = pl.BlockSpec((None, t, None, vb), lambda i, j, n: (i, 0, j, n))
    per_node = pl.BlockSpec((None, t, None), lambda i, j, *_: (i, 0, j))
    mask_spec = pl.BlockSpec((None, t, t), lambda i, *_: (i, 0, 0))
    state_columns = pl.BlockSpec((None, None, dk, vb), lambda i, j, n: (i, j, 0, n))
    f32 = jnp.float32
    outputs = [jax.ShapeDtypeStruct((b, t, h, dv), f32), jax.ShapeDtypeStruct((b, t, h, dv), f32)]
    params = plt.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages)
    beta32, mask8, state32 = beta.astype(f32), visible.astype(jnp.int8), initial_state.astype(f32)
    if not config.two_launch:  # one launch: the direct form or the block loop
        if config.direct:
            merge_precision = (lax.Precision.HIGHEST if precision == "highest" or interpret or not config.inverse_passes
                               else lax.Precision.DEFAULT if config.inverse_passes == 1
                               else lax.DotAlgorithmPreset.TF32_TF32_F32_X3)
            kernel = functools.partial(_direct_kernel, t=t, precision=matmul_precision, merge_precision=merge_precision)
        else:
            kernel = functools.partial(_kernel, t=t, precision=matmul_precision, interpret=interpret)
        return tuple(pl.pallas_call(
            kernel_body(kernel, interpret),
            grid=(b, h, dv // vb),
            in_specs=[key_spec, key_spec, value_rows, per_node, per_node, mask_spec, state_columns],
            # Every column block of a head writes the same G (the same float operations on the same inputs).
            out_specs=[value_rows, value_rows, per_node],
            out_shape=outputs + [jax.ShapeDtypeStruct((b, t, h), f32)],
            compiler_params=params, interpret=interpret, debug=debug,
            name="tree_delta_rule_direct" if config.direct else "tree_delta_rule",
        )(q, k, v, g.astype(f32), beta32, mask8, state32))
    # The two-launch form. G first, every node at once (elementwise sums: exact float32 whatever the backend).
    cum = jnp.sum(jnp.where(visible[:, :, :, None], g.astype(f32)[:, None], 0.0), axis=2)  # [b, T, H]
    n = config.block_rows
    blocks = cdiv(t, n)
    # Tile rows; columns a power of two for the rolled chain (zeros past T), the blocks' own for the unrolled one.
    rows = blocks * n
    width = rows if config.unrolled_chain else next_pow2(rows)
    tile = pl.BlockSpec((None, None, n, n), lambda i, j, r, c: (i, j, r, c))
    a, qk, inv = pl.pallas_call(
        kernel_body(functools.partial(_tiles_kernel, t=t, precision=matmul_precision), interpret),
        grid=(b, h, blocks, width // n),
        in_specs=[key_spec, key_spec, per_node, per_node, mask_spec],
        out_specs=[tile, tile, pl.BlockSpec((None, None, n, n), lambda i, j, r, c: (i, j, r, 0))],
        out_shape=[jax.ShapeDtypeStruct((b, h, rows, width), f32), jax.ShapeDtypeStruct((b, h, rows, width), f32),
                   jax.ShapeDtypeStruct((b, h, rows, n), f32)],
        compiler_params=plt.CompilerParams(num_warps=config.tile_warps, num_stages=1),
        interpret=interpret, debug=debug, name="tree_delta_rule_tiles",
    )(q, k, cum, beta32, mask8)
    per_head = lambda dim: pl.BlockSpec((None, None, rows, dim), lambda i, j, n: (i, j, 0, 0))  # noqa: E731
    if config.s0_in_xla:
        terms = _initial_state_terms(q, k, v, cum, beta32, state32, matmul_precision)
        term_specs = [value_rows, value_rows]
    else:
        terms = (q, k, v, cum, beta32, state32)
        term_specs = [key_spec, key_spec, value_rows, per_node, per_node, state_columns]
    out, v_new = pl.pallas_call(
        kernel_body(functools.partial(_chain_kernel, t=t, precision=matmul_precision, s0_given=config.s0_in_xla,
                                      unrolled=config.unrolled_chain), interpret),
        grid=(b, h, dv // vb),
        in_specs=term_specs + [per_head(width), per_head(width), per_head(n)],
        out_specs=[value_rows, value_rows],
        out_shape=outputs,
        compiler_params=params, interpret=interpret, debug=debug, name="tree_delta_rule_chain",
    )(*terms, a, qk, inv)
    return out, v_new, cum


def tree_delta_rule(q, k, v, g, beta, initial_state, visible, *, precision: str = "highest",
                    config: TreeDeltaRuleConfig | None = None, interpret: bool | None = None):
    """`tree_delta_rule_pallas`, interpreted where there is no GPU (interpret None). The reference is the
    application's `qwen3_5.tree_gated_delta_rule`, which the model calls for trees wider than MAX_NODES."""
    return tree_delta_rule_pallas(q, k, v, g, beta, initial_state, visible, precision=precision, config=config,
                                  interpret=resolve_interpret(interpret))
