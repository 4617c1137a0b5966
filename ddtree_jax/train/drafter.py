"""Train a DFlash drafter for any supported target, with the project's inference code as the model.

    python -m ddtree_jax.train.drafter --target DIR --out DIR [--steps N | --minutes M]
        [--block-size 16 --layers 5 --num-taps 5 --sequences 4096 --prompt-len 64 --gen-len 192 ...]
    python -m ddtree_jax.train.drafter --features FEATURES --out DIR [--target DIR] [--devices N] ...

The DFlash recipe (research notes §2), step by step:

1. Data: target-generated continuations. Prompts are windows of the corpus (tokenized with the target's
   tokenizer), or random token ids when the target has no tokenizer (or `--random-prompts`), or a JSONL
   file; the frozen target continues each one by `--gen-len` tokens with `engine.generate` (AR mode,
   greedy unless `--temperature`, EOS not stopping), in batches. Sequence = prompt + continuation.
   With `--features` the sequences and their taps come from an extraction (`train/extract.py`), read in
   shuffled batches from its shards (`features.ShardStream`), and the target must be the one they were
   extracted from (its fingerprint); the last `--held-out-shards` are held out.
2. Taps: without `--features`, each step runs the frozen target over its sequences (its family's
   `forward(..., tap_layers=ids)`), so hidden states are never stored. `target_layer_ids` spread from
   layer 1 to num_layers - 3 like the published drafters (`build_target_layer_ids`).
3. Blocks: per sequence, `--anchors` random anchors among the generated tokens (anchor a and a + 1 both
   inside the sequence, a at or after the prompt's end). Anchor a spawns the block
   `[x_a, mask x (bs - 1)]` at positions a .. a + bs - 1; its context is the taps of positions < a.
   Slot k (1 .. bs - 1) is labelled x_{a+k} (slot 0 has no label), weighted w_k = exp(-(k - 1) / gamma),
   and zero past the sequence's end. Loss = sum(w * CE) / sum(w).
   gamma: 7 for bs 16 (the recipe, as every SpecForge DFlash config); for another block size
   gamma = 7 * bs / 16 (3.5 for bs 8, between the 4 NVIDIA ModelOpt uses and the 3 that would keep the
   last slot's weight at the bs-16 value e^-2), or `--gamma`.
4. Model: each (sequence, anchor) pair is one row. Rows run the inference functions themselves:
   `dflash.ingest_context` (the context K/V) and `dflash.draft_logits` (the block pass), so training
   and inference cannot disagree. The context K/V of a position does not depend on the anchor (it is
   `k_proj`/`v_proj` of that position's fused taps, RoPE'd at that position), so each sequence is
   ingested once and each row reads the first `a` rows of its sequence's cache (its `lengths` = a):
   exactly the cache that `ingest_context(taps[:a], counts=a)` builds at inference (tested).
5. Optimizer: AdamW with warm-up, cosine decay and global-norm clipping (`common.py`); the gradient is
   taken w.r.t. the drafter's parameters only (the target, its embedding and lm_head are frozen).
   `--devices N`: data parallel, each step's sequences split over N devices of this host.

Evaluation every `--eval-every` steps: the weighted loss, per-slot accuracy and tau_est on anchors of the
held-out sequences, and greedy DFlash decoding of `--eval-decode` held-out prompts (`--eval-prompts`, or
the held-out sequences' prompts): tau and the acceptance rate per draft position, as the doctor reports
them (log.json, the log lines, acceptance.png). The export is the evaluation best on `--select`.

Export (OUT): the published HF layout (`architectures: ["DFlashDraftModel"]`, `block_size`,
`dflash_config: {mask_token_id, target_layer_ids}`, `num_target_layers`, `layer_types`, ...), bf16 (or
float32) safetensors. Work folder (`--work`, default OUT.train): run.json, the generated sequences
(sequences.npz), orbax checkpoints (resumed when present), log.json, loss.png, acceptance.png. At the
end the export is loaded with `load_drafter` and run against AR on held-out prompts (greedy DFlash ==
AR, tau).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax.sharding import PartitionSpec as P

from ddtree_jax.cache import KVCache
from ddtree_jax.config import DFlashConfig, Qwen3Config, parse_dflash
from ddtree_jax.models.contract import ForwardMeta
from ddtree_jax.models import dflash, target_family
from ddtree_jax.models.params import ModelParams
from ddtree_jax.parallel import Parallel, put
from ddtree_jax.train import common, corpus
from ddtree_jax.train import features as features_lib
from ddtree_jax.train import tokenizer as tok_lib

RECIPE_GAMMA, RECIPE_BLOCK = 7.0, 16


# ----------------------------------------------------------------------------------------------------
# Config


def build_target_layer_ids(num_target_layers: int, num_taps: int) -> list[int]:
    """Tap layers spread from 1 to num_target_layers - 3, as the published drafters:
    `round(1 + i * (N - 4) / (n - 1))`, e.g. 36 layers, 5 taps -> [1, 9, 17, 25, 33]; 6 layers, 3 taps ->
    [1, 2, 3]; one tap -> [N // 2]. Targets with fewer than 5 layers get distinct layers in 0 .. N - 1."""
    n, taps = num_target_layers, num_taps
    if taps < 1 or taps > n:
        raise ValueError(f"num_taps must be in 1..{n} (the target's layers), got {taps}")
    if taps == 1:
        return [n // 2]
    if n >= 5:
        ids = sorted({round(1 + i * (n - 4) / (taps - 1)) for i in range(taps)})
        if len(ids) == taps:
            return ids
    return sorted({round(i * (n - 1) / (taps - 1)) for i in range(taps)})


def default_num_taps(num_target_layers: int) -> int:
    """5 like the published drafters, fewer for shallow targets (at most N - 3 layers in 1 .. N - 3)."""
    return max(1, min(5, num_target_layers - 3))


def loss_gamma(block_size: int) -> float:
    """The position-decay constant: 7 at bs 16 (the recipe), scaled with the block size elsewhere."""
    return RECIPE_GAMMA * block_size / RECIPE_BLOCK


def drafter_config_dict(target: Qwen3Config, *, num_layers: int, block_size: int, mask_token_id: int,
                        target_layer_ids: list[int], intermediate_size: int | None = None,
                        num_heads: int | None = None, num_kv_heads: int | None = None, head_dim: int | None = None,
                        dtype: str = "bfloat16") -> dict:
    """The drafter's HF `config.json` in the published layout; widths default to the target's."""
    return {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "vocab_size": target.vocab_size,
        "hidden_size": target.hidden_size,
        "intermediate_size": intermediate_size or target.intermediate_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads or target.num_heads,
        "num_key_value_heads": num_kv_heads or target.num_kv_heads,
        "head_dim": head_dim or target.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": target.max_position_embeddings,
        "rms_norm_eps": target.rms_norm_eps,
        "rope_theta": target.rope.theta,
        "rope_scaling": None,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "block_size": block_size,
        "num_target_layers": target.num_layers,
        "layer_types": ["full_attention"] * num_layers,
        "sliding_window": None,
        "use_sliding_window": False,
        "dflash_config": {"mask_token_id": mask_token_id, "target_layer_ids": list(target_layer_ids)},
        "torch_dtype": dtype,
    }


# ----------------------------------------------------------------------------------------------------
# Blocks, labels, weights


def position_weights(block_size: int, gamma: float) -> np.ndarray:
    """[bs - 1] float32: slot k = 1 .. bs - 1 gets exp(-(k - 1) / gamma) (slot 0 has no label)."""
    return np.exp(-np.arange(block_size - 1, dtype=np.float64) / gamma).astype(np.float32)


def block_inputs(tokens: jax.Array, lengths: jax.Array, anchors: jax.Array, anchor_ok: jax.Array, *,
                 block_size: int, mask_token_id: int, gamma: float):
    """Blocks, labels and weights for every (sequence, anchor) row.

    Args:
      tokens:    [b, L] int, sequences (right-padded); lengths [b] int, valid tokens per sequence.
      anchors:   [b, A] int anchor positions; anchor_ok [b, A] bool (False: the row weighs nothing).
    Returns (row i = sequence i // A, anchor i % A):
      block:   [b * A, bs] int32, `[x_a, mask x (bs - 1)]`.
      labels:  [b * A, bs - 1] int32, slot k (1 .. bs - 1) -> x_{a+k} (0 where a + k >= length).
      weights: [b * A, bs - 1] float32, exp(-(k - 1) / gamma) where a + k < length and the anchor is ok.
    Example, bs 4, x = [10 11 12 13 14], length 5, anchor 2: block [12 M M M], labels [13 14 0],
    weights [1, e^(-1/gamma), 0].
    """
    b, L = tokens.shape
    a = anchors.reshape(-1)  # [R]
    seq = jnp.repeat(jnp.arange(b), anchors.shape[1])  # [R]
    k = jnp.arange(1, block_size)  # slots 1 .. bs - 1
    pos = a[:, None] + k[None, :]  # [R, bs - 1]
    in_seq = pos < lengths[seq][:, None]
    labels = jnp.where(in_seq, tokens[seq[:, None], jnp.minimum(pos, L - 1)], 0).astype(jnp.int32)
    w = jnp.asarray(position_weights(block_size, gamma))[None, :]
    weights = jnp.where(in_seq & anchor_ok.reshape(-1)[:, None], w, 0.0)
    block = jnp.concatenate([tokens[seq, a][:, None], jnp.full((a.shape[0], block_size - 1), mask_token_id)], axis=1)
    return block.astype(jnp.int32), labels, weights


def sample_anchors(key: jax.Array, starts: jax.Array, lengths: jax.Array, max_len: int, num_anchors: int):
    """[b, A] distinct random anchors per sequence in [starts, lengths - 2], and [b, A] ok flags (False
    where a sequence has fewer than A candidates)."""
    pos = jnp.arange(max_len)[None, :]
    candidate = (pos >= starts[:, None]) & (pos <= lengths[:, None] - 2)
    scores = jnp.where(candidate, jax.random.uniform(key, (starts.shape[0], max_len)), -1.0)
    values, anchors = jax.lax.top_k(scores, num_anchors)
    return anchors.astype(jnp.int32), values >= 0


def row_caches(drafter: ModelParams, taps: jax.Array, lengths: jax.Array, anchors: jax.Array, dtype) -> KVCache:
    """The drafter's context cache for every row: taps [b, L, F] of each sequence are ingested once
    (`dflash.ingest_context`), then row (i, j) gets sequence i's cache with length anchors[i, j]: the
    context rows of positions < anchor, and nothing else visible. Equal to ingesting taps[i, :a] with
    counts = a into an empty cache, as inference does."""
    b, L, _ = taps.shape
    cache = dflash.ingest_context(drafter, taps, lengths, dflash.create_cache(drafter.config, b, L, dtype))
    seq = jnp.repeat(jnp.arange(b), anchors.shape[1])
    return KVCache(k=tuple(k[seq] for k in cache.k), v=tuple(v[seq] for v in cache.v),
                   lengths=anchors.reshape(-1).astype(jnp.int32))


def weighted_ce(logits: jax.Array, labels: jax.Array, weights: jax.Array):
    """(sum(w * CE) / sum(w), per-slot CE [R, bs - 1]) for float32 logits [R, bs - 1, v]."""
    picked = jnp.take_along_axis(logits, labels[..., None], axis=-1)[..., 0]
    ce = jax.nn.logsumexp(logits, axis=-1) - picked
    return jnp.sum(weights * ce) / jnp.maximum(jnp.sum(weights), 1e-9), ce


def target_taps(target: ModelParams, tokens: jax.Array, lengths: jax.Array, layer_ids: tuple[int, ...]) -> jax.Array:
    """[b, L, len(ids) * e] outputs of the frozen target's tapped layers (HF hidden_states[l + 1])."""
    b, L = tokens.shape
    dtype = target.array("model.embed_tokens.weight").dtype
    family = target_family(target.config)
    cache = family.create_cache(target.config, b, L, dtype)
    out = family.forward(target, tokens, ForwardMeta.prompt(lengths, L), cache, tap_layers=layer_ids)
    return jax.lax.stop_gradient(out.taps)


def rows_loss(drafter: ModelParams, target: ModelParams, taps: jax.Array, tokens: jax.Array, lengths: jax.Array,
              anchors: jax.Array, anchor_ok: jax.Array, *, gamma: float, dtype):
    """The training loss of a batch: (weighted CE, aux) with aux = (logits, labels, weights)."""
    config: DFlashConfig = drafter.config
    block, labels, weights = block_inputs(tokens, lengths, anchors, anchor_ok, block_size=config.block_size,
                                          mask_token_id=config.mask_token_id, gamma=gamma)
    cache = row_caches(drafter, taps, lengths, anchors, dtype)
    logits = dflash.draft_logits(drafter, target, block, cache)  # [R, bs - 1, v] float32
    loss, _ = weighted_ce(logits, labels, weights)
    return loss, (logits, labels, weights)


def block_metrics(logits: jax.Array, labels: jax.Array, weights: jax.Array) -> dict:
    """Per-slot accuracy (argmax == label) and a greedy-acceptance estimate.

    `tau_est`: 1 + the mean run of leading correct slots per row. On greedy target data a row's run is
    exactly the number of drafts DFlash would accept from that anchor (the bonus x_a is the target's
    own greedy token), so this is tau for rounds starting at random anchors (runs cut at the sequence
    end count as stops). It runs above the tau of real decoding, whose rounds start right after a
    missed draft, where the text tends to be harder."""
    valid = weights > 0
    correct = (jnp.argmax(logits, -1) == labels) & valid
    acc = jnp.sum(correct, 0) / jnp.maximum(jnp.sum(valid, 0), 1)
    run = jnp.sum(jnp.cumprod(correct, axis=1), axis=1)
    rows = valid[:, 0]
    return {"slot_accuracy": acc, "tau_est": 1.0 + jnp.sum(run * rows) / jnp.maximum(jnp.sum(rows), 1)}


def batch_taps(target: ModelParams, rows: Sequences, layer_ids: tuple[int, ...]) -> jax.Array:
    """The rows' taps: extracted ones (`rows.taps`, bf16 from disk), else the frozen target's, computed here."""
    return rows.taps if rows.taps is not None else target_taps(target, rows.tokens, rows.lengths, layer_ids)


def make_step(skeleton: ModelParams, optimizer, *, layer_ids: tuple[int, ...], num_anchors: int, gamma: float, dtype,
              parallel: Parallel = Parallel()):
    """The jitted step: (state, target, rows: Sequences, key, lr) -> (state, metrics).

    `rows` (tokens [b, L], starts [b], lengths [b], taps [b, L, F] or None) is split over the devices of a
    data-parallel `parallel` and the state replicated, so XLA sums the gradient over devices: the same
    update as one device running the whole batch."""

    def step(state, target, rows, key, lr):
        taps = batch_taps(target, rows, layer_ids)
        anchors, ok = sample_anchors(key, rows.starts, rows.lengths, rows.tokens.shape[1], num_anchors)

        def loss_fn(tree):
            loss, _ = rows_loss(common.to_params(skeleton, tree, dtype), target, taps, rows.tokens, rows.lengths,
                                anchors, ok, gamma=gamma, dtype=dtype)
            return loss

        loss, grads = jax.value_and_grad(loss_fn)(state["params"])
        params, opt_state, gnorm = common.apply_step(state["params"], state["opt_state"], grads, optimizer, lr)
        return {"params": params, "opt_state": opt_state, "step": state["step"] + 1}, {"loss": loss,
                                                                                       "grad_norm": gnorm}

    return jax.jit(step, donate_argnums=(0,), out_shardings=parallel.sharding(P()))


def place_rows(rows: Sequences, parallel: Parallel) -> Sequences:
    """Host rows -> device rows, split over the devices of a data-parallel `parallel`."""
    return jax.tree.map(lambda a: put(a, parallel.sharding(parallel.batch_spec(a.ndim))), rows)


def make_eval(skeleton: ModelParams, target: ModelParams, data: Sequences, *, layer_ids, num_anchors, gamma, dtype,
              batch: int, parallel: Parallel = Parallel(), seed: int = 777):
    """Held-out weighted loss, per-slot accuracy and tau_est on fixed anchors of the held-out sequences
    (`batch` rows per call; with a data-parallel `parallel`, len(data) and `batch` are multiples of its size)."""

    def one(tree, target, rows, key):
        taps = batch_taps(target, rows, layer_ids)
        anchors, ok = sample_anchors(key, rows.starts, rows.lengths, rows.tokens.shape[1], num_anchors)
        return rows_loss(common.to_params(skeleton, tree, dtype), target, taps, rows.tokens, rows.lengths, anchors, ok,
                         gamma=gamma, dtype=dtype)

    return chunked_eval(one, target, data, batch=batch, parallel=parallel, seed=seed)


def chunked_eval(rows_loss_fn, target: ModelParams, data: Sequences, *, batch: int, parallel: Parallel = Parallel(),
                 seed: int = 777, accuracy_name: str = "slot_accuracy"):
    """evaluate(state) -> {loss, tau_est, accuracy_name}: held-out metrics over `data` in calls of `batch` rows
    (call i's anchors seeded `seed + i`, so every evaluation sees the same rows). `rows_loss_fn(params tree,
    target, rows, key) -> (loss, (logits [R, k, v], labels [R, k], weights [R, k]))` is jitted here; the loss
    is weighted by each call's total weight, accuracy and tau_est as `block_metrics`."""

    @jax.jit
    def one(tree, target, rows, key):
        loss, (logits, labels, weights) = rows_loss_fn(tree, target, rows, key)
        m = block_metrics(logits, labels, weights)
        return loss, jnp.sum(weights), m["slot_accuracy"], m["tau_est"]

    chunks = [slice(i, min(i + batch, len(data))) for i in range(0, len(data), batch)]

    def evaluate(state) -> dict:
        losses, ws, accs, taus = [], [], [], []
        for i, s in enumerate(chunks):
            rows = place_rows(data.take(s), parallel)
            loss, w, acc, tau = one(state["params"], target, rows, jax.random.key(seed + i))
            losses.append(float(loss) * float(w))
            ws.append(float(w))
            accs.append(np.asarray(acc))
            taus.append(float(tau))
        return {"loss": sum(losses) / max(sum(ws), 1e-9), "tau_est": float(np.mean(taus)),
                accuracy_name: np.round(np.mean(accs, 0), 4)}

    return evaluate


def make_acceptance_eval(skeleton: ModelParams, target: ModelParams, prompts: list[list[int]], *, max_new_tokens: int,
                         dtype, parallel: Parallel = Parallel(), mtp_steps: int | None = None):
    """Greedy DFlash decoding of held-out `prompts` with the current parameters, as the doctor runs it (EOS
    ignored): tau and the acceptance rate per draft position (`doctor.position_acceptance`). `mtp_steps`: the
    parameters are an MTP head (`train/mtp.py`), decoded with `--mode mtp` and that many drafts per round."""
    from ddtree_jax.doctor import position_acceptance
    from ddtree_jax.engine import DecodeOptions, Mode, generate

    mode = Mode.DFLASH if mtp_steps is None else Mode.MTP
    options = DecodeOptions(mode=mode, max_new_tokens=max_new_tokens, parallel=parallel, mtp_steps=mtp_steps or 3)

    def evaluate(state) -> dict:
        drafter = common.to_params(skeleton, state["params"], dtype)
        result = generate(target, prompts, options, drafter=drafter)
        block = drafter.config.block_size if mtp_steps is None else mtp_steps + 1
        return {"tau": result.tau, "position_acceptance": position_acceptance(result.acceptance_lengths, block)}

    return evaluate


# ----------------------------------------------------------------------------------------------------
# Data


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Sequences:
    """Rows of training data (host or device arrays): tokens [n, L] int32 (right-padded with 0), starts [n]
    (prompt lengths: the first anchor position), lengths [n], and taps [n, L, F] (the target's tapped
    hidden states, bf16) when they were extracted to disk; None: the step runs the target for them."""

    tokens: np.ndarray
    starts: np.ndarray
    lengths: np.ndarray
    taps: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.tokens)

    def take(self, idx) -> Sequences:
        return Sequences(self.tokens[idx], self.starts[idx], self.lengths[idx],
                         None if self.taps is None else self.taps[idx])

    def save(self, path: Path) -> None:
        np.savez(path, tokens=self.tokens, starts=self.starts, lengths=self.lengths)

    @classmethod
    def load(cls, path: Path) -> Sequences:
        with np.load(path) as z:
            return cls(z["tokens"], z["starts"], z["lengths"])


def corpus_prompts(tokenizer, num: int, prompt_len: int, seed: int, *, corpus_root=None,
                   include_tests: bool = False, max_files: int | None = None) -> list[list[int]]:
    """`num` windows of `prompt_len` tokens from the corpus's training files (never across documents),
    at seeded random places."""
    train, _ = corpus.split_files(corpus.list_files(corpus_root, include_tests=include_tests))
    train = train[:max_files]
    rng = np.random.default_rng(seed)
    docs = [np.asarray(d, np.int32) for d in tok_lib.encode_documents(tokenizer, corpus.iter_texts(train, corpus_root))]
    docs = [d for d in docs if len(d) >= prompt_len]
    if not docs:
        raise ValueError(f"no corpus document has {prompt_len} tokens")
    counts = np.array([len(d) - prompt_len + 1 for d in docs])
    picks = rng.integers(0, counts.sum(), size=num)
    bounds = np.cumsum(counts)
    out = []
    for p in picks:
        i = int(np.searchsorted(bounds, p, side="right"))
        off = int(p - (bounds[i - 1] if i else 0))
        out.append(docs[i][off:off + prompt_len].tolist())
    return out


def random_prompts(vocab_size: int, num: int, prompt_len: int, seed: int, exclude: tuple[int, ...]) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    allowed = np.setdiff1d(np.arange(vocab_size), np.asarray(exclude, np.int64))
    return rng.choice(allowed, size=(num, prompt_len)).tolist()


def file_prompts(path: Path, tokenizer, target_dir: Path, vocab_size: int, prompt_len: int | None = None
                 ) -> list[list[int]]:
    """The token ids of a JSONL prompt file as `generate --prompts` reads it ('prompt', 'prompt_ids' or
    'messages' per line; a bad line is a `BadInput` naming FILE:LINE), each kept to its last `prompt_len`
    tokens (None: whole)."""
    from ddtree_jax.cli import BadInput, ChatOptions, read_prompt_file

    lines = read_prompt_file(path, tokenizer, target_dir, ChatOptions(), vocab_size)
    for line in lines:
        if line.error is not None:
            raise BadInput(line.error)
    return [line.ids[-prompt_len:] if prompt_len else list(line.ids) for line in lines]


def generate_sequences(target: ModelParams, prompts: list[list[int]], gen_len: int, *, batch: int,
                       temperature: float = 0.0, seed: int = 0, desc: str = "drafter data",
                       parallel: Parallel = Parallel(), width: int | None = None, progress: bool = True) -> Sequences:
    """Prompt + `gen_len` target tokens per prompt (AR through the engine, EOS does not stop), batched;
    rows right-padded to `width` tokens (default: the longest). The batch from row i on is seeded `seed + i`."""
    from tqdm import tqdm

    from ddtree_jax.engine import DecodeOptions, generate
    from ddtree_jax.sampling import SamplingConfig

    options = DecodeOptions(max_new_tokens=gen_len, eos_ids=(), sampling=SamplingConfig(temperature=temperature),
                            parallel=parallel)
    width = width or max(len(p) for p in prompts) + gen_len
    tokens = np.zeros((len(prompts), width), np.int32)
    starts = np.array([len(p) for p in prompts], np.int32)
    lengths = starts + gen_len
    for i in tqdm(range(0, len(prompts), batch), desc=desc, unit="batch", disable=None if progress else True):
        chunk = prompts[i:i + batch]
        # Full batches only, so one compiled shape serves all (the last one is padded with repeats).
        padded = chunk + [chunk[-1]] * (batch - len(chunk)) if len(prompts) > batch else chunk
        result = generate(target, padded, options, seed=seed + i)
        for r, (prompt, out) in enumerate(zip(chunk, result.output_ids[:len(chunk)], strict=True)):
            tokens[i + r, :len(prompt)] = prompt
            tokens[i + r, len(prompt):len(prompt) + gen_len] = out
    return Sequences(tokens, starts, lengths)


# ----------------------------------------------------------------------------------------------------
# Export and check


def export(tree: dict, config_raw: dict, out: Path, dtype=ml_dtypes.bfloat16) -> Path:
    from ddtree_jax.checkpoint import save_hf

    arrays = {name: np.asarray(a, np.float32).astype(dtype) for name, a in common.flatten(tree).items()}
    return save_hf(arrays, config_raw, out, force=True)


def greedy_check(target: ModelParams, drafter: ModelParams, prompts: list[list[int]], spec,
                 block: int, mode: str) -> dict:
    """Greedy decoding with `spec` (DecodeOptions of dflash or mtp, `block` tokens verified per round) against AR
    on `prompts`, as the doctor reports it: {"tau", "position_acceptance", "greedy_<mode>_equals_ar", "flagged",
    "prompts"}."""
    from ddtree_jax.doctor import diagnose
    from ddtree_jax.engine import Mode, generate

    out = generate(target, prompts, spec, drafter=drafter)
    lossless = out.output_ids == generate(target, prompts, dataclasses.replace(spec, mode=Mode.AR)).output_ids
    report = diagnose(out.acceptance_lengths, block, lossless, None, mode=mode)
    return {"tau": report.tau, "position_acceptance": [round(r, 4) for r in report.position_acceptance],
            f"greedy_{mode}_equals_ar": lossless, "flagged": report.flagged, "prompts": len(prompts)}


def check_export(target_dir: Path, out: Path, prompts: list[list[int]], max_new_tokens: int, dtype) -> dict:
    """Load the export with `load_drafter` and compare greedy DFlash with AR on `prompts` (`greedy_check`)."""
    from ddtree_jax.checkpoint import load_drafter, load_target
    from ddtree_jax.engine import DecodeOptions, Mode

    target = load_target(target_dir, dtype)
    drafter = load_drafter(out, target.config, dtype)
    return greedy_check(target, drafter, prompts, DecodeOptions(mode=Mode.DFLASH, max_new_tokens=max_new_tokens),
                        drafter.config.block_size, "dflash")


# ----------------------------------------------------------------------------------------------------
# Driver


@dataclasses.dataclass
class DrafterTrainConfig:
    target: Path | None  # None with `features`: the target the features were extracted from
    out: Path
    work: Path | None = None
    features: Path | None = None  # train from an extraction (`train.extract`) instead of generating data here
    # drafter shape
    block_size: int = 16
    layers: int = 5
    num_taps: int | None = None  # default: default_num_taps(target layers)
    target_layer_ids: tuple[int, ...] | None = None  # overrides num_taps
    intermediate_size: int | None = None  # default: the target's
    mask_token_id: int | None = None  # default: the tokenizer's <|mask|>, else the last embedding row
    gamma: float | None = None  # default: loss_gamma(block_size)
    # data generated here (without `features`)
    sequences: int = 4096
    prompt_len: int = 64
    gen_len: int = 192
    gen_batch: int = 256
    temperature: float = 0.0
    random_prompts: bool = False
    prompts_file: Path | None = None
    corpus_root: Path | None = None
    include_tests: bool = False
    max_files: int | None = None  # prompts from the first N training files only (smoke runs)
    held_out: float = 0.05  # fraction of the generated sequences kept for evaluation
    # data from `features`
    held_out_shards: int = 1  # the last shards, kept for evaluation
    eval_sequences: int = 64  # held-out sequences evaluated (from those shards)
    shuffle_shards: int = 8  # shards whose rows are shuffled together (a window; 2-3 windows are in memory)
    # optimization
    steps: int | None = 2000
    minutes: float | None = None
    batch: int = 16  # sequences per step
    anchors: int = 16  # anchors per sequence: rows per step = batch * anchors
    lr: float = 6e-4
    warmup: int = 100
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.01
    clip: float = 1.0
    seed: int = 0
    dtype: str = "auto"
    devices: int = 1  # data parallel
    eval_every: int = 250
    eval_prompts: Path | None = None  # JSONL; default: the prompts of the held-out sequences
    eval_decode: int = 8  # held-out prompts decoded with DFlash at every evaluation (0: none)
    eval_new_tokens: int = 64
    select: str = "tau_est"  # the held-out metric that picks the exported evaluation: tau_est or tau
    patience: int | None = None  # stop after this many evaluations without a better held-out `select`
    save_every: int = 500
    log_every: int = 25
    export_dtype: str = "bfloat16"
    check_prompts: int = 8
    check_new_tokens: int = 64

    def work_dir(self) -> Path:
        return Path(self.work) if self.work is not None else Path(str(self.out) + ".train")


SELECT_METRICS = ("tau_est", "tau")


def load_target_tokenizer(target_dir: Path):
    """The target folder's tokenizer, or None when it has none."""
    if not any((target_dir / f).exists() for f in ("tokenizer.json", "tokenizer_config.json")):
        return None
    return tok_lib.load_tokenizer(target_dir)


def default_mask_token_id(target_config, tokenizer) -> int:
    """The tokenizer's <|mask|> when it names one inside the vocabulary, else the last embedding row."""
    tok_mask = tok_lib.mask_token_id(tokenizer)
    return tok_mask if tok_mask is not None and tok_mask < target_config.vocab_size else target_config.vocab_size - 1


def parse_layer_ids(text: str | None) -> tuple[int, ...] | None:
    if not text:
        return None
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise ValueError(f"--target-layer-ids: expected comma-separated integers, got {text!r}") from None


def check_settings(cfg: DrafterTrainConfig, devices: int) -> None:
    """Flags that cannot work, refused before anything loads."""
    for flag, value in (("--batch", cfg.batch), ("--anchors", cfg.anchors), ("--devices", cfg.devices),
                        ("--shuffle-shards", cfg.shuffle_shards), ("--eval-new-tokens", cfg.eval_new_tokens)):
        if value < 1:
            raise ValueError(f"{flag}: expected >= 1, got {value}")
    if cfg.batch % devices:
        raise ValueError(f"--batch {cfg.batch}: must be a multiple of --devices {devices} (rows split evenly)")
    if cfg.select not in SELECT_METRICS:
        raise ValueError(f"--select: expected one of {', '.join(SELECT_METRICS)}, got {cfg.select!r}")
    if cfg.select == "tau" and cfg.eval_decode < 1:
        raise ValueError("--select tau needs --eval-decode >= 1 (tau comes from decoding held-out prompts)")
    if cfg.target is None and cfg.features is None:
        raise ValueError("--target is needed (or --features, whose manifest names its target)")


def held_out_rows(feats: features_lib.Features, shards: list[int], limit: int) -> Sequences:
    """The first `limit` rows of the held-out shards, taps included (host arrays)."""
    parts, n = [], 0
    for index in shards:
        if n >= limit:
            break
        arrays = feats.load(index)
        take = slice(0, min(limit - n, len(arrays["tokens"])))
        parts.append(Sequences(arrays["tokens"][take], arrays["starts"][take], arrays["lengths"][take],
                               arrays["taps"][take]))
        n += len(parts[-1])
    return jax.tree.map(lambda *a: np.concatenate(a), *parts)


def train_drafter(cfg: DrafterTrainConfig) -> dict:
    """Generate data (or open extracted features), train, checkpoint, export, check; returns a summary dict."""
    from ddtree_jax.checkpoint import load_target
    from ddtree_jax.config import load_target_config, read_config_json
    from ddtree_jax.parallel import make_parallel

    common.check_out_folder(cfg.out)
    parallel = make_parallel(cfg.devices, "dp") if cfg.devices > 1 else Parallel()
    check_settings(cfg, parallel.size)
    feats = features_lib.open_features(cfg.features) if cfg.features is not None else None
    target_dir = Path(cfg.target) if cfg.target is not None else Path(feats.manifest["target"]["path"])
    tconf: Qwen3Config = load_target_config(target_dir)
    tokenizer = load_target_tokenizer(target_dir)
    mask_id = cfg.mask_token_id if cfg.mask_token_id is not None else default_mask_token_id(tconf, tokenizer)
    asked = cfg.target_layer_ids or (build_target_layer_ids(tconf.num_layers, cfg.num_taps) if cfg.num_taps else None)
    if feats is not None:
        layer_ids = list(feats.target_layer_ids)
        if asked is not None and list(asked) != layer_ids:
            raise ValueError(f"--target-layer-ids/--num-taps ask for taps {list(asked)}, but {cfg.features} holds "
                             f"the taps of layers {layer_ids}")
        if cfg.held_out_shards >= len(feats.shards) or cfg.held_out_shards < 0:
            raise ValueError(f"--held-out-shards {cfg.held_out_shards}: {cfg.features} has {len(feats.shards)} shards "
                             "and at least one must be left for training")
    else:
        layer_ids = list(asked or build_target_layer_ids(tconf.num_layers, default_num_taps(tconf.num_layers)))
    eval_prompt_ids = None
    if cfg.eval_prompts is not None and cfg.eval_decode:
        eval_prompt_ids = file_prompts(cfg.eval_prompts, tokenizer, target_dir, tconf.vocab_size)[:cfg.eval_decode]
    gamma = cfg.gamma or loss_gamma(cfg.block_size)
    config_raw = drafter_config_dict(tconf, num_layers=cfg.layers, block_size=cfg.block_size, mask_token_id=mask_id,
                                     target_layer_ids=layer_ids, intermediate_size=cfg.intermediate_size,
                                     dtype=cfg.export_dtype)
    dconf = parse_dflash(config_raw, "drafter config")
    work = cfg.work_dir()
    run = common.TrainRun(work, title="DFlash drafter training")
    dtype = common.compute_dtype(cfg.dtype)
    target = load_target(target_dir, dtype, parallel=parallel)

    # 1. Data: extracted features, or sequences generated once and kept in the work folder (so a resumed
    # run trains on the same sequences).
    stream = None
    if feats is not None:
        feats.check_target(features_lib.fingerprint(target, read_config_json(target_dir)), target_dir)
        split = len(feats.shards) - cfg.held_out_shards
        stream = features_lib.ShardStream(feats, list(range(split)), batch=cfg.batch, window=cfg.shuffle_shards,
                                          seed=cfg.seed)
        eval_data = held_out_rows(feats, list(range(split, len(feats.shards))), cfg.eval_sequences) \
            if cfg.held_out_shards and cfg.eval_sequences > 0 else None
        source, n_train = f"features {cfg.features} ({feats.manifest['prompt_source']})", stream.rows
        run.save_meta(prompt_source=source)

        def rows_for(step: int) -> Sequences:
            return Sequences(**stream.batch_at(step))
    else:
        data_file = work / "sequences.npz"
        if data_file.exists():
            data = Sequences.load(data_file)
        else:
            data = make_sequences(cfg, target, tokenizer, target_dir, mask_id, run, parallel)
            data.save(data_file)
        n_eval = max(1, round(len(data) * cfg.held_out)) if len(data) > 1 else 0
        train_data, eval_data = data.take(slice(0, len(data) - n_eval)), data.take(slice(len(data) - n_eval, None))
        n_train = len(train_data)
        if cfg.batch > n_train:
            raise ValueError(f"--batch {cfg.batch} is larger than the {n_train} training sequences")

        def rows_for(step: int) -> Sequences:
            rng = np.random.default_rng((cfg.seed, step))
            return train_data.take(np.sort(rng.choice(n_train, size=cfg.batch, replace=False)))
    if eval_data is not None:  # whole rows per device
        eval_data = eval_data.take(slice(0, len(eval_data) - len(eval_data) % parallel.size))
    n_eval = len(eval_data) if eval_data is not None else 0

    # 2-5. Model, optimizer, loop.
    init = dflash.init_random(dconf, tconf.hidden_size, dtype=jnp.float32, seed=cfg.seed)
    skeleton = dflash.abstract(dconf, tconf.hidden_size, jnp.float32)
    tree = common.param_tree(init)
    del init
    optim = common.OptimConfig(lr=cfg.lr, warmup=cfg.warmup, min_ratio=cfg.min_lr_ratio,
                               weight_decay=cfg.weight_decay, clip=cfg.clip)
    optimizer = common.make_optimizer(optim, tree)
    state = {"params": tree, "opt_state": optimizer.init(tree), "step": jnp.zeros((), jnp.int32)}
    state = jax.device_put(state, parallel.sharding(P()))  # replicated over a data-parallel mesh
    state, start = run.resume(state)
    n_params = common.count_params(state["params"])
    run.save_meta(config=config_raw, params=n_params, gamma=gamma, sequences=n_train + n_eval,
                  held_out_sequences=n_eval, settings=json.loads(json.dumps(dataclasses.asdict(cfg), default=str)),
                  loss_name=f"weighted CE, w_k = exp(-(k-1)/{gamma:g}) (nats)")
    width = eval_data.tokens.shape[1] if eval_data is not None else feats.width
    print(f"drafter: {n_params / 1e6:.2f}M parameters, {cfg.layers} layers, block {cfg.block_size}, taps {layer_ids}, "
          f"mask {mask_id}, gamma {gamma:g}; {n_train} train / {n_eval} held-out sequences of {width} tokens"
          + (f"; data parallel over {parallel.size} devices" if parallel.size > 1 else "")
          + (f"; resuming at step {start}" if start else ""), file=sys.stderr)

    key = jax.random.key(cfg.seed)
    step_fn = make_step(skeleton, optimizer, layer_ids=tuple(layer_ids), num_anchors=cfg.anchors, gamma=gamma,
                        dtype=dtype, parallel=parallel)

    def batch_for(step: int):
        return target, place_rows(rows_for(step), parallel), jax.random.fold_in(key, step)

    evaluations = []
    if n_eval:
        evaluations.append(make_eval(skeleton, target, eval_data, layer_ids=tuple(layer_ids), num_anchors=cfg.anchors,
                                     gamma=gamma, dtype=dtype, batch=cfg.batch, parallel=parallel))
    if eval_prompt_ids is None and cfg.eval_decode and n_eval:
        eval_prompt_ids = [eval_data.tokens[i, :eval_data.starts[i]].tolist() for i in range(min(cfg.eval_decode,
                                                                                                   n_eval))]
    if eval_prompt_ids:
        evaluations.append(make_acceptance_eval(skeleton, target, eval_prompt_ids, max_new_tokens=cfg.eval_new_tokens,
                                                dtype=dtype, parallel=parallel))
    if cfg.select == "tau" and not eval_prompt_ids:
        raise ValueError(f"--select {cfg.select}: there are no held-out prompts to decode")
    selectable = bool(eval_prompt_ids) if cfg.select == "tau" else n_eval > 0  # else the last step is exported

    def evaluate(state) -> dict:
        return {k: v for evaluation in evaluations for k, v in evaluation(state).items()}

    def schedule_for(total: int) -> common.Schedule:
        return common.Schedule(cfg.lr, cfg.warmup, total, cfg.min_lr_ratio)

    try:
        state, steps = common.train_loop(
            run=run, state=state, start_step=start, total=None if cfg.minutes else cfg.steps,
            budget_seconds=cfg.minutes * 60 if cfg.minutes else None, schedule_for=schedule_for, step_fn=step_fn,
            batch_for=batch_for, evaluate=evaluate if evaluations else None, eval_every=cfg.eval_every,
            save_every=cfg.save_every, log_every=cfg.log_every, desc="drafter",
            best=(cfg.select, "max") if selectable else None, patience=cfg.patience)
    finally:
        if stream is not None:
            stream.close()

    export_dtype = {"bfloat16": ml_dtypes.bfloat16, "float32": np.float32}[cfg.export_dtype]
    out = export(state["params"], config_raw, Path(cfg.out), export_dtype)
    summary = {"out": str(out), "steps": steps, "params": n_params, "block_size": cfg.block_size,
               "target_layer_ids": layer_ids, "mask_token_id": mask_id, "gamma": gamma,
               "final_loss": run.history[-1]["loss"] if run.history else None,
               "held_out": next((e for e in run.evals if e["step"] == run.meta.get("best_step")),
                                run.evals[-1] if run.evals else None),
               "export_bytes": sum(f.stat().st_size for f in Path(out).glob("*.safetensors"))}
    chosen = summary["held_out"] or {}
    if "position_acceptance" in chosen:
        from ddtree_jax.doctor import acceptance_table

        print(f"drafter: exported step {chosen['step']}; on {len(eval_prompt_ids)} held-out prompts "
              f"({cfg.eval_new_tokens} tokens each) tau {chosen['tau']:.2f}, acceptance per draft position:",
              file=sys.stderr)
        print("\n".join(acceptance_table(chosen["position_acceptance"])), file=sys.stderr)
    if cfg.check_prompts and n_eval:
        k = min(cfg.check_prompts, n_eval)
        prompts = [eval_data.tokens[i, :eval_data.starts[i]].tolist() for i in range(k)]
        summary["check"] = check_export(target_dir, out, prompts, cfg.check_new_tokens, dtype)
        print(f"drafter check on {k} held-out prompts: tau {summary['check']['tau']:.2f}, greedy DFlash == AR: "
              f"{summary['check']['greedy_dflash_equals_ar']}, acceptance per position "
              f"{summary['check']['position_acceptance']}", file=sys.stderr)
    run.write_log(summary=summary)
    return summary


def make_sequences(cfg: DrafterTrainConfig, target: ModelParams, tokenizer, target_dir: Path, mask_id: int,
                   run: common.TrainRun, parallel: Parallel) -> Sequences:
    """The training sequences of a run without extracted features: prompts continued by the target."""
    tconf = target.config
    if cfg.random_prompts and cfg.prompts_file is None:
        tokenizer = None
    if cfg.prompts_file is not None:
        prompts = file_prompts(cfg.prompts_file, tokenizer, target_dir, tconf.vocab_size, cfg.prompt_len)
        prompts = [prompts[i % len(prompts)] for i in range(cfg.sequences)]
        source = f"JSONL {cfg.prompts_file}"
    elif tokenizer is not None:
        prompts = corpus_prompts(tokenizer, cfg.sequences, cfg.prompt_len, cfg.seed, corpus_root=cfg.corpus_root,
                                 include_tests=cfg.include_tests, max_files=cfg.max_files)
        source = "corpus windows"
    else:
        prompts = random_prompts(tconf.vocab_size, cfg.sequences, cfg.prompt_len, cfg.seed, (mask_id,))
        source = "random token ids"
    print(f"drafter: generating {len(prompts)} continuations of {cfg.gen_len} tokens ({source} prompts, "
          f"{'greedy' if cfg.temperature == 0 else f'temperature {cfg.temperature}'})", file=sys.stderr)
    t0 = time.perf_counter()
    data = generate_sequences(target, prompts, cfg.gen_len, batch=min(cfg.gen_batch, len(prompts)),
                              temperature=cfg.temperature, seed=cfg.seed, parallel=parallel)
    print(f"drafter: generated {len(data)} sequences in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    run.save_meta(prompt_source=source)
    return data


def add_generation_args(g, defaults) -> None:
    """The flags of the target-generated training data (`generate_sequences`), which the drafter and the MTP
    trainers share; `defaults` is the trainer's config."""
    g.add_argument("--sequences", type=int, default=defaults.sequences, help="target-generated training sequences")
    g.add_argument("--prompt-len", type=int, default=defaults.prompt_len,
                   help="prompt tokens: corpus windows of N tokens; file and function prompts keep their last N")
    g.add_argument("--gen-len", type=int, default=defaults.gen_len, help="target tokens generated per prompt")
    g.add_argument("--gen-batch", type=int, default=defaults.gen_batch)
    g.add_argument("--temperature", type=float, default=defaults.temperature, help="data generation (0: greedy)")
    src = g.add_mutually_exclusive_group()
    src.add_argument("--random-prompts", "--tokenizer-free", dest="random_prompts", action="store_true",
                     help="random token-id prompts even if the target has a tokenizer (always so without one)")
    src.add_argument("--prompts", dest="prompts_file", type=Path, default=None,
                     help="JSONL prompts ({'prompt': ...} or {'prompt_ids': [...]}), cycled to --sequences")
    g.add_argument("--corpus-root", type=Path, default=None, help="folder of .py files for prompts (default: stdlib)")
    g.add_argument("--include-tests", action="store_true")
    g.add_argument("--max-files", type=int, default=None, help="prompts from the first N training files only")


def parse_args(argv=None) -> DrafterTrainConfig:
    from ddtree_jax.train.target import add_common_args

    d = DrafterTrainConfig(target=Path("."), out=Path("."))
    p = argparse.ArgumentParser(prog="python -m ddtree_jax.train.drafter", description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--target", type=Path, default=None,
                   help="target checkpoint folder (HF or orbax); with --features, default: the one they came from")
    p.add_argument("--out", type=Path, required=True, help="drafter export folder (replaced at the end)")
    p.add_argument("--features", type=Path, default=None,
                   help="train from this extraction (python -m ddtree_jax.train.extract) instead of generating data")
    p.add_argument("--block-size", type=int, default=d.block_size)
    p.add_argument("--layers", type=int, default=d.layers, help="drafter decoder layers")
    p.add_argument("--num-taps", type=int, default=None, help="target layers tapped (default: min(5, layers - 3))")
    p.add_argument("--target-layer-ids", default=None, help="comma-separated tap layers (overrides --num-taps)")
    p.add_argument("--intermediate", type=int, default=None, help="drafter MLP width (default: the target's)")
    p.add_argument("--mask-token-id", type=int, default=None,
                   help="default: the tokenizer's <|mask|>, else the target's last embedding row")
    p.add_argument("--gamma", type=float, default=None, help="loss decay (default: 7 * block_size / 16)")
    add_generation_args(p.add_argument_group("data generated here (without --features)"), d)
    f = p.add_argument_group("data from --features")
    f.add_argument("--held-out-shards", type=int, default=d.held_out_shards,
                   help="the last shards, kept for the held-out loss (and prompts, without --eval-prompts)")
    f.add_argument("--eval-sequences", type=int, default=d.eval_sequences, help="held-out sequences evaluated")
    f.add_argument("--shuffle-shards", type=int, default=d.shuffle_shards,
                   help="shards whose rows are shuffled together (memory holds two or three such windows)")
    p.add_argument("--batch", type=int, default=d.batch, help="sequences per step (over all devices)")
    p.add_argument("--anchors", type=int, default=d.anchors, help="anchors (blocks) per sequence")
    p.add_argument("--devices", type=int, default=d.devices, help="data parallel over this many devices")
    add_common_args(p, d)
    p.add_argument("--eval-prompts", type=Path, default=None,
                   help="JSONL held-out prompts decoded at every evaluation (default: the held-out sequences' prompts)")
    p.add_argument("--eval-decode", type=int, default=d.eval_decode,
                   help="prompts decoded with DFlash at every evaluation for tau and acceptance per draft position "
                        "(0: none)")
    p.add_argument("--eval-new-tokens", type=int, default=d.eval_new_tokens, help="tokens per decoded prompt")
    p.add_argument("--select", choices=SELECT_METRICS, default=d.select,
                   help="held-out metric choosing the exported evaluation: tau_est (anchors in held-out sequences) "
                        "or tau (decoding the held-out prompts)")
    p.add_argument("--export-dtype", choices=["bfloat16", "float32"], default=d.export_dtype)
    p.add_argument("--check-prompts", type=int, default=d.check_prompts,
                   help="held-out prompts for the final DFlash-vs-AR check (0: skip)")
    a = p.parse_args(argv)
    return DrafterTrainConfig(
        target=a.target, out=a.out, work=a.work, features=a.features, block_size=a.block_size, layers=a.layers,
        num_taps=a.num_taps, target_layer_ids=parse_layer_ids(a.target_layer_ids), intermediate_size=a.intermediate,
        mask_token_id=a.mask_token_id, gamma=a.gamma, sequences=a.sequences, prompt_len=a.prompt_len,
        gen_len=a.gen_len, gen_batch=a.gen_batch, temperature=a.temperature, random_prompts=a.random_prompts,
        prompts_file=a.prompts_file, corpus_root=a.corpus_root, include_tests=a.include_tests, max_files=a.max_files,
        held_out_shards=a.held_out_shards, eval_sequences=a.eval_sequences, shuffle_shards=a.shuffle_shards,
        steps=None if a.minutes else a.steps, minutes=a.minutes, batch=a.batch, anchors=a.anchors, lr=a.lr,
        warmup=a.warmup, min_lr_ratio=a.min_lr_ratio, weight_decay=a.weight_decay, clip=a.clip, seed=a.seed,
        dtype=a.dtype, devices=a.devices, eval_every=a.eval_every, eval_prompts=a.eval_prompts,
        eval_decode=a.eval_decode, eval_new_tokens=a.eval_new_tokens, select=a.select, patience=a.patience,
        save_every=a.save_every, log_every=a.log_every, export_dtype=a.export_dtype, check_prompts=a.check_prompts)


def main(argv=None) -> int:
    from ddtree_jax.checkpoint import CheckpointError
    from ddtree_jax.cli import BadInput
    from ddtree_jax.config import ConfigError

    try:
        cfg = parse_args(argv)
        summary = train_drafter(cfg)
    except (BadInput, CheckpointError, ConfigError, ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(summary, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
