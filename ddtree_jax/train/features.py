"""Extracted drafter features on disk: target-generated sequences and the target's tapped hidden states.

A features folder (written by `python -m ddtree_jax.train.extract`, read by `train.drafter --features`):

    manifest.json               what every shard holds, the settings, the target's fingerprint
    shard-00000.safetensors     tokens [n, L] int32 (right-padded with 0), starts [n] int32 (prompt
    shard-00001.safetensors     lengths: the first anchor), lengths [n] int32, taps [n, L, F] bfloat16
    ...                         (the target's layers `target_layer_ids` at every position, concatenated;
                                zero past each row's length)

A shard is written to a temporary name and renamed when complete, so a shard file that exists is whole;
manifest.json is rewritten (the same way) after each shard. `fingerprint` identifies a target by its
config and weights, so features are never used with another target than the one that made them.

`ShardStream` reads training batches from the shards: shuffled across and within shards, with only a
window of shards in memory (never the whole set), deterministic in the step so a resumed run sees the
same batches.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import json
import os
from pathlib import Path

import ml_dtypes
import numpy as np

FORMAT = "ddtree_jax.features/1"
MANIFEST = "manifest.json"
TAPS_DTYPE = ml_dtypes.bfloat16
# config.json fields that say how a checkpoint was saved, not what the model computes, and whether a trained
# MTP head sits beside the target (`train/mtp.py`): not the target itself.
UNFINGERPRINTED_FIELDS = frozenset({"torch_dtype", "dtype", "transformers_version", "_name_or_path",
                                    "mtp_num_hidden_layers"})
FINGERPRINT_SAMPLE = 64  # leading elements of each weight's first row that enter the fingerprint


class FeaturesError(ValueError):
    """A features folder that cannot be used as asked (printed as one `error:` line)."""


def shard_name(index: int) -> str:
    return f"shard-{index:05d}.safetensors"


def fingerprint(params, config_raw: dict) -> str:
    """sha256 (hex, 16 digits) of a target: its config.json (minus how it was saved: dtype, versions) and,
    per weight in name order, its name, shape and first FINGERPRINT_SAMPLE elements rounded to bfloat16.

    The rounding makes it independent of the compute dtype the target was loaded in (a float32 or bf16
    load of the same checkpoint give the same bf16 values), while any retraining changes the sample."""
    h = hashlib.sha256()
    config = {k: v for k, v in config_raw.items() if k not in UNFINGERPRINTED_FIELDS}
    h.update(json.dumps(config, sort_keys=True).encode())
    for name, array in sorted(params.flat().items()):
        first = array[(0,) * (array.ndim - 1)] if array.ndim > 1 else array
        sample = np.asarray(first[:FINGERPRINT_SAMPLE], np.float32).astype(ml_dtypes.bfloat16)
        h.update(f"{name}{tuple(array.shape)}".encode())
        h.update(sample.tobytes())
    return h.hexdigest()[:16]


# ----------------------------------------------------------------------------------------------------
# Writing


def write_json_atomic(path: Path, data: dict) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    os.replace(tmp, path)


def write_shard(folder: Path, index: int, tokens: np.ndarray, starts: np.ndarray, lengths: np.ndarray,
                taps: np.ndarray) -> dict:
    """Write one shard (temporary name, then rename); returns its manifest entry.

    tokens [n, L] int, starts [n], lengths [n], taps [n, L, F] (any float dtype: stored as bfloat16, and
    zeroed past each row's length)."""
    from safetensors.numpy import save_file

    n, width = tokens.shape
    inside = np.arange(width)[None, :] < lengths[:, None]
    arrays = {"tokens": np.ascontiguousarray(tokens, np.int32), "starts": np.asarray(starts, np.int32),
              "lengths": np.asarray(lengths, np.int32),
              "taps": np.where(inside[..., None], taps, 0).astype(TAPS_DTYPE)}
    path = folder / shard_name(index)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        save_file(arrays, str(tmp), metadata={"format": FORMAT})
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # safetensors creates files 0600; a shard should read like any new file
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return {"file": path.name, "sequences": int(n), "tokens": int(lengths.sum()),
            "generated_tokens": int((lengths - starts).sum()), "bytes": path.stat().st_size}


def remove_partial_shards(folder: Path) -> list[str]:
    """Delete shard files an interrupted run left under their temporary names; returns their names."""
    stale = sorted(folder.glob(".shard-*.safetensors.*.tmp"))
    for path in stale:
        path.unlink(missing_ok=True)
    return [p.name for p in stale]


# ----------------------------------------------------------------------------------------------------
# Reading


@dataclasses.dataclass(frozen=True)
class Features:
    """An extraction's manifest, read and checked (`open_features`)."""

    folder: Path
    manifest: dict

    @property
    def target_layer_ids(self) -> tuple[int, ...]:
        return tuple(self.manifest["target_layer_ids"])

    @property
    def shards(self) -> list[dict]:
        return self.manifest["shards"]

    @property
    def width(self) -> int:
        return int(self.manifest["sequence_width"])

    @property
    def tap_width(self) -> int:
        return int(self.manifest["tap_width"])

    def check_target(self, target_fingerprint: str, target_dir: Path) -> None:
        want = self.manifest["target"]["fingerprint"]
        if target_fingerprint != want:
            raise FeaturesError(
                f"{self.folder / MANIFEST}: the features were extracted from a target with fingerprint {want} "
                f"({self.manifest['target']['path']}), but {target_dir} has fingerprint {target_fingerprint}: "
                "another model or other weights (extract again with this target)")

    def load(self, index: int) -> dict[str, np.ndarray]:
        """All arrays of shard `index`."""
        from safetensors.numpy import load_file

        path = self.folder / self.shards[index]["file"]
        try:
            return load_file(str(path))
        except Exception as e:  # safetensors raises its own types for truncated or corrupt files
            raise FeaturesError(f"{path}: not a readable shard ({' '.join(str(e).split())})") from None


def open_features(folder: str | Path) -> Features:
    """Read and check a features folder: a complete extraction whose shard headers match the manifest."""
    from safetensors import safe_open

    folder = Path(folder)
    path = folder / MANIFEST
    try:
        manifest = json.loads(path.read_text())
    except FileNotFoundError:
        raise FeaturesError(f"{path}: not found (expected a folder written by python -m ddtree_jax.train.extract)") \
            from None
    except (OSError, ValueError) as e:
        raise FeaturesError(f"{path}: not readable JSON ({e})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise FeaturesError(f"{path}: 'format' is {manifest.get('format') if isinstance(manifest, dict) else None!r}, "
                            f"expected {FORMAT!r}")
    done, total = len(manifest["shards"]), manifest["num_shards"]
    if done < total:
        raise FeaturesError(f"{path}: the extraction is incomplete ({done} of {total} shards written); run the same "
                            "extract command again to finish it")
    features = Features(folder, manifest)
    width, taps = features.width, features.tap_width
    for entry in features.shards:
        n = entry["sequences"]
        want = {"tokens": ("I32", [n, width]), "starts": ("I32", [n]), "lengths": ("I32", [n]),
                "taps": ("BF16", [n, width, taps])}
        shard = folder / entry["file"]
        try:
            with safe_open(str(shard), framework="numpy") as f:
                have = {k: (f.get_slice(k).get_dtype(), list(f.get_slice(k).get_shape())) for k in f.keys()}
        except Exception as e:  # missing, truncated or corrupt
            raise FeaturesError(f"{shard}: not a readable shard ({' '.join(str(e).split())})") from None
        if have != want:
            raise FeaturesError(f"{shard}: holds {have}, but {MANIFEST} says {want}")
    return features


class ShardStream:
    """Training batches from some of a features folder's shards, shuffled, with bounded memory.

    Epoch e visits the shards in a random order (seeded by (seed, e)), `window` shards at a time, and the
    rows of those shards in a random order; batch i of an epoch is rows [i * batch, (i + 1) * batch) of
    that order (the last incomplete batch of an epoch is skipped). So rows of up to `window` shards mix
    within a batch, every row is seen once per epoch, and memory holds the shards of the windows the
    current batch overlaps plus the next window, read ahead in a background thread.
    Example: 4 shards of 3 rows, window 2, batch 4: an epoch is 12 rows in 3 batches; its first window
    might be shards (2, 0), their 6 rows shuffled, then shards (3, 1).
    """

    def __init__(self, features: Features, shards: list[int], *, batch: int, window: int, seed: int):
        self.features, self.shards, self.batch, self.window, self.seed = features, list(shards), batch, window, seed
        self.sizes = {s: features.shards[s]["sequences"] for s in self.shards}
        self.rows = sum(self.sizes.values())
        if batch > self.rows:
            raise FeaturesError(f"batch {batch} is larger than the {self.rows} training sequences in "
                                f"{len(self.shards)} shards")
        self.batches_per_epoch = self.rows // batch
        self._epoch: tuple[int, np.ndarray, np.ndarray, list[int]] | None = None
        self._loaded: dict[int, concurrent.futures.Future] = {}
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)
        self.max_loaded = 0  # the most shards held at once (for tests of the memory bound)

    def epoch_order(self, epoch: int) -> tuple[np.ndarray, np.ndarray, list[int]]:
        """(shard [rows], row [rows], window start offsets): the epoch's row order."""
        if self._epoch is None or self._epoch[0] != epoch:
            rng = np.random.default_rng((self.seed, epoch))
            order = [self.shards[i] for i in rng.permutation(len(self.shards))]
            shard_ids, row_ids, starts, offset = [], [], [], 0
            for w in range(0, len(order), self.window):
                group = order[w:w + self.window]
                s = np.concatenate([np.full(self.sizes[g], g) for g in group])
                r = np.concatenate([np.arange(self.sizes[g]) for g in group])
                perm = rng.permutation(len(s))
                shard_ids.append(s[perm])
                row_ids.append(r[perm])
                starts.append(offset)
                offset += len(s)
            self._epoch = (epoch, np.concatenate(shard_ids), np.concatenate(row_ids), starts)
        return self._epoch[1:]

    def _needed(self, epoch: int, lo: int, hi: int) -> tuple[set[int], set[int]]:
        """(the shards of the windows that rows [lo, hi) of the epoch overlap, those of the window after them;
        empty at the epoch's end)."""
        shard_ids, _, starts = self.epoch_order(epoch)
        bounds = [*starts, len(shard_ids)]
        first = int(np.searchsorted(bounds, lo, side="right")) - 1
        last = int(np.searchsorted(bounds, hi - 1, side="right")) - 1
        current = set(shard_ids[bounds[first]:bounds[last + 1]].tolist())
        ahead = set(shard_ids[bounds[last + 1]:bounds[last + 2]].tolist()) if last + 2 < len(bounds) else set()
        return current, ahead

    def batch_at(self, step: int) -> dict[str, np.ndarray]:
        """The rows of training step `step` (0-based): tokens [b, L], starts [b], lengths [b], taps [b, L, F]."""
        epoch, i = divmod(step, self.batches_per_epoch)
        shard_ids, row_ids, _ = self.epoch_order(epoch)
        lo, hi = i * self.batch, (i + 1) * self.batch
        current, ahead = self._needed(epoch, lo, hi)
        for shard in [s for s in self._loaded if s not in current | ahead]:
            del self._loaded[shard]
        for shard in sorted(current) + sorted(ahead - current):  # read ahead after what this batch needs
            if shard not in self._loaded:
                self._loaded[shard] = self._pool.submit(self.features.load, shard)
        self.max_loaded = max(self.max_loaded, len(self._loaded))
        s, r = shard_ids[lo:hi], row_ids[lo:hi]
        out = {k: np.empty((self.batch, *shape), dtype) for k, (shape, dtype) in self._row_layout().items()}
        for shard in np.unique(s):
            arrays = self._loaded[int(shard)].result()
            pick = s == shard
            for k in out:
                out[k][pick] = arrays[k][r[pick]]
        return out

    def _row_layout(self) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
        w, f = self.features.width, self.features.tap_width
        return {"tokens": ((w,), np.int32), "starts": ((), np.int32), "lengths": ((), np.int32),
                "taps": ((w, f), TAPS_DTYPE)}

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._loaded.clear()
