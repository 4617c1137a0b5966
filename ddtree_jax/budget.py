"""`--budget auto`: every round, the draft-tree size that is expected to commit the most tokens per second.

The round drafts once; then, before anything is verified, each candidate budget (`DecodeOptions.budgets`, 0 =
the chain, i.e. a DFlash round) gets the number of tokens it is expected to commit, and the round verifies
the candidate with the most expected tokens per second of its measured round cost (`choose`), through a
`lax.switch` whose branches are the ordinary fixed-budget rounds (`round.auto_round`). Every branch is an
exact speculative round, so the choice never changes what is emitted, only how fast.

Expected tokens. Under the drafter's marginals a tree node is on the accepted path with the probability of
its root path, exp(score) (`DraftTree.scores`), and siblings exclude each other, so the probability that the
path reaches depth d is the sum of exp(score) over the tree's depth-d nodes, and the expected committed
tokens are 1 + sum_d reach_d. `build_tree` emits nodes best first in one total order that does not depend on
the budget, so the tree of budget B' < B is the first B' + 1 nodes of the tree of budget B
(`tree.first_nodes`): one build of the widest tree gives every tree candidate's reach by a cumulative sum
over its nodes. The chain's reach is the product of the per-depth top-1 probabilities.

Correction. Drafters are over- or under-confident, so the reach the target actually grants is tracked
against the reach predicted for the tree that ran: per candidate and depth, exponential moving averages of the
observed indicator (committed count - 1 >= d) and of the predicted reach, over the running rows of each round;
their ratio (with a pseudo-count `PRIOR`) scales that candidate's predicted reach before the next choice. A
candidate keeps its own factor because how far the drafter's confidence carries depends on the tree (the
chain's top-1 products are not a wide tree's sums), and one that has not run keeps the drafter's own
prediction: a disappointing choice lets the others be tried (with one shared factor, a CPU run stayed on a
budget of 4 whose correction had dragged every candidate down). All of
it lives in the decode state (`BudgetState`) and updates on device.

Costs. Seconds per round of each candidate come from a short calibration on the actual model, device and
batch (`engine.calibrate_round_costs`: a few rounds of the compiled decode loop with the choice forced to
one candidate), cached on disk (`cost_cache_path`, keyed by `cost_key`). They reach the compiled loop in the
state (`BudgetState.costs`), an array argument, so a new calibration never recompiles.

Worked example (one row, chain and B = 4, depths 1..3): chain top-1 probabilities [0.5 0.5 0.5] give reach
[0.5 0.25 0.125] and 1.875 expected tokens; the B = 4 tree with nodes (depth, p) = (1, .5) (1, .3) (2, .25)
(2, .15) gives reach [0.8 0.4 0] and 2.2 tokens. At costs [1.0, 1.2] ms: 1.875 vs 1.83 tokens per ms, so the
chain runs; at [1.0, 1.1] ms the tree (2.0 per ms).

Letters: b rows, N candidate budgets, L draft depths (block size - 1), T nodes of the widest tree.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import time
from pathlib import Path

import jax
import jax.numpy as jnp

from ddtree_jax.tree import DraftTree

CHAIN = 0  # the candidate budget that means a DFlash round (the chain of per-depth argmaxes)
# The chain and B = 16: on the H200 (docs/performance.md, 2026-12-02) B = 64 projected only 2% above B = 16 at
# the Qwen3-8B shape and ran slower on the demo pair, and a wider candidate makes every round build its tree.
DEFAULT_CANDIDATES = (CHAIN, 16)
DECAY = 0.9  # per round, of the observed / predicted reach averages (about 10 rounds of memory)
PRIOR = 0.05  # pseudo-count of both averages: the correction starts at 1 and moves once data arrives
COST_CACHE_ENV = "DDTREE_JAX_ROUND_COSTS"  # a folder that overrides the cost cache's default place


def candidates_text(candidates: tuple[int, ...]) -> str:
    """(0, 16) -> 'chain,16': the flag's spelling of a candidate tuple."""
    return ",".join("chain" if b == CHAIN else str(b) for b in candidates)


def parse_candidates(text: str) -> tuple[int, ...]:
    """'chain,16,64' (or '0,16,64') -> (0, 16, 64): distinct, ascending; ValueError saying what was expected."""
    try:
        values = [CHAIN if v.strip() == "chain" else int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"expected a comma list of budgets >= 1 and 'chain' (or 0), got {text!r}") from None
    return check_candidates(values)


def check_candidates(values) -> tuple[int, ...]:
    values = tuple(sorted(set(int(v) for v in values)))
    if len(values) < 2 or values[0] < 0:
        raise ValueError(f"expected at least two distinct budgets >= 1 or 0 (the chain), got "
                         f"{','.join(map(str, values)) or 'none'}")
    return values


# ----------------------------------------------------------------------------------------------------
# Device side


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class BudgetState:
    """What `--budget auto` carries through the decode loop (device).

    costs:    [N] float32 seconds per round of each candidate (`DecodeOptions.budgets` order); set by the host
              (`engine.generate`) before the loop: an argument, not part of the compiled program.
    seen:     [N, L] float32 per candidate, moving average of the observed reach (the accepted path got to
              depth d + 1) over the rounds that verified it.
    expected: [N, L] float32 per candidate, moving average of the reach predicted for those rounds.
    chosen:   [b, max_new] int32 the budget each round of a row verified (0 the chain), as
              `DecodeState.round_lengths`.
    """

    costs: jax.Array
    seen: jax.Array
    expected: jax.Array
    chosen: jax.Array

    @classmethod
    def start(cls, batch: int, max_new: int, candidates: int, depths: int) -> "BudgetState":
        return cls(costs=jnp.ones((candidates,), jnp.float32), seen=jnp.zeros((candidates, depths), jnp.float32),
                   expected=jnp.zeros((candidates, depths), jnp.float32), chosen=jnp.zeros((batch, max_new), jnp.int32))

    @property
    def correction(self) -> jax.Array:
        """[N, L] observed over predicted reach, per candidate and depth (1 before the candidate runs)."""
        return (self.seen + PRIOR) / (self.expected + PRIOR)


def tree_reach(tree: DraftTree, budgets: tuple[int, ...], depths: int) -> jax.Array:
    """[b, len(budgets), L] reach by depth of the trees of each budget, all prefixes of `tree` (nodes in
    best-first order: budget B's tree is the first B + 1 nodes, `tree.first_nodes`).

    Example: scores [0, ln .5, ln .3, ln .25] at depths [0 1 1 2] and budgets (1, 3): reach [[.5 0], [.8 .25]]."""
    prob = jnp.where(tree.valid, jnp.exp(tree.scores), 0.0)  # [b, T]
    at_depth = (tree.depths[:, :, None] == jnp.arange(1, depths + 1)[None, None, :]) & (tree.depths[:, :, None] > 0)
    running = jnp.cumsum(prob[:, :, None] * at_depth, axis=1)  # [b, T, L]: reach of the first n + 1 nodes
    return running[:, jnp.asarray(budgets), :]


def chain_reach(log_probs: jax.Array) -> jax.Array:
    """[b, L] reach by depth of the chain of per-depth argmaxes: the product of the top-1 probabilities down
    to each depth (log_probs [b, L, v] float32)."""
    return jnp.exp(jnp.cumsum(jnp.max(log_probs, axis=-1), axis=-1))


def choose(reach: jax.Array, running: jax.Array, budget_state: BudgetState) -> jax.Array:
    """The candidate index [] int32 with the most expected tokens per second over the batch's running rows.

    reach [b, N, L] predicted by the drafter, corrected per candidate and depth (capped at 1); a row expects
    1 + sum_d reach_d tokens. One choice for the batch: a `lax.switch` on a batched index would run every
    branch."""
    corrected = jnp.minimum(reach * budget_state.correction[None], 1.0)
    tokens = 1.0 + corrected.sum(-1)  # [b, N]
    per_second = jnp.sum(jnp.where(running[:, None], tokens, 0.0), axis=0) / budget_state.costs
    return jnp.argmax(per_second).astype(jnp.int32)


def observe(budget_state: BudgetState, pick: jax.Array, predicted: jax.Array, counts: jax.Array, running: jax.Array,
            budget: jax.Array, num_rounds: jax.Array) -> BudgetState:
    """After a round that verified candidate `pick` [] (its budget `budget` []): fold the running rows' observed
    reach (counts [b] committed tokens, root included) and the reach predicted for its tree (predicted [b, L])
    into that candidate's averages, and record `budget` at each running row's round index `num_rounds` [b]."""
    depths = predicted.shape[-1]
    n = jnp.maximum(running.sum(), 1).astype(jnp.float32)
    got = (counts[:, None] - 1 >= jnp.arange(1, depths + 1)[None, :]) & running[:, None]
    seen_now = got.sum(0) / n
    expected_now = jnp.where(running[:, None], predicted, 0.0).sum(0) / n
    any_running = running.any()
    blend = lambda old, new: jnp.where(any_running, DECAY * old + (1 - DECAY) * new, old)  # noqa: E731
    b, max_new = budget_state.chosen.shape
    idx = jnp.where(running, num_rounds, max_new)
    chosen = budget_state.chosen.at[jnp.arange(b), idx].set(budget, mode="drop")
    seen = budget_state.seen.at[pick].set(blend(budget_state.seen[pick], seen_now))
    expected = budget_state.expected.at[pick].set(blend(budget_state.expected[pick], expected_now))
    return dataclasses.replace(budget_state, seen=seen, expected=expected, chosen=chosen)


# ----------------------------------------------------------------------------------------------------
# The cost cache (host side)


def cost_key(target_config, drafter_config, options, batch: int, capacity: int, dtype) -> dict:
    """What a round's cost depends on: the models' shapes (their configs), the device, the dtype, the batch,
    the context (the cache capacity, rounded up to a power of two), the candidates and the options that change
    the compiled round (block size, kernels, matmul precision, split-K, greedy or sampled acceptance, layout)."""
    device = jax.devices()[0]
    context = 1 << max(7, (capacity - 1).bit_length())
    return {"target": _digest(repr(target_config)), "drafter": _digest(repr(drafter_config)),
            "device": f"{device.platform}:{device.device_kind}", "devices": options.parallel.size,
            "parallel": options.parallel.mode, "dtype": jnp.dtype(dtype).name, "batch": batch, "context": context,
            "budgets": list(options.budgets), "block_size": options.block_size, "kernels": options.kernels,
            "matmul_precision": options.matmul_precision, "split_k": options.split_k, "greedy": options.sampling.greedy,
            "jax": jax.__version__}


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def cost_cache_dir() -> Path:
    """$DDTREE_JAX_ROUND_COSTS, else ddtree_jax/round_costs under $XDG_CACHE_HOME or ~/.cache."""
    if os.environ.get(COST_CACHE_ENV):
        return Path(os.environ[COST_CACHE_ENV])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "ddtree_jax" / "round_costs"


def cost_cache_path(key: dict) -> Path:
    return cost_cache_dir() / f"{_digest(json.dumps(key, sort_keys=True))}.json"


def load_costs(key: dict) -> list[float] | None:
    """The cached seconds per round of `key`'s candidates, or None (absent, unreadable or for another key)."""
    try:
        entry = json.loads(cost_cache_path(key).read_text())
    except (OSError, ValueError):
        return None
    seconds = entry.get("seconds") if isinstance(entry, dict) and entry.get("key") == key else None
    if not isinstance(seconds, list) or len(seconds) != len(key["budgets"]) or not all(
            isinstance(s, (int, float)) and s > 0 for s in seconds):
        return None
    return [float(s) for s in seconds]


def save_costs(key: dict, seconds) -> Path | None:
    """Write the entry atomically (a temporary file, then a rename); None (and nothing written) when the
    cache folder cannot be written: the costs then hold for this process only."""
    from ddtree_jax.cli import atomic_path

    path = cost_cache_path(key)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with atomic_path(path) as tmp:
            tmp.write_text(json.dumps({"key": key, "seconds": [float(s) for s in seconds],
                                       "date": time.strftime("%Y-%m-%d %H:%M:%S")}, indent=1) + "\n")
    except OSError:
        return None
    return path


__all__ = ["CHAIN", "DEFAULT_CANDIDATES", "candidates_text", "BudgetState", "parse_candidates", "check_candidates",
           "tree_reach", "chain_reach", "choose", "observe", "cost_key", "cost_cache_dir", "cost_cache_path",
           "load_costs", "save_costs"]
