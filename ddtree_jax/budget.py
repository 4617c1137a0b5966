"""`--budget auto`: every round, the draft-tree size that is expected to commit the most tokens per second.

The round drafts once; then, before any tree is built, each candidate budget (`DecodeOptions.budgets`, 0 = the
chain, i.e. a DFlash round) gets the number of tokens it is expected to commit, and the round verifies the
candidate with the most expected tokens per second of its measured round cost (`choose`): the ordinary
fixed-budget round of that candidate (`round.auto_candidate_round`; the chain takes the argmaxes as DFlash does,
a tree builds its own tree). The loop (`round.auto_loop`) runs each chosen candidate's rounds under a
`lax.switch` that runs once per change of candidate, not every round (on a GPU a conditional waits for the
host). Every round is an exact speculative round, so the choice never changes what is emitted, only how fast;
and a round that verifies the chain costs a DFlash round (no vocabulary top-k, no tree build).

Reach. Under the drafter's marginals a tree node is on the accepted path with the probability of its root path,
exp(score) (`DraftTree.scores`), and siblings exclude each other, so the probability that the path reaches depth
d (its reach) is the sum of exp(score) over the tree's depth-d nodes (`tree_reach`), and the expected committed
tokens are 1 + sum_d reach_d. The chain's reach is the product of the per-depth top-1 probabilities
(`chain_reach`: a max and a logsumexp over the vocabulary).

Predicting a tree's reach without building it. The widest tree costs a vocabulary top-k and a build, which
is what a chain round should not pay, so a tree's reach is predicted from the chain's (`predicted_reach`):
chain_d + share_d x (1 - chain_d), where share_d is the part of what the chain leaves at depth d that this
candidate's tree adds, learned from the rounds that built it (moving averages of tree - chain and of
1 - chain, whose ratio is `BudgetState.share`; on the demo pair B = 16's share falls with depth, from about
0.6 at depth 1 to 0 past depth 7). Before a tree candidate has run its share is 1 (untried, it looks good and
gets tried), and every round it is not verified its share moves 1 - FORGET of the way back to 1, so a tree that
stopped being chosen is tried again (exploration; the chain's prediction needs none). The prediction is not the
built tree's exact reach, so a round may choose differently than a rule that builds the widest tree first
(the rule before 2026-12-02); replayed on that rule's recorded demo-pair rounds it chose the same candidate in
88% of them, at 0.6% fewer expected tokens per second by that rule's own measure. The alternative kept exact
choices: an upper bound on each tree's expected tokens from the per-depth top-3 probabilities, building only
when some tree might win; it could skip the build in only 72% of the rounds the chain won, and it costs a top-k
pass and a sort in every round, more than it saves where trees mostly win (the CPU).

Correction. Drafters are over- or under-confident, so the reach the target actually grants is tracked
against the drafter's reach of what ran (the tree's `tree_reach` after its build, the chain's): per candidate
and depth, moving averages of the observed indicator (committed count - 1 >= d) and of the drafter's reach, over
the running rows of each round; their ratio (with a pseudo-count `PRIOR`) scales that candidate's predicted
reach before the next choice. A candidate keeps its own factor because how far the drafter's confidence carries
depends on the tree (the chain's top-1 products are not a wide tree's sums), and one that has not run keeps the
drafter's own prediction. All of it lives in the decode state (`BudgetState`) and updates on device.

Costs. Seconds per round of each candidate come from a short calibration on the actual model, device and
batch (`engine.calibrate`: a few rounds of the compiled decode loop with the choice forced to one
candidate, after every candidate has run untimed for a quarter second, the candidates taking turns), cached
on disk (`cost_cache_path`, keyed by `cost_key`). They reach the compiled loop in the state
(`BudgetState.costs`), an array argument, so a new calibration never recompiles. So does the cost of a change
of candidate (`BudgetState.change_cost`: leaving one candidate's loop and entering another's, where on a GPU each
conditional waits for the host), which `choose` charges to every candidate but the last round's: the rule
changes candidate only when the change pays for itself.

Worked example (one row, chain and B = 4, depths 1..3): chain top-1 probabilities [0.5 0.5 0.5] give reach
[0.5 0.25 0.125] and 1.875 expected tokens; B = 4's share learned as [0.6 0.2 0] predicts reach
[0.5 + 0.6 x 0.5, 0.25 + 0.2 x 0.75, 0.125] = [0.8 0.4 0.125] and 2.325 tokens. At costs [1.0, 1.3] ms: 1.875
vs 1.79 tokens per ms, so the chain runs; at [1.0, 1.2] ms the tree (1.94 per ms).

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
# the Qwen3-8B shape and ran slower on the demo pair.
DEFAULT_CANDIDATES = (CHAIN, 16)
DECAY = 0.9  # per round, of the observed / predicted reach averages (about 10 rounds of memory)
PRIOR = 0.05  # pseudo-count of both correction averages: the correction starts at 1 and moves once data arrives
FORGET = 0.995  # per round not verified, a candidate's share keeps this much of its distance from 1 (exploration)
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
    expected: [N, L] float32 per candidate, moving average of the drafter's reach of what those rounds verified
              (its tree's `tree_reach`; the chain's `chain_reach`).
    gain:     [N, L] float32 per candidate, moving average of its tree's reach less the chain's, over the same
              rounds (0 for the chain).
    room:     [N, L] float32 per candidate, moving average of what the chain's reach left, 1 - chain reach.
    chosen:   [b, max_new] int32 the budget each round of a row verified (0 the chain), as
              `DecodeState.round_lengths`.
    change_cost: [] float32 seconds a round costs beyond its candidate's `costs` when the round before it
              verified another candidate (the loop leaves one candidate's rounds and enters another's:
              `round.auto_loop`); set by the host with `costs`.
    last:     [] int32 the candidate the last round verified (-1 before any round: no change is charged).
    """

    costs: jax.Array
    seen: jax.Array
    expected: jax.Array
    gain: jax.Array
    room: jax.Array
    chosen: jax.Array
    change_cost: jax.Array
    last: jax.Array

    @classmethod
    def start(cls, batch: int, max_new: int, candidates: int, depths: int) -> "BudgetState":
        zeros = lambda: jnp.zeros((candidates, depths), jnp.float32)  # noqa: E731
        return cls(costs=jnp.ones((candidates,), jnp.float32), seen=zeros(), expected=zeros(), gain=zeros(),
                   room=zeros(), chosen=jnp.zeros((batch, max_new), jnp.int32),
                   change_cost=jnp.zeros((), jnp.float32), last=jnp.full((), -1, jnp.int32))

    @property
    def correction(self) -> jax.Array:
        """[N, L] observed over predicted reach, per candidate and depth (1 before the candidate runs)."""
        return (self.seen + PRIOR) / (self.expected + PRIOR)

    @property
    def share(self) -> jax.Array:
        """[N, L] the part of what the chain's reach leaves (1 - chain reach) that each candidate's tree adds,
        per depth: gain / room (within [-1, 1]); 1, all of it, before the candidate has run (an untried tree
        looks good, so it gets tried). Both averages start at 0 and move together, so their ratio carries no
        start-up bias."""
        ratio = self.gain / jnp.where(self.room > 0, self.room, 1.0)
        return jnp.where(self.room > 0, jnp.clip(ratio, -1.0, 1.0), 1.0)  # clipped: a near-0 room is noise


def tree_reach(tree: DraftTree, depths: int) -> jax.Array:
    """[b, L] the drafter's reach by depth of a tree: the sum of exp(score) over its nodes at each depth.

    Example: scores [0, ln .5, ln .3, ln .25] at depths [0 1 1 2]: reach [.8 .25]."""
    prob = jnp.where(tree.valid, jnp.exp(tree.scores), 0.0)  # [b, T]
    at_depth = tree.depths[:, :, None] == jnp.arange(1, depths + 1)[None, None, :]  # the root (depth 0) nowhere
    return jnp.sum(prob[:, :, None] * at_depth, axis=1)


def chain_reach(logits: jax.Array) -> jax.Array:
    """[b, L] reach by depth of the chain of per-depth argmaxes: the product of the top-1 probabilities down
    to each depth (logits or log-probabilities [b, L, v] float32: a max and a logsumexp per depth)."""
    top1 = jnp.max(logits, axis=-1) - jax.nn.logsumexp(logits, axis=-1)
    return jnp.exp(jnp.cumsum(top1, axis=-1))


def predicted_reach(chain: jax.Array, budgets: tuple[int, ...], budget_state: BudgetState) -> jax.Array:
    """[b, N, L] each candidate's reach by depth as the drafter would predict it, from the chain's reach
    (chain [b, L]) alone: the chain's own, and for a tree chain + share x (1 - chain) (`BudgetState.share`,
    learned from the trees that ran), within [0, 1]. No tree is built for it."""
    is_tree = jnp.asarray([b != CHAIN for b in budgets])[None, :, None]
    tree = jnp.clip(chain[:, None, :] + budget_state.share[None] * (1.0 - chain[:, None, :]), 0.0, 1.0)
    return jnp.where(is_tree, tree, chain[:, None, :])


def choose(reach: jax.Array, running: jax.Array, budget_state: BudgetState) -> jax.Array:
    """The candidate index [] int32 with the most expected tokens per second over the batch's running rows.

    reach [b, N, L] predicted (`predicted_reach`), corrected per candidate and depth (capped at 1); a row expects
    1 + sum_d reach_d tokens. A candidate other than the last round's is charged `change_cost` on top of its
    round's cost: choosing afresh every round changed candidate in 399 of 894 rounds on the H200's demo pair,
    whose decode then took ~0.37 ms per change beyond its calibrated 0.20-0.30 ms rounds (auto at 0.80x the
    best fixed budget, 2026-12-03). One choice for the batch: a `lax.switch` on a batched index would run every
    branch."""
    corrected = jnp.minimum(reach * budget_state.correction[None], 1.0)
    tokens = 1.0 + corrected.sum(-1)  # [b, N]
    candidates = jnp.arange(budget_state.costs.shape[0])
    change = (candidates != budget_state.last) & (budget_state.last >= 0)
    seconds = budget_state.costs + jnp.where(change, budget_state.change_cost, 0.0)
    per_second = jnp.sum(jnp.where(running[:, None], tokens, 0.0), axis=0) / seconds
    return jnp.argmax(per_second).astype(jnp.int32)


def observe(budget_state: BudgetState, pick: jax.Array, reach: jax.Array, chain: jax.Array, counts: jax.Array,
            running: jax.Array, budget: jax.Array, num_rounds: jax.Array) -> BudgetState:
    """After a round that verified candidate `pick` [] (its budget `budget` []): fold the running rows' observed
    reach (counts [b] committed tokens, root included), the drafter's reach of what was verified (reach [b, L])
    and the chain's (chain [b, L]) into that candidate's averages; every other candidate's share moves
    1 - FORGET of the way back to 1 (so a tree that stopped being chosen is tried again); record `budget` at each
    running row's round index `num_rounds` [b], and `pick` as the last candidate. A round in which no row runs
    changes nothing."""
    depths = reach.shape[-1]
    n = jnp.maximum(running.sum(), 1).astype(jnp.float32)
    mean = lambda x: jnp.where(running[:, None], x, 0.0).sum(0) / n  # noqa: E731  [b, L] -> [L], running rows
    got = (counts[:, None] - 1 >= jnp.arange(1, depths + 1)[None, :]).astype(jnp.float32)
    candidates = jnp.arange(budget_state.seen.shape[0])[:, None]
    ran = (candidates == pick) & running.any()  # [N, 1]
    idle = (candidates != pick) & running.any()
    blend = lambda old, new: jnp.where(ran, DECAY * old + (1 - DECAY) * new[None], old)  # noqa: E731
    room = blend(budget_state.room, mean(1.0 - chain))
    gain = blend(budget_state.gain, mean(reach - chain))
    gain = jnp.where(idle, gain + (1 - FORGET) * (room - gain), gain)
    b, max_new = budget_state.chosen.shape
    idx = jnp.where(running, num_rounds, max_new)
    return dataclasses.replace(budget_state, seen=blend(budget_state.seen, mean(got)),
                               expected=blend(budget_state.expected, mean(reach)), gain=gain, room=room,
                               chosen=budget_state.chosen.at[jnp.arange(b), idx].set(budget, mode="drop"),
                               last=jnp.where(running.any(), pick.astype(jnp.int32), budget_state.last))


# ----------------------------------------------------------------------------------------------------
# The cost cache (host side)


CALIBRATION_VERSION = 3  # 2: a warm-up, then the candidates interleaved; 3: and the cost of a change (2026-12-03)


def cost_key(target_config, drafter_config, options, batch: int, capacity: int, dtype) -> dict:
    """What a round's cost depends on: the models' shapes (their configs), the device, the dtype, the batch,
    the context (the cache capacity, rounded up to a power of two), the candidates and the options that change
    the compiled round (block size, kernels, matmul precision, split-K, FP8 matmul, greedy or sampled acceptance,
    layout), and the calibration's own version (costs measured by an older schedule are measured again)."""
    device = jax.devices()[0]
    context = 1 << max(7, (capacity - 1).bit_length())
    return {"target": _digest(repr(target_config)), "drafter": _digest(repr(drafter_config)),
            "device": f"{device.platform}:{device.device_kind}", "devices": options.parallel.size,
            "parallel": options.parallel.mode, "dtype": jnp.dtype(dtype).name, "batch": batch, "context": context,
            "budgets": list(options.budgets), "block_size": options.block_size, "kernels": options.kernels,
            "matmul_precision": options.matmul_precision, "split_k": options.split_k,
            "fp8_matmul": options.fp8_matmul, "row_invariant": options.row_invariant, "greedy": options.sampling.greedy,
            "jax": jax.__version__, "calibration": CALIBRATION_VERSION}


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def cost_cache_dir() -> Path:
    """$DDTREE_JAX_ROUND_COSTS, else ddtree_jax/round_costs under $XDG_CACHE_HOME or ~/.cache."""
    if os.environ.get(COST_CACHE_ENV):
        return Path(os.environ[COST_CACHE_ENV])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "ddtree_jax" / "round_costs"


def cost_cache_path(key: dict) -> Path:
    return cost_cache_dir() / f"{_digest(json.dumps(key, sort_keys=True))}.json"


def load_costs(key: dict) -> tuple[list[float], float] | None:
    """The cached (seconds per round of `key`'s candidates, seconds per change of candidate), or None (absent,
    unreadable or for another key)."""
    try:
        entry = json.loads(cost_cache_path(key).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(entry, dict) or entry.get("key") != key:
        return None
    seconds, change = entry.get("seconds"), entry.get("change_seconds")
    if not isinstance(seconds, list) or len(seconds) != len(key["budgets"]) or not all(
            isinstance(s, (int, float)) and s > 0 for s in seconds):
        return None
    if not isinstance(change, (int, float)) or change < 0:
        return None
    return [float(s) for s in seconds], float(change)


def save_costs(key: dict, seconds, change_seconds: float) -> Path | None:
    """Write the entry (seconds per round of each candidate, seconds per change of candidate) atomically (a
    temporary file, then a rename); None (and nothing written) when the cache folder cannot be written: the
    costs then hold for this process only."""
    from ddtree_jax.cli import atomic_path

    path = cost_cache_path(key)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with atomic_path(path) as tmp:
            tmp.write_text(json.dumps({"key": key, "seconds": [float(s) for s in seconds],
                                       "change_seconds": float(change_seconds),
                                       "date": time.strftime("%Y-%m-%d %H:%M:%S")}, indent=1) + "\n")
    except OSError:
        return None
    return path


__all__ = ["CHAIN", "DEFAULT_CANDIDATES", "candidates_text", "BudgetState", "parse_candidates", "check_candidates",
           "tree_reach", "chain_reach", "predicted_reach", "choose", "observe", "cost_key", "cost_cache_dir",
           "cost_cache_path", "load_costs", "save_costs"]
