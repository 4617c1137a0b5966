"""`python -m ddtree_jax.generate`: generate text from a local checkpoint (HF or orbax folder).

Streams text to the terminal, or prints one JSON object with `--json`:
  {"mode", "output_ids", "text" (with a tokenizer), "acceptance_lengths", "tau", "new_tokens",
   "decode_seconds", "tokens_per_second", "matmul_precision" (as resolved)}, plus "block_size" and
  "acceptance_histogram" for dflash and ddtree, and "budget" for ddtree.
Bad input (missing or corrupt checkpoint, unknown token ids, ...) prints one `error:` line and exits 2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

EXIT_BAD_INPUT = 2
# Provisional: the benchmark on real shapes will pick the default budget.
DEFAULT_BUDGET = 64


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m ddtree_jax.generate", description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--target", type=Path, default=None,
                   help="target checkpoint folder (HF safetensors or orbax); default: the demo pair shipped "
                        "with the package (ddtree_jax/assets/demo)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompt", default=None, help="prompt text (tokenized with the checkpoint's tokenizer)")
    src.add_argument("--prompt-ids", default=None, help="prompt as comma-separated token ids, e.g. 1,2,3")
    p.add_argument("--chat", action="store_true", help="wrap --prompt in the tokenizer's chat template")
    p.add_argument("--mode", choices=["ddtree", "dflash", "ar"], default="ddtree", help="decoding mode")
    p.add_argument("--drafter", type=Path, default=None,
                   help="DFlash drafter checkpoint folder (ddtree and dflash modes); default with no "
                        "--target: the demo drafter")
    p.add_argument("--budget", type=int, default=DEFAULT_BUDGET, help="DDTree: draft tree nodes besides the root")
    p.add_argument("--block-size", type=int, default=0, help="drafter block size (0: the drafter's own)")
    p.add_argument("--save-trees", type=Path, default=None,
                   help="write every round's draft tree and accepted path here (JSON lines)")
    p.add_argument("--allow-layer-mismatch", action="store_true",
                   help="run a drafter whose num_target_layers differs from the target's layer count")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument("--top-p", type=float, default=1.0, help="1.0 = off")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ignore-eos", action="store_true", help="do not stop at EOS")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    p.add_argument("--kernels", choices=["auto", "jax", "pallas"], default="auto",
                   help="attention and acceptance: auto (the Pallas kernels on a GPU, pure JAX elsewhere; "
                        "$DDTREE_JAX_KERNELS=pallas|jax overrides auto), pure JAX, or the Pallas kernels "
                        "(interpreted without a GPU)")
    p.add_argument("--matmul-precision", choices=["auto", "default", "high", "highest"], default="auto",
                   help="precision of every matmul: highest is true float32 (on a GPU, no TF32), default lets a "
                        "GPU round float32 inputs to TF32 (faster, not exact), high in between; auto: highest "
                        "for --dtype float32, default for bfloat16 (CPUs compute float32 fully either way)")
    add_parallel_args(p)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    p.add_argument("--stream-every", type=int, default=8, help="rounds per device call when streaming")
    return p.parse_args(argv)


class BadInput(Exception):
    pass


def add_parallel_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--devices", type=int, default=1, help="devices to run on (a one-axis mesh; all processes')")
    p.add_argument("--parallel", choices=["tp", "dp"], default="tp",
                   help="tp: split the models over the devices; dp: split the batch rows")
    p.add_argument("--coordinator", default=None,
                   help="multi-process runs: HOST:PORT of process 0 (jax.distributed.initialize)")
    p.add_argument("--num-processes", type=int, default=None, help="multi-process runs: number of processes")
    p.add_argument("--process-id", type=int, default=None, help="multi-process runs: this process's index")


def parallel_from_args(args):
    from ddtree_jax.parallel import init_distributed, make_parallel

    if args.coordinator is not None:
        if args.num_processes is None or args.process_id is None:
            raise BadInput("--coordinator needs --num-processes and --process-id")
        init_distributed(args.coordinator, args.num_processes, args.process_id)
    if args.devices < 1:
        raise BadInput(f"--devices: expected >= 1, got {args.devices}")
    try:
        return make_parallel(args.devices, args.parallel)
    except ValueError as e:
        raise BadInput(str(e)) from None


def _load_tokenizer(folder: Path):
    if not any((folder / f).exists() for f in ("tokenizer.json", "tokenizer_config.json")):
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(folder))
    except Exception as e:  # transformers raises many types for broken tokenizer files
        raise BadInput(f"{folder}: tokenizer cannot be loaded ({' '.join(str(e).split())})") from None


def _parse_prompt_ids(text: str) -> list[int]:
    try:
        ids = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise BadInput(f"--prompt-ids: expected comma-separated integers, got {text!r}") from None
    if not ids:
        raise BadInput("--prompt-ids: no token ids given")
    return ids


def _tokenize_prompt(args, tokenizer, folder: Path) -> list[int]:
    text = args.prompt if args.prompt is not None else "def fibonacci(n):"
    if tokenizer is None:
        raise BadInput(f"{folder}: no tokenizer.json or tokenizer_config.json; pass --prompt-ids instead of --prompt")
    if args.chat:
        if not getattr(tokenizer, "chat_template", None):
            raise BadInput(f"{folder}: the tokenizer has no chat template (drop --chat)")
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                            tokenize=True)
        ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    else:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if not ids:
        raise BadInput("--prompt: the prompt tokenizes to nothing")
    return list(ids)


def run(args: argparse.Namespace) -> dict:
    import jax.numpy as jnp

    from ddtree_jax.checkpoint import load_drafter, load_target
    from ddtree_jax.config import check_pair, generation_eos_ids, load_drafter_config, load_target_config
    from ddtree_jax.engine import DecodeOptions, Mode, generate, resolve_options
    from ddtree_jax.demo_pair import DEMO_NOTE, demo_drafter, demo_target
    from ddtree_jax.sampling import SamplingConfig

    parallel = parallel_from_args(args)  # first: a multi-process run must initialise before any device use
    # Check what needs no checkpoint first, so bad flags fail fast.
    if args.max_new_tokens < 1:
        raise BadInput(f"--max-new-tokens: expected >= 1, got {args.max_new_tokens}")
    try:
        sampling = SamplingConfig(args.temperature, args.top_k, args.top_p)
    except ValueError as e:
        raise BadInput(str(e)) from None
    prompt = _parse_prompt_ids(args.prompt_ids) if args.prompt_ids is not None else None

    folder = args.target
    mode = Mode(args.mode)
    if folder is None:
        folder = demo_target()
        if args.drafter is None and mode.needs_drafter:
            args.drafter = demo_drafter()
        print(f"note: no --target given, so this runs the demo pair: {DEMO_NOTE}.", file=sys.stderr)
    if args.budget < 1:
        raise BadInput(f"--budget: expected >= 1, got {args.budget}")
    if args.save_trees is not None and not mode.needs_drafter:
        raise BadInput("--save-trees: needs --mode ddtree or dflash")
    dtype = {"bfloat16": jnp.bfloat16, "float32": jnp.float32}[args.dtype]
    if mode.needs_drafter:
        if args.drafter is None:
            raise BadInput(f"--mode {mode.value} needs --drafter DIR (or --mode ar)")
        if args.block_size == 1 or args.block_size < 0:
            raise BadInput(f"--block-size: expected 0 (the drafter's) or >= 2, got {args.block_size}")
        # The pair is checked from the configs alone, before any weights are read.
        check_pair(load_target_config(folder), load_drafter_config(args.drafter),
                   allow_layer_mismatch=args.allow_layer_mismatch, where=str(args.drafter / "config.json"))
    params = load_target(folder, dtype, progress=not args.json, parallel=parallel)
    drafter = None
    if mode.needs_drafter:
        drafter = load_drafter(args.drafter, params.config, dtype, allow_layer_mismatch=args.allow_layer_mismatch,
                               progress=not args.json, parallel=parallel)
    tokenizer = _load_tokenizer(folder)
    if prompt is None:
        prompt = _tokenize_prompt(args, tokenizer, folder)
    eos = () if args.ignore_eos else tuple(dict.fromkeys(params.config.eos_token_ids + generation_eos_ids(folder)))
    options = DecodeOptions(mode=mode, max_new_tokens=args.max_new_tokens, sampling=sampling, eos_ids=eos,
                            block_size=args.block_size if mode.needs_drafter else 0, budget=args.budget,
                            record_trees=args.save_trees is not None, parallel=parallel, kernels=args.kernels,
                            matmul_precision=args.matmul_precision)

    printed = [""]

    def stream(rows):
        if tokenizer is None:
            return
        text = tokenizer.decode(rows[0], skip_special_tokens=True)
        if text.startswith(printed[0]) and not text.endswith("\ufffd"):
            sys.stdout.write(text[len(printed[0]):])
            sys.stdout.flush()
            printed[0] = text

    try:
        result = generate(params, [prompt], options, drafter=drafter, seed=args.seed,
                          steps_per_call=None if args.json else args.stream_every,
                          on_tokens=None if args.json else stream)
    except ValueError as e:
        raise BadInput(str(e)) from None
    out = result.output_ids[0]
    report = {
        "mode": args.mode,
        "output_ids": out,
        "acceptance_lengths": result.acceptance_lengths[0],
        "tau": result.tau,
        "new_tokens": len(out),
        "decode_seconds": result.decode_seconds,
        "tokens_per_second": len(out) / result.decode_seconds if result.decode_seconds > 0 else None,
        "matmul_precision": resolve_options(options, drafter, dtype).matmul_precision,  # what "auto" became
    }
    if tokenizer is not None:
        report["text"] = tokenizer.decode(out, skip_special_tokens=True)
    if mode.needs_drafter:
        block_size = args.block_size or drafter.config.block_size
        report["block_size"] = block_size
        report["acceptance_histogram"] = result.acceptance_histogram(block_size)
    if mode is Mode.DDTREE:
        report["budget"] = args.budget
    if args.save_trees is not None:
        _write_lines(args.save_trees, result.trees)
    if not args.json:
        if tokenizer is None:
            print(" ".join(map(str, out)))
        else:
            stream(result.output_ids)
            print()
        tps = report["tokens_per_second"]
        print(f"[{args.mode}] {len(out)} tokens in {result.decode_seconds:.3f} s"
              + (f" ({tps:.1f} tokens/s)" if tps else "") + f", tau {result.tau:.2f}", file=sys.stderr)
    return report


def _write_lines(path: Path, rows: list[dict]) -> None:
    """JSON lines, written to a temporary file and renamed."""
    import tempfile

    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def main(argv=None) -> int:
    args = parse_args(argv)
    from ddtree_jax.checkpoint import CheckpointError
    from ddtree_jax.config import ConfigError

    try:
        report = run(args)
    except (BadInput, CheckpointError, ConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    if args.json:
        print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
