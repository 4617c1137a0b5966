"""`python -m ddtree_jax.doctor [--target DIR --drafter DIR]`: is this drafter right for this target?

Without `--target` it checks the demo pair shipped with the package, on its held-out prompts.

1. Checks the pair from the configs (mask token, tap layers, widths, vocab, layer count) and loads
   both checkpoints strictly; any failure is one `error:` line and exit 2.
2. Runs a short greedy DFlash generation on a few prompts, prints the acceptance rate per draft position
   and tau, and checks that the output equals AR output (greedy DFlash is lossless).
3. Flags pathological acceptance (first draft position accepted in under 20% of rounds) with its likely
   causes, exit 1. A healthy pair exits 0.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import numpy as np

from ddtree_jax.generate import add_parallel_args

EXIT_FLAGGED = 1
EXIT_BAD_INPUT = 2
FIRST_POSITION_FLOOR = 0.2
DEFAULT_PROMPTS = (
    "def binary_search(items, target):",
    "The three laws of thermodynamics are",
    "import json\n\ndef load_config(path):",
    "Write a short story about a lighthouse keeper.",
)
LIKELY_CAUSES = (
    "dflash_config.mask_token_id is not the mask token the drafter was trained with",
    "dflash_config.target_layer_ids are off by one (taps must be HF hidden_states[l + 1], the output of layer l)",
    "causal / sliding-window drafter layers are not honoured (layer_types, sliding_window, is_causal)",
    "the drafter was trained for another target (check num_target_layers and the target's exact version)",
)


@dataclasses.dataclass
class Report:
    rounds: int
    tau: float
    position_acceptance: list[float]  # rate at which draft position j (0-based) was accepted
    lossless: bool  # greedy DFlash output == AR output
    first_divergence: int | None  # token index in the first differing row, if any
    flagged: bool
    causes: list[str]

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def position_acceptance(acceptance_lengths: list[list[int]], block_size: int) -> list[float]:
    """Per draft position j = 0 .. bs - 2: the fraction of rounds whose committed length was >= j + 2.

    A round that commits A tokens accepted drafts 0 .. A - 2 (the last token is the bonus).
    Example: rounds [1, 3, 2] with bs 4 -> position 0: 2/3, position 1: 1/3, position 2: 0.
    """
    rounds = np.array([n for row in acceptance_lengths for n in row])
    if rounds.size == 0:
        return [0.0] * (block_size - 1)
    return [float((rounds >= j + 2).mean()) for j in range(block_size - 1)]


def diagnose(acceptance_lengths: list[list[int]], block_size: int, lossless: bool,
             first_divergence: int | None) -> Report:
    rates = position_acceptance(acceptance_lengths, block_size)
    rounds = [n for row in acceptance_lengths for n in row]
    flagged = rates[0] < FIRST_POSITION_FLOOR
    return Report(rounds=len(rounds), tau=float(np.mean(rounds)) if rounds else 0.0, position_acceptance=rates,
                  lossless=lossless, first_divergence=first_divergence, flagged=flagged,
                  causes=list(LIKELY_CAUSES) if flagged else [])


def _prompts(args, tokenizer, vocab_size: int, mask_id: int) -> list[list[int]]:
    if args.prompts is not None:
        out = []
        for n, line in enumerate(args.prompts.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                item = json.loads(line)
                ids = item["prompt_ids"] if "prompt_ids" in item else None
                text = item.get("prompt") if ids is None else None
            except (json.JSONDecodeError, AttributeError, TypeError):
                raise ValueError(f"{args.prompts}:{n}: expected a JSON object with 'prompt' or 'prompt_ids'") from None
            if ids is None:
                if not isinstance(text, str) or tokenizer is None:
                    raise ValueError(f"{args.prompts}:{n}: needs 'prompt_ids' (no tokenizer) or a 'prompt' string")
                ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            out.append([int(i) for i in ids])
        if not out:
            raise ValueError(f"{args.prompts}: no prompts")
        return out[:args.num_prompts]
    if tokenizer is not None:
        return [tokenizer(p, add_special_tokens=False)["input_ids"] for p in DEFAULT_PROMPTS[:args.num_prompts]]
    rng = np.random.default_rng(0)
    choices = np.array([t for t in range(vocab_size) if t != mask_id])
    return [rng.choice(choices, size=12).tolist() for _ in range(args.num_prompts)]


def run(args) -> Report:
    import jax.numpy as jnp

    from ddtree_jax.checkpoint import load_drafter, load_target
    from ddtree_jax.config import check_pair, load_drafter_config, load_target_config
    from ddtree_jax.engine import DecodeOptions, Mode, generate
    from ddtree_jax.generate import _load_tokenizer, parallel_from_args

    check_pair(load_target_config(args.target), load_drafter_config(args.drafter),
               allow_layer_mismatch=args.allow_layer_mismatch, where=str(args.drafter / "config.json"))
    dtype = {"bfloat16": jnp.bfloat16, "float32": jnp.float32}[args.dtype]
    parallel = parallel_from_args(args)
    target = load_target(args.target, dtype, parallel=parallel)
    drafter = load_drafter(args.drafter, target.config, dtype, allow_layer_mismatch=args.allow_layer_mismatch,
                           parallel=parallel)
    prompts = _prompts(args, _load_tokenizer(args.target), target.config.vocab_size, drafter.config.mask_token_id)
    bs = args.block_size or drafter.config.block_size
    base = DecodeOptions(max_new_tokens=args.max_new_tokens, parallel=parallel)  # EOS ignored: more rounds
    spec = generate(target, prompts, dataclasses.replace(base, mode=Mode.DFLASH, block_size=bs), drafter=drafter)
    ar = generate(target, prompts, base)
    divergence = None
    for a, b in zip(ar.output_ids, spec.output_ids):
        if a != b:
            divergence = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            break
    return diagnose(spec.acceptance_lengths, bs, divergence is None, divergence)


def print_report(report: Report, out=None) -> None:
    out = out or sys.stdout
    print(f"rounds: {report.rounds}   tau (tokens per round, bonus included): {report.tau:.2f}", file=out)
    print("acceptance per draft position:", file=out)
    for j, rate in enumerate(report.position_acceptance):
        print(f"  {j:3d}  {rate:6.1%}  {'#' * round(rate * 40)}", file=out)
    print("greedy DFlash == AR: " + ("yes" if report.lossless else
                                     f"NO, first difference at token {report.first_divergence}"), file=out)
    if report.flagged:
        print(f"FLAGGED: the first draft position is accepted in {report.position_acceptance[0]:.1%} of rounds "
              f"(< {FIRST_POSITION_FLOOR:.0%}). Likely causes:", file=out)
        for cause in report.causes:
            print(f"  - {cause}", file=out)
    else:
        print("OK: acceptance looks healthy for this pair.", file=out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m ddtree_jax.doctor", description=__doc__.split("\n")[0])
    p.add_argument("--target", type=Path, default=None, help="target folder (default: the shipped demo pair)")
    p.add_argument("--drafter", type=Path, default=None, help="drafter folder (default with no --target: the demo's)")
    p.add_argument("--prompts", type=Path, default=None,
                   help="JSONL with 'prompt' or 'prompt_ids' per line (default with no --target: the demo's "
                        "held-out prompts)")
    p.add_argument("--num-prompts", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--block-size", type=int, default=0, help="0: the drafter's own")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    p.add_argument("--allow-layer-mismatch", action="store_true")
    p.add_argument("--json", action="store_true", help="print the report as one JSON object")
    add_parallel_args(p)
    args = p.parse_args(argv)

    from ddtree_jax.checkpoint import CheckpointError
    from ddtree_jax.config import ConfigError
    from ddtree_jax.generate import BadInput

    try:
        if args.target is None:
            from ddtree_jax.demo_pair import DEMO_NOTE, demo_drafter, demo_prompts, demo_target

            args.target = demo_target()
            args.drafter = args.drafter or demo_drafter()
            args.prompts = args.prompts or demo_prompts()
            print(f"note: no --target given, so this checks the demo pair: {DEMO_NOTE}.", file=sys.stderr)
        elif args.drafter is None:
            raise BadInput("--target needs --drafter DIR")
        report = run(args)
    except (BadInput, CheckpointError, ConfigError, ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    if args.json:
        print(json.dumps(report.as_dict()))
    else:
        print_report(report)
    return EXIT_FLAGGED if report.flagged else 0


if __name__ == "__main__":
    sys.exit(main())
