"""Greedy tree acceptance: argmax of the target's logits at every node (Pallas, Triton), then the walk.

The contract is `ddtree_jax.accept.accept_tree` with the greedy rule (decoded token = argmax over the
vocabulary, first maximum on ties, as jnp.argmax): a node is accepted iff every node on its root path
carries the token that its parent's decoded token asks for; the deepest accepted node ends the path
and its decoded token is the bonus. `tree_accept_reference` restates that in plain jnp (independently:
kernels never import ddtree_jax).

Letters: b batch, t tree nodes (T = B + 1, node 0 the root), v vocabulary, p path slots (P, static).

The bytes are in the [b, t, v] logits, so the kernel is the argmax: a grid over (row, node block,
vocabulary split), each program reducing its split in `block_v` tiles to a (max, first index) pair per
node; a plain jnp step picks the first split holding the maximum. The walk touches only [b, t] int32
arrays and is jnp, vectorised by pointer doubling (no loop over nodes): after step k every node knows
its 2^k-th ancestor and whether all of its 2^k nearest path nodes (itself included) are ok.

Example (greedy), tokens [x a b c], parents [0 0 1 0], decoded [a b q c']:
ok = [1, a == dec[0], b == dec[1], c == dec[0]] = [1 1 1 0]; accepted = [1 1 1 0];
deepest = node 2 (depth 2); path = [0 1 2 2 ...], count 3, bonus = dec[2] = q, tokens = [a b q q ...].

Logits are taken to be NaN-free: jnp.argmax returns the first NaN, the kernel does not promise that.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels._dispatch import (cdiv, check_knobs, core_count, next_pow2, resolve_implementation,
                                      resolve_interpret, round_up)
from pallas_kernels.launch import kernel_body

_NEG_INF = float("-inf")


class Accepted(NamedTuple):
    """Per row (device), in this order:
      path:   [b, P] int32 accepted node indices by depth (root first), padded with the deepest node's index.
      count:  [b] int32 accepted nodes, root included.
      bonus:  [b] int32 the decoded token of the deepest accepted node.
      tokens: [b, P] int32 decoded tokens along the path (the accepted drafts, then the bonus at count - 1).
    """

    path: jax.Array
    count: jax.Array
    bonus: jax.Array
    tokens: jax.Array


@dataclasses.dataclass(frozen=True)
class TreeAcceptConfig:
    """Tuning knobs of the argmax kernel (static, hashable).

    block_t:    nodes per program; a power of two (clamped to the padded node count).
    block_v:    vocabulary entries per tile; a power of two >= 16 (clamped to the padded vocabulary).
    num_splits: vocabulary splits per (row, node block); None picks about two programs per streaming
                multiprocessor (never more splits than tiles).
    num_warps, num_stages: Triton's warps per program and software-pipelining depth.
    """

    block_t: int = 8
    block_v: int = 1024
    num_splits: int | None = None
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self):
        check_knobs(self, pow2={"block_t": 1, "block_v": 16}, optional_counts=("num_splits",))


# ----------------------------------------------------------------------------------------------------
# Kernel body


def _argmax_kernel(
    # inputs
    x_ref,    # [t, v] logits of one row
    # outputs
    max_ref,  # [block_t] float32 the largest logit of each node within this split
    idx_ref,  # [block_t] int32 its first index (the split's first index if the split holds only -inf)
    *,
    block_t: int,
    block_v: int,
    chunk: int,
    num_tiles: int,
    num_nodes: int,
    vocab: int,
):
    node_block, split = pl.program_id(1), pl.program_id(2)
    t0 = node_block * block_t
    row_ok = t0 + jnp.arange(block_t, dtype=jnp.int32) < num_nodes
    v_start = split * chunk

    def body(i, carry):
        best, arg = carry
        v0 = v_start + i * block_v
        cols = v0 + jnp.arange(block_v, dtype=jnp.int32)
        ok = row_ok[:, None] & (cols < vocab)[None, :]
        x = plt.load(x_ref.at[pl.ds(t0, block_t), pl.ds(v0, block_v)], mask=ok, other=_NEG_INF)
        x = x.astype(jnp.float32)
        tile_max = jnp.max(x, axis=1)
        # First index of the maximum: masked columns (-inf) come after every real column of the tile.
        tile_arg = jnp.min(jnp.where(x == tile_max[:, None], cols[None, :], jnp.iinfo(jnp.int32).max), axis=1)
        # Strictly greater: on a tie the earlier tile (lower index) keeps it.
        better = tile_max > best
        return jnp.where(better, tile_max, best), jnp.where(better, tile_arg, arg)

    init = (jnp.full((block_t,), _NEG_INF, jnp.float32), jnp.full((block_t,), v_start, jnp.int32))
    best, arg = lax.fori_loop(0, num_tiles, body, init)
    max_ref[...] = best
    idx_ref[...] = arg


# ----------------------------------------------------------------------------------------------------
# pallas_call wrapper


def _layout(b: int, t: int, v: int, config: TreeAcceptConfig) -> dict:
    block_t = min(config.block_t, next_pow2(t))
    block_v = min(config.block_v, max(16, next_pow2(v)))
    node_blocks = cdiv(t, block_t)
    num_splits = config.num_splits
    if num_splits is None:
        num_splits = cdiv(2 * core_count(), b * node_blocks)
    num_splits = max(1, min(num_splits, cdiv(v, block_v)))
    chunk = round_up(cdiv(v, num_splits), block_v)
    num_splits = cdiv(v, chunk)  # no empty trailing splits
    return dict(block_t=block_t, block_v=block_v, node_blocks=node_blocks, padded_nodes=node_blocks * block_t,
                num_splits=num_splits, chunk=chunk, num_tiles=chunk // block_v)


def _argmax_partials(logits, *, config: TreeAcceptConfig, interpret: bool, debug: bool = False):
    """logits [b, t, v] -> (max [splits, b, padded t] f32, idx [splits, b, padded t] int32, layout)."""
    if logits.ndim != 3:
        raise ValueError(f"logits must be [b, t, v], got shape {logits.shape}")
    b, t, v = logits.shape
    lay = _layout(b, t, v, config)
    block_t, num_splits = lay["block_t"], lay["num_splits"]
    kernel = functools.partial(_argmax_kernel, block_t=block_t, block_v=lay["block_v"], chunk=lay["chunk"],
                               num_tiles=lay["num_tiles"], num_nodes=t, vocab=v)
    maxes, idxs = pl.pallas_call(
        kernel_body(kernel, interpret),
        grid=(b, lay["node_blocks"], num_splits),
        in_specs=[pl.BlockSpec((None, t, v), lambda i, j, k: (i, 0, 0))],
        out_specs=[pl.BlockSpec((None, None, block_t), lambda i, j, k: (k, i, j)),
                   pl.BlockSpec((None, None, block_t), lambda i, j, k: (k, i, j))],
        out_shape=[jax.ShapeDtypeStruct((num_splits, b, lay["padded_nodes"]), jnp.float32),
                   jax.ShapeDtypeStruct((num_splits, b, lay["padded_nodes"]), jnp.int32)],
        compiler_params=plt.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages),
        interpret=interpret,
        debug=debug,
        name="tree_accept_argmax",
    )(logits)
    return maxes, idxs, lay


def _merge_argmax(maxes, idxs, t: int) -> jax.Array:
    """The first split holding the maximum (splits cover increasing indices): [b, t] int32."""
    best_split = jnp.argmax(maxes[:, :, :t], axis=0)
    return jnp.take_along_axis(idxs[:, :, :t], best_split[None], axis=0)[0]


def tree_walk(decoded, tokens, parents, depths, valid, *, path_len: int) -> Accepted:
    """The acceptance walk for any decoding rule, vectorised by pointer doubling (see the module docstring).

    decoded [b, t] int32 the target's token at every node (argmax, or a sample per node); tokens, parents,
    depths [b, t] int32 and valid [b, t] bool the tree; path_len P (static) bounds the path. A node is
    accepted iff every node on its root path carries the token its parent's decoded token asks for.
    Returns Accepted. The engine runs it for sampled tokens; `tree_accept_pallas` after its argmax."""
    b, t = tokens.shape
    parent_token = jnp.take_along_axis(decoded, parents, axis=1)
    ok = ((tokens == parent_token) & valid).at[:, 0].set(True)  # the root (bonus) is always accepted
    # up[k] = 2^k-th ancestor (the root is its own parent); all_ok covers the 2^k nearest path nodes.
    steps = max(1, (min(t, path_len) - 1).bit_length())  # 2^steps > min(t, P) - 1 >= any depth
    up, all_ok, ups = parents, ok, [parents]
    for _ in range(steps):
        all_ok = all_ok & jnp.take_along_axis(all_ok, up, axis=1)
        up = jnp.take_along_axis(up, up, axis=1)
        ups.append(up)
    deepest = jnp.argmax(jnp.where(all_ok, depths, -1), axis=1).astype(jnp.int32)  # first on ties
    deep_depth = jnp.take_along_axis(depths, deepest[:, None], axis=1)  # [b, 1]
    # Slot p holds the ancestor of `deepest` at depth p: lift by depth - p, one set bit at a time.
    # Example: deepest at depth 5, p = 2: lift 3 = 1 + 2, so up[0] then up[1]. Slots past the path keep `deepest`.
    lift = deep_depth - jnp.arange(path_len, dtype=jnp.int32)[None, :]  # [b, p]
    path = jnp.broadcast_to(deepest[:, None], (b, path_len))
    for k in range(steps):
        take = (lift > 0) & (((lift >> k) & 1) == 1)
        path = jnp.where(take, jnp.take_along_axis(ups[k], path, axis=1), path)
    path = path.astype(jnp.int32)
    return Accepted(path=path, count=(deep_depth[:, 0] + 1).astype(jnp.int32),
                    bonus=jnp.take_along_axis(decoded, deepest[:, None], axis=1)[:, 0].astype(jnp.int32),
                    tokens=jnp.take_along_axis(decoded, path, axis=1).astype(jnp.int32))


def _check_tree(logits, tokens, parents, depths, valid, path_len):
    if not isinstance(path_len, int) or isinstance(path_len, bool) or path_len < 1:
        raise ValueError(f"path_len={path_len!r}: must be an int >= 1 (max depth + 1)")
    if logits.ndim != 3:
        raise ValueError(f"logits must be [b, t, v], got shape {logits.shape}")
    b, t, _ = logits.shape
    for name, x in (("tokens", tokens), ("parents", parents), ("depths", depths), ("valid", valid)):
        if x.shape != (b, t):
            raise ValueError(f"{name} must be [b, t] = {(b, t)}, got {x.shape}")


# ----------------------------------------------------------------------------------------------------
# Public functions


@functools.partial(jax.jit, static_argnames=("config", "interpret", "debug"))
def greedy_tokens_pallas(logits, *, config: TreeAcceptConfig | None = None, interpret: bool = False,
                         debug: bool = False) -> jax.Array:
    """logits [b, t, v] (float32 or bf16) -> [b, t] int32 argmax over v, first maximum on ties."""
    config = TreeAcceptConfig() if config is None else config
    maxes, idxs, _ = _argmax_partials(logits, config=config, interpret=interpret, debug=debug)
    return _merge_argmax(maxes, idxs, logits.shape[1])


@functools.partial(jax.jit, static_argnames=("path_len", "config", "interpret", "debug"))
def tree_accept_pallas(logits, tokens, parents, depths, valid, *, path_len: int,
                       config: TreeAcceptConfig | None = None, interpret: bool = False,
                       debug: bool = False) -> Accepted:
    """The Pallas argmax plus the pointer-doubling walk; arguments and result as `tree_accept_reference`."""
    _check_tree(logits, tokens, parents, depths, valid, path_len)
    decoded = greedy_tokens_pallas(logits, config=config, interpret=interpret, debug=debug)
    return tree_walk(decoded, tokens.astype(jnp.int32), parents.astype(jnp.int32), depths.astype(jnp.int32),
                     valid.astype(bool), path_len=path_len)


def tree_accept(logits, tokens, parents, depths, valid, *, path_len: int, implementation: str | None = None,
                config: TreeAcceptConfig | None = None, interpret: bool | None = None) -> Accepted:
    """Dispatcher: the Pallas kernel on a GPU, the reference elsewhere.

    implementation: None (argument, then $DDTREE_JAX_KERNELS, then the backend), "pallas" or
    "reference". interpret: None interprets the kernel where there is no GPU. Arguments and result as
    `tree_accept_reference`.
    """
    if resolve_implementation(implementation) == "reference":
        return tree_accept_reference(logits, tokens, parents, depths, valid, path_len=path_len)
    return tree_accept_pallas(logits, tokens, parents, depths, valid, path_len=path_len, config=config,
                              interpret=resolve_interpret(interpret))


@functools.partial(jax.jit, static_argnames=("path_len",))
def tree_accept_reference(logits, tokens, parents, depths, valid, *, path_len: int) -> Accepted:
    """Greedy acceptance of a batch of draft trees, in plain jnp.

    Args:
      logits:  [b, t, v] the target's logits at every node (float32 or bf16).
      tokens:  [b, t] int32 node tokens (node 0 = root = last round's bonus).
      parents: [b, t] int32 parent index; the root is its own parent; parents precede children.
      depths:  [b, t] int32, root 0.
      valid:   [b, t] bool; False for padding nodes (never accepted).
      path_len: P (static), max depth + 1.
    Returns:
      Accepted(path [b, P], count [b], bonus [b], tokens [b, P]), all int32.
    """
    _check_tree(logits, tokens, parents, depths, valid, path_len)
    b, t, _ = logits.shape
    decoded = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    parents = parents.astype(jnp.int32)
    # ancestor[i, j]: node j is on node i's root path (itself included); P - 1 parent steps reach the root.
    eye = jnp.eye(t, dtype=bool)
    ancestor = jnp.broadcast_to(eye, (b, t, t))
    current = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    for _ in range(path_len - 1):
        current = jnp.take_along_axis(parents, current, axis=1)
        ancestor = ancestor | jax.nn.one_hot(current, t, dtype=bool)
    ancestor = ancestor & (valid[:, :, None] | eye)  # padding nodes see only themselves
    ok = (tokens == jnp.take_along_axis(decoded, parents, axis=1)) & valid
    ok = ok.at[:, 0].set(True)
    accepted = ~jnp.any(ancestor & ~ok[:, None, :], axis=-1)
    deepest = jnp.argmax(jnp.where(accepted, depths, -1), axis=1)
    count = jnp.take_along_axis(depths, deepest[:, None], axis=1)[:, 0] + 1
    on_path = jnp.take_along_axis(ancestor, deepest[:, None, None], axis=1)[:, 0]  # [b, t]
    slot = jnp.where(on_path, depths, path_len)  # off-path nodes go to slot P, which is dropped
    path = jnp.broadcast_to(deepest[:, None], (b, path_len)).astype(jnp.int32)
    path = path.at[jnp.arange(b)[:, None], slot].set(jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t)),
                                                     mode="drop")
    return Accepted(path=path, count=count.astype(jnp.int32),
                    bonus=jnp.take_along_axis(decoded, deepest[:, None], axis=1)[:, 0],
                    tokens=jnp.take_along_axis(decoded, path, axis=1))
