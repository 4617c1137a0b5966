"""Device mesh and the two ways to use it: tensor parallel (tp) and data parallel (dp).

- tp: one model split over the mesh axis "model" in the Megatron layout. Every parameter carries
  logical `axes` metadata (models/layers.py); `TP_RULES` maps them to the mesh: q/k/v and gate/up are
  split on their output features, o/down on their input features, the embedding and lm_head on the
  vocabulary; the KV caches on their heads. A Gated DeltaNet layer (models/qwen3_5.py) splits the same
  way by key heads, each with its value heads: in_proj_qkv, the conv and its window on their channels,
  z/b/a, A_log, dt_bias and the recurrent state by value heads, out_proj on its input features. Given
  those input shardings, XLA's SPMD partitioner places one all-reduce after the attention (or Gated
  DeltaNet) output projection and one after the MLP of every layer. A split axis whose head count does
  not divide by the mesh size stays replicated (`param_shardings` warns once per model). Small arrays
  (the tree, the acceptance walk, tokens) stay replicated, so every device agrees on the path.
- dp: one replica per device over the mesh axis "data"; rows of the batch (and their caches) are split
  over devices and every device runs the whole round on its rows.

This is what `jax.pmap` over the devices used to do: pmap is implemented as `jit(shard_map)` since
JAX 0.8, and new code states shardings on a `Mesh` and lets `jit` partition. The same mesh spans
several hosts under `jax.distributed.initialize` (see README): arrays are built with
`jax.make_array_from_callback`, so each process materialises only its own shards.
"""

from __future__ import annotations

import dataclasses
import re
import warnings
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

MODEL_AXIS = "model"
DATA_AXIS = "data"
# Logical parameter axes -> the tp mesh axis (None: replicated). linear_*: a Gated DeltaNet layer's conv
# channels ([q | k | v]), value channels (value heads x Dv) and value heads.
TP_RULES = {"q_heads": MODEL_AXIS, "kv_heads": MODEL_AXIS, "mlp": MODEL_AXIS, "vocab": MODEL_AXIS,
            "linear_conv": MODEL_AXIS, "linear_value": MODEL_AXIS, "linear_heads": MODEL_AXIS}


@dataclasses.dataclass(frozen=True)
class Parallel:
    """Static description of how arrays are laid out (hashable: part of the compilation key).

    mode 'single' uses the default device; 'tp' and 'dp' use `mesh` (one axis).
    """

    mode: str = "single"
    mesh: Mesh | None = None

    def __post_init__(self):
        if self.mode not in ("single", "tp", "dp"):
            raise ValueError(f"parallel mode must be single, tp or dp, got {self.mode!r}")
        if self.mode != "single" and self.mesh is None:
            raise ValueError(f"parallel mode {self.mode} needs a mesh")

    @property
    def size(self) -> int:
        return 1 if self.mesh is None else self.mesh.size

    def sharding(self, spec: P) -> jax.sharding.Sharding:
        if self.mesh is None:
            return jax.sharding.SingleDeviceSharding(jax.devices()[0])
        return NamedSharding(self.mesh, spec)

    # ---- parameters

    def param_spec(self, axes: tuple[str | None, ...] | None, shape: tuple[int, ...], groups: int | None = None) -> P:
        """tp: shard each dim whose logical axis has a rule, when its `groups` (the whole heads it is made of;
        None: the dim's size) divide by the mesh size; replicate otherwise."""
        if self.mode != "tp" or axes is None:
            return P()
        spec = []
        for name, dim in zip(axes, shape):
            axis = TP_RULES.get(name)
            spec.append(axis if axis is not None and (groups or dim) % self.size == 0 else None)
        return P(*spec)

    # ---- activations and caches

    def batch_spec(self, ndim: int) -> P:
        """Arrays with a leading batch axis: split over 'data' in dp, replicated otherwise."""
        return P(DATA_AXIS, *([None] * (ndim - 1))) if self.mode == "dp" else P()

    def kv_spec(self, num_kv_heads: int) -> P:
        """KV cache [b, s, n, d]: heads over 'model' (tp), rows over 'data' (dp)."""
        if self.mode == "tp":
            return P(None, None, MODEL_AXIS if num_kv_heads % self.size == 0 else None, None)
        return self.batch_spec(4)

    def recurrent_specs(self, key_heads: int) -> tuple[P, P]:
        """A Gated DeltaNet layer's state [b, Hv, Dk, Dv] and conv window [b, C, K - 1]: under tp, value heads
        and conv channels over 'model' (as the layer's weights: both split when the key heads divide);
        rows over 'data' (dp)."""
        if self.mode == "tp":
            axis = MODEL_AXIS if key_heads % self.size == 0 else None
            return P(None, axis, None, None), P(None, axis, None)
        return self.batch_spec(4), self.batch_spec(3)

    def constrain(self, x: jax.Array, spec: P) -> jax.Array:
        """Pin an array's layout inside jit (a no-op on one device)."""
        if self.mesh is None:
            return x
        return jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, spec))


def constrain_cache(cache, parallel: Parallel):
    """Pin a cache's layout inside jit: K/V heads over the tp axis, rows over the dp axis; a hybrid's
    recurrent states by heads (tp, `Parallel.recurrent_specs`) or rows (dp); an MTP head's hidden state rows
    over dp (replicated under tp). None and single-device caches pass through."""
    from ddtree_jax.cache import HybridCache, KVCache, MTPCache, RecurrentState

    if cache is None or parallel.mesh is None:
        return cache
    if isinstance(cache, MTPCache):
        return MTPCache(kv=constrain_cache(cache.kv, parallel), hidden=parallel.constrain(cache.hidden,
                                                                                        parallel.batch_spec(2)))
    if isinstance(cache, HybridCache):
        def pin(r: RecurrentState) -> RecurrentState:
            state, conv = parallel.recurrent_specs(r.key_heads)
            return RecurrentState(state=parallel.constrain(r.state, state), conv=parallel.constrain(r.conv, conv))

        return HybridCache(kv=constrain_cache(cache.kv, parallel), recurrent=tuple(pin(r) for r in cache.recurrent))
    spec = parallel.kv_spec(cache.k[0].shape[2])
    return KVCache(k=tuple(parallel.constrain(k, spec) for k in cache.k),
                   v=tuple(parallel.constrain(v, spec) for v in cache.v),
                   lengths=parallel.constrain(cache.lengths, parallel.batch_spec(1)))


def make_parallel(devices: int = 1, mode: str = "tp") -> Parallel:
    """A one-axis mesh over the first `devices` devices (all processes' devices under jax.distributed)."""
    if devices == 1 and mode != "dp":
        return Parallel()
    available = jax.devices()
    if devices > len(available):
        raise ValueError(f"--devices {devices}: only {len(available)} device(s) are visible "
                         f"({available[0].platform})")
    if mode not in ("tp", "dp"):
        raise ValueError(f"--parallel must be tp or dp, got {mode!r}")
    axis = MODEL_AXIS if mode == "tp" else DATA_AXIS
    return Parallel(mode=mode, mesh=Mesh(np.array(available[:devices]), (axis,)))


def init_distributed(coordinator: str, num_processes: int, process_id: int) -> None:
    """Join a multi-process run (JAX's own runtime). On CPU, cross-process collectives go through gloo."""
    if jax.config.jax_platforms in (None, "", "cpu") or "cpu" in str(jax.config.jax_platforms):
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=coordinator, num_processes=num_processes, process_id=process_id)


def put(array: Any, sharding: jax.sharding.Sharding) -> jax.Array:
    """Host array -> device array laid out by `sharding`; each process builds only its own shards."""
    host = np.asarray(array)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def param_shardings(params, parallel: Parallel):
    """The sharding of every parameter of a ModelParams, by dotted name. Under tp, warns once (per model)
    when heads that the rules would split do not divide by the mesh size, naming what stays replicated."""
    from ddtree_jax.models.params import flat_variables

    shardings, whole = {}, {}  # whole: a layer's block ('model.layers.*.linear_attn') or table -> what did not divide
    for name, var in flat_variables(params.state).items():
        axes, groups, shape = getattr(var, "axes", None), getattr(var, "groups", None), var.get_value().shape
        spec = parallel.param_spec(axes, shape, groups)
        shardings[name] = parallel.sharding(spec)
        ruled = [dim for axis, dim in zip(axes or (), shape) if TP_RULES.get(axis)]
        if parallel.mode == "tp" and ruled and all(s is None for s in spec):
            block = re.match(r"(.*?layers\.)\d+\.([^.]+)", name)
            module = f"{block.group(1)}*.{block.group(2)}" if block else name.rsplit(".", 1)[0]
            whole.setdefault(module, set()).add(f"{groups} heads" if groups else f"{ruled[0]} features")
    if whole:
        listed = "; ".join(f"{module} ({', '.join(sorted(units))})" for module, units in whole.items())
        warnings.warn(f"--parallel tp on {parallel.size} devices: these stay whole on every device, their heads "
                      f"(or features) do not divide by {parallel.size}: {listed}", stacklevel=2)
    return shardings


def shard_params(params, parallel: Parallel):
    """Lay out existing parameters (e.g. random ones) by the parallel rules."""
    shardings = param_shardings(params, parallel)
    held = params.state_flat()
    return params.replace_state_flat({name: jax.device_put(held[name], shardings[name]) for name in held})


def to_host(x: jax.Array) -> np.ndarray:
    """Read a (possibly multi-process) array on every process."""
    if jax.process_count() > 1 and not x.is_fully_addressable:
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(x)
