"""Pretrain a small Qwen3 target with the project's own model code; export it in the HF layout.

    python -m ddtree_jax.train.target --tokenizer TOK_DIR --out OUT_DIR [--steps N | --minutes M]
        [--batch B --seq-len L --lr LR --hidden 256 --layers 6 ...]

Data: the corpus files (default: the Python standard library, `corpus.py`), tokenized, each followed by
`<|endoftext|>`, concatenated into one token stream; every step takes `batch` windows of `seq_len + 1`
tokens at random offsets (seeded by the step, so a resumed run sees the same batches). The held-out
files make the evaluation stream.

Model and loss: `qwen3.forward` over the window with an empty KV cache of capacity `seq_len` and a
causal mask, `qwen3.logits`, next-token cross-entropy; float32 master weights, the forward in the
compute dtype (bfloat16 on a GPU by default); AdamW with warm-up and cosine decay (`common.py`).

Work folder (`--work`, default OUT.train): run.json, orbax checkpoints (resumed when present), log.json,
loss.png. At the end OUT holds the HF export: config.json (`model_type: qwen3`), bf16 safetensors in
shards of at most `--max-shard-mb`, the tokenizer files and generation_config.json with the EOS id.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from ddtree_jax.config import Qwen3Config, parse_qwen3
from ddtree_jax.shapes import SHAPES
from ddtree_jax.models.contract import ForwardMeta
from ddtree_jax.models import qwen3
from ddtree_jax.models.params import ModelParams
from ddtree_jax.train import common, corpus
from ddtree_jax.train import tokenizer as tok_lib

DEFAULT_MAX_SHARD_BYTES = 14 * 10**6  # every file, header included, stays under 15 MB


_DEMO = SHAPES["demo"]


@dataclasses.dataclass(frozen=True)
class TargetShape:
    """The default is the demo target's shape (`shapes.SHAPES["demo"]`): 6.8M parameters at vocab 8192
    (13.6 MB in bf16)."""

    hidden_size: int = _DEMO["hidden_size"]
    num_layers: int = _DEMO["num_hidden_layers"]
    num_heads: int = _DEMO["num_attention_heads"]
    num_kv_heads: int = _DEMO["num_key_value_heads"]
    head_dim: int = _DEMO["head_dim"]
    intermediate_size: int = _DEMO["intermediate_size"]
    rope_theta: float = _DEMO["rope_theta"]
    max_position_embeddings: int = _DEMO["max_position_embeddings"]
    tie_word_embeddings: bool = _DEMO["tie_word_embeddings"]


def round_vocab(n: int, multiple: int = 64) -> int:
    return -(-n // multiple) * multiple


def target_config_dict(vocab_size: int, shape: TargetShape, eos_id: int | None, dtype: str = "bfloat16") -> dict:
    """The HF `config.json` of a Qwen3ForCausalLM of this shape (transformers loads it as is)."""
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": vocab_size,
        "hidden_size": shape.hidden_size,
        "intermediate_size": shape.intermediate_size,
        "num_hidden_layers": shape.num_layers,
        "num_attention_heads": shape.num_heads,
        "num_key_value_heads": shape.num_kv_heads,
        "head_dim": shape.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": shape.max_position_embeddings,
        "rms_norm_eps": 1e-6,
        "rope_theta": shape.rope_theta,
        "tie_word_embeddings": shape.tie_word_embeddings,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": shape.num_layers,
        "initializer_range": 0.02,
        "bos_token_id": eos_id,
        "eos_token_id": eos_id,
        "pad_token_id": eos_id,
        "torch_dtype": dtype,
    }


# ----------------------------------------------------------------------------------------------------
# Data


def token_stream(tokenizer, texts, eos_id: int) -> np.ndarray:
    """All texts tokenized, each followed by EOS, as one int32 array."""
    docs = tok_lib.encode_documents(tokenizer, texts)
    out = np.empty(sum(len(d) + 1 for d in docs), np.int32)
    i = 0
    for d in docs:
        out[i:i + len(d)] = d
        out[i + len(d)] = eos_id
        i += len(d) + 1
    return out


def windows(stream: np.ndarray, batch: int, length: int, rng: np.random.Generator) -> np.ndarray:
    """[batch, length] windows at uniform random offsets."""
    if len(stream) < length + 1:
        raise ValueError(f"the token stream ({len(stream)} tokens) is shorter than one window ({length})")
    starts = rng.integers(0, len(stream) - length + 1, size=batch)
    return np.stack([stream[s:s + length] for s in starts])


# ----------------------------------------------------------------------------------------------------
# Loss and step


def lm_loss(params: ModelParams, tokens: jax.Array) -> jax.Array:
    """Mean next-token cross-entropy of tokens [b, t + 1] (inputs tokens[:, :-1], labels tokens[:, 1:]),
    through the project's forward with an empty cache of capacity t and a causal mask."""
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    b, t = inputs.shape
    dtype = params.array("model.embed_tokens.weight").dtype
    cache = qwen3.create_cache(params.config, b, t, dtype)
    out = qwen3.forward(params, inputs, ForwardMeta.prompt(jnp.full((b,), t, jnp.int32), t), cache)
    logits = qwen3.logits(params, out.hidden)  # float32 [b, t, v]
    picked = jnp.take_along_axis(logits, labels[..., None], axis=-1)[..., 0]
    return jnp.mean(jax.nn.logsumexp(logits, axis=-1) - picked)


def make_step(skeleton: ModelParams, optimizer, dtype):
    """The jitted training step: (state, tokens [b, t + 1], lr) -> (state, {"loss", "grad_norm"})."""

    def loss_fn(tree, tokens):
        return lm_loss(common.to_params(skeleton, tree, dtype), tokens)

    def step(state, tokens, lr):
        loss, grads = jax.value_and_grad(loss_fn)(state["params"], tokens)
        params, opt_state, gnorm = common.apply_step(state["params"], state["opt_state"], grads, optimizer, lr)
        return {"params": params, "opt_state": opt_state, "step": state["step"] + 1}, {"loss": loss,
                                                                                       "grad_norm": gnorm}

    return jax.jit(step, donate_argnums=(0,))


def make_eval(skeleton: ModelParams, dtype, batches: list[np.ndarray]):
    loss = jax.jit(lambda tree, tokens: lm_loss(common.to_params(skeleton, tree, dtype), tokens))

    def evaluate(state) -> dict:
        return {"loss": float(np.mean([float(loss(state["params"], jnp.asarray(b))) for b in batches]))}

    return evaluate


# ----------------------------------------------------------------------------------------------------
# Export


def export(tree: dict, config_raw: dict, out: Path, tokenizer_dir: Path, staging: Path, *,
           max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, dtype=ml_dtypes.bfloat16) -> Path:
    """Write the HF folder: config.json, safetensors shards, tokenizer files, generation_config.json."""
    from ddtree_jax.checkpoint import SIDE_FILES, save_hf

    if staging.exists():
        shutil.rmtree(staging)
    staging.mkdir(parents=True)
    for name in SIDE_FILES:
        if (tokenizer_dir / name).exists():
            shutil.copy2(tokenizer_dir / name, staging / name)
    eos = config_raw["eos_token_id"]
    (staging / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": config_raw["bos_token_id"], "eos_token_id": eos, "pad_token_id": config_raw["pad_token_id"],
         "do_sample": False}, indent=2) + "\n")
    arrays = {name: np.asarray(a, np.float32).astype(dtype) for name, a in common.flatten(tree).items()}
    return save_hf(arrays, config_raw, out, side_files_from=staging, max_shard_bytes=max_shard_bytes, force=True)


def sample_text(out: Path, prompt: str, max_new_tokens: int = 48, dtype=jnp.float32) -> str:
    """Greedy AR continuation of `prompt` by the exported checkpoint (checks that it loads and runs)."""
    from ddtree_jax.checkpoint import load_target
    from ddtree_jax.engine import DecodeOptions, generate

    params = load_target(out, dtype)
    tokenizer = tok_lib.load_tokenizer(out)
    ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    result = generate(params, [ids], DecodeOptions(max_new_tokens=max_new_tokens, eos_ids=params.config.eos_token_ids))
    return tokenizer.decode(result.output_ids[0])


# ----------------------------------------------------------------------------------------------------
# Driver


@dataclasses.dataclass
class TargetTrainConfig:
    out: Path
    tokenizer: Path
    work: Path | None = None
    shape: TargetShape = TargetShape()
    steps: int | None = 2000
    minutes: float | None = None  # a time budget instead of a step count (the total is fixed after timing)
    batch: int = 32
    seq_len: int = 512
    lr: float = 2e-3
    warmup: int = 100
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    clip: float = 1.0
    seed: int = 0
    dtype: str = "auto"  # compute dtype
    corpus_root: Path | None = None  # default: the stdlib
    include_tests: bool = False
    max_files: int | None = None  # train on the first N training files only (smoke runs)
    held_out_fraction: float = corpus.HELD_OUT_FRACTION
    eval_every: int = 250
    patience: int | None = None  # stop after this many evaluations without a better held-out loss
    eval_batches: int = 8
    save_every: int = 500
    log_every: int = 25
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES
    sample_prompt: str | None = "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"

    def work_dir(self) -> Path:
        return Path(self.work) if self.work is not None else Path(str(self.out) + ".train")


def train_target(cfg: TargetTrainConfig) -> dict:
    """Pretrain, checkpoint, export; returns a summary dict (also written to the work folder's log)."""
    common.check_out_folder(cfg.out)
    work = cfg.work_dir()
    run = common.TrainRun(work, title="target pretraining")
    dtype = common.compute_dtype(cfg.dtype)
    tokenizer = tok_lib.load_tokenizer(cfg.tokenizer)
    eos_id = tokenizer.eos_token_id
    if eos_id is None:
        raise ValueError(f"{cfg.tokenizer}: the tokenizer has no EOS token")
    vocab = round_vocab(len(tokenizer))
    config_raw = target_config_dict(vocab, cfg.shape, eos_id)
    config: Qwen3Config = parse_qwen3(config_raw, "target config")

    files = corpus.list_files(cfg.corpus_root, include_tests=cfg.include_tests)
    train_files, held_files = corpus.split_files(files, cfg.held_out_fraction)
    train_files = train_files[:cfg.max_files]
    print(f"target: corpus {len(train_files)} train files, {len(held_files)} held out; tokenizing", file=sys.stderr)
    train_stream = token_stream(tokenizer, corpus.iter_texts(train_files, cfg.corpus_root), eos_id)
    held_stream = token_stream(tokenizer, corpus.iter_texts(held_files, cfg.corpus_root), eos_id)
    if len(held_stream) < cfg.seq_len + 1:
        held_stream = train_stream  # a tiny corpus: evaluate on training text rather than not at all
    eval_rng = np.random.default_rng(12345)
    eval_batches = [windows(held_stream, cfg.batch, cfg.seq_len + 1, eval_rng) for _ in range(cfg.eval_batches)]

    init = qwen3.init_random(config, dtype=jnp.float32, seed=cfg.seed)
    skeleton = qwen3.abstract(config, jnp.float32)
    tree = common.param_tree(init)
    del init
    optim = common.OptimConfig(lr=cfg.lr, warmup=cfg.warmup, min_ratio=cfg.min_lr_ratio,
                               weight_decay=cfg.weight_decay, clip=cfg.clip)
    optimizer = common.make_optimizer(optim, tree)
    state = {"params": tree, "opt_state": optimizer.init(tree), "step": jnp.zeros((), jnp.int32)}
    state, start = run.resume(state)
    n_params = common.count_params(state["params"])
    run.save_meta(config=config_raw, params=n_params, train_tokens=len(train_stream),
                  held_out_tokens=len(held_stream), settings=_settings(cfg), loss_name="next-token CE (nats)")
    print(f"target: {n_params / 1e6:.2f}M parameters, vocab {vocab}, {len(train_stream) / 1e6:.2f}M training tokens"
          + (f"; resuming at step {start}" if start else ""), file=sys.stderr)

    def batch_for(step: int):
        rng = np.random.default_rng((cfg.seed, step))
        return (jnp.asarray(windows(train_stream, cfg.batch, cfg.seq_len + 1, rng)),)

    def schedule_for(total: int) -> common.Schedule:
        return common.Schedule(cfg.lr, cfg.warmup, total, cfg.min_lr_ratio)

    state, steps = common.train_loop(
        run=run, state=state, start_step=start, total=None if cfg.minutes else cfg.steps,
        budget_seconds=cfg.minutes * 60 if cfg.minutes else None, schedule_for=schedule_for,
        step_fn=make_step(skeleton, optimizer, dtype), batch_for=batch_for,
        evaluate=make_eval(skeleton, dtype, eval_batches), eval_every=cfg.eval_every,
        save_every=cfg.save_every, log_every=cfg.log_every, desc="target", best=("loss", "min"),
        patience=cfg.patience)

    out = export(state["params"], config_raw, Path(cfg.out), Path(cfg.tokenizer), work / "export_side",
                 max_shard_bytes=cfg.max_shard_bytes)
    summary = {"out": str(out), "steps": steps, "params": n_params,
               "final_loss": run.history[-1]["loss"] if run.history else None,
               "held_out_loss": run.meta.get("best_value", run.evals[-1]["loss"] if run.evals else None),
               "exported_step": run.meta.get("best_step", steps),
               "export_bytes": sum(f.stat().st_size for f in out.glob("*.safetensors"))}
    if cfg.sample_prompt:
        summary["sample"] = {"prompt": cfg.sample_prompt, "continuation": sample_text(out, cfg.sample_prompt)}
        print(f"target sample (greedy):\n{cfg.sample_prompt}{summary['sample']['continuation']}", file=sys.stderr)
    run.write_log(summary=summary)
    return summary


def _settings(cfg: TargetTrainConfig) -> dict:
    d = dataclasses.asdict(cfg)
    return json.loads(json.dumps(d, default=str))


def add_common_args(p: argparse.ArgumentParser, defaults) -> None:
    """Flags both trainers take (step count or time budget, optimizer, logging, checkpoints)."""
    g = p.add_mutually_exclusive_group()
    g.add_argument("--steps", type=int, default=defaults.steps, help="training steps")
    g.add_argument("--minutes", type=float, default=None,
                   help="train for about this long instead (the step count is fixed after timing the first steps)")
    p.add_argument("--lr", type=float, default=defaults.lr, help="peak learning rate (AdamW)")
    p.add_argument("--warmup", type=int, default=defaults.warmup, help="linear warm-up steps")
    p.add_argument("--min-lr-ratio", type=float, default=defaults.min_lr_ratio,
                   help="the cosine decays to this fraction of --lr")
    p.add_argument("--weight-decay", type=float, default=defaults.weight_decay)
    p.add_argument("--clip", type=float, default=defaults.clip, help="global gradient-norm clip")
    p.add_argument("--seed", type=int, default=defaults.seed)
    p.add_argument("--dtype", choices=["auto", "bfloat16", "float32"], default=defaults.dtype,
                   help="compute dtype (master weights are float32); auto: bfloat16 on a GPU, else float32")
    p.add_argument("--work", type=Path, default=None, help="checkpoints, log.json, loss.png (default: OUT.train)")
    p.add_argument("--eval-every", type=int, default=defaults.eval_every)
    p.add_argument("--patience", type=int, default=defaults.patience,
                   help="stop after this many evaluations without improvement (the best evaluation's "
                        "parameters are exported in any case)")
    p.add_argument("--save-every", type=int, default=defaults.save_every, help="orbax checkpoint every N steps")
    p.add_argument("--log-every", type=int, default=defaults.log_every)


def parse_args(argv=None) -> TargetTrainConfig:
    d = TargetTrainConfig(out=Path("."), tokenizer=Path("."))
    p = argparse.ArgumentParser(prog="python -m ddtree_jax.train.target", description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="HF export folder (replaced at the end)")
    p.add_argument("--tokenizer", type=Path, required=True, help="tokenizer folder (train.tokenizer's output)")
    p.add_argument("--batch", type=int, default=d.batch, help="sequences per step")
    p.add_argument("--seq-len", type=int, default=d.seq_len, help="tokens per sequence")
    add_common_args(p, d)
    s = TargetShape()
    p.add_argument("--hidden", type=int, default=s.hidden_size)
    p.add_argument("--layers", type=int, default=s.num_layers)
    p.add_argument("--heads", type=int, default=s.num_heads)
    p.add_argument("--kv-heads", type=int, default=s.num_kv_heads)
    p.add_argument("--head-dim", type=int, default=s.head_dim)
    p.add_argument("--intermediate", type=int, default=s.intermediate_size)
    p.add_argument("--untied", action="store_true", help="a separate lm_head (default: tied to the embedding)")
    p.add_argument("--corpus-root", type=Path, default=None, help="folder of .py files (default: the stdlib)")
    p.add_argument("--include-tests", action="store_true", help="also train on test folders")
    p.add_argument("--max-files", type=int, default=None, help="use only the first N training files")
    p.add_argument("--eval-batches", type=int, default=d.eval_batches)
    p.add_argument("--max-shard-mb", type=float, default=d.max_shard_bytes / 1e6,
                   help="largest safetensors shard (MB, 10^6 bytes)")
    a = p.parse_args(argv)
    shape = TargetShape(hidden_size=a.hidden, num_layers=a.layers, num_heads=a.heads, num_kv_heads=a.kv_heads,
                        head_dim=a.head_dim, intermediate_size=a.intermediate, tie_word_embeddings=not a.untied)
    return TargetTrainConfig(
        out=a.out, tokenizer=a.tokenizer, work=a.work, shape=shape, steps=None if a.minutes else a.steps,
        minutes=a.minutes, batch=a.batch, seq_len=a.seq_len, lr=a.lr, warmup=a.warmup, min_lr_ratio=a.min_lr_ratio,
        weight_decay=a.weight_decay, clip=a.clip, seed=a.seed, dtype=a.dtype, corpus_root=a.corpus_root,
        include_tests=a.include_tests, max_files=a.max_files, eval_every=a.eval_every, patience=a.patience,
        eval_batches=a.eval_batches,
        save_every=a.save_every, log_every=a.log_every, max_shard_bytes=int(a.max_shard_mb * 1e6))


def main(argv=None) -> int:
    from ddtree_jax.checkpoint import CheckpointError
    from ddtree_jax.config import ConfigError

    cfg = parse_args(argv)
    try:
        summary = train_target(cfg)
    except (CheckpointError, ConfigError, ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps({k: v for k, v in summary.items() if k != "sample"}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
