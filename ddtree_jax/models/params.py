"""A model's parameters as one pytree: the NNX state plus, as static aux data, its graph and config.

The NNX graph is split once; jitted functions receive `ModelParams` and merge the module inside the
trace (free at run time), so no Python object graph is walked per step.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
from flax import nnx

from ddtree_jax.models.layers import PackedProjections, apply_fp8


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ModelParams:
    """state: the NNX `Param` state (device arrays); graphdef and config: static.

    Two views by dotted name: `state_flat` as held (a `PackedProjections` weight is one array, e.g.
    'model.layers.0.mlp.gate_up_proj.weight'), and `flat` as Hugging Face names the tensors (its parts,
    'model.layers.0.mlp.gate_proj.weight' and '...up_proj.weight'): checkpoints and their tests speak HF.
    """

    state: Any
    graphdef: Any = dataclasses.field(metadata=dict(static=True))
    config: Any = dataclasses.field(metadata=dict(static=True))

    def module(self):
        """The NNX module with these parameters (call inside jit)."""
        return nnx.merge(self.graphdef, self.state)

    def state_flat(self) -> dict[str, jax.Array]:
        """Parameters as held, by dotted name (no copies)."""
        return {name: var.get_value() for name, var in flat_variables(self.state).items()}

    def array(self, name: str) -> jax.Array:
        """One parameter as held, e.g. `array('model.embed_tokens.weight')` (no copy)."""
        return flat_variables(self.state)[name].get_value()

    def replace_state_flat(self, arrays: dict[str, Any]) -> "ModelParams":
        """A copy whose parameters are taken from `arrays` (names as held, all of them)."""
        variables = flat_variables(self.state)
        missing = sorted(set(variables) - set(arrays))
        if missing:
            raise KeyError(f"no value for {missing[0]} ({len(missing)} missing)")
        leaves = [arrays[name] for name in variables]
        state = jax.tree.unflatten(jax.tree.structure(self.state), leaves)
        return dataclasses.replace(self, state=state)

    def flat(self) -> dict[str, jax.Array]:
        """Parameters by HF name, e.g. 'model.layers.0.self_attn.q_proj.weight' (a packed weight's parts are
        slices: copies on the device), in the order of the names' dotted parts (numbers as numbers): the
        order of an unpacked module tree's state, which seeded draws by name follow. Works on abstract
        parameters too (ShapeDtypeStructs)."""
        packed, renamed = hf_layout(self)
        out = {}
        for name, array in self.state_flat().items():
            if name in packed:
                prefix, module, suffix = packed[name]
                out.update({prefix + part + suffix: w for part, w in module.unpack(array).items()})
            else:
                out[renamed.get(name, name)] = array
        return dict(sorted(out.items(), key=lambda item: _path_key(item[0])))

    def pack(self, arrays: dict[str, Any], consume: bool = False) -> dict[str, Any]:
        """{HF name: array} (NumPy or JAX, all of them) -> {name as held: array}: what `replace_state_flat` takes.
        `consume`: remove each packed part from `arrays` once packed (a load then holds one module twice at
        most, not the whole model)."""
        packed, renamed = hf_layout(self)
        hf_names = {name: renamed.get(name, name) for name in flat_variables(self.state)}
        out = {}
        for name, hf in hf_names.items():
            if name in packed:
                prefix, module, suffix = packed[name]
                take = arrays.pop if consume else arrays.__getitem__
                parts = {part.name: take(prefix + part.name + suffix) for part in module.parts}
                out[name] = module.pack(parts)
            elif hf not in arrays:
                raise KeyError(f"no value for {hf}")
            else:
                out[name] = arrays[hf]
        return out

    def replace_flat(self, arrays: dict[str, Any]) -> "ModelParams":
        """A copy whose parameters are taken from `arrays` (HF names, all of them; packed as held)."""
        return self.replace_state_flat(self.pack(arrays))


def _path_key(name: str) -> tuple:
    """'model.layers.10.mlp' -> ((1, 'model'), (1, 'layers'), (0, 10), (1, 'mlp')): numbers before names, in
    numeric order, as a module tree's state flattens."""
    return tuple((0, int(part)) if part.isdigit() else (1, part) for part in name.split("."))


def hf_layout(params: ModelParams) -> tuple[dict[str, tuple[str, PackedProjections, str]], dict[str, str]]:
    """({packed array's name as held: (HF prefix of its parts, its module, the HF suffix: '.weight', or
    '.weight_scale_inv' for packed FP8 scales)}, {name as held: HF name} of the parts that FP8 keeps apart under
    their packed module)."""
    packed, renamed = {}, {}
    for path, module in nnx.iter_modules(params.module()):
        if not isinstance(module, PackedProjections):
            continue
        name = ".".join(str(p) for p in path)
        prefix = name.rpartition(".")[0] + "." if "." in name else ""
        if module.packed:
            for suffix in (".weight", ".weight_scale_inv") if module.block is not None else (".weight",):
                packed[name + suffix] = (prefix, module, suffix)
        else:
            for held in flat_variables(nnx.state(module, nnx.Param)):
                renamed[f"{name}.{held}"] = prefix + held
    return packed, renamed


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
