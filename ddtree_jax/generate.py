"""`python -m ddtree_jax.generate`: generate text from a local checkpoint (HF or orbax folder).

One prompt: streams text to the terminal and ends with one summary line on stderr, or prints one JSON
object with `--json`: {"mode", "output_ids", "text" (with a tokenizer), "acceptance_lengths", "tau",
"new_tokens", "decode_seconds", "tokens_per_second", "prefill_seconds", "compile_seconds",
"matmul_precision", "split_k", "fp8_matmul" and "row_invariant" (as resolved)}, plus "block_size" and
"acceptance_histogram" for dflash, ddtree and mtp, "budget" for ddtree and "mtp_steps" for mtp; with `--budget
auto` "budget" is "auto", plus "auto_scope", "budget_candidates", "budgets_chosen" (the budget each round verified,
0 the chain), "calibration_seconds" and, per call, "auto_record" (each candidate's calls, tokens and decode seconds
so far, this call and its calibration included), per round "round_costs_s" (seconds per round of each candidate,
as used) and "change_cost_s" (seconds charged to a change of candidate).
Many prompts (`--prompts FILE.jsonl`): runs them in batches and writes one such JSON line per prompt, with
its "index", "line" and "id", to `--out` or stdout; a line that cannot run gets {"index", "line", "id",
"error"} instead, and the others still run (exit status 1 then).
Bad input (missing or corrupt checkpoint, unknown token ids, a request larger than the model's positions
or the device's memory, an output path that cannot be written, ...) prints one `error:` line and exits 2
before any long work.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from ddtree_jax.cli import (EXIT_BAD_INPUT, TAU_HELP, BadInput, ChatOptions, add_chat_args,
                            add_compilation_cache_args, add_dtype_arg, add_matmul_args, add_parallel_args, chat_options,
                            check_token_ids, check_writable, encode_prompt, load_tokenizer, mode_label,
                            parallel_from_args, parse_prompt_ids, read_prompt_file, resolve_dtype,
                            setup_compilation_cache, summary_line, warn, warn_unread_template_kwargs,
                            write_lines_atomic)

EXIT_PARTIAL = 1
DEFAULT_PROMPT = "def fibonacci(n):"


def build_parser() -> argparse.ArgumentParser:
    from ddtree_jax.budget import AUTO_SCOPES, CALIBRATION_CALLS, DEFAULT_CANDIDATES, candidates_text
    from ddtree_jax.round import DecodeOptions  # the API's defaults (its fixed budget among them)

    p = argparse.ArgumentParser(prog="python -m ddtree_jax.generate", description=__doc__.split("\n")[0],
                                epilog=TAU_HELP + ".", formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--target", type=Path, default=None,
                   help="target checkpoint folder (HF safetensors or orbax); default: the demo pair shipped "
                        "with the package (ddtree_jax/assets/demo)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompt", default=None,
                     help=f"prompt text (tokenized with the checkpoint's tokenizer); default {DEFAULT_PROMPT!r}")
    src.add_argument("--prompt-ids", default=None, help="prompt as comma-separated token ids, e.g. 1,2,3")
    src.add_argument("--prompts", type=Path, default=None, metavar="FILE.jsonl",
                     help='many prompts, one JSON object per line: {"prompt": TEXT}, {"messages": [...]} (chat '
                          'turns) or {"prompt_ids": [...]}, with an optional "id"; run in batches of --batch-size, '
                          "one JSON line out per prompt")
    p.add_argument("--batch-size", type=int, default=8,
                   help="--prompts: prompts decoded together (rows of unequal length share a batch)")
    p.add_argument("--out", type=Path, default=None, metavar="FILE.jsonl",
                   help="--prompts: write the JSON lines here (default: stdout)")
    add_chat_args(p)
    p.add_argument("--mode", choices=["ddtree", "dflash", "mtp", "ar"], default="ddtree",
                   help="decoding mode (mtp: the target's own multi-token-prediction head drafts, no --drafter)")
    p.add_argument("--drafter", type=Path, default=None,
                   help="DFlash drafter checkpoint folder (ddtree and dflash modes); default with no "
                        "--target: the demo drafter")
    p.add_argument("--budget", default="auto",
                   help="DDTree: auto (the default), the candidate of --budget-candidates that commits the most "
                        "tokens per second (--auto-scope; per call, a new model, device, batch or context first "
                        f"calibrates on {CALIBRATION_CALLS} calls, README), or a fixed number of draft-tree nodes "
                        f"besides the root (the target verifies budget + 1 per round; e.g. {DecodeOptions.budget})")
    p.add_argument("--budget-candidates", default=candidates_text(DEFAULT_CANDIDATES),
                   help="--budget auto: the budgets to choose from, comma-separated; chain (or 0) is a DFlash round")
    p.add_argument("--auto-scope", choices=list(AUTO_SCOPES), default=DecodeOptions.auto_scope,
                   help="--budget auto: choose once per call (batch) among the candidates' fixed programs by the "
                        "tokens per second measured on earlier calls (kept on disk), or every round on the device "
                        "from the drafter's tree and calibrated round costs")
    p.add_argument("--recalibrate", action="store_true",
                   help="--budget auto: per round, measure the round costs again even when the cost cache has them; "
                        "per call, start from an empty record, not the one kept on disk")
    p.add_argument("--mtp-steps", type=int, default=DecodeOptions.mtp_steps,
                   help="mtp: draft steps of the head per round (the target verifies mtp-steps + 1 tokens)")
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
    add_matmul_args(p)
    add_parallel_args(p)
    add_compilation_cache_args(p)
    p.add_argument("--json", action="store_true",
                   help="print one JSON object instead of streaming text (--prompts always writes JSON lines)")
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
    from ddtree_jax.budget import parse_candidates

    if args.budget == "auto":
        try:
            args.budget_candidates = parse_candidates(args.budget_candidates)
        except ValueError as e:
            raise BadInput(f"--budget-candidates: {e}") from None
    else:
        try:
            args.budget = int(args.budget)
        except ValueError:
            raise BadInput(f"--budget: expected an integer >= 1 or auto, got {args.budget!r}") from None
    for flag, value, minimum in (("--max-new-tokens", args.max_new_tokens, 1),
                                 ("--budget", 1 if args.budget == "auto" else args.budget, 1),
                                 ("--stream-every", args.stream_every, 1), ("--batch-size", args.batch_size, 1),
                                 ("--mtp-steps", args.mtp_steps, 1)):
        if value < minimum:
            raise BadInput(f"{flag}: expected >= {minimum}, got {value}")
    if args.block_size == 1 or args.block_size < 0:
        raise BadInput(f"--block-size: expected 0 (the drafter's) or >= 2, got {args.block_size}")
    if args.out is not None and args.prompts is None:
        raise BadInput("--out: needs --prompts FILE.jsonl (one prompt prints to stdout)")
    if args.save_trees is not None and args.prompts is not None:
        raise BadInput("--save-trees: one prompt at a time (not with --prompts)")
    if args.mode == "mtp" and args.drafter is not None:
        raise BadInput("--drafter: not used by --mode mtp (the target's own MTP head drafts)")
    if args.mode == "mtp" and args.block_size:
        raise BadInput("--block-size: not used by --mode mtp (--mtp-steps sets the chain: mtp-steps + 1 tokens)")
    if args.row_invariant:
        from ddtree_jax.models.contract import Kernels, resolve_kernels

        kernels = resolve_kernels(args.kernels, resolve_dtype(args.dtype))
        if kernels is not Kernels.PALLAS:
            raise BadInput(f"--row-invariant: needs the Pallas kernels (--kernels pallas); --kernels {args.kernels} "
                           f"means {kernels.value} here")
        if args.devices > 1 and args.parallel == "tp":
            raise BadInput("--row-invariant: one device or --parallel dp (its matmuls are not split over devices)")


@dataclasses.dataclass
class Request:
    """What a run needs before any weight is read: the checkpoints' configs and tokenizer, and the options."""

    folder: Path
    drafter_dir: Path | None  # the DFlash drafter's folder (None for ar and mtp)
    target_config: object
    drafter_config: object  # DFlashConfig; mtp: MTPConfig
    tokenizer: object
    chat: ChatOptions
    dtype: object
    options: object  # DecodeOptions as the flags give them (`check_memory` returns them resolved)


def prepare(args) -> Request:
    from ddtree_jax.checkpoint import check_mtp
    from ddtree_jax.config import check_pair, generation_eos_ids, load_drafter_config, load_target_config
    from ddtree_jax.demo_pair import DEMO_NOTE, demo_drafter, demo_target
    from ddtree_jax.engine import DecodeOptions, Mode

    setup_compilation_cache(args)
    parallel = parallel_from_args(args)  # before any other device use: a multi-process run initialises here
    check_flags(args)
    sampling = sampling_from_args(args)
    chat = chat_options(args)
    folder = args.target
    mode = Mode(args.mode)
    if folder is None:
        folder = demo_target()
        if args.drafter is None and mode in (Mode.DFLASH, Mode.DDTREE):
            args.drafter = demo_drafter()
        print(f"note: no --target given, so this runs the demo pair: {DEMO_NOTE}.", file=sys.stderr)
    if args.save_trees is not None:
        if not mode.needs_drafter:
            raise BadInput("--save-trees: needs --mode ddtree, dflash or mtp")
        check_writable(args.save_trees, "--save-trees")
    if args.out is not None:
        check_writable(args.out, "--out")
    dtype = resolve_dtype(args.dtype)
    target_config = load_target_config(folder)
    drafter_config = None
    if mode is Mode.MTP:  # the head ships in the target's folder; checked before any weight is read
        drafter_config = check_mtp(folder, target_config)
    elif mode.needs_drafter:
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
    warn_unread_template_kwargs(tokenizer, folder, chat)
    eos = () if args.ignore_eos else tuple(dict.fromkeys(target_config.eos_token_ids + generation_eos_ids(folder)))
    options = DecodeOptions(mode=mode, max_new_tokens=args.max_new_tokens, sampling=sampling, eos_ids=eos,
                            block_size=args.block_size if mode in (Mode.DFLASH, Mode.DDTREE) else 0,
                            budget=DecodeOptions.budget if args.budget == "auto" else args.budget,
                            budgets=args.budget_candidates if args.budget == "auto" and mode is Mode.DDTREE else (),
                            auto_scope=args.auto_scope,
                            mtp_steps=args.mtp_steps,
                            record_trees=args.save_trees is not None, parallel=parallel, kernels=args.kernels,
                            matmul_precision=args.matmul_precision, split_k=args.split_k,
                            fp8_matmul=args.fp8_matmul, row_invariant=args.row_invariant)
    return Request(folder, args.drafter if mode in (Mode.DFLASH, Mode.DDTREE) else None, target_config,
                   drafter_config, tokenizer, chat, dtype, options)


def past_positions(request: Request, prompt_length: int) -> str | None:
    """Why a prompt of this length plus --max-new-tokens goes past the target's or the drafter's
    max_position_embeddings, or None."""
    new = request.options.max_new_tokens
    tokens = prompt_length + new
    limits = [(request.target_config.max_position_embeddings, "target", request.folder)]
    if request.drafter_dir is not None:
        limits.append((request.drafter_config.max_position_embeddings, "drafter", request.drafter_dir))
    for limit, name, folder in limits:
        if tokens > limit:
            return (f"{prompt_length} prompt tokens + --max-new-tokens {new} = {tokens} tokens: beyond the {name}'s "
                    f"max_position_embeddings {limit} ({folder / 'config.json'})")
    return None


def check_positions(request: Request, prompt_length: int, allow_long_context: bool) -> None:
    """Refuse a prompt past the models' positions, or with --allow-long-context warn about it."""
    problem = past_positions(request, prompt_length)
    if problem and not allow_long_context:
        raise BadInput(f"{problem}; ask for fewer tokens, or pass --allow-long-context to go past it")
    if problem:
        warn(f"{problem}; the model was not trained on these positions")


def check_memory(request: Request, batch: int, longest: int):
    """Refuse a request whose estimated device memory (`memory.estimate`: weights, caches, verify buffers for
    `batch` rows of up to `longest` prompt tokens) exceeds what the device has, before any weight is read.
    Returns the options resolved (block size, kernels) as `engine.generate` will run them."""
    from ddtree_jax.engine import resolve_options
    from ddtree_jax.config import MTPConfig
    from ddtree_jax.memory import device_memory, estimate, format_bytes
    from ddtree_jax.models import dflash, mtp, target_family

    tc, dc, dtype = request.target_config, request.drafter_config, request.dtype
    target = target_family(tc).abstract(tc, dtype)
    drafter = None
    if dc is not None:
        drafter = mtp.abstract(dc, dtype) if isinstance(dc, MTPConfig) else dflash.abstract(dc, tc.hidden_size, dtype)
    try:
        options = resolve_options(request.options, drafter, dtype)
    except ValueError as e:
        raise BadInput(str(e)) from None
    need = estimate(target, drafter, options, batch, longest)
    have, what = device_memory()
    if need.total > have:
        rows = f"{batch} rows of " if batch > 1 else ""
        raise BadInput(f"{rows}{longest} prompt tokens + --max-new-tokens {options.max_new_tokens} = "
                       f"{longest + options.max_new_tokens} tokens need about {format_bytes(need.total)} "
                       f"({need.breakdown()}; a cache of {need.capacity} tokens per row), but the device has "
                       f"{format_bytes(have)} ({what}); ask for fewer tokens" + (" or a smaller --batch-size"
                                                                               if batch > 1 else ""))
    return options


def load_models(args, request: Request):
    from ddtree_jax.checkpoint import load_drafter, load_mtp, load_target
    from ddtree_jax.engine import Mode

    progress, parallel = not args.json and args.prompts is None, request.options.parallel
    params = load_target(request.folder, request.dtype, progress=progress, parallel=parallel)
    drafter = None
    if request.options.mode is Mode.MTP:
        drafter = load_mtp(request.folder, params.config, request.dtype, progress=progress, parallel=parallel)
    elif request.drafter_dir is not None:
        drafter = load_drafter(request.drafter_dir, params.config, request.dtype,
                               allow_layer_mismatch=args.allow_layer_mismatch, progress=progress, parallel=parallel)
    return params, drafter


def row_report(mode: str, options, result, row: int, tokenizer) -> dict:
    """The JSON report of one row of a GenerationResult (times are the whole call's: its rows ran together)."""
    from ddtree_jax.engine import Mode

    one = dataclasses.replace(result, output_ids=[result.output_ids[row]],
                              acceptance_lengths=[result.acceptance_lengths[row]], trees=None, budgets_chosen=None)
    out = one.output_ids[0]
    report = {
        "mode": mode,
        "output_ids": out,
        "acceptance_lengths": one.acceptance_lengths[0],
        "tau": one.tau,
        "new_tokens": len(out),
        "decode_seconds": result.decode_seconds,
        "tokens_per_second": len(out) / result.decode_seconds if result.decode_seconds > 0 else None,
        "prefill_seconds": result.prefill_seconds,
        "compile_seconds": result.compile_seconds,
        "matmul_precision": options.matmul_precision,  # what "auto" became
        "split_k": options.split_k,
        "fp8_matmul": options.fp8_matmul,
        "row_invariant": options.row_invariant,
    }
    if tokenizer is not None:
        report["text"] = tokenizer.decode(out, skip_special_tokens=True)
    if options.mode.needs_drafter:
        report["block_size"] = options.block_size
        report["acceptance_histogram"] = one.acceptance_histogram(options.block_size)
    if options.mode is Mode.DDTREE:
        report["budget"] = "auto" if options.auto_budget else options.budget
    if options.auto_budget:
        report["auto_scope"] = options.auto_scope
        report["budget_candidates"] = list(options.budgets)
        report["budgets_chosen"] = result.budgets_chosen[row]
        if options.auto_per_call:
            report["auto_record"] = result.auto_learned
        else:
            report["round_costs_s"] = result.round_costs
            report["change_cost_s"] = result.change_cost
        report["calibration_seconds"] = result.calibration_seconds
    if options.mode is Mode.MTP:
        report["mtp_steps"] = options.mtp_steps
    return report


def run(args: argparse.Namespace) -> dict:
    """One prompt (--prompt, --prompt-ids or the default): stream it, or return its JSON report."""
    from ddtree_jax.engine import Mode, generate

    request = prepare(args)
    if args.prompt_ids is not None:
        prompt, where = parse_prompt_ids(args.prompt_ids), "--prompt-ids"
    else:
        prompt, where = encode_prompt(request.tokenizer, request.folder, request.chat, "--prompt",
                                      text=args.prompt if args.prompt is not None else DEFAULT_PROMPT), "--prompt"
    check_token_ids(prompt, request.target_config.vocab_size, where)
    check_positions(request, len(prompt), args.allow_long_context)
    options = check_memory(request, 1, len(prompt))
    params, drafter = load_models(args, request)
    tokenizer = request.tokenizer
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
                          on_tokens=None if args.json else stream, recalibrate=args.recalibrate)
    except ValueError as e:
        raise BadInput(str(e)) from None
    report = row_report(args.mode, options, result, 0, tokenizer)
    if args.save_trees is not None:
        write_lines_atomic(args.save_trees, (json.dumps(row) for row in result.trees))
    if not args.json:
        if tokenizer is None:
            print(" ".join(map(str, report["output_ids"])))
        else:
            stream(result.output_ids)
            print()
    print(summary_line(mode_label(args.mode, args.budget, options.block_size, ran_per_call(options, result)),
                       report["new_tokens"],
                       result.decode_seconds, result.compile_seconds, None if options.mode is Mode.AR else result.tau,
                       calibration_seconds=result.calibration_seconds), file=sys.stderr)
    return report


def ran_per_call(options, result) -> list[int]:
    """`--budget auto` per call: the budget the call ran (0: the chain), once per row that ran a round; else []."""
    if not options.auto_per_call:
        return []
    return [chosen[0] for chosen in result.budgets_chosen if chosen]


def run_prompts(args: argparse.Namespace) -> int:
    """--prompts FILE.jsonl: every runnable line in batches of --batch-size; one JSON line per line of the
    file, in its order, to --out (written to a temporary file, renamed at the end) or stdout. Returns the
    exit status: 0, or EXIT_PARTIAL when some lines could not run (each reported by FILE:LINE)."""
    from tqdm import tqdm

    from ddtree_jax.engine import Mode, generate

    request = prepare(args)
    lines = read_prompt_file(args.prompts, request.tokenizer, request.folder, request.chat,
                             request.target_config.vocab_size)
    for i, line in enumerate(lines):
        problem = line.error is None and past_positions(request, len(line.ids))
        if problem and not args.allow_long_context:
            lines[i] = dataclasses.replace(line, ids=None, error=f"{args.prompts}:{line.line}: {problem}; ask for "
                                                                 "fewer tokens, or pass --allow-long-context")
    for line in lines:
        if line.error is not None:
            print(f"error: {line.error}", file=sys.stderr)
    runnable = [line for line in lines if line.error is None]
    if not runnable:
        raise BadInput(f"{args.prompts}: none of its {len(lines)} prompts can run")
    longest = max(len(line.ids) for line in runnable)
    if args.allow_long_context:
        check_positions(request, longest, True)
    options = check_memory(request, min(args.batch_size, len(runnable)), longest)
    params, drafter = load_models(args, request)

    records = {line.index: {"index": line.index, "line": line.line, "id": line.id, "error": line.error}
               for line in lines if line.error is not None}
    tokens, rounds, decode_s, compile_s, calibration_s, learned, ran = 0, [], 0.0, 0.0, 0.0, None, set()
    with tqdm(total=len(runnable), desc="prompts", unit="prompt", disable=None) as bar:
        for b, start in enumerate(range(0, len(runnable), args.batch_size)):
            batch = runnable[start:start + args.batch_size]
            try:  # --budget auto carries what it learned from batch to batch
                result = generate(params, [line.ids for line in batch], options, drafter=drafter,
                                  seed=args.seed + b, recalibrate=args.recalibrate and b == 0,
                                  auto_learned=learned)
            except ValueError as e:
                raise BadInput(str(e)) from None
            learned = result.auto_learned
            ran.update(ran_per_call(options, result))
            for row, line in enumerate(batch):
                records[line.index] = {"index": line.index, "line": line.line, "id": line.id,
                                       **row_report(args.mode, options, result, row, request.tokenizer)}
            tokens += result.new_tokens
            rounds += [n for row in result.acceptance_lengths for n in row]
            decode_s += result.decode_seconds
            compile_s += result.compile_seconds
            calibration_s += result.calibration_seconds
            bar.update(len(batch))
    out_lines = (json.dumps(records[i]) for i in range(len(lines)))
    if args.out is not None:
        write_lines_atomic(args.out, out_lines)
    else:
        for text in out_lines:
            print(text)
    failed = len(lines) - len(runnable)
    print(summary_line(mode_label(args.mode, args.budget, options.block_size, ran),
                       tokens, decode_s, compile_s,
                       None if options.mode is Mode.AR else sum(rounds) / len(rounds),
                       prompts=f"{len(runnable)} prompts" + (f" ({failed} failed)" if failed else ""),
                       calibration_seconds=calibration_s), file=sys.stderr)
    return EXIT_PARTIAL if failed else 0


def main(argv=None) -> int:
    args = parse_args(argv)
    from ddtree_jax.checkpoint import CheckpointError
    from ddtree_jax.config import ConfigError

    try:
        if args.prompts is not None:
            return run_prompts(args)
        report = run(args)
    except (BadInput, CheckpointError, ConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    if args.json:
        print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
