"""Command-line plumbing shared by the entry points (generate, doctor, bench, convert).

Flags that several commands take (devices, dtype, compilation cache, chat), the one error type they print
as `error: ...` with exit status 2, tokenizer loading, prompts (text, chat, token ids, JSONL files), output
paths checked before any work and written atomically, and the one-line run summary.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import sys
import tempfile
from collections.abc import Iterable
from pathlib import Path

# Nothing at run time needs PyTorch; without it transformers prints an advisory on every import.
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

EXIT_BAD_INPUT = 2
DTYPE_CHOICES = ("auto", "bfloat16", "float32")
TAU_HELP = ("tau: tokens committed per decode round (the drafts the target accepted plus its own next token), "
            "averaged over rounds; AR's is 1, and tokens/s grows with it when a round costs about one AR step")


class BadInput(Exception):
    """A flag, prompt or path the command cannot use; printed as one `error:` line, exit status 2."""


def warn(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr)


# ----------------------------------------------------------------------------------------------------
# Flags several commands share


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


def add_dtype_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dtype", choices=DTYPE_CHOICES, default="auto",
                   help="weights and activations (logits and softmax are float32 always); auto: float32 on a "
                        "CPU, where bfloat16 buys no speed and its rounding can flip near-tied greedy tokens, "
                        "bfloat16 on an accelerator")


def add_matmul_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--matmul-precision", choices=["auto", "default", "high", "highest"], default="auto",
                   help="precision of every matmul: highest is true float32 (on a GPU, no TF32), default lets a "
                        "GPU round float32 inputs to TF32 (faster, not exact), high in between; auto: highest "
                        "for --dtype float32, default for bfloat16 (CPUs compute float32 fully either way)")
    p.add_argument("--split-k", choices=["auto", "xla", "off"], default="auto",
                   help="GPU: may XLA split a matmul's reduction into partial sums (xla: its autotuner decides) or "
                        "not (off); auto: off for dflash, ddtree and mtp (which verify several tokens per call), "
                        "xla for ar")
    p.add_argument("--fp8-matmul", choices=["auto", "dequantize", "stream", "w8a8"], default="auto",
                   help="FP8 weights: dequantize (XLA dequantises each weight, then multiplies) or stream (the "
                        "weight-streaming matmul reads the FP8 weight as stored and scales it inside: the Pallas "
                        "kernel with --kernels pallas, its jnp reference otherwise; one device, decode calls of few "
                        "rows, prefill dequantizes); w8a8: stream with each token's activations quantised to FP8 "
                        "per 128 features too (FP8 tensor cores; transformers' and vLLM's arithmetic for these "
                        "checkpoints, other outputs); auto: stream with the Pallas kernels on a GPU, else dequantize")
    p.add_argument("--row-invariant", action="store_true",
                   help="every token's arithmetic independent of the call's other tokens (the weight-streaming "
                        "matmul in 16-row tiles for the projections and the lm_head, the row-invariant attention "
                        "kernel): greedy DFlash and DDTree output equals AR bit for bit in bf16 on dense targets; "
                        "needs the Pallas kernels; slower (one device; calls of at most 128 tokens)")


def resolve_dtype(name: str):
    """'auto' | 'bfloat16' | 'float32' -> a jnp dtype; 'auto' is float32 on the CPU backend, bfloat16 elsewhere."""
    import jax
    import jax.numpy as jnp

    if name == "auto":
        name = "float32" if jax.default_backend() == "cpu" else "bfloat16"
    return {"bfloat16": jnp.bfloat16, "float32": jnp.float32}[name]


def add_compilation_cache_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--compilation-cache", type=Path, default=None, metavar="DIR",
                   help="folder of JAX's persistent compilation cache, so that a repeated run skips most "
                        "compilation; None: $JAX_COMPILATION_CACHE_DIR if set, else ddtree_jax/xla under "
                        "$XDG_CACHE_HOME or ~/.cache")
    p.add_argument("--no-compilation-cache", action="store_true", help="compile everything afresh and keep nothing")


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "ddtree_jax" / "xla"


def setup_compilation_cache(args) -> Path | None:
    """Point JAX's persistent compilation cache at the folder the flags name (call before anything compiles).

    Returns the folder, or None when the cache is off (--no-compilation-cache, or a folder that cannot be
    written: then a warning, and the run goes on without it)."""
    import jax

    if args.no_compilation_cache:
        jax.config.update("jax_enable_compilation_cache", False)
        return None
    folder = args.compilation_cache or Path(os.environ.get("JAX_COMPILATION_CACHE_DIR") or default_cache_dir())
    try:
        folder.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=folder).close()
    except OSError as e:
        warn(f"compilation cache {folder}: cannot write there ({e.strerror or e}); compiling without it")
        jax.config.update("jax_enable_compilation_cache", False)
        return None
    jax.config.update("jax_compilation_cache_dir", str(folder))
    if "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in os.environ:
        # JAX keeps only programs that took >= 1 s to compile; the demo's smaller ones add up, so keep all.
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    return folder


# ----------------------------------------------------------------------------------------------------
# Tokenizer and prompts


def load_tokenizer(folder: Path):
    """The checkpoint folder's tokenizer (transformers AutoTokenizer), or None when it has no tokenizer files."""
    if not any((folder / f).exists() for f in ("tokenizer.json", "tokenizer_config.json")):
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(folder))
    except Exception as e:  # transformers raises many types for broken tokenizer files
        raise BadInput(f"{folder}: tokenizer cannot be loaded ({' '.join(str(e).split())})") from None


def parse_prompt_ids(text: str, flag: str = "--prompt-ids") -> list[int]:
    try:
        ids = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise BadInput(f"{flag}: expected comma-separated integers, got {text!r}") from None
    if not ids:
        raise BadInput(f"{flag}: no token ids given")
    return ids


def check_token_ids(ids: list[int], vocab_size: int, where: str) -> None:
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise BadInput(f"{where}: token id {bad[0]} is outside the vocabulary (0..{vocab_size - 1})")


@dataclasses.dataclass(frozen=True)
class ChatOptions:
    """How text prompts become token ids: as they are (`chat` False), or through the tokenizer's chat template
    with an optional system turn and keyword arguments for the template (e.g. enable_thinking)."""

    chat: bool = False
    system: str | None = None
    template_kwargs: dict = dataclasses.field(default_factory=dict)


def add_chat_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--chat", action="store_true", help="wrap text prompts in the tokenizer's chat template")
    p.add_argument("--thinking", action=argparse.BooleanOptionalAction, default=None,
                   help="with --chat: the template's enable_thinking switch (Qwen3 templates: on unless "
                        "--no-thinking); the published Qwen3 DFlash drafters were trained with --no-thinking; "
                        "default: the template's own")
    p.add_argument("--system", default=None, metavar="TEXT", help="with --chat: a system turn before the user's")
    p.add_argument("--chat-template-kwargs", default=None, metavar="JSON",
                   help="with --chat: more variables for the chat template, as a JSON object, e.g. "
                        "'{\"enable_thinking\": false}'")


def chat_options(args) -> ChatOptions:
    """ChatOptions from the flags of `add_chat_args`; the chat-only flags need --chat."""
    kwargs = {}
    if args.chat_template_kwargs is not None:
        try:
            kwargs = json.loads(args.chat_template_kwargs)
        except json.JSONDecodeError as e:
            raise BadInput(f"--chat-template-kwargs: not JSON ({e.msg}): {args.chat_template_kwargs!r}") from None
        if not isinstance(kwargs, dict):
            raise BadInput(f"--chat-template-kwargs: expected a JSON object, got {args.chat_template_kwargs!r}")
    if args.thinking is not None:
        if kwargs.get("enable_thinking", args.thinking) != args.thinking:
            raise BadInput(f"--{'' if args.thinking else 'no-'}thinking contradicts --chat-template-kwargs "
                           f"enable_thinking={json.dumps(kwargs['enable_thinking'])}")
        kwargs["enable_thinking"] = args.thinking
    given = [flag for flag, value in (("--thinking/--no-thinking", args.thinking), ("--system", args.system),
                                      ("--chat-template-kwargs", args.chat_template_kwargs)) if value is not None]
    if given and not args.chat:
        raise BadInput(f"{given[0]}: needs --chat (it sets the chat template)")
    return ChatOptions(chat=args.chat, system=args.system, template_kwargs=kwargs)


def warn_unread_template_kwargs(tokenizer, folder: Path, chat: ChatOptions) -> None:
    """A template variable the chat template never mentions changes nothing: say so (e.g. --no-thinking on a
    template without a thinking switch)."""
    template = str(getattr(tokenizer, "chat_template", None) or "")
    for name in chat.template_kwargs:
        if template and name not in template:
            warn(f"the chat template in {folder} never reads {name!r}, so setting it changes nothing")


def encode_prompt(tokenizer, folder: Path, chat: ChatOptions, where: str, *, text: str | None = None,
                  messages: list | None = None) -> list[int]:
    """Token ids of a text prompt (plain, or a user turn of the chat template with `chat.chat`) or of chat
    `messages` (always through the template). `chat.system` adds a system turn unless `messages` has one.
    `where` names the flag or file line in errors."""
    if tokenizer is None:
        raise BadInput(f"{where}: {folder} has no tokenizer.json or tokenizer_config.json, so prompts must be "
                       "token ids (--prompt-ids, or 'prompt_ids' lines)")
    if messages is None and not chat.chat:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    else:
        if not getattr(tokenizer, "chat_template", None):
            raise BadInput(f"{where}: the tokenizer in {folder} has no chat template" +
                           (" (drop --chat)" if messages is None else ""))
        if messages is None:
            messages = [{"role": "user", "content": text}]
        if not isinstance(messages, list) or not all(isinstance(m, dict) and isinstance(m.get("role"), str)
                                                      and isinstance(m.get("content"), str) for m in messages):
            raise BadInput(f"{where}: 'messages' must be a list of {{\"role\": ..., \"content\": ...}} objects")
        if chat.system is not None and not any(m["role"] == "system" for m in messages):
            messages = [{"role": "system", "content": chat.system}, *messages]
        try:
            ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                **chat.template_kwargs)
        except Exception as e:  # the template's own errors (jinja raise_exception, ...)
            raise BadInput(f"{where}: the chat template failed ({' '.join(str(e).split())})") from None
        ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    if not ids:
        raise BadInput(f"{where}: the prompt is empty (no tokens)")
    return list(ids)


@dataclasses.dataclass(frozen=True)
class PromptLine:
    """One prompt of a JSONL file: `index` among the file's prompts (blank lines skipped), `line` its line
    number, `id` the line's "id" field if any; `ids` its token ids, or `error` why it cannot run."""

    index: int
    line: int
    id: object
    ids: list[int] | None
    error: str | None = None


def read_prompt_file(path: Path, tokenizer, folder: Path, chat: ChatOptions, vocab_size: int) -> list[PromptLine]:
    """Prompts of a JSONL file, one JSON object per line: {"prompt": TEXT}, {"messages": [...]} (chat turns)
    or {"prompt_ids": [...]}, plus an optional "id". A line that cannot run (not JSON, none or several of
    those keys, an empty prompt, token ids outside the vocabulary) keeps its error, naming FILE:LINE, so
    the others can still run; an unreadable or empty file is a BadInput."""
    try:
        text = Path(path).read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise BadInput(f"{path}: cannot be read ({getattr(e, 'strerror', None) or e})") from None
    out = []
    for n, raw in enumerate(text.splitlines(), 1):
        if not raw.strip():
            continue
        where, item = f"{path}:{n}", None
        try:
            item = json.loads(raw)
            keys = [k for k in ("prompt", "messages", "prompt_ids") if isinstance(item, dict) and k in item]
            if len(keys) != 1:
                raise BadInput(f"{where}: expected a JSON object with one of 'prompt', 'messages' or 'prompt_ids'")
            value = item[keys[0]]
            if keys[0] == "prompt_ids":
                if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool)
                                                          for t in value):
                    raise BadInput(f"{where}: 'prompt_ids' must be a list of integers")
                if not value:
                    raise BadInput(f"{where}: the prompt is empty (no tokens)")
                ids = value
            elif keys[0] == "prompt":
                if not isinstance(value, str):
                    raise BadInput(f"{where}: 'prompt' must be a string")
                ids = encode_prompt(tokenizer, folder, chat, where, text=value)
            else:
                ids = encode_prompt(tokenizer, folder, chat, where, messages=value)
            check_token_ids(ids, vocab_size, where)
            error = None
        except json.JSONDecodeError as e:
            ids, error = None, f"{where}: not JSON ({e.msg})"
        except BadInput as e:
            ids, error = None, str(e)
        out.append(PromptLine(len(out), n, item.get("id") if isinstance(item, dict) else None, ids, error))
    if not out:
        raise BadInput(f"{path}: no prompts")
    return out


# ----------------------------------------------------------------------------------------------------
# Output files


def check_writable(path: Path, flag: str, *, folder: bool = False) -> None:
    """Refuse an output path before any work: a folder where a file goes (or the reverse), a parent that is
    a file, or a place where nothing can be created (tested by creating and removing a temporary file in
    the nearest existing folder, which also holds where permission bits do not, e.g. for root)."""
    path = Path(path)
    if not folder and path.is_dir():
        raise BadInput(f"{flag} {path}: is a folder (expected a file name)")
    if folder and path.exists() and not path.is_dir():
        raise BadInput(f"{flag} {path}: is a file (expected a folder name)")
    parent = path.absolute().parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise BadInput(f"{flag} {path}: {parent} is a file, not a folder")
    try:
        tempfile.TemporaryFile(dir=parent).close()
    except OSError as e:
        raise BadInput(f"{flag} {path}: cannot write in {parent} ({e.strerror or e})") from None


@contextlib.contextmanager
def atomic_path(path: Path):
    """A temporary path beside `path` for the block to write; renamed into place when the block ends without
    an error, removed otherwise (no half-written file at `path`)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_lines_atomic(path: Path, lines) -> None:
    """Write text lines to a temporary file beside `path`, then rename it into place (no half-written file).
    The file gets the usual permissions (0666 less the umask), not mkstemp's 0600."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path) as tmp, open(tmp, "x") as f:
        for line in lines:
            f.write(line + "\n")


# ----------------------------------------------------------------------------------------------------
# Summary


RECORDED_AS_DIR = ("--trace", "--compilation-cache")  # folders a record names as DIR


def recorded_command(program: str, argv) -> str:
    """The command line a JSON record keeps (`program` and the arguments), without `--out` and its value, and with
    DIR for the folders of RECORDED_AS_DIR: those are where this run wrote, often machine paths, and a record
    names none. Example: ['--budgets', '16', '--trace', '/tmp/t', '--out=/tmp/o'] -> 'PROGRAM --budgets 16
    --trace DIR'."""
    args, kept = list(argv), []
    while args:
        arg = args.pop(0)
        flag = arg.split("=", 1)[0]
        if flag not in ("--out", *RECORDED_AS_DIR):
            kept.append(arg)
            continue
        if arg == flag:  # the value is the next argument
            args = args[1:]
        if flag != "--out":
            kept += [flag, "DIR"]
    return " ".join([program, *kept])


def mode_label(mode: str, budget: int | str | None = None, block_size: int | None = None,
               ran: Iterable[int] = ()) -> str:
    """'ar', 'dflash block=16', 'ddtree B=64', 'ddtree B=auto (31)' or 'mtp steps=3': how a run is named in its
    summary line; `ran`, `--budget auto` per call: the budgets its calls ran (0: the chain), in parentheses."""
    if mode == "ddtree":
        ran = sorted(set(ran))
        return f"ddtree B={budget}" + (f" ({', '.join('chain' if b == 0 else str(b) for b in ran)})" if ran else "")
    if mode == "dflash":
        return f"dflash block={block_size}"
    if mode == "mtp":
        return f"mtp steps={block_size - 1}"  # the chain: the bonus token and the head's drafts
    return mode


def summary_line(label: str, tokens: int, decode_seconds: float, compile_seconds: float, tau: float | None = None,
                 prompts: str | None = None, calibration_seconds: float = 0.0) -> str:
    """One line per run, e.g. '[ddtree B=64] 64 tokens, 3.15 tokens per round (tau), decode 0.43 s =
    149 tokens/s; compile 6.1 s'. `tau` None (AR) leaves it out; `prompts` ('12 prompts') leads the counts;
    `--budget auto`'s calibration seconds, when it calibrated, close it."""
    parts = [f"[{label}]", (f"{prompts}, " if prompts else "") + f"{tokens} tokens,"]
    if tau is not None:
        parts.append(f"{tau:.2f} tokens per round (tau),")
    rate = f" = {tokens / decode_seconds:.0f} tokens/s" if decode_seconds > 0 else ""
    parts.append(f"decode {decode_seconds:.2f} s{rate}; compile {compile_seconds:.1f} s")
    if calibration_seconds > 0:
        parts[-1] += f"; --budget auto calibration {calibration_seconds:.2f} s"
    return " ".join(parts)
