"""A model's parameters as one pytree: the NNX state plus, as static aux data, its graph and config.

The NNX graph is split once; jitted functions receive `ModelParams` and merge the module inside the
trace (free at run time), so no Python object graph is walked per step.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
from flax import nnx

from ddtree_jax.models.layers import apply_fp8


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ModelParams:
    """state: the NNX `Param` state (device arrays); graphdef and config: static."""

    state: Any
    graphdef: Any = dataclasses.field(metadata=dict(static=True))
    config: Any = dataclasses.field(metadata=dict(static=True))

    def module(self):
        """The NNX module with these parameters (call inside jit)."""
        return nnx.merge(self.graphdef, self.state)

    def flat(self) -> dict[str, jax.Array]:
        """Parameters by dotted HF name, e.g. 'model.layers.0.self_attn.q_proj.weight'."""
        return {name: var.get_value() for name, var in flat_variables(self.state).items()}

    def replace_flat(self, arrays: dict[str, Any]) -> "ModelParams":
        """A copy whose parameters are taken from `arrays` (dotted names, all of them)."""
        variables = flat_variables(self.state)
        missing = sorted(set(variables) - set(arrays))
        if missing:
            raise KeyError(f"no value for {missing[0]} ({len(missing)} missing)")
        leaves = [arrays[name] for name in variables]
        state = jax.tree.unflatten(jax.tree.structure(self.state), leaves)
        return dataclasses.replace(self, state=state)


def flat_variables(state) -> dict[str, nnx.Variable]:
    """NNX state -> {dotted name: Variable}, in the state's (deterministic) leaf order."""
    out = {}
    leaves, _ = jax.tree_util.tree_flatten_with_path(state, is_leaf=lambda x: isinstance(x, nnx.Variable))
    for path, var in leaves:
        out[".".join(_key_name(k) for k in path)] = var
    return out


def _key_name(key) -> str:
    for attr in ("key", "idx", "name"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def abstract_params(build: Callable[[nnx.Rngs], nnx.Module], config) -> ModelParams:
    """Shapes and dtypes only (nothing allocated): the target of a checkpoint load. The projections that
    `config.fp8` converts are FP8 (`layers.apply_fp8`), here and in `random_params`."""
    module = nnx.eval_shape(lambda: apply_fp8(build(nnx.Rngs(0)), config))
    graphdef, state = nnx.split(module, nnx.Param)
    return ModelParams(state=state, graphdef=graphdef, config=config)


def random_params(build: Callable[[nnx.Rngs], nnx.Module], config, seed: int = 0) -> ModelParams:
    """Randomly initialised parameters (tests, shape benchmarks)."""
    module = apply_fp8(build(nnx.Rngs(seed)), config)
    graphdef, state = nnx.split(module, nnx.Param)
    return ModelParams(state=state, graphdef=graphdef, config=config)
