"""Generation from the host: `generate` pads the prompts, sizes the cache, compiles prefill and the decode
loop once per shape, runs them and times them, compilation excluded.

The device side (the decode state, the stages of a round, the rounds and the loop) is `ddtree_jax/round.py`;
its public names are re-exported here, since `engine` is the Python API: `generate`, `DecodeOptions`, `Mode`.
"""

from __future__ import annotations

import collections
import dataclasses
import statistics
import sys
import time
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ddtree_jax import budget as auto
from ddtree_jax.config import MTPConfig
from ddtree_jax.models.contract import resolve_fp8_matmul, resolve_kernels
from ddtree_jax.models.params import ModelParams
from ddtree_jax.parallel import put, to_host
from ddtree_jax.round import DecodeOptions, DecodeState, Mode, RoundTrace, decode_loop, prefill

# The Python API: generate and its types here; the device-side names re-exported from round.py.
__all__ = ["generate", "GenerationResult", "compile_generation", "GenerationPrograms", "resolve_options", "kept_record",
           "cache_shape", "calibrate", "compile_program", "models_as_leaves", "prefill_on_leaves",
           "decode_loop_on_leaves", "DecodeOptions", "DecodeState", "Mode", "RoundTrace", "decode_loop", "prefill"]

CAPACITY_BUCKET = 128
PROMPT_BUCKET = 32


@dataclasses.dataclass
class GenerationResult:
    """Per row: output_ids (prompt excluded, EOS kept), acceptance_lengths (tokens per round). Seconds are
    device-synchronised wall time; compilation is excluded from prefill and decode."""

    output_ids: list[list[int]]
    acceptance_lengths: list[list[int]]
    prefill_seconds: float
    decode_seconds: float
    compile_seconds: float
    trees: list[dict] | None = None  # with options.record_trees: one dict per row per round
    # --budget auto: per row, the budget each round verified (0: the chain), as acceptance_lengths; the seconds
    # per round of each candidate that the choice used (options.budgets order), the seconds it charged a change
    # of candidate, and the seconds spent measuring them (0 when they came from the cost cache or the caller)
    budgets_chosen: list[list[int]] | None = None
    round_costs: list[float] | None = None
    change_cost: float | None = None
    calibration_seconds: float = 0.0
    # --budget auto: what the call learned, for the next call's `generate(auto_learned=...)`: per round, each
    # candidate's committed tokens (`budget.BudgetState.learned`); per call, each candidate's calls, tokens and
    # seconds (`budget.CallRecord.learned`)
    auto_learned: dict | None = None

    def acceptance_histogram(self, block_size: int) -> list[int]:
        """Rounds by committed length: entry k counts rounds that committed k + 1 tokens (k + 1 = depth
        of the deepest accepted node + 1)."""
        counts = [0] * block_size
        for row in self.acceptance_lengths:
            for n in row:
                counts[n - 1] += 1
        return counts

    @property
    def new_tokens(self) -> int:
        return sum(len(o) for o in self.output_ids)

    @property
    def tau(self) -> float:
        rounds = [n for row in self.acceptance_lengths for n in row]
        return float(np.mean(rounds)) if rounds else 0.0


def _round_up(n: int, bucket: int) -> int:
    return -(-n // bucket) * bucket


def cache_shape(max_prompt_len: int, options: DecodeOptions) -> tuple[int, int]:
    """(prompt width, cache capacity) in tokens for prompts of up to `max_prompt_len` tokens: the prompt
    padded to a PROMPT_BUCKET multiple; the cache holds it, `max_new_tokens` and the widest verify call,
    rounded up to a CAPACITY_BUCKET multiple (so nearby requests share one compiled program). `options`
    must be resolved (`resolve_options`: block size known)."""
    width = _round_up(max_prompt_len, PROMPT_BUCKET)
    return width, _round_up(width + options.max_new_tokens + options.verify_width, CAPACITY_BUCKET)


COMPILED_KEPT = 64  # compiled programs kept per process (least recently used dropped first): the bench
# decodes every prompt with each of its rows in turn, two programs per row and prompt length bucket
_COMPILED: collections.OrderedDict = collections.OrderedDict()

# XLA's compiler option for DecodeOptions.split_k == "off": every GEMM with one split of K. An experimental
# option (jaxlib 0.10-0.11 have it); a jaxlib without it compiles as "xla", with one note.
SPLIT_K_OFF = {"xla_gpu_experimental_force_split_k": 1}
_NOTED: set[str] = set()


def compiler_options(options: DecodeOptions | None) -> dict:
    """XLA compiler options of a program compiled for these (resolved) decode options."""
    return dict(SPLIT_K_OFF) if options is not None and options.split_k == "off" else {}


def compile_program(fn: Callable, args: tuple, static: dict | None = None, donate: tuple[int, ...] = ()):
    """`fn` AOT-compiled for these arguments (static keyword arguments hashed into the program), with the
    compiler options its `options` (a static DecodeOptions, if any) ask for."""
    static = static or {}
    lowered = jax.jit(fn, static_argnames=tuple(static), donate_argnums=donate).lower(*args, **static)
    extra = compiler_options(static.get("options"))
    if extra:
        try:
            return lowered.compile(extra)
        except jax.errors.JaxRuntimeError as e:  # raised while parsing the options, before any compiling
            if "No such compile option" not in str(e):
                raise
            if str(extra) not in _NOTED:
                _NOTED.add(str(extra))
                print(f"note: this jaxlib ({jax.__version__}) has no XLA option {extra}; compiling without it",
                      file=sys.stderr)
    return lowered.compile()


def _compiled(name: str, fn: Callable, args: tuple, static: dict, donate: tuple[int, ...] = ()):
    """`compile_program`, keeping the last COMPILED_KEPT programs; returns (compiled, seconds spent
    compiling: 0 when it was kept)."""
    shapes = jax.tree.map(lambda a: (a.shape, a.dtype) if hasattr(a, "shape") else a, args)
    key = (name, jax.tree.structure(args), str(jax.tree.leaves(shapes)), tuple(sorted(static.items())))
    if key in _COMPILED:
        _COMPILED.move_to_end(key)
        return _COMPILED[key], 0.0
    start = time.perf_counter()
    compiled = compile_program(fn, args, static, donate)
    _COMPILED[key] = compiled
    while len(_COMPILED) > COMPILED_KEPT:
        _COMPILED.popitem(last=False)
    return compiled, time.perf_counter() - start


def resolve_options(options: DecodeOptions, drafter: ModelParams | None, dtype=None) -> DecodeOptions:
    """Fill in what the drafter decides (block size) and what "auto" kernels, matmul precision and split-K mean here,
    and check that the mode has what it needs. `dtype`: the target's compute dtype; "auto" kernels keep the
    pure-JAX path for float32, where the Pallas attention is many times slower than XLA's on the H200 (910
    vs 61 us per call at T = 16, docs/kernels.md); "auto" precision is "highest" for float32 (a GPU would
    otherwise round its matmul inputs to TF32) and "default" otherwise (16-bit runs as before); "auto" split-K
    is "off" for the speculative modes on a GPU and "xla" otherwise (`DecodeOptions.split_k`); "auto" FP8 matmul is
    what `models.contract.resolve_fp8_matmul` says."""
    if options.kernels == "auto":
        options = dataclasses.replace(options, kernels=resolve_kernels(options.kernels, dtype).value)
    if options.matmul_precision == "auto":
        float32 = dtype is not None and np.dtype(dtype) == np.float32
        options = dataclasses.replace(options, matmul_precision="highest" if float32 else "default")
    if options.split_k == "auto":
        several = options.mode.needs_drafter and jax.default_backend() == "gpu"
        options = dataclasses.replace(options, split_k="off" if several else "xla")
    if options.fp8_matmul == "auto":
        options = dataclasses.replace(options, fp8_matmul=resolve_fp8_matmul(options.fp8_matmul, options.kernels).value)
    if options.mode.needs_drafter:
        if drafter is None:
            raise ValueError(f"mode {options.mode.value} needs a drafter"
                             + (" (the target's MTP head: checkpoint.load_mtp)" if options.mode is Mode.MTP else ""))
        if (options.mode is Mode.MTP) != isinstance(drafter.config, MTPConfig):
            raise ValueError(f"mode {options.mode.value} needs " + ("the target's MTP head (checkpoint.load_mtp)"
                             if options.mode is Mode.MTP else "a DFlash drafter") + ", not this drafter")
        if options.mode is Mode.MTP:
            options = dataclasses.replace(options, block_size=options.mtp_steps + 1)
        elif options.block_size == 0:
            options = dataclasses.replace(options, block_size=drafter.config.block_size)
    return options


@dataclasses.dataclass
class GenerationPrograms:
    """A generation's compiled prefill and decode loop with their inputs (`compile_generation`): `prefill()` a
    fresh DecodeState, `loop(state, rounds)` up to `rounds` more rounds (default: `steps`) on it (donated).

    The programs take the models as their leaves (`models_as_leaves`) and the round counts as device scalars made
    once: flattening the models' NNX state and making the scalar in every call took a call of 0 rounds of the demo
    pair's loop from 0.16 to 0.44 ms on this project's CPU and cost ~0.7 ms a call on the H200 (2026-12-03), paid
    once per prompt in the bench and per batch in `generate --prompts`."""

    options: DecodeOptions  # resolved
    drafter: ModelParams | None
    weights: tuple[list, list]  # the target's and the drafter's leaves
    tokens: jax.Array  # [b, width] int32, the padded prompts (rows beyond the caller's: dp padding)
    lengths: jax.Array  # [b] int32
    rng: jax.Array
    capacity: int
    steps: int  # rounds per `loop` call by default
    prefill_fn: Callable
    loop_fn: Callable
    compile_seconds: float
    _rounds: dict = dataclasses.field(default_factory=dict, repr=False)  # rounds -> device int32 scalar

    @property
    def batch(self) -> int:
        return self.tokens.shape[0]

    def prefill(self) -> DecodeState:
        return self.prefill_fn(*self.weights, self.tokens, self.lengths, self.rng)

    def loop(self, state: DecodeState, rounds: int | None = None) -> DecodeState:
        n = self.steps if rounds is None else int(rounds)
        if n not in self._rounds:
            self._rounds[n] = jnp.asarray(n, jnp.int32)
        return self.loop_fn(*self.weights, state, self._rounds[n])


def models_as_leaves(target: ModelParams, drafter: ModelParams | None) -> tuple[tuple[list, list], tuple]:
    """((target leaves, drafter leaves), their treedefs): the arguments and the static `treedefs` of
    `prefill_on_leaves` and `decode_loop_on_leaves`."""
    (target_leaves, target_def), (drafter_leaves, drafter_def) = jax.tree.flatten(target), jax.tree.flatten(drafter)
    return (target_leaves, drafter_leaves), (target_def, drafter_def)


def prefill_on_leaves(target_leaves, drafter_leaves, tokens, lengths, rng, *, treedefs, capacity, options):
    """`round.prefill` with the models given as leaves (`treedefs`: the target's and the drafter's)."""
    target, drafter = (jax.tree.unflatten(d, leaves) for d, leaves in zip(treedefs, (target_leaves, drafter_leaves)))
    return prefill(target, drafter, tokens, lengths, rng, capacity=capacity, options=options)


def decode_loop_on_leaves(target_leaves, drafter_leaves, state, steps, *, treedefs, options):
    """`round.decode_loop` with the models given as leaves: the program `generate` runs (the bench's `--shape`
    rows compile it too)."""
    target, drafter = (jax.tree.unflatten(d, leaves) for d, leaves in zip(treedefs, (target_leaves, drafter_leaves)))
    return decode_loop(target, drafter, state, steps, options=options)


def compile_generation(target: ModelParams, prompts: Sequence[Sequence[int]], options: DecodeOptions, *,
                       drafter: ModelParams | None = None, seed: int = 0,
                       steps_per_call: int | None = None) -> GenerationPrograms:
    """Resolve the options, check and pad the prompts (dp: rows added to fill the devices), size the cache and
    compile (or take from the process's kept programs) prefill and the decode loop for them: what `generate`
    runs, for tools that time its calls (`tools/loop_cost.py`)."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    if options.auto_per_call:
        raise ValueError("--budget auto per call runs its candidates' fixed programs (`DecodeOptions.candidate`); "
                         "auto_scope='round' compiles the per-round program")
    options = resolve_options(options, drafter, target.array("model.embed_tokens.weight").dtype)
    if not options.mode.needs_drafter:
        drafter = None
    if options.record_trees and not options.mode.needs_drafter:
        raise ValueError("record_trees needs a speculative mode (dflash, ddtree or mtp)")
    vocab = target.config.vocab_size
    for r, prompt in enumerate(prompts):
        bad = [t for t in prompt if not 0 <= int(t) < vocab]
        if bad:
            raise ValueError(f"prompt {r}: token id {bad[0]} is outside the vocabulary (0..{vocab - 1})")
    parallel = options.parallel
    if parallel.mode == "dp" and len(prompts) % parallel.size:
        # dp splits rows evenly over devices: pad with copies of the first prompt, dropped at the end.
        prompts = list(prompts) + [prompts[0]] * (parallel.size - len(prompts) % parallel.size)
    lengths = np.array([len(p) for p in prompts], np.int32)
    width, capacity = cache_shape(int(lengths.max()), options)
    tokens = np.zeros((len(prompts), width), np.int32)
    for r, prompt in enumerate(prompts):
        tokens[r, :len(prompt)] = prompt
    rng = jax.random.key(seed)
    tokens = put(tokens, parallel.sharding(parallel.batch_spec(2)))
    lengths_dev = put(lengths, parallel.sharding(parallel.batch_spec(1)))
    weights, treedefs = models_as_leaves(target, drafter)
    prefill_fn, prefill_compile_s = _compiled("prefill", prefill_on_leaves, (*weights, tokens, lengths_dev, rng),
                                              dict(treedefs=treedefs, capacity=capacity, options=options))
    state = prefill_fn.out_info  # the decode state's shapes and shardings
    steps = steps_per_call or options.max_new_tokens  # a round emits >= 1 token
    loop_fn, loop_compile_s = _compiled("decode_loop", decode_loop_on_leaves, (*weights, state, jnp.int32(steps)),
                                        dict(treedefs=treedefs, options=options), donate=(2,))
    return GenerationPrograms(options=options, drafter=drafter, weights=weights, tokens=tokens, lengths=lengths_dev,
                              rng=rng, capacity=capacity, steps=steps, prefill_fn=prefill_fn, loop_fn=loop_fn,
                              compile_seconds=prefill_compile_s + loop_compile_s)


def generate(target: ModelParams, prompts: Sequence[Sequence[int]], options: DecodeOptions, *,
             drafter: ModelParams | None = None, seed: int = 0, steps_per_call: int | None = None,
             on_tokens: Callable[[list[list[int]]], None] | None = None,
             round_costs: Sequence[float] | None = None, change_cost: float = 0.0,
             recalibrate: bool = False, auto_learned: dict | None = None) -> GenerationResult:
    """Generate for a batch of token-id prompts (unequal lengths allowed).

    drafter: the DFlash drafter (dflash and ddtree modes), or the target's MTP head (mtp mode:
    `checkpoint.load_mtp`). steps_per_call: rounds per device call (None: the whole loop in one call);
    `on_tokens` receives every row's tokens so far after each call, for streaming.
    `--budget auto` (options.budgets): round_costs, seconds per round of each candidate, and change_cost, seconds
    a round costs on top when it verifies another candidate than the round before; round_costs None takes both
    from the cost cache, or measures them on these prompts first (`calibrate`) and caches them (`recalibrate`:
    measure even when cached); auto_learned, a previous call's `GenerationResult.auto_learned` (same candidates):
    the committed tokens per round it learned, to start from instead of nothing. Per call (`options.auto_scope`
    "call", the default) no costs: the candidate `budget.CallRecord.choose` picks from auto_learned, else from
    the record kept on disk for these models, device and batch (`recalibrate`: from nothing), which calibrates
    on the first calls' prompts (every candidate on the same prompts), runs as a fixed program
    (`_generate_per_call`).
    """
    if options.auto_per_call:
        if round_costs is not None:
            raise ValueError("round_costs: --budget auto per round only (auto_scope='round')")
        return _generate_per_call(target, prompts, options, drafter=drafter, seed=seed, steps_per_call=steps_per_call,
                                  on_tokens=on_tokens, recalibrate=recalibrate, auto_learned=auto_learned)
    if round_costs is not None and len(round_costs) != len(options.budgets):
        raise ValueError(f"round_costs: one per candidate budget {options.budgets}, got {len(round_costs)}")
    if change_cost < 0:
        raise ValueError(f"change_cost: seconds >= 0, got {change_cost}")
    if auto_learned is not None and (not options.auto_budget or auto_learned.get("scope") != "round" or len(
            auto_learned.get("tokens", ())) != len(options.budgets)):
        raise ValueError(f"auto_learned: a previous --budget auto call's (per round), over the candidates "
                         f"{options.budgets}")
    n_prompts = len(prompts)
    programs = compile_generation(target, prompts, options, drafter=drafter, seed=seed,
                                  steps_per_call=1 if options.record_trees else steps_per_call)
    options, drafter, b = programs.options, programs.drafter, programs.batch
    start = time.perf_counter()
    state = jax.block_until_ready(programs.prefill())
    prefill_s = time.perf_counter() - start
    calibration_s = 0.0
    if options.auto_budget and round_costs is None:
        key = auto.cost_key(target.config, drafter.config, options, b, programs.capacity,
                            target.array("model.embed_tokens.weight").dtype)
        cached = None if recalibrate else auto.load_costs(key)
        if cached is not None:
            round_costs, change_cost = cached
        else:
            start = time.perf_counter()
            round_costs, change_cost, complete = calibrate(programs.prefill, programs.loop, options)
            calibration_s = time.perf_counter() - start
            if complete and auto.save_costs(key, round_costs, change_cost) is None:
                print(f"warning: cannot write the round-cost cache in {auto.cost_cache_dir()}; the costs hold "
                      "for this run only", file=sys.stderr)
    if options.auto_budget:
        state = with_round_costs(state, round_costs, change_cost)
        if auto_learned is not None:
            state = dataclasses.replace(state, budget=state.budget.with_learned(auto_learned))

    trees: list[dict] | None = [] if options.record_trees else None
    decode_s = 0.0
    while True:
        if on_tokens is not None:
            on_tokens(_rows(state))
        done = to_host(state.done)
        if done.all():
            break
        running = ~done
        start = time.perf_counter()
        state = jax.block_until_ready(programs.loop(state))
        decode_s += time.perf_counter() - start
        if trees is not None:
            trees.extend(_trace_rows(state, running))
    round_lengths, num_rounds = to_host(state.round_lengths), to_host(state.num_rounds)
    chosen = to_host(state.budget.chosen) if options.auto_budget else None
    return GenerationResult(
        output_ids=_rows(state)[:n_prompts],
        acceptance_lengths=[round_lengths[r, :num_rounds[r]].tolist() for r in range(n_prompts)],
        prefill_seconds=prefill_s,
        decode_seconds=decode_s,
        compile_seconds=programs.compile_seconds,
        trees=trees,
        budgets_chosen=None if chosen is None else [chosen[r, :num_rounds[r]].tolist() for r in range(n_prompts)],
        round_costs=[float(c) for c in round_costs] if options.auto_budget else None,
        change_cost=float(change_cost) if options.auto_budget else None,
        calibration_seconds=calibration_s,
        auto_learned=state.budget.learned() if options.auto_budget else None,
    )


def kept_record(target: ModelParams, prompts: Sequence[Sequence[int]], options: DecodeOptions,
                drafter: ModelParams | None) -> tuple[dict, "auto.CallRecord | None"]:
    """`--budget auto` per call: the key of the record for these prompts and options (`budget.record_key`: the
    batch, and the context the widest candidate's program would size), and the record kept on disk for it (None:
    none)."""
    dtype = target.array("model.embed_tokens.weight").dtype
    resolved = resolve_options(options, drafter, dtype)
    _, capacity = cache_shape(max(map(len, prompts), default=0), resolved)
    key = auto.record_key(target.config, drafter.config, resolved, len(prompts), capacity, dtype)
    return key, auto.load_record(key)


def _generate_per_call(target: ModelParams, prompts: Sequence[Sequence[int]], options: DecodeOptions, *,
                       drafter: ModelParams | None, seed: int, recalibrate: bool, auto_learned: dict | None,
                       on_tokens: Callable | None, **kwargs) -> GenerationResult:
    """`generate` for `--budget auto` per call: the candidate the record picks runs its fixed program
    (`DecodeOptions.candidate`: the programs of the fixed rows, compiled once per process); the record (with this
    call's calibration runs, if it calibrated) is kept on disk and returned as `auto_learned`.

    Calibration (`budget.decide_call`): on the first `budget.CALIBRATION_CALLS` calls of a record, every candidate
    first runs on these prompts (a freshly compiled program once more, so that its first run's setup is not
    timed), each with a seed of its own: their outputs are set aside, so the choice, which depends on their speed,
    is independent of the sampling of the call that is returned (exact with sampling). Their seconds are
    `calibration_seconds`."""
    n = len(options.budgets)
    key, kept = kept_record(target, prompts, options, drafter)
    if auto_learned is not None:
        record = auto.CallRecord.from_learned(auto_learned, n)
    elif recalibrate or kept is None:
        record = auto.CallRecord.empty(n)
    else:
        record = kept
    returned, compile_s = [], []

    def run(i: int, calibrating: bool) -> tuple[int, float]:
        fixed = options.candidate(options.budgets[i])
        if calibrating:
            out = generate(target, prompts, fixed, drafter=drafter, seed=seed + 1 + i, **kwargs)
            if out.compile_seconds > 0:
                compile_s.append(out.compile_seconds)
                out = generate(target, prompts, fixed, drafter=drafter, seed=seed + 1 + i, **kwargs)
        else:
            out = generate(target, prompts, fixed, drafter=drafter, seed=seed, on_tokens=on_tokens, **kwargs)
            returned.append(out)
        compile_s.append(out.compile_seconds)
        return out.new_tokens, out.decode_seconds

    record, pick, calibration_s = auto.decide_call(record, run)
    [result], budget = returned, options.budgets[pick]
    if auto.save_record(key, record) is None and "record" not in _NOTED:
        _NOTED.add("record")
        print(f"warning: cannot write the --budget auto record in {auto.cost_cache_dir()}; what this run measures "
              "holds for this process only", file=sys.stderr)
    trees = None if result.trees is None else [{**tree, "budget": budget} for tree in result.trees]
    return dataclasses.replace(result, trees=trees, auto_learned=record.learned(), calibration_seconds=calibration_s,
                               compile_seconds=sum(compile_s),
                               budgets_chosen=[[budget] * len(a) for a in result.acceptance_lengths])


def with_round_costs(state: DecodeState, seconds: Sequence[float], change_seconds: float = 0.0) -> DecodeState:
    """The state with `--budget auto`'s seconds per round of each candidate and per change of candidate (array
    arguments of the loop)."""
    budget = state.budget
    costs = jax.device_put(np.asarray(seconds, np.float32), budget.costs.sharding)
    change = jax.device_put(np.asarray(change_seconds, np.float32), budget.change_cost.sharding)
    return dataclasses.replace(state, budget=dataclasses.replace(budget, costs=costs, change_cost=change))


# Timed rounds per call of the calibration (a decode's rest where it has fewer), and timed triples of calls per
# candidate (median). With 8 and 5 the demo pair's costs on the H200 read 0.20 ms for the chain and 0.29 for
# B = 16 in four runs (2026-12-03, evening) where tools/loop_cost.py timed auto's rounds at 0.226 and 0.278 ms in
# calls of 48: the chain looked 15% cheaper against B = 16 than it ran, and auto kept it where B = 32 was ahead.
CALIBRATION_ROUNDS = 32
CALIBRATION_REPEATS = 7
CALIBRATION_WARMUP_S = 0.25  # untimed calls of every candidate first, at least this long
FORCED_OUT = float("inf")  # the cost that keeps a candidate from being chosen while another one is measured


def calibrate(run_prefill: Callable[[], DecodeState], run_loop: Callable[[DecodeState, int], DecodeState],
              options: DecodeOptions) -> tuple[list[float], float, bool]:
    """Seconds per round of each `--budget auto` candidate, and per change of candidate, measured with the
    compiled prefill and decode loop that the generation runs: per candidate, the choice forced to it (every
    other candidate's cost FORCED_OUT), the time of a call of 1 + CALIBRATION_ROUNDS rounds less that of a call
    of one round (each after a fresh prefill and one untimed round), per round of difference, so that a call's
    own dispatch cancels (timing the long call alone read 0.70 ms for both the chain and B = 16 on the demo pair
    on the H200, 2026-12-02, whose rounds take 0.33 and 0.39 ms). Every call enters its candidate's loop once
    (`round.auto_loop`), as a change of candidate does: a call of one round less a call of none, less a round,
    is the cost of that entry. The schedule is `calibration_schedule`'s. Returns (seconds, change seconds,
    complete): a candidate that got no timed round (the rows finished within one round) is given seconds in
    proportion to its verified tokens against the measured ones, and `complete` is False (not worth caching)."""
    budgets = options.budgets

    def timed(i: int, rounds: int) -> tuple[float, int]:
        forced = [FORCED_OUT] * len(budgets)
        forced[i] = 1.0
        state = jax.block_until_ready(run_loop(with_round_costs(run_prefill(), forced), 1))
        first = int(to_host(state.step))
        start = time.perf_counter()
        state = jax.block_until_ready(run_loop(state, rounds))
        return time.perf_counter() - start, int(to_host(state.step)) - first

    widths = [options.candidate(b).verify_width for b in budgets]
    return calibration_schedule(timed, widths, clock=time.perf_counter)


def calibration_schedule(timed: Callable[[int, int], tuple[float, int]], widths: Sequence[int], *,
                         clock: Callable[[], float], warmup_s: float = CALIBRATION_WARMUP_S,
                         repeats: int = CALIBRATION_REPEATS) -> tuple[list[float], float, bool]:
    """`calibrate`'s measurement order, apart from the device: timed(i, rounds) -> (seconds, rounds run) for
    candidate i (rounds may be 0: the call drafts and chooses, and runs no round); widths: each candidate's
    verified tokens per round (for one that gets no timed round).

    First every candidate runs untimed, round-robin, for at least `warmup_s` (clock seconds): the candidate
    measured first read 0.41 ms per round against the 0.24 its rounds take (the demo pair's chain on the H200,
    2026-12-03, measured right after compiling; a GPU that was idle starts at a low clock, the likely cause,
    not yet confirmed). Then the candidates take turns, one (long, short, empty) triple each per repeat, so that
    what drifts during the calibration drifts for all of them alike; per candidate the median over the repeats
    of (long - short) per round; the change's cost is the median over candidates and repeats of short - empty
    less that repeat's round (at least 0)."""
    n = len(widths)
    start = clock()
    while True:
        for i in range(n):
            timed(i, 1 + CALIBRATION_ROUNDS)
        if clock() - start >= warmup_s:
            break
    times: list[list[float]] = [[] for _ in range(n)]
    changes: list[float] = []
    for _ in range(repeats):
        for i in range(n):
            long_s, long_rounds = timed(i, 1 + CALIBRATION_ROUNDS)
            short_s, short_rounds = timed(i, 1)
            empty_s, _ = timed(i, 0)
            if long_rounds > short_rounds and long_s > short_s:
                per_round = (long_s - short_s) / (long_rounds - short_rounds)
                times[i].append(per_round)
                if short_rounds == 1:
                    changes.append(short_s - empty_s - per_round)
            elif long_rounds:  # timer noise above the difference: the long call alone
                times[i].append(long_s / long_rounds)
    seconds = [statistics.median(t) if t else None for t in times]
    measured = [(s, w) for s, w in zip(seconds, widths) if s is not None]
    per_token = statistics.median(s / w for s, w in measured) if measured else 1.0
    change = max(0.0, statistics.median(changes)) if changes else 0.0
    return [s if s is not None else per_token * w for s, w in zip(seconds, widths)], change, len(measured) == n


def _trace_rows(state: DecodeState, running: np.ndarray) -> list[dict]:
    """The last round's trees of the rows that were running, as JSON-ready dicts (valid nodes only)."""
    t = jax.tree.map(to_host, state.trace)
    chosen = to_host(state.budget.chosen) if state.budget is not None else None
    num_rounds = to_host(state.num_rounds)
    out = []
    for r in np.flatnonzero(running):
        keep = t.valid[r]
        count = int(t.count[r])
        out.append({"round": int(to_host(state.step)) - 1, "row": int(r), "start": int(t.start[r]),
                    "tokens": t.tokens[r][keep].tolist(), "parents": t.parents[r][keep].tolist(),
                    "depths": t.depths[r][keep].tolist(), "accepted": t.path[r][:count].tolist()})
        if chosen is not None:  # --budget auto: the budget this round verified (0: the chain)
            out[-1]["budget"] = int(chosen[r, num_rounds[r] - 1])
    return out


def _rows(state: DecodeState) -> list[list[int]]:
    output, counts = to_host(state.output), to_host(state.num_generated)
    return [output[r, :counts[r]].tolist() for r in range(output.shape[0])]
