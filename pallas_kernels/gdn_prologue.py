"""A Gated DeltaNet layer's step between its input projections and the tree delta rule, in one kernel (Pallas,
Triton): the causal depthwise conv over each node's root path, SiLU, the L2 norms of q and k, and the gates.

The contract is the tree branch of `ddtree_jax.models.qwen3_5.GatedDeltaNet` (HF `Qwen3_5GatedDeltaNet` over a
draft tree's nodes): `gdn_prologue_reference` below restates it in plain jnp (kernels never import the
application; the tests hold the two to each other and to the model). Per node i at depth d_i (parents before
children) and channel c of the projection `mixed` [T, C] (channels [q (Hk x K) | k (Hk x K) | v (H x V)]):

    conv[i, c] = sum over taps j = 0 .. W: w[c, j] * src_j,  back = W - j,
    src_j = mixed[ancestor `back` levels up of i, c]    if d_i >= back,
            window[c, W - 1 + d_i - back]                else (the committed inputs above the root, oldest first),
    y = silu(conv) rounded to mixed's dtype,
    q = y_q / sqrt(|y_q|^2 + 1e-6) * K^-1/2 and k = y_k / sqrt(|y_k|^2 + 1e-6) per head, v = y_v (float32),
    beta = sigmoid(b) (in b's dtype), g = -exp(A_log) * softplus(a + dt_bias) (float32) per value head,

with W + 1 taps (the window holds W inputs), a and b the outputs of in_proj_a and in_proj_b [T, H]. The sums run
over the taps in that order, in float32, as the model's (every tap's product added to the sum of the taps
before it).

Why a kernel: XLA ran this as six to eight small kernels per layer at the Qwen3.6-27B shape (the ancestors'
gathers, the conv, the norms as reductions, the gates, slices for the delta rule; 1.0-3.4 us each on an H100,
docs/performance.md, 2026-12-06), 48 layers a verify. Here one program per (batch row, head of 128 channels)
gathers its channels' W + 1 source rows for every node, and the programs of value heads also write their head's
gates: one launch, ~80 programs a row at that shape.

Letters: b batch, T nodes (TP padded to a power of two >= 16), C channels, Hk key heads, H value heads (a
multiple of Hk), K key dim, V value dim (the kernel takes K = V: every program's tile is one head), W + 1 taps.
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

MAX_NODES = 64  # a program's [TP, head dim] tiles in registers (offline for sm_90 at 128 nodes: spills)
NORM_EPS = 1e-6  # the L2 norm's (HF `l2norm`'s eps, added to the squared norm)


def supports(t: int, key_dim: int, value_dim: int) -> bool:
    """Whether the kernel takes T nodes with these head dims: 1 <= T <= MAX_NODES, K = V a power of two >= 16."""
    return 1 <= t <= MAX_NODES and key_dim == value_dim and key_dim >= 16 and not key_dim & (key_dim - 1)


def _kernel(mixed_ref, window_ref, w_ref, parents_ref, depths_ref, a_ref, b_ref, a_log_ref, dt_bias_ref,  # inputs
            q_ref, k_ref, v_ref, g_ref, beta_ref,  # outputs
            *, t: int, taps: int, key_heads: int, head_dim: int, scale: float):
    # One row's refs: mixed [T, C], window [C, W], w [C, W + 1], parents/depths [T], a/b [T, H], A_log/dt_bias [H];
    # q/k [T, Hk * K], v [T, H * V] float32, g/beta [T, H] float32. Program (row, c): channels [c D, (c + 1) D).
    c = pl.program_id(1)
    d, f32 = head_dim, jnp.float32
    cols = c * d + jnp.arange(d, dtype=jnp.int32)
    nodes = jnp.arange(max(16, next_pow2(t)), dtype=jnp.int32)
    ok = nodes < t
    last = jnp.int32(t - 1)
    depth = plt.load(depths_ref.at[jnp.minimum(nodes, last)], mask=ok, other=0)

    def up(_, node):  # one level up the root path (a root's parent is clamped: its reads are masked below)
        return plt.load(parents_ref.at[jnp.clip(node, 0, last)], mask=ok, other=0)

    def tap(j, conv):  # weight tap j reads the input `back` levels up, oldest first; a device loop, so that the
        # taps' gathered [TP, D] tiles are not all live at once (unrolled, Triton issued every load first and
        # spilled at 64 nodes)
        back = taps - 1 - j
        on_path = depth >= back
        node = lax.fori_loop(0, back, up, nodes)
        from_nodes = plt.load(mixed_ref.at[jnp.clip(node, 0, last)[:, None], cols[None, :]],
                              mask=(ok & on_path)[:, None], other=0.0)
        slot = jnp.clip(taps - 1 + depth - back, 0, taps - 2)
        from_window = plt.load(window_ref.at[cols[None, :], slot[:, None]], mask=(ok & ~on_path)[:, None],
                               other=0.0).astype(mixed_ref.dtype)
        src = jnp.where(on_path[:, None], from_nodes, from_window).astype(f32)
        return conv + src * plt.load(w_ref.at[cols, j]).astype(f32)[None, :]

    conv = lax.fori_loop(0, taps, tap, jnp.zeros((nodes.shape[0], d), f32))
    y = jax.nn.silu(conv).astype(mixed_ref.dtype).astype(f32)  # [TP, D]
    rows = jnp.where(ok, nodes, t)  # masked lanes store out of range (dropped; Triton masks them)
    head = cols - c * d

    def unit(x):  # x / sqrt(|x|^2 + eps) per row
        return x * lax.rsqrt(jnp.sum(x * x, axis=1, keepdims=True) + NORM_EPS)

    @pl.when(c < key_heads)
    def _():
        plt.store(q_ref.at[rows[:, None], cols[None, :]], unit(y) * scale, mask=ok[:, None])

    @pl.when((c >= key_heads) & (c < 2 * key_heads))
    def _():
        plt.store(k_ref.at[rows[:, None], (cols - key_heads * d)[None, :]], unit(y), mask=ok[:, None])

    @pl.when(c >= 2 * key_heads)
    def _():
        h = c - 2 * key_heads  # this program's value head
        plt.store(v_ref.at[rows[:, None], (h * d + head)[None, :]], y, mask=ok[:, None])
        clamped = jnp.minimum(nodes, last)
        b_in = plt.load(b_ref.at[clamped, h], mask=ok, other=0.0)
        a_in = plt.load(a_ref.at[clamped, h], mask=ok, other=0.0).astype(f32)
        beta = jax.nn.sigmoid(b_in.astype(f32)).astype(b_ref.dtype).astype(f32)
        decay = -jnp.exp(a_log_ref[h].astype(f32))
        g = decay * jax.nn.softplus(a_in + dt_bias_ref[h].astype(f32))
        plt.store(g_ref.at[rows, h], g, mask=ok)
        plt.store(beta_ref.at[rows, h], beta, mask=ok)


def _warps(t: int) -> int:
    """Warps per program: a program holds [TP, D] tiles (the conv's float32 sum, a gathered source block), so more
    warps for more nodes (offline for sm_90 at the Qwen3.6-27B shape, `tools/triton_offline.py --only gdn_prologue`:
    64-96 registers up to 16 nodes with 4, 174-205 at 64 with 8, no spills; at 128 nodes 16 warps still spilled)."""
    return 4 if t <= 32 else 8


def _check(mixed, window, conv_w, parents, depths, a, b, a_log, dt_bias, key_heads, key_dim, value_dim):
    bsz, t, channels = mixed.shape
    h = a.shape[-1]
    taps = conv_w.shape[-1]
    if channels != 2 * key_heads * key_dim + h * value_dim or h % key_heads:
        raise ValueError(f"mixed [b, T, C] = {mixed.shape}: C must be 2 Hk K + H V = 2 x {key_heads} x {key_dim} + "
                         f"{h} x {value_dim} with Hk dividing H")
    if window.shape != (bsz, channels, taps - 1) or conv_w.shape != (channels, taps) or taps < 2:
        raise ValueError(f"window [b, C, W] = {window.shape} and conv weight [C, W + 1] = {conv_w.shape}: expected "
                         f"{(bsz, channels, taps - 1)} and {(channels, taps)}, W >= 1")
    if parents.shape != (bsz, t) or depths.shape != (bsz, t) or a.shape != (bsz, t, h) or b.shape != (bsz, t, h):
        raise ValueError(f"parents, depths [b, T] = {(bsz, t)}, a, b [b, T, H] = {(bsz, t, h)}; got {parents.shape}, "
                         f"{depths.shape}, {a.shape}, {b.shape}")
    if a_log.shape != (h,) or dt_bias.shape != (h,):
        raise ValueError(f"A_log and dt_bias must be [H] = {(h,)}; got {a_log.shape}, {dt_bias.shape}")
    if not supports(t, key_dim, value_dim):
        raise ValueError(f"T={t} nodes, K={key_dim}, V={value_dim}: the kernel takes 1 <= T <= {MAX_NODES} and K = V, "
                         "a power of two >= 16")


@functools.partial(jax.jit, static_argnames=("key_heads", "key_dim", "value_dim", "interpret", "debug"))
def gdn_prologue_pallas(mixed, window, conv_w, parents, depths, a, b, a_log, dt_bias, *, key_heads: int,
                        key_dim: int, value_dim: int, interpret: bool = False, debug: bool = False):
    """The Pallas kernel; arguments and results as `gdn_prologue_reference`."""
    _check(mixed, window, conv_w, parents, depths, a, b, a_log, dt_bias, key_heads, key_dim, value_dim)
    bsz, t, channels = mixed.shape
    h = a.shape[-1]
    kernel = functools.partial(_kernel, t=t, taps=conv_w.shape[-1], key_heads=key_heads, head_dim=key_dim,
                               scale=key_dim ** -0.5)
    row = lambda *shape: pl.BlockSpec((None, *shape), lambda i, c: (i,) + (0,) * len(shape))  # noqa: E731
    whole = lambda *shape: pl.BlockSpec(shape, lambda i, c: (0,) * len(shape))  # noqa: E731
    f32 = jnp.float32
    q, k, v, g, beta = pl.pallas_call(
        kernel_body(kernel, interpret),
        grid=(bsz, channels // key_dim),
        in_specs=[row(t, channels), row(channels, window.shape[-1]), whole(*conv_w.shape), row(t), row(t), row(t, h),
                  row(t, h), whole(h), whole(h)],
        out_specs=[row(t, key_heads * key_dim), row(t, key_heads * key_dim), row(t, h * value_dim), row(t, h),
                   row(t, h)],
        out_shape=[jax.ShapeDtypeStruct((bsz, t, key_heads * key_dim), f32),
                   jax.ShapeDtypeStruct((bsz, t, key_heads * key_dim), f32),
                   jax.ShapeDtypeStruct((bsz, t, h * value_dim), f32),
                   jax.ShapeDtypeStruct((bsz, t, h), f32), jax.ShapeDtypeStruct((bsz, t, h), f32)],
        compiler_params=plt.CompilerParams(num_warps=_warps(t), num_stages=1),
        interpret=interpret, debug=debug, name="gdn_prologue",
    )(mixed, window, conv_w, parents.astype(jnp.int32), depths.astype(jnp.int32), a, b, a_log, dt_bias)
    return (q.reshape(bsz, t, key_heads, key_dim), k.reshape(bsz, t, key_heads, key_dim),
            v.reshape(bsz, t, h, value_dim), g, beta)


def gdn_prologue_reference(mixed, window, conv_w, parents, depths, a, b, a_log, dt_bias, *, key_heads: int,
                           key_dim: int, value_dim: int):
    """Plain jnp. mixed [b, T, C] (in_proj_qkv's output: channels [q | k | v]), window [b, C, W] (the committed
    conv inputs above the root, oldest first), conv_w [C, W + 1], parents [b, T] (anything at a root), depths [b, T]
    (the root path's length above the committed tokens: 0 at a root), a and b [b, T, H] (in_proj_a's and
    in_proj_b's outputs), A_log and dt_bias [H].
    Returns q and k [b, T, Hk, K] (L2-normalised; q times K^-1/2), v [b, T, H, V], g and beta [b, T, H], all
    float32 (module docstring)."""
    _, t, _ = mixed.shape
    taps, f32 = conv_w.shape[-1], jnp.float32
    nodes = jnp.broadcast_to(jnp.arange(t), parents.shape)
    ancestors = [nodes]
    for _ in range(1, taps):
        ancestors.append(jnp.take_along_axis(parents, jnp.clip(ancestors[-1], 0, t - 1), axis=1))
    conv = 0.0
    for j in range(taps):
        back = taps - 1 - j
        from_nodes = jnp.take_along_axis(mixed, jnp.clip(ancestors[back], 0, t - 1)[..., None], axis=1)
        slot = jnp.clip(taps - 1 + depths - back, 0, taps - 2)
        from_window = jnp.take_along_axis(jnp.swapaxes(window, 1, 2), slot[..., None], axis=1).astype(mixed.dtype)
        src = jnp.where((depths >= back)[..., None], from_nodes, from_window).astype(f32)
        conv = conv + src * conv_w[:, j].astype(f32)
    y = jax.nn.silu(conv).astype(mixed.dtype).astype(f32)
    kd = key_heads * key_dim
    shape = y.shape[:2]
    unit = lambda x: x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + NORM_EPS)  # noqa: E731
    q = unit(y[..., :kd].reshape(*shape, key_heads, key_dim)) * key_dim ** -0.5
    k = unit(y[..., kd:2 * kd].reshape(*shape, key_heads, key_dim))
    v = y[..., 2 * kd:].reshape(*shape, -1, value_dim)
    beta = jax.nn.sigmoid(b).astype(f32)
    g = -jnp.exp(a_log.astype(f32)) * jax.nn.softplus(a.astype(f32) + dt_bias.astype(f32))
    return q, k, v, g, beta


def gdn_prologue(mixed, window, conv_w, parents, depths, a, b, a_log, dt_bias, *, key_heads: int, key_dim: int,
                 value_dim: int, implementation: str | None = None, interpret: bool | None = None):
    """Dispatcher: the Pallas kernel on a GPU (interpreted where there is none, `interpret` None), the reference
    elsewhere (`implementation`, as `pallas_kernels._dispatch.resolve_implementation`). Arguments and results as
    `gdn_prologue_reference`."""
    shape_args = dict(key_heads=key_heads, key_dim=key_dim, value_dim=value_dim)
    if resolve_implementation(implementation) == "reference":
        return gdn_prologue_reference(mixed, window, conv_w, parents, depths, a, b, a_log, dt_bias, **shape_args)
    return gdn_prologue_pallas(mixed, window, conv_w, parents, depths, a, b, a_log, dt_bias, **shape_args,
                               interpret=resolve_interpret(interpret))
