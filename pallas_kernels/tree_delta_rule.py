"""The gated delta rule over the nodes of a draft tree, one launch per layer (Pallas, Triton).

The contract is `ddtree_jax.models.qwen3_5.tree_gated_delta_rule` (the chunked WY form with the tree's
ancestor relation in place of causal order): per value head h, with G_i = sum over node i's root path P(i) of g,
L_ij = exp(G_i - G_j) for j in P(i) (0 elsewhere) and A = strict(diag(beta) K K^T * L),

    (I + A) [U | W] = [diag(beta) V | diag(beta exp(G)) K],   v_new = U - W S0,
    out = (Q exp(G)) S0 + (Q K^T * L) v_new.

The reference is that function in plain jnp (the CPU tests also check both against a float64 node-by-node
recurrence along each root path); kernels never import the application, so the two meet in the tests.

Why a kernel: XLA runs the rule as ~15 kernels per layer, among them a batched cuBLAS triangular solve that
walks its n rows one after another; on the H200 at the Qwen3.6-27B shape (48 value heads, head dims 128) the rule
took 35 us per layer at T = 16 and 92 us at T = 65, 30 and 51 us of it the solve (tools/gdn_probe.py,
2026-12-02): 48 layers make that 1.7 and 4.4 ms of a round. The kernel took 13.4 us at T = 16, but 140-194 us
at T = 65 (its blocks run one after another in one program per head, and the unrolled block loops spill
registers), so the hybrid model calls it for trees of up to 16 nodes (`qwen3_5.TREE_RULE_KERNEL_UP_TO`).

One program per (batch row, value head), grid (b, H). Nodes are taken in row blocks of 16, in node order
(parents precede children, so a block's rows depend only on earlier rows and on themselves): for block r,
  1. G of its rows from the ancestor mask (float32 sums);
  2. the right-hand side minus, per earlier block c, A's 16 x 16 tile (r, c) times c's solved [U | W] (`exp` only
     where j is on i's path);
  3. the 16 x 16 diagonal block's inverse by forward substitution (16 steps on a 16 x 16 tile), then one matmul;
  4. v_new and out of the block's rows (earlier blocks' keys, G and v_new read back).
Solved rows go to global scratch (extra outputs, L2-resident) and a CTA barrier separates a block's stores from
the next block's loads. The sequential part is ceil(T / 16) blocks, not T rows, and every tile is 16 x 16 or
16 x K/V (the work grows as the square of the blocks, which is small next to the registers a T x K tile took).

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

from pallas_kernels._dispatch import cdiv, check_knobs, resolve_interpret

MAX_NODES = 128  # every node's keys, values and mask row fit one program; wider trees stay on the XLA path
BLOCK = 16  # node rows per block: Triton's smallest matmul side

_DN = (((1,), (0,)), ((), ()))  # a [m, k] @ [k, n]
_DN_T = (((1,), (1,)), ((), ()))  # a [m, k] @ b[n, k]^T


def supports(t: int, key_dim: int, value_dim: int) -> bool:
    """Whether the kernel takes T nodes with these head dims (1 <= T <= MAX_NODES; powers of two >= 16)."""
    return 1 <= t <= MAX_NODES and all(d >= 16 and not d & (d - 1) for d in (key_dim, value_dim))


@dataclasses.dataclass(frozen=True)
class TreeDeltaRuleConfig:
    """Tuning knobs of the kernel (static, hashable).

    num_warps:  Triton's warps per program (one program per batch row and value head). 8: at T = 16 on the H200
                (Qwen3.6-27B shape) 13.4 us per layer against 16.8 with 4 (tools/gdn_probe.py, 2026-12-02).
    num_stages: Triton's software pipelining; 1: the block loop stores and reloads scratch across barriers.
    """

    num_warps: int = 8
    num_stages: int = 1

    def __post_init__(self):
        check_knobs(self, pow2={})


def _kernel(q_ref, k_ref, v_ref, g_ref, beta_ref, vis_ref, s0_ref,  # inputs
            out_ref, vnew_ref, cum_ref, u_ref, w_ref,  # outputs (u, w: scratch)
            *, t: int, precision, interpret: bool):
    f32 = jnp.float32

    def rows_of(ref, rows, ok):  # [n, D] rows of a [T, D] ref; indices clamped (in bounds), masked rows 0
        cols = jnp.arange(ref.shape[-1])
        return plt.load(ref.at[jnp.minimum(rows, t - 1)[:, None], cols[None, :]], mask=ok[:, None], other=0.0)

    # Masked lanes of a store get an out-of-range row: the interpreter drops those writes (a masked lane writing
    # back the old value at a shared clamped row could overwrite a real one); Triton masks them.
    def store_rows(ref, rows, ok, x):
        cols = jnp.arange(ref.shape[-1])
        plt.store(ref.at[jnp.where(ok, rows, t)[:, None], cols[None, :]], x.astype(ref.dtype), mask=ok[:, None])

    def mask_of(rows, cols, ok_rows, ok_cols):  # [n, m] bool: visible[rows, cols]
        clamp = lambda x: jnp.minimum(x, t - 1)  # noqa: E731
        return plt.load(vis_ref.at[clamp(rows)[:, None], clamp(cols)[None, :]],
                        mask=ok_rows[:, None] & ok_cols[None, :], other=0) != 0

    block = jnp.arange(BLOCK)
    within_row, within_col = block[:, None], block[None, :]
    eye = (within_row == within_col).astype(f32)

    def barrier():  # the interpreter runs a program as one sequential program and has no barrier
        if not interpret:
            plt.debug_barrier()

    def dot(a, b, dims=_DN):
        return lax.dot_general(a, b, dims, precision=precision, preferred_element_type=f32)

    def decay(visible, cum_rows, cum_cols):  # L on visible pairs, 0 elsewhere (exp only where visible)
        return jnp.where(visible, jnp.exp(jnp.where(visible, cum_rows[:, None] - cum_cols[None, :], 0.0)), 0.0)

    # Every tile is 16 x 16 or 16 x K/V: blocks of earlier rows are read back one at a time (a [T, K] tile of
    # every node spilled registers: 530 us per layer at T = 65 on the H200, against 13 us at T = 16).
    for r in range(cdiv(t, BLOCK)):
        start = r * BLOCK
        rows = start + block
        ok = rows < t
        q_r = rows_of(q_ref, rows, ok).astype(f32)
        k_r = rows_of(k_ref, rows, ok).astype(f32)
        v_r = rows_of(v_ref, rows, ok).astype(f32)
        beta_r = plt.load(beta_ref.at[jnp.minimum(rows, t - 1)], mask=ok, other=0.0).astype(f32)
        cum_r = jnp.zeros((BLOCK,), f32)  # G_i: g summed over the root path (ancestors are in blocks <= r)
        for c in range(r + 1):
            cols = c * BLOCK + block
            g_c = plt.load(g_ref.at[jnp.minimum(cols, t - 1)], mask=cols < t, other=0.0)
            cum_r += jnp.sum(jnp.where(mask_of(rows, cols, ok, cols < t), g_c[None, :], 0.0), axis=1)
        kb_r = k_r * beta_r[:, None]
        rhs_u = v_r * beta_r[:, None]  # [16, V]
        rhs_w = kb_r * jnp.exp(cum_r)[:, None]  # [16, K]
        for c in range(r):  # the right-hand side minus A's columns of earlier (solved) blocks
            cols = c * BLOCK + block
            all_ok = cols < t
            k_c = rows_of(k_ref, cols, all_ok).astype(f32)
            cum_c = plt.load(cum_ref.at[cols], mask=all_ok, other=0.0)
            a_rc = dot(kb_r, k_c, _DN_T) * decay(mask_of(rows, cols, ok, all_ok), cum_r, cum_c)  # [16, 16]
            rhs_u = rhs_u - dot(a_rc, u_ref[pl.ds(c * BLOCK, BLOCK), :])
            rhs_w = rhs_w - dot(a_rc, w_ref[pl.ds(c * BLOCK, BLOCK), :])
        # The diagonal block: (I + D)^-1 by forward substitution (row s is final once the rows above it are
        # subtracted; then every later row subtracts D[:, s] times it).
        visible_d = mask_of(rows, rows, ok, ok)
        strict_d = visible_d & (within_col < within_row)
        d = jnp.where(strict_d, dot(kb_r, k_r, _DN_T) * decay(strict_d, cum_r, cum_r), 0.0)  # [16, 16]
        inv = eye
        for s in range(BLOCK):
            row_s = jnp.sum(jnp.where(within_row == s, inv, 0.0), axis=0)  # [16]
            col_s = jnp.sum(jnp.where(within_col == s, d, 0.0), axis=1)  # [16]
            inv = inv - jnp.where(within_row > s, col_s[:, None], 0.0) * row_s[None, :]
        u_r = dot(inv, rhs_u)  # [16, V]
        w_r = dot(inv, rhs_w)  # [16, K]
        vnew_r = u_r - dot(w_r, s0_ref[...].astype(f32))  # S0 [K, V] loaded where used: registers are scarce
        u_ref[pl.ds(start, BLOCK), :] = u_r
        w_ref[pl.ds(start, BLOCK), :] = w_r
        store_rows(vnew_ref, rows, ok, vnew_r)
        plt.store(cum_ref.at[jnp.where(ok, rows, t)], cum_r, mask=ok)
        barrier()
        out_r = dot(q_r * jnp.exp(cum_r)[:, None], s0_ref[...].astype(f32))
        for c in range(r):  # (Q K^T * L) v_new over earlier blocks, then this one
            cols = c * BLOCK + block
            all_ok = cols < t
            k_c = rows_of(k_ref, cols, all_ok).astype(f32)
            cum_c = plt.load(cum_ref.at[cols], mask=all_ok, other=0.0)
            intra = dot(q_r, k_c, _DN_T) * decay(mask_of(rows, cols, ok, all_ok), cum_r, cum_c)
            out_r += dot(intra, rows_of(vnew_ref, cols, all_ok))
        out_r += dot(dot(q_r, k_r, _DN_T) * decay(visible_d, cum_r, cum_r), vnew_r)
        store_rows(out_ref, rows, ok, out_r)


@functools.partial(jax.jit, static_argnames=("precision", "config", "interpret", "debug"))
def tree_delta_rule_pallas(q, k, v, g, beta, initial_state, visible, *, precision: str = "highest",
                           config: TreeDeltaRuleConfig | None = None, interpret: bool = False, debug: bool = False):
    """q, k [b, T, Hk, K] (Hk divides H: value head h reads key head h // (H / Hk)), v [b, T, H, V], g and beta
    [b, T, H], initial_state [b, H, K, V], visible [b, T, T] bool; all but visible float32 (q, k, v may be
    lower precision: they are widened). T <= MAX_NODES; K, V powers of two >= 16.
    Returns (out [b, T, H, V], v_new [b, T, H, V], G [b, T, H]), float32: `tree_gated_delta_rule`'s out,
    written values and root-path log decays. precision: the matmuls' ("highest": float32 products; "default":
    the GPU's tensor-core float32 (TF32), as XLA's float32 dots at the default precision)."""
    config = TreeDeltaRuleConfig() if config is None else config
    b, t, hk, dk = q.shape
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
    rows = cdiv(t, BLOCK) * BLOCK
    if precision not in ("highest", "default"):
        raise ValueError(f"precision={precision!r}: expected 'highest' or 'default'")
    kernel = functools.partial(_kernel, t=t, precision=lax.Precision[precision.upper()], interpret=interpret)
    key_spec = pl.BlockSpec((None, t, None, dk), lambda i, j: (i, 0, j // group, 0))
    head_rows = lambda dim: pl.BlockSpec((None, t, None, dim), lambda i, j: (i, 0, j, 0))  # noqa: E731
    per_node = pl.BlockSpec((None, t, None), lambda i, j: (i, 0, j))
    scratch = lambda dim: pl.BlockSpec((None, None, rows, dim), lambda i, j: (i, j, 0, 0))  # noqa: E731
    out, v_new, cum, _, _ = pl.pallas_call(
        kernel,
        grid=(b, h),
        in_specs=[key_spec, key_spec, head_rows(dv), per_node, per_node,
                  pl.BlockSpec((None, t, t), lambda i, j: (i, 0, 0)),
                  pl.BlockSpec((None, None, dk, dv), lambda i, j: (i, j, 0, 0))],
        out_specs=[head_rows(dv), head_rows(dv), per_node, scratch(dv), scratch(dk)],
        out_shape=[jax.ShapeDtypeStruct((b, t, h, dv), jnp.float32), jax.ShapeDtypeStruct((b, t, h, dv), jnp.float32),
                   jax.ShapeDtypeStruct((b, t, h), jnp.float32),
                   jax.ShapeDtypeStruct((b, h, rows, dv), jnp.float32),
                   jax.ShapeDtypeStruct((b, h, rows, dk), jnp.float32)],
        compiler_params=plt.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages),
        interpret=interpret,
        debug=debug,
        name="tree_delta_rule",
    )(q, k, v, g.astype(jnp.float32), beta.astype(jnp.float32), visible.astype(jnp.int8),
      initial_state.astype(jnp.float32))
    return out, v_new, cum


def tree_delta_rule(q, k, v, g, beta, initial_state, visible, *, precision: str = "highest",
                    config: TreeDeltaRuleConfig | None = None, interpret: bool | None = None):
    """`tree_delta_rule_pallas`, interpreted where there is no GPU (interpret None). The reference is the
    application's `qwen3_5.tree_gated_delta_rule`, which the model calls for trees wider than MAX_NODES."""
    return tree_delta_rule_pallas(q, k, v, g, beta, initial_state, visible, precision=precision, config=config,
                                  interpret=resolve_interpret(interpret))
