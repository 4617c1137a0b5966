"""`--budget auto`: the draft-tree size that commits the most tokens per second, learned from what the target grants.

Two scopes (`DecodeOptions.auto_scope`). Per call (the default; the last part of this module, host side): each
`engine.generate` call runs one candidate's fixed program, the one with the best measured tokens per second in a
record of every candidate's runs on the same prompts (`CallRecord`, `decide_call`: the first calls calibrate),
kept on disk. Per round (below, device side): every round chooses, inside the compiled loop.

The candidates (`DecodeOptions.budgets`, 0 = the chain, i.e. a DFlash round) each have a measured cost per round
(calibrated on the actual model, device and batch; below) and a committed-tokens-per-round that the decode learns
as it goes. Every round verifies the candidate with the most tokens per second, tokens / cost (`choose`), as the
ordinary fixed-budget round of that candidate (`round.auto_candidate_round`); a `lax.switch` runs once per change
of candidate (`round.auto_loop`); a run of chain rounds learns and chooses at its end (`chain_rounds`). Every
round is an exact speculative round, so the choice never changes what is emitted, only how fast.

What a round teaches (`observe`). A round that verified a tree of budget B also tells, exactly, what every
smaller candidate would have committed from the same state (greedy; with sampling, an estimate): the trees are
nested (a budget-b tree is the first b + 1 nodes of the budget-B tree, `tree.build_tree`'s best-first order, which
also numbers every node after its parent), so a smaller tree's walk is the accepted path's nodes numbered <= b;
and the chain follows the target's tokens along the accepted path for as long as its per-depth argmaxes match
them (where the chain would go past the last known token, the count is a lower bound). So every round reveals
the first candidate's count, and each candidate's tokens per round are estimated as the first candidate's
average plus the candidate's average gain over it, paired in the rounds that revealed both (exponentially
weighted, DECAY per round): a gain varies about a third as much as a count does (demo pair, 2026-12-03: standard
deviations 1.2-1.3 against 3.6-4.0 tokens), so a few rounds of the widest candidate judge the trees. A round that
runs the widest candidate reveals every count: the first round of a decode that has learned nothing runs it,
and so does a round after as many rounds without it as it has run (row-rounds; at least as many as keep the
probes' extra time within PROBE_SHARE, at least PROBE_MIN and at most PROBE_MAX), so the estimates of the trees
firm up while a narrower candidate wins. What was learned carries from one `generate` call to the next
(`GenerationResult.auto_learned`, `generate(auto_learned=...)`): the bench and `generate --prompts` pass it on.

Why averages, not a per-round prediction. The rule before 2026-12-03 predicted each round's tokens from the
drafter's confidence (the chain's reach, a learned share of it per tree, a correction per depth). Along auto's
own rounds on the demo pair (`tools/auto_counterfactual.py`: every candidate run from the same states, 751 rounds,
the H200's costs), the predicted gain of a tree over the chain correlated 0.06-0.12 with the gain the target
granted; even the drafter's exact reach of every built tree (0.26-0.31) gave a per-round rule 0.6% above the
best candidate's average. Acting on the weak signal cost more than it won: that rule reached 0.964x the best
fixed candidate on its own rounds (and 0.90x on the H200, 2026-12-03); docs/performance.md has this rule's.

Costs. Seconds per round of each candidate come from a short calibration (`engine.calibrate`: a few rounds of the
compiled decode loop with the choice forced to one candidate, after every candidate has run untimed for a
quarter second, the candidates taking turns), cached on disk (`cost_cache_path`, keyed by `cost_key`). They reach
the compiled loop in the state (`BudgetState.costs`), an array argument, so a new calibration never recompiles.
So does the cost of a change of candidate (`BudgetState.change_cost`: leaving one candidate's loop and entering
another's), which `choose` spreads over CHANGE_ROUNDS rounds for every candidate but the last round's: charged in
full to one round, it kept replays on a worse candidate for hundreds of rounds.

Worked example (chain and B = 4): the chain commits 1.875 tokens per round on average, B = 4 2.3. At costs
[1.0, 1.3] ms: 1.875 against 1.77 tokens per ms, so the chain runs; at [1.0, 1.2] ms B = 4 (1.92 per ms).

Letters: b rows, N candidate budgets, P = block size (the longest accepted path, root included).
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
import numpy as np

CHAIN = 0  # the candidate budget that means a DFlash round (the chain of per-depth argmaxes)
# The chain and B = 15, 31, 63: trees of 16, 32 and 64 rows with their root, whole tiles of the verify (H200,
# 2026-12-04 evening: at the Qwen3.6-27B shape B = 15's round cost 1.00x DFlash's and B = 63's 1.09-1.13x against
# B = 64's 1.19-1.20x; at the Qwen3-8B shape and on the demo pair, with its tau, no dearer than 16 and 64). B = 31
# since 2026-12-05: the demo pair's best budget on the H200 in every run of 2026-12-04, which the choice cannot
# reach without it (a choice kept per call gives 0.93-0.95x the best fixed budget over (chain, 15, 63), 1.000x
# over these four; docs/performance.md); a candidate costs the per-call choice one call to try it.
DEFAULT_CANDIDATES = (CHAIN, 15, 31, 63)
# How often `--budget auto` chooses (`DecodeOptions.auto_scope`): once per `generate` call among the candidates'
# fixed programs (`CallRecord`), or every round on the device (`BudgetState`, `round.auto_loop`).
AUTO_SCOPES = ("call", "round")
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

    costs:        [N] float32 seconds per round of each candidate (`DecodeOptions.budgets` order); set by the host
                  (`engine.generate`) before the loop: an argument, not part of the compiled program.
    change_cost:  [] float32 seconds a round costs beyond its candidate's `costs` when the round before it verified
                  another candidate; set by the host with `costs`.
    tokens:       [N] float32 exponentially weighted (DECAY per round) sums over the running rows of the rounds
                  that revealed each candidate's count: the first candidate's count, every other one's gain over it
                  (its count less the first candidate's in the same round).
    rows:         [N] float32 those rows, weighted alike: the first candidate's tokens per row-round are
                  tokens[0] / rows[0], another's that plus tokens[c] / rows[c] (`per_round`).
    since_widest: [] int32 rounds since the widest candidate ran.
    last:         [] int32 the candidate the last round verified (-1 before any round: no change is charged).
    chosen:       [b, max_new] int32 the budget each round of a row verified (0 the chain), as
                  `DecodeState.round_lengths`.
    """

    costs: jax.Array
    change_cost: jax.Array
    tokens: jax.Array
    rows: jax.Array
    since_widest: jax.Array
    last: jax.Array
    chosen: jax.Array

    @classmethod
    def start(cls, batch: int, max_new: int, candidates: int) -> "BudgetState":
        zeros = jnp.zeros((candidates,), jnp.float32)
        return cls(costs=jnp.ones((candidates,), jnp.float32), change_cost=jnp.zeros((), jnp.float32),
                   tokens=zeros, rows=zeros, since_widest=jnp.zeros((), jnp.int32),
                   last=jnp.full((), -1, jnp.int32), chosen=jnp.zeros((batch, max_new), jnp.int32))

    @property
    def per_round(self) -> jax.Array:
        """[N] each candidate's estimated committed tokens per row-round (0 where nothing was revealed)."""
        mean = self.tokens / jnp.maximum(self.rows, 1e-30)
        return mean[0] + jnp.where(jnp.arange(mean.shape[0]) > 0, mean, 0.0)

    def learned(self) -> dict:
        """What carries to the next call (host numpy): tokens, rows, since_widest."""
        return {"scope": "round", "tokens": np.asarray(self.tokens), "rows": np.asarray(self.rows),
                "since_widest": int(self.since_widest)}

    def with_learned(self, learned: dict) -> "BudgetState":
        """This state with a previous call's `learned()` (arrays placed as this state's)."""
        put = lambda value, like: jax.device_put(np.asarray(value, like.dtype), like.sharding)  # noqa: E731
        return dataclasses.replace(self, tokens=put(learned["tokens"], self.tokens),
                                   rows=put(learned["rows"], self.rows),
                                   since_widest=put(learned["since_widest"], self.since_widest))


DECAY = 0.999  # per round, of every candidate's tokens and rows (about 1000 rounds of memory)
# Rounds without the widest candidate before it runs once more (it reveals every candidate's count): as many as
# the row-rounds it has run, and as many as keep a probe's extra time (its round over the best candidate's, and
# the two changes of candidate) within PROBE_SHARE of the time, within PROBE_MIN and PROBE_MAX. A fixed 256 let
# one unlucky early estimate hold for 256 rounds (the CPU's demo pair, 2026-12-03: the chain in 129 rounds where
# B = 16 was 12% faster); without the price, probes every ~32 rounds took ~3% of the demo pair's time on the H200
# (2026-12-03: 38 B = 16 rounds of 1087, each ~0.07 ms dearer than the chain's 0.27 and two 0.08 ms changes).
PROBE_MIN, PROBE_MAX = 32, 256
PROBE_SHARE = 0.02
CHANGE_ROUNDS = 32  # rounds a change of candidate is spread over in `choose`


def choose(budget_state: BudgetState) -> jax.Array:
    """The candidate index [] int32 with the most tokens per second, `per_round` / (cost + the change's share),
    a change's share being change_cost / CHANGE_ROUNDS for every candidate but the last round's; the widest
    candidate when it has never run or as many rounds have passed without it as it has run, and at least as many
    as keep the probe's extra seconds within PROBE_SHARE of the rounds' (within PROBE_MIN, PROBE_MAX). A candidate
    of infinite cost is never chosen (the calibration forces one candidate so)."""
    costs = budget_state.costs
    widest = costs.shape[0] - 1
    allowed = jnp.isfinite(costs)
    per_round = budget_state.per_round
    candidates = jnp.arange(costs.shape[0])
    change = (candidates != budget_state.last) & (budget_state.last >= 0)
    seconds = costs + jnp.where(change, budget_state.change_cost / CHANGE_ROUNDS, 0.0)
    best = jnp.argmax(jnp.where(allowed, per_round / jnp.where(allowed, seconds, 1.0), -1.0)).astype(jnp.int32)
    due = budget_state.since_widest.astype(jnp.float32) >= _probe_interval(budget_state, best)
    explore = allowed[widest] & ((budget_state.rows[widest] == 0) | due)
    return jnp.where(explore, jnp.int32(widest), best)


def _probe_interval(budget_state: BudgetState, best: jax.Array) -> jax.Array:
    """[] float32 rounds without the widest candidate after which `choose` runs it once, `best` [] int32 being the
    candidate it would choose otherwise: as many as the widest has run (row-rounds), and as many as keep the
    probe's extra seconds within PROBE_SHARE of the rounds', within PROBE_MIN and PROBE_MAX."""
    costs = budget_state.costs
    widest = costs.shape[0] - 1
    probe_extra = costs[widest] - costs[best] + 2 * budget_state.change_cost  # seconds a probe costs beyond `best`
    priced = probe_extra / (PROBE_SHARE * costs[best])  # rounds between probes that keep them within PROBE_SHARE
    return jnp.clip(jnp.maximum(budget_state.rows[widest], priced), PROBE_MIN, PROBE_MAX)


UNBOUNDED_ROUNDS = 1 << 30  # `chain_rounds` when the widest candidate is priced out (never probed)


def chain_rounds(budget_state: BudgetState) -> jax.Array:
    """[] int32 rounds of the chain (candidate 0, chosen by `choose` from this state) that run before the widest
    candidate's probe is due (>= 1; UNBOUNDED_ROUNDS when the widest is priced out): `auto_loop` runs that many
    chain rounds without learning from each one (`learn_chain_rounds` learns from them all at their end).

    Why this holds `choose`'s choice. A chain round reveals only the chain's own count (it is the smallest
    candidate), which moves every candidate's estimate by the same tokens (`per_round`: the first candidate's
    count plus each one's gain); so during a run of chain rounds the choice changes when the probe falls due (this
    count) or when the chain's average drifts far enough to tip a tree ahead: an average over ~1000 rounds
    (DECAY) moves little within one run, and a drift is acted on at the run's end (at most PROBE_MAX rounds while
    the widest is priced in). Learning in every round cost the demo pair's chain round ~3% on the H200
    (2026-12-03: ~7 us of small kernels in a 0.23 ms round)."""
    widest = budget_state.costs.shape[0] - 1
    left = jnp.ceil(_probe_interval(budget_state, jnp.int32(0)) - budget_state.since_widest.astype(jnp.float32))
    return jnp.where(jnp.isfinite(budget_state.costs[widest]),
                     jnp.maximum(left, 1.0).astype(jnp.int32), jnp.int32(UNBOUNDED_ROUNDS))


def learn_chain_rounds(budget_state: BudgetState, round_lengths: jax.Array, first_round: jax.Array,
                       end_round: jax.Array, rounds: jax.Array) -> BudgetState:
    """What `observe` learns from `rounds` [] int32 consecutive chain rounds, learned at once at their end: row r ran
    its rounds first_round[r] .. end_round[r] - 1 [b] (a row runs from the first of them until it is done, so its
    j-th ran in the j-th round) and committed round_lengths [b, max_new] tokens in each. The chain's tokens and
    rows gain each round's sums weighted DECAY^(rounds after it), as `observe` folds them one round at a time;
    since_widest grows by `rounds`; the chain is the last candidate. `chosen` is left as it is: its zeros are the
    chain's budget. No rounds: nothing changes."""
    index = jnp.arange(round_lengths.shape[1])[None, :]
    ran = (index >= first_round[:, None]) & (index < end_round[:, None])
    weight = jnp.where(ran, DECAY ** (rounds - 1 - (index - first_round[:, None])).astype(jnp.float32), 0.0)
    decay = DECAY ** rounds.astype(jnp.float32)
    tokens = decay * budget_state.tokens[0] + jnp.sum(weight * round_lengths)
    rows = decay * budget_state.rows[0] + jnp.sum(weight)
    return dataclasses.replace(budget_state, tokens=budget_state.tokens.at[0].set(tokens),
                               rows=budget_state.rows.at[0].set(rows),
                               since_widest=budget_state.since_widest + rounds,
                               last=jnp.where(rounds > 0, jnp.int32(0), budget_state.last))


def revealed_counts(budgets: tuple[int, ...], pick: int, counts: jax.Array, path: jax.Array, tokens: jax.Array,
                    chain_tokens: jax.Array) -> tuple[jax.Array, jax.Array]:
    """What every candidate would have committed in a round that verified candidate `pick` (static) and committed
    counts [b] along the accepted path [b, P] (node indices, root first) with the target's tokens [b, P] (the
    token after each path node; the last one the bonus), chain_tokens [b, P - 1] the draft's per-depth argmaxes.
    Returns (counts [b, N] int32, revealed [N] bool): the candidate itself; a smaller tree, the path's nodes
    numbered <= its budget (nested trees); the chain, 1 + the depths its argmaxes match the target's tokens
    (a lower bound where it matches the last known one); a wider tree, not revealed (0).

    Example (P = 4): a B = 4 round accepts path [0 1 3 5] (count 3: nodes 1 and 3, the bonus after 3): B = 2
    commits 2 (node 1 only); target tokens [7 8 9 -] against chain argmaxes [7 6 9]: the chain commits 2."""
    depth = jnp.arange(path.shape[1])
    known = depth[None, :] < counts[:, None]  # [b, P]: the path's accepted nodes and the bonus's position
    matches = (chain_tokens == tokens[:, :-1]) & known[:, :-1]
    chain = 1 + jnp.sum(jnp.cumprod(matches.astype(jnp.int32), axis=1), axis=1)
    out, revealed = [], []
    for i, b in enumerate(budgets):
        if i == pick:
            out.append(counts)
        elif b == CHAIN:
            out.append(chain)
        elif b < budgets[pick]:
            out.append(1 + jnp.sum(known[:, 1:] & (path[:, 1:] <= b), axis=1))
        else:
            out.append(jnp.zeros_like(counts))
        revealed.append(i == pick or b == CHAIN or b < budgets[pick])
    return jnp.stack(out, axis=1).astype(jnp.int32), jnp.asarray(revealed)


def observe(budget_state: BudgetState, pick: int, counts: jax.Array, revealed: jax.Array, running: jax.Array,
            budget: int, num_rounds: jax.Array) -> BudgetState:
    """After a round that verified candidate `pick` (static; its budget `budget`): fold the running rows'
    counts [b, N] of every revealed [N] candidate (`revealed_counts`; the first is always revealed) into its tokens
    (the first's count, another's gain over it) and rows, record `budget`
    at each running row's round index `num_rounds` [b], `pick` as the last candidate and the widest's absence.
    A round in which no row runs changes nothing."""
    any_running = running.any()
    n = running.sum().astype(jnp.float32)
    gains = counts - jnp.where(jnp.arange(counts.shape[1]) > 0, counts[:, :1], 0)  # [b, N]: count, then gains
    total = jnp.sum(jnp.where(running[:, None], gains, 0), axis=0).astype(jnp.float32)  # [N]
    learn = revealed & any_running
    tokens = jnp.where(learn, DECAY * budget_state.tokens + total, budget_state.tokens)
    rows = jnp.where(learn, DECAY * budget_state.rows + n, budget_state.rows)
    widest = budget_state.costs.shape[0] - 1
    since = jnp.where(any_running, 0 if pick == widest else budget_state.since_widest + 1, budget_state.since_widest)
    b, max_new = budget_state.chosen.shape
    idx = jnp.where(running, num_rounds, max_new)
    return dataclasses.replace(budget_state, tokens=tokens, rows=rows, since_widest=since.astype(jnp.int32),
                               chosen=budget_state.chosen.at[jnp.arange(b), idx].set(budget, mode="drop"),
                               last=jnp.where(any_running, jnp.int32(pick), budget_state.last))


# ----------------------------------------------------------------------------------------------------
# The cost cache (host side)


# 2: a warm-up, then the candidates interleaved; 3: and the cost of a change; 4: calls of 32 rounds, 7 repeats
# (2026-12-03)
CALIBRATION_VERSION = 4


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


def _read_entry(path: Path, key: dict) -> dict | None:
    """The JSON entry at `path` written for `key`, or None (absent, unreadable or for another key)."""
    try:
        entry = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return entry if isinstance(entry, dict) and entry.get("key") == key else None


def _write_entry(path: Path, entry: dict) -> Path | None:
    """Write `entry` as JSON at `path` atomically (a temporary file, then a rename); None (and nothing written)
    when the folder cannot be written."""
    from ddtree_jax.cli import atomic_path

    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with atomic_path(path) as tmp:
            tmp.write_text(json.dumps({**entry, "date": time.strftime("%Y-%m-%d %H:%M:%S")}, indent=1) + "\n")
    except OSError:
        return None
    return path


def load_costs(key: dict) -> tuple[list[float], float] | None:
    """The cached (seconds per round of `key`'s candidates, seconds per change of candidate), or None (absent,
    unreadable or for another key)."""
    entry = _read_entry(cost_cache_path(key), key)
    if entry is None:
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
    return _write_entry(cost_cache_path(key), {"key": key, "seconds": [float(s) for s in seconds],
                                               "change_seconds": float(change_seconds)})


# ----------------------------------------------------------------------------------------------------
# Per call (host side): `DecodeOptions.auto_scope == "call"`


# Calls on whose prompts every candidate runs (the calibration, `decide_call`); the choice is made from these paired
# runs only, so a prompt's difficulty weighs on every candidate alike. Measured on the H200's demo pair
# (2026-12-05), a record that also learned from each call's own run (unpaired, after 2 paired calls) settled on
# B = 63 where B = 31 was 4% faster: prompts differ by more than the candidates (docs/performance.md). Replays of
# every candidate's measured seconds per prompt (`tools/per_call_choice.py --rule engine`, 300 random prompt
# orders) gave 0.97-0.99x the best fixed budget with 4 paired calls on the H200's runs, 1.00x on the CPU's.
CALIBRATION_CALLS = 4
CALL_RECORD_VERSION = 1


@dataclasses.dataclass(frozen=True)
class CallRecord:
    """What `--budget auto` per call knows: for each candidate (`DecodeOptions.budgets` order), the calibration
    calls that ran its fixed program (the chain: DFlash's) on the same prompts as every other candidate, the tokens
    they emitted (every row's) and their decode seconds.

    Why per call. A per-round choice (`auto_scope="round"`, the `lax.switch` of `round.auto_loop`) pays for its
    program every call and for every change of candidate, and learns from its own rounds, which start where the
    candidate before them stopped (biased: docs/performance.md, 2026-12-04 evening); on the H200's demo pair it
    reached 0.86-0.87x the best fixed budget. A call that runs one fixed program pays nothing extra, and the
    calibration measures the objective itself, tokens per second, every candidate on the same prompts."""

    calls: tuple[int, ...]
    tokens: tuple[float, ...]
    seconds: tuple[float, ...]
    paired: int = 0  # calls on whose prompts every candidate ran (the calibration, `decide_call`)

    @classmethod
    def empty(cls, candidates: int) -> "CallRecord":
        return cls(calls=(0,) * candidates, tokens=(0.0,) * candidates, seconds=(0.0,) * candidates)

    @classmethod
    def from_learned(cls, learned: dict, candidates: int) -> "CallRecord":
        """The record of `learned()` (a previous call's `GenerationResult.auto_learned`); ValueError if it is not
        one over `candidates` candidates."""
        try:
            record = cls(calls=tuple(int(c) for c in learned["calls"]),
                         tokens=tuple(float(t) for t in learned["tokens"]),
                         seconds=tuple(float(s) for s in learned["seconds"]), paired=int(learned["paired"]))
        except (KeyError, TypeError, ValueError):
            got = sorted(learned) if isinstance(learned, dict) else type(learned).__name__
            raise ValueError("expected a --budget auto per-call record: calls, tokens and seconds per candidate, "
                             f"paired, got keys {got}") from None
        n = {len(record.calls), len(record.tokens), len(record.seconds)}
        bad = [c for c, t, s in zip(record.calls, record.tokens, record.seconds) if c < 0 or t < 0 or s < 0
               or (c > 0) != (s > 0)]
        if n != {candidates} or bad or not 0 <= record.paired <= min(record.calls):
            raise ValueError(f"expected a per-call record of {candidates} candidates with calls, tokens and seconds "
                             f">= 0 (seconds > 0 exactly where calls > 0) and paired calls within each one's calls, "
                             f"got {learned}")
        return record

    def learned(self) -> dict:
        """What carries to the next call (`GenerationResult.auto_learned`; JSON)."""
        return {"scope": "call", "calls": list(self.calls), "tokens": list(self.tokens),
                "seconds": list(self.seconds), "paired": self.paired}

    @property
    def rates(self) -> list[float | None]:
        """Each candidate's tokens per second over its calls (None: never run)."""
        return [t / s if c else None for c, t, s in zip(self.calls, self.tokens, self.seconds)]

    @property
    def calibrating(self) -> bool:
        """Fewer than CALIBRATION_CALLS paired calls: the next call runs every candidate on its prompts first."""
        return self.paired < CALIBRATION_CALLS

    def choose(self) -> int:
        """The candidate index a call runs: the highest rate (the first where none has run).

        Example: tokens (400, 300), seconds (2.0, 1.4): rates 200 and 214.3 tokens/s, the second runs."""
        rates = [-1.0 if rate is None else rate for rate in self.rates]
        return int(np.argmax(rates))

    def add(self, index: int, tokens: int, seconds: float) -> "CallRecord":
        """The record with one more call of candidate `index` that emitted `tokens` in `seconds` of decode (a call
        that decoded nothing, its rows done after the prompt's pass, is not recorded)."""
        if seconds <= 0:
            return self
        bump = lambda values, by: tuple(v + by if i == index else v for i, v in enumerate(values))  # noqa: E731
        return dataclasses.replace(self, calls=bump(self.calls, 1), tokens=bump(self.tokens, float(tokens)),
                                   seconds=bump(self.seconds, float(seconds)))


def decide_call(record: CallRecord, run) -> tuple[CallRecord, int, float]:
    """One call of `--budget auto` per call. While the record is `calibrating`, every candidate i first runs on the
    call's prompts (`run(i, True)`: a calibration run, its output set aside) and goes into the record, paired; then
    the candidate the record chooses runs (`run(pick, False)`: the call's own, not recorded: the choice rests on
    paired runs only). `run` returns (tokens emitted, decode seconds). Returns (the record, pick, the calibration
    runs' seconds). `engine.generate` runs the programs; the tools replay measured seconds."""
    calibration_s = 0.0
    if record.calibrating:
        runs = [run(i, True) for i in range(len(record.calls))]
        if all(seconds > 0 for _, seconds in runs):  # prompts done after their pass decode nothing: not paired
            for i, (tokens, seconds) in enumerate(runs):
                record = record.add(i, tokens, seconds)
            record = dataclasses.replace(record, paired=record.paired + 1)
        calibration_s = sum(seconds for _, seconds in runs)
    pick = record.choose()
    run(pick, False)
    return record, pick, calibration_s


def record_key(target_config, drafter_config, options, batch: int, capacity: int, dtype) -> dict:
    """What a per-call record depends on: `cost_key`'s fields (greedy or sampled acceptance among them), the
    calibration's version left out."""
    key = cost_key(target_config, drafter_config, options, batch, capacity, dtype)
    del key["calibration"]
    return {**key, "record": CALL_RECORD_VERSION}


def record_path(key: dict) -> Path:
    return cost_cache_dir() / f"calls-{_digest(json.dumps(key, sort_keys=True))}.json"


def load_record(key: dict) -> CallRecord | None:
    """The per-call record kept for `key`, or None (absent, unreadable, for another key or malformed)."""
    entry = _read_entry(record_path(key), key)
    if entry is None:
        return None
    try:
        return CallRecord.from_learned(entry, len(key["budgets"]))
    except ValueError:
        return None


def save_record(key: dict, record: CallRecord) -> Path | None:
    """Keep `record` for `key` (atomically; None, and nothing written, when the folder cannot be written)."""
    return _write_entry(record_path(key), {"key": key, **record.learned()})


__all__ = ["CHAIN", "DEFAULT_CANDIDATES", "AUTO_SCOPES", "candidates_text", "BudgetState", "parse_candidates",
           "check_candidates", "choose", "chain_rounds", "UNBOUNDED_ROUNDS", "learn_chain_rounds", "revealed_counts",
           "observe", "DECAY", "PROBE_MIN", "PROBE_MAX", "PROBE_SHARE", "CHANGE_ROUNDS",
           "cost_key", "cost_cache_dir", "cost_cache_path", "load_costs", "save_costs",
           "CALIBRATION_CALLS", "CallRecord", "decide_call", "record_key", "record_path", "load_record",
           "save_record"]
