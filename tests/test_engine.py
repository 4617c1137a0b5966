"""The AR engine: masks, EOS handling, on-device loop, and greedy output against transformers' generate."""

from __future__ import annotations

import argparse

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ddtree_jax.checkpoint import load_target
from ddtree_jax.engine import CALIBRATION_ROUNDS, DecodeOptions, DecodeState, calibration_schedule, generate
from ddtree_jax.models.contract import causal_mask
from ddtree_jax.round import _emit
from ddtree_jax.sampling import SamplingConfig


def test_causal_mask_literal():
    mask = np.asarray(causal_mask(jnp.array([2, 3]), 3)).astype(int)
    np.testing.assert_array_equal(mask[0], [[1, 0, 0], [1, 1, 0], [0, 0, 1]])
    np.testing.assert_array_equal(mask[1], [[1, 0, 0], [1, 1, 0], [1, 1, 1]])


@dataclasses.dataclass
class EmitCase:
    name: str
    tokens: list[list[int]]
    counts: list[int]
    done: list[bool]
    num_generated: list[int]
    expect_output: list[list[int]]
    expect_done: list[bool]


EMIT_CASES = [
    EmitCase("append_all", [[5, 6, 7]], [3], [False], [0], [[5, 6, 7]], [False]),
    EmitCase("eos_inside_round_drops_the_rest", [[5, 9, 7]], [3], [False], [0], [[5, 9]], [True]),
    EmitCase("eos_beyond_count_is_ignored", [[5, 6, 9]], [2], [False], [0], [[5, 6]], [False]),
    EmitCase("budget_cuts_the_round", [[5, 6, 7]], [3], [False], [4], [[1, 1, 1, 1, 5, 6]], [True]),
    EmitCase("done_rows_stay_put", [[5, 6, 7], [5, 6, 7]], [3, 3], [True, False], [1, 1],
             [[1], [1, 5, 6, 7]], [True, False]),
]


@pytest.mark.parametrize("case", EMIT_CASES, ids=lambda c: c.name)
def test_emit(case: EmitCase):
    b, max_new = len(case.tokens), 6
    output = np.zeros((b, max_new), np.int32)
    for r, n in enumerate(case.num_generated):
        output[r, :n] = 1
    state = DecodeState(cache=None, draft_cache=None, last_token=jnp.asarray(output[:, 0]), output=jnp.asarray(output),
                        num_generated=jnp.asarray(case.num_generated, jnp.int32), done=jnp.asarray(case.done),
                        round_lengths=None, num_rounds=None, rng=None, step=None)
    options = DecodeOptions(max_new_tokens=max_new, eos_ids=(9,))
    out = _emit(state, jnp.asarray(case.tokens, jnp.int32), jnp.asarray(case.counts, jnp.int32), options)
    got = [np.asarray(out.output)[r, :int(out.num_generated[r])].tolist() for r in range(b)]
    assert got == case.expect_output
    assert np.asarray(out.done).tolist() == case.expect_done
    for r in range(b):
        if got[r]:
            assert int(out.last_token[r]) == got[r][-1]


def test_eos_stops_each_row_and_is_kept(random_target):
    params = load_target(random_target, jnp.float32)
    prompts = [[3, 1, 4, 1, 5], [9, 2, 6]]
    free = generate(params, prompts, DecodeOptions(max_new_tokens=24)).output_ids
    eos = free[0][6]  # a token row 0 emits; row 1 may or may not emit it
    stopped = generate(params, prompts, DecodeOptions(max_new_tokens=24, eos_ids=(eos,))).output_ids
    for row_free, row_stopped in zip(free, stopped):
        cut = row_free.index(eos) + 1 if eos in row_free else len(row_free)
        assert row_stopped == row_free[:cut]
    assert len(stopped[0]) <= 7


def test_streaming_in_chunks_gives_the_same_tokens(random_target):
    params = load_target(random_target, jnp.float32)
    options = DecodeOptions(max_new_tokens=21)
    whole = generate(params, [[7, 7, 7]], options)
    seen = []
    chunked = generate(params, [[7, 7, 7]], options, steps_per_call=4, on_tokens=lambda rows: seen.append(len(rows[0])))
    assert chunked.output_ids == whole.output_ids
    assert seen == [1, 5, 9, 13, 17, 21]
    assert whole.acceptance_lengths == [[1] * 20] and whole.tau == 1.0


def test_sampling_is_reproducible_and_seed_dependent(random_target):
    params = load_target(random_target, jnp.float32)
    options = DecodeOptions(max_new_tokens=16, sampling=SamplingConfig(temperature=1.0, top_k=20))
    a = generate(params, [[1, 2, 3]], options, seed=1).output_ids
    assert generate(params, [[1, 2, 3]], options, seed=1).output_ids == a
    assert generate(params, [[1, 2, 3]], options, seed=2).output_ids != a


def test_rejects_out_of_vocabulary_prompt(random_target):
    params = load_target(random_target, jnp.float32)
    with pytest.raises(ValueError, match="token id 100000 is outside the vocabulary"):
        generate(params, [[1, 100000]], DecodeOptions(max_new_tokens=2))


def test_greedy_matches_transformers_generate_with_unequal_prompts(hf_qwen3):
    torch = pytest.importorskip("torch")
    from transformers import GenerationConfig

    folder, hf = hf_qwen3
    params = load_target(folder, jnp.float32)
    rng = np.random.default_rng(4)
    prompts = [rng.integers(0, 256, size=n).tolist() for n in (6, 1, 13)]
    ours = generate(params, prompts, DecodeOptions(max_new_tokens=24)).output_ids
    config = GenerationConfig(max_new_tokens=24, do_sample=False, eos_token_id=None, pad_token_id=0)
    for prompt, row in zip(prompts, ours):
        with torch.no_grad():
            theirs = hf.generate(torch.tensor([prompt]), generation_config=config)[0, len(prompt):].tolist()
        assert len(theirs) == 24
        assert row == theirs


def test_split_k_auto_is_off_for_speculative_modes_on_a_gpu_only(monkeypatch):
    from ddtree_jax.engine import Mode, resolve_options

    class Drafter:  # resolve_options reads the drafter's block size only
        config = type("C", (), {"block_size": 4})()

    def resolved(mode, backend):
        monkeypatch.setattr(jax, "default_backend", lambda: backend)
        return resolve_options(DecodeOptions(mode=mode), None if mode is Mode.AR else Drafter()).split_k

    assert [resolved(m, "gpu") for m in (Mode.AR, Mode.DFLASH, Mode.DDTREE)] == ["xla", "off", "off"]
    assert [resolved(m, "cpu") for m in (Mode.AR, Mode.DFLASH, Mode.DDTREE)] == ["xla", "xla", "xla"]
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert resolve_options(DecodeOptions(mode=Mode.DDTREE, split_k="xla"), Drafter()).split_k == "xla"
    with pytest.raises(ValueError, match="split_k"):
        DecodeOptions(split_k="never")


def test_fp8_matmul_auto_is_resolved_in_one_place_and_bad_values_are_refused():
    """"auto" becomes what `resolve_fp8_matmul` says (before compiling, so the program is keyed on it), a given
    choice is kept and reaches the models' Runtime, and the CLI offers exactly the engine's choices."""
    import argparse

    from ddtree_jax.cli import add_matmul_args
    from ddtree_jax.engine import resolve_options
    from ddtree_jax.models.contract import FP8_MATMUL_CHOICES, Fp8Matmul, resolve_fp8_matmul

    assert resolve_options(DecodeOptions(), None).fp8_matmul == resolve_fp8_matmul("auto").value == "dequantize"
    assert DecodeOptions().runtime.fp8_matmul is resolve_fp8_matmul("auto")
    assert resolve_fp8_matmul("auto", "pallas") is Fp8Matmul.DEQUANTIZE  # no GPU here
    for choice in ("dequantize", "stream", "w8a8"):
        assert resolve_options(DecodeOptions(fp8_matmul=choice), None).fp8_matmul == choice
        assert DecodeOptions(fp8_matmul=choice).runtime.fp8_matmul is Fp8Matmul(choice)
    import pallas_kernels

    with pytest.MonkeyPatch.context() as patch:  # on a GPU: stream with the Pallas kernels, dequantize with jax
        patch.setattr(pallas_kernels, "on_gpu", lambda: True)
        assert resolve_options(DecodeOptions(kernels="pallas"), None).fp8_matmul == "stream"
        assert resolve_options(DecodeOptions(kernels="jax"), None).fp8_matmul == "dequantize"
        assert DecodeOptions(kernels="pallas").runtime.fp8_matmul is Fp8Matmul.STREAM
    with pytest.raises(ValueError,
                       match="fp8_matmul must be one of 'auto', 'dequantize', 'stream', 'w8a8', got 'fast'"):
        DecodeOptions(fp8_matmul="fast")
    with pytest.raises(ValueError, match="fp8_matmul"):
        resolve_fp8_matmul("fast")
    parser = argparse.ArgumentParser()
    add_matmul_args(parser)
    flag = next(a for a in parser._actions if a.dest == "fp8_matmul")
    assert tuple(flag.choices) == FP8_MATMUL_CHOICES and flag.default == "auto"


def test_row_invariant_reaches_every_projection_and_the_attention(random_target, monkeypatch):
    """`row_invariant=True` reaches the models' Runtime: an AR step's forward holds one streaming kernel per
    projection (q|k|v, o, gate|up, down: 4 per layer) and its logits one more, and its attention is the
    row-invariant kernel; without it (the negative control, small calls' dense streaming off) none streams and the
    attention is the fast kernel. It needs the Pallas kernels, and the CLI flag maps onto it."""
    from ddtree_jax.cli import add_matmul_args
    from ddtree_jax.models import layers as model_layers
    from ddtree_jax.models import qwen3
    from ddtree_jax.models.contract import ForwardMeta
    from ddtree_jax.round import prefill as round_prefill
    from jaxprs import pallas_call_names

    monkeypatch.setattr(model_layers, "DENSE_STREAM_MAX_ROWS", 0)  # what streams below is row_invariant's alone

    params = load_target(random_target, jnp.float32)
    layers = params.config.num_layers
    cache = qwen3.create_cache(params.config, 1, 32, jnp.float32)
    meta = ForwardMeta.step(jnp.array([3]), jnp.array([True]))

    def kernels(fn) -> dict:
        jaxpr = jax.make_jaxpr(fn)(params, jnp.array([[5]]))
        names = pallas_call_names(jaxpr)
        return {kind: sum(n.startswith(kind) for n in names)
                for kind in ("stream_matmul", "tree_attention_row_invariant")}

    for row_invariant, streams, invariant_attention in ((True, 4, 1), (False, 0, 0)):
        options = DecodeOptions(kernels="pallas", row_invariant=row_invariant)
        assert options.runtime.row_invariant is row_invariant
        forward = lambda p, t: qwen3.forward(p, t, meta, cache, runtime=options.runtime).hidden  # noqa: E731
        assert kernels(forward) == {"stream_matmul": streams * layers,
                                    "tree_attention_row_invariant": invariant_attention * layers}, row_invariant
        logits = kernels(lambda p, t: qwen3.logits(p, forward(p, t), options.runtime))
        assert logits["stream_matmul"] == streams * layers + row_invariant
        # The prompt's pass too: each mode compiles its own prefill, whose XLA GEMMs gave other bits per program.
        prefill = kernels(lambda p, t: round_prefill(p, None, jnp.tile(t, (1, 4)), jnp.array([4]), jax.random.key(0),
                                                     capacity=32, options=options).cache.k)
        assert prefill == logits, row_invariant
    with pytest.raises(ValueError, match="row_invariant needs the Pallas kernels .*kernels='jax'"):
        DecodeOptions(kernels="jax", row_invariant=True)
    parser = argparse.ArgumentParser()
    add_matmul_args(parser)
    assert parser.parse_args(["--row-invariant"]).row_invariant and not parser.parse_args([]).row_invariant


def test_compile_program_passes_split_k_off_and_survives_a_jaxlib_without_the_option(monkeypatch, capsys):
    from ddtree_jax import engine

    def f(x, *, options):
        return x @ x.T

    x = jnp.arange(12.0).reshape(3, 4)
    off = DecodeOptions(split_k="off")
    assert engine.compiler_options(off) == engine.SPLIT_K_OFF
    assert engine.compiler_options(DecodeOptions(split_k="xla")) == {}
    np.testing.assert_array_equal(engine.compile_program(f, (x,), {"options": off})(x), np.asarray(x) @ np.asarray(x).T)
    # An option this jaxlib does not know: one note, then the program compiled without it.
    monkeypatch.setattr(engine, "SPLIT_K_OFF", {"xla_gpu_no_such_option_for_this_test": 1})
    for _ in range(2):
        np.testing.assert_array_equal(engine.compile_program(f, (x,), {"options": off})(x),
                                      np.asarray(x) @ np.asarray(x).T)
    assert capsys.readouterr().err.count("xla_gpu_no_such_option_for_this_test") == 1


class WarmingDevice:
    """A simulated device for `calibration_schedule`: candidate i's round takes ROUND_S[i] seconds, a call adds
    DISPATCH_S, a call that runs rounds enters its candidate's loop once (ENTRY_S), and for the first SLOW_FOR_S
    seconds of its clock every round takes SLOW_BY times longer (a GPU waking from idle at a low clock)."""

    ROUND_S, DISPATCH_S, ENTRY_S, SLOW_FOR_S, SLOW_BY = (0.244e-3, 0.327e-3), 0.05e-3, 0.17e-3, 0.06, 1.7

    def __init__(self):
        self.now, self.calls = 0.0, []

    def clock(self) -> float:
        return self.now

    def timed(self, i: int, rounds: int) -> tuple[float, int]:
        self.calls.append(i)
        speed = self.SLOW_BY if self.now < self.SLOW_FOR_S else 1.0
        seconds = self.DISPATCH_S + (self.ENTRY_S if rounds else 0.0) + rounds * self.ROUND_S[i] * speed
        self.now += seconds + 1e-3  # and the untimed prefill before it
        return seconds, rounds


def test_calibration_warms_up_then_interleaves_the_candidates():
    device = WarmingDevice()
    costs, change, complete = calibration_schedule(device.timed, [16, 17], clock=device.clock, warmup_s=0.25,
                                                   repeats=5)
    assert complete and costs == pytest.approx(WarmingDevice.ROUND_S, rel=1e-9)
    assert change == pytest.approx(WarmingDevice.ENTRY_S, rel=1e-9)  # the entry, not the dispatch
    timed = device.calls[-30:]  # 5 repeats x 2 candidates x (long, short, empty)
    assert timed == [0, 0, 0, 1, 1, 1] * 5 and device.calls[:2] == [0, 1]  # warm-up round-robin first
    # Negative control: one candidate measured first without the warm-up (the order before) has most of its
    # pairs in the slow period, and the median keeps them (the chain's 0.41 ms against its 0.24 on the H200).
    cold = WarmingDevice()
    costs, _, _ = calibration_schedule(cold.timed, [16], clock=cold.clock, warmup_s=0.0, repeats=5)
    assert costs[0] > 1.3 * WarmingDevice.ROUND_S[0]


def test_calibration_of_a_candidate_without_a_timed_round_scales_by_width():
    """Rows that finish within one round give the long call no more rounds than the short one: that
    candidate's cost is the measured ones' cost per verified token times its width, and not complete."""

    def timed(i, rounds):
        return (1e-3 * rounds, rounds) if i == 0 else (1e-6, 0)

    costs, change, complete = calibration_schedule(timed, [16, 32], clock=iter(range(10**6)).__next__,
                                                   warmup_s=0.0, repeats=3)
    assert not complete and change == pytest.approx(0.0, abs=1e-12) and costs[0] == pytest.approx(1e-3) and costs[1] == pytest.approx(2e-3)
    assert CALIBRATION_ROUNDS >= 2
