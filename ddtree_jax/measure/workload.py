"""What the benchmark and the tools run: random weights of a named shape on the device, decode states whose
caches hold a given context, and the round's own stage functions (`round.STAGES`) compiled one by one.

Nothing here re-implements a round: `stage_programs` lays out `round.STAGES` in round order with the
arguments each needs (the outputs of the stages before it), and `prepare_row` compiles them beside the
device loop that `generate` runs (`round.decode_loop`).
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path
from typing import Callable

import jax
import jax.numpy as jnp

from ddtree_jax import round as rnd
from ddtree_jax.cache import HybridCache, MTPCache, RecurrentState
from ddtree_jax.engine import compile_program, decode_loop_on_leaves, models_as_leaves
from ddtree_jax.measure.timing import LOOP_ROUNDS, in_loop_seconds, median_seconds, record_trace
from ddtree_jax.models import dflash, mtp, target_family
from ddtree_jax.shapes import shape_configs

BUCKET = 128  # cache capacity rounding, as the engine's


def random_pair(shape: str, parallel, dtype=jnp.bfloat16, fp8: bool = False):
    """Random target (Qwen3, or a Qwen3.5/3.6 hybrid) and drafter of a named shape (`shapes.SHAPES`),
    initialised on the device in `dtype`, laid out by `parallel`. `fp8`: the target's projections are
    block-scaled FP8 as `quantize-fp8` writes them (random FP8 values, scales 1)."""
    from ddtree_jax.config import TARGET_PARSERS, check_pair, fp8_quantization_config, parse_dflash

    target_raw, drafter_raw = shape_configs(shape)
    if fp8:
        target_raw = {**target_raw, "quantization_config": fp8_quantization_config(target_raw)}
    t_cfg, d_cfg = TARGET_PARSERS[target_raw["model_type"]](target_raw), parse_dflash(drafter_raw)
    check_pair(t_cfg, d_cfg, where=f"{shape} drafter")

    target = random_params(target_family(t_cfg).abstract(t_cfg, dtype), parallel, 0)
    drafter = random_params(dflash.abstract(d_cfg, t_cfg.hidden_size, dtype), parallel, 1)
    return target, drafter


def random_mtp_head(target, parallel, dtype=jnp.bfloat16):
    """A random MTP head for a random Qwen3.5/3.6 target (`random_pair`): the target config's
    `mtp_num_hidden_layers` layers, or one (the published checkpoints' head) where the shape leaves it out."""
    from ddtree_jax.config import mtp_config

    config = target.config
    if getattr(config, "mtp_num_hidden_layers", None) == 0:
        config = dataclasses.replace(config, mtp_num_hidden_layers=1)
    return random_params(mtp.abstract(mtp_config(config), dtype), parallel, 2)


def random_params(abstract, parallel, seed: int):
    """Random parameters of `abstract`'s shapes laid out by `parallel`: normal * 0.02, ones for norms and FP8
    scales. One small jitted initialiser per (shape, sharding), not one program for the whole model: XLA
    takes many minutes to compile a single random-init program of an 8B model."""
    from ddtree_jax.parallel import param_shardings

    shardings = param_shardings(abstract, parallel)
    arrays = {}
    for i, (name, leaf) in enumerate(abstract.state_flat().items()):
        ones = "norm" in name or name.endswith("_scale_inv")
        arrays[name] = random_array(leaf.shape, jnp.dtype(leaf.dtype).name, ones, shardings[name])(
            jax.random.fold_in(jax.random.key(seed), i))
    return abstract.replace_state_flat(arrays)


@functools.lru_cache(maxsize=None)
def random_array(shape, dtype: str, ones: bool, sharding) -> Callable:
    """A jitted initialiser (key -> array): ones, or normal * 0.02, of this shape, dtype and sharding."""
    def make(key):
        if ones:
            return jnp.ones(shape, dtype)
        return (jax.random.normal(key, shape, jnp.float32) * 0.02).astype(dtype)

    return jax.jit(make, out_shardings=sharding)


def empty_state(target_config, drafter_config, context: int, options, room_rounds: int,
                tokens_per_round: int | None = None, dtype=jnp.bfloat16, batch: int = 1) -> rnd.DecodeState:
    """A decode state of `batch` rows mid-generation (last token 1, nothing done) with empty caches sized for
    `context` committed tokens plus `room_rounds` rounds of `tokens_per_round` (default: full acceptance)
    and the widest verify: a tight capacity, since the pure-JAX attention reads every slot (masked) and
    spare room would be timed too. Call under `jax.eval_shape` for shapes only."""
    b = batch
    per_round = tokens_per_round or (options.block_size + 1 if options.mode.needs_drafter else 1)
    capacity = -(-(context + room_rounds * per_round + options.verify_width) // BUCKET) * BUCKET
    cache = target_family(target_config).create_cache(target_config, b, capacity, dtype)
    draft_cache = None
    if options.mode.needs_drafter:
        drafter_family = mtp if options.mode is rnd.Mode.MTP else dflash
        draft_cache = drafter_family.create_cache(drafter_config, b, capacity, dtype)
    return rnd.DecodeState.start(cache, draft_cache, jnp.ones((b,), jnp.int32), jax.random.key(0), options,
                                 num_generated=jnp.ones((b,), jnp.int32))


def filled_state(target, drafter, context: int, options, parallel, room_rounds: int,
                 tokens_per_round: int | None = None, batch: int = 1) -> rnd.DecodeState:
    """`empty_state` whose caches hold `context` committed tokens of random K/V (and, for a hybrid target,
    random recurrent states and conv windows), laid out as the engine lays them out."""
    dtype = target.array("model.embed_tokens.weight").dtype  # caches in the weights' dtype, as the engine's
    abstract = jax.eval_shape(lambda: empty_state(target.config, drafter.config, context, options, room_rounds,
                                                  tokens_per_round, dtype=dtype, batch=batch))

    def random_like(shape_dtype, sharding, seed: int):
        # One small cached initialiser per shape (a single program that draws every layer's K/V compiled
        # for minutes on the H200).
        return random_array(shape_dtype.shape, str(shape_dtype.dtype), False, sharding)(jax.random.key(seed))

    def filled(cache, seed: int):
        sharding = parallel.sharding(parallel.kv_spec(cache.k[0].shape[2]))
        ks = tuple(random_like(k, sharding, seed * 1000 + i) for i, k in enumerate(cache.k))
        vs = tuple(random_like(v, sharding, seed * 1000 + 500 + i) for i, v in enumerate(cache.v))
        return dataclasses.replace(cache, k=ks, v=vs, lengths=jnp.full(cache.lengths.shape, context, jnp.int32))

    def filled_target(cache, seed: int):
        if not isinstance(cache, HybridCache):
            return filled(cache, seed)
        # Recurrent states as the engine lays them out: rows over dp, heads over tp.
        specs = [parallel.recurrent_specs(r.key_heads) for r in cache.recurrent]
        recurrent = tuple(RecurrentState(state=random_like(r.state, parallel.sharding(state), seed * 1000 + 700 + i),
                                         conv=random_like(r.conv, parallel.sharding(conv), seed * 1000 + 900 + i))
                          for i, (r, (state, conv)) in enumerate(zip(cache.recurrent, specs)))
        return HybridCache(kv=filled(cache.kv, seed), recurrent=recurrent)

    def filled_draft(cache):
        if isinstance(cache, MTPCache):  # the head's K/V and its last output (rows over dp)
            hidden = random_like(cache.hidden, parallel.sharding(parallel.batch_spec(2)), 2 * 1000 + 800)
            return MTPCache(kv=filled(cache.kv, 2), hidden=hidden)
        return filled(cache, 2)

    draft_cache = filled_draft(abstract.draft_cache) if abstract.draft_cache is not None else None
    def ones():  # a fresh buffer each (the loop donates its state: no buffer may appear twice)
        return jax.device_put(jnp.ones((batch,), jnp.int32), parallel.sharding(parallel.batch_spec(1)))

    return rnd.DecodeState.start(filled_target(abstract.cache, 1), draft_cache, ones(), jax.random.key(0), options,
                                 num_generated=ones())


def stage_programs(target, drafter, state: rnd.DecodeState, options, evaluate: Callable) -> dict:
    """The stages of a speculative round as {name: (stage function, arguments, static keyword arguments)},
    in round order; each stage function IS `round.STAGES[name]`. The arguments of a stage are the outputs
    of the stages before it, made by `evaluate(name, fn, args, static)` (`jax.eval_shape` for shapes only,
    or compile-and-run for real arrays); they are as the round passes them."""
    programs = {}

    def add(name, args, **static):
        fn = rnd.STAGES[name]
        programs[name] = (fn, args, static)
        return evaluate(name, fn, args, static)

    logits = add("draft", (drafter, target, state.last_token, state.draft_cache), options=options)
    tree = add("tree", (logits, state.last_token), options=options)
    out, node_logits = add("verify", (target, tree, state.cache), tap_layers=drafter.config.target_layer_ids,
                           options=options)
    acc = add("accept", (tree, node_logits, state.rng), options=options)
    add("commit", (drafter, target, out, acc, acc.count, state.draft_cache), options=options)
    return programs


@dataclasses.dataclass
class RowPrograms:
    """One bench row, compiled: `programs` maps "round" (the device loop) and the stages ("draft", "tree",
    "verify", "accept", "commit") to (compiled function, its arguments). The loop's entry holds the weights;
    its decode state, which every call donates, is `state` (the newest). The stages' arguments are a second
    filled state and the outputs of the stages before them, computed once while compiling."""

    programs: dict
    state: object = None


def prepare_row(target, drafter, options, context: int, repeats: int, parallel, batch: int = 1) -> RowPrograms:
    """Compile a row's device loop (`round.decode_loop`, as `generate` runs it, the number of rounds an
    argument) and, for DFlash and DDTree, each stage of a round (`stage_programs`), on filled caches. Runs
    each stage once (untimed) to get the next stage's inputs, so rows can be prepared in parallel threads
    (XLA compiles without the GIL) and timed one after another afterwards (`time_row`)."""
    rounds = repeats + 2  # median_seconds' warm-up included
    # Every array reaches a compiled program as an argument: one closed over becomes a constant of the
    # program (16 GB of them at 8B, which XLA then tries to constant-fold for minutes). Random weights commit
    # about one token per round (the drafts are rejected), so the loop's cache leaves room for two per round.
    state = filled_state(target, drafter, context, options, parallel, rounds * (LOOP_ROUNDS + 1) + LOOP_ROUNDS,
                         tokens_per_round=2 if options.mode.needs_drafter else 1, batch=batch)
    # The loop as `generate` compiles it: the models as leaves (`engine.decode_loop_on_leaves`).
    weights, treedefs = models_as_leaves(target, drafter)
    loop = compile_program(decode_loop_on_leaves, (*weights, state, jnp.int32(1)),
                           {"treedefs": treedefs, "options": options}, donate=(2,))
    row = RowPrograms(programs={"round": (loop, weights)}, state=state)
    if not options.mode.needs_drafter:
        return row
    stage_state = filled_state(target, drafter, context, options, parallel, rounds, batch=batch)

    def run(name, fn, args, static):
        compiled = compile_program(fn, args, static)
        row.programs[name] = (compiled, args)
        return compiled(*args)

    stage_programs(target, drafter, stage_state, options, run)
    return row


def time_row(row: RowPrograms, repeats: int, trace_dir: Path | None = None) -> dict:
    """Median seconds of each prepared stage, and of a round in the device loop.

    round: the time a round adds inside `round.decode_loop` (`timing.in_loop_seconds`: calls of
    LOOP_ROUNDS rounds against calls of 1, the dispatch cancelled out); round_call: one round per call,
    dispatch included (what a caller pays who steps one round at a time). Stages are single calls of
    programs compiled alone, so each includes its own dispatch. `trace_dir`: also record a profiler trace
    (with a Perfetto JSON) of one call of LOOP_ROUNDS rounds there.
    """
    loop, weights = row.programs["round"]

    def rounds_per_call(n: int):
        row.state = loop(*weights, row.state, jnp.int32(n))
        return row.state.step

    out = {}
    out["round"], out["round_call"] = in_loop_seconds(rounds_per_call, repeats)
    if trace_dir is not None:
        record_trace(trace_dir, lambda: rounds_per_call(LOOP_ROUNDS))
    for name, (compiled, args) in row.programs.items():
        if name != "round":
            out[name] = median_seconds(lambda: compiled(*args), repeats)
    if len(row.programs) == 1:  # AR: the round is its verify
        out["verify"] = out["round"]
    return out
