"""Train a multi-token-prediction (MTP) head for a frozen target, with the project's inference code as the model.

    python -m ddtree_jax.train.mtp --target DIR --out DIR [--steps N | --minutes M]
        [--layers 1 --chain 3 --sequences 4096 --prompt-len 64 --gen-len 128 --batch 16 --anchors 32 ...]

The head is `models/mtp.py`'s `MultiTokenPredictor`, the module Qwen3.5/3.6 checkpoints ship; for a dense Qwen3
target its decoder layer takes the target's dimensions (`config.dense_mtp_layers`) and it reads the dense
target's final normed hidden state, as a Qwen3.5 head reads its target's.

1. Data: target-generated continuations, as the drafter trainer makes them (`drafter.generate_sequences`):
   prompts from a JSONL file, else the corpus (`extract.build_prompts`: `--corpus-prompts mixed`, the default,
   is every training-file function's signature and docstring, up to half, and windows of the files for the
   rest), else random token ids (a target without a tokenizer); the frozen target continues each by
   `--gen-len` tokens (greedy unless `--temperature`, EOS not stopping). Kept in the work folder
   (sequences.npz), so a resumed run trains on the same sequences; the last `--held-out` share is held out.
2. Hidden states: each step runs the frozen target over its sequences for its final hidden state after the
   final norm (`ForwardOut.hidden`), what a round hands the head (never stored).
3. Rows: `--anchors` random anchors a per sequence, a in [prompt length - 1, length - 3]: a round whose last
   committed slot is a (the first round after a prompt of P tokens has a = P - 1). Step s = 1 .. `--chain`
   of the row predicts x_{a+s+1}, weighted `--step-decay`^(s - 1) (0 past the sequence's end);
   loss = sum(w * CE) / sum(w).
4. Model: the inference functions themselves. `mtp.ingest_outputs` runs the head over each whole sequence
   from an empty cache (position p pairs x_{p+1} with the target's hidden state at p: the cache that prefill
   and the commits build); row (sequence, a) gets that cache cut to a + 1 slots with the head's output at a
   (the `MTPCache` a round starts from), and `mtp.draft_logits` runs the chain on it with the true
   continuation x_{a+2} .. as the chain's tokens (teacher forcing: a draft only counts when it equals the
   target's token, and then the two chains are the same). The gradient is taken w.r.t. the head only (the
   target, its embedding and lm_head are frozen). AdamW with warm-up, cosine decay and clipping (`common.py`).

Evaluation every `--eval-every` steps: the loss, per-step accuracy and tau_est (1 + the mean run of leading
correct steps) on anchors of the held-out sequences, and greedy `--mode mtp` decoding (`--eval-mtp-steps`
drafts per round) of `--eval-decode` held-out prompts (`--eval-prompts FILE`, else the held-out sequences'
prompts): tau and the acceptance rate per draft step, as the doctor reports them. The export is the
evaluation best on `--select`.

Export (OUT): the target's folder with the head beside its files (`checkpoint.write_mtp_beside`:
mtp.safetensors, model.safetensors.index.json, `mtp_num_hidden_layers` in config.json), which `--mode mtp`,
the doctor and `checkpoint.load_mtp` read. OUT equal to --target adds the head there, leaving the target's
weight files as they are; another OUT gets the target's files (hard links where the file system allows)
and the head. The target must be an HF folder. Work folder (`--work`, default OUT.train): run.json,
sequences.npz, orbax checkpoints (resumed when present), log.json, loss.png, acceptance.png. At the end the
export is loaded with `load_mtp` and decoded against AR on held-out prompts (greedy MTP == AR, tau).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from ddtree_jax.cache import KVCache, MTPCache
from ddtree_jax.config import MTPConfig, mtp_config
from ddtree_jax.models import mtp, target_family
from ddtree_jax.models.contract import ForwardMeta
from ddtree_jax.models.params import ModelParams
from ddtree_jax.train import common
from ddtree_jax.train import drafter as drafter_lib
from ddtree_jax.train.drafter import Sequences

# ----------------------------------------------------------------------------------------------------
# Rows: anchors, labels, weights


def step_weights(chain: int, decay: float) -> np.ndarray:
    """[chain] float32: step s = 1 .. chain weighs decay^(s - 1)."""
    return (decay ** np.arange(chain, dtype=np.float64)).astype(np.float32)


def chain_labels(tokens: jax.Array, lengths: jax.Array, anchors: jax.Array, anchor_ok: jax.Array, *, chain: int,
                 decay: float) -> tuple[jax.Array, jax.Array]:
    """Labels and weights of every (sequence, anchor) row.

    Args:
      tokens: [b, L] int, sequences (right-padded); lengths [b] int.
      anchors: [b, A] int, the last committed slot a of each row; anchor_ok [b, A] bool (False: weighs nothing).
    Returns (row i = sequence i // A, anchor i % A):
      labels:  [b * A, chain] int32, step s (column s - 1) -> x_{a+s+1} (0 where a + s + 1 >= length).
      weights: [b * A, chain] float32, decay^(s - 1) where a + s + 1 < length and the anchor is ok.
    The chain's input tokens are labels[:, :-1]: step s + 1 runs on x_{a+s+1}, what step s drafted when right.
    Example, chain 3, x = [10 11 12 13 14 15], length 6, anchor 2: labels [14 15 0], weights [1, d, 0].
    """
    b, L = tokens.shape
    a = anchors.reshape(-1)
    seq = jnp.repeat(jnp.arange(b), anchors.shape[1])
    pos = a[:, None] + 2 + jnp.arange(chain)[None, :]  # [R, chain]
    in_seq = pos < lengths[seq][:, None]
    labels = jnp.where(in_seq, tokens[seq[:, None], jnp.minimum(pos, L - 1)], 0).astype(jnp.int32)
    w = jnp.asarray(step_weights(chain, decay))[None, :]
    return labels, jnp.where(in_seq & anchor_ok.reshape(-1)[:, None], w, 0.0)


def sample_anchors(key: jax.Array, rows: Sequences, num_anchors: int) -> tuple[jax.Array, jax.Array]:
    """[b, A] distinct random anchors per sequence in [start - 1, length - 3] (step 1's label x_{a+2} a generated
    token), and [b, A] ok flags (`drafter.sample_anchors`, whose range is [start, length - 2], shifted by one)."""
    return drafter_lib.sample_anchors(key, rows.starts - 1, rows.lengths - 1, rows.tokens.shape[1], num_anchors)


def target_hidden(target: ModelParams, tokens: jax.Array, lengths: jax.Array) -> jax.Array:
    """[b, L, e]: the frozen target's final hidden state (after its final norm) at every position."""
    b, L = tokens.shape
    family = target_family(target.config)
    cache = family.create_cache(target.config, b, L, target.array("model.embed_tokens.weight").dtype)
    return jax.lax.stop_gradient(family.forward(target, tokens, ForwardMeta.prompt(lengths, L), cache).hidden)


def row_caches(head: ModelParams, target: ModelParams, tokens: jax.Array, hidden: jax.Array, lengths: jax.Array,
               anchors: jax.Array, dtype) -> MTPCache:
    """The head's cache for every row: each sequence is ingested once (`mtp.ingest_outputs`: position p pairs
    x_{p+1} with the target's hidden state at p, from an empty cache, as prefill does), then row (i, j) gets
    sequence i's K/V with length anchors[i, j] + 1 and the head's output at the anchor: the cache of a round
    whose last committed slot is the anchor (slots past it are in the arrays but unseen)."""
    b, L = tokens.shape
    outputs, cache = mtp.ingest_outputs(head, target, jnp.roll(tokens, -1, axis=1), hidden, lengths - 1,
                                        mtp.create_cache(head.config, b, L, dtype))
    seq, a = jnp.repeat(jnp.arange(b), anchors.shape[1]), anchors.reshape(-1)
    kv = KVCache(k=(cache.kv.k[0][seq],), v=(cache.kv.v[0][seq],), lengths=(a + 1).astype(jnp.int32))
    return MTPCache(kv=kv, hidden=outputs[seq, a])


def rows_loss(head: ModelParams, target: ModelParams, hidden: jax.Array, rows: Sequences, anchors: jax.Array,
              anchor_ok: jax.Array, *, chain: int, decay: float, dtype):
    """The training loss of a batch: (weighted CE, (logits [R, chain, v], labels, weights))."""
    labels, weights = chain_labels(rows.tokens, rows.lengths, anchors, anchor_ok, chain=chain, decay=decay)
    cache = row_caches(head, target, rows.tokens, hidden.astype(dtype), rows.lengths, anchors, dtype)
    logits = mtp.draft_logits(head, target, cache, chain, tokens=labels[:, :-1])
    loss, _ = drafter_lib.weighted_ce(logits, labels, weights)
    return loss, (logits, labels, weights)


def make_step(skeleton: ModelParams, optimizer, *, num_anchors: int, chain: int, decay: float, dtype):
    """The jitted step: (state, target, rows: Sequences, key, lr) -> (state, metrics)."""

    def step(state, target, rows, key, lr):
        hidden = target_hidden(target, rows.tokens, rows.lengths)
        anchors, ok = sample_anchors(key, rows, num_anchors)

        def loss_fn(tree):
            return rows_loss(common.to_params(skeleton, tree, dtype), target, hidden, rows, anchors, ok, chain=chain,
                             decay=decay, dtype=dtype)[0]

        loss, grads = jax.value_and_grad(loss_fn)(state["params"])
        params, opt_state, gnorm = common.apply_step(state["params"], state["opt_state"], grads, optimizer, lr)
        return {"params": params, "opt_state": opt_state, "step": state["step"] + 1}, {"loss": loss,
                                                                                       "grad_norm": gnorm}

    return jax.jit(step, donate_argnums=(0,))


def make_eval(skeleton: ModelParams, target: ModelParams, data: Sequences, *, num_anchors: int, chain: int,
              decay: float, dtype, batch: int, seed: int = 777):
    """Held-out weighted loss, per-step accuracy and tau_est (`drafter.block_metrics`: 1 + the mean run of
    leading correct steps) on fixed anchors of the held-out sequences, `batch` sequences per call."""

    def one(tree, target, rows, key):
        hidden = target_hidden(target, rows.tokens, rows.lengths)
        anchors, ok = sample_anchors(key, rows, num_anchors)
        return rows_loss(common.to_params(skeleton, tree, dtype), target, hidden, rows, anchors, ok, chain=chain,
                         decay=decay, dtype=dtype)

    return drafter_lib.chunked_eval(one, target, data, batch=batch, seed=seed, accuracy_name="step_accuracy")


# ----------------------------------------------------------------------------------------------------
# Export and check


def link_or_copy_folder(src: Path, dst: Path) -> None:
    """The files of folder `src` into the existing folder `dst`: hard links where the file system allows, else
    copies (a weight file is never rewritten in place later: `write_mtp_beside` renames new files in)."""
    for file in sorted(src.iterdir()):
        if file.is_file():
            try:
                os.link(file, dst / file.name)
            except OSError:
                shutil.copy2(file, dst / file.name)


def export(tree: dict, target_dir: Path, out: Path, num_layers: int, dtype=ml_dtypes.bfloat16) -> Path:
    """The head (`tree`, nested `mtp.*` arrays) stored beside the target: in `target_dir` itself when `out` is
    it, else in `out`, a new folder holding the target's files (replaced atomically)."""
    from ddtree_jax.checkpoint import atomic_folder, write_mtp_beside

    arrays = {name: np.asarray(a, np.float32).astype(dtype) for name, a in common.flatten(tree).items()}
    if out.resolve() != target_dir.resolve():
        atomic_folder(out, lambda tmp: link_or_copy_folder(target_dir, tmp), force=True)
    return write_mtp_beside(out, arrays, num_layers)


def check_export(out: Path, prompts: list[list[int]], max_new_tokens: int, mtp_steps: int, dtype) -> dict:
    """Load the export with `load_target` and `load_mtp` and compare greedy `--mode mtp` with AR on `prompts`
    (`drafter.greedy_check`)."""
    from ddtree_jax.checkpoint import load_mtp, load_target
    from ddtree_jax.engine import DecodeOptions, Mode

    target = load_target(out, dtype)
    head = load_mtp(out, target.config, dtype)
    spec = DecodeOptions(mode=Mode.MTP, max_new_tokens=max_new_tokens, mtp_steps=mtp_steps)
    return drafter_lib.greedy_check(target, head, prompts, spec, mtp_steps + 1, "mtp")


# ----------------------------------------------------------------------------------------------------
# Driver


@dataclasses.dataclass
class MTPTrainConfig:
    target: Path
    out: Path
    work: Path | None = None
    # head
    layers: int = 1  # mtp_num_hidden_layers (the round runs layer 0; see models/mtp.py)
    chain: int = 3  # steps trained per anchor: step 1 and chain - 1 chained steps
    step_decay: float = 0.8  # step s weighs step_decay^(s - 1)
    # data
    sequences: int = 4096
    prompt_len: int = 64
    gen_len: int = 128
    gen_batch: int = 256
    temperature: float = 0.0
    random_prompts: bool = False
    prompts_file: Path | None = None
    corpus_prompts: str = "mixed"
    corpus_root: Path | None = None
    include_tests: bool = False
    max_files: int | None = None
    held_out: float = 0.03
    # optimization
    steps: int | None = 2000
    minutes: float | None = None
    batch: int = 16  # sequences per step
    anchors: int = 32  # anchors per sequence: rows per step = batch * anchors
    lr: float = 1e-3
    warmup: int = 100
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.01
    clip: float = 1.0
    seed: int = 0
    dtype: str = "auto"
    eval_every: int = 250
    eval_prompts: Path | None = None
    eval_decode: int = 8
    eval_new_tokens: int = 64
    eval_mtp_steps: int = 3
    select: str = "tau_est"
    patience: int | None = None
    save_every: int = 500
    log_every: int = 25
    export_dtype: str = "bfloat16"
    check_prompts: int = 8  # held-out prompts decoded (--eval-new-tokens each) to check the export

    def work_dir(self) -> Path:
        return Path(self.work) if self.work is not None else Path(str(self.out) + ".train")


def check_settings(cfg: MTPTrainConfig) -> None:
    """Flags that cannot work, refused before anything loads."""
    from ddtree_jax.train.extract import CORPUS_PROMPTS

    for flag, value in (("--layers", cfg.layers), ("--chain", cfg.chain), ("--batch", cfg.batch),
                        ("--anchors", cfg.anchors), ("--sequences", cfg.sequences), ("--gen-len", cfg.gen_len),
                        ("--eval-mtp-steps", cfg.eval_mtp_steps), ("--eval-new-tokens", cfg.eval_new_tokens)):
        if value < 1:
            raise ValueError(f"{flag}: expected >= 1, got {value}")
    if not 0 < cfg.step_decay <= 1:
        raise ValueError(f"--step-decay: expected a number in (0, 1], got {cfg.step_decay}")
    if cfg.corpus_prompts not in CORPUS_PROMPTS:
        raise ValueError(f"--corpus-prompts: expected one of {', '.join(CORPUS_PROMPTS)}, got {cfg.corpus_prompts!r}")
    if cfg.select not in drafter_lib.SELECT_METRICS:
        raise ValueError(f"--select: expected one of {', '.join(drafter_lib.SELECT_METRICS)}, got {cfg.select!r}")
    if cfg.select == "tau" and cfg.eval_decode < 1:
        raise ValueError("--select tau needs --eval-decode >= 1 (tau comes from decoding held-out prompts)")


def make_sequences(cfg: MTPTrainConfig, target: ModelParams, tokenizer, target_dir: Path, run: common.TrainRun
                   ) -> Sequences:
    """The run's sequences: prompts (`extract.build_prompts`) continued by the target (`drafter.generate_sequences`)."""
    from ddtree_jax.train.extract import ExtractConfig, build_prompts

    asked = ExtractConfig(target=target_dir, out=cfg.out, prompts_file=cfg.prompts_file,
                          random_prompts=cfg.random_prompts, corpus_prompts=cfg.corpus_prompts,
                          corpus_root=cfg.corpus_root, include_tests=cfg.include_tests, max_files=cfg.max_files,
                          sequences=cfg.sequences, prompt_len=cfg.prompt_len, seed=cfg.seed)
    prompts, source = build_prompts(asked, tokenizer, target_dir, target.config.vocab_size, -1)
    print(f"mtp: generating {len(prompts)} continuations of {cfg.gen_len} tokens ({source} prompts, "
          f"{'greedy' if cfg.temperature == 0 else f'temperature {cfg.temperature}'})", file=sys.stderr)
    t0 = time.perf_counter()
    data = drafter_lib.generate_sequences(target, prompts, cfg.gen_len, batch=min(cfg.gen_batch, len(prompts)),
                                          temperature=cfg.temperature, seed=cfg.seed, desc="mtp data")
    print(f"mtp: generated {len(data)} sequences in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    run.save_meta(prompt_source=source)
    return data


def train_mtp(cfg: MTPTrainConfig) -> dict:
    """Generate data, train, checkpoint, export, check; returns a summary dict."""
    from ddtree_jax.checkpoint import checkpoint_format, load_target
    from ddtree_jax.config import load_target_config

    check_settings(cfg)
    target_dir, out = Path(cfg.target), common.check_out_folder(cfg.out)
    if checkpoint_format(target_dir) != "hf":
        raise ValueError(f"--target {target_dir}: the head is stored beside a Hugging Face folder's safetensors; "
                         "convert this orbax folder to HF first (conversions.convert orbax-to-hf)")
    tconf = load_target_config(target_dir)
    hconf: MTPConfig = mtp_config(dataclasses.replace(tconf, mtp_num_hidden_layers=cfg.layers))
    tokenizer = drafter_lib.load_target_tokenizer(target_dir)
    eval_prompt_ids = None
    if cfg.eval_prompts is not None and cfg.eval_decode:
        eval_prompt_ids = drafter_lib.file_prompts(cfg.eval_prompts, tokenizer, target_dir,
                                                   tconf.vocab_size)[:cfg.eval_decode]
    run = common.TrainRun(cfg.work_dir(), title=f"MTP head training ({target_dir.name})")
    dtype = common.compute_dtype(cfg.dtype)
    target = load_target(target_dir, dtype)

    data_file = run.work / "sequences.npz"
    if data_file.exists():
        data = Sequences.load(data_file)
    else:
        data = make_sequences(cfg, target, tokenizer, target_dir, run)
        data.save(data_file)
    n_eval = max(1, round(len(data) * cfg.held_out)) if len(data) > 1 else 0
    train_data, eval_data = data.take(slice(0, len(data) - n_eval)), data.take(slice(len(data) - n_eval, None))
    n_train = len(train_data)
    if cfg.batch > n_train:
        raise ValueError(f"--batch {cfg.batch} is larger than the {n_train} training sequences")

    tree = common.param_tree(mtp.init_random(hconf, jnp.float32, seed=cfg.seed))
    skeleton = mtp.abstract(hconf, jnp.float32)
    optimizer = common.make_optimizer(common.OptimConfig(lr=cfg.lr, warmup=cfg.warmup, min_ratio=cfg.min_lr_ratio,
                                                         weight_decay=cfg.weight_decay, clip=cfg.clip), tree)
    state = {"params": tree, "opt_state": optimizer.init(tree), "step": jnp.zeros((), jnp.int32)}
    state, start = run.resume(state)
    n_params = common.count_params(state["params"])
    run.save_meta(params=n_params, mtp_num_hidden_layers=cfg.layers, sequences=len(data), held_out_sequences=n_eval,
                  settings=json.loads(json.dumps(dataclasses.asdict(cfg), default=str)),
                  loss_name=f"weighted CE over {cfg.chain} steps, w_s = {cfg.step_decay:g}^(s-1) (nats)")
    print(f"mtp: {n_params / 1e6:.2f}M parameters, {cfg.layers} layer(s), {cfg.chain} steps trained per anchor; "
          f"{n_train} train / {n_eval} held-out sequences of {data.tokens.shape[1]} tokens"
          + (f"; resuming at step {start}" if start else ""), file=sys.stderr)

    def rows_for(step: int) -> Sequences:
        rng = np.random.default_rng((cfg.seed, step))
        return train_data.take(np.sort(rng.choice(n_train, size=cfg.batch, replace=False)))

    key = jax.random.key(cfg.seed)
    step_fn = make_step(skeleton, optimizer, num_anchors=cfg.anchors, chain=cfg.chain, decay=cfg.step_decay,
                        dtype=dtype)

    def batch_for(step: int):
        return target, jax.tree.map(jnp.asarray, rows_for(step)), jax.random.fold_in(key, step)

    evaluations = []
    if n_eval:
        evaluations.append(make_eval(skeleton, target, eval_data, num_anchors=cfg.anchors, chain=cfg.chain,
                                     decay=cfg.step_decay, dtype=dtype, batch=cfg.batch))
    if eval_prompt_ids is None and cfg.eval_decode and n_eval:
        eval_prompt_ids = [eval_data.tokens[i, :eval_data.starts[i]].tolist()
                           for i in range(min(cfg.eval_decode, n_eval))]
    if eval_prompt_ids:
        evaluations.append(drafter_lib.make_acceptance_eval(skeleton, target, eval_prompt_ids,
                                                            max_new_tokens=cfg.eval_new_tokens, dtype=dtype,
                                                            mtp_steps=cfg.eval_mtp_steps))
    selectable = bool(eval_prompt_ids) if cfg.select == "tau" else n_eval > 0

    state, steps = common.train_loop(
        run=run, state=state, start_step=start, total=None if cfg.minutes else cfg.steps,
        budget_seconds=cfg.minutes * 60 if cfg.minutes else None,
        schedule_for=lambda total: common.Schedule(cfg.lr, cfg.warmup, total, cfg.min_lr_ratio), step_fn=step_fn,
        batch_for=batch_for,
        evaluate=(lambda s: {k: v for e in evaluations for k, v in e(s).items()}) if evaluations else None,
        eval_every=cfg.eval_every, save_every=cfg.save_every, log_every=cfg.log_every, desc="mtp",
        best=(cfg.select, "max") if selectable else None, patience=cfg.patience)

    export_dtype = {"bfloat16": ml_dtypes.bfloat16, "float32": np.float32}[cfg.export_dtype]
    export(state["params"], target_dir, out, cfg.layers, export_dtype)
    summary = {"out": str(out), "steps": steps, "params": n_params, "mtp_num_hidden_layers": cfg.layers,
               "chain": cfg.chain, "final_loss": run.history[-1]["loss"] if run.history else None,
               "held_out": next((e for e in run.evals if e["step"] == run.meta.get("best_step")),
                                run.evals[-1] if run.evals else None),
               "head_bytes": (out / "mtp.safetensors").stat().st_size}
    chosen = summary["held_out"] or {}
    if "position_acceptance" in chosen:
        from ddtree_jax.doctor import acceptance_table

        print(f"mtp: exported step {chosen['step']}; on {len(eval_prompt_ids)} held-out prompts "
              f"({cfg.eval_new_tokens} tokens each, {cfg.eval_mtp_steps} MTP steps) tau {chosen['tau']:.2f}, "
              "acceptance per draft step:", file=sys.stderr)
        print("\n".join(acceptance_table(chosen["position_acceptance"])), file=sys.stderr)
    if cfg.check_prompts and n_eval:
        k = min(cfg.check_prompts, n_eval)
        prompts = [eval_data.tokens[i, :eval_data.starts[i]].tolist() for i in range(k)]
        summary["check"] = check_export(out, prompts, cfg.eval_new_tokens, cfg.eval_mtp_steps, dtype)
        print(f"mtp check on {k} held-out prompts: tau {summary['check']['tau']:.2f}, greedy MTP == AR: "
              f"{summary['check']['greedy_mtp_equals_ar']}, acceptance per step "
              f"{summary['check']['position_acceptance']}", file=sys.stderr)
    run.write_log(summary=summary)
    return summary


def parse_args(argv=None) -> MTPTrainConfig:
    from ddtree_jax.train.extract import CORPUS_PROMPTS
    from ddtree_jax.train.target import add_common_args

    d = MTPTrainConfig(target=Path("."), out=Path("."))
    p = argparse.ArgumentParser(prog="python -m ddtree_jax.train.mtp", description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--target", type=Path, required=True, help="target checkpoint folder (HF)")
    p.add_argument("--out", type=Path, required=True,
                   help="the target folder with the head beside it (--target itself: the head is added there)")
    p.add_argument("--layers", type=int, default=d.layers, help="the head's decoder layers (mtp_num_hidden_layers)")
    p.add_argument("--chain", type=int, default=d.chain, help="MTP steps trained per anchor (1: step 1 alone)")
    p.add_argument("--step-decay", type=float, default=d.step_decay, help="step s weighs step-decay^(s-1)")
    g = p.add_argument_group("data")
    drafter_lib.add_generation_args(g, d)
    g.add_argument("--corpus-prompts", choices=CORPUS_PROMPTS, default=d.corpus_prompts,
                   help="corpus prompts: functions (signature + docstring), windows, or both")
    g.add_argument("--held-out", type=float, default=d.held_out, help="share of the sequences held out")
    p.add_argument("--batch", type=int, default=d.batch, help="sequences per step")
    p.add_argument("--anchors", type=int, default=d.anchors, help="anchors (rows) per sequence")
    add_common_args(p, d)
    p.add_argument("--eval-prompts", type=Path, default=None,
                   help="JSONL held-out prompts decoded at every evaluation (default: the held-out sequences' prompts)")
    p.add_argument("--eval-decode", type=int, default=d.eval_decode,
                   help="prompts decoded with --mode mtp at every evaluation (0: none)")
    p.add_argument("--eval-new-tokens", type=int, default=d.eval_new_tokens, help="tokens per decoded prompt")
    p.add_argument("--eval-mtp-steps", type=int, default=d.eval_mtp_steps, help="drafts per round when decoding")
    p.add_argument("--select", choices=drafter_lib.SELECT_METRICS, default=d.select,
                   help="held-out metric choosing the exported evaluation: tau_est (anchors of held-out sequences) "
                        "or tau (decoding the held-out prompts)")
    p.add_argument("--export-dtype", choices=["bfloat16", "float32"], default=d.export_dtype)
    p.add_argument("--check-prompts", type=int, default=d.check_prompts,
                   help="held-out prompts for the final MTP-vs-AR check of the export (0: skip)")
    a = p.parse_args(argv)
    fields = {f.name for f in dataclasses.fields(MTPTrainConfig)}
    given = {k: v for k, v in vars(a).items() if k in fields}
    return MTPTrainConfig(**dict(given, steps=None if a.minutes else a.steps))


def main(argv=None) -> int:
    from ddtree_jax.checkpoint import CheckpointError
    from ddtree_jax.cli import BadInput
    from ddtree_jax.config import ConfigError

    try:
        summary = train_mtp(parse_args(argv))
    except (BadInput, CheckpointError, ConfigError, ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(summary, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
