"""One decode round, top to bottom, and the on-device loop over rounds.

A speculative round (DFlash, DDTree or MTP) is five stages, each a public function of device arrays that the
round composes and that the benchmark and the tools compile and time as they are (`STAGES`):

    draft   the drafter reads its cached context and the block [bonus, mask x (bs - 1)]: logits [b, bs - 1, v];
            MTP: the target's own MTP head runs m chained steps (`models/mtp.py`): logits [b, m, v]
    tree    DDTree: the B most probable prefixes under those marginals (`tree.build_tree`); DFlash and MTP:
            the chain of per-position argmaxes (`accept.chain_tree`)
    verify  the target runs every node in one pass (node at position start + depth, seeing the committed
            cache and its own ancestors): logits per node, hidden taps, every node's K/V beside the cache
            (`cache.PendingKV`) and a hybrid's per-node recurrent records
    accept  the target's decoding rule at every node and the walk to the deepest agreeing node: path,
            count, the tokens the round emits (greedy on the Pallas kernels: one fused kernel)
    commit  the accepted nodes' K/V are written into the cache, a hybrid's recurrent state becomes the deepest
            accepted node's, and the accepted taps become the drafter's next context (MTP: the head runs
            over the emitted tokens with the target's hidden states and keeps their K/V, `mtp.ingest`)

An AR round is the verify of one token (`ar_round`). `decode_loop` runs rounds in a `lax.while_loop`
until every row is done or a step limit is reached (`--budget auto`: `auto_loop`, a loop of each chosen
candidate's rounds under a switch that runs once per change of candidate); the host side
(`engine.generate`) compiles it once per shape and donates the state, so caches update in place. Every one of
these entry points traces under the options' matmul precision (`at_matmul_precision`): float32 means float32
on a GPU too (no TF32).

Letters (the package glossary, `ddtree_jax/__init__.py`): b rows, T tree nodes (B + 1 for DDTree, bs for
DFlash, m + 1 for MTP, 1 for AR), P path slots (the block size; m + 1 for MTP), m MTP steps, v vocabulary.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import functools
import inspect

import jax
import jax.numpy as jnp

from ddtree_jax import cache as kv
from ddtree_jax.accept import Accepted, accept_tree, chain_tree
from ddtree_jax.budget import (AUTO_SCOPES, CHAIN, BudgetState, chain_rounds, check_candidates, choose,
                               learn_chain_rounds, observe, revealed_counts)
from ddtree_jax.models import dflash, mtp, target_family
from ddtree_jax.models.contract import (FP8_MATMUL_CHOICES, KERNEL_CHOICES, ForwardMeta,
                                        ForwardOut, Kernels, Runtime, resolve_fp8_matmul, resolve_kernels)
from ddtree_jax.models.params import ModelParams
from ddtree_jax.parallel import Parallel, constrain_cache
from ddtree_jax.sampling import SamplingConfig, decode_tokens
from ddtree_jax.tree import DraftTree, build_tree
from pallas_kernels.tree_accept import tree_accept


# Budgets up to which the Pallas kernel builds the tree (`pallas_kernels.tree_build`, one program per row, its
# candidates pruned): the whole build (V = 151936, L = 15, its top-k included) took 89 / 123 us at B = 64 and
# 123-128 / 166 at B = 128 for shallow / deep trees, against 207-215 and 238-244 for XLA's builder, in one H200 call
# (tools/topk_probe.py, 2026-12-04; docs/performance.md). Up to its MAX_BUDGET (512) since its defaults above 128 of
# 2026-12-06 (the running list's bound, wider tiles, the merge by binary search, the bisection above B): on an H100,
# 106 / 260 us at B = 512 for shallow / deep trees against 302 / 318 for XLA's builder, 75 / 168 against 232 / 234
# at B = 256, and the 8B's DDTree round at B = 256 11.64 against 11.83 ms (B = 512 18.28 against 18.13, within the
# spread: its tree step 0.24 against 0.53 ms); with the candidate table in registers since, 243.5-254.3 us deep at
# B = 512 on two more H100s.
TREE_BUILD_KERNEL_UP_TO = 512
# Budgets up to which the Pallas kernel takes the vocabulary top-k (`pallas_kernels.vocab_top_k`, lax.top_k's
# bits): at every K measured it beat XLA's threshold top-k (H100, 2026-12-05: 82 / 120 us against 132 / 160 at
# K = 256 / 512; H200, 2026-12-02: 83 against 115 us at 64).
VOCAB_TOP_K_KERNEL_UP_TO = 512
# The round's kept K/V written into every layer's cache by one Pallas kernel (`pallas_kernels.commit_rows`) on the
# Pallas path with one device, not one dynamic-update-slice kernel per layer and array (72 at the Qwen3-8B shape,
# ~0.13 ms of a DFlash or DDTree round on the H200, 2026-12-05 traces); the drafter's new context K/V likewise
# (one launch instead of two per drafter layer; added after the timings below, not timed on its own). On: on an H100
# (2026-12-05, two calls, `python tools/with_knobs.py engine:commit_rows_kernel=1 -m ddtree_jax.bench --shape
# qwen3-8b ...` between plain runs) the bf16 8B DFlash round took 7.90-7.96 ms against 7.98-8.05, DDTree B = 15
# 7.86-8.04 against 7.98-8.05, B = 64 8.68 against 8.76 (twice); on the H200, alternating, DFlash 6.14, 6.20
# against 6.34, 6.35, B = 64 6.79, 6.83 against 7.03, 7.05, the demo pair's tree rounds 3.7-5.3% faster.
COMMIT_ROWS_KERNEL = True

# Matmul precision of a decode: "auto" (`engine.resolve_options`: "highest" for a float32 target, "default"
# otherwise), or one of JAX's names, applied to every dot of target and drafter (`at_matmul_precision`).
MATMUL_PRECISIONS = ("auto", "default", "high", "highest")

# Whether XLA's GEMMs may split their reduction over K on a GPU: "auto" (`engine.resolve_options`), "xla" (its
# autotuner decides) or "off" (one split; `engine.compile_program` passes XLA the compiler option).
SPLIT_K_CHOICES = ("auto", "xla", "off")


class Mode(str, enum.Enum):
    AR = "ar"
    DFLASH = "dflash"
    DDTREE = "ddtree"
    MTP = "mtp"

    @property
    def needs_drafter(self) -> bool:
        """A drafter drafts the round: DFlash's for dflash and ddtree, the target's MTP head for mtp."""
        return self is not Mode.AR


@dataclasses.dataclass(frozen=True)
class DecodeOptions:
    """Static choices of one generation call (hashable: part of the compilation key).

    block_size: drafter block (bonus + bs - 1 drafts); 0 takes the drafter's own. MTP: the chain's length,
      mtp_steps + 1 (`engine.resolve_options` sets it).
    budget: DDTree tree nodes besides the root (B); the target verifies B + 1 tokens per round.
    budgets: DDTree with `--budget auto` when not empty: the candidate budgets, ascending, 0 meaning the chain
      (a DFlash round); the one that commits the most tokens per second is chosen (`auto_scope`; `budget.py`),
      and `budget` is unused.
    auto_scope: with `budgets`, how often the budget is chosen: "call" (default), once per `engine.generate` call,
      on the host, which then runs that candidate's fixed program (`budget.CallRecord`: the candidates' measured
      tokens per second, kept on disk); "round", every round on the device (`auto_loop`: the `lax.switch`).
      Not compared (nor hashed): no compiled program depends on it.
    mtp_steps: MTP steps per round (m): the head drafts m tokens and the target verifies m + 1.
    kernels: "auto" (the Pallas kernels on a GPU for 16-bit weights, pure JAX elsewhere;
      $DDTREE_JAX_KERNELS overrides), "jax" or "pallas" (`models.contract.resolve_kernels`);
      `engine.resolve_options` pins "auto" before compiling, so a compiled program is keyed on what it runs.
    matmul_precision: the precision of every matmul and einsum of target and drafter (JAX's
      `default_matmul_precision` while the round's entry points trace): "highest" is full float32 (on a
      GPU, no TF32), "default" lets XLA round float32 inputs to TF32 on a GPU (a CPU stays float32), "high" in
      between; "auto" is pinned by `engine.resolve_options` ("highest" for a float32 target, "default"
      otherwise); left "auto", JAX's own default applies. The Pallas attention multiplies float32 inputs at
      full precision whatever this says.
    split_k: whether XLA's GEMMs may split their reduction over K on a GPU. "xla" leaves it to XLA's autotuner;
      "off" forbids it (a split-K GEMM ends in a separate reduction kernel, which XLA cannot fuse into the
      Pallas kernel after it: three per layer at 65 rows). "auto" is pinned by `engine.resolve_options`: "off"
      for the modes that verify several tokens per call (dflash, ddtree, mtp) on a GPU, "xla" otherwise (at
      one row split-K streams the weights faster). Measured on the H200 at the Qwen3-8B shape, 2026-12-02:
      off took the B = 64 DDTree round from 7.74 to 7.26 ms and DFlash's from 6.37 to 6.31, and the AR step
      from 4.84 to 5.11 (docs/performance.md). Arithmetic changes with it (reduction order), not exactness.
    fp8_matmul: how FP8 projections multiply (`models.contract.Fp8Matmul`): "dequantize" (XLA dequantises the
      weight in float32, casts it and multiplies), "stream" (`pallas_kernels.stream_matmul` reads the FP8
      weight as stored and scales its blocks' partial sums: the Pallas kernel where `kernels` is "pallas", its
      jnp reference otherwise; only on one device and for calls of at most `layers.STREAM_MAX_ROWS` rows,
      `layers.fp8_stream_config`) or "auto" (`models.contract.resolve_fp8_matmul`: "stream" with the Pallas
      kernels on a GPU, where the FP8 projections streamed in a third of XLA's time), pinned by
      `engine.resolve_options`; or "w8a8": streamed as "stream" says, with each token's activations quantised to
      FP8 per group of 128 features (`models.fp8.quantize_rows`, power-of-two scales; inside the kernel where it
      can; the arithmetic transformers and vLLM run the published FP8 checkpoints with on a GPU: FP8 tensor cores,
      other outputs than the dequantised weights'), never chosen by "auto". No effect without FP8 weights.
    row_invariant: every row's arithmetic independent of the call's other rows (`models.contract.Runtime`): the
      weight-streaming matmul for the projections and the lm_head, the row-invariant attention kernel, so that
      greedy speculative output is the AR output bit for bit in bf16 on dense targets without sliding windows
      (issue 20; hybrids: the Gated DeltaNet verify and AR step still compute different arithmetic). The prompt's
      pass (`prefill`) too: each mode compiles its own. Needs the Pallas kernels; slower.
    """

    mode: Mode = Mode.AR
    max_new_tokens: int = 64
    sampling: SamplingConfig = SamplingConfig()
    eos_ids: tuple[int, ...] = ()  # empty: never stop on a token
    block_size: int = 0
    budget: int = 63  # B + 1 = 64 rows: whole tiles of the verify (README, "Picking a budget")
    budgets: tuple[int, ...] = ()
    auto_scope: str = dataclasses.field(default="call", compare=False)  # host-side: not in the compilation key
    mtp_steps: int = 3
    record_trees: bool = False  # keep each round's tree and accepted path in the state (--save-trees)
    parallel: Parallel = Parallel()  # device layout (parallel.py)
    kernels: str = "auto"
    matmul_precision: str = "auto"
    split_k: str = "auto"
    fp8_matmul: str = "auto"
    row_invariant: bool = False

    def __post_init__(self):
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.mode.needs_drafter and self.block_size == 1:
            raise ValueError(f"block_size must be >= 2 for {self.mode.value}, got {self.block_size}")
        if self.mode is Mode.DDTREE and self.budget < 1:
            raise ValueError(f"budget must be >= 1, got {self.budget}")
        if self.budgets:
            if self.mode is not Mode.DDTREE:
                raise ValueError(f"budgets (--budget auto) is a ddtree option, not {self.mode.value}'s")
            if self.budgets != check_candidates(self.budgets):
                raise ValueError(f"budgets must be distinct and ascending, got {self.budgets}")
        if self.auto_scope not in AUTO_SCOPES:
            raise ValueError(f"auto_scope must be one of {', '.join(map(repr, AUTO_SCOPES))}, got {self.auto_scope!r}")
        if self.mode is Mode.MTP and self.mtp_steps < 1:
            raise ValueError(f"mtp_steps must be >= 1, got {self.mtp_steps}")
        if self.mode is Mode.MTP and self.block_size not in (0, self.mtp_steps + 1):
            raise ValueError(f"block_size of an MTP chain is mtp_steps + 1 = {self.mtp_steps + 1}, "
                             f"got {self.block_size}")
        if self.kernels not in KERNEL_CHOICES:
            raise ValueError(f"kernels must be one of {', '.join(map(repr, KERNEL_CHOICES))}, got {self.kernels!r}")
        if self.matmul_precision not in MATMUL_PRECISIONS:
            raise ValueError(f"matmul_precision must be one of {', '.join(map(repr, MATMUL_PRECISIONS))}, "
                             f"got {self.matmul_precision!r}")
        if self.split_k not in SPLIT_K_CHOICES:
            raise ValueError(f"split_k must be one of {', '.join(map(repr, SPLIT_K_CHOICES))}, got {self.split_k!r}")
        if self.fp8_matmul not in FP8_MATMUL_CHOICES:
            raise ValueError(f"fp8_matmul must be one of {', '.join(map(repr, FP8_MATMUL_CHOICES))}, "
                             f"got {self.fp8_matmul!r}")
        if self.row_invariant and resolve_kernels(self.kernels) is not Kernels.PALLAS:
            raise ValueError(f"row_invariant needs the Pallas kernels (kernels='pallas'), got kernels={self.kernels!r}"
                             f" (resolved: {resolve_kernels(self.kernels).value})")

    @property
    def runtime(self) -> Runtime:
        """What the models and the accept stage receive: the kernel implementation, under tp the mesh the
        Pallas attention's `shard_map` splits heads over, and the FP8 and dense matmuls."""
        tp_mesh = self.parallel.mesh if self.parallel.mode == "tp" else None
        kernels = resolve_kernels(self.kernels)
        return Runtime(kernels=kernels, tp_mesh=tp_mesh, fp8_matmul=resolve_fp8_matmul(self.fp8_matmul, kernels),
                       row_invariant=self.row_invariant)

    @property
    def auto_budget(self) -> bool:
        """DDTree choosing its budget among `budgets`: per call (`auto_scope` "call": `engine.generate`) or every
        round (`auto_loop`)."""
        return bool(self.budgets)

    @property
    def auto_per_call(self) -> bool:
        """`--budget auto` choosing once per call, on the host: `engine.generate` runs `candidate(chosen)`."""
        return self.auto_budget and self.auto_scope == "call"

    def candidate(self, budget: int) -> "DecodeOptions":
        """The options of one `--budget auto` candidate's fixed round: a DFlash round for 0 (the chain), else a
        DDTree round of that budget."""
        if budget == CHAIN:
            return dataclasses.replace(self, mode=Mode.DFLASH, budgets=())
        return dataclasses.replace(self, budget=budget, budgets=())

    @property
    def verify_width(self) -> int:
        """Tokens the target verifies per round (the widest call after prefill; auto: the widest candidate)."""
        if self.auto_budget:
            return max(self.candidate(b).verify_width for b in self.budgets)
        return {Mode.AR: 1, Mode.DFLASH: self.block_size, Mode.DDTREE: self.budget + 1,
                Mode.MTP: self.mtp_steps + 1}[self.mode]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DecodeState:
    """Everything the loop carries, all on device.

    Fields:
      cache:          target cache (KVCache; HybridCache for a recurrent family); `lengths` counts the tokens
                      fed to the target.
      draft_cache:    drafter context K/V (same lengths as `cache` between rounds); MTP: the head's
                      MTPCache (K/V of the same lengths, and its output at the last slot); None for AR.
      last_token:     [b] int32, newest emitted token (not yet fed to the target).
      output:         [b, max_new] int32, emitted tokens (prompt excluded); valid up to num_generated.
      num_generated:  [b] int32.
      done:           [b] bool, row emitted EOS or reached max_new.
      round_lengths:  [b, max_new] int32, tokens committed per round (bonus included); 0 = no round.
      num_rounds:     [b] int32, rounds in which the row was still running.
      rng:            PRNG key (sampling).
      step:           [] int32, rounds run (all rows).
      trace:          the last round's tree and accepted path (RoundTrace), when options.record_trees.
      budget:         `--budget auto`'s costs, acceptance correction and chosen budgets (budget.BudgetState).
    """

    cache: kv.KVCache | kv.HybridCache
    draft_cache: kv.KVCache | kv.MTPCache | None
    last_token: jax.Array
    output: jax.Array
    num_generated: jax.Array
    done: jax.Array
    round_lengths: jax.Array
    num_rounds: jax.Array
    rng: jax.Array
    step: jax.Array
    trace: "RoundTrace | None" = None
    budget: BudgetState | None = None

    @classmethod
    def start(cls, cache, draft_cache, last_token: jax.Array, rng: jax.Array, options: DecodeOptions,
              num_generated: jax.Array | None = None) -> "DecodeState":
        """A state around the given caches with nothing emitted yet (or `num_generated` tokens counted)."""
        b = last_token.shape[0]
        return cls(cache=cache, draft_cache=draft_cache, last_token=last_token,
                   output=jnp.zeros((b, options.max_new_tokens), jnp.int32),
                   num_generated=jnp.zeros((b,), jnp.int32) if num_generated is None else num_generated,
                   done=jnp.zeros((b,), bool), round_lengths=jnp.zeros((b, options.max_new_tokens), jnp.int32),
                   num_rounds=jnp.zeros((b,), jnp.int32), rng=rng, step=jnp.zeros((), jnp.int32),
                   trace=RoundTrace.empty(b, options.verify_width, options.block_size)
                   if options.record_trees else None,
                   budget=BudgetState.start(b, options.max_new_tokens, len(options.budgets))
                   if options.auto_budget else None)


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

    def padded(self, nodes: int) -> "RoundTrace":
        """The same trace over `nodes` >= T node slots (the extra ones invalid): one shape for every budget."""
        pad = lambda x: jnp.pad(x, ((0, 0), (0, nodes - x.shape[1])))  # noqa: E731
        return dataclasses.replace(self, tokens=pad(self.tokens), parents=pad(self.parents), depths=pad(self.depths),
                                   valid=pad(self.valid))


def at_matmul_precision(fn):
    """`fn` traced under its `options.matmul_precision` (JAX's `default_matmul_precision`, which each dot
    reads when it is traced): every matmul, einsum and convolution beneath it, target's and drafter's, gets
    that precision without a `precision=` at each call site. Wraps the round's traced entry points (the
    stages, the rounds, `decode_loop`, `prefill`); nested ones set the same value. "auto" (options not
    resolved) leaves JAX's own default in force."""
    signature = inspect.signature(fn)

    @functools.wraps(fn)
    def traced(*args, **kwargs):
        precision = signature.bind(*args, **kwargs).arguments["options"].matmul_precision
        with contextlib.nullcontext() if precision == "auto" else jax.default_matmul_precision(precision):
            return fn(*args, **kwargs)

    return traced


# ----------------------------------------------------------------------------------------------------
# The stages of a speculative round


@at_matmul_precision
def draft(drafter: ModelParams, target: ModelParams, last_token: jax.Array, draft_cache: kv.KVCache | kv.MTPCache,
          options: DecodeOptions) -> jax.Array:
    """The drafter's block [bonus, mask x (bs - 1)] over its cached context: float32 logits [b, bs - 1, v].
    MTP: m chained steps of the target's head after its cache (the bonus is already in it): [b, m, v]."""
    if options.mode is Mode.MTP:
        return mtp.draft_logits(drafter, target, draft_cache, options.mtp_steps, options.runtime)
    b, bs = last_token.shape[0], options.block_size
    block = jnp.concatenate([last_token[:, None], jnp.full((b, bs - 1), drafter.config.mask_token_id, jnp.int32)],
                            axis=1)
    return dflash.draft_logits(drafter, target, block, draft_cache, options.runtime)


@at_matmul_precision
def propose(logits: jax.Array, last_token: jax.Array, options: DecodeOptions) -> DraftTree:
    """The tree to verify, rooted at each row's bonus `last_token` [b]: DDTree's B most probable prefixes
    under the drafter's marginals (T = B + 1 nodes), or the chain of argmaxes (DFlash: T = bs; MTP: m + 1)."""
    if options.mode is Mode.DDTREE:
        # The kernels off tp only: there the drafter's logits are split over the vocabulary and the build runs
        # replicated, where XLA's partitioning of a Triton custom call is not checked on a GPU yet. The kernels
        # only where they were measured faster.
        runtime = options.runtime
        kernels = runtime.pallas and runtime.tp_mesh is None
        return build_tree(jax.nn.log_softmax(logits, axis=-1), last_token, options.budget,
                          top_k="pallas" if kernels and options.budget <= VOCAB_TOP_K_KERNEL_UP_TO else "auto",
                          implementation="pallas" if kernels and options.budget <= TREE_BUILD_KERNEL_UP_TO
                          else "reference")
    drafts = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    return chain_tree(jnp.concatenate([last_token[:, None], drafts], axis=1))


@at_matmul_precision
def verify(target: ModelParams, tree: DraftTree, cache, tap_layers: tuple[int, ...],
           options: DecodeOptions) -> tuple[ForwardOut, jax.Array]:
    """The target over every node of the tree at once: (its ForwardOut, float32 logits [b, T, v]).

    Node i sits at position `cache.lengths + depth_i` and sees the committed cache and its own root path;
    a recurrent family runs each node from its parent's state (a chain too: the same code path)."""
    family = target_family(target.config)
    meta = ForwardMeta.tree(cache.lengths, tree.parents, tree.depths, tree.ancestor)
    out = family.forward(target, tree.tokens, meta, cache, tap_layers=tap_layers, runtime=options.runtime)
    return out, family.logits(target, out.hidden, options.runtime)


@at_matmul_precision
def accept(tree: DraftTree, node_logits: jax.Array, key: jax.Array, options: DecodeOptions) -> Accepted:
    """The target's decoding rule at every node, then the walk to the deepest node whose whole root path
    agrees. Greedy on the Pallas kernels: one fused kernel reads the [b, T, v] logits once for the argmax
    and walks (`pallas_kernels.tree_accept`); under tp the logits are split over the vocabulary, so XLA's
    sharded argmax does that step. Otherwise `sampling.decode_tokens` (argmax, or an independent sample
    per node) and the same walk."""
    runtime, bs = options.runtime, options.block_size
    if runtime.pallas and options.sampling.greedy and runtime.tp_mesh is None:
        return tree_accept(node_logits, tree.tokens, tree.parents, tree.depths, tree.valid, path_len=bs,
                           implementation="pallas")
    return accept_tree(tree, decode_tokens(node_logits, key, options.sampling), bs)


@at_matmul_precision
def commit(drafter: ModelParams, target: ModelParams, out: ForwardOut, acc: Accepted, counts: jax.Array,
           draft_cache: kv.KVCache | kv.MTPCache, options: DecodeOptions):
    """Keep the accepted path (`counts` [b] nodes per row; 0 for rows that are done): returns (target cache,
    drafter cache). The accepted nodes' K/V (`out.pending`) go to slots [start, start + count), a recurrent
    family installs the deepest accepted node's state and conv window, and the accepted nodes' taps become
    the drafter's next context rows. MTP: the head runs over the tokens the round emits, each paired with the
    target's hidden state one position earlier (node i's: the chain's nodes are positions start + i), and keeps
    `counts` of them (`mtp.ingest`; `target` gives the embedding)."""
    hybrid = out.nodes is not None
    target_kv = out.cache.kv if hybrid else out.cache
    one_launch = COMMIT_ROWS_KERNEL and options.runtime.pallas and options.runtime.tp_mesh is None
    if options.mode is Mode.DDTREE:
        target_kv = kv.commit_pending(target_kv, out.pending, counts, acc.path, one_launch=one_launch)
        taps = jnp.take_along_axis(out.taps, acc.path[:, :, None], axis=1)
    else:  # a chain's path is 0, 1, 2, ...: its nodes are in order
        target_kv, taps = kv.commit_pending(target_kv, out.pending, counts, one_launch=one_launch), out.taps
    cache = target_kv
    if hybrid:
        cache = kv.HybridCache(kv=target_kv, recurrent=tuple(kv.commit_recurrent(r, n, acc.path, counts)
                                                             for r, n in zip(out.cache.recurrent, out.nodes)))
    if options.mode is Mode.MTP:
        draft_cache = mtp.ingest(drafter, target, acc.tokens, out.hidden, counts, draft_cache, options.runtime)
    else:
        draft_cache = dflash.ingest_context(drafter, taps, counts, draft_cache, options.runtime, one_launch=one_launch)
    return constrain_cache(cache, options.parallel), constrain_cache(draft_cache, options.parallel)


# The stages in round order; the benchmark and tools/compile_times.py compile and time these objects.
STAGES = {"draft": draft, "tree": propose, "verify": verify, "accept": accept, "commit": commit}


# ----------------------------------------------------------------------------------------------------
# Rounds


@at_matmul_precision
def speculative_round(target: ModelParams, drafter: ModelParams, state: DecodeState,
                      options: DecodeOptions) -> DecodeState:
    """One DFlash, DDTree or MTP round: draft once, verify every drafted token in one target pass, keep the
    longest path on which the target's own decoding rule agrees, plus the target's next token.

    Chain example, bs = 4: bonus x, drafts [d1 d2 d3], decoded post = [p0 p1 p2 p3]; d1 == p0,
    d2 == p1, d3 != p2 gives path [0 1 2], count 3; the cache keeps [x d1 d2], the round emits
    [p0 p1 p2] = [d1 d2 p2], and p2 is the next bonus. At temperature > 0 every node gets an independent
    sample of the target's rule (sample-and-match), so every emitted token is an exact sample given its
    prefix.
    """
    with jax.named_scope("draft"):
        logits = draft(drafter, target, state.last_token, state.draft_cache, options)
    with jax.named_scope("tree"):
        tree = propose(logits, state.last_token, options)
    return verify_round(target, drafter, state, tree, options)


@at_matmul_precision
def verify_round(target: ModelParams, drafter: ModelParams, state: DecodeState, tree: DraftTree,
                 options: DecodeOptions) -> DecodeState:
    """The rest of a speculative round once its tree is drafted: verify, accept, commit, emit."""
    rng, key = jax.random.split(state.rng)
    out, acc = verify_accept(target, drafter, state, tree, key, options)
    return finish_round(target, drafter, state, tree, out, acc, rng, options)


@at_matmul_precision
def verify_accept(target: ModelParams, drafter: ModelParams, state: DecodeState, tree: DraftTree, key: jax.Array,
                  options: DecodeOptions) -> tuple[ForwardOut, Accepted]:
    """The target over the tree and its decoding rule at every node: (the verify's ForwardOut, the accepted
    path). Reads the caches, writes nothing."""
    with jax.named_scope("verify"):
        out, node_logits = verify(target, tree, state.cache, drafter.config.target_layer_ids, options)
    with jax.named_scope("accept"):
        acc = accept(tree, node_logits, key, options)
    return out, acc


@at_matmul_precision
def finish_round(target: ModelParams, drafter: ModelParams, state: DecodeState, tree: DraftTree, out: ForwardOut,
                 acc: Accepted, rng: jax.Array, options: DecodeOptions) -> DecodeState:
    """Commit the accepted path into the caches, emit its tokens, record the round (rows that are done keep
    everything)."""
    running = ~state.done
    start = state.cache.lengths
    counts = jnp.where(running, acc.count, 0)
    with jax.named_scope("commit"):
        cache, draft_cache = commit(drafter, target, out, acc, counts, state.draft_cache, options)
    trace = RoundTrace(start=start, tokens=tree.tokens, parents=tree.parents, depths=tree.depths,
                       valid=tree.valid, path=acc.path, count=counts) if options.record_trees else None
    state = dataclasses.replace(state, cache=cache, draft_cache=draft_cache, rng=rng, trace=trace)
    return _record_round(_emit(state, acc.tokens, counts, options), counts, running)


@at_matmul_precision
def ar_round(target: ModelParams, drafter: None, state: DecodeState, options: DecodeOptions) -> DecodeState:
    """Feed each row's last token to the target and emit the next one (a done row's state stays put)."""
    running = ~state.done
    family = target_family(target.config)
    with jax.named_scope("verify"):
        out = family.forward(target, state.last_token[:, None], ForwardMeta.step(state.cache.lengths, running),
                             state.cache, runtime=options.runtime)
        logits = family.logits(target, out.hidden[:, 0], options.runtime)
    counts = running.astype(jnp.int32)
    cache = constrain_cache(kv.advance(out.cache, counts), options.parallel)
    rng, key = jax.random.split(state.rng)
    token = decode_tokens(logits, key, options.sampling)
    state = dataclasses.replace(state, cache=cache, rng=rng)
    return _record_round(_emit(state, token[:, None], counts, options), counts, running)


@at_matmul_precision
def auto_candidate_round(target: ModelParams, drafter: ModelParams, state: DecodeState, pick: int,
                         options: DecodeOptions, learn: bool = True) -> DecodeState:
    """One `--budget auto` round that verifies candidate `pick` (static; `options.budgets[pick]`): the fixed round
    of `options.candidate(budget)` (the chain takes the argmaxes as DFlash does, no top-k and no tree build; a tree
    builds its own budget's tree), then, with `learn`, what it revealed of every candidate's count is learned
    (`budget.revealed_counts`, `budget.observe`; the chain's rounds in `auto_loop` learn at the end of their run
    instead, `budget.learn_chain_rounds`)."""
    budget = options.budgets[pick]
    sub = options.candidate(budget)
    running = ~state.done
    with jax.named_scope("draft"):
        logits = draft(drafter, target, state.last_token, state.draft_cache, options)
    rng, key = jax.random.split(state.rng)
    with jax.named_scope("tree"):
        tree = propose(logits, state.last_token, sub)
    # The chain's per-depth argmaxes [b, L], against which a tree round reveals the chain's count.
    chain_tokens = tree.tokens[:, 1:] if budget == CHAIN else jnp.argmax(logits, axis=-1).astype(jnp.int32)
    out, acc = verify_accept(target, drafter, state, tree, key, sub)
    if options.record_trees:  # the trace holds the widest candidate's nodes
        tree = pad_nodes(tree, options.verify_width)
    # Committed as a tree's path (the chain's is 0, 1, 2, ...): the chain's own commit, a slice of its nodes
    # written in place, made XLA copy every cache array in each round of this loop (CPU, 2026-12-03); the
    # path's gather does not.
    after = finish_round(target, drafter, state, tree, out, acc, rng, options)
    if not learn:
        return after
    counts = jnp.where(running, acc.count, 0)
    with jax.named_scope("choose"):
        revealed, which = revealed_counts(options.budgets, pick, counts, acc.path, acc.tokens, chain_tokens)
        budget_state = observe(state.budget, pick, revealed, which, running, budget, state.num_rounds)
    return dataclasses.replace(after, budget=budget_state)


@at_matmul_precision
def auto_loop(target: ModelParams, drafter: ModelParams, state: DecodeState, stop_at: jax.Array,
              options: DecodeOptions) -> DecodeState:
    """`--budget auto`'s decode loop: every round verifies the candidate with the most tokens per second
    (`budget.choose`: learned tokens per round over measured cost), in rounds of `auto_candidate_round`.

    The switch between candidates sits outside the rounds: a `lax.switch` on the chosen candidate runs that
    candidate's rounds in a `lax.while_loop` of their own for as long as it stays the choice, each tree round
    choosing for the next one at its end. On a GPU a conditional waits for the host (likely the main part of why
    an auto round cost 0.40 ms against a fixed B = 16 round's 0.33 on the demo pair on the H200, 2026-12-03, with
    a switch in every round); here it runs once per change of candidate. The choice depends on the budget state
    only, not on the round's draft, so the loops carry no draft (carrying the next round's draft logits cost
    copies every round: an auto round ran ~13 more kernels than the DFlash round it ran, four of them copies, on
    the H200, 2026-12-03). The chain's rounds neither learn nor choose one by one: they run until the widest
    candidate's probe is due (`budget.chain_rounds`), then learn from them all (`budget.learn_chain_rounds`) and
    choose, so its loop's body is a DFlash round. That loop runs before the switch, not in a branch of it (the switch's
    branch 0 passes the state on): in a branch, XLA's CPU program copied 16 cache arrays at every entry of a
    candidate's loop (2026-12-03 night: 350 copies in the program against 265). Every round is the fixed round
    of its candidate, so the output is what any fixed budget's is (greedy: AR's)."""
    more = lambda s: (~s.done).any() & (s.step < stop_at)  # noqa: E731

    def chain_run(carry):  # candidate 0 (the chain) while it is the choice: rounds until the probe falls due
        first, pick = carry
        until = first.step + chain_rounds(first.budget)
        s = jax.lax.while_loop(lambda s: (pick == 0) & more(s) & (s.step < until),
                               lambda s: auto_candidate_round(target, drafter, s, 0, options, learn=False), first)
        with jax.named_scope("choose"):  # no rounds (a tree was the choice): the same state, the same choice
            learned = learn_chain_rounds(s.budget, s.round_lengths, first.num_rounds, s.num_rounds,
                                         s.step - first.step)
            return dataclasses.replace(s, budget=learned), choose(learned)

    def rounds_of(pick: int):
        def body(carry):
            s = auto_candidate_round(target, drafter, carry[0], pick, options)
            with jax.named_scope("choose"):
                return s, choose(s.budget)

        return lambda carry: jax.lax.while_loop(lambda c: more(c[0]) & (c[1] == pick), body, carry)

    if options.budgets[0] == CHAIN:  # the chain's loop before the switch, whose branch 0 passes the state on
        branches = [lambda carry: carry] + [rounds_of(i) for i in range(1, len(options.budgets))]

        def step(carry):
            carry = chain_run(carry)
            return jax.lax.switch(carry[1], branches, carry)
    else:
        branches = [rounds_of(i) for i in range(len(options.budgets))]
        step = lambda carry: jax.lax.switch(carry[1], branches, carry)  # noqa: E731
    carry = jax.lax.while_loop(lambda c: more(c[0]), step, (state, choose(state.budget)))
    return carry[0]


def pad_nodes(tree_of_arrays, nodes: int):
    """Every array of a pytree padded along axis 1 (the node axis) to `nodes` entries (zeros, False; a tree's
    ancestor mask along both node axes): an auto round's tree in the trace, which holds the widest candidate's."""
    def pad(x):
        widths = [(0, 0)] * x.ndim
        widths[1] = (0, nodes - x.shape[1])
        if x.ndim == 3 and x.dtype == jnp.bool_ and x.shape[1] == x.shape[2]:  # DraftTree.ancestor [b, T, T]
            widths[2] = widths[1]
        return jnp.pad(x, widths)

    return jax.tree.map(pad, tree_of_arrays)


ROUNDS = {Mode.AR: ar_round, Mode.DFLASH: speculative_round, Mode.DDTREE: speculative_round,
          Mode.MTP: speculative_round}


@at_matmul_precision
def decode_loop(target: ModelParams, drafter: ModelParams | None, state: DecodeState, max_steps: jax.Array,
                options: DecodeOptions) -> DecodeState:
    """Run rounds until every row is done or `max_steps` more rounds have run (all on device); `--budget auto`:
    `auto_loop`."""
    stop_at = state.step + max_steps
    if options.auto_budget:
        return auto_loop(target, drafter, state, stop_at, options)
    round_fn = ROUNDS[options.mode]

    def cond(s: DecodeState):
        return (~s.done).any() & (s.step < stop_at)

    return jax.lax.while_loop(cond, lambda s: round_fn(target, drafter, s, options), state)


@at_matmul_precision
def prefill(target: ModelParams, drafter: ModelParams | None, tokens: jax.Array, prompt_lengths: jax.Array,
            rng: jax.Array, *, capacity: int, options: DecodeOptions) -> DecodeState:
    """Run the prompt (right-padded tokens [b, p], lengths [b]), emit each row's first token, and fill the
    drafter's context cache (MTP: the head runs over the prompt, each position paired with the next token,
    the last with the first emitted one)."""
    b, p = tokens.shape
    dtype = target.array("model.embed_tokens.weight").dtype
    family = target_family(target.config)
    cache = constrain_cache(family.create_cache(target.config, b, capacity, dtype), options.parallel)
    taps = drafter.config.target_layer_ids if drafter is not None else ()
    # The options' runtime, row-invariant when asked: each mode compiles its own prefill (DFlash's returns the taps
    # and fills the drafter's cache), and with XLA's GEMMs the prompt's K/V differed in bits between AR's program
    # and DFlash's and between batch sizes, so greedy DFlash left AR at a near-tie (demo pair, bf16, H200, 2026-12-03).
    out = family.forward(target, tokens, ForwardMeta.prompt(prompt_lengths, p), cache, tap_layers=taps,
                         runtime=options.runtime)
    cache = kv.advance(out.cache, prompt_lengths)
    last_hidden = jnp.take_along_axis(out.hidden, (prompt_lengths - 1)[:, None, None], axis=1)[:, 0]
    rng, key = jax.random.split(rng)
    first = decode_tokens(family.logits(target, last_hidden, options.runtime), key, options.sampling)
    draft_cache = None
    if options.mode is Mode.MTP:
        # Position i pairs with token i + 1: the prompt shifted left by one, the first emitted token last.
        shifted = jnp.roll(tokens, -1, axis=1).at[jnp.arange(b), prompt_lengths - 1].set(first)
        draft_cache = mtp.ingest(drafter, target, shifted, out.hidden, prompt_lengths, constrain_cache(
            mtp.create_cache(drafter.config, b, capacity, dtype), options.parallel), options.runtime)
    elif drafter is not None:
        draft_cache = dflash.ingest_context(drafter, out.taps, prompt_lengths, constrain_cache(
            dflash.create_cache(drafter.config, b, capacity, dtype), options.parallel), options.runtime)
    state = DecodeState.start(cache, draft_cache, first, rng, options)
    return _emit(state, first[:, None], jnp.ones((b,), jnp.int32), options)


# ----------------------------------------------------------------------------------------------------
# Bookkeeping shared by the rounds


def _is_eos(tokens: jax.Array, eos_ids: tuple[int, ...]) -> jax.Array:
    if not eos_ids:
        return jnp.zeros(tokens.shape, bool)
    return jnp.isin(tokens, jnp.asarray(eos_ids, jnp.int32))


def _emit(state: DecodeState, tokens: jax.Array, counts: jax.Array, options: DecodeOptions) -> DecodeState:
    """Append up to `tokens.shape[1]` tokens per row (the first `counts[r]`), stopping rows at EOS or max_new.

    tokens [b, w] int32, counts [b] int32 (0 for rows already done). A row that meets EOS keeps the EOS and
    drops what follows it in the same round. Example: counts [3], tokens [[a EOS c]] -> emits [a EOS], done.
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


def _record_round(state: DecodeState, counts: jax.Array, running: jax.Array) -> DecodeState:
    b = counts.shape[0]
    idx = jnp.where(running, state.num_rounds, state.round_lengths.shape[1])
    round_lengths = state.round_lengths.at[jnp.arange(b), idx].set(counts, mode="drop")
    return dataclasses.replace(state, round_lengths=round_lengths, num_rounds=state.num_rounds + running,
                               step=state.step + 1)


__all__ = ["MATMUL_PRECISIONS", "SPLIT_K_CHOICES", "Mode", "DecodeOptions", "DecodeState", "RoundTrace", "Kernels",
           "at_matmul_precision", "STAGES", "draft", "propose", "verify", "accept", "commit", "speculative_round",
           "verify_round", "verify_accept", "finish_round", "auto_candidate_round", "auto_loop", "pad_nodes",
           "ar_round", "ROUNDS", "decode_loop", "prefill"]
