"""`--budget auto`'s choice (`budget.py`'s worked example), what a round reveals and how it is learned, the
candidate parser and the on-disk cost cache; per call, the record's choice and its on-disk copy. The decoding
itself (lossless, branches taken, calibration, the per-call record) is tested in test_ddtree_decoding.py and
test_hybrid_decoding.py."""

from __future__ import annotations

import dataclasses
import json

import jax.numpy as jnp
import numpy as np
import pytest

from ddtree_jax import budget as auto
from ddtree_jax.engine import DecodeOptions, Mode
from ddtree_jax.random_checkpoint import tiny_qwen3_config

LN = np.log


def state_with(tokens_per_round, costs, rows=10.0, **kw) -> auto.BudgetState:
    """A one-row state that has learned `tokens_per_round` [N] over `rows` row-rounds each (the first candidate's
    count, the others' gains over it), at `costs` [N]."""
    n = len(costs)
    state = auto.BudgetState.start(1, 8, n)
    gains = np.asarray(tokens_per_round, np.float32) - np.r_[0, [tokens_per_round[0]] * (n - 1)]
    return dataclasses.replace(state, tokens=jnp.asarray(gains) * rows,
                               rows=jnp.full((n,), rows, jnp.float32), costs=jnp.asarray(costs, jnp.float32), **kw)


def test_choice_of_the_worked_example():
    """budget.py's example: the chain 1.875 tokens per round, B = 4 2.3: at [1.0, 1.3] ms the chain (1.875 against
    1.77 per ms), at [1.0, 1.2] the tree (1.92)."""
    assert int(auto.choose(state_with([1.875, 2.3], [1.0, 1.3]))) == 0
    assert int(auto.choose(state_with([1.875, 2.3], [1.0, 1.2]))) == 1


def test_a_change_of_candidate_is_charged_its_share():
    """At [1.0, 1.2] ms the tree leads by 2.2% (1.917 against 1.875 per ms). A change costing 3.2 ms adds 0.1 ms
    (3.2 / CHANGE_ROUNDS) to the tree's round after a chain round: 1.77 per ms, the chain stays; after a tree
    round the chain would count 1.1 ms (1.70): the tree stays. No last round or a free change: the better rate."""
    assert auto.CHANGE_ROUNDS == 32
    state = state_with([1.875, 2.3], [1.0, 1.2], change_cost=jnp.asarray(3.2, jnp.float32))
    pick = lambda **kw: int(auto.choose(dataclasses.replace(state, **kw)))  # noqa: E731
    assert int(state.last) == -1 and pick() == 1
    assert pick(last=jnp.asarray(0)) == 0 and pick(last=jnp.asarray(1)) == 1
    assert pick(last=jnp.asarray(0), change_cost=jnp.asarray(0.0)) == 1


def test_the_widest_runs_first_and_every_probe_rounds_and_never_when_forced_out():
    """Nothing learned: the widest candidate (it reveals every count). Learned, the chain is better; after as many
    rounds without the widest as it has run (10 row-rounds, so PROBE_MIN = 32; 300, so PROBE_MAX = 256), the
    widest once. A candidate of infinite cost (the calibration's forcing) is never chosen, the widest included."""
    fresh = dataclasses.replace(auto.BudgetState.start(1, 8, 3), costs=jnp.asarray([1.0, 1.0, 1.0]))
    assert int(auto.choose(fresh)) == 2
    costs = [1.0, 1.2, 1.4]  # a probe 0.4 dearer than the chain's round: priced at 0.4 / (2% of 1.0) = 20 rounds
    state = state_with([3.0, 3.1, 3.2], costs)
    np.testing.assert_allclose(np.asarray(state.per_round), [3.0, 3.1, 3.2], rtol=1e-6)
    assert int(auto.choose(state)) == 0
    assert (auto.PROBE_MIN, auto.PROBE_MAX, auto.PROBE_SHARE) == (32, 256, 0.02)
    assert int(auto.choose(dataclasses.replace(state, since_widest=jnp.asarray(31)))) == 0
    assert int(auto.choose(dataclasses.replace(state, since_widest=jnp.asarray(32)))) == 2
    long = state_with([3.0, 3.1, 3.2], costs, rows=300.0)
    assert int(auto.choose(dataclasses.replace(long, since_widest=jnp.asarray(255)))) == 0
    assert int(auto.choose(dataclasses.replace(long, since_widest=jnp.asarray(256)))) == 2
    mid = state_with([3.0, 3.1, 3.2], costs, rows=100.0)
    assert [int(auto.choose(dataclasses.replace(mid, since_widest=jnp.asarray(n)))) for n in (99, 100)] == [0, 2]
    inf = float("inf")
    for forced in range(3):
        forced_costs = jnp.asarray([1.0 if i == forced else inf for i in range(3)])
        assert int(auto.choose(dataclasses.replace(fresh, costs=forced_costs))) == forced
        assert int(auto.choose(dataclasses.replace(state, costs=forced_costs, since_widest=jnp.asarray(999)))) == forced


def test_a_probe_waits_until_its_price_is_within_its_share():
    """The widest 1.0 ms dearer than the chain's 1.0: probes 1.0 / (2% of 1.0) = 50 rounds apart (10 row-rounds
    run would say 32); with two changes of 0.5 ms each on top, 2.0 / 0.02 = 100."""
    state = state_with([3.0, 3.1, 3.2], [1.0, 1.5, 2.0])
    probes = lambda s: [int(auto.choose(dataclasses.replace(s, since_widest=jnp.asarray(n)))) for n in  # noqa: E731
                        (49, 50, 99, 100)]
    assert probes(state) == [0, 2, 2, 2]
    assert probes(dataclasses.replace(state, change_cost=jnp.asarray(0.5, jnp.float32))) == [0, 0, 0, 2]


def test_a_run_of_chain_rounds_ends_where_choose_would_probe():
    """`chain_rounds` from a state where the chain is the choice: after that many chain rounds (since_widest grown
    by as many) `choose` probes the widest, one round fewer it still takes the chain; at least one round; unbounded
    when the widest is priced out."""
    for rows, since, change in [(10.0, 0, 0.0), (10.0, 31, 0.0), (10.0, 45, 0.0), (100.0, 17, 0.0), (300.0, 3, 0.0),
                                (10.0, 5, 0.5)]:
        state = state_with([3.0, 3.1, 3.2], [1.0, 1.5, 2.0], rows=rows, since_widest=jnp.asarray(since),
                           last=jnp.asarray(0), change_cost=jnp.asarray(change, jnp.float32))
        assert int(auto.choose(state)) == 0
        k = int(auto.chain_rounds(state))
        later = lambda n: int(auto.choose(dataclasses.replace(state, since_widest=jnp.asarray(n))))  # noqa: E731
        assert k >= 1 and later(since + k) == 2, (rows, since, k)
        assert k == 1 or later(since + k - 1) == 0, (rows, since, k)
    priced_out = state_with([3.0, 3.1, 3.2], [1.0, 1.5, float("inf")])
    assert int(auto.chain_rounds(priced_out)) == auto.UNBOUNDED_ROUNDS


def test_chain_rounds_learned_at_their_end_as_round_by_round():
    """Five chain rounds over three rows: row 0 runs all five (its rounds 2-6: two earlier rounds were a tree's),
    row 1 three and is then done (rounds 0-2), row 2 none. Learned at once, the state equals `observe`'s after
    each round, chosen untouched (zeros: the chain), since_widest + 5, the chain last."""
    start = dataclasses.replace(auto.BudgetState.start(3, 8, 2), tokens=jnp.asarray([40.0, 3.0]),
                                rows=jnp.asarray([10.0, 10.0]), since_widest=jnp.asarray(4), last=jnp.asarray(1))
    lengths = np.zeros((3, 8), np.int32)
    lengths[0, 2:7] = [3, 1, 4, 1, 5]
    lengths[1, 0:3] = [2, 6, 5]
    first, end = jnp.asarray([2, 0, 5]), jnp.asarray([7, 3, 5])
    at_once = auto.learn_chain_rounds(start, jnp.asarray(lengths), first, end, jnp.asarray(5))
    one_by_one = start
    for i in range(5):
        running = jnp.asarray([True, i < 3, False])
        counts = jnp.asarray([[lengths[0, 2 + i], 0], [lengths[1, i] if i < 3 else 0, 0], [0, 0]])
        one_by_one = auto.observe(one_by_one, 0, counts, jnp.asarray([True, False]), running, 0,
                                  jnp.asarray([2 + i, i, 5]))
    for field in ("tokens", "rows"):
        np.testing.assert_allclose(np.asarray(getattr(at_once, field)), np.asarray(getattr(one_by_one, field)),
                                   rtol=1e-6)
    decay5 = auto.DECAY ** 5
    assert float(at_once.rows[0]) == pytest.approx(10 * decay5 + 2 * sum(auto.DECAY ** j for j in (2, 3, 4)) +
                                                   sum(auto.DECAY ** j for j in (0, 1)), rel=1e-6)
    assert float(at_once.tokens[1]) == 3.0 and float(at_once.rows[1]) == 10.0
    assert int(at_once.since_widest) == int(one_by_one.since_widest) == 9
    assert int(at_once.last) == int(one_by_one.last) == 0
    assert not np.asarray(at_once.chosen).any() and not np.asarray(one_by_one.chosen).any()
    unchanged = auto.learn_chain_rounds(start, jnp.asarray(lengths), first, first, jnp.asarray(0))
    for field in ("tokens", "rows", "since_widest", "last"):
        np.testing.assert_array_equal(np.asarray(getattr(unchanged, field)), np.asarray(getattr(start, field)))


def test_revealed_counts_of_smaller_trees_and_the_chain():
    """budget.py's example (P = 4, candidates chain, 2, 4, 8; B = 4 ran): path [0 1 3 5] with count 3 (nodes 1
    and 3 accepted, the bonus after node 3): B = 2 commits 2 (node 1 only), the chain 2 (its argmaxes [7 6 9]
    against the target's [7 8 9]), B = 8 is not revealed. Row 2 accepted node 3 (count 2), outside B = 2's tree
    (1), and the chain matches every known target token ([4 5]): a lower bound, 3. Row 3 accepted nothing
    (count 1): 1 for everyone revealed."""
    path = jnp.asarray([[0, 1, 3, 5], [0, 3, 3, 3], [0, 0, 0, 0]])
    counts = jnp.asarray([3, 2, 1])
    target_tokens = jnp.asarray([[7, 8, 9, 1], [4, 5, 0, 0], [3, 0, 0, 0]])
    chain_tokens = jnp.asarray([[7, 6, 9], [4, 5, 6], [2, 0, 0]])
    got, revealed = auto.revealed_counts((0, 2, 4, 8), 2, counts, path, target_tokens, chain_tokens)
    assert np.asarray(revealed).tolist() == [True, True, True, False]
    assert np.asarray(got).tolist() == [[2, 2, 3, 0], [3, 1, 2, 0], [1, 1, 1, 0]]
    # The chain ran: only it is revealed.
    got, revealed = auto.revealed_counts((0, 2), 0, counts, path, target_tokens, chain_tokens)
    assert np.asarray(revealed).tolist() == [True, False] and np.asarray(got)[:, 0].tolist() == [3, 2, 1]


def test_observe_averages_the_revealed_counts_and_records_the_round():
    """Two running rows commit [3, 1] tokens on candidate 1 and reveal [2, 1] for candidate 0; candidate 2 is not
    revealed. After 20 such rounds candidate 0's count averages 1.5 and candidate 1's gain over it 0.5 (per_round
    2.0), rows = 2 (1 - DECAY^20) / (1 - DECAY); the
    budget is written at each running row's round index; a done row counts nowhere; a round in which no row runs
    changes nothing; since_widest counts the rounds without candidate 2 and restarts when it runs."""
    state = auto.BudgetState.start(3, 4, 3)
    counts = jnp.asarray([[2, 3, 0], [1, 1, 0], [9, 9, 0]])
    revealed = jnp.asarray([True, True, False])
    running = jnp.asarray([True, True, False])
    for _ in range(20):
        state = auto.observe(state, 1, counts, revealed, running, 4, jnp.asarray([1, 1, 0]))
    rows = 2 * (1 - auto.DECAY ** 20) / (1 - auto.DECAY)
    np.testing.assert_allclose(np.asarray(state.rows), [rows, rows, 0], rtol=1e-5)
    np.testing.assert_allclose(np.asarray(state.tokens) / rows, [1.5, 0.5, 0], rtol=1e-5)
    np.testing.assert_allclose(np.asarray(state.per_round)[:2], [1.5, 2.0], rtol=1e-5)
    assert int(state.since_widest) == 20 and int(state.last) == 1
    assert np.asarray(state.chosen).tolist() == [[0, 4, 0, 0], [0, 4, 0, 0], [0, 0, 0, 0]]
    idle = auto.observe(state, 2, counts, jnp.asarray([True, True, True]), jnp.zeros(3, bool), 8,
                        jnp.zeros(3, jnp.int32))
    for field in ("tokens", "rows", "since_widest", "last", "chosen"):
        np.testing.assert_array_equal(np.asarray(getattr(idle, field)), np.asarray(getattr(state, field)))
    widest = auto.observe(state, 2, counts, jnp.asarray([True, True, True]), running, 8, jnp.asarray([2, 2, 0]))
    assert int(widest.since_widest) == 0 and float(widest.rows[2]) == 2.0


def test_learned_state_carries_to_a_fresh_state():
    state = state_with([2.0, 3.0], [1.0, 1.2], rows=4.0, since_widest=jnp.asarray(7))
    fresh = auto.BudgetState.start(2, 8, 2).with_learned(state.learned())
    np.testing.assert_array_equal(np.asarray(fresh.tokens), [8.0, 4.0])
    np.testing.assert_array_equal(np.asarray(fresh.per_round), [2.0, 3.0])
    np.testing.assert_array_equal(np.asarray(fresh.rows), [4.0, 4.0])
    assert int(fresh.since_widest) == 7 and int(fresh.last) == -1 and fresh.chosen.shape == (2, 8)


@pytest.mark.parametrize("text,want", [("chain,16,64", (0, 16, 64)), ("64, 0 ,16", (0, 16, 64)), ("4,8", (4, 8))])
def test_parse_candidates(text, want):
    assert auto.parse_candidates(text) == want


@pytest.mark.parametrize("text", ["64", "chain", "a,b", "-1,4", "", "16,16"])
def test_parse_candidates_refuses(text):
    with pytest.raises(ValueError, match="expected"):
        auto.parse_candidates(text)


def test_options_take_auto_only_for_ddtree_and_are_as_wide_as_the_widest_candidate():
    options = DecodeOptions(mode=Mode.DDTREE, block_size=16, budgets=(0, 16, 64))
    assert options.auto_budget and options.verify_width == 65
    assert DecodeOptions(mode=Mode.DDTREE, block_size=16, budgets=(0, 8)).verify_width == 16  # the chain: bs
    assert options.candidate(0).mode is Mode.DFLASH and options.candidate(16).budget == 16
    assert not options.candidate(16).auto_budget
    with pytest.raises(ValueError, match="ddtree option"):
        DecodeOptions(mode=Mode.DFLASH, budgets=(0, 16))
    with pytest.raises(ValueError, match="ascending"):
        DecodeOptions(mode=Mode.DDTREE, budgets=(64, 16))


def test_cost_cache_round_trip_is_keyed_and_atomic(tmp_path, monkeypatch):
    monkeypatch.setenv(auto.COST_CACHE_ENV, str(tmp_path / "c"))
    from ddtree_jax.config import parse_qwen3

    config = parse_qwen3(tiny_qwen3_config())
    options = DecodeOptions(mode=Mode.DDTREE, block_size=4, budgets=(0, 4, 16))
    key = auto.cost_key(config, None, options, 2, 300, jnp.float32)
    assert key["context"] == 512 and key["batch"] == 2 and key["budgets"] == [0, 4, 16]
    assert auto.load_costs(key) is None
    path = auto.save_costs(key, [1e-3, 2e-3, 3e-3], 0.5e-3)
    assert path.parent == tmp_path / "c" and [p.name for p in path.parent.iterdir()] == [path.name]  # no temp left
    assert auto.load_costs(key) == ([1e-3, 2e-3, 3e-3], 0.5e-3)
    assert auto.load_costs({**key, "batch": 4}) is None  # another batch: another entry
    streamed = dataclasses.replace(options, fp8_matmul="stream")  # another FP8 matmul: another compiled round
    assert auto.load_costs(auto.cost_key(config, None, streamed, 2, 300, jnp.float32)) is None
    assert auto.load_costs({**key, "calibration": key["calibration"] - 1}) is None  # an older schedule's costs
    path.write_text(json.dumps({"key": key, "seconds": [1, -1, 2], "change_seconds": 0}))
    assert auto.load_costs(key) is None  # a broken entry is measured again, not used
    path.write_text(json.dumps({"key": key, "seconds": [1, 1, 2]}))
    assert auto.load_costs(key) is None  # no change cost: measured again
    path.write_text("{not json")
    assert auto.load_costs(key) is None


def test_call_record_takes_the_best_rate():
    """`CallRecord.choose`: the highest tokens per second (the docstring's example), the first candidate where none
    has run, never one that has not run while another has."""
    assert auto.CallRecord(calls=(2, 1), tokens=(400.0, 300.0), seconds=(2.0, 1.4)).choose() == 1
    assert auto.CallRecord.empty(3).choose() == 0
    record = auto.CallRecord.empty(3).add(2, 10, 1.0)
    assert record.rates == [None, None, 10.0] and record.choose() == 2
    assert record.add(0, 5, 0.0) == record  # no decode: not recorded


def test_decide_call_calibrates_paired_then_chooses():
    """`decide_call` on two candidates whose seconds per prompt are [1, 1, 1, 1, 1] and [0.5, 2, 0.5, 0.5, 9] (a
    prompt a token), worked by hand: prompts 0-3 run both (the calibration, paired), each then the choice from the
    sums so far: 1 (0.5 s against 1), 0 (2 against 2.5), 0 (a tie at 3 s: the first), 1 (3.5 against 4); prompt 4
    runs 1 alone, not recorded (its 9 s do not move the choice)."""
    seconds = [[1.0, 1.0, 1.0, 1.0, 1.0], [0.5, 2.0, 0.5, 0.5, 9.0]]
    record, picks, calibration = auto.CallRecord.empty(2), [], []
    for prompt in range(5):
        ran = []

        def run(i, calibrating):
            ran.append((i, calibrating))
            return 1, seconds[i][prompt]

        record, pick, calibration_s = auto.decide_call(record, run)
        picks.append(pick)
        calibration.append((ran[-1], len(ran), calibration_s))
    assert picks == [1, 0, 0, 1, 1] and auto.CALIBRATION_CALLS == 4
    assert calibration == [((1, False), 3, 1.5), ((0, False), 3, 3.0), ((0, False), 3, 1.5), ((1, False), 3, 1.5),
                           ((1, False), 1, 0.0)]
    assert record.calls == (4, 4) and record.seconds == (4.0, 3.5) and record.paired == 4 and not record.calibrating


@pytest.mark.parametrize("learned", [{"calls": [1], "tokens": [1.0], "seconds": [1.0]},  # one candidate of two
                                     {"calls": [1, 0], "tokens": [1.0, 0.0], "seconds": [0.0, 0.0]},  # no seconds
                                     {"calls": [1, -1], "tokens": [1.0, 0.0], "seconds": [1.0, 0.0]},
                                     {"calls": [1, 1], "tokens": [1.0, 1.0], "seconds": [1.0, 1.0], "paired": 2},
                                     {"tokens": [1.0, 0.0], "rows": [1.0, 0.0]},  # a per-round state's
                                     [1, 2]])
def test_call_record_refuses_what_is_not_one(learned):
    with pytest.raises(ValueError, match="expected"):
        auto.CallRecord.from_learned(learned, 2)


def test_call_record_on_disk_is_keyed_and_atomic(tmp_path, monkeypatch):
    """The record round-trips through its own file beside the costs (no temporary left), keyed as the costs but
    for the calibration's version; another batch has another; a broken entry reads as none."""
    monkeypatch.setenv(auto.COST_CACHE_ENV, str(tmp_path / "c"))
    from ddtree_jax.config import parse_qwen3

    config = parse_qwen3(tiny_qwen3_config())
    options = DecodeOptions(mode=Mode.DDTREE, block_size=4, budgets=(0, 4, 16))
    key = auto.record_key(config, None, options, 1, 300, jnp.float32)
    assert "calibration" not in key and key["batch"] == 1 and key["budgets"] == [0, 4, 16]
    assert auto.load_record(key) is None
    record = auto.CallRecord(calls=(1, 2, 0), tokens=(10.0, 30.0, 0.0), seconds=(0.1, 0.2, 0.0))
    path = auto.save_record(key, record)
    assert [p.name for p in path.parent.iterdir()] == [path.name] and path.name.startswith("calls-")
    assert auto.load_record(key) == record
    assert auto.load_record({**key, "batch": 2}) is None
    path.write_text(json.dumps({"key": key, "calls": [1, 2], "tokens": [1, 2], "seconds": [1, 2]}))
    assert auto.load_record(key) is None  # two candidates' record under a key of three


def test_a_wider_round_reveals_what_the_chain_and_smaller_trees_commit():
    """Greedy, on the demo pair (float32): from the same state, the counts that B = 16's accepted path reveals
    (`revealed_counts`: the nested B = 4 tree, the chain's argmaxes against the target's tokens) are what the chain's
    and B = 4's own rounds commit, in every round of a held-out prompt; and the rounds are not trivial (some commit
    more than one token, and B = 16 commits more than the chain in some)."""
    import jax

    from ddtree_jax import round as rounds
    from ddtree_jax.bench import read_prompts
    from ddtree_jax.checkpoint import load_drafter, load_target
    from ddtree_jax.demo_pair import demo_drafter, demo_prompts, demo_target
    from ddtree_jax.engine import cache_shape, resolve_options

    target = load_target(demo_target(), jnp.float32)
    drafter = load_drafter(demo_drafter(), target.config, jnp.float32)
    prompt = read_prompts(demo_prompts(), demo_target(), target.config.vocab_size)[0]
    budgets = (0, 4, 16)
    options = resolve_options(DecodeOptions(mode=Mode.DDTREE, max_new_tokens=32, budgets=budgets), drafter,
                              jnp.float32)
    widest_round = jax.jit(lambda state: rounds.auto_candidate_round(target, drafter, state, len(budgets) - 1, options))

    @jax.jit
    def counts_from(state):
        logits = rounds.draft(drafter, target, state.last_token, state.draft_cache, options)
        own = []
        for b in budgets:
            sub = options.candidate(b)
            tree = rounds.propose(logits, state.last_token, sub)
            _, acc = rounds.verify_accept(target, drafter, state, tree, state.rng, sub)
            own.append(acc.count)
            if b == budgets[-1]:
                revealed, which = auto.revealed_counts(budgets, len(budgets) - 1, acc.count, acc.path, acc.tokens,
                                                       jnp.argmax(logits, axis=-1).astype(jnp.int32))
        return jnp.stack(own, axis=1), revealed, which

    width, capacity = cache_shape(len(prompt), options)
    tokens = np.zeros((1, width), np.int32)
    tokens[0, :len(prompt)] = prompt
    state = rounds.prefill(target, drafter, jnp.asarray(tokens), jnp.asarray([len(prompt)], jnp.int32),
                           jax.random.key(0), capacity=capacity, options=options)
    seen = []
    while not bool(state.done[0]):
        own, revealed, which = counts_from(state)
        assert np.asarray(which).all()
        np.testing.assert_array_equal(np.asarray(revealed), np.asarray(own))
        seen.append(np.asarray(own)[0])
        state = widest_round(state)
    seen = np.array(seen)
    assert (seen[:, 0] > 1).any() and (seen[:, 2] > seen[:, 0]).any(), seen
