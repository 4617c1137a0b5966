"""Where the hybrid's tree verify goes: the Gated DeltaNet tree rule and its triangular solve, per layer.

    python tools/gdn_probe.py --out DIR [--t 16,17,65,257] [--heads 48] [--solves trsm,blocked16,...]
    python tools/gdn_probe.py --out DIR --smoke [--t 5,16]   # tiny shapes (T 5 and 16 by default): runs on a CPU

`qwen3_5.tree_gated_delta_rule` solves one unit lower triangular T x T system per value head (the WY form),
[T, Dk + Dv] right-hand sides, with `qwen3_5.unit_lower_solve`. Each solve variant below is timed alone and
inside the whole rule (and the rule with the solve left out: what the rest costs), at the Qwen3.6-27B shape
by default (48 value heads, head dims 128, batch 1), T nodes (16: DFlash's chain; 17, 65, 257: DDTree at
B = 16, 64, 256). Device time per layer: `L` layers' distinct inputs in one program, run 1 and R passes
in a device loop (`measure.timing.in_loop_seconds`), each pass feeding the next. Every variant's solution is
checked against a float64 NumPy solve of the same systems. Writes DIR/gdn_probe.json and prints a table.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import json
import math
import platform
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from ddtree_jax.cli import atomic_path
from ddtree_jax.measure.timing import in_loop_seconds
from ddtree_jax.models import qwen3_5
from pallas_kernels import tree_delta_rule


def system_inputs(key, layers: int, heads: int, t: int, dk: int, dv: int):
    """Per layer the rule's inputs for a random tree of t nodes (a chain when t == 16): q, k, v, g, beta, S0,
    visible, as `tree_gated_delta_rule` takes them (batch 1)."""
    out = []
    for layer in range(layers):
        ks = jax.random.split(jax.random.fold_in(key, layer), 7)
        q = jax.random.normal(ks[0], (1, t, heads, dk), jnp.float32)
        q = q / jnp.linalg.norm(q, axis=-1, keepdims=True) * dk ** -0.5
        k = jax.random.normal(ks[1], (1, t, heads, dk), jnp.float32)
        k = k / jnp.linalg.norm(k, axis=-1, keepdims=True)
        v = jax.random.normal(ks[2], (1, t, heads, dv), jnp.float32)
        g = -jnp.abs(jax.random.normal(ks[3], (1, t, heads), jnp.float32)) * 0.1
        beta = jax.nn.sigmoid(jax.random.normal(ks[4], (1, t, heads), jnp.float32))
        s0 = jax.random.normal(ks[5], (1, heads, dk, dv), jnp.float32) * 0.1
        if t == 16:
            parents = np.maximum(np.arange(t) - 1, 0)
        else:
            rng = np.random.default_rng(layer)
            parents = np.array([0] + [int(rng.integers(0, i)) for i in range(1, t)])
        visible = np.eye(t, dtype=bool)
        for i in range(1, t):
            visible[i] |= visible[parents[i]]
        out.append((q, k, v, g, beta, s0, jnp.asarray(visible[None])))
    return out


def build_system(q, k, v, g, beta, s0, visible):
    """The rule's system [1, H, T, T] and right-hand side [1, H, T, Dk + Dv] (as `tree_gated_delta_rule`)."""
    captured = {}

    def capture(system, rhs):
        captured["system"], captured["rhs"] = system, rhs
        return rhs

    qwen3_5.tree_gated_delta_rule(q, k, v, g, beta, s0, visible, solve=capture)
    return captured["system"], captured["rhs"]


def trsm(system, rhs):
    return jax.lax.linalg.triangular_solve(system, rhs, left_side=True, lower=True, unit_diagonal=True)


def inverse_then_matmul(system, rhs):
    """trsm against the identity (T columns instead of Dk + Dv), then one matmul."""
    n = system.shape[-1]
    eye = jnp.broadcast_to(jnp.eye(n, dtype=system.dtype), system.shape)
    return trsm(system, eye) @ rhs


def solve_variants():
    return {"trsm": trsm, "inverse": inverse_then_matmul,
            "blocked8": lambda s, r: qwen3_5.blocked_unit_lower_solve(s, r, 8),
            "blocked16": lambda s, r: qwen3_5.blocked_unit_lower_solve(s, r, 16),
            "blocked32": lambda s, r: qwen3_5.blocked_unit_lower_solve(s, r, 32),
            "current": qwen3_5.unit_lower_solve}


def rule_with(solve):
    """tree_gated_delta_rule with `solve` for its triangular solve (None: the solve left out)."""
    return functools.partial(qwen3_5.tree_gated_delta_rule, solve=solve or (lambda system, rhs: rhs))


def looped(fn, feed):
    """A program running `fn` over every layer's inputs, `passes` times, each pass feeding the next through
    `feed(inputs, outputs, tiny)` (tiny a traced 0, so nothing is hoisted or folded)."""
    def program(layer_inputs, tiny, passes):
        def one_pass(_, carry):
            new = []
            for inputs in carry:
                outputs = fn(*inputs)
                new.append(feed(inputs, outputs, tiny))
            return new
        return jax.lax.fori_loop(0, passes, one_pass, layer_inputs)
    return program


def kernel_configs(args) -> dict[str, tuple[str, tree_delta_rule.TreeDeltaRuleConfig]]:
    """The kernel variants the --kernel* flags name: {name: (precision, config)}, every combination."""
    chosen = args.kernel_forms.split(",")
    forms = [("one", {}) for name in chosen if name == "one"] + [  # (name, the form's TreeDeltaRuleConfig knobs)
        (f"{name}{w}" + (f"_r{n}" if n != "16" else ""),
         {"two_launch": True, "tile_warps": int(w), "block_rows": int(n), "s0_in_xla": "s0xla" in name,
          "unrolled_chain": "unrolled" in name})
        for name in chosen if name.startswith("two")
        for w in args.kernel_tile_warps.split(",") for n in args.kernel_block_rows.split(",")] + [
        (f"direct_inv{n}", {"direct": True, "inverse_passes": int(n)}) for name in chosen if name == "direct"
        for n in args.kernel_inverse_passes.split(",")]
    return {f"kernel_{p}_w{w}_vb{vb}_s{st}_{form}": (p, tree_delta_rule.TreeDeltaRuleConfig(
                num_warps=int(w), value_block=int(vb), num_stages=int(st), **knobs))
            for p, w, vb, st, (form, knobs) in itertools.product(
                [p for p in args.kernels.split(",") if p], args.kernel_warps.split(","),
                args.kernel_value_blocks.split(","), args.kernel_stages.split(","), forms)
            if knobs.get("two_launch") or st == "1"}  # the one-launch and direct forms pipeline no block loop


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--t", default=None, help="nodes per tree (default 16,17,65,257; with --smoke 5,16)")
    p.add_argument("--heads", type=int, default=48)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--solves", default="trsm,inverse,blocked8,blocked16,blocked32,current")
    p.add_argument("--kernels", default="default,highest",
                   help="the Pallas kernel's whole rule (pallas_kernels/tree_delta_rule.py) at these matmul precisions")
    p.add_argument("--kernel-warps", default="8", help="the kernel's num_warps values to time")
    p.add_argument("--kernel-value-blocks", default="64", help="the kernel's value_block values to time")
    p.add_argument("--kernel-forms", default="one,two",
                   help="the kernel's forms to time: one (one launch), two (TreeDeltaRuleConfig.two_launch), and two "
                        "with its knobs: two_s0xla (s0_in_xla), two_unrolled (unrolled_chain), two_s0xla_unrolled; "
                        "direct (TreeDeltaRuleConfig.direct)")
    p.add_argument("--kernel-block-rows", default="16",
                   help="the two-launch form's block_rows values to time (node rows per block)")
    p.add_argument("--kernel-inverse-passes", default="1",
                   help="the direct form's inverse_passes values to time (0 float32, 1 TF32, 3 TF32 x3)")
    p.add_argument("--kernel-tile-warps", default="4", help="the two-launch form's tile_warps values to time")
    p.add_argument("--kernel-stages", default="1", help="the kernel's num_stages values to time")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--smoke", action="store_true", help="tiny shapes (a CPU check of the script)")
    args = p.parse_args(argv)
    heads, dk, dv, layers = args.heads, 128, 128, args.layers
    ts = [int(x) for x in (args.t or ("5,16" if args.smoke else "16,17,65,257")).split(",")]
    if args.smoke:
        heads, dk, dv, layers = 2, 16, 16, 2
    solves = solve_variants()
    names = args.solves.split(",")
    for name in names:
        if name not in solves:
            print(f"error: --solves: unknown {name!r}; expected some of {', '.join(solves)}", file=sys.stderr)
            return 2
    kernel_variants = kernel_configs(args)
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    key = jax.random.PRNGKey(0)
    print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}; H = {heads}, Dk = Dv = {dk}, L = {layers}",
          flush=True)
    for t in ts:
        inputs = system_inputs(key, layers, heads, t, dk, dv)
        systems = [tuple(jax.jit(build_system)(*x)) for x in inputs]
        s64 = np.asarray(systems[0][0], np.float64)
        r64 = np.asarray(systems[0][1], np.float64)
        exact = np.linalg.solve(np.tril(s64, -1) + np.eye(t), r64)
        tiny = jnp.float32(0.0)

        def time_it(program, data):
            compiled = jax.jit(program).lower(data, tiny, jnp.int32(1)).compile()
            return in_loop_seconds(lambda n: compiled(data, tiny, jnp.int32(n)), args.repeats)[0] / layers

        for name in names + ["rule_without_solve"] + list(kernel_variants):
            row = {"t": t, "heads": heads, "variant": name}
            try:
                if name.startswith("kernel_"):
                    precision, config = kernel_variants[name]
                    if not tree_delta_rule.supports(t, dk, dv):
                        continue
                    row["config"] = dataclasses.asdict(config)  # tools/with_tree_rule.py --best reads it

                    def rule(q, k, v, g, beta, s0, visible, precision=precision, config=config):
                        out, v_new, cum = tree_delta_rule.tree_delta_rule(q, k, v, g, beta, s0, visible,
                                                                          precision=precision, config=config)
                        return out, k, v_new, cum

                    got = rule(*inputs[0])[0]
                    want = qwen3_5.tree_gated_delta_rule(*inputs[0])[0]
                    row["rel_err_out"] = float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want))
                elif name != "rule_without_solve":
                    solve = solves[name]
                    got = np.asarray(jax.jit(solve)(*systems[0]), np.float64)
                    row["rel_err"] = float(np.linalg.norm(got - exact) / np.linalg.norm(exact))
                    row["solve_us"] = 1e6 * time_it(
                        looped(solve, lambda x, out, tiny: (x[0], x[1] + out * tiny)), systems)
                    rule = rule_with(solve)
                else:
                    rule = rule_with(None)
                row["rule_us"] = 1e6 * time_it(
                    looped(rule, lambda x, out, tiny: (x[0] + out[0][..., :x[0].shape[-1]] * tiny,) + tuple(x[1:])),
                    inputs)
            except Exception as exc:  # a variant that fails is recorded, the others go on
                row["error"] = f"{type(exc).__name__}: {str(exc)[:400]}"
            rows.append(row)
            print(json.dumps(row), flush=True)
    result = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "python": platform.python_version(),
              "date": time.strftime("%Y-%m-%d"), "command": " ".join(sys.argv), "rows": rows}
    path = args.out / "gdn_probe.json"
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(result, indent=1))
    print(f"\n{'T':>4} {'variant':>20} {'solve us':>9} {'rule us':>9} {'rel err':>9}")
    for r in rows:
        print(f"{r['t']:>4} {r['variant']:>20} {r.get('solve_us', math.nan):9.1f} {r.get('rule_us', math.nan):9.1f} "
              f"{r.get('rel_err', r.get('rel_err_out', math.nan)):9.2e} {r.get('error', '')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
