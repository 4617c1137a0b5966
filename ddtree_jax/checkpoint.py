"""Checkpoints: Hugging Face safetensors folders (single or sharded) and orbax folders, both ways.

Loading is strict: a missing, unexpected, mis-shaped or non-float tensor, a wrong `model_type`, or a truncated
or corrupt file raises `CheckpointError` (or `ConfigError`) with one line that names the file and the tensor.
Files hold HF names, and `ModelParams.flat` gives the parameters under them (each NNX state path is the HF
name, except a packed projection's weight, which holds several HF tensors). In a block-scaled FP8 checkpoint
(`config.Fp8Config`) the projections it converts are F8_E4M3 with their `weight_scale_inv` (float), every
other tensor is not FP8, and FP8 weights stay float8_e4m3fn when loaded (scales float32).

An orbax checkpoint folder holds `config.json` (the HF config, verbatim), `ddtree_checkpoint.json`
(format marker), `params/` (the orbax pytree, keyed by the HF name's dotted parts) and any tokenizer or
generation-config files. Every save writes into a temporary sibling folder and renames it at the end.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable, Iterator

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from ddtree_jax.config import (DRAFTER_ARCHITECTURE, MTPConfig, check_pair, load_drafter_config, load_target_config,
                               mtp_config, parse_dflash, parse_target, read_config_json)
from ddtree_jax.models import dflash, mtp, target_family
from ddtree_jax.models.fp8 import FP8_DTYPE
from ddtree_jax.models.params import ModelParams
from ddtree_jax.parallel import Parallel, param_shardings, put

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
ORBAX_MARKER = "ddtree_checkpoint.json"
# Copied along by conversions; everything a tokenizer or generation needs.
SIDE_FILES = (
    "generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
    "vocab.json", "merges.txt", "chat_template.jinja", "added_tokens.json",
)
FLOAT_DTYPES = {"F16": np.float16, "BF16": ml_dtypes.bfloat16, "F32": np.float32, "F64": np.float64}
DEFAULT_MAX_SHARD_BYTES = 5 * 2**30


class CheckpointError(ValueError):
    """A checkpoint folder or file cannot be loaded as asked."""


def parse_dtype(name: str | None):
    """'bfloat16' | 'float32' | 'float16' | None ('as stored') -> a jnp dtype or None."""
    table = {"bfloat16": jnp.bfloat16, "bf16": jnp.bfloat16, "float32": jnp.float32, "fp32": jnp.float32,
             "float16": jnp.float16, "fp16": jnp.float16}
    if name is None:
        return None
    if name not in table:
        raise CheckpointError(f"dtype {name!r} is not supported (expected one of bfloat16, float32, float16)")
    return table[name]


def checkpoint_format(path: str | Path) -> str:
    """'hf' or 'orbax', from what the folder holds."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path}: not a folder (expected a Hugging Face or orbax checkpoint folder)")
    if (path / ORBAX_MARKER).exists():
        return "orbax"
    if (path / INDEX_FILE).exists() or (path / SINGLE_FILE).exists():
        return "hf"
    raise CheckpointError(
        f"{path}: no {SINGLE_FILE}, {INDEX_FILE} or {ORBAX_MARKER} (expected a Hugging Face or orbax checkpoint)"
    )


# ----------------------------------------------------------------------------------------------------
# Hugging Face safetensors


def _tensor_files(path: Path) -> dict[str, Path]:
    """Tensor name -> file, from the index (sharded) or the single file's header."""
    index = path / INDEX_FILE
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            assert isinstance(weight_map, dict)
        except (OSError, ValueError, KeyError, TypeError, AssertionError) as e:
            raise CheckpointError(f"{index}: not a valid safetensors index (expected a 'weight_map' object; {e})") from None
        files = {name: path / str(file) for name, file in weight_map.items()}
        for name, file in files.items():
            if not file.exists():
                raise CheckpointError(f"{index}: tensor '{name}' maps to {file.name}, which does not exist")
        # The index must agree with the shards' own headers.
        for file in sorted(set(files.values())):
            with _open(file) as f:
                keys = set(f.keys())
            for name, mapped in files.items():
                if mapped == file and name not in keys:
                    raise CheckpointError(f"{file}: tensor '{name}' is listed in {INDEX_FILE} but not in this file")
            for name in keys:
                if files.get(name) != file:
                    raise CheckpointError(f"{file}: tensor '{name}' is in this file but {INDEX_FILE} does not map it here")
        return files
    single = path / SINGLE_FILE
    with _open(single) as f:
        return {name: single for name in f.keys()}


class _open:
    """`safe_open` whose failures name the file."""

    def __init__(self, file: Path):
        self.file = file

    def __enter__(self):
        from safetensors import safe_open

        try:
            self.handle = safe_open(str(self.file), framework="numpy")
            return self.handle.__enter__()
        except Exception as e:  # safetensors raises its own error types for bad headers and truncation
            raise CheckpointError(f"{self.file}: {_truncation(self.file) or 'not a readable safetensors file'} "
                                  f"({_one_line(e)})") from None

    def __exit__(self, *exc):
        return self.handle.__exit__(*exc)


def _header(file: Path) -> tuple[int, dict]:
    """(header length in bytes, header) of a safetensors file: {name: {dtype, shape, data_offsets}}."""
    with open(file, "rb") as f:
        header_len = int.from_bytes(f.read(8), "little")
        return header_len, json.loads(f.read(header_len))


def _read_fp8(file: Path, name: str, header: tuple[int, dict]) -> np.ndarray:
    """An F8_E4M3 tensor as a float8_e4m3fn array, read at its header offsets: safetensors' numpy reader has
    no float8 type (safetensors/safetensors#682)."""
    header_len, entries = header
    start, end = entries[name]["data_offsets"]
    data = np.fromfile(file, np.uint8, count=end - start, offset=8 + header_len + start)
    return data.view(ml_dtypes.float8_e4m3fn).reshape(entries[name]["shape"])


def _truncation(file: Path) -> str | None:
    """If the header parses but the data is cut short, name the first tensor that is cut."""
    try:
        size = file.stat().st_size
        header_len, header = _header(file)
        data = size - 8 - header_len
        cut = [(v["data_offsets"][1], name) for name, v in header.items()
               if name != "__metadata__" and v["data_offsets"][1] > data]
    except Exception:
        return None
    if not cut:
        return None
    end, name = min(cut)
    return f"truncated: tensor '{name}' ends at data byte {end} but the file holds {max(data, 0)} data bytes"


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__


def _expected_shapes(params: ModelParams) -> dict[str, tuple[int, ...]]:
    return {name: tuple(a.shape) for name, a in params.flat().items()}


def _fp8_names(params: ModelParams) -> frozenset[str]:
    """The parameters stored as float8_e4m3fn: the weights of the FP8 projections (config.json's
    `quantization_config`)."""
    return frozenset(name for name, a in params.flat().items() if a.dtype == FP8_DTYPE)


def _check_dtype(where: Path, name: str, found: str, is_float: bool, is_fp8: bool, want_fp8: bool) -> None:
    """A stored tensor's dtype against the model's: F8_E4M3 exactly where the config makes a projection FP8,
    another floating-point dtype everywhere else (`found`: the dtype as the file names it)."""
    if want_fp8 and not is_fp8:
        raise CheckpointError(f"{where}: tensor '{name}' has dtype {found}, expected float8_e4m3fn "
                              "(config.json's quantization_config makes this projection FP8)")
    if not want_fp8 and (is_fp8 or not is_float):
        why = " (only the projections that config.json's quantization_config converts are FP8)" if is_fp8 else ""
        raise CheckpointError(f"{where}: tensor '{name}' has dtype {found}, expected a floating-point dtype "
                              f"({', '.join(FLOAT_DTYPES)}){why}")


def read_hf_arrays(path: str | Path, expected: dict[str, tuple[int, ...]], tied_pairs: dict[str, str] | None = None,
                   progress: Callable[[int], Iterator] | None = None, *, stored_names: dict[str, str] | None = None,
                   ignored_prefixes: tuple[str, ...] = (), fp8: frozenset[str] = frozenset()) -> dict[str, np.ndarray]:
    """Read and check every tensor of an HF folder against `expected` {name: shape}; host numpy arrays,
    stored dtype. `tied_pairs` {extra name: name it must equal} lists tensors allowed as exact copies
    (an lm_head saved next to tied embeddings). `stored_names` {our name: name in the files} renames
    (default: the same); stored tensors whose names start with one of `ignored_prefixes` are skipped
    unread. `fp8`: our names of the tensors that must be F8_E4M3 (every other one is another float dtype).
    Errors name tensors as stored; the result is keyed by our names."""
    path = Path(path)
    files = {name: file for name, file in _tensor_files(path).items() if not name.startswith(ignored_prefixes)}
    tied_pairs = tied_pairs or {}
    stored_names = stored_names or {}
    ours = {stored_names.get(name, name): name for name in expected}  # stored name -> our name
    expected = {stored: expected[name] for stored, name in ours.items()}
    fp8 = frozenset(stored for stored, name in ours.items() if name in fp8)
    tied_pairs = {stored_names.get(a, a): stored_names.get(b, b) for a, b in tied_pairs.items()}
    where = path / (INDEX_FILE if (path / INDEX_FILE).exists() else SINGLE_FILE)
    for name in expected:
        if name not in files:
            raise CheckpointError(f"{where}: tensor '{name}' is missing (expected shape {expected[name]})")
    for name, file in files.items():
        if name not in expected and name not in tied_pairs:
            raise CheckpointError(f"{file}: unexpected tensor '{name}' (not part of this model's config)")

    arrays: dict[str, np.ndarray] = {}
    by_file: dict[Path, list[str]] = {}
    for name, file in files.items():
        by_file.setdefault(file, []).append(name)
    bar = progress(len(files)) if progress else None
    for file, names in sorted(by_file.items()):
        header = None
        with _open(file) as f:
            for name in names:
                meta = f.get_slice(name)
                dtype, shape = meta.get_dtype(), tuple(meta.get_shape())
                _check_dtype(file, name, dtype, dtype in FLOAT_DTYPES, dtype == "F8_E4M3", name in fp8)
                want = expected.get(name, expected.get(tied_pairs.get(name, ""), None))
                if shape != want:
                    raise CheckpointError(f"{file}: tensor '{name}' has shape {shape}, expected {want} from config.json")
                try:
                    if dtype == "F8_E4M3":
                        header = header or _header(file)
                        arrays[name] = _read_fp8(file, name, header)
                    else:
                        arrays[name] = f.get_tensor(name)
                except Exception as e:
                    raise CheckpointError(f"{file}: tensor '{name}' cannot be read ({_one_line(e)})") from None
                if bar is not None:
                    next(bar, None)
    for extra, original in tied_pairs.items():
        if extra in arrays:
            if not np.array_equal(np.asarray(arrays[extra], np.float32), np.asarray(arrays[original], np.float32)):
                raise CheckpointError(f"{files[extra]}: tensor '{extra}' differs from '{original}' but "
                                      "config.json says tie_word_embeddings=true")
            del arrays[extra]
    return {ours[name]: a for name, a in arrays.items()}


def tied_extras(config) -> dict[str, str]:
    return {"lm_head.weight": "model.embed_tokens.weight"} if getattr(config, "tie_word_embeddings", False) else {}


# Per HF model_type: where a target's tensors live in its files, and which stored tensors are not ours.
# A `qwen3_5` (vision-language) checkpoint keeps the text model under `model.language_model.` and also
# holds the vision tower (`model.visual.*`) and the multi-token-prediction head (`mtp.*`), which the
# target does not use (HF's Qwen3_5ForCausalLM ignores them too; `load_mtp` reads the head alone, and an
# orbax conversion keeps it under the same names); a dense `qwen3` folder may hold a head trained for it
# (`train/mtp.py`, `write_mtp_beside`); every other tensor is checked strictly.
TEXT_PREFIXES = {"qwen3_5": "model.language_model."}
IGNORED_PREFIXES = {"qwen3_5": ("model.visual.", mtp.PREFIX), "qwen3_5_text": (mtp.PREFIX,), "qwen3": (mtp.PREFIX,)}
BESIDE_MTP = ("model.", "lm_head.")  # what an MTP head's load skips: the target's tensors (and a vision tower)


def stored_layout(config, names) -> tuple[dict[str, str], tuple[str, ...]]:
    """({our name: stored name}, ignored prefixes) of a target's or MTP head's HF files; `names` are our
    parameter names."""
    if isinstance(config, MTPConfig):
        return {}, BESIDE_MTP
    hf_type = getattr(config, "hf_model_type", getattr(config, "model_type", None))
    prefix = TEXT_PREFIXES.get(hf_type)
    renames = {n: prefix + n[len("model."):] for n in names if n.startswith("model.")} if prefix else {}
    return renames, IGNORED_PREFIXES.get(hf_type, ())


def _to_device(arrays: dict[str, np.ndarray | jax.Array], dtypes: dict | None,
               shardings: dict | None = None) -> dict[str, jax.Array]:
    """Host (or first-device) arrays -> device arrays in `dtypes[name]` (None: as stored), each onto its shards
    (a host array straight onto them, with no full copy on one device). Empties `arrays` as it goes."""
    out = {}
    for name in list(arrays):
        a = arrays.pop(name)  # one array at a time in two copies, not the whole model
        a = a if dtypes is None else a.astype(dtypes[name])
        if shardings is None:
            out[name] = jnp.asarray(a)
        else:
            out[name] = put(a, shardings[name]) if isinstance(a, np.ndarray) else jax.device_put(a, shardings[name])
    return out


def write_hf_files(folder: Path, arrays: dict[str, np.ndarray | jax.Array], config_raw: dict, *,
                   max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> None:
    """Write config.json and model.safetensors (or shards + index) into an existing folder."""
    from safetensors.numpy import save_file

    (folder / "config.json").write_text(json.dumps(config_raw, indent=2) + "\n")
    host = {name: np.asarray(a) for name, a in arrays.items()}
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name in sorted(host):
        if shards[-1] and size + host[name].nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = host[name]
        size += host[name].nbytes
    if len(shards) == 1:
        save_file(shards[0], str(folder / SINGLE_FILE), metadata={"format": "pt"})
        return
    weight_map = {}
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(folder / file), metadata={"format": "pt"})
        weight_map.update({name: file for name in shard})
    total = sum(a.nbytes for a in host.values())
    (folder / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))


def save_hf(arrays: dict[str, np.ndarray | jax.Array], config_raw: dict, out: str | Path, *,
            side_files_from: str | Path | None = None, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
            force: bool = False) -> Path:
    """Write an HF checkpoint folder (config, weights, side files) atomically."""

    def write(tmp: Path):
        write_hf_files(tmp, arrays, config_raw, max_shard_bytes=max_shard_bytes)
        copy_side_files(side_files_from, tmp)

    return atomic_folder(out, write, force=force)


# ----------------------------------------------------------------------------------------------------
# orbax


def nest(flat: dict[str, object]) -> dict:
    """{'a.b.c': x} -> {'a': {'b': {'c': x}}} (orbax stores parameters by their names' dotted parts)."""
    tree: dict = {}
    for name, value in flat.items():
        node = tree
        *parents, leaf = name.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return tree


def flatten(tree: dict, prefix: str = "") -> dict[str, object]:
    """Inverse of `nest`."""
    out = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        out.update(flatten(value, name + ".") if isinstance(value, dict) else {name: value})
    return out


class _orbax:
    """Orbax V1 pytree calls under their current names (`save`/`load`/`metadata`), falling back to the
    `*_pytree` names of older 0.12 releases."""

    @staticmethod
    def _fn(new: str, old: str):
        from orbax.checkpoint import v1 as ocp

        return getattr(ocp, new, None) or getattr(ocp, old)

    @classmethod
    def save(cls, path, tree):
        return cls._fn("save", "save_pytree")(path, tree)

    @classmethod
    def load(cls, path, abstract_tree):
        return cls._fn("load", "load_pytree")(path, abstract_tree)

    @staticmethod
    def placeholder():
        """What a restore target holds in place of a stored leaf to leave unread."""
        from orbax.checkpoint import v1 as ocp

        return ocp.PLACEHOLDER

    @classmethod
    def metadata(cls, path):
        return cls._fn("metadata", "pytree_metadata")(path).metadata


def save_orbax(arrays: dict[str, np.ndarray | jax.Array], config_raw: dict, out: str | Path, *,
               side_files_from: str | Path | None = None, force: bool = False) -> Path:
    """Write an orbax checkpoint folder (see the module docstring). Atomic."""
    def write(tmp: Path):
        (tmp / "config.json").write_text(json.dumps(config_raw, indent=2) + "\n")
        (tmp / ORBAX_MARKER).write_text(json.dumps({"format": "orbax", "params": "params",
                                                     "model_type": config_raw.get("model_type")}) + "\n")
        _orbax.save(tmp / "params", nest({n: jnp.asarray(a) for n, a in arrays.items()}))
        copy_side_files(side_files_from, tmp)

    return atomic_folder(out, write, force=force)


def read_orbax_arrays(path: str | Path, expected: dict[str, tuple[int, ...]], dtypes: dict | None = None,
                      shardings: dict | None = None, fp8: frozenset[str] = frozenset(), *,
                      ignored_prefixes: tuple[str, ...] = ()) -> dict[str, jax.Array]:
    """Restore an orbax folder's params, checked against `expected` {name: shape} (`fp8`: the names that must be
    float8_e4m3fn); in `dtypes[name]` (None: as stored); each array lands on its `shardings[name]` (default:
    the first device). Stored tensors whose names start with one of `ignored_prefixes` are skipped unread."""
    path = Path(path)
    params_dir = path / "params"
    try:
        meta = _orbax.metadata(params_dir)
    except Exception as e:
        raise CheckpointError(f"{params_dir}: not a readable orbax checkpoint ({_one_line(e)})") from None
    everything = flatten(meta)
    stored = {name: m for name, m in everything.items() if not name.startswith(ignored_prefixes)}
    for name in expected:
        if name not in stored:
            raise CheckpointError(f"{params_dir}: tensor '{name}' is missing (expected shape {expected[name]})")
    for name, m in stored.items():
        if name not in expected:
            raise CheckpointError(f"{params_dir}: unexpected tensor '{name}' (not part of this model's config)")
        if tuple(m.shape) != expected[name]:
            raise CheckpointError(f"{params_dir}: tensor '{name}' has shape {tuple(m.shape)}, expected {expected[name]}")
        _check_dtype(params_dir, name, np.dtype(m.dtype).name, jnp.issubdtype(m.dtype, jnp.floating),
                     m.dtype == FP8_DTYPE, name in fp8)
    single = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    target = nest({n: jax.ShapeDtypeStruct(m.shape, dtypes[n] if dtypes is not None else m.dtype,
                                            sharding=shardings[n] if shardings is not None else single)
                   if n in stored else _orbax.placeholder() for n, m in everything.items()})  # placeholders: unread
    try:
        restored = _orbax.load(params_dir, target)
    except Exception as e:
        raise CheckpointError(f"{params_dir}: cannot be restored ({_one_line(e)})") from None
    return {n: a for n, a in flatten(restored).items() if n in stored}


# ----------------------------------------------------------------------------------------------------
# Public entry points


def is_drafter(config_raw: dict) -> bool:
    return DRAFTER_ARCHITECTURE in (config_raw.get("architectures") or [])


def _stored_shape(path: Path, name: str) -> tuple[int, ...] | None:
    """The shape a checkpoint folder stores for one tensor, read from headers or metadata only."""
    if checkpoint_format(path) == "orbax":
        try:
            return tuple(flatten(_orbax.metadata(path / "params"))[name].shape)
        except KeyError:
            return None
        except Exception as e:
            raise CheckpointError(f"{path / 'params'}: not a readable orbax checkpoint ({_one_line(e)})") from None
    files = _tensor_files(path)
    if name not in files:
        return None
    with _open(files[name]) as f:
        return tuple(f.get_slice(name).get_shape())


def _load(path: Path, abstract: ModelParams, dtype, tied: dict[str, str], progress: bool,
          parallel: Parallel | None) -> ModelParams:
    """`abstract` was built in `dtype` (or float32 when None): its dtypes are the loaded ones, FP8 weights and
    their float32 scales included; None keeps every stored dtype. Files hold HF names (`ModelParams.flat`);
    the projections the model packs (`PackedProjections`) are packed on the host (HF folders) or on the first
    device (orbax restores there), then every parameter goes onto its shards."""
    expected, fp8 = _expected_shapes(abstract), _fp8_names(abstract)
    if checkpoint_format(path) == "hf":
        bar = _progress_bar(f"loading {path.name}") if progress else None
        renames, ignored = stored_layout(abstract.config, expected)
        arrays = read_hf_arrays(path, expected, tied, bar, stored_names=renames, ignored_prefixes=ignored, fp8=fp8)
    else:
        stored_dtypes = None if dtype is None else {name: a.dtype for name, a in abstract.flat().items()}
        arrays = read_orbax_arrays(path, expected, stored_dtypes, None, fp8,
                                   ignored_prefixes=orbax_ignored(abstract.config))
    held = abstract.pack(arrays, consume=True)
    dtypes = None if dtype is None else {name: a.dtype for name, a in abstract.state_flat().items()}
    shardings = param_shardings(abstract, parallel) if parallel is not None else None
    return abstract.replace_state_flat(_to_device(held, dtypes, shardings))


def orbax_ignored(config) -> tuple[str, ...]:
    """Orbax folders keep our names: a target's, and the MTP head's (`mtp.`) when it was converted with one."""
    return BESIDE_MTP if isinstance(config, MTPConfig) else (mtp.PREFIX,)


def load_target(path: str | Path, dtype=jnp.bfloat16, progress: bool = False,
                parallel: Parallel | None = None) -> ModelParams:
    """Load a target checkpoint (HF or orbax folder) as `ModelParams` in `dtype` (None: as stored), each
    parameter placed by `parallel` (default: the first device).

    Qwen3 (`qwen3`) and Qwen3.5/3.6 (`qwen3_5_text`, or `qwen3_5` whose text weights sit under
    `model.language_model.`; its `model.visual.*` and `mtp.*` tensors are ignored: `load_mtp` reads the
    MTP head) targets."""
    path = Path(path)
    checkpoint_format(path)
    config = load_target_config(path)
    abstract = target_family(config).abstract(config, dtype or jnp.float32)
    return _load(path, abstract, dtype, tied_extras(config), progress, parallel)


def has_mtp_tensors(path: str | Path) -> bool:
    """Whether a checkpoint folder stores an MTP head (its `mtp.fc.weight`), from headers or metadata only."""
    return _stored_shape(Path(path), mtp.PREFIX + "fc.weight") is not None


def check_mtp(path: str | Path, target_config) -> MTPConfig:
    """The MTP head a target checkpoint folder (HF or orbax) ships, from its config and file headers alone: a
    target without one is a ConfigError (no `mtp_num_hidden_layers`) or a CheckpointError (no `mtp.*`)."""
    path = Path(path)
    config = mtp_config(target_config, str(path / "config.json"))
    if not has_mtp_tensors(path):
        raise CheckpointError(f"{path}: holds no '{mtp.PREFIX}*' tensors (no multi-token-prediction head), though "
                              f"config.json says mtp_num_hidden_layers={config.num_layers}; --mode mtp needs a "
                              "checkpoint that ships the head")
    return config


def load_mtp(path: str | Path, target_config, dtype=jnp.bfloat16, progress: bool = False,
             parallel: Parallel | None = None) -> ModelParams:
    """Load the multi-token-prediction head that a target checkpoint (HF or orbax) holds beside the target
    (`mtp.*`, `mtp_num_hidden_layers` layers: a Qwen3.5/3.6 checkpoint's own, or one trained for a dense Qwen3
    target, `write_mtp_beside`), as `ModelParams` of `models/mtp.py`; a target without one is an error before
    any weight is read (`check_mtp`)."""
    path = Path(path)
    config = check_mtp(path, target_config)
    return _load(path, mtp.abstract(config, dtype or jnp.float32), dtype, {}, progress, parallel)


MTP_FILE = "mtp.safetensors"  # where `write_mtp_beside` puts a trained head


def write_mtp_beside(path: str | Path, arrays: dict[str, np.ndarray], num_layers: int) -> Path:
    """Store an MTP head (`arrays`: {'mtp.*': array}, `num_layers` decoder layers) in an HF target folder, leaving
    the target's weight files as they are: the head in mtp.safetensors; model.safetensors.index.json mapping
    every tensor to its file (the target's single file or its shards, and the head's), as a sharded checkpoint;
    `mtp_num_hidden_layers` in config.json (inside `text_config` for a `qwen3_5` wrapper). transformers reads a
    folder that has model.safetensors from that file alone (it prefers the single file to an index), so it loads
    the target as before. A head this function stored earlier is replaced; one inside the target's own files is
    refused. Each file is written under a temporary name and then renamed, the index and config.json last."""
    from safetensors.numpy import save_file

    path = Path(path)
    if checkpoint_format(path) != "hf":
        raise CheckpointError(f"{path}: an MTP head is stored beside a Hugging Face folder's safetensors; convert "
                              "this orbax folder to HF first (conversions.convert orbax-to-hf)")
    if not arrays or any(not name.startswith(mtp.PREFIX) for name in arrays):
        raise CheckpointError(f"expected the head's tensors, all named '{mtp.PREFIX}*', got {sorted(arrays)[:3]}")
    files = {name: file for name, file in _tensor_files(path).items() if file.name != MTP_FILE}
    inside = sorted(name for name in files if name.startswith(mtp.PREFIX))
    if inside:
        raise CheckpointError(f"{files[inside[0]]}: already holds an MTP head ('{inside[0]}'); this folder's "
                              f"head is not replaced by one stored beside it")
    raw = read_config_json(path)
    (raw["text_config"] if raw.get("model_type") == "qwen3_5" else raw)["mtp_num_hidden_layers"] = num_layers

    umask = os.umask(0)
    os.umask(umask)

    def replace(name: str, write: Callable[[Path], None]) -> None:
        tmp = path / f".{name}.{os.getpid()}.tmp"
        write(tmp)
        os.chmod(tmp, 0o666 & ~umask)  # as any new file (safetensors writes 0600)
        os.replace(tmp, path / name)

    host = {name: np.ascontiguousarray(a) for name, a in sorted(arrays.items())}
    replace(MTP_FILE, lambda tmp: save_file(host, str(tmp), metadata={"format": "pt"}))
    weight_map = {name: file.name for name, file in files.items()} | {name: MTP_FILE for name in host}
    total = sum(file.stat().st_size - 8 - _header(file)[0] for file in {*files.values(), path / MTP_FILE})  # data
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    replace(INDEX_FILE, lambda tmp: tmp.write_text(json.dumps(index, indent=2) + "\n"))
    replace("config.json", lambda tmp: tmp.write_text(json.dumps(raw, indent=2) + "\n"))
    return path


def load_drafter(path: str | Path, target_config, dtype=jnp.bfloat16, *, allow_layer_mismatch: bool = False,
                 progress: bool = False, parallel: Parallel | None = None) -> ModelParams:
    """Load a DFlash drafter for `target_config`, checking the pair before reading any weights."""
    path = Path(path)
    checkpoint_format(path)
    config = load_drafter_config(path)
    check_pair(target_config, config, allow_layer_mismatch=allow_layer_mismatch, where=str(path / "config.json"))
    want = len(config.target_layer_ids) * target_config.hidden_size
    fc = _stored_shape(path, "fc.weight")
    if fc is not None and len(fc) == 2 and fc[1] != want:
        raise CheckpointError(
            f"{path}: tensor 'fc.weight' takes {fc[1]} input features, but len(target_layer_ids)="
            f"{len(config.target_layer_ids)} taps x the target's hidden_size {target_config.hidden_size} = {want}")
    abstract = dflash.abstract(config, target_config.hidden_size, dtype or jnp.float32)
    return _load(path, abstract, dtype, {}, progress, parallel)


def model_abstract(path: str | Path, raw: dict) -> tuple[ModelParams, dict[str, str]]:
    """(abstract float32 parameters, tied extras) of the target or drafter that config dict `raw` describes,
    for the checkpoint folder `path` (a drafter's context width is read from its stored `fc.weight`)."""
    path = Path(path)
    where = str(path / "config.json")
    if is_drafter(raw):
        config = parse_dflash(raw, where)
        fc = _stored_shape(path, "fc.weight")
        if fc is None or len(fc) != 2 or fc[1] % len(config.target_layer_ids):
            raise CheckpointError(f"{path}: tensor 'fc.weight' is missing or its input width {fc} is not a multiple "
                                  f"of the {len(config.target_layer_ids)} target_layer_ids")
        return dflash.abstract(config, fc[1] // len(config.target_layer_ids), jnp.float32), {}
    config = parse_target(raw, where)
    return target_family(config).abstract(config, jnp.float32), tied_extras(config)


def read_arrays(path: str | Path, progress: bool = False) -> tuple[dict[str, np.ndarray | jax.Array], dict]:
    """All parameters of a target or drafter checkpoint in their stored dtypes, plus the raw config dict; a
    target's MTP head (`mtp.*`) too when its config and files have one."""
    path = Path(path)
    fmt = checkpoint_format(path)
    raw = read_config_json(path)
    abstract, tied = model_abstract(path, raw)
    parts = [(abstract, tied)]
    if getattr(abstract.config, "mtp_num_hidden_layers", 0) and has_mtp_tensors(path):  # the target's MTP head too
        parts.append((mtp.abstract(mtp_config(abstract.config), jnp.float32), {}))
    arrays = {}
    for part, part_tied in parts:
        expected, fp8 = _expected_shapes(part), _fp8_names(part)
        if fmt == "hf":
            bar = _progress_bar(f"reading {path.name}") if progress else None
            renames, ignored = stored_layout(part.config, expected)
            arrays.update(read_hf_arrays(path, expected, part_tied, bar, stored_names=renames, ignored_prefixes=ignored,
                                         fp8=fp8))
        else:
            arrays.update(read_orbax_arrays(path, expected, fp8=fp8, ignored_prefixes=orbax_ignored(part.config)))
    return arrays, raw


def _progress_bar(desc: str):
    from tqdm import tqdm

    def make(total: int):
        bar = tqdm(total=total, desc=desc, unit="tensor", leave=False, disable=None)  # None: off when not a TTY

        def ticks():
            for _ in range(total):
                bar.update(1)
                yield
            bar.close()

        return ticks()

    return make


def copy_side_files(src: str | Path | None, dst: Path) -> None:
    if src is None:
        return
    for name in SIDE_FILES:
        if (Path(src) / name).exists():
            shutil.copy2(Path(src) / name, dst / name)


def atomic_folder(out: str | Path, write: Callable[[Path], None], *, force: bool = False) -> Path:
    """Run `write(tmp)` on a fresh temporary sibling of `out`, then rename it to `out`.

    An existing `out` is an error unless `force`; then it is replaced only after the write succeeded.
    """
    out = Path(out)
    if out.exists() and not force:
        raise CheckpointError(f"{out}: already exists (pass --force to overwrite)")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes 0700; the result should read like any new folder
    try:
        write(tmp)
        if out.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
            os.replace(out, old / out.name)
            os.replace(tmp, out)
            shutil.rmtree(old)
        else:
            os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
