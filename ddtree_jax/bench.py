"""`python -m ddtree_jax.bench`: time AR, DFlash and DDTree rounds, by stage, against hardware floors.

Two ways to run:
- `--shape qwen3-8b` (or qwen3-4b, qwen3-32b, tiny; the hybrid qwen3.6-27b, tiny-hybrid): random bf16
  weights of that shape built on the device, a matching random drafter (the published DFlash layout of
  that target, block 16), a cache filled with `--context` tokens (and, for a hybrid, random recurrent
  states and conv windows). Times per round, separately and in total: draft, tree build, verify, accept,
  commit, for AR, DFlash and DDTree at `--budgets`. For a hybrid target every row also gives the bytes of
  per-node recurrent-state vectors that its verify keeps (`recurrent_node_bytes`), which the floor counts. Random
  weights accept almost nothing, so tokens/s are also projected at a given tau (`--tau`, default the
  paper's MATH-500 Qwen3-8B values), marked as projected.
- `--target DIR --drafter DIR --prompts FILE.jsonl`: all modes on real prompts: tau, tokens/s, speedup
  over AR measured in the same run, and the first greedy divergence from AR. With neither `--shape` nor
  `--target`: the demo pair shipped with the package, on its held-out prompts.

The same run measures the memory bandwidth (several ways, the best taken) and the bf16 matmul rate;
every row prints its floor (max(bytes / bandwidth, FLOPs / matmul rate)) and the ratio to it. A round is
timed inside the device loop, as `generate` runs it: calls of 8 rounds against calls of 1, so that a
call's dispatch cancels out (one round per call is reported beside it). Rows are compiled in parallel
threads before any is timed. Warm-up is excluded, times are medians of repeats, each synchronised on the
device. Writes a JSON file with every figure, a markdown table and a plot (time per round against
budget, with the floor); `--trace DIR` adds a profiler trace per row.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import functools
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

SHAPES = {
    # HF config fields of the targets; the drafter follows the published DFlash layout for each.
    "qwen3-8b": dict(hidden_size=4096, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                     head_dim=128, intermediate_size=12288, vocab_size=151936, tie_word_embeddings=False,
                     rope_theta=1e6),
    "qwen3-4b": dict(hidden_size=2560, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                     head_dim=128, intermediate_size=9728, vocab_size=151936, tie_word_embeddings=True,
                     rope_theta=1e6),
    "qwen3-32b": dict(hidden_size=5120, num_hidden_layers=64, num_attention_heads=64, num_key_value_heads=8,
                      head_dim=128, intermediate_size=25600, vocab_size=151936, tie_word_embeddings=False,
                      rope_theta=1e6),
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                 intermediate_size=128, vocab_size=320, tie_word_embeddings=False, rope_theta=1e4),
    # Hybrid targets (Gated DeltaNet + gated full attention), HF `qwen3_5_text` fields. Qwen3.6-27B's
    # text_config as research/dflash_qwen.md 5.2 gives it (every field is there; none falls back to
    # transformers' Qwen3_5TextConfig defaults). M-RoPE with text positions is 1-D RoPE, so mrope_section is
    # left out; MTP weights are not part of the target.
    "qwen3.6-27b": dict(model_type="qwen3_5_text", hidden_size=5120, num_hidden_layers=64,
                        layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 16,
                        intermediate_size=17408, num_attention_heads=24, num_key_value_heads=4, head_dim=256,
                        attn_output_gate=True, linear_conv_kernel_dim=4, linear_key_head_dim=128,
                        linear_num_key_heads=16, linear_num_value_heads=48, linear_value_head_dim=128,
                        vocab_size=248320, tie_word_embeddings=False, rms_norm_eps=1e-6,
                        max_position_embeddings=262144,
                        rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25}),
    "tiny-hybrid": dict(model_type="qwen3_5_text"),  # random_checkpoint.tiny_qwen3_5_config as it is
}
# The drafter of each shape, as the published DFlash checkpoint for that target lays it out (HF drafter
# config fields; research/dflash_qwen.md 1.3 and 1.6). Shapes not listed get the Qwen3-8B-DFlash layout
# (5 full-attention non-causal layers, 32/8 heads of 128, the target's FFN width, block 16).
DRAFTERS = {
    # z-lab/Qwen3.6-27B-DFlash: 4 causal sliding-window (2048) layers + 1 non-causal full-attention layer.
    "qwen3.6-27b": dict(num_hidden_layers=5, layer_types=["sliding_attention"] * 4 + ["full_attention"],
                        sliding_window=2048, use_sliding_window=True, num_attention_heads=32,
                        num_key_value_heads=8, head_dim=128, intermediate_size=17408, rope_theta=1e7,
                        max_position_embeddings=262144, block_size=16, num_target_layers=64,
                        dflash_config={"mask_token_id": 248070, "target_layer_ids": [1, 16, 31, 46, 61]}),
    # The same layout in miniature: one causal sliding-window layer (window 8) and one non-causal layer.
    "tiny-hybrid": dict(num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"], sliding_window=8,
                        use_sliding_window=True, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                        intermediate_size=128, block_size=16, num_target_layers=4,
                        dflash_config={"mask_token_id": 319, "target_layer_ids": [0, 3]}),
}
SMALL_SHAPES = ("tiny", "tiny-hybrid")  # CPU-sized: small ceiling measurements too
LOOP_ROUNDS = 8  # rounds per timed call of the device loop (time_stages)
# The paper's Table 1, MATH-500, Qwen3-8B, T = 0: DFlash tau 7.79; DDTree tau 10.73 at its best budget.
# Per-budget values are not published; these defaults use the DDTree figure for every budget >= 64 and
# interpolate below. Override with --tau.
DEFAULT_TAU = {"ar": 1.0, "dflash": 7.79, 16: 9.0, 64: 10.73, 256: 10.73, 512: 10.73}


def _projected_tau(taus: dict, mode: str, budget: int | None) -> float:
    """tau for a mode (and DDTree budget): the given value, else the nearest smaller listed budget's."""
    if mode != "ddtree":
        return taus.get(mode, 1.0)
    budgets = sorted(k for k in taus if isinstance(k, int))
    below = [k for k in budgets if k <= budget]
    return taus[budget] if budget in taus else taus[below[-1] if below else budgets[0]]


def _median_seconds(fn, repeats: int, warmup: int = 2) -> float:
    import jax

    for _ in range(warmup):
        jax.block_until_ready(fn())
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure_ceilings(repeats: int, small: bool) -> dict:
    """Memory bandwidth and the bf16 matmul rate of the default device.

    Bandwidth is measured several ways, because XLA's kernels reach different fractions of the hardware
    rate: `copy` (`a * 2 + 1` over 2 GiB of bf16, bytes read + written), `read` (a float32 sum of the same
    array, bytes read), `gemv` (a 1 GiB bf16 matrix times a vector, the matrix's bytes: the access pattern
    of a batch-1 decode step) and, where PyTorch sees a CUDA GPU, `torch_copy` (a 4 GiB device-to-device
    copy timed with CUDA events, bytes read + written: the method the device notes use). On the H200 the
    three XLA figures came out at 2.4-3.4 TB/s while torch's copy and XLA's own matmul kernels inside a
    decode step reached 4.1-4.3 TB/s (docs/performance.md). `bandwidth_bytes_per_s` is the highest of them:
    the floors use it, so that no row can look closer to its floor because one measurement came out low.
    """
    import jax
    import jax.numpy as jnp

    n = 2**22 if small else 2**30  # elements of bf16: 8 MiB or 2 GiB
    x = jax.random.normal(jax.random.key(0), (n,), jnp.bfloat16)
    copy = jax.jit(lambda a: a * 2 + 1)
    copy_bw = 2 * x.nbytes / _median_seconds(lambda: copy(x), repeats)
    total = jax.jit(lambda a: jnp.sum(a, dtype=jnp.float32))
    read_bw = x.nbytes / _median_seconds(lambda: total(x), repeats)
    shape = (512, 2048) if small else (2**14, 2**15)  # 2 MiB or 1 GiB of bf16
    w = x[: shape[0] * shape[1]].reshape(shape)
    v = jax.random.normal(jax.random.key(3), (w.shape[1],), jnp.bfloat16)
    gemv = jax.jit(lambda m, u: jnp.einsum("oi,i->o", m, u))
    gemv_bw = w.nbytes / _median_seconds(lambda: gemv(w, v), repeats)
    m = 512 if small else 8192
    a = jax.random.normal(jax.random.key(1), (m, m), jnp.bfloat16)
    b = jax.random.normal(jax.random.key(2), (m, m), jnp.bfloat16)
    mm = jax.jit(lambda p, q: p @ q)
    matmul = 2 * m**3 / _median_seconds(lambda: mm(a, b), repeats)
    out = {"copy_bytes_per_s": copy_bw, "read_bytes_per_s": read_bw, "gemv_bytes_per_s": gemv_bw,
           "bf16_flops_per_s": matmul}
    torch_bw = None if small else torch_copy_bandwidth()
    if torch_bw:
        out["torch_copy_bytes_per_s"] = torch_bw
    out["bandwidth_bytes_per_s"] = max(v for k, v in out.items() if k.endswith("bytes_per_s"))
    return out


def torch_copy_bandwidth(n_bytes: int = 4 << 30, repeats: int = 10) -> float | None:
    """Bytes read + written per second of a PyTorch device-to-device copy timed with CUDA events, or None
    where PyTorch is missing or sees no CUDA GPU (it then costs nothing but the import attempt)."""
    try:
        import torch
    except ImportError:
        return None
    try:
        if not torch.cuda.is_available():
            return None
        src = torch.randn(n_bytes // 2, dtype=torch.bfloat16, device="cuda")
        dst = torch.empty_like(src)
        for _ in range(3):
            dst.copy_(src)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        times = []
        for _ in range(repeats):
            start.record()
            dst.copy_(src)
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        del src, dst
        torch.cuda.empty_cache()
        return 2 * n_bytes / statistics.median(times)
    except RuntimeError:  # e.g. no device memory left beside JAX's
        return None


def shape_configs(shape: str, layers: int | None = None) -> tuple[dict, dict]:
    """HF config dicts (target, drafter) of a named shape; `layers` cuts the target to that many decoder
    layers (tools/compile_times.py; Qwen3 shapes only)."""
    from ddtree_jax.random_checkpoint import tiny_dflash_config, tiny_qwen3_5_config, tiny_qwen3_config

    fields = dict(SHAPES[shape])
    if layers:
        if shape in DRAFTERS:
            raise ValueError(f"--layers cuts Qwen3 shapes only, not {shape}")
        fields["num_hidden_layers"] = layers
    hybrid = fields.get("model_type") == "qwen3_5_text"
    target_raw = tiny_qwen3_5_config(**fields) if hybrid else tiny_qwen3_config(**fields)
    if shape in DRAFTERS:
        return target_raw, tiny_dflash_config(target_raw, **DRAFTERS[shape])
    n_layers = target_raw["num_hidden_layers"]
    big = shape not in SMALL_SHAPES
    # The published drafters' taps at 36 layers; otherwise five spread over the layers (fewer when few).
    taps = [1, 9, 17, 25, 33] if n_layers == 36 else \
        sorted({min(n_layers - 1, round(1 + i * max(n_layers - 4, 0) / 4)) for i in range(5)})
    drafter_raw = tiny_dflash_config(
        target_raw, num_hidden_layers=5 if big else 2, layer_types=["full_attention"] * (5 if big else 2),
        num_attention_heads=32 if big else 4, num_key_value_heads=8 if big else 2, head_dim=128 if big else 16,
        intermediate_size=target_raw["intermediate_size"], block_size=16,
        dflash_config={"mask_token_id": target_raw["vocab_size"] - 1,
                       "target_layer_ids": taps if big else [0, n_layers - 1]})
    return target_raw, drafter_raw


def _random_pair(shape: str, parallel):
    """Random bf16 target (Qwen3, or a Qwen3.5/3.6 hybrid) and drafter of a named shape, initialised on the
    device."""
    import jax

    from ddtree_jax.checkpoint import target_module
    from ddtree_jax.config import TARGET_PARSERS, check_pair, parse_dflash
    from ddtree_jax.models import dflash
    from ddtree_jax.models.params import ModelParams
    from ddtree_jax.parallel import param_shardings

    target_raw, drafter_raw = shape_configs(shape)
    t_cfg, d_cfg = TARGET_PARSERS[target_raw["model_type"]](target_raw), parse_dflash(drafter_raw)
    check_pair(t_cfg, d_cfg, where=f"{shape} drafter")

    def init(abstract: ModelParams, seed: int) -> ModelParams:
        # One small jitted initialiser per (shape, sharding), not one program for the whole model: XLA
        # takes many minutes to compile a single random-init program of an 8B model.
        shardings = param_shardings(abstract, parallel)
        arrays = {}
        for i, (name, leaf) in enumerate(abstract.flat().items()):
            ones = "norm" in name
            arrays[name] = _random_array(leaf.shape, str(leaf.dtype), ones, shardings[name])(
                jax.random.fold_in(jax.random.key(seed), i))
        return abstract.replace_flat(arrays)

    target = init(target_module(t_cfg).abstract(t_cfg), 0)
    drafter = init(dflash.abstract(d_cfg, t_cfg.hidden_size), 1)
    return target, drafter


@functools.lru_cache(maxsize=None)
def _random_array(shape, dtype: str, ones: bool, sharding):
    import jax
    import jax.numpy as jnp

    def make(key):
        if ones:
            return jnp.ones(shape, dtype)
        return (jax.random.normal(key, shape, jnp.float32) * 0.02).astype(dtype)

    return jax.jit(make, out_shardings=sharding)


def _param_bytes(params) -> int:
    return sum(a.size * a.dtype.itemsize for a in params.flat().values())


def _filled_state(target, drafter, context: int, options, parallel, rounds: int, tokens_per_round: int | None = None):
    """A decode state whose caches hold `context` committed tokens of random K/V (and, for a hybrid target,
    random recurrent states and conv windows), with room for `rounds` rounds of `tokens_per_round` committed
    tokens each (default: full acceptance)."""
    import jax
    import jax.numpy as jnp

    from ddtree_jax.cache import HybridCache, RecurrentState
    from ddtree_jax.engine import target_model
    from ddtree_jax.models import dflash

    b = 1
    # Tight capacity: the pure-JAX attention reads every slot (masked), so spare room would be timed too.
    per_round = tokens_per_round or (options.block_size + 1 if options.mode.needs_drafter else 1)
    capacity = -(-(context + rounds * per_round + options.verify_width) // 128) * 128
    dtype = jnp.bfloat16

    def random_like(shape_dtype, sharding, seed: int):
        # One small cached initialiser per shape (a single program that draws every layer's K/V compiled
        # for minutes on the H200).
        return _random_array(shape_dtype.shape, str(shape_dtype.dtype), False, sharding)(jax.random.key(seed))

    def filled(cache, seed: int):
        sharding = parallel.sharding(parallel.kv_spec(cache.k[0].shape[2]))
        ks = tuple(random_like(k, sharding, seed * 1000 + i) for i, k in enumerate(cache.k))
        vs = tuple(random_like(v, sharding, seed * 1000 + 500 + i) for i, v in enumerate(cache.v))
        return dataclasses.replace(cache, k=ks, v=vs, lengths=jnp.full((b,), context, jnp.int32))

    def filled_target(cache, seed: int):
        if not isinstance(cache, HybridCache):
            return filled(cache, seed)
        # Recurrent states as the engine lays them out: rows over dp, replicated under tp.
        state_sharding = parallel.sharding(parallel.batch_spec(4))
        conv_sharding = parallel.sharding(parallel.batch_spec(3))
        recurrent = tuple(RecurrentState(state=random_like(r.state, state_sharding, seed * 1000 + 700 + i),
                                         conv=random_like(r.conv, conv_sharding, seed * 1000 + 900 + i))
                          for i, r in enumerate(cache.recurrent))
        return HybridCache(kv=filled(cache.kv, seed), recurrent=recurrent)

    model = target_model(target)
    cache = filled_target(jax.eval_shape(lambda: model.create_cache(target.config, b, capacity, dtype)), 1)
    draft_cache = None
    if options.mode.needs_drafter:
        draft_cache = filled(jax.eval_shape(lambda: dflash.create_cache(drafter.config, b, capacity, dtype)), 2)
    return decode_state(cache, draft_cache, options)


def decode_state(cache, draft_cache, options):
    """A batch-1 decode state mid-generation around the given caches (last token 1, nothing done)."""
    import jax
    import jax.numpy as jnp

    from ddtree_jax.engine import DecodeState, RoundTrace

    b = 1
    return DecodeState(
        cache=cache, draft_cache=draft_cache, last_token=jnp.ones((b,), jnp.int32),
        output=jnp.zeros((b, options.max_new_tokens), jnp.int32), num_generated=jnp.ones((b,), jnp.int32),
        done=jnp.zeros((b,), bool), round_lengths=jnp.zeros((b, options.max_rounds), jnp.int32),
        num_rounds=jnp.zeros((b,), jnp.int32), rng=jax.random.key(0), step=jnp.zeros((), jnp.int32),
        trace=RoundTrace.empty(b, options.verify_width, options.block_size) if options.record_trees else None)


@dataclasses.dataclass
class RowPrograms:
    """One bench row, compiled: `programs` maps "round" (the device loop) and the stages ("draft", "tree",
    "verify", "accept", "commit") to (compiled function, its arguments). The loop's entry holds the weights;
    its decode state, which every call donates, is `state` (the newest). The stages' arguments are a second
    filled state and the outputs of the stages before them, computed once while compiling."""

    programs: dict
    state: object = None


def _compile(fn, *args, donate: tuple[int, ...] = ()):
    import jax

    return jax.jit(fn, donate_argnums=donate).lower(*args).compile()


def prepare_stages(target, drafter, options, context: int, repeats: int, parallel) -> RowPrograms:
    """Compile a row's device loop and, for DFlash and DDTree, each stage of a round, on filled caches.

    The loop is the engine's own (`engine.decode_loop`, the rounds of `engine.ROUNDS`, the number of rounds
    an argument); the stages are a round's pieces, each compiled alone, for
    either target family (the engine's dispatch): on a hybrid target the verify also walks every Gated
    DeltaNet layer over the tree nodes and keeps each node's state, and the commit installs the deepest
    accepted node's state and conv window beside the K/V move. Runs each stage once (untimed) to get the
    next stage's inputs, so rows can be prepared in parallel threads (XLA compiles without the GIL) and
    timed one after another afterwards (`time_stages`).
    """
    import jax
    import jax.numpy as jnp

    from ddtree_jax.accept import accept_tree, chain_tree
    from ddtree_jax.cache import HybridCache, advance, commit_path, commit_recurrent
    from ddtree_jax.engine import Mode, _target_forward, decode_loop, target_model
    from ddtree_jax.models import dflash
    from ddtree_jax.sampling import decode_tokens
    from ddtree_jax.tree import build_tree

    rounds = repeats + 2  # _median_seconds' warm-up included
    # Every array reaches a compiled stage as an argument: one closed over becomes a constant of the
    # program (16 GB of them at 8B, which XLA then tries to constant-fold for minutes).
    # The round runs as generate runs it: inside the device loop (`engine.decode_loop`), `max_steps` rounds
    # per call. Random weights commit about one token per round (the drafts are rejected), so the loop's
    # cache leaves room for two per round: the pure-JAX attention reads every slot, spare room would be timed.
    state = _filled_state(target, drafter, context, options, parallel, rounds * (LOOP_ROUNDS + 1) + LOOP_ROUNDS,
                          tokens_per_round=2 if options.mode.needs_drafter else 1)
    loop_c = _compile(lambda t, d, s, n: decode_loop(t, d, s, n, options), target, drafter, state, jnp.int32(1),
                      donate=(2,))
    row = RowPrograms(programs={"round": (loop_c, (target, drafter))}, state=state)
    if options.mode is Mode.AR:
        return row
    stage_state = _filled_state(target, drafter, context, options, parallel, rounds)
    kernels = options.attention_kernels
    bs, b = options.block_size, 1

    def stage(name, fn, *args):
        compiled = _compile(fn, *args)
        row.programs[name] = (compiled, args)
        return compiled(*args)

    block = jnp.concatenate([stage_state.last_token[:, None],
                             jnp.full((b, bs - 1), drafter.config.mask_token_id, jnp.int32)], axis=1)
    logits = stage("draft", lambda d, t, blk, dc: dflash.draft_logits(d, t, blk, dc, kernels),
                   drafter, target, block, stage_state.draft_cache)
    if options.mode is Mode.DDTREE:
        tree_fn = lambda lg, last: build_tree(jax.nn.log_softmax(lg, -1), last, options.budget)  # noqa: E731
    else:
        tree_fn = lambda lg, last: chain_tree(jnp.concatenate(  # noqa: E731
            [last[:, None], jnp.argmax(lg, -1).astype(jnp.int32)], axis=1))
    tree = stage("tree", tree_fn, logits, stage_state.last_token)

    def verify_fn(t, tr, cache, rng):
        # As the engine's verify: a hybrid's recurrent layers walk the tree (parents), keeping every node's state.
        fwd = _target_forward(t, tr.tokens, cache.lengths[:, None] + tr.depths, cache, tr.ancestor,
                              tap_layers=drafter.config.target_layer_ids, kernels=kernels, parents=tr.parents)
        return fwd, decode_tokens(target_model(t).logits(t, fwd.hidden), rng, options.sampling)

    fwd, decoded = stage("verify", verify_fn, target, tree, stage_state.cache, stage_state.rng)
    acc = stage("accept", lambda tr, dec: accept_tree(tr, dec, bs), tree, decoded)

    def commit_fn(d, f, a, draft_cache):
        # As the engine's commit.
        hybrid = isinstance(f.cache, HybridCache)
        kv = f.cache.kv if hybrid else f.cache
        if options.mode is Mode.DDTREE:
            kv = commit_path(kv, a.path, a.count)
            taps = jnp.take_along_axis(f.taps, a.path[:, :, None], axis=1)
        else:
            kv, taps = advance(kv, a.count), f.taps
        cache = HybridCache(kv=kv, recurrent=tuple(commit_recurrent(r, n, a.path, a.count)
                                                   for r, n in zip(f.cache.recurrent, f.nodes))) if hybrid else kv
        return cache, dflash.ingest_context(d, taps, a.count, draft_cache)

    stage("commit", commit_fn, drafter, fwd, acc, stage_state.draft_cache)
    return row


def time_stages(row: RowPrograms, repeats: int, trace_dir: Path | None = None) -> dict:
    """Median seconds of each prepared stage, and of a round in the device loop.

    round: (t(LOOP_ROUNDS rounds in one call) - t(1 round in one call)) / (LOOP_ROUNDS - 1), the time a
    round adds inside `engine.decode_loop`, as `generate` runs it (the call's dispatch cancelled out);
    round_call: one round per call, dispatch included (what a caller pays who steps one round at a time).
    Stages are single calls of programs compiled alone, so each includes its own dispatch.
    `trace_dir`: also record a profiler trace (with a Perfetto JSON) of one call of LOOP_ROUNDS rounds there.
    """
    import jax
    import jax.numpy as jnp

    loop_c, weights = row.programs["round"]

    def rounds_per_call(n: int):
        steps = jnp.int32(n)

        def call():
            row.state = loop_c(*weights, row.state, steps)
            return row.state.step
        return call

    out = {"round_call": _median_seconds(rounds_per_call(1), repeats)}
    many = _median_seconds(rounds_per_call(LOOP_ROUNDS), repeats)
    out["round"] = max(many - out["round_call"], 0.0) / (LOOP_ROUNDS - 1)
    if trace_dir is not None:
        try:
            with jax.profiler.trace(str(trace_dir), create_perfetto_trace=True):
                jax.block_until_ready(rounds_per_call(LOOP_ROUNDS)())
        except Exception as e:  # noqa: BLE001 - a profiler that cannot start costs the trace, not the row
            print(f"warning: no trace in {trace_dir}: {str(e).splitlines()[0][:200]}", file=sys.stderr)
    for name, (compiled, args) in row.programs.items():
        if name != "round":
            out[name] = _median_seconds(lambda: compiled(*args), repeats)
    if len(row.programs) == 1:  # AR: the round is its verify
        out["verify"] = out["round"]
    return out


def _is_hybrid_config(config) -> bool:
    return getattr(config, "model_type", "qwen3") == "qwen3_5"


def recurrent_node_bytes(config, nodes: int, dtype_bytes: int = 2) -> int:
    """Bytes of what a hybrid target keeps per node while it verifies `nodes` tokens as a tree (DDTree: B + 1
    nodes; DFlash: its chain of block-size nodes; AR keeps none, its one token updates the state in place),
    for the commit to form the accepted node's state. For every Gated DeltaNet layer and node
    (`cache.NodeStates`): the float32 key, written value and log decay, Hv x (Dk + Dv + 1) x 4, and the
    node's conv input, C x dtype_bytes (a node's conv window is its ancestors' inputs). 0 for an
    attention-only target. Qwen3.6-27B: 48 layers x (48 x 257 x 4 + 10240 x 2) = 3.2 MiB per node (a full
    Hv x Dk x Dv state per node, as verification kept until 2026-12-01, would be 144.9 MiB)."""
    if not _is_hybrid_config(config):
        return 0
    vectors = config.linear_num_value_heads * (config.linear_key_head_dim + config.linear_value_head_dim + 1) * 4
    return nodes * len(config.linear_layers) * (vectors + config.linear_conv_dim * dtype_bytes)


def committed_recurrent_bytes(config, dtype_bytes: int = 2) -> int:
    """Bytes of a hybrid target's committed recurrent state per sequence: every Gated DeltaNet layer's float32
    state and its conv window (C x (K - 1) in the weights' dtype). 0 for an attention-only target."""
    if not _is_hybrid_config(config):
        return 0
    state = config.linear_num_value_heads * config.linear_key_head_dim * config.linear_value_head_dim * 4
    window = config.linear_conv_dim * (config.linear_conv_kernel - 1) * dtype_bytes
    return len(config.linear_layers) * (state + window)


def _param_count(params) -> int:
    return sum(a.size for a in params.flat().values())


def floor_terms(target, drafter, mode: str, tokens: int, context: int, block_size: int = 16) -> dict:
    """Bytes that one round moves and FLOPs that it does, at least (batch 1, bf16 weights and caches).

    Bytes: every weight read once (the target's actual parameters, plus the drafter's in the speculative
    modes), the K/V of `context` tokens in each of the target's attention layers (all layers of a Qwen3; the
    full-attention layers of a hybrid), and on a hybrid the recurrent states: the committed state read and
    written back, plus, when the verify walks a tree (DFlash/DDTree), every node's kept vectors written and
    read back once (`recurrent_node_bytes`).
    FLOPs: 2 x (target parameters, less an untied input embedding) per verified token, attention over the
    cache, on a hybrid the delta-rule update of every Gated DeltaNet layer per token, and 2 x the drafter's
    parameters per block slot.
    """
    cfg = target.config
    hybrid = _is_hybrid_config(cfg)
    attn_layers = len(cfg.attention_layers) if hybrid else cfg.num_layers
    speculative = mode != "ar"
    weight_bytes = _param_bytes(target) + (_param_bytes(drafter) if speculative else 0)
    kv_bytes = 2 * attn_layers * context * cfg.num_kv_heads * cfg.head_dim * 2
    recurrent_bytes = 2 * committed_recurrent_bytes(cfg)
    if speculative:
        recurrent_bytes += 2 * recurrent_node_bytes(cfg, tokens)
    embed = cfg.vocab_size * cfg.hidden_size * (0 if cfg.tie_word_embeddings else 1)
    flops = 2 * (_param_count(target) - embed) * tokens
    flops += 4 * attn_layers * cfg.num_heads * cfg.head_dim * context * tokens  # attention over the cache
    if hybrid:  # decay, read, update and output of a Hv x Dk x Dv state per token and layer
        flops += 7 * len(cfg.linear_layers) * cfg.linear_num_value_heads * cfg.linear_key_head_dim \
            * cfg.linear_value_head_dim * tokens
    if speculative:
        flops += 2 * _param_count(drafter) * block_size  # the drafter's block
    return {"weight_bytes": weight_bytes, "kv_bytes": kv_bytes, "recurrent_bytes": recurrent_bytes,
            "bytes": weight_bytes + kv_bytes + recurrent_bytes, "flops": flops}


def floor_seconds(target, drafter, mode: str, tokens: int, context: int, ceilings: dict,
                  block_size: int = 16) -> float:
    """max(bytes / bandwidth, FLOPs / matmul rate) for one round (`floor_terms`)."""
    terms = floor_terms(target, drafter, mode, tokens, context, block_size)
    return max(terms["bytes"] / ceilings["bandwidth_bytes_per_s"], terms["flops"] / ceilings["bf16_flops_per_s"])


def _out_of_memory(e: Exception) -> bool:
    return "RESOURCE_EXHAUSTED" in str(e) or "out of memory" in str(e).lower()


def run_shape(args, parallel) -> dict:
    import jax
    from tqdm import tqdm

    from ddtree_jax.engine import DecodeOptions, Mode

    small = args.shape in SMALL_SHAPES
    start = time.perf_counter()
    ceilings = measure_ceilings(args.repeats, small)
    print(f"ceilings {ceilings}", flush=True)
    target, drafter = _random_pair(args.shape, parallel)
    jax.block_until_ready(target.flat())
    print(f"random weights ready after {time.perf_counter() - start:.0f} s", flush=True)
    rows = []
    modes = [("ar", None)] * ("ar" in args.modes) + [("dflash", None)] * ("dflash" in args.modes) + \
        [("ddtree", b) for b in args.budgets if "ddtree" in args.modes]
    # Each mode with every attention/acceptance implementation in turn, so a cut-short run still compares.
    plan = [(mode, budget, k) for mode, budget in modes for k in args.kernels]
    taus = dict(DEFAULT_TAU)
    taus.update(args.tau or {})
    skipped = []
    plan_options = [DecodeOptions(mode=Mode(mode), max_new_tokens=4096, block_size=16, budget=budget or 64,
                                  parallel=parallel, kernels=kernels) for mode, budget, kernels in plan]

    def prepare(options):
        try:
            return prepare_stages(target, drafter, options, args.context, args.repeats, parallel)
        except Exception as e:  # noqa: BLE001 - only running out of device memory is survivable
            if not _out_of_memory(e):
                raise
            return e

    # A hybrid's rows hold large verify outputs (per-node vectors of every GDN layer, 54 GB of weights beside
    # them at 27B): prepare those one at a time, just before they are timed. Otherwise compile every row
    # first, in parallel threads, then time them one by one (no two programs on the device at once while
    # timing).
    workers = 1 if _is_hybrid_config(target.config) else max(1, args.compile_workers)
    if workers > 1:
        with concurrent.futures.ThreadPoolExecutor(workers) as pool:
            futures = [pool.submit(prepare, o) for o in plan_options]
            for _ in tqdm(concurrent.futures.as_completed(futures), total=len(futures), desc="compile",
                          disable=None):
                pass
            prepared = [f.result() for f in futures]
        print(f"{len(plan)} rows compiled after {time.perf_counter() - start:.0f} s ({workers} threads)", flush=True)
    for i in tqdm(range(len(plan)), desc="bench", disable=None):
        (mode, budget, kernels), options = plan[i], plan_options[i]
        row = prepared[i] if workers > 1 else prepare(options)
        if workers > 1:
            prepared[i] = None  # each row's caches and stage outputs go once it is timed
        tokens = options.verify_width
        # Per-node recurrent states kept by the verify (hybrid targets; AR updates its state in place).
        node_bytes = recurrent_node_bytes(target.config, tokens) if mode != "ar" else 0
        trace = args.trace / f"{mode}{budget or ''}-{kernels}" if args.trace else None
        try:
            if isinstance(row, Exception):
                raise row
            stages = time_stages(row, args.repeats, trace)
        except Exception as e:  # noqa: BLE001 - only running out of device memory is survivable
            if not _out_of_memory(e):
                raise
            # e.g. a large budget on a hybrid: what T nodes keep of every GDN layer did not fit. Keep going.
            skipped.append({"mode": mode, "budget": budget, "kernels": kernels, "verify_tokens": tokens,
                            "recurrent_state_bytes": node_bytes, "error": str(e).splitlines()[0][:300]})
            print(json.dumps(skipped[-1]), flush=True)
            continue
        finally:
            del row
        terms = floor_terms(target, drafter, mode, tokens, args.context, options.block_size)
        floor = floor_seconds(target, drafter, mode, tokens, args.context, ceilings, options.block_size)
        tau = _projected_tau(taus, mode, budget)
        rows.append({"mode": mode, "budget": budget, "kernels": kernels, "verify_tokens": tokens, **{f"{k}_s": v for k, v in stages.items()},
                     "floor_s": floor, "ratio_to_floor": stages["round"] / floor, "tau_projected": tau,
                     "tokens_per_s_projected": tau / stages["round"],
                     "recurrent_state_bytes": node_bytes, "recurrent_state_mib": node_bytes / 2**20,
                     "floor_bytes": terms["bytes"], "floor_recurrent_bytes": terms["recurrent_bytes"],
                     "floor_flops": terms["flops"]})
        # Progress that survives a cut-short run: one line and a partial JSON per row.
        print(json.dumps({k: v for k, v in rows[-1].items()}), flush=True)
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "bench.partial.json").write_text(json.dumps({"ceilings": ceilings, "rows": rows,
                                                                "skipped": skipped}, indent=1))
    for r in rows:
        ar = next((a for a in rows if a["mode"] == "ar" and a["kernels"] == r["kernels"]), None)
        r["round_over_ar_step"] = r["round_s"] / ar["round_s"] if ar else None
    return {"kind": "shape", "shape": args.shape, "context": args.context, "device": str(jax.devices()[0].device_kind),
            "devices": parallel.size, "parallel": parallel.mode, "jax": jax.__version__, "ceilings": ceilings,
            "target_bytes": _param_bytes(target), "drafter_bytes": _param_bytes(drafter),
            "target_config": shape_configs(args.shape)[0], "hybrid": _is_hybrid_config(target.config),
            "recurrent_committed_bytes": committed_recurrent_bytes(target.config),
            "recurrent_bytes_per_node": recurrent_node_bytes(target.config, 1), "rows": rows, "skipped": skipped}


def _read_prompts(path: Path, tokenizer) -> list[list[int]]:
    prompts = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError:
            raise ValueError(f"{path}:{n}: not JSON") from None
        if "prompt_ids" in item:
            prompts.append([int(i) for i in item["prompt_ids"]])
        elif "prompt" in item and tokenizer is not None:
            prompts.append(tokenizer(item["prompt"], add_special_tokens=False)["input_ids"])
        else:
            raise ValueError(f"{path}:{n}: expected 'prompt_ids', or 'prompt' with a tokenizer in the target folder")
    if not prompts:
        raise ValueError(f"{path}: no prompts")
    return prompts


def run_checkpoints(args, parallel) -> dict:
    import jax
    import jax.numpy as jnp
    from tqdm import tqdm

    from ddtree_jax.checkpoint import load_drafter, load_target
    from ddtree_jax.engine import DecodeOptions, Mode, generate
    from ddtree_jax.generate import _load_tokenizer

    dtype = {"bfloat16": jnp.bfloat16, "float32": jnp.float32}[args.dtype]
    target = load_target(args.target, dtype, parallel=parallel)
    drafter = load_drafter(args.drafter, target.config, dtype, parallel=parallel)
    prompts = _read_prompts(args.prompts, _load_tokenizer(args.target))[:args.num_prompts]
    plan = [("ar", None)] + [("dflash", None)] * ("dflash" in args.modes) + \
        [("ddtree", b) for b in args.budgets if "ddtree" in args.modes]
    rows, reference = [], None
    for mode, budget in tqdm(plan, desc="bench", disable=None):
        options = DecodeOptions(mode=Mode(mode), max_new_tokens=args.max_new_tokens, budget=budget or 64,
                                parallel=parallel)
        generate(target, prompts[:1], options, drafter=drafter)  # warm-up (compilation)
        results = [generate(target, [p], options, drafter=drafter) for p in prompts]
        outputs = [r.output_ids[0] for r in results]
        decode_s = sum(r.decode_seconds for r in results)
        tokens = sum(len(o) for o in outputs)
        rounds = [n for r in results for n in r.acceptance_lengths[0]]
        divergence = None
        if reference is None:
            reference = outputs
        else:
            for i, (a, b) in enumerate(zip(reference, outputs)):
                if a != b:
                    at = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
                    divergence = {"prompt": i, "token": at}
                    break
        rows.append({"mode": mode, "budget": budget, "tau": float(np.mean(rounds)), "tokens": tokens,
                     "decode_s": decode_s, "tokens_per_s": tokens / decode_s, "first_divergence": divergence})
    for r in rows:
        r["speedup_over_ar"] = r["tokens_per_s"] / rows[0]["tokens_per_s"]
    return {"kind": "checkpoints", "target": str(args.target), "drafter": str(args.drafter),
            "prompts": len(prompts), "device": str(jax.devices()[0].device_kind), "devices": parallel.size,
            "parallel": parallel.mode, "jax": jax.__version__, "rows": rows}


def ceilings_text(c: dict) -> str:
    """One sentence with the measured ceilings (`measure_ceilings`)."""
    tb = lambda k: f"{c[k] / 1e12:.2f}" if k in c else "-"  # noqa: E731
    return (f"Measured ceilings: bandwidth {tb('bandwidth_bytes_per_s')} TB/s (the highest of copy "
            f"{tb('copy_bytes_per_s')}, read {tb('read_bytes_per_s')}, gemv {tb('gemv_bytes_per_s')}, torch copy "
            f"{tb('torch_copy_bytes_per_s')}), bf16 matmul {c['bf16_flops_per_s'] / 1e12:.0f} TFLOP/s.")


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f}" if n >= 2**20 else f"{n / 2**20:.3f}"


def markdown(report: dict) -> str:
    if report["kind"] == "shape":
        head = ("| mode | B | kernels | verify tokens | draft ms | tree ms | verify ms | accept ms | commit ms | round ms | "
                "floor ms | x floor | x AR step | 1 round per call ms | projected tok/s (tau) | recurrent state MiB |\n|"
                + "---|" * 16 + "\n")
        ms = lambda r, k: f"{r[k] * 1e3:.2f}" if k in r else "-"  # noqa: E731
        hybrid = report.get("hybrid", False)
        mib = lambda r: _mib(r.get("recurrent_state_bytes", 0)) if hybrid else "-"  # noqa: E731
        lines = [f"| {r['mode']} | {r['budget'] or '-'} | {r.get('kernels', 'jax')} | {r['verify_tokens']} | {ms(r, 'draft_s')} | "
                 f"{ms(r, 'tree_s')} | {ms(r, 'verify_s')} | {ms(r, 'accept_s')} | {ms(r, 'commit_s')} | "
                 f"{ms(r, 'round_s')} | {ms(r, 'floor_s')} | {r['ratio_to_floor']:.2f} | "
                 f"{r['round_over_ar_step'] or float('nan'):.2f} | {ms(r, 'round_call_s')} | "
                 f"{r['tokens_per_s_projected']:.0f} ({r['tau_projected']:.2f}) | "
                 f"{mib(r)} |"
                 for r in report["rows"]]
        c = report["ceilings"]
        notes = ""
        if hybrid:
            notes += (f" Recurrent state MiB: what the verify keeps per node for the commit (every Gated DeltaNet "
                      f"layer's key, written value and log decay in float32, and the conv input), "
                      f"{_mib(report['recurrent_bytes_per_node'])} MiB per node (AR: none, it updates the committed "
                      f"{_mib(report['recurrent_committed_bytes'])} MiB in place); the floor counts them written "
                      f"and read back once.")
        for r in report.get("skipped", []):
            notes += (f"\n\nNot measured: {r['mode']} B={r['budget'] or '-'} ({r.get('kernels', 'jax')}), "
                      f"{r['verify_tokens']} verify tokens, {_mib(r['recurrent_state_bytes'])} MiB of node "
                      f"states: {r['error']}")
        return (head + "\n".join(lines) + f"\n\n{ceilings_text(c)} Round: the time a round adds inside the device loop ({LOOP_ROUNDS} rounds per "
                f"call against 1); stages: each compiled and called alone (dispatch included). Projected tokens/s "
                f"= tau / round time."
                + notes + "\n")
    head = "| mode | B | tau | tokens/s | speedup over AR | first divergence from AR |\n|---|---|---|---|---|---|\n"
    return head + "\n".join(f"| {r['mode']} | {r['budget'] or '-'} | {r['tau']:.2f} | {r['tokens_per_s']:.1f} | "
                            f"{r['speedup_over_ar']:.2f} | {r['first_divergence'] or 'none'} |"
                            for r in report["rows"]) + "\n"


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    if report["kind"] == "shape":
        kernels = list(dict.fromkeys(r.get("kernels", "jax") for r in report["rows"]))
        for i, k in enumerate(kernels):
            rows = [r for r in report["rows"] if r.get("kernels", "jax") == k]
            tree = [r for r in rows if r["mode"] == "ddtree"]
            if tree:
                ax.plot([r["budget"] for r in tree], [r["round_s"] * 1e3 for r in tree], "o-", color=f"C{3 * i}",
                        label=f"DDTree round ({k})")
                if i == 0:
                    ax.plot([r["budget"] for r in tree], [r["floor_s"] * 1e3 for r in tree], "k--", label="floor")
                ax.set_xscale("log", base=2)
            for r in rows:
                if r["mode"] != "ddtree":
                    ax.axhline(r["round_s"] * 1e3, ls=":" if i == 0 else "-.",
                               color=f"C{3 * i + (1 if r['mode'] == 'ar' else 2)}",
                               label=f"{r['mode']} {'step' if r['mode'] == 'ar' else 'round'} ({k})")
        ax.set_xlabel("tree budget B (nodes verified = B + 1)")
        ax.set_ylabel("ms per round")
        ax.set_title(f"{report['shape']}, context {report['context']}, {report['device']}")
        ax.legend()
    else:
        ax.bar([f"{r['mode']}{'' if r['budget'] is None else ' ' + str(r['budget'])}" for r in report["rows"]],
               [r["tokens_per_s"] for r in report["rows"]])
        ax.set_ylabel("tokens/s")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    from ddtree_jax.generate import BadInput, add_parallel_args, parallel_from_args

    p = argparse.ArgumentParser(prog="python -m ddtree_jax.bench", description=__doc__.split("\n")[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default=None)
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--budgets", default="16,64,256,512")
    p.add_argument("--modes", default="ar,dflash,ddtree")
    p.add_argument("--kernels", default="jax",
                   help="comma list of jax,pallas: attention/acceptance implementations timed (--shape only)")
    p.add_argument("--tau", default=None, help="projected tau, e.g. 'dflash=7.8,64=10.7,256=10.7'")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--compile-workers", type=int, default=min(8, os.cpu_count() or 1),
                   help="--shape: threads compiling the rows before any is timed (hybrid shapes: 1)")
    p.add_argument("--trace", type=Path, default=None,
                   help="--shape: a profiler trace (TensorBoard + Perfetto JSON) of 3 rounds per row, under DIR/ROW")
    p.add_argument("--target", type=Path, default=None)
    p.add_argument("--drafter", type=Path, default=None)
    p.add_argument("--prompts", type=Path, default=None)
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    p.add_argument("--out", type=Path, default=Path("bench_out"), help="folder for JSON, markdown and plot")
    add_parallel_args(p)
    args = p.parse_args(argv)
    try:
        args.budgets = [int(b) for b in args.budgets.split(",") if b]
        args.modes = [m for m in args.modes.split(",") if m]
        args.kernels = [k for k in args.kernels.split(",") if k]
        if not args.kernels or any(k not in ("jax", "pallas") for k in args.kernels):
            raise ValueError("kernels")
        if args.tau:
            args.tau = {(k if k in ("ar", "dflash") else int(k)): float(v)
                        for k, v in (item.split("=") for item in args.tau.split(","))}
    except ValueError:
        print("error: --budgets takes integers, --kernels a comma list of jax,pallas, --tau KEY=VALUE pairs",
              file=sys.stderr)
        return 2
    if args.shape is not None and args.target is not None:
        print("error: give either --shape NAME or --target DIR --drafter DIR --prompts FILE", file=sys.stderr)
        return 2
    if args.shape is None and args.target is None:  # the shipped demo pair on its held-out prompts
        from ddtree_jax.demo_pair import DEMO_NOTE, demo_drafter, demo_prompts, demo_target

        args.target, args.drafter, args.prompts = demo_target(), demo_drafter(), demo_prompts()
        print(f"note: no --shape or --target given, so this runs the demo pair: {DEMO_NOTE}.", file=sys.stderr)
    from ddtree_jax.checkpoint import CheckpointError
    from ddtree_jax.config import ConfigError

    try:
        parallel = parallel_from_args(args)
        if args.shape is not None:
            report = run_shape(args, parallel)
        else:
            if args.drafter is None or args.prompts is None:
                raise BadInput("--target needs --drafter DIR and --prompts FILE.jsonl")
            report = run_checkpoints(args, parallel)
    except (BadInput, CheckpointError, ConfigError, ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    report["command"] = "python -m ddtree_jax.bench " + " ".join(sys.argv[1:] if argv is None else argv)
    report["date"] = time.strftime("%Y-%m-%d")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench.json").write_text(json.dumps(report, indent=2))
    table = markdown(report)
    (args.out / "bench.md").write_text(table)
    plot(report, args.out / "bench.png")
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
