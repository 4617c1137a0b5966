"""The decode options' matmul precision (issue 26): what "auto" resolves to, that it reaches every dot the
round's entry points trace (read in the lowered programs, against an opposite surrounding default), and
that the Pallas attention multiplies float32 at full precision whatever the surrounding default.

The numbers themselves (float32 against float64, and TF32 missing the tolerance) are in
tests/models/test_qwen3_float64.py."""

from __future__ import annotations

import functools
import json
import re

import jax
import jax.numpy as jnp
import pytest

from ddtree_jax import round as rnd
from ddtree_jax.engine import DecodeOptions, Mode, resolve_options
from ddtree_jax.measure import workload
from pallas_kernels.tree_attention import TreeAttentionConfig, tree_attention_pallas

from jaxprs import equations


def test_auto_precision_is_highest_for_float32_only():
    assert resolve_options(DecodeOptions(), None, jnp.float32).matmul_precision == "highest"
    for dtype in (jnp.bfloat16, jnp.float16, None):
        assert resolve_options(DecodeOptions(), None, dtype).matmul_precision == "default"
    for choice in ("default", "high", "highest"):
        assert resolve_options(DecodeOptions(matmul_precision=choice), None, jnp.float32).matmul_precision == choice
    with pytest.raises(ValueError, match="matmul_precision must be one of .*'tf32'"):
        DecodeOptions(matmul_precision="tf32")


def _dot_precisions(hlo: str) -> list[str]:
    """The precision of every dot_general in a lowered StableHLO module ("none": no precision attribute)."""
    found = []
    for line in hlo.splitlines():
        if "stablehlo.dot_general" in line:
            match = re.search(r"precision = \[(\w+), (\w+)\]", line)
            found.append("none" if match is None else match.group(1) if match.group(1) == match.group(2)
                         else f"{match.group(1)},{match.group(2)}")
    return found


def _lowered_programs(target, drafter, options: DecodeOptions) -> dict[str, str]:
    """StableHLO text of every entry point of a round, as the engine and the benchmark compile them:
    prefill, the decode loop, and each stage of `round.STAGES` alone (AR: no drafter, no stages)."""
    def lower(fn, args, static):
        return jax.jit(fn, static_argnames=tuple(static)).lower(*args, **static).as_text()

    b, width = 2, 8
    tokens, lengths = jax.ShapeDtypeStruct((b, width), jnp.int32), jax.ShapeDtypeStruct((b,), jnp.int32)
    key = jax.eval_shape(lambda: jax.random.key(0))
    state = jax.eval_shape(lambda: workload.empty_state(target.config, drafter.config, 16, options, 2,
                                                        dtype=jnp.float32, batch=b))
    if not options.mode.needs_drafter:
        drafter = None
    texts = {"prefill": lower(rnd.prefill, (target, drafter, tokens, lengths, key),
                              dict(capacity=64, options=options)),
             "decode_loop": lower(rnd.decode_loop, (target, drafter, state, jnp.int32(3)), dict(options=options))}
    if drafter is not None:
        def evaluate(name, fn, args, static):
            texts[name] = lower(fn, args, static)
            return jax.eval_shape(lambda *a: fn(*a, **static), *args)

        workload.stage_programs(target, drafter, state, options, evaluate)
    return texts


@pytest.mark.parametrize("mode,precision,surrounding", [(Mode.DDTREE, "default", "highest"),
                                                        (Mode.AR, "highest", "default")])
def test_precision_reaches_every_dot_of_every_entry_point(tiny_abstract_pair, mode, precision, surrounding):
    """Every dot of prefill, the decode loop and each stage carries the options' precision, though the
    surrounding default says otherwise (a dot the scope missed would carry the surrounding one)."""
    target, drafter = tiny_abstract_pair
    options = DecodeOptions(mode=mode, max_new_tokens=8, block_size=4, budget=6, kernels="jax",
                            matmul_precision=precision)
    with jax.default_matmul_precision(surrounding):
        texts = _lowered_programs(target, drafter, options)
    found = {name: _dot_precisions(text) for name, text in texts.items()}
    expected = {"prefill", "decode_loop"} | ({"draft", "verify", "commit"} if mode.needs_drafter else set())
    assert {name for name, dots in found.items() if dots} >= expected, found  # the matmuls are there
    assert all(p == precision.upper() for dots in found.values() for p in dots), found


def test_unresolved_auto_leaves_the_surrounding_default(tiny_abstract_pair):
    """Options not through `resolve_options` ("auto") change nothing: the caller's default applies."""
    target, drafter = tiny_abstract_pair
    options = DecodeOptions(mode=Mode.AR, max_new_tokens=8)
    state = jax.eval_shape(lambda: workload.empty_state(target.config, drafter.config, 16, options, 2,
                                                        dtype=jnp.float32))
    with jax.default_matmul_precision("high"):
        text = jax.jit(rnd.decode_loop, static_argnames=("options",)).lower(
            target, None, state, jnp.int32(3), options=options).as_text()
    assert set(_dot_precisions(text)) == {"HIGH"}


def _kernel_dot_precisions(jaxpr) -> list:
    """Precisions of the dot_generals inside the pallas_call(s) of a jaxpr (nested jaxprs searched)."""
    return [eqn.params["precision"] for eqn, outer in equations(jaxpr)
            if eqn.primitive.name == "dot_general" and "pallas_call" in outer]


@pytest.mark.parametrize("dtype,surrounding,expected", [(jnp.float32, "default", jax.lax.Precision.HIGHEST),
                                                        (jnp.bfloat16, "highest", jax.lax.Precision.DEFAULT)])
@pytest.mark.parametrize("lean,dots", [(False, 4), (True, 6)])
def test_pallas_attention_multiplies_float32_at_full_precision(dtype, surrounding, expected, lean, dots):
    """The kernel's dots: HIGHEST for float32 inputs (Pallas' Triton lowering then asks tl.dot for IEEE
    float32, where DEFAULT or HIGH would ask for TF32), DEFAULT for bf16 as before; the surrounding default
    changes neither. Scores and values over the cache and over the new tokens; with lean_steps (the default) the
    cache's whole blocks and its partial last block in loops of their own."""
    b, t, n, g, d, s = 1, 4, 2, 2, 16, 32
    x = lambda *shape: jax.ShapeDtypeStruct(shape, dtype)  # noqa: E731
    args = (x(b, t, n * g, d), x(b, s, n, d), x(b, s, n, d), jax.ShapeDtypeStruct((b,), jnp.int32), x(b, t, n, d),
            x(b, t, n, d), jax.ShapeDtypeStruct((b, t, t), bool), jax.ShapeDtypeStruct((b, t), jnp.int32))
    with jax.default_matmul_precision(surrounding):
        jaxpr = jax.make_jaxpr(functools.partial(tree_attention_pallas, scale=0.25,
                                                 config=TreeAttentionConfig(lean_steps=lean)))(*args)
    found = _kernel_dot_precisions(jaxpr)
    assert len(found) == dots
    assert set(found) == {(expected, expected)}


def test_generate_cli_records_the_resolved_precision(random_target, capsys):
    """`--matmul-precision` reaches the options and the JSON says what ran: "auto" is "highest" in float32;
    "default" runs too, with the same tokens on a CPU (which computes float32 fully either way)."""
    from ddtree_jax.generate import main, parse_args

    assert parse_args([]).matmul_precision == "auto"
    with pytest.raises(SystemExit):
        parse_args(["--matmul-precision", "tf32"])
    reports = {}
    for flag in ("auto", "default"):
        assert main(["--target", str(random_target), "--prompt-ids", "1,2,3", "--mode", "ar", "--json",
                     "--max-new-tokens", "4", "--dtype", "float32", "--matmul-precision", flag]) == 0
        reports[flag] = json.loads(capsys.readouterr().out)
    assert reports["auto"]["matmul_precision"] == "highest" and reports["default"]["matmul_precision"] == "default"
    assert reports["auto"]["output_ids"] == reports["default"]["output_ids"]
