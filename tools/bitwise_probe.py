"""Which parts of the target's forward give a row the same bits whatever else is in the call (issue 20).

    python tools/bitwise_probe.py --out DIR [--t 16,17,65] [--dtype bfloat16]
    python tools/bitwise_probe.py --out DIR --smoke      # tiny shapes: runs on a CPU

Greedy speculative decoding equals AR token for token only if the verify computes each node's logits with the
same arithmetic as the AR step computing the same prefix. The verify calls the model on T rows at once, the
AR step on one. For each part of a Qwen3 forward, at the Qwen3-8B shape by default, this probe computes T
rows in one call and each row alone, and counts the rows whose bits differ:

  matmul_xla        x @ W^T by XLA (the models' einsum) for the q|k|v, down and lm_head shapes;
  matmul_stream     the same by `pallas_kernels.stream_matmul` (its k slices' partial sums added outside),
                    and with one slice (`_one_split`: one reduction order over K by construction);
  add_rms_norm      the residual add and RMSNorm (Pallas kernel, and XLA's fusion of the jnp reference);
  attention         `pallas_kernels.tree_attention` (kernel and reference): node j of a chain of T new tokens over
                    a cache of S, against the AR step attending to the same prefix (the chain's first j
                    tokens then in the cache, position S + j);
  gdn_rule          a hybrid's Gated DeltaNet layer at the Qwen3.6-27B shape: node j of a chain of T through the
                    tree rule (the kernel, or the model's jnp WY form) against the AR steps' one-token recurrence
                    (`qwen3_5.recurrent_gated_delta_rule`, the state carried from step to step);
  elementwise       SiLU(x) * y: the control that must be row-invariant everywhere.

A part whose rows all match in every case is row-invariant here; one that differs names what issue 20 has to
replace. Writes DIR/bitwise_probe.json and prints a table.
"""

from __future__ import annotations

import argparse
import functools
import json
import platform
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from ddtree_jax.cli import atomic_path
from ddtree_jax.models import qwen3_5
from pallas_kernels import on_gpu
from pallas_kernels.rms_norm import add_rms_norm
from pallas_kernels.stream_matmul import StreamMatmulConfig, fitted_config, stream_matmul
from pallas_kernels.tree_attention import tree_attention
from pallas_kernels.tree_delta_rule import tree_delta_rule

QWEN3_8B = {"embed": 4096, "ffn": 12288, "heads": 32, "kv_heads": 8, "head_dim": 128, "vocab": 151936,
            "cache": 2048, "gdn_value_heads": 48, "gdn_key_heads": 16, "gdn_dim": 128}  # GDN: Qwen3.6-27B's
SMOKE = {"embed": 64, "ffn": 128, "heads": 4, "kv_heads": 2, "head_dim": 16, "vocab": 256, "cache": 40,
         "gdn_value_heads": 4, "gdn_key_heads": 2, "gdn_dim": 16}


PARTS = ("elementwise", "matmul_xla:", "matmul_stream:", "matmul_stream_one_split:", "add_rms_norm", "attention",
         "gdn_rule")  # what `probe` measures (`--parts` takes their names or prefixes)


def compare_rows(together, alone) -> dict:
    """together [T, ...] (one call on T rows), alone [T, ...] (row i computed by itself): how many rows differ in
    any bit, and the largest difference (float32)."""
    together, alone = np.asarray(together), np.asarray(alone)
    flat_t, flat_a = together.reshape(len(together), -1), alone.reshape(len(alone), -1)
    differ = [not np.array_equal(flat_t[i].view(np.uint8), flat_a[i].view(np.uint8)) for i in range(len(flat_t))]
    diff = np.abs(flat_t.astype(np.float32) - flat_a.astype(np.float32))
    return {"rows": len(differ), "rows_differing": int(sum(differ)), "max_abs_diff": float(diff.max(initial=0.0))}


def row_invariance(fn, x) -> dict:
    """fn applied to x [T, ...] at once and to each row x[i:i+1] alone (each its own compiled call)."""
    compiled = jax.jit(fn)
    return compare_rows(compiled(x), jnp.concatenate([compiled(x[i:i + 1]) for i in range(x.shape[0])]))


def attention_rows(shape: dict, t: int, *, dtype, implementation: str, key) -> dict:
    """Node j of a chain of t new tokens over a cache of S against the AR step at position S + j."""
    s, n, hq, d = shape["cache"], shape["kv_heads"], shape["heads"], shape["head_dim"]
    ks = jax.random.split(key, 5)
    q = jax.random.normal(ks[0], (1, t, hq, d), dtype)
    k_new, v_new = (jax.random.normal(k_, (1, t, n, d), dtype) for k_ in ks[1:3])
    cache_len = s + t  # room for the chain's keys in the AR steps' caches
    k_cache = jnp.zeros((1, cache_len, n, d), dtype).at[:, :s].set(jax.random.normal(ks[3], (1, s, n, d), dtype))
    v_cache = jnp.zeros((1, cache_len, n, d), dtype).at[:, :s].set(jax.random.normal(ks[4], (1, s, n, d), dtype))
    attend = jax.jit(functools.partial(tree_attention, scale=d ** -0.5, implementation=implementation))
    chain = jnp.tril(jnp.ones((1, t, t), bool))
    together = attend(q, k_cache, v_cache, jnp.array([s]), k_new, v_new, chain, s + jnp.arange(t)[None])[0]
    alone = []
    for j in range(t):  # the AR step: the chain's first j tokens are in the cache
        kc, vc = k_cache.at[:, s:s + j].set(k_new[:, :j]), v_cache.at[:, s:s + j].set(v_new[:, :j])
        alone.append(attend(q[:, j:j + 1], kc, vc, jnp.array([s + j]), k_new[:, j:j + 1], v_new[:, j:j + 1],
                            jnp.ones((1, 1, 1), bool), jnp.array([[s + j]]))[0])
    return compare_rows(together, jnp.concatenate(alone))


def gdn_rows(shape: dict, t: int, implementation: str, key) -> dict:
    """Node j of a chain of t through the tree rule against the AR steps' recurrence over tokens 0..j (float32,
    as the model runs the rule)."""
    hv, hk, d = shape["gdn_value_heads"], shape["gdn_key_heads"], shape["gdn_dim"]
    ks = jax.random.split(key, 6)
    unit = lambda x: x / jnp.linalg.norm(x, axis=-1, keepdims=True)  # noqa: E731
    q = unit(jax.random.normal(ks[0], (1, t, hk, d))) * d ** -0.5
    k = unit(jax.random.normal(ks[1], (1, t, hk, d)))
    v = jax.random.normal(ks[2], (1, t, hv, d))
    g = -jnp.abs(jax.random.normal(ks[3], (1, t, hv))) * 0.1
    beta = jax.nn.sigmoid(jax.random.normal(ks[4], (1, t, hv)))
    state = jax.random.normal(ks[5], (1, hv, d, d)) * 0.1
    chain = jnp.tril(jnp.ones((1, t, t), bool))
    group = hv // hk
    q_v, k_v = jnp.repeat(q, group, axis=2), jnp.repeat(k, group, axis=2)  # by value head, as the model's jnp path
    if implementation == "pallas":
        together = jax.jit(tree_delta_rule)(q, k, v, g, beta, state, chain)[0][0]
    else:
        together = jax.jit(qwen3_5.tree_gated_delta_rule)(q_v, k_v, v, g, beta, state, chain)[0][0]
    step = jax.jit(qwen3_5.recurrent_gated_delta_rule)
    alone = []
    for j in range(t):  # the AR step of token j, from the state the steps before it left
        out, state = step(q_v[:, j:j + 1], k_v[:, j:j + 1], v[:, j:j + 1], g[:, j:j + 1], beta[:, j:j + 1], state)
        alone.append(out[0])
    return compare_rows(together, jnp.concatenate(alone))


def probe(shape: dict, ts: list[int], dtype, implementations: list[str], key,
          parts: tuple[str, ...] = ()) -> list[dict]:
    """Every part at every T (the attention, the Gated DeltaNet rule and the norm first: the matmuls' compiles are
    the slow ones); `parts` keeps those whose name starts with one of them (all when empty)."""
    e, f, v = shape["embed"], shape["ffn"], shape["vocab"]
    qkv = (shape["heads"] + 2 * shape["kv_heads"]) * shape["head_dim"]
    weights = {name: jax.random.normal(jax.random.fold_in(key, i), dims, dtype) * dims[1] ** -0.5
               for i, (name, dims) in enumerate({"qkv": (qkv, e), "down": (e, f), "lm_head": (v, e)}.items())}
    rows = []
    for t in ts:
        x_e = jax.random.normal(jax.random.fold_in(key, 100 + t), (t, e), dtype)
        x_f = jax.random.normal(jax.random.fold_in(key, 200 + t), (t, f), dtype)
        cases = [("elementwise", "xla", lambda x: jax.nn.silu(x) * x[:, ::-1], x_e)]
        for name, w in weights.items():
            x = x_f if name == "down" else x_e
            cases.append((f"matmul_xla:{name}", "xla", lambda x, w=w: jnp.einsum("ti,oi->to", x, w), x))
            for impl in implementations:
                for splits in (None, 1):  # the default k slices (their partial sums added by XLA), and one
                    config = fitted_config(*w.shape, config=StreamMatmulConfig(splits=splits))
                    cases.append((f"matmul_stream{'' if splits is None else '_one_split'}:{name}", impl,
                                  lambda x, w=w, impl=impl, config=config: stream_matmul(
                                      x, w, implementation=impl, config=config), x))
        norm_w = 1 + 0.1 * jax.random.normal(jax.random.fold_in(key, 300), (e,), dtype)
        for impl in implementations:
            cases.append(("add_rms_norm", impl, lambda x, impl=impl: jnp.concatenate(
                add_rms_norm(x, x[:, ::-1], norm_w, eps=1e-6, implementation=impl), axis=-1), x_e))
        measures = [(part, impl, functools.partial(rows_of, shape, t, implementation=impl,
                                                   key=jax.random.fold_in(key, 400 + t)))
                    for part, rows_of in (("attention", functools.partial(attention_rows, dtype=dtype)),
                                          ("gdn_rule", gdn_rows))
                    for impl in implementations]
        cases.sort(key=lambda case: case[0].startswith("matmul"))  # the norm before the matmuls
        measures += [(part, impl, functools.partial(row_invariance, fn, x)) for part, impl, fn, x in cases]
        for part, impl, measure in measures:
            if parts and not part.startswith(parts):
                continue
            row = {"part": part, "implementation": impl, "t": t}
            try:
                row.update(measure())
            except Exception as exc:  # a part that fails is recorded, the others go on
                row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--t", default="16,17,65", help="rows per call (the verify's: 16 DFlash, 17 and 65 DDTree)")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--smoke", action="store_true", help="tiny shapes, kernels interpreted (a CPU check of the script)")
    p.add_argument("--parts", default="", help="comma-separated part names (or prefixes, e.g. matmul_stream) to "
                   "probe; all when empty")
    args = p.parse_args(argv)
    try:
        ts = [int(x) for x in args.t.split(",")]
    except ValueError:
        print(f"error: --t: expected comma-separated integers, got {args.t!r}", file=sys.stderr)
        return 2
    parts = tuple(p for p in args.parts.split(",") if p)
    unknown = [p for p in parts if not any(k.startswith(p) or p.startswith(k) for k in PARTS)]
    if unknown:
        print(f"error: --parts: {', '.join(unknown)} names no part (parts: {', '.join(PARTS)}, each matmul with "
              f":qkv, :down or :lm_head)", file=sys.stderr)
        return 2
    shape = SMOKE if args.smoke else QWEN3_8B
    implementations = ["pallas", "reference"] if on_gpu() or args.smoke else ["reference"]
    args.out.mkdir(parents=True, exist_ok=True)
    print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}, {args.dtype}; shape {shape}", flush=True)
    rows = probe(shape, ts, jnp.dtype(args.dtype), implementations, jax.random.PRNGKey(0), parts=parts)
    result = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "python": platform.python_version(),
              "date": time.strftime("%Y-%m-%d"), "command": " ".join(sys.argv), "dtype": args.dtype, "shape": shape,
              "rows": rows}
    path = args.out / "bitwise_probe.json"
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(result, indent=1))
    print(f"\n{'part':>32} {'impl':>10} {'T':>4} {'rows differing':>15} {'max |diff|':>11}")
    for r in rows:
        print(f"{r['part']:>32} {r['implementation']:>10} {r['t']:>4} "
              f"{str(r.get('rows_differing', '-')) + ' / ' + str(r.get('rows', '-')):>15} "
              f"{r.get('max_abs_diff', float('nan')):11.3g} {r.get('error', '')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
