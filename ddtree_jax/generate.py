"""`python -m ddtree_jax.generate`: generate text from a local checkpoint (HF or orbax folder).

Streams text to the terminal and ends with one summary line on stderr, or prints one JSON object with
`--json`: {"mode", "output_ids", "text" (with a tokenizer), "acceptance_lengths", "tau", "new_tokens",
"decode_seconds", "tokens_per_second", "prefill_seconds", "compile_seconds"}, plus "block_size" and
"acceptance_histogram" for dflash and ddtree, and "budget" for ddtree.
Bad input (missing or corrupt checkpoint, unknown token ids, a request larger than the model's positions
or the device's memory, an output path that cannot be written, ...) prints one `error:` line and exits 2
before any long work.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ddtree_jax.cli import (TAU_HELP, BadInput, add_compilation_cache_args, add_dtype_arg, add_parallel_args,
                            check_token_ids, check_writable, load_tokenizer, mode_label, parallel_from_args,
                            parse_prompt_ids, resolve_dtype, setup_compilation_cache, summary_line, warn,
                            write_lines_atomic)

# bench.py and tools/greedy_equality.py still import BadInput, add_parallel_args, parallel_from_args and
# this name from here; they now live in ddtree_jax.cli.
_load_tokenizer = load_tokenizer

EXIT_BAD_INPUT = 2
# Provisional: the benchmark on real shapes will pick the default budget.
DEFAULT_BUDGET = 64
DEFAULT_PROMPT = "def fibonacci(n):"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m ddtree_jax.generate", description=__doc__.split("\n")[0],
                                epilog=TAU_HELP + ".", formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--target", type=Path, default=None,
                   help="target checkpoint folder (HF safetensors or orbax); default: the demo pair shipped "
                        "with the package (ddtree_jax/assets/demo)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompt", default=None,
                     help=f"prompt text (tokenized with the checkpoint's tokenizer); default {DEFAULT_PROMPT!r}")
    src.add_argument("--prompt-ids", default=None, help="prompt as comma-separated token ids, e.g. 1,2,3")
    p.add_argument("--chat", action="store_true", help="wrap --prompt in the tokenizer's chat template")
    p.add_argument("--mode", choices=["ddtree", "dflash", "ar"], default="ddtree", help="decoding mode")
    p.add_argument("--drafter", type=Path, default=None,
                   help="DFlash drafter checkpoint folder (ddtree and dflash modes); default with no "
                        "--target: the demo drafter")
    p.add_argument("--budget", type=int, default=DEFAULT_BUDGET,
                   help="DDTree: draft-tree nodes besides the root (the target verifies budget + 1 per round)")
    p.add_argument("--block-size", type=int, default=0,
                   help="drafter block: the bonus token + block-size - 1 drafts (0: the drafter's own)")
    p.add_argument("--save-trees", type=Path, default=None, metavar="FILE",
                   help="write every round's draft tree and accepted path here (JSON lines)")
    p.add_argument("--allow-layer-mismatch", action="store_true",
                   help="run a drafter whose num_target_layers differs from the target's layer count")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate at most (EOS stops earlier)")
    p.add_argument("--allow-long-context", action="store_true",
                   help="let the prompt plus --max-new-tokens go past the model's max_position_embeddings "
                        "(with a warning: positions the model was not trained on)")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature; 0 = greedy")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens; 0 = off")
    p.add_argument("--top-p", type=float, default=1.0,
                   help="sample among the most likely tokens holding this much probability; 1.0 = off")
    p.add_argument("--seed", type=int, default=0, help="random seed of the sampling (unused when greedy)")
    p.add_argument("--ignore-eos", action="store_true", help="do not stop at EOS")
    add_dtype_arg(p)
    p.add_argument("--kernels", choices=["auto", "jax", "pallas"], default="auto",
                   help="attention and acceptance: auto (the Pallas kernels on a GPU, pure JAX elsewhere; "
                        "$DDTREE_JAX_KERNELS=pallas|jax overrides auto), pure JAX, or the Pallas kernels "
                        "(interpreted without a GPU)")
    add_parallel_args(p)
    add_compilation_cache_args(p)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    p.add_argument("--stream-every", type=int, default=8, help="rounds per device call when streaming (>= 1)")
    return p


def parse_args(argv=None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def sampling_from_args(args):
    from ddtree_jax.sampling import SamplingConfig, SamplingError

    try:
        return SamplingConfig(args.temperature, args.top_k, args.top_p)
    except SamplingError as e:
        raise BadInput(f"--{e.field.replace('_', '-')}: expected {e.expected}, got {e.got}") from None


def check_flags(args) -> None:
    """What needs no checkpoint, so that bad flags fail at once."""
    for flag, value, minimum in (("--max-new-tokens", args.max_new_tokens, 1), ("--budget", args.budget, 1),
                                 ("--stream-every", args.stream_every, 1)):
        if value < minimum:
            raise BadInput(f"{flag}: expected >= {minimum}, got {value}")
    if args.block_size == 1 or args.block_size < 0:
        raise BadInput(f"--block-size: expected 0 (the drafter's) or >= 2, got {args.block_size}")


def _tokenize_prompt(args, tokenizer, folder: Path) -> list[int]:
    text = args.prompt if args.prompt is not None else DEFAULT_PROMPT
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


def check_request(target_dir: Path, target_config, drafter_dir: Path | None, drafter_config, options, dtype,
                  prompt_lengths: list[int], allow_long_context: bool):
    """Check a request before any weight is read: every prompt plus --max-new-tokens within the models'
    positions (or a warning with --allow-long-context), and the estimated device memory (weights, caches,
    verify buffers; `memory.estimate`) within what the device has. Returns the options resolved
    (block size, kernels) as `engine.generate` will run them."""
    from ddtree_jax.checkpoint import target_module
    from ddtree_jax.engine import resolve_options
    from ddtree_jax.memory import device_memory, estimate, format_bytes
    from ddtree_jax.models import dflash

    longest = max(prompt_lengths)
    tokens = longest + options.max_new_tokens
    asked = f"{longest} prompt tokens + --max-new-tokens {options.max_new_tokens} = {tokens} tokens"
    limits = [(target_config.max_position_embeddings, "target", target_dir)]
    if drafter_config is not None:
        limits.append((drafter_config.max_position_embeddings, "drafter", drafter_dir))
    for limit, name, folder in limits:
        if tokens > limit:
            where = f"the {name}'s max_position_embeddings {limit} ({folder / 'config.json'})"
            if not allow_long_context:
                raise BadInput(f"{asked}: beyond {where}; ask for fewer tokens, or pass --allow-long-context to "
                               "go past it")
            warn(f"{asked}: beyond {where}; the model was not trained on these positions")

    target = target_module(target_config).abstract(target_config, dtype)
    drafter = dflash.abstract(drafter_config, target_config.hidden_size, dtype) if drafter_config else None
    try:
        options = resolve_options(options, drafter, dtype)
    except ValueError as e:
        raise BadInput(str(e)) from None
    need = estimate(target, drafter, options, len(prompt_lengths), longest)
    have, what = device_memory()
    if need.total > have:
        raise BadInput(f"{asked} need about {format_bytes(need.total)} ({need.breakdown()}; a cache of "
                       f"{need.capacity} tokens per row), but the device has {format_bytes(have)} ({what}); ask "
                       "for fewer tokens")
    return options


def run(args: argparse.Namespace) -> dict:
    from ddtree_jax.checkpoint import load_drafter, load_target
    from ddtree_jax.config import check_pair, generation_eos_ids, load_drafter_config, load_target_config
    from ddtree_jax.demo_pair import DEMO_NOTE, demo_drafter, demo_target
    from ddtree_jax.engine import DecodeOptions, Mode, generate

    setup_compilation_cache(args)
    parallel = parallel_from_args(args)  # before any other device use: a multi-process run initialises here
    check_flags(args)
    sampling = sampling_from_args(args)
    prompt = parse_prompt_ids(args.prompt_ids) if args.prompt_ids is not None else None

    folder = args.target
    mode = Mode(args.mode)
    if folder is None:
        folder = demo_target()
        if args.drafter is None and mode.needs_drafter:
            args.drafter = demo_drafter()
        print(f"note: no --target given, so this runs the demo pair: {DEMO_NOTE}.", file=sys.stderr)
    if args.save_trees is not None:
        if not mode.needs_drafter:
            raise BadInput("--save-trees: needs --mode ddtree or dflash")
        check_writable(args.save_trees, "--save-trees")
    dtype = resolve_dtype(args.dtype)
    target_config = load_target_config(folder)
    drafter_config = None
    if mode.needs_drafter:
        if args.drafter is None:
            raise BadInput(f"--mode {mode.value} needs --drafter DIR (or --mode ar)")
        # The pair is checked from the configs alone, before any weights are read.
        drafter_config = load_drafter_config(args.drafter)
        check_pair(target_config, drafter_config, allow_layer_mismatch=args.allow_layer_mismatch,
                   where=str(args.drafter / "config.json"))
        if args.block_size > drafter_config.block_size:
            warn(f"--block-size {args.block_size} is above the drafter's block_size {drafter_config.block_size}: "
                 "it was not trained to draft that far, so expect fewer accepted tokens per round")
    tokenizer = load_tokenizer(folder)
    if prompt is None:
        prompt = _tokenize_prompt(args, tokenizer, folder)
    check_token_ids(prompt, target_config.vocab_size, "--prompt-ids" if args.prompt_ids is not None else "--prompt")
    eos = () if args.ignore_eos else tuple(dict.fromkeys(target_config.eos_token_ids + generation_eos_ids(folder)))
    options = DecodeOptions(mode=mode, max_new_tokens=args.max_new_tokens, sampling=sampling, eos_ids=eos,
                            block_size=args.block_size if mode.needs_drafter else 0, budget=args.budget,
                            record_trees=args.save_trees is not None, parallel=parallel, kernels=args.kernels)
    options = check_request(folder, target_config, args.drafter, drafter_config, options, dtype, [len(prompt)],
                            args.allow_long_context)

    params = load_target(folder, dtype, progress=not args.json, parallel=parallel)
    drafter = None
    if mode.needs_drafter:
        drafter = load_drafter(args.drafter, params.config, dtype, allow_layer_mismatch=args.allow_layer_mismatch,
                               progress=not args.json, parallel=parallel)
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
        "prefill_seconds": result.prefill_seconds,
        "compile_seconds": result.compile_seconds,
    }
    if tokenizer is not None:
        report["text"] = tokenizer.decode(out, skip_special_tokens=True)
    if mode.needs_drafter:
        report["block_size"] = options.block_size
        report["acceptance_histogram"] = result.acceptance_histogram(options.block_size)
    if mode is Mode.DDTREE:
        report["budget"] = args.budget
    if args.save_trees is not None:
        write_lines_atomic(args.save_trees, (json.dumps(row) for row in result.trees))
    if not args.json:
        if tokenizer is None:
            print(" ".join(map(str, out)))
        else:
            stream(result.output_ids)
            print()
    print(summary_line(mode_label(args.mode, args.budget, options.block_size), len(out), result.decode_seconds,
                       result.compile_seconds, None if mode is Mode.AR else result.tau), file=sys.stderr)
    return report


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
