"""`python -m ddtree_jax.doctor [--target DIR --drafter DIR]`: is this drafter wired right for this target?

Without `--target` it checks the demo pair shipped with the package (with `--mode mtp`, the demo target's head),
on its held-out prompts. With `--mode mtp` it checks the MTP head in the target's folder instead (no drafter: a
Qwen3.5/3.6 checkpoint's own, or one trained by `train.mtp`, as the demo target's): steps 1 and 2 with greedy MTP
rounds of `--mtp-steps` drafts (acceptance per draft step, tau, lossless against AR), no wirings to try; OK or WEAK.

1. Checks the pair from the configs (mask token, tap layers, widths, vocab, layer count) and loads
   both checkpoints strictly; any failure is one `error:` line and exit 2.
2. Runs a short greedy DFlash generation on a few prompts, prints the acceptance rate per draft position
   and tau, and checks that the output equals AR output (greedy DFlash is lossless).
3. Runs the same prompts with the likely miswirings of the drafter's config (same weights): tap layers
   shifted by -1 and +1, the tokenizer's mask-like tokens as the mask token, and the other causal /
   sliding-window reading where the config leaves it open. When one of them clearly beats the config as
   given (first draft position accepted +10 points, or tau +15%), the pair is MISWIRED: the report names
   the field and the value that fix it, exit 1. When none does and the first draft position is accepted
   in under 20% of rounds, the drafter is WEAK (wired as well as the doctor can tell), exit 1. Else OK,
   exit 0.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import numpy as np

from ddtree_jax.cli import (EXIT_BAD_INPUT, TAU_HELP, BadInput, add_chat_args, add_compilation_cache_args,
                            add_dtype_arg, add_parallel_args, atomic_path, chat_options, check_writable, encode_prompt,
                            load_tokenizer, parallel_from_args, read_prompt_file, resolve_dtype,
                            setup_compilation_cache, warn_unread_template_kwargs)

EXIT_FLAGGED = 1
FIRST_POSITION_FLOOR = 0.2
# An alternative wiring "clearly" beats the given one by this much first-position acceptance or this tau ratio.
FIRST_POSITION_GAIN = 0.10
TAU_GAIN = 1.15
DEFAULT_PROMPTS = (
    "def binary_search(items, target):",
    "The three laws of thermodynamics are",
    "import json\n\ndef load_config(path):",
    "Write a short story about a lighthouse keeper.",
)
# What a weak result may still come from, beyond the wirings the doctor tries.
UNTESTED_CAUSES = (
    "a mask token the tokenizer does not name (check dflash_config.mask_token_id against the drafter's card)",
    "tap layers off by more than one (taps must be HF hidden_states[l + 1], the output of layer l)",
    "the drafter was trained for another target (check num_target_layers and the target's exact version)",
    "prompts unlike the drafter's training data (e.g. chat prompts without the chat template or thinking "
    "setting it was trained with)",
)


@dataclasses.dataclass
class Trial:
    """One wiring the doctor ran: `field` = `value` changed in the drafter's config (None: as given)."""

    field: str | None
    value: object
    note: str
    tau: float
    first_position: float  # rate at which draft position 0 was accepted

    def label(self) -> str:
        if self.field is None:
            return "as given"
        return f"{self.field} = {json.dumps(self.value)}" + (f" ({self.note})" if self.note else "")


@dataclasses.dataclass
class Report:
    mode: str  # "dflash" or "mtp": what drafted
    prompts: int  # prompts decoded
    rounds: int
    tau: float
    position_acceptance: list[float]  # rate at which draft position j (0-based) was accepted
    lossless: bool  # greedy DFlash output == AR output
    first_divergence: int | None  # token index in the first differing row, if any
    verdict: str  # "ok", "weak" or "miswired"
    fix: Trial | None  # miswired: the wiring that clearly beats the given one
    trials: list[Trial]  # every wiring run, the given one first
    causes: list[str]  # weak: what else may be wrong

    @property
    def flagged(self) -> bool:
        return self.verdict != "ok"

    def as_dict(self) -> dict:
        return {**dataclasses.asdict(self), "flagged": self.flagged}


def position_acceptance(acceptance_lengths: list[list[int]], block_size: int) -> list[float]:
    """Per draft position j = 0 .. bs - 2: the fraction of rounds whose committed length was >= j + 2.

    A round that commits A tokens accepted drafts 0 .. A - 2 (the last token is the bonus).
    Example: rounds [1, 3, 2] with bs 4 -> position 0: 2/3, position 1: 1/3, position 2: 0.
    """
    rounds = np.array([n for row in acceptance_lengths for n in row])
    if rounds.size == 0:
        return [0.0] * (block_size - 1)
    return [float((rounds >= j + 2).mean()) for j in range(block_size - 1)]


def acceptance_table(rates: list[float]) -> list[str]:
    """The lines of the per-position table the doctor prints (and the drafter trainer, for its held-out
    prompts): position, rate, a bar of 40 characters at 100%."""
    return [f"  {j:3d}  {rate:6.1%}  {'#' * round(rate * 40)}" for j, rate in enumerate(rates)]


def _tau(acceptance_lengths: list[list[int]]) -> float:
    rounds = [n for row in acceptance_lengths for n in row]
    return float(np.mean(rounds)) if rounds else 0.0


def beats_clearly(alternative: Trial, given: Trial) -> bool:
    return (alternative.first_position >= given.first_position + FIRST_POSITION_GAIN
            or alternative.tau >= given.tau * TAU_GAIN)


# What a weak MTP head may come from (nothing to rewire: the head is the checkpoint's own).
MTP_CAUSES = (
    "the checkpoint's mtp.* weights were not trained with this target (or are placeholders)",
    "prompts unlike the model's training data (e.g. chat prompts without the chat template or thinking setting)",
)


def diagnose(acceptance_lengths: list[list[int]], block_size: int, lossless: bool, first_divergence: int | None,
             alternatives: list[Trial] = (), mode: str = "dflash") -> Report:
    """The verdict from the given wiring's acceptance and the alternatives' (Trials with a field set).
    `block_size`: drafts per round + 1 (MTP: its steps + 1)."""
    rates = position_acceptance(acceptance_lengths, block_size)
    tau = _tau(acceptance_lengths)
    given = Trial(None, None, "", tau, rates[0])
    better = [t for t in alternatives if beats_clearly(t, given)]
    fix = max(better, key=lambda t: (t.tau, t.first_position)) if better else None
    verdict = "miswired" if fix else "weak" if rates[0] < FIRST_POSITION_FLOOR else "ok"
    causes = MTP_CAUSES if mode == "mtp" else UNTESTED_CAUSES
    return Report(mode=mode, prompts=len(acceptance_lengths), rounds=sum(len(row) for row in acceptance_lengths),
                  tau=tau, position_acceptance=rates, lossless=lossless, first_divergence=first_divergence,
                  verdict=verdict, fix=fix, trials=[given, *alternatives],
                  causes=list(causes) if verdict == "weak" else [])


# ----------------------------------------------------------------------------------------------------
# The wirings tried


def mask_like_tokens(tokenizer, vocab_size: int) -> dict[int, str]:
    """{token id: what it is} of the tokens a drafter's mask token is likely to be: the tokenizer's mask
    token, its special / added tokens whose text says "mask", and the first embedding row past the
    tokenizer's vocabulary (where an added <|MASK|> lands: the published Qwen3 drafters' 151669)."""
    found: dict[int, str] = {}
    if tokenizer is None:
        return found
    if getattr(tokenizer, "mask_token_id", None) is not None:
        found[tokenizer.mask_token_id] = repr(tokenizer.mask_token)
    for token_id, token in sorted(getattr(tokenizer, "added_tokens_decoder", {}).items()):
        if "mask" in str(token).lower():
            found.setdefault(token_id, repr(str(token)))
    if len(tokenizer) < vocab_size:
        found.setdefault(len(tokenizer), "the first embedding row past the tokenizer's vocabulary")
    return {i: note for i, note in found.items() if 0 <= i < vocab_size}


def alternative_wirings(drafter_config, raw: dict, target_config, tokenizer) -> list[tuple[str, object, str, object]]:
    """(field, value, note, config) per likely miswiring of `drafter_config`, each a `dataclasses.replace`
    of it. `raw` is the drafter's config.json (for the sliding-window fields the parsed config drops)."""
    replace = dataclasses.replace
    out = []
    layers = drafter_config.target_layer_ids
    for shift in (-1, 1):
        moved = tuple(layer + shift for layer in layers)
        if min(moved) >= 0 and max(moved) < target_config.num_layers:
            out.append(("dflash_config.target_layer_ids", list(moved), f"shifted by {shift:+d}",
                        replace(drafter_config, target_layer_ids=moved)))
    for token_id, note in mask_like_tokens(tokenizer, target_config.vocab_size).items():
        if token_id != drafter_config.mask_token_id:
            out.append(("dflash_config.mask_token_id", token_id, note, replace(drafter_config, mask_token_id=token_id)))
    layer_types = raw.get("layer_types") or []
    sliding = [kind == "sliding_attention" for kind in layer_types]
    if any(sliding):
        # Sliding layers are causal in the current reference drafter unless is_causal says otherwise; the
        # first release made every layer non-causal.
        if raw.get("is_causal") is None:
            out.append(("is_causal", False, "no layer causal, as the first reference drafter",
                        replace(drafter_config, layer_causal=(False,) * drafter_config.num_layers)))
        if any(w is not None for w in drafter_config.layer_windows):
            out.append(("use_sliding_window", False, "no sliding window",
                        replace(drafter_config, layer_windows=(None,) * drafter_config.num_layers)))
        elif isinstance(raw.get("sliding_window"), int) and raw["sliding_window"] > 0:
            windows = tuple(raw["sliding_window"] if s else None for s in sliding)
            out.append(("use_sliding_window", True, f"window {raw['sliding_window']} on the sliding layers",
                        replace(drafter_config, layer_windows=windows)))
    return out


# ----------------------------------------------------------------------------------------------------
# Running


def doctor_prompts(args, tokenizer, chat, vocab_size: int, mask_id: int) -> list[list[int]]:
    """The first --num-prompts prompts of --prompts FILE.jsonl (as `generate --prompts` reads it; a bad line
    among them is an error), else the built-in ones (text, or random token ids without a tokenizer)."""
    if args.prompts is not None:
        lines = read_prompt_file(args.prompts, tokenizer, args.target, chat, vocab_size)[:args.num_prompts]
        for line in lines:
            if line.error is not None:
                raise BadInput(line.error)
        return [line.ids for line in lines]
    if tokenizer is not None:
        return [encode_prompt(tokenizer, args.target, chat, "built-in prompt", text=text)
                for text in DEFAULT_PROMPTS[:args.num_prompts]]
    rng = np.random.default_rng(0)
    choices = np.array([t for t in range(vocab_size) if t != mask_id])
    return [rng.choice(choices, size=12).tolist() for _ in range(args.num_prompts)]


def first_divergence(ar, spec) -> int | None:
    """The token index of the first difference in the first row where `spec`'s output differs from AR's."""
    for a, b in zip(ar.output_ids, spec.output_ids):
        if a != b:
            return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return None


def run(args) -> Report:
    from ddtree_jax.checkpoint import load_drafter, load_target
    from ddtree_jax.config import check_pair, load_drafter_config, load_target_config, read_config_json
    from ddtree_jax.engine import DecodeOptions, Mode, generate

    setup_compilation_cache(args)
    parallel = parallel_from_args(args)
    chat = chat_options(args)
    for flag, value in (("--num-prompts", args.num_prompts), ("--max-new-tokens", args.max_new_tokens),
                        ("--mtp-steps", args.mtp_steps)):
        if value < 1:
            raise BadInput(f"{flag}: expected >= 1, got {value}")
    if args.mode == "mtp":
        return run_mtp(args, parallel, chat)
    check_pair(load_target_config(args.target), load_drafter_config(args.drafter),
               allow_layer_mismatch=args.allow_layer_mismatch, where=str(args.drafter / "config.json"))
    dtype = resolve_dtype(args.dtype)
    target = load_target(args.target, dtype, parallel=parallel)
    drafter = load_drafter(args.drafter, target.config, dtype, allow_layer_mismatch=args.allow_layer_mismatch,
                           parallel=parallel)
    tokenizer = load_tokenizer(args.target)
    warn_unread_template_kwargs(tokenizer, args.target, chat)
    prompts = doctor_prompts(args, tokenizer, chat, target.config.vocab_size, drafter.config.mask_token_id)
    bs = args.block_size or drafter.config.block_size
    base = DecodeOptions(max_new_tokens=args.max_new_tokens, parallel=parallel)  # EOS ignored: more rounds
    dflash = dataclasses.replace(base, mode=Mode.DFLASH, block_size=bs)
    spec = generate(target, prompts, dflash, drafter=drafter)
    ar = generate(target, prompts, base)
    divergence = first_divergence(ar, spec)
    trials = []
    wirings = alternative_wirings(drafter.config, read_config_json(args.drafter), target.config, tokenizer)
    for field, value, note, config in wirings:
        result = generate(target, prompts, dflash, drafter=dataclasses.replace(drafter, config=config))
        trials.append(Trial(field, value, note, result.tau, position_acceptance(result.acceptance_lengths, bs)[0]))
    return diagnose(spec.acceptance_lengths, bs, divergence is None, divergence, trials)


def run_mtp(args, parallel, chat) -> Report:
    """The target's own MTP head (`--mode mtp`): greedy MTP rounds against AR on the prompts; a target without
    a head is an error before any weight is read (`checkpoint.check_mtp`)."""
    from ddtree_jax.checkpoint import check_mtp, load_mtp, load_target
    from ddtree_jax.config import load_target_config
    from ddtree_jax.engine import DecodeOptions, Mode, generate

    check_mtp(args.target, load_target_config(args.target))
    dtype = resolve_dtype(args.dtype)
    target = load_target(args.target, dtype, parallel=parallel)
    head = load_mtp(args.target, target.config, dtype, parallel=parallel)
    tokenizer = load_tokenizer(args.target)
    warn_unread_template_kwargs(tokenizer, args.target, chat)
    prompts = doctor_prompts(args, tokenizer, chat, target.config.vocab_size, mask_id=-1)
    base = DecodeOptions(max_new_tokens=args.max_new_tokens, parallel=parallel)  # EOS ignored: more rounds
    spec = generate(target, prompts, dataclasses.replace(base, mode=Mode.MTP, mtp_steps=args.mtp_steps), drafter=head)
    divergence = first_divergence(generate(target, prompts, base), spec)
    return diagnose(spec.acceptance_lengths, args.mtp_steps + 1, divergence is None, divergence, mode="mtp")


def print_report(report: Report, drafter: Path | None = None, out=None) -> None:
    out = out or sys.stdout
    print(f"rounds: {report.rounds}   tau (tokens per round, bonus included): {report.tau:.2f}", file=out)
    print("acceptance per draft position:", file=out)
    for line in acceptance_table(report.position_acceptance):
        print(line, file=out)
    name = {"dflash": "DFlash", "mtp": "MTP"}[report.mode]
    print(f"greedy {name} == AR: " + ("yes" if report.lossless else
                                      f"NO, first difference at token {report.first_divergence}"), file=out)
    if len(report.trials) > 1:
        print("wirings tried (same weights and prompts):", file=out)
        width = max(len(t.label()) for t in report.trials)
        print(f"  {'drafter config':<{width}}  first draft accepted    tau", file=out)
        for t in report.trials:
            print(f"  {t.label():<{width}}  {t.first_position:20.1%}  {t.tau:5.2f}", file=out)
    given = report.trials[0]
    if report.verdict == "miswired":
        fix = report.fix
        where = f" in {drafter / 'config.json'}" if drafter is not None else ""
        print(f"MISWIRED: with {fix.label()} the first draft position is accepted in {fix.first_position:.1%} of "
              f"rounds (as given: {given.first_position:.1%}) and tau is {fix.tau:.2f} (as given: {given.tau:.2f}). "
              f"Fix: set {fix.field} to {json.dumps(fix.value)}{where}.", file=out)
    elif report.verdict == "weak":
        tried = (f", and none of the {len(report.trials) - 1} other wirings tried does clearly better, so the "
                 "drafter is wired as well as the doctor can tell" if report.mode == "dflash" else "")
        print(f"WEAK: the first draft position is accepted in {given.first_position:.1%} of rounds "
              f"(< {FIRST_POSITION_FLOOR:.0%}){tried}. Possible causes:", file=out)
        for cause in report.causes:
            print(f"  - {cause}", file=out)
    else:
        print("OK: acceptance looks healthy" + (", and no other wiring tried does clearly better."
                                                if report.mode == "dflash" else "."), file=out)


def plot_report(report: Report, path: Path, title: str) -> None:
    """The acceptance rate per draft position as bars (tau in the title), written as a PNG to `path` through a
    temporary file beside it (no half-written file)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rates = report.position_acceptance
    fig, ax = plt.subplots(figsize=(7, 3.6), dpi=110)
    ax.bar(range(len(rates)), rates, color="C0")
    for j, rate in enumerate(rates):
        ax.text(j, rate + 0.01, f"{rate:.0%}", ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(rates)))
    ax.set_xlabel("draft position (0: the first draft after the bonus token)")
    ax.set_ylabel("rounds accepting it")
    ax.set_ylim(0, 1.08)
    ax.set_title(f"{title}\ntau {report.tau:.2f} tokens per round over {report.rounds} rounds", fontsize=9)
    fig.tight_layout()
    try:
        with atomic_path(path) as tmp:
            fig.savefig(tmp, format="png")
    finally:
        plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m ddtree_jax.doctor", description=__doc__.split("\n")[0],
                                epilog=TAU_HELP + ".", formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--target", type=Path, default=None, help="target folder (default: the shipped demo pair)")
    p.add_argument("--drafter", type=Path, default=None, help="drafter folder (default with no --target: the demo's)")
    p.add_argument("--mode", choices=("dflash", "mtp"), default="dflash",
                   help="what drafts: the DFlash --drafter, or the MTP head in the --target's folder (Qwen3.5/3.6, "
                        "or trained by python -m ddtree_jax.train.mtp)")
    p.add_argument("--mtp-steps", type=int, default=3, help="--mode mtp: the head's drafts per round")
    p.add_argument("--prompts", type=Path, default=None,
                   help="JSONL with 'prompt', 'messages' or 'prompt_ids' per line, as generate --prompts reads it "
                        "(default with no --target: the demo's held-out prompts; else a few built-in ones)")
    add_chat_args(p)
    p.add_argument("--num-prompts", type=int, default=4, help="prompts to run (the first ones of the file)")
    p.add_argument("--max-new-tokens", type=int, default=48, help="tokens generated per prompt (EOS ignored)")
    p.add_argument("--block-size", type=int, default=0, help="drafter block (0: the drafter's own)")
    add_dtype_arg(p)
    p.add_argument("--allow-layer-mismatch", action="store_true",
                   help="check a drafter whose num_target_layers differs from the target's layer count")
    p.add_argument("--json", action="store_true", help="print the report as one JSON object")
    p.add_argument("--plot", type=Path, default=None, metavar="FILE.png",
                   help="also draw the acceptance per draft position into this PNG")
    add_parallel_args(p)
    add_compilation_cache_args(p)
    args = p.parse_args(argv)

    from ddtree_jax.checkpoint import CheckpointError
    from ddtree_jax.config import ConfigError

    try:
        demo = args.target is None
        if demo:
            from ddtree_jax.demo_pair import DEMO_NOTE, demo_drafter, demo_prompts, demo_target

            args.target = demo_target()
            if args.mode == "dflash":
                args.drafter = args.drafter or demo_drafter()
            args.prompts = args.prompts or demo_prompts()
            what = "the demo target's MTP head" if args.mode == "mtp" else "the demo pair"
            print(f"note: no --target given, so this checks {what}: {DEMO_NOTE}.", file=sys.stderr)
        elif args.drafter is None and args.mode == "dflash":
            raise BadInput("--target needs --drafter DIR (or --mode mtp for the target's own MTP head)")
        if args.mode == "mtp" and args.drafter is not None:
            raise BadInput("--mode mtp checks the target's own MTP head: give --target DIR without --drafter")
        if args.plot is not None:
            check_writable(args.plot, "--plot")
        report = run(args)
    except (BadInput, CheckpointError, ConfigError, ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    if args.json:
        print(json.dumps(report.as_dict()))
    else:
        print_report(report, args.drafter)
    if args.plot is not None:
        target = "the demo target" if demo else args.target.name
        pair = (f"{target} + its MTP head" if report.mode == "mtp" else "the demo pair" if demo
                else f"{args.target.name} + {args.drafter.name}")
        prompts = report.prompts
        plot_report(report, args.plot, f"{pair}: greedy {'MTP' if report.mode == 'mtp' else 'DFlash'}, {prompts} "
                                       f"prompts x {args.max_new_tokens} tokens, "
                                       f"{np.dtype(resolve_dtype(args.dtype)).name}")
    return EXIT_FLAGGED if report.flagged else 0


if __name__ == "__main__":
    sys.exit(main())
