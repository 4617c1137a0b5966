"""Decoding rounds and the on-device decode loop.

A round is one jitted function of `(target, drafter, DecodeState)`; the loop is a `lax.while_loop` over rounds
that runs until every row is done or a step limit is reached (the limit lets a terminal stream a few
rounds per call). The state is donated, so caches update in place. The host-facing `generate` pads the
prompts, sizes the cache, compiles once per shape (kept in a small cache) and times prefill and decode
separately, compilation excluded.

Modes: AR (one target token per round); DFlash (a drafted chain verified in one target pass); DDTree
(a static-size draft tree built from the same drafter pass, verified in one target pass with an
ancestor mask). DFlash is the DDTree round with a chain for a tree.

Targets: Qwen3 (attention only: a `KVCache`) and the Qwen3.5/3.6 hybrid (a `HybridCache`: K/V of the
full-attention layers plus a recurrent state per Gated DeltaNet layer). On a hybrid, verification runs every
Gated DeltaNet layer over the tree nodes in order, each node starting from its parent's state, and the
commit installs the deepest accepted node's state and conv window (`cache.commit_recurrent`).
"""

from __future__ import annotations

import dataclasses
import enum
import time
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ddtree_jax.accept import Acceptance, accept_tree, chain_tree
from ddtree_jax.cache import (HybridCache, KVCache, RecurrentState, advance, advance_hybrid, commit_path,
                             commit_recurrent)
from ddtree_jax.models import dflash, qwen3, qwen3_5
from ddtree_jax.models.params import ModelParams
from ddtree_jax.parallel import Parallel, put, to_host
from ddtree_jax.sampling import SamplingConfig, decode_tokens
from ddtree_jax.tree import build_tree
from pallas_kernels._dispatch import KERNEL_CHOICES, resolve_kernels

CAPACITY_BUCKET = 128
PROMPT_BUCKET = 32


class Mode(str, enum.Enum):
    AR = "ar"
    DFLASH = "dflash"
    DDTREE = "ddtree"

    @property
    def needs_drafter(self) -> bool:
        return self is not Mode.AR


@dataclasses.dataclass(frozen=True)
class DecodeOptions:
    """Static choices of one generation call (hashable: part of the compilation key).

    block_size: drafter block (bonus + bs - 1 drafts); 0 takes the drafter's own.
    budget: DDTree tree nodes besides the root (B); the target verifies B + 1 tokens per round.
    """

    mode: Mode = Mode.AR
    max_new_tokens: int = 64
    sampling: SamplingConfig = SamplingConfig()
    eos_ids: tuple[int, ...] = ()  # empty: never stop on a token
    block_size: int = 0
    budget: int = 64
    record_trees: bool = False  # keep each round's tree and accepted path in the state (--save-trees)
    parallel: Parallel = Parallel()  # device layout (parallel.py)
    # "auto": the Pallas kernels (pallas_kernels/) on a GPU for 16-bit weights, pure-JAX attention and
    # acceptance elsewhere ($DDTREE_JAX_KERNELS=pallas|jax overrides "auto"); "jax" or "pallas" forces one.
    # See `kernel_impl` and `resolve_options`.
    kernels: str = "auto"

    def __post_init__(self):
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.mode.needs_drafter and self.block_size == 1:
            raise ValueError(f"block_size must be >= 2 for {self.mode.value}, got {self.block_size}")
        if self.mode is Mode.DDTREE and self.budget < 1:
            raise ValueError(f"budget must be >= 1, got {self.budget}")
        if self.kernels not in KERNEL_CHOICES:
            raise ValueError(f"kernels must be one of {', '.join(map(repr, KERNEL_CHOICES))}, got {self.kernels!r}")

    @property
    def kernel_impl(self) -> str:
        """"jax" or "pallas": the one place where "auto" is resolved (`pallas_kernels._dispatch.resolve_kernels`:
        $DDTREE_JAX_KERNELS if set, else "pallas" when JAX's default backend is a GPU). `resolve_options` pins
        it before compiling, so a compiled program is keyed on what it runs."""
        return resolve_kernels(self.kernels)

    @property
    def attention_kernels(self):
        """What the models' attention receives: "jax", "pallas", or ("pallas", mesh) under tp."""
        kernels = self.kernel_impl
        if kernels == "pallas" and self.parallel.mode == "tp":
            return ("pallas", self.parallel.mesh)
        return kernels

    @property
    def verify_width(self) -> int:
        """Tokens the target verifies per round (the widest call after prefill)."""
        return {Mode.AR: 1, Mode.DFLASH: self.block_size, Mode.DDTREE: self.budget + 1}[self.mode]

    @property
    def max_rounds(self) -> int:
        return self.max_new_tokens


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DecodeState:
    """Everything the loop carries, all on device.

    Fields:
      cache:          target KV cache (HybridCache for a hybrid target); `lengths` counts the tokens fed to
                      the target.
      draft_cache:    drafter context K/V (same lengths as `cache` between rounds), or None for AR.
      last_token:     [b] int32, newest emitted token (not yet fed to the target).
      output:         [b, max_new] int32, emitted tokens (prompt excluded); valid up to num_generated.
      num_generated:  [b] int32.
      done:           [b] bool, row emitted EOS or reached max_new.
      round_lengths:  [b, max_rounds] int32, tokens committed per round (bonus included); 0 = no round.
      num_rounds:     [b] int32, rounds in which the row was still running.
      rng:            PRNG key (sampling).
      step:           [] int32, rounds run (all rows).
      trace:          the last round's tree and accepted path (RoundTrace), when options.record_trees.
    """

    cache: KVCache | HybridCache
    draft_cache: KVCache | None
    last_token: jax.Array
    output: jax.Array
    num_generated: jax.Array
    done: jax.Array
    round_lengths: jax.Array
    num_rounds: jax.Array
    rng: jax.Array
    step: jax.Array
    trace: "RoundTrace | None" = None


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RoundTrace:
    """One round's draft tree and what was accepted (device; T tree nodes, P = block size).

    start [b] position of the root; tree.* [b, T]; path [b, P] accepted node indices by depth; count [b]."""

    start: jax.Array
    tokens: jax.Array
    parents: jax.Array
    depths: jax.Array
    valid: jax.Array
    path: jax.Array
    count: jax.Array

    @classmethod
    def empty(cls, batch: int, nodes: int, path_len: int) -> "RoundTrace":
        z = lambda *shape: jnp.zeros(shape, jnp.int32)  # noqa: E731
        return cls(start=z(batch), tokens=z(batch, nodes), parents=z(batch, nodes), depths=z(batch, nodes),
                   valid=jnp.zeros((batch, nodes), bool), path=z(batch, path_len), count=z(batch))


def causal_mask(valid: jax.Array, t: int) -> jax.Array:
    """[b, t, t] bool: token i sees tokens j <= i of its row; a padding token (i >= valid[r]) sees only itself.

    Example, t = 3, valid = [2]:  [[1,0,0], [1,1,0], [0,0,1]].
    """
    i = jnp.arange(t)[:, None]
    j = jnp.arange(t)[None, :]
    is_valid = i[None] < valid[:, None, None]
    return (j <= i)[None] & (is_valid | (i == j)[None])


def target_model(params: ModelParams):
    """The model module of a target: `qwen3_5` for a hybrid (Qwen3.5/3.6) config, else `qwen3`. Both have
    create_cache, forward and logits."""
    return qwen3_5 if getattr(params.config, "model_type", "qwen3") == "qwen3_5" else qwen3


def is_hybrid(params: ModelParams) -> bool:
    return target_model(params) is qwen3_5


def _target_forward(target: ModelParams, tokens, positions, cache, new_mask, *, tap_layers=(), kernels="jax",
                    valid=None, parents=None):
    """The target's forward; `valid` (real tokens per row) and `parents` (a verification tree) matter only to
    a hybrid target's recurrent layers, an attention-only target needs neither."""
    if is_hybrid(target):
        return qwen3_5.forward(target, tokens, positions, cache, new_mask, tap_layers=tap_layers, valid=valid,
                               kernels=kernels, parents=parents)
    return qwen3.forward(target, tokens, positions, cache, new_mask, tap_layers=tap_layers, kernels=kernels)


def _advance(cache, counts):
    return advance_hybrid(cache, counts) if isinstance(cache, HybridCache) else advance(cache, counts)


def _constrain_cache(cache, parallel: Parallel):
    """Pin a cache's layout: heads over the tp axis, rows over the dp axis (a hybrid's recurrent states:
    rows over dp, replicated under tp)."""
    if cache is None or parallel.mesh is None:
        return cache
    if isinstance(cache, HybridCache):
        recurrent = tuple(RecurrentState(state=parallel.constrain(r.state, parallel.batch_spec(4)),
                                         conv=parallel.constrain(r.conv, parallel.batch_spec(3)))
                          for r in cache.recurrent)
        return HybridCache(kv=_constrain_cache(cache.kv, parallel), recurrent=recurrent)
    spec = parallel.kv_spec(cache.k[0].shape[2])
    return KVCache(k=tuple(parallel.constrain(k, spec) for k in cache.k),
                   v=tuple(parallel.constrain(v, spec) for v in cache.v),
                   lengths=parallel.constrain(cache.lengths, parallel.batch_spec(1)))


def _is_eos(tokens: jax.Array, eos_ids: tuple[int, ...]) -> jax.Array:
    if not eos_ids:
        return jnp.zeros(tokens.shape, bool)
    return jnp.isin(tokens, jnp.asarray(eos_ids, jnp.int32))


def _emit(state: DecodeState, tokens: jax.Array, counts: jax.Array, options: DecodeOptions) -> DecodeState:
    """Append up to `tokens.shape[1]` tokens per row (the first `counts[r]`), stopping rows at EOS or max_new.

    tokens [b, w] int32, counts [b] int32 (0 for rows already done). A row that meets EOS keeps the EOS and
    drops what follows it in the same round.
    """
    b, w = tokens.shape
    max_new = options.max_new_tokens
    offsets = jnp.arange(w)[None, :]
    eos_at = _is_eos(tokens, options.eos_ids) & (offsets < counts[:, None])
    first_eos = jnp.where(eos_at.any(-1), jnp.argmax(eos_at, axis=-1) + 1, w)
    kept = jnp.minimum(jnp.minimum(counts, first_eos), max_new - state.num_generated)
    kept = jnp.where(state.done, 0, kept)
    slots = state.num_generated[:, None] + offsets
    write = offsets < kept[:, None]
    rows = jnp.broadcast_to(jnp.arange(b)[:, None], (b, w))
    output = state.output.at[rows, jnp.where(write, slots, max_new)].set(tokens, mode="drop")
    num_generated = state.num_generated + kept
    hit_eos = (eos_at & write).any(-1)
    done = state.done | hit_eos | (num_generated >= max_new)
    last = jnp.take_along_axis(tokens, jnp.maximum(kept - 1, 0)[:, None], axis=1)[:, 0]
    return dataclasses.replace(state, output=output, num_generated=num_generated, done=done,
                               last_token=jnp.where(kept > 0, last, state.last_token))


def prefill(target: ModelParams, drafter: ModelParams | None, tokens: jax.Array, prompt_lengths: jax.Array,
            rng: jax.Array, *, capacity: int, options: DecodeOptions) -> DecodeState:
    """Run the prompt (right-padded tokens [b, p], lengths [b]), fill the drafter's context cache, and emit
    each row's first token."""
    b, p = tokens.shape
    dtype = target.flat()["model.embed_tokens.weight"].dtype
    model = target_model(target)
    cache = _constrain_cache(model.create_cache(target.config, b, capacity, dtype), options.parallel)
    positions = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (b, p))
    taps = drafter.config.target_layer_ids if drafter is not None else ()
    out = _target_forward(target, tokens, positions, cache, causal_mask(prompt_lengths, p), tap_layers=taps,
                          kernels=options.attention_kernels, valid=prompt_lengths)
    cache = _advance(out.cache, prompt_lengths)
    draft_cache = None
    if drafter is not None:
        draft_cache = dflash.ingest_context(drafter, out.taps, prompt_lengths, _constrain_cache(
            dflash.create_cache(drafter.config, b, capacity, dtype), options.parallel))
    last_hidden = jnp.take_along_axis(out.hidden, (prompt_lengths - 1)[:, None, None], axis=1)[:, 0]
    rng, key = jax.random.split(rng)
    first = decode_tokens(model.logits(target, last_hidden), key, options.sampling)
    state = DecodeState(
        cache=cache,
        draft_cache=draft_cache,
        last_token=first,
        output=jnp.zeros((b, options.max_new_tokens), jnp.int32),
        num_generated=jnp.zeros((b,), jnp.int32),
        done=jnp.zeros((b,), bool),
        round_lengths=jnp.zeros((b, options.max_rounds), jnp.int32),
        num_rounds=jnp.zeros((b,), jnp.int32),
        rng=rng,
        step=jnp.zeros((), jnp.int32),
        trace=RoundTrace.empty(b, options.verify_width, options.block_size) if options.record_trees else None,
    )
    return _emit(state, first[:, None], jnp.ones((b,), jnp.int32), options)


def ar_round(target: ModelParams, drafter: None, state: DecodeState, options: DecodeOptions) -> DecodeState:
    """Feed each row's last token to the target and emit the next one."""
    b = state.last_token.shape[0]
    running = ~state.done
    out = _target_forward(target, state.last_token[:, None], state.cache.lengths[:, None], state.cache,
                          jnp.ones((b, 1, 1), bool), kernels=options.attention_kernels,
                          valid=running.astype(jnp.int32))  # a done row's recurrent state stays put
    cache = _constrain_cache(_advance(out.cache, running.astype(jnp.int32)), options.parallel)
    rng, key = jax.random.split(state.rng)
    token = decode_tokens(target_model(target).logits(target, out.hidden[:, 0]), key, options.sampling)
    counts = running.astype(jnp.int32)
    state = dataclasses.replace(state, cache=cache, rng=rng)
    return _record_round(_emit(state, token[:, None], counts, options), counts, running)


def speculative_round(target: ModelParams, drafter: ModelParams, state: DecodeState,
                      options: DecodeOptions) -> DecodeState:
    """One DFlash or DDTree round: draft once, verify every drafted token in one target pass, keep the
    longest path on which the target's own decoding rule agrees, plus the target's next token.

    DFlash drafts the chain of per-position argmaxes; DDTree the B most probable prefixes (tree.py).
    Chain example, bs = 4: bonus x, drafts [d1 d2 d3], decoded post = [p0 p1 p2 p3]; d1 == p0,
    d2 == p1, d3 != p2 gives path [0 1 2], count 3; the cache keeps [x d1 d2], the round emits
    [p0 p1 p2] = [d1 d2 p2], and p2 is the next bonus. At temperature > 0 every node gets an independent
    sample of the target's rule (sample-and-match), so every emitted token is an exact sample given its
    prefix.
    """
    b = state.last_token.shape[0]
    bs = options.block_size
    running = ~state.done
    start = state.cache.lengths
    with jax.named_scope("draft"):
        block = jnp.concatenate([state.last_token[:, None],
                                 jnp.full((b, bs - 1), drafter.config.mask_token_id, jnp.int32)], axis=1)
        logits = dflash.draft_logits(drafter, target, block, state.draft_cache,
                                     options.attention_kernels)  # [b, bs - 1, v]
    with jax.named_scope("tree"):
        if options.mode is Mode.DDTREE:
            tree = build_tree(jax.nn.log_softmax(logits, axis=-1), state.last_token, options.budget)
        else:
            drafts = jnp.argmax(logits, axis=-1).astype(jnp.int32)
            tree = chain_tree(jnp.concatenate([state.last_token[:, None], drafts], axis=1))
    with jax.named_scope("verify"):
        # A hybrid's recurrent layers walk the tree (a chain for DFlash): each node from its parent's state.
        out = _target_forward(target, tree.tokens, start[:, None] + tree.depths, state.cache, tree.ancestor,
                              tap_layers=drafter.config.target_layer_ids, kernels=options.attention_kernels,
                              parents=tree.parents)
        rng, key = jax.random.split(state.rng)
        node_logits = target_model(target).logits(target, out.hidden)
    with jax.named_scope("accept"):
        if options.kernel_impl == "pallas" and options.sampling.greedy and options.parallel.mode != "tp":
            # The fused kernel reads the T x V logits once for the argmax and walks the tree (under tp the
            # logits are split over the vocabulary and XLA's sharded argmax does this step).
            from pallas_kernels.tree_accept import tree_accept_pallas

            fused = tree_accept_pallas(node_logits, tree.tokens, tree.parents, tree.depths, tree.valid,
                                       path_len=bs, interpret=jax.default_backend() != "gpu")
            acc = Acceptance(path=fused.path, count=fused.count, bonus=fused.bonus, tokens=fused.tokens)
        else:
            acc = accept_tree(tree, decode_tokens(node_logits, key, options.sampling), bs)
        counts = jnp.where(running, acc.count, 0)
    with jax.named_scope("commit"):
        hybrid = isinstance(out.cache, HybridCache)
        kv = out.cache.kv if hybrid else out.cache
        if options.mode is Mode.DDTREE:
            kv = commit_path(kv, acc.path, counts)
            taps = jnp.take_along_axis(out.taps, acc.path[:, :, None], axis=1)
        else:  # a chain's path is 0, 1, 2, ...: rows are already in place
            kv, taps = advance(kv, counts), out.taps
        # A hybrid's recurrent layers take the deepest accepted node's state and the path's conv window.
        cache = HybridCache(kv=kv, recurrent=tuple(commit_recurrent(r, n, acc.path, counts) for r, n in
                                                   zip(out.cache.recurrent, out.nodes))) if hybrid else kv
        draft_cache = _constrain_cache(dflash.ingest_context(drafter, taps, counts, state.draft_cache),
                                       options.parallel)
        cache = _constrain_cache(cache, options.parallel)
        trace = RoundTrace(start=start, tokens=tree.tokens, parents=tree.parents, depths=tree.depths,
                           valid=tree.valid, path=acc.path, count=counts) if options.record_trees else None
        state = dataclasses.replace(state, cache=cache, draft_cache=draft_cache, rng=rng, trace=trace)
        state = _emit(state, acc.tokens, counts, options)
    return _record_round(state, counts, running)


def _record_round(state: DecodeState, counts: jax.Array, running: jax.Array) -> DecodeState:
    b = counts.shape[0]
    idx = jnp.where(running, state.num_rounds, state.round_lengths.shape[1])
    round_lengths = state.round_lengths.at[jnp.arange(b), idx].set(counts, mode="drop")
    return dataclasses.replace(state, round_lengths=round_lengths, num_rounds=state.num_rounds + running,
                               step=state.step + 1)


ROUNDS = {Mode.AR: ar_round, Mode.DFLASH: speculative_round, Mode.DDTREE: speculative_round}


def decode_loop(target: ModelParams, drafter: ModelParams | None, state: DecodeState, max_steps: jax.Array,
                options: DecodeOptions) -> DecodeState:
    """Run rounds until every row is done or `max_steps` more rounds have run (all on device)."""
    round_fn = ROUNDS[options.mode]
    stop_at = state.step + max_steps

    def cond(s: DecodeState):
        return (~s.done).any() & (s.step < stop_at)

    return jax.lax.while_loop(cond, lambda s: round_fn(target, drafter, s, options), state)


# ----------------------------------------------------------------------------------------------------
# Host-facing API


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


_COMPILED: dict = {}


def _compiled(name: str, fn: Callable, args: tuple, static: dict, donate: tuple[int, ...] = ()):
    """AOT-compile `fn` for these argument shapes once per process; returns (compiled, seconds spent)."""
    shapes = jax.tree.map(lambda a: (a.shape, a.dtype) if hasattr(a, "shape") else a, args)
    key = (name, jax.tree.structure(args), str(jax.tree.leaves(shapes)), tuple(sorted(static.items())))
    if key in _COMPILED:
        return _COMPILED[key], 0.0
    start = time.perf_counter()
    compiled = jax.jit(fn, static_argnames=tuple(static), donate_argnums=donate).lower(*args, **static).compile()
    _COMPILED[key] = compiled
    return compiled, time.perf_counter() - start


def resolve_options(options: DecodeOptions, drafter: ModelParams | None, dtype=None) -> DecodeOptions:
    """Fill in what the drafter decides (block size) and what "auto" kernels mean here, and check that the mode
    has what it needs. `dtype`: the target's compute dtype; "auto" keeps the pure-JAX path for float32,
    where the Pallas attention is many times slower than XLA's on the H200 (910 vs 61 us per call at
    T = 16, docs/kernels.md)."""
    if options.kernels == "auto":
        options = dataclasses.replace(options, kernels=resolve_kernels(options.kernels, dtype))
    if options.mode.needs_drafter:
        if drafter is None:
            raise ValueError(f"mode {options.mode.value} needs a drafter")
        if options.block_size == 0:
            options = dataclasses.replace(options, block_size=drafter.config.block_size)
    return options


def generate(target: ModelParams, prompts: Sequence[Sequence[int]], options: DecodeOptions, *,
             drafter: ModelParams | None = None, seed: int = 0, steps_per_call: int | None = None,
             on_tokens: Callable[[list[list[int]]], None] | None = None) -> GenerationResult:
    """Generate for a batch of token-id prompts (unequal lengths allowed).

    drafter: the DFlash drafter (DFlash mode). steps_per_call: rounds per device call (None: the whole loop
    in one call); `on_tokens` receives every row's tokens so far after each call, for streaming.
    """
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    options = resolve_options(options, drafter, target.flat()["model.embed_tokens.weight"].dtype)
    if not options.mode.needs_drafter:
        drafter = None
    vocab = target.config.vocab_size
    for r, prompt in enumerate(prompts):
        bad = [t for t in prompt if not 0 <= int(t) < vocab]
        if bad:
            raise ValueError(f"prompt {r}: token id {bad[0]} is outside the vocabulary (0..{vocab - 1})")
    n_prompts = len(prompts)
    parallel = options.parallel
    if parallel.mode == "dp" and n_prompts % parallel.size:
        # dp splits rows evenly over devices: pad with copies of the first prompt, dropped at the end.
        prompts = list(prompts) + [prompts[0]] * (parallel.size - n_prompts % parallel.size)
    b = len(prompts)
    lengths = np.array([len(p) for p in prompts], np.int32)
    width, capacity = cache_shape(int(lengths.max()), options)
    tokens = np.zeros((b, width), np.int32)
    for r, prompt in enumerate(prompts):
        tokens[r, :len(prompt)] = prompt
    rng = jax.random.key(seed)
    tokens = put(tokens, parallel.sharding(parallel.batch_spec(2)))
    lengths_dev = put(lengths, parallel.sharding(parallel.batch_spec(1)))

    static = dict(capacity=capacity, options=options)
    prefill_fn, compile_s = _compiled("prefill", prefill, (target, drafter, tokens, lengths_dev, rng), static)
    start = time.perf_counter()
    state = jax.block_until_ready(prefill_fn(target, drafter, tokens, lengths_dev, rng))
    prefill_s = time.perf_counter() - start

    if options.record_trees:
        if not options.mode.needs_drafter:
            raise ValueError("record_trees needs a speculative mode (dflash or ddtree)")
        steps_per_call = 1  # the trace holds one round; read it after every round
    trees: list[dict] | None = [] if options.record_trees else None
    steps = jnp.asarray(steps_per_call or options.max_rounds, jnp.int32)
    loop_fn, loop_compile_s = _compiled("decode_loop", decode_loop, (target, drafter, state, steps),
                                        dict(options=options), donate=(2,))
    decode_s = 0.0
    while True:
        if on_tokens is not None:
            on_tokens(_rows(state))
        done = to_host(state.done)
        if done.all():
            break
        running = ~done
        start = time.perf_counter()
        state = jax.block_until_ready(loop_fn(target, drafter, state, steps))
        decode_s += time.perf_counter() - start
        if trees is not None:
            trees.extend(_trace_rows(state, running))
    round_lengths, num_rounds = to_host(state.round_lengths), to_host(state.num_rounds)
    return GenerationResult(
        output_ids=_rows(state)[:n_prompts],
        acceptance_lengths=[round_lengths[r, :num_rounds[r]].tolist() for r in range(n_prompts)],
        prefill_seconds=prefill_s,
        decode_seconds=decode_s,
        compile_seconds=compile_s + loop_compile_s,
        trees=trees,
    )


def _trace_rows(state: DecodeState, running: np.ndarray) -> list[dict]:
    """The last round's trees of the rows that were running, as JSON-ready dicts (valid nodes only)."""
    t = jax.tree.map(to_host, state.trace)
    out = []
    for r in np.flatnonzero(running):
        keep = t.valid[r]
        count = int(t.count[r])
        out.append({"round": int(to_host(state.step)) - 1, "row": int(r), "start": int(t.start[r]),
                    "tokens": t.tokens[r][keep].tolist(), "parents": t.parents[r][keep].tolist(),
                    "depths": t.depths[r][keep].tolist(), "accepted": t.path[r][:count].tolist()})
    return out


def _rows(state: DecodeState) -> list[list[int]]:
    output, counts = to_host(state.output), to_host(state.num_generated)
    return [output[r, :counts[r]].tolist() for r in range(output.shape[0])]
