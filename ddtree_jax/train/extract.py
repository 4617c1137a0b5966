"""Extract a drafter's training data once: target-generated continuations and the target's tapped hidden states.

    python -m ddtree_jax.train.extract --target DIR --out DIR [--prompts FILE.jsonl] [--sequences N]
        [--prompt-len 64 --gen-len 192 --batch 256 --shard-mb 256 --devices N --max-new-shards K ...]

Then `python -m ddtree_jax.train.drafter --features DIR --out DRAFTER` trains from the shards without
running the target's layers again (`train/features.py` describes the folder).

1. Prompts: each line of a JSONL file (`{"prompt": ...}`, `{"prompt_ids": [...]}` or `{"messages": ...}`,
   as `generate --prompts` reads them; once each, or cycled to `--sequences`), else the built-in corpus
   (the Python standard library's training files, `corpus.py`): `--corpus-prompts functions` is every
   function's signature + docstring (the held-out prompts' style), `windows` random windows of
   `--prompt-len` tokens, `mixed` (default) every function prompt once, up to half of `--sequences`, and
   windows for the rest, in a seeded random order. A target without a tokenizer gets random token ids. Prompts keep their
   last `--prompt-len` tokens.
2. Continuations: the frozen target continues each prompt by `--gen-len` tokens (AR through the engine,
   greedy unless `--temperature`, EOS not stopping), `--batch` prompts per call.
3. Taps: one forward pass of the target over each whole sequence gives the outputs of the tap layers
   (`--target-layer-ids`, default spread as the published drafters: `drafter.build_target_layer_ids`).
4. Shards of `--shard-mb` (bf16 taps) are written to temporary names and renamed when complete, and the
   manifest is rewritten after each. An interrupted run is resumed by running the same command again:
   complete shards are kept, a partial one is discarded, and the settings, prompts and target must be the
   ones the folder was started with. `--max-new-shards K` stops after K more shards (extraction in
   pieces). The size of the whole extraction and the free disk space are printed before anything runs.

`--devices N` runs generation and taps data-parallel over N devices of this host (the rows of each
batch split over them).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import shutil
import sys
import time
from pathlib import Path

import jax
import numpy as np

from ddtree_jax.train import common, corpus, features
from ddtree_jax.train import drafter as drafter_lib

CORPUS_PROMPTS = ("mixed", "functions", "windows")


@dataclasses.dataclass
class ExtractConfig:
    target: Path
    out: Path
    prompts_file: Path | None = None
    random_prompts: bool = False
    corpus_prompts: str = "mixed"
    corpus_root: Path | None = None
    include_tests: bool = False
    max_files: int | None = None
    sequences: int | None = None  # default: each prompt of --prompts once, else DEFAULT_SEQUENCES
    prompt_len: int = 64
    gen_len: int = 192
    temperature: float = 0.0
    seed: int = 0
    num_taps: int | None = None
    target_layer_ids: tuple[int, ...] | None = None
    batch: int = 256  # sequences per device call (generation and taps)
    shard_mb: float = 256.0
    shard_sequences: int | None = None  # overrides shard_mb
    max_new_shards: int | None = None
    dtype: str = "auto"
    devices: int = 1


DEFAULT_SEQUENCES = 4096
TARGET_TAPS = jax.jit(drafter_lib.target_taps, static_argnums=3)  # one compiled program per shape and layer set


def sequence_bytes(width: int, tap_width: int) -> int:
    """Bytes one sequence takes in a shard: bf16 taps [L, F], int32 tokens [L], start and length."""
    return width * tap_width * 2 + width * 4 + 8


def corpus_function_prompts(tokenizer, prompt_len: int, *, corpus_root=None, include_tests: bool = False,
                            max_files: int | None = None) -> list[list[int]]:
    """Every function signature + docstring of the corpus's training files, tokenized, last `prompt_len`
    tokens kept (the held-out prompts' style, from the files the target trained on)."""
    train, _ = corpus.split_files(corpus.list_files(corpus_root, include_tests=include_tests))
    texts = [p for text in corpus.iter_texts(train[:max_files], corpus_root) for p in corpus.function_prompts(text)]
    return [ids[-prompt_len:] for ids in (tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts) if ids]


def build_prompts(cfg: ExtractConfig, tokenizer, target_dir: Path, vocab_size: int, mask_id: int
                  ) -> tuple[list[list[int]], str]:
    """(prompts, where they came from), `cfg.sequences` of them (default: DEFAULT_SEQUENCES, or each
    line of --prompts once)."""
    if cfg.prompts_file is not None:
        prompts = drafter_lib.file_prompts(cfg.prompts_file, tokenizer, target_dir, vocab_size, cfg.prompt_len)
        n = cfg.sequences or len(prompts)
        return [prompts[i % len(prompts)] for i in range(n)], f"JSONL {cfg.prompts_file}"
    n = cfg.sequences or DEFAULT_SEQUENCES
    if tokenizer is None or cfg.random_prompts:
        return drafter_lib.random_prompts(vocab_size, n, cfg.prompt_len, cfg.seed, (mask_id,)), "random token ids"
    kw = dict(corpus_root=cfg.corpus_root, include_tests=cfg.include_tests, max_files=cfg.max_files)
    functions: list[list[int]] = []
    if cfg.corpus_prompts in ("mixed", "functions"):
        functions = corpus_function_prompts(tokenizer, cfg.prompt_len, **kw)
        functions = [functions[i] for i in np.random.default_rng(cfg.seed).permutation(len(functions))]
        if not functions:
            raise ValueError("the corpus's training files have no function with a docstring")
    if cfg.corpus_prompts == "functions":
        return [functions[i % len(functions)] for i in range(n)], "corpus functions (signature + docstring)"
    functions = functions[:n // 2]
    windows = drafter_lib.corpus_prompts(tokenizer, n - len(functions), cfg.prompt_len, cfg.seed, **kw)
    source = "corpus windows" if not functions else f"corpus: {len(functions)} functions, {len(windows)} windows"
    mixed = functions + windows  # interleaved, so that every shard (the held-out ones too) has both kinds
    return [mixed[i] for i in np.random.default_rng((cfg.seed, 1)).permutation(len(mixed))], source


def prompts_digest(prompts: list[list[int]]) -> str:
    return hashlib.sha256(json.dumps(prompts).encode()).hexdigest()[:16]


def human_bytes(n: float) -> str:
    """Decimal units, as disks are sold: 24.2 GB is 24.2e9 bytes."""
    for unit in ("B", "KB", "MB"):
        if n < 1000:
            return f"{n:.0f} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} GB"


def continue_and_tap(target, prompts: list[list[int]], *, gen_len: int, width: int, batch: int, temperature: float,
                     seed: int, layer_ids: tuple[int, ...], parallel) -> drafter_lib.Sequences:
    """The target's continuations of `prompts` (rows right-padded to `width` tokens) and its taps [n, width, F]
    (bf16 host array), `batch` rows per device call (a multiple of the devices of a data-parallel `parallel`;
    short calls are padded with copies of their first row, so every call has one shape)."""
    from ddtree_jax.parallel import put, to_host

    batch = min(batch, -(-len(prompts) // parallel.size) * parallel.size)
    seqs = drafter_lib.generate_sequences(target, prompts, gen_len, batch=batch, temperature=temperature, seed=seed,
                                          parallel=parallel, width=width, progress=False)
    taps = np.zeros((len(prompts), width, len(layer_ids) * target.config.hidden_size), features.TAPS_DTYPE)
    for b0 in range(0, len(prompts), batch):
        rows = np.arange(b0, min(b0 + batch, len(prompts)))
        padded = np.concatenate([rows, np.full(batch - len(rows), rows[0])])
        tokens = put(seqs.tokens[padded], parallel.sharding(parallel.batch_spec(2)))
        lengths = put(seqs.lengths[padded], parallel.sharding(parallel.batch_spec(1)))
        taps[rows] = to_host(TARGET_TAPS(target, tokens, lengths, layer_ids))[:len(rows)].astype(features.TAPS_DTYPE)
    return dataclasses.replace(seqs, taps=taps)


def check_resumable(manifest: dict, settings: dict, folder: Path) -> None:
    """A folder can only be continued with the settings it was started with."""
    for key, value in settings.items():
        if manifest.get("settings", {}).get(key) != value:
            raise ValueError(f"{folder / features.MANIFEST}: holds an extraction with {key} = "
                             f"{json.dumps(manifest.get('settings', {}).get(key))}, this run has {json.dumps(value)} "
                             "(a folder continues only with the settings it was started with: use another --out)")


def extract(cfg: ExtractConfig) -> dict:
    """Write (or finish) the features folder; returns the manifest."""
    from ddtree_jax.checkpoint import load_target
    from ddtree_jax.config import load_target_config, read_config_json
    from ddtree_jax.parallel import Parallel, make_parallel
    from tqdm import tqdm

    out, target_dir = Path(cfg.out), Path(cfg.target)
    manifest_path = out / features.MANIFEST
    if out.exists() and (not out.is_dir() or (any(out.iterdir()) and not manifest_path.exists())):
        raise ValueError(f"{out}: exists and is not a features folder (no {features.MANIFEST}); choose an empty or "
                         "new --out")
    for flag, value in (("--prompt-len", cfg.prompt_len), ("--gen-len", cfg.gen_len), ("--batch", cfg.batch),
                        ("--devices", cfg.devices)):
        if value < 1:
            raise ValueError(f"{flag}: expected >= 1, got {value}")
    if cfg.corpus_prompts not in CORPUS_PROMPTS:
        raise ValueError(f"--corpus-prompts: expected one of {', '.join(CORPUS_PROMPTS)}, got {cfg.corpus_prompts!r}")
    tconf = load_target_config(target_dir)
    layer_ids = list(cfg.target_layer_ids or drafter_lib.build_target_layer_ids(
        tconf.num_layers, cfg.num_taps or drafter_lib.default_num_taps(tconf.num_layers)))
    if min(layer_ids) < 0 or max(layer_ids) >= tconf.num_layers or len(set(layer_ids)) != len(layer_ids):
        raise ValueError(f"--target-layer-ids {layer_ids}: expected distinct layers in 0..{tconf.num_layers - 1}")
    tokenizer = drafter_lib.load_target_tokenizer(target_dir)
    mask_id = drafter_lib.default_mask_token_id(tconf, tokenizer)
    parallel = make_parallel(cfg.devices, "dp") if cfg.devices > 1 else Parallel()
    batch = -(-cfg.batch // parallel.size) * parallel.size  # whole rows per device

    prompts, source = build_prompts(cfg, tokenizer, target_dir, tconf.vocab_size, mask_id)
    width, tap_width = cfg.prompt_len + cfg.gen_len, len(layer_ids) * tconf.hidden_size
    per_seq = sequence_bytes(width, tap_width)
    shard_seqs = cfg.shard_sequences or max(1, int(cfg.shard_mb * 1e6 // per_seq))
    num_shards = -(-len(prompts) // shard_seqs)
    settings = {"target_layer_ids": layer_ids, "prompt_len": cfg.prompt_len, "gen_len": cfg.gen_len,
                "temperature": cfg.temperature, "seed": cfg.seed, "sequences": len(prompts),
                "shard_sequences": shard_seqs, "prompts_sha256": prompts_digest(prompts)}
    manifest = json.loads(manifest_path.read_text()) if manifest_path.exists() else None
    if manifest is not None:
        check_resumable(manifest, settings, out)
        manifest["shards"] = [e for e in manifest["shards"] if (out / e["file"]).exists()]
    done = {e["file"] for e in manifest["shards"]} if manifest else set()
    todo = [i for i in range(num_shards) if features.shard_name(i) not in done]
    todo_seqs = sum(min(shard_seqs, len(prompts) - i * shard_seqs) for i in todo)
    total_bytes, todo_bytes = len(prompts) * per_seq, todo_seqs * per_seq
    existing = next(p for p in (out, *out.absolute().parents) if p.exists())
    free = shutil.disk_usage(existing).free
    say = lambda msg: print(f"extract: {msg}", file=sys.stderr, flush=True)  # noqa: E731
    say(f"{len(prompts)} sequences of {cfg.prompt_len} + {cfg.gen_len} tokens (prompts: {source}), taps of layers "
        f"{layer_ids} ({tap_width} features, bf16): {human_bytes(total_bytes)} in {num_shards} shards of up to "
        f"{shard_seqs} sequences; {len(todo)} shards ({human_bytes(todo_bytes)}) to write, "
        f"{human_bytes(free)} free in {out}")
    if todo_bytes > free:
        raise ValueError(f"--out {out}: {human_bytes(todo_bytes)} to write but only {human_bytes(free)} free")
    out.mkdir(parents=True, exist_ok=True)
    stale = features.remove_partial_shards(out)
    if stale:
        say(f"removed {len(stale)} partial shard(s) of an interrupted run: {', '.join(stale)}")
    if manifest is not None and not todo:
        say(f"{out} is complete: nothing to do")
        return manifest

    dtype = common.compute_dtype(cfg.dtype)
    target = load_target(target_dir, dtype, parallel=parallel)
    fp = features.fingerprint(target, read_config_json(target_dir))
    if manifest is not None and manifest["target"]["fingerprint"] != fp:
        raise ValueError(f"{manifest_path}: was started with a target of fingerprint "
                         f"{manifest['target']['fingerprint']}, but {target_dir} has fingerprint {fp} (another model "
                         "or other weights)")
    if manifest is None:
        manifest = {"format": features.FORMAT, "target": {
            "fingerprint": fp, "path": str(target_dir.absolute()), "model_type": tconf.model_type,
            "num_layers": tconf.num_layers, "hidden_size": tconf.hidden_size, "vocab_size": tconf.vocab_size},
            "target_layer_ids": layer_ids, "sequence_width": width, "tap_width": tap_width, "taps_dtype": "bfloat16",
            "arrays": {"tokens": ["int32", ["n", width]], "starts": ["int32", ["n"]], "lengths": ["int32", ["n"]],
                       "taps": ["bfloat16", ["n", width, tap_width]]},
            "prompt_source": source, "num_shards": num_shards, "settings": settings, "shards": []}
        features.write_json_atomic(manifest_path, manifest)

    bar = tqdm(total=len(prompts), initial=len(prompts) - todo_seqs, desc="extract", unit="seq", dynamic_ncols=True,
               disable=None)  # None: no bar when stderr is not a terminal
    written = 0
    try:
        for index in todo:
            if cfg.max_new_shards is not None and written >= cfg.max_new_shards:
                break
            t0 = time.perf_counter()
            lo = index * shard_seqs
            seqs = continue_and_tap(target, prompts[lo:lo + shard_seqs], gen_len=cfg.gen_len, width=width,
                                    batch=batch, temperature=cfg.temperature, seed=cfg.seed + lo,
                                    layer_ids=tuple(layer_ids), parallel=parallel)
            entry = features.write_shard(out, index, seqs.tokens, seqs.starts, seqs.lengths, seqs.taps)
            manifest["shards"] = sorted([*manifest["shards"], entry], key=lambda e: e["file"])
            features.write_json_atomic(manifest_path, manifest)
            written += 1
            bar.update(len(seqs))
            tqdm.write(f"extract: shard {index + 1}/{num_shards} written: {entry['sequences']} sequences, "
                       f"{human_bytes(entry['bytes'])}, {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    finally:
        bar.close()
    left = num_shards - len(manifest["shards"])
    say(f"{len(manifest['shards'])}/{num_shards} shards in {out}" +
        (f"; {left} left: run the same command again to continue" if left else ""))
    return manifest


def parse_args(argv=None) -> ExtractConfig:
    d = ExtractConfig(target=Path("."), out=Path("."))
    p = argparse.ArgumentParser(prog="python -m ddtree_jax.train.extract", description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--target", type=Path, required=True, help="target checkpoint folder (HF or orbax)")
    p.add_argument("--out", type=Path, required=True, help="features folder (created; a rerun continues it)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompts", dest="prompts_file", type=Path, default=None,
                     help="JSONL prompts ('prompt', 'prompt_ids' or 'messages' per line)")
    src.add_argument("--random-prompts", action="store_true", help="random token ids even if there is a tokenizer")
    p.add_argument("--corpus-prompts", choices=CORPUS_PROMPTS, default=d.corpus_prompts,
                   help="built-in corpus prompts: function signatures + docstrings, token windows, or both")
    p.add_argument("--corpus-root", type=Path, default=None, help="folder of .py files (default: the stdlib)")
    p.add_argument("--include-tests", action="store_true", help="the corpus's test folders too")
    p.add_argument("--max-files", type=int, default=None, help="prompts from the first N training files only")
    p.add_argument("--sequences", type=int, default=None,
                   help=f"sequences to extract (default: each --prompts line once, else {DEFAULT_SEQUENCES})")
    p.add_argument("--prompt-len", type=int, default=d.prompt_len, help="prompt tokens kept (the last ones)")
    p.add_argument("--gen-len", type=int, default=d.gen_len, help="target tokens generated per prompt")
    p.add_argument("--temperature", type=float, default=d.temperature, help="generation (0: greedy)")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--num-taps", type=int, default=None, help="target layers tapped (default: min(5, layers - 3))")
    p.add_argument("--target-layer-ids", default=None, help="comma-separated tap layers (overrides --num-taps)")
    p.add_argument("--batch", type=int, default=d.batch, help="sequences per device call")
    p.add_argument("--shard-mb", type=float, default=d.shard_mb, help="shard size")
    p.add_argument("--shard-sequences", type=int, default=None, help="sequences per shard (overrides --shard-mb)")
    p.add_argument("--max-new-shards", type=int, default=None,
                   help="write at most this many shards in this run (the same command continues later)")
    p.add_argument("--dtype", choices=["auto", "bfloat16", "float32"], default=d.dtype,
                   help="compute dtype (taps are stored as bf16); auto: bfloat16 on a GPU, else float32")
    p.add_argument("--devices", type=int, default=d.devices, help="data-parallel over this many devices")
    a = p.parse_args(argv)
    return ExtractConfig(
        target=a.target, out=a.out, prompts_file=a.prompts_file, random_prompts=a.random_prompts,
        corpus_prompts=a.corpus_prompts, corpus_root=a.corpus_root, include_tests=a.include_tests,
        max_files=a.max_files, sequences=a.sequences, prompt_len=a.prompt_len, gen_len=a.gen_len,
        temperature=a.temperature, seed=a.seed, num_taps=a.num_taps,
        target_layer_ids=drafter_lib.parse_layer_ids(a.target_layer_ids), batch=a.batch, shard_mb=a.shard_mb,
        shard_sequences=a.shard_sequences, max_new_shards=a.max_new_shards, dtype=a.dtype, devices=a.devices)


def main(argv=None) -> int:
    from ddtree_jax.checkpoint import CheckpointError
    from ddtree_jax.cli import BadInput
    from ddtree_jax.config import ConfigError

    cfg = parse_args(argv)
    try:
        manifest = extract(cfg)
    except (BadInput, CheckpointError, ConfigError, ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    shards = manifest["shards"]
    print(json.dumps({"out": str(cfg.out), "shards": len(shards), "num_shards": manifest["num_shards"],
                      "sequences": sum(e["sequences"] for e in shards), "bytes": sum(e["bytes"] for e in shards),
                      "fingerprint": manifest["target"]["fingerprint"]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
