"""Qwen3.5/3.6 hybrid target (HF `model_type: qwen3_5` / `qwen3_5_text`) as Flax NNX modules and a pure
forward function.

Layers are either Gated DeltaNet ("linear_attention": a causal depthwise conv and a gated delta-rule
recurrence, with a per-row `RecurrentState`) or gated full attention ("full_attention": GQA over the KV cache,
partial RoPE, output times sigmoid(gate)). The module tree mirrors HF's `Qwen3_5ForCausalLM`, so the NNX state
path of every parameter is its HF name in a `qwen3_5_text` checkpoint
('model.layers.0.linear_attn.in_proj_qkv.weight', ...), except the full attention's q|k|v and the MLP's
gate|up, packed (`layers.PackedProjections`; `ModelParams.flat` gives HF's tensors); `checkpoint.py` maps the
`qwen3_5` layout ('model.language_model.…') onto these names.

Dimension letters: b batch, t new tokens, e hidden, n KV heads, d head dim, H value heads of a GDN layer
(its Hk key heads are repeated to them), K/V key/value head dims of a GDN layer, C conv channels, c chunk.
Every RMSNorm is zero-centred (`x / rms(x) * (1 + w)`, weight init 0) except the GDN output norm (gated:
`w * x / rms(x) * silu(z)`, weight init 1).

Tensor parallelism (`parallel.py`, the mesh in `Runtime.tp_mesh`): the attention and MLP weights carry the
Megatron axes of qwen3.py (q_proj's per-head [query | gate] rows split with their heads). A GDN layer splits
by key heads, each with its value heads (value head h reads key head h // (H / Hk)): in_proj_qkv and the
conv on their channels, z/b/a, A_log, dt_bias, the recurrent state and the per-node records by value heads,
out_proj on its input features, so one all-reduce follows it. The channels are [q (Hk x K) | k (Hk x K) |
v (H x V)], and a sharded array is split in contiguous blocks: a device's rows of in_proj_qkv (and conv
channels, and conv window) are a contiguous 1/N of C, not its heads' q, k and v. No reshape of [q | k | v]
makes them one block when H > Hk, and reordering the rows at load would make the parameters differ from
the checkpoint's tensors of the same names; so the conv runs on the contiguous blocks, and one all-gather
of its output (b x t x C activations) per layer re-lays them by heads.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from ddtree_jax.cache import HybridCache, KVCache, NodeStates, PendingKV, RecurrentState, write_pending
from ddtree_jax.config import FULL_ATTENTION, Qwen3_5Config
from ddtree_jax.models import qwen3
from ddtree_jax.models.contract import ForwardMeta, ForwardOut, Runtime
from ddtree_jax.models.layers import (Embedding, Linear, PackedProjections, Part, SwiGLU, add_and_norm, apply_rope,
                                      cached_attention, param, rope_cos_sin)
from ddtree_jax.models.params import ModelParams, abstract_params, random_params
from ddtree_jax.parallel import MODEL_AXIS
from pallas_kernels import tree_delta_rule as tree_rule_kernel

RECURRENT = True  # the cache is a HybridCache: K/V beside a recurrent state per Gated DeltaNet layer
CHUNK = 64  # tokens per chunk of the chunked (WY) delta rule, as HF
BLOCKED_SOLVE_ABOVE = 128  # systems larger than this are solved by blocks (`unit_lower_solve`)


# ----------------------------------------------------------------------------------------------------
# Delta rule: pure jnp, float32


def unit_lower_solve(system: jax.Array, rhs: jax.Array) -> jax.Array:
    """x with system @ x = rhs: system [..., n, n] unit lower triangular (its diagonal and upper part are not
    read), rhs [..., n, m] -> [..., n, m] float32.

    On the GPU, `jax.lax.linalg.triangular_solve`. On the CPU, forward substitution in XLA ops, one row per
    step: jaxlib 0.10.2's LAPACK solve splits a large batch into tasks on XLA's intra-op thread pool and
    blocks its pool thread until they are done, so when the devices of a host mesh solve at once they can
    hold every pool thread (2 on a 2-core machine) and wait forever (seen with 2 and 4 forced devices;
    jaxlib 0.11.2 builds without that path). Both agree to float32 rounding. Above BLOCKED_SOLVE_ABOVE rows
    (trees of B >= 128), `blocked_unit_lower_solve` with 32-row blocks: on the
    H200 at the Qwen3.6-27B shape, T = 257, it took 143 us per layer against the triangular solve's 228
    (tools/gdn_probe.py, 2026-12-02).
    """
    if system.shape[-1] > BLOCKED_SOLVE_ABOVE:
        return blocked_unit_lower_solve(system, rhs, 32)
    return _direct_solve(system, rhs)


def _direct_solve(system: jax.Array, rhs: jax.Array) -> jax.Array:
    def substitute(system, rhs):
        n = system.shape[-1]

        def row(i, x):  # x_i = rhs_i - sum over j < i of system_ij x_j (rows >= i of x are still 0)
            a = jnp.where(jnp.arange(n) < i, jax.lax.dynamic_index_in_dim(system, i, -2, keepdims=False), 0.0)
            x_i = jax.lax.dynamic_index_in_dim(rhs, i, -2, keepdims=False) - jnp.einsum("...j,...jm->...m", a, x)
            return jax.lax.dynamic_update_index_in_dim(x, x_i, i, -2)

        return jax.lax.fori_loop(0, n, row, jnp.zeros_like(rhs))

    def lapack(system, rhs):
        return jax.lax.linalg.triangular_solve(system, rhs, left_side=True, lower=True, unit_diagonal=True)

    return jax.lax.platform_dependent(system, rhs, cpu=substitute, default=lapack)


def blocked_unit_lower_solve(system: jax.Array, rhs: jax.Array, block: int = 16) -> jax.Array:
    """`unit_lower_solve` by blocks of `block` rows: the diagonal blocks' inverses in one batched solve against
    the identity, then block row after block row X_r = D_r^-1 (rhs_r - A[r, :r] X[:r]) as matmuls.

    system [..., n, n], rhs [..., n, m] -> [..., n, m]; n is padded to whole blocks (identity rows, zero
    right-hand sides). Why: a batched triangular solve runs its n rows one after another."""
    n, m = system.shape[-1], rhs.shape[-1]
    nb = -(-n // block)
    pad = nb * block - n
    batch = system.shape[:-2]
    if pad:
        system = jnp.pad(system, [(0, 0)] * len(batch) + [(0, pad), (0, pad)])
        system = system + jnp.diag(jnp.arange(nb * block) >= n).astype(system.dtype)
        rhs = jnp.pad(rhs, [(0, 0)] * len(batch) + [(0, pad), (0, 0)])
    diag = jnp.stack([system[..., r * block:(r + 1) * block, r * block:(r + 1) * block] for r in range(nb)], -3)
    eye = jnp.broadcast_to(jnp.eye(block, dtype=system.dtype), diag.shape)
    inverse = _direct_solve(diag, eye)
    solved = []
    for r in range(nb):
        rows = slice(r * block, (r + 1) * block)
        b_r = rhs[..., rows, :]
        if r:
            b_r = b_r - system[..., rows, :r * block] @ jnp.concatenate(solved, axis=-2)
        solved.append(inverse[..., r, :, :] @ b_r)
    return jnp.concatenate(solved, axis=-2)[..., :n, :m]


def recurrent_gated_delta_rule(q, k, v, g, beta, initial_state):
    """The gated delta rule one token at a time.

    Args:
      q, k:  [b, t, H, K] float32; k L2-normalised, q L2-normalised and scaled by K ** -0.5.
      v:     [b, t, H, V] float32.
      g:     [b, t, H] float32 log decay (<= 0); beta: [b, t, H] float32 write strength in [0, 1].
             A token with g = 0 and beta = 0 leaves the state unchanged.
      initial_state: [b, H, K, V] float32.
    Returns:
      out [b, t, H, V] float32 (o_t = S_t^T q_t) and the final state [b, H, K, V] float32, where
      S_t = exp(g_t) S_{t-1} + k_t (beta_t (v_t - (exp(g_t) S_{t-1})^T k_t))^T.
    """
    def step(state, x):
        q_t, k_t, v_t, g_t, b_t = x  # [b, H, K], [b, H, K], [b, H, V], [b, H], [b, H]
        state = state * jnp.exp(g_t)[..., None, None]
        memory = jnp.einsum("bhkv,bhk->bhv", state, k_t)
        delta = (v_t - memory) * b_t[..., None]
        state = state + k_t[..., :, None] * delta[..., None, :]
        return state, jnp.einsum("bhkv,bhk->bhv", state, q_t)

    xs = tuple(jnp.moveaxis(x, 1, 0) for x in (q, k, v, g, beta))
    state, out = jax.lax.scan(step, initial_state, xs)
    return jnp.moveaxis(out, 0, 1), state


def tree_gated_delta_rule(q, k, v, g, beta, initial_state, visible, solve=None):
    """The gated delta rule over the nodes of a tree, all nodes at once (the chunked WY form of
    `chunk_gated_delta_rule` with the tree's ancestor relation in place of causal order).

    Node i's recurrence runs along its root path P(i) (the nodes `visible[i]` marks, itself included),
    starting from `initial_state`: its state is its parent's advanced over node i. With G_i the log decay
    summed along P(i) and L_ij = exp(G_i - G_j) for j in P(i) (0 elsewhere), the rows u and w solve
    (I + strict(diag(beta) K K^T * L)) [u | w] = [diag(beta) V | diag(beta exp(G)) K] (lower triangular in
    node order, since parents precede children); v_new = u - w S0 is what each node writes, and
    out = (q exp(G)) S0 + (Q K^T * L) v_new. Node i's state is never formed: it is
    exp(G_i) S0 + sum over j in P(i) of exp(G_i - G_j) k_j v_new_j^T (`cache.path_state`), so a verify
    keeps, per node, a key, a value and a log decay instead of a Hv x Dk x Dv state. A chain is the tree whose
    root paths are prefixes; a padding node that sees only itself starts from `initial_state`.

    Args:
      q, k, v, g, beta, initial_state: as `recurrent_gated_delta_rule`, with t = T nodes.
      visible: [b, T, T] bool, visible[i, j] = node j is on node i's root path (the verify's ancestor mask).
      solve: what solves the unit lower triangular system (None: `unit_lower_solve`; tools/gdn_probe.py times
        others).
    Returns:
      out [b, T, H, V] float32, and per node its key k [b, T, H, K], written value v_new [b, T, H, V] and
      root-path log decay G [b, T, H] (float32), from which `cache.path_state` forms any node's state.
    """
    t = k.shape[1]
    f32 = jnp.float32
    q, k, v = (jnp.moveaxis(x, 2, 1) for x in (q, k, v))  # [b, H, T, ...]
    g, beta = jnp.moveaxis(g, 2, 1), jnp.moveaxis(beta, 2, 1)  # [b, H, T]
    on_path = visible[:, None]  # [b, 1, T, T]
    cum = jnp.einsum("bij,bhj->bhi", visible.astype(f32), g)  # G_i
    # exp only where j is on i's path (elsewhere G_i - G_j can be large and positive).
    decay = jnp.where(on_path, jnp.exp(jnp.where(on_path, cum[..., :, None] - cum[..., None, :], 0.0)), 0.0)
    k_beta = k * beta[..., None]
    strict = on_path & ~jnp.eye(t, dtype=bool)
    system = jnp.where(strict, jnp.einsum("bhik,bhjk->bhij", k_beta, k) * decay, 0.0) + jnp.eye(t, dtype=f32)
    rhs = jnp.concatenate([v * beta[..., None], k_beta * jnp.exp(cum)[..., None]], axis=-1)
    solved = (unit_lower_solve if solve is None else solve)(system, rhs)
    dv = v.shape[-1]
    u, w = solved[..., :dv], solved[..., dv:]
    v_new = u - jnp.einsum("bhtk,bhkv->bhtv", w, initial_state)
    intra = jnp.einsum("bhik,bhjk->bhij", q, k) * decay
    out = jnp.einsum("bhtk,bhkv->bhtv", q * jnp.exp(cum)[..., None], initial_state) \
        + jnp.einsum("bhij,bhjv->bhiv", intra, v_new)
    back = lambda x: jnp.moveaxis(x, 1, 2)  # noqa: E731 - [b, H, T, ...] -> [b, T, H, ...]
    return back(out), back(k), back(v_new), back(cum)


def chunk_gated_delta_rule(q, k, v, g, beta, initial_state, chunk_size: int = CHUNK):
    """The gated delta rule over chunks of `chunk_size` tokens (the WY/UT form): same arguments and results
    as `recurrent_gated_delta_rule`, equal up to float rounding.

    Inside a chunk, with G_i the cumulative log decay up to token i and L_ij = exp(G_i - G_j) for j <= i
    (0 above the diagonal), the rows u (corrected values) and w (decayed keys reading the old state) solve
    (I + strict_lower(diag(beta) K K^T * L)) [u | w] = [diag(beta) V | diag(beta exp(G)) K]; then
    v_new = u - w S, out = (q exp(G)) S + (Q K^T * L) v_new, S' = exp(G_last) S + (K exp(G_last - G))^T v_new.
    The sequence is padded with g = beta = 0 tokens (which change nothing) to whole chunks.
    """
    b, t, h, dk = k.shape
    dv = v.shape[-1]
    pad = -t % chunk_size
    n = (t + pad) // chunk_size

    def chunks(x):  # [b, t, H, ...] -> [n, b, H, c, ...]
        x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        x = x.reshape(b, n, chunk_size, *x.shape[2:])
        return jnp.moveaxis(jnp.moveaxis(x, 3, 2), 1, 0)

    q, k, v, g, beta = (chunks(x) for x in (q, k, v, g, beta))  # q,k [n,b,H,c,K]; v [n,b,H,c,V]; g,beta [n,b,H,c]
    cum = jnp.cumsum(g, axis=-1)
    lower = jnp.tril(jnp.ones((chunk_size, chunk_size), bool))  # j <= i
    decay = jnp.exp(jnp.where(lower, cum[..., :, None] - cum[..., None, :], -jnp.inf))  # [n,b,H,c,c]
    k_beta = k * beta[..., None]
    system = jnp.einsum("...ik,...jk->...ij", k_beta, k) * decay
    system = jnp.where(jnp.tril(lower, -1), system, 0.0) + jnp.eye(chunk_size, dtype=system.dtype)
    rhs = jnp.concatenate([v * beta[..., None], k_beta * jnp.exp(cum)[..., None]], axis=-1)
    solved = unit_lower_solve(system, rhs)
    u, w = solved[..., :dv], solved[..., dv:]
    intra = jnp.einsum("...ik,...jk->...ij", q, k) * decay
    q_decayed = q * jnp.exp(cum)[..., None]
    last = cum[..., -1:]
    k_decayed = k * jnp.exp(last - cum)[..., None]

    def step(state, x):
        u_i, w_i, q_i, k_i, intra_i, last_i = x
        v_new = u_i - jnp.einsum("bhck,bhkv->bhcv", w_i, state)
        out = jnp.einsum("bhck,bhkv->bhcv", q_i, state) + jnp.einsum("bhij,bhjv->bhiv", intra_i, v_new)
        state = state * jnp.exp(last_i)[..., None] + jnp.einsum("bhck,bhcv->bhkv", k_i, v_new)
        return state, out

    state, out = jax.lax.scan(step, initial_state, (u, w, q_decayed, k_decayed, intra, last))
    out = jnp.moveaxis(out, 0, 1)  # [b, n, H, c, V]
    out = jnp.moveaxis(out, 2, 3).reshape(b, n * chunk_size, h, dv)[:, :t]
    return out, state


# ----------------------------------------------------------------------------------------------------
# Modules


class ZeroCenteredRMSNorm(nnx.Module):
    """HF `Qwen3_5RMSNorm`: `x / rms(x) * (1 + w)` in float32, then cast to x's dtype (weight init 0)."""

    kind = "zero_centered"  # `pallas_kernels.rms_norm`'s name for this scaling

    def __init__(self, dim: int, eps: float, axis_name: str = "embed", *, dtype):
        self.weight = param(None, (dim,), dtype, (axis_name,), "zeros")
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (normed * (1.0 + self.weight[...].astype(jnp.float32))).astype(x.dtype)


class GatedRMSNorm(nnx.Module):
    """HF `Qwen3_5RMSNormGated`: `w * (x / rms(x)) * silu(z)` per head (weight init 1)."""

    def __init__(self, dim: int, eps: float, *, dtype):
        self.weight = param(None, (dim,), dtype, ("linear_head_dim",), "ones")
        self.eps = eps

    def __call__(self, x: jax.Array, z: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        normed = (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)).astype(x.dtype)
        scaled = (self.weight[...].astype(x.dtype) * normed).astype(jnp.float32)
        return (scaled * jax.nn.silu(z.astype(jnp.float32))).astype(x.dtype)


class DepthwiseConv(nnx.Module):
    """HF `nn.Conv1d(C, C, K, groups=C, bias=False)`: weight [C, 1, K]."""

    def __init__(self, channels: int, kernel: int, key_heads: int, *, dtype, rngs):
        self.weight = param(rngs, (channels, 1, kernel), dtype, ("linear_conv", None, None), "normal", key_heads)


class GatedAttention(nnx.Module):
    """Full attention with an output gate: q_proj gives per head [query | gate]; q/k norms, partial RoPE."""

    def __init__(self, config: Qwen3_5Config, *, dtype, rngs):
        e, d, h, n = config.hidden_size, config.head_dim, config.num_heads, config.num_kv_heads
        # q_proj's rows are per head [query | gate] (two units of d), so a split into whole heads (here whole KV
        # groups of q|k|v) keeps each head's gate with it.
        parts = (Part("q_proj", 2 * (h // n), ("q_heads", "embed"), h), Part("k_proj", 1, ("kv_heads", "embed"), n),
                 Part("v_proj", 1, ("kv_heads", "embed"), n))
        self.qkv_proj = PackedProjections(e, n, d, parts, ("kv_heads", None, None, "embed"), dtype=dtype, rngs=rngs)
        self.o_proj = Linear(h * d, e, ("embed", "q_heads"), dtype=dtype, rngs=rngs, groups=h)
        self.q_norm = ZeroCenteredRMSNorm(d, config.rms_norm_eps, "head_dim", dtype=dtype)
        self.k_norm = ZeroCenteredRMSNorm(d, config.rms_norm_eps, "head_dim", dtype=dtype)
        self.head_dim, self.rotary_dim = d, config.rotary_dim

    def _rope(self, x, cos, sin):
        """Rotate the first rotary_dim dims of each head (pairs (i, i + rotary_dim/2)); pass the rest."""
        r = self.rotary_dim
        return jnp.concatenate([apply_rope(x[..., :r], cos, sin), x[..., r:]], axis=-1)

    def project(self, x, cos, sin, runtime: Runtime):
        """x [b, t, e], cos/sin [b, t, rotary_dim] -> q [b, t, n*g, d] (normed, rotated), gate [b, t, n*g*d],
        k [b, t, n, d] (normed, rotated), v [b, t, n, d]."""
        b, t, _ = x.shape
        d = self.head_dim
        q_gate, k, v = self.qkv_proj(x, runtime)
        q_gate = q_gate.reshape(b, t, -1, 2 * d)
        q, gate = q_gate[..., :d], q_gate[..., d:].reshape(b, t, -1)
        q = self._rope(self.q_norm(q), cos, sin)
        k = self._rope(self.k_norm(k.reshape(b, t, -1, d)), cos, sin)
        return q, gate, k, v.reshape(b, t, -1, d)

    def output(self, attended, gate, runtime: Runtime):
        """attended [b, t, n*g, d], gate [b, t, n*g*d] -> o_proj(attended * sigmoid(gate)) [b, t, e]."""
        b, t = attended.shape[:2]
        return self.o_proj(attended.reshape(b, t, -1) * jax.nn.sigmoid(gate), runtime)

    def __call__(self, x, cos, sin, k_cache, v_cache, cache_lengths, meta: ForwardMeta, *, runtime: Runtime):
        """x [b, t, e], cos/sin [b, t, rotary_dim] -> (out [b, t, e], k_new [b, t, n, d], v_new [b, t, n, d])."""
        q, gate, k, v = self.project(x, cos, sin, runtime)
        out = cached_attention(q, k_cache, v_cache, cache_lengths, k, v, meta.new_mask, meta.positions,
                               scale=self.head_dim ** -0.5, runtime=runtime)
        return self.output(out, gate, runtime), k, v


def _tree_rule_kernel(q, k, v, g, beta, initial_state, visible, *, precision: str, mesh: jax.sharding.Mesh | None):
    """`tree_gated_delta_rule`'s out, written values and log decays by the Pallas kernel
    (`pallas_kernels.tree_delta_rule`), q and k by key head [b, t, Hk, K]. Under tensor parallelism (`mesh`, whose
    size divides the key heads) it runs under `shard_map` on each device's key heads and their value heads."""
    rule = functools.partial(tree_rule_kernel.tree_delta_rule, precision=precision)
    if mesh is None:
        return rule(q, k, v, g, beta, initial_state, visible)
    heads, per_node, state_heads = P(None, None, MODEL_AXIS, None), P(None, None, MODEL_AXIS), P(None, MODEL_AXIS)
    sharded = jax.shard_map(rule, mesh=mesh, in_specs=(heads, heads, heads, per_node, per_node, state_heads, P()),
                            out_specs=(heads, heads, per_node), check_vma=False)
    return sharded(q, k, v, g, beta, initial_state, visible)


def _pin(x: jax.Array, axis: int | None, *, mesh: jax.sharding.Mesh | None) -> jax.Array:
    """x with its `axis` split over the tp mesh (None: whole on every device); x as it is without a mesh (one
    device, dp, or key heads that do not divide)."""
    if mesh is None:
        return x
    spec = [None] * x.ndim
    if axis is not None:
        spec[axis] = MODEL_AXIS
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P(*spec)))


class GatedDeltaNet(nnx.Module):
    """HF `Qwen3_5GatedDeltaNet`: in_proj_qkv -> causal depthwise conv + SiLU -> gated delta rule ->
    gated RMSNorm with in_proj_z -> out_proj."""

    def __init__(self, config: Qwen3_5Config, *, dtype, rngs):
        e, hv, conv = config.hidden_size, config.linear_num_value_heads, config.linear_conv_dim
        # Under tp every split axis is made of hk whole groups (a key head and its value heads): all split or
        # none (`parallel.Parallel.param_spec`), and a device's value heads are those of its key heads.
        hk, vd = config.linear_num_key_heads, config.linear_value_dim
        self.in_proj_qkv = Linear(e, conv, ("linear_conv", "embed"), dtype=dtype, rngs=rngs, groups=hk)
        self.in_proj_z = Linear(e, vd, ("linear_value", "embed"), dtype=dtype, rngs=rngs, groups=hk)
        self.in_proj_b = Linear(e, hv, ("linear_heads", "embed"), dtype=dtype, rngs=rngs, groups=hk)
        self.in_proj_a = Linear(e, hv, ("linear_heads", "embed"), dtype=dtype, rngs=rngs, groups=hk)
        self.conv1d = DepthwiseConv(conv, config.linear_conv_kernel, hk, dtype=dtype, rngs=rngs)
        self.A_log = param(None, (hv,), dtype, ("linear_heads",), "zeros", hk)
        self.dt_bias = param(None, (hv,), dtype, ("linear_heads",), "ones", hk)
        self.norm = GatedRMSNorm(config.linear_value_head_dim, config.rms_norm_eps, dtype=dtype)
        self.out_proj = Linear(vd, e, ("embed", "linear_value"), dtype=dtype, rngs=rngs, groups=hk)
        self.key_heads = hk
        self.key_dim, self.value_dim = config.linear_key_dim, config.linear_value_dim
        self.key_head_dim, self.value_head_dim = config.linear_key_head_dim, config.linear_value_head_dim

    def __call__(self, x: jax.Array, state: RecurrentState, valid: jax.Array, parents: jax.Array | None = None,
                 depths: jax.Array | None = None, visible: jax.Array | None = None, *, runtime: Runtime = Runtime(),
                 ) -> tuple[jax.Array, RecurrentState, NodeStates | None]:
        """x [b, t, e]; valid [b] int, real tokens per row (the rest are right padding and leave the state
        alone) -> (out [b, t, e], the state advanced over each row's valid tokens, None).

        Tree mode (parents [b, t], depths [b, t] and visible [b, t, t], the ancestor mask, given; the t tokens
        are the nodes of a tree hanging below the committed tokens, parents before children): each node's
        conv window is made of its ancestors' inputs (the committed window above the root) and its
        recurrence continues its parent's (the committed state for depth 0; `tree_gated_delta_rule`).
        Returns (out, the committed state unchanged, NodeStates with what forms any node's state, and every
        node's conv input) so that the caller installs an accepted node's.

        runtime.tp_mesh: split the layer by key heads over it (when they divide; module docstring).
        """
        b, t, _ = x.shape
        kernel = self.conv1d.weight.shape[-1]
        tree = parents is not None
        mesh = runtime.tp_mesh
        if mesh is not None and self.key_heads % mesh.size:
            mesh = None  # the key heads do not divide: the weights are whole on every device, and so is all this
        pin = functools.partial(_pin, mesh=mesh)

        # Causal depthwise conv over [window | new inputs]; the new window is each row's last K-1 real inputs.
        mixed = pin(self.in_proj_qkv(x, runtime), 2)  # [b, t, C]; tp: in the weight's contiguous blocks of channels
        window_in = jnp.swapaxes(state.conv, 1, 2).astype(mixed.dtype)  # [b, K-1, C], oldest first
        w = self.conv1d.weight[...][:, 0, :].astype(jnp.float32)  # [C, K]
        if tree:
            # The input `back` steps up the root path of every node: ancestor node `back` levels up while
            # depth - back >= 0, else slot K-1 + depth - back of the committed window.
            ancestors, node = [], jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
            for _ in range(kernel):
                ancestors.append(node)
                node = jnp.take_along_axis(parents, node, axis=1)
            conv = 0.0
            for j in range(kernel):  # weight tap j reads the input kernel - 1 - j steps back (oldest first)
                back = kernel - 1 - j
                from_nodes = jnp.take_along_axis(mixed, ancestors[back][..., None], axis=1)
                slot = jnp.clip(kernel - 1 + depths - back, 0, kernel - 2)
                from_window = jnp.take_along_axis(window_in, slot[..., None], axis=1)
                src = jnp.where((depths >= back)[..., None], from_nodes, from_window)
                conv = conv + src.astype(jnp.float32) * w[:, j]
            new_conv = state.conv
        else:
            full = jnp.concatenate([window_in, mixed], axis=1)  # [b, K-1+t, C]
            conv = sum(full[:, j:j + t].astype(jnp.float32) * w[:, j] for j in range(kernel))
            window = jax.vmap(lambda row, n: jax.lax.dynamic_slice_in_dim(row, n, kernel - 1, axis=0))(full, valid)
            new_conv = jnp.swapaxes(window, 1, 2).astype(state.conv.dtype)  # [b, C, K-1]
        pre_conv = mixed
        mixed = jax.nn.silu(conv).astype(x.dtype)
        # tp: the channels are [q | k | v], so a device's heads are three pieces of them, not the contiguous
        # block its weight rows give. One all-gather of these activations gives every device all channels;
        # each then slices its own heads locally (pinning every slice whole first: otherwise XLA moves the
        # pieces with one collective-permute each).
        mixed = pin(mixed, None)

        f32 = jnp.float32

        def heads(start: int, stop: int, head_dim: int) -> jax.Array:  # [b, t, heads, head_dim], split by heads
            return pin(pin(mixed[..., start:stop], None).reshape(b, t, -1, head_dim), 2).astype(f32)

        q = heads(0, self.key_dim, self.key_head_dim)
        k = heads(self.key_dim, 2 * self.key_dim, self.key_head_dim)
        v = heads(2 * self.key_dim, mixed.shape[-1], self.value_head_dim)
        q = q * jax.lax.rsqrt(jnp.sum(q * q, axis=-1, keepdims=True) + 1e-6) * self.key_head_dim ** -0.5
        k = k * jax.lax.rsqrt(jnp.sum(k * k, axis=-1, keepdims=True) + 1e-6)
        repeat = v.shape[2] // k.shape[2]  # value head h reads key head h // repeat (HF repeat_interleave)
        q_keyed, k_keyed = q, k  # [b, t, Hk, K]: the kernel reads key head h // repeat itself
        q, k = pin(jnp.repeat(q, repeat, axis=2), 2), pin(jnp.repeat(k, repeat, axis=2), 2)
        beta = jax.nn.sigmoid(self.in_proj_b(x, runtime)).astype(f32)  # [b, t, H]
        g = -jnp.exp(self.A_log[...].astype(f32)) * jax.nn.softplus(self.in_proj_a(x, runtime).astype(f32)
                                                                       + self.dt_bias[...].astype(f32))
        nodes = None
        if tree:
            # The Pallas kernel wherever it takes the tree: on the H200 at the Qwen3.6-27B shape 7 us per layer at
            # T = 16, 13-16 at T = 17, 37-44 at T = 65 and 94 at T = 128 against XLA's 35, 38-40, 90-97 and
            # 120-137 (tools/gdn_probe.py and the bench's traces, 2026-12-02 and 04); wider trees take the jnp WY
            # form.
            if runtime.pallas and tree_rule_kernel.supports(t, self.key_head_dim, self.value_head_dim):
                precision = "highest" if x.dtype == jnp.float32 else "default"
                core, values, log_decay = _tree_rule_kernel(q_keyed, k_keyed, v, g, beta, state.state, visible,
                                                            precision=precision, mesh=mesh)
                keys = k
            else:
                core, keys, values, log_decay = tree_gated_delta_rule(q, k, v, g, beta, state.state, visible)
            new_state = state.state
            nodes = NodeStates(keys=pin(keys, 2), values=pin(values, 2), log_decay=pin(log_decay, 2),
                               inputs=pin(pre_conv.astype(state.conv.dtype), 2))
        else:
            is_valid = jnp.arange(t)[None, :] < valid[:, None]  # [b, t]
            beta, g = jnp.where(is_valid[..., None], beta, 0.0), jnp.where(is_valid[..., None], g, 0.0)
            rule = recurrent_gated_delta_rule if t == 1 else chunk_gated_delta_rule
            core, new_state = rule(q, k, v, g, beta, state.state)
        core = self.norm(core.astype(x.dtype), self.in_proj_z(x, runtime).reshape(b, t, -1, self.value_head_dim))
        out = self.out_proj(core.reshape(b, t, -1), runtime)
        return out, RecurrentState(state=new_state, conv=new_conv), nodes


class DecoderLayer(nnx.Module):
    def __init__(self, config: Qwen3_5Config, layer_type: str, *, dtype, rngs):
        self.input_layernorm = ZeroCenteredRMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype)
        if layer_type == FULL_ATTENTION:
            self.self_attn = GatedAttention(config, dtype=dtype, rngs=rngs)
        else:
            self.linear_attn = GatedDeltaNet(config, dtype=dtype, rngs=rngs)
        self.post_attention_layernorm = ZeroCenteredRMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype)
        self.mlp = SwiGLU(config.hidden_size, config.intermediate_size, dtype=dtype, rngs=rngs)


class Qwen3_5Model(nnx.Module):
    def __init__(self, config: Qwen3_5Config, *, dtype, rngs):
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size, dtype=dtype, rngs=rngs)
        self.layers = nnx.List([DecoderLayer(config, kind, dtype=dtype, rngs=rngs) for kind in config.layer_types])
        self.norm = ZeroCenteredRMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype)


class Qwen3_5ForCausalLM(nnx.Module):
    def __init__(self, config: Qwen3_5Config, *, dtype=jnp.bfloat16, rngs: nnx.Rngs):
        self.model = Qwen3_5Model(config, dtype=dtype, rngs=rngs)
        if not config.tie_word_embeddings:
            self.lm_head = Linear(config.hidden_size, config.vocab_size, ("vocab", "embed"), dtype=dtype, rngs=rngs)


# ----------------------------------------------------------------------------------------------------
# Functional API


def build(config: Qwen3_5Config, dtype=jnp.bfloat16):
    return lambda rngs: Qwen3_5ForCausalLM(config, dtype=dtype, rngs=rngs)


def abstract(config: Qwen3_5Config, dtype=jnp.bfloat16) -> ModelParams:
    return abstract_params(build(config, dtype), config)


def init_random(config: Qwen3_5Config, dtype=jnp.bfloat16, seed: int = 0) -> ModelParams:
    return random_params(build(config, dtype), config, seed)


def create_cache(config: Qwen3_5Config, batch: int, capacity: int, dtype) -> HybridCache:
    """Empty caches: K/V for the full-attention layers, zero states for the Gated DeltaNet layers."""
    kv = KVCache.create(len(config.attention_layers), batch, capacity, config.num_kv_heads, config.head_dim, dtype)
    recurrent = tuple(
        RecurrentState.create(batch, config.linear_num_value_heads, config.linear_key_head_dim,
                              config.linear_value_head_dim, config.linear_conv_dim, config.linear_conv_kernel, dtype)
        for _ in config.linear_layers)
    return HybridCache(kv=kv, recurrent=recurrent)


def forward(params: ModelParams, tokens: jax.Array, meta: ForwardMeta, cache: HybridCache, *,
            tap_layers: tuple[int, ...] = (), runtime: Runtime = Runtime()) -> ForwardOut:
    """Run the target on new tokens (the family contract, `models/contract.py`).

    tokens [b, t] int; cache: committed K/V and recurrent states; tap_layers: decoder layer ids whose outputs
    to return (static). meta: positions and the attention layers' mask of the new tokens, and:
    - chain mode (`meta.parents` None): the tokens extend each row's committed sequence; `meta.valid` real
      tokens per row (the rest is right padding that leaves the recurrent states alone). The returned cache
      has every recurrent state advanced over the valid tokens.
    - tree mode (`meta.parents` given, `meta.new_mask` the tree's ancestor mask, node depths =
      `positions - cache.lengths`): each Gated DeltaNet layer runs the tree recurrence
      (`tree_gated_delta_rule`) over every node's root path; the returned cache is the input cache as it was,
      `ForwardOut.nodes` has what forms any node's state (`cache.commit_recurrent`) and `ForwardOut.pending`
      the attention layers' K/V of every node (`cache.commit_pending`).
    """
    config: Qwen3_5Config = params.config
    model = params.module()
    qwen3.check_tap_layers(tap_layers, config.num_layers)
    x = model.model.embed_tokens(tokens)
    cos, sin = rope_cos_sin(meta.positions, config.rope, config.rotary_dim)
    kv, lengths = cache.kv, cache.kv.lengths
    new_k, new_v, new_states, taps = list(kv.k), list(kv.v), list(cache.recurrent), {}
    nodes = [None] * len(cache.recurrent)
    tree = meta.is_tree
    depths = (meta.positions - lengths[:, None]).astype(jnp.int32) if tree else None
    attn_index = {layer: j for j, layer in enumerate(config.attention_layers)}
    linear_index = {layer: j for j, layer in enumerate(config.linear_layers)}
    delta = None  # what the previous layer's MLP adds to the stream: added by the next norm's call
    for i, layer in enumerate(model.model.layers):
        with jax.named_scope(f"layer_{i}"):
            # A full-attention layer's norm feeds q|k|v alone (W8A8 rows from the norm); a Gated DeltaNet's feeds four,
            # two of them unquantised (their two FP8 ones' rows from the norm were no faster on an H100, 2026-12-06).
            x, h = add_and_norm(layer.input_layernorm, x, delta, runtime,
                                into=layer.self_attn.qkv_proj if i in attn_index else None)
            if i - 1 in tap_layers:
                taps[i - 1] = x
            if i in attn_index:
                j = attn_index[i]
                mixed, k, v = layer.self_attn(h, cos, sin, kv.k[j], kv.v[j], lengths, meta, runtime=runtime)
                new_k[j], new_v[j] = (k, v) if tree else (write_pending(kv.k[j], k, lengths),
                                                          write_pending(kv.v[j], v, lengths))
            else:
                j = linear_index[i]
                mixed, new_states[j], nodes[j] = layer.linear_attn(
                    h, cache.recurrent[j], meta.valid, meta.parents, depths, meta.new_mask if tree else None,
                    runtime=runtime)
            x, h = add_and_norm(layer.post_attention_layernorm, x, mixed, runtime, into=layer.mlp.gate_up_proj)
            delta = layer.mlp(h, runtime)
    x, hidden = add_and_norm(model.model.norm, x, delta, runtime)
    if config.num_layers - 1 in tap_layers:
        taps[config.num_layers - 1] = x
    tapped = jnp.concatenate([taps[i] for i in tap_layers], axis=-1) if tap_layers else None
    if tree:  # the round writes the nodes it keeps
        return ForwardOut(hidden=hidden, taps=tapped, cache=cache, pending=PendingKV(k=tuple(new_k), v=tuple(new_v)),
                          nodes=tuple(nodes))
    new_cache = HybridCache(kv=dataclasses.replace(kv, k=tuple(new_k), v=tuple(new_v)), recurrent=tuple(new_states))
    return ForwardOut(hidden=hidden, taps=tapped, cache=new_cache)


# lm_head (or the tied embedding) has the same names as in qwen3.
logits = qwen3.logits
