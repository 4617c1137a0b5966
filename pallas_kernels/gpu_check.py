"""GPU check of the Pallas kernels: correctness against the references and time against them.

    python -m pallas_kernels.gpu_check --out DIR [--quick] [--repeats N]
    python -m pallas_kernels.gpu_check --out DIR --smoke      # tiny shapes, interpreted: runs on a CPU

At Qwen3-8B shapes, batch 1 (32 query heads, 8 KV heads, head dim 128, a 2048-slot cache holding 2048
committed tokens; vocabulary 151936):
- tree_attention for T in {1, 16, 65, 257, 513} new tokens (a chain for 16, random trees otherwise):
  relative error ||out - ref|| / ||ref|| in bf16 and float32; time of the kernel (default config and,
  without --quick, a few others), of the jitted jnp reference, and of `jax.nn.dot_product_attention`
  (xla and cudnn) on the cache and the new tokens concatenated beforehand, with a boolean mask.
- tree_accept for T in {17, 65, 257, 513} nodes: exact agreement of (path, count, bonus, tokens) and of
  the decoded tokens with the reference in bf16 and float32 logits; time of the kernel path, of the
  reference, of the argmax kernel alone and of jnp.argmax alone.
Run time on an H200 not yet measured (an estimate: a few minutes); --quick and --only shorten it.
Times: median over rounds of `--calls` back-to-back calls of a jitted function (compilation and a
warm-up excluded), so dispatch overlaps the device work; reported per call in microseconds, with
the HBM bandwidth and matrix rate that the bytes and flops imply. A variant that fails to lower or
run is recorded with its error and the script goes on. The JSON holds every record.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import statistics
import sys
import time
import traceback
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import tree_accept as tac
from pallas_kernels import tree_attention as ta

# Shapes (Qwen3-8B, batch 1).
FULL = dict(b=1, hq=32, n=8, d=128, s=2048, length=2048, attn_t=(1, 16, 65, 257, 513),
            vocab=151936, accept_t=(17, 65, 257, 513), path_len=16)
SMOKE = dict(b=1, hq=4, n=2, d=16, s=40, length=37, attn_t=(1, 5), vocab=300, accept_t=(5, 17), path_len=4)

# Alternatives to the defaults (block_q=64, block_k=64, block_u=32, 4 warps, 2 stages); offline compiles
# (pallas_kernels.triton_offline) put all of them within sm_90's shared memory.
ATTN_SWEEP = [
    ta.TreeAttentionConfig(block_q=16),
    ta.TreeAttentionConfig(block_q=32),
    ta.TreeAttentionConfig(num_warps=8),
    ta.TreeAttentionConfig(block_q=128, num_warps=8),
    ta.TreeAttentionConfig(block_k=32),
    ta.TreeAttentionConfig(block_k=128, num_warps=8),
    ta.TreeAttentionConfig(num_stages=1),
    ta.TreeAttentionConfig(num_stages=3),
]
ACCEPT_SWEEP = [
    tac.TreeAcceptConfig(block_t=16, block_v=512),
    tac.TreeAcceptConfig(block_t=4, block_v=2048),
    tac.TreeAcceptConfig(block_t=8, block_v=1024, num_warps=8),
    tac.TreeAcceptConfig(block_t=8, block_v=2048, num_warps=8),
]


def error_text(exc: BaseException, limit: int = 1500) -> str:
    text = f"{type(exc).__name__}: {exc}"
    return text if len(text) <= limit else text[: limit // 2] + " ... " + text[-limit // 2:]


def time_us(fn, args, *, rounds: int, calls: int) -> float:
    """Median per-call time (us) over `rounds` rounds of `calls` back-to-back calls; one warm-up round first."""
    jax.block_until_ready(fn(*args))
    samples = []
    for _ in range(rounds):
        start = time.perf_counter()
        out = None
        for _ in range(calls):
            out = fn(*args)
        jax.block_until_ready(out)
        samples.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(samples)


def rel_err(out, ref) -> float:
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30))


def random_tree(rng: np.random.Generator, t: int, max_depth: int, chain: bool):
    """(ancestor mask [t, t], depths [t]) of a chain or of a random tree of depth <= max_depth."""
    mask = np.eye(t, dtype=bool)
    depths = np.zeros(t, np.int64)
    parents = np.zeros(t, np.int64)
    for i in range(1, t):
        if chain:
            p = i - 1
        else:
            while True:
                p = int(rng.integers(0, i))
                if depths[p] < max_depth:
                    break
        parents[i], depths[i] = p, depths[p] + 1
        mask[i] = mask[p]
        mask[i, i] = True
    return mask, depths, parents


def attention_inputs(shape: dict, t: int, dtype, seed: int):
    rng = np.random.default_rng(seed)
    b, hq, n, d, s, length = (shape[k] for k in ("b", "hq", "n", "d", "s", "length"))

    def normal(*dims):
        return jnp.asarray(rng.standard_normal(dims, np.float32)).astype(dtype)

    mask, depths, _ = random_tree(rng, t, shape["path_len"] - 1, chain=(t == 16))
    return dict(q=normal(b, t, hq, d), k_cache=normal(b, s, n, d), v_cache=normal(b, s, n, d),
                cache_lengths=jnp.full((b,), length, jnp.int32), k_new=normal(b, t, n, d), v_new=normal(b, t, n, d),
                new_mask=jnp.asarray(np.broadcast_to(mask, (b, t, t))),
                positions=jnp.asarray(np.broadcast_to(length + depths, (b, t)), jnp.int32))


def dpa_inputs(x: dict):
    """Cache and new tokens concatenated, with the [b, 1, t, s + t] boolean mask that cached_attention implies."""
    b, t = x["q"].shape[:2]
    s = x["k_cache"].shape[1]
    keys = jnp.concatenate([x["k_cache"], x["k_new"]], axis=1)
    values = jnp.concatenate([x["v_cache"], x["v_new"]], axis=1)
    seen_cache = jnp.broadcast_to(jnp.arange(s)[None, None, :] < x["cache_lengths"][:, None, None], (b, t, s))
    mask = jnp.concatenate([seen_cache, x["new_mask"]], axis=-1)[:, None]
    return x["q"], keys, values, mask


def check_attention(shape: dict, *, interpret: bool, sweep: bool, rounds: int, calls: int) -> list[dict]:
    records = []
    d = shape["d"]
    scale = d ** -0.5
    flop_per_t = 4 * shape["hq"] * d  # q.k and p.v per (query, key) pair and head
    for t in shape["attn_t"]:
        for dtype in (jnp.bfloat16, jnp.float32):
            name = jnp.dtype(dtype).name
            x = attention_inputs(shape, t, dtype, seed=t)
            keys_seen = shape["length"] + t
            cache_bytes = 2 * shape["length"] * shape["n"] * d * jnp.dtype(dtype).itemsize
            flops = flop_per_t * t * keys_seen
            base = dict(kernel="tree_attention", dtype=name, t=t, b=shape["b"], hq=shape["hq"], n=shape["n"], d=d,
                        s=shape["s"], length=shape["length"], bytes_kv=cache_bytes, flops=flops)
            ref_fn = jax.jit(functools.partial(ta.tree_attention_reference, scale=scale))
            with jax.default_matmul_precision("highest"):
                ref = jax.block_until_ready(jax.jit(functools.partial(ta.tree_attention_reference, scale=scale))(**x))
            configs = [ta.TreeAttentionConfig()] + (ATTN_SWEEP if sweep and dtype == jnp.bfloat16 else [])
            for config in configs:
                rec = dict(base, variant="pallas", config=repr(config))
                try:
                    fn = jax.jit(functools.partial(ta.tree_attention_pallas, scale=scale, config=config,
                                                   interpret=interpret))
                    out = jax.block_until_ready(fn(**x))
                    rec.update(rel_err=rel_err(out, ref), finite=bool(np.isfinite(np.asarray(out, np.float32)).all()))
                    rec["us"] = time_us(_kw(fn, x), (), rounds=rounds, calls=calls)
                    rec["status"] = "ok"
                except Exception as exc:  # noqa: BLE001 - record and go on
                    rec.update(status="error", error=error_text(exc))
                records.append(rec)
            rec = dict(base, variant="reference", config="")
            try:
                out = jax.block_until_ready(ref_fn(**x))
                rec.update(rel_err=rel_err(out, ref), us=time_us(_kw(ref_fn, x), (), rounds=rounds, calls=calls),
                           status="ok")
            except Exception as exc:  # noqa: BLE001
                rec.update(status="error", error=error_text(exc))
            records.append(rec)
            q, keys, values, mask = dpa_inputs(x)
            for impl in ("xla", "cudnn"):
                rec = dict(base, variant=f"dot_product_attention[{impl}]", config="k/v concatenated beforehand")
                try:
                    fn = jax.jit(functools.partial(jax.nn.dot_product_attention, scale=scale, implementation=impl))
                    out = jax.block_until_ready(fn(q, keys, values, None, mask))
                    rec.update(rel_err=rel_err(out, ref),
                               us=time_us(fn, (q, keys, values, None, mask), rounds=rounds, calls=calls), status="ok")
                except Exception as exc:  # noqa: BLE001
                    rec.update(status="error", error=error_text(exc))
                records.append(rec)
    for rec in records:
        if rec.get("status") == "ok":
            rec["tb_per_s"] = rec["bytes_kv"] / (rec["us"] * 1e-6) / 1e12
            rec["tflop_per_s"] = rec["flops"] / (rec["us"] * 1e-6) / 1e12
    return records


def _kw(fn, kwargs: dict):
    return lambda: fn(**kwargs)


def accept_inputs(shape: dict, t: int, dtype, seed: int):
    """Random tree of t nodes, logits under which a random root path is accepted (argmax planted)."""
    rng = np.random.default_rng(seed)
    vocab, p = shape["vocab"], shape["path_len"]
    _, depths, parents = random_tree(rng, t, p - 1, chain=False)
    tokens = rng.integers(0, vocab, size=t)
    decoded = rng.integers(0, vocab, size=t)
    node = int(np.argmax(depths))
    while node != 0:
        decoded[parents[node]] = tokens[node]
        node = int(parents[node])
    logits = rng.standard_normal((1, t, vocab), np.float32)
    logits[0, np.arange(t), decoded] = 8.0
    return (jnp.asarray(logits).astype(dtype), jnp.asarray(tokens[None], jnp.int32),
            jnp.asarray(parents[None], jnp.int32), jnp.asarray(depths[None], jnp.int32), jnp.ones((1, t), bool))


def check_accept(shape: dict, *, interpret: bool, sweep: bool, rounds: int, calls: int) -> list[dict]:
    records = []
    p = shape["path_len"]
    for t in shape["accept_t"]:
        for dtype in (jnp.bfloat16, jnp.float32):
            name = jnp.dtype(dtype).name
            args = accept_inputs(shape, t, dtype, seed=t)
            base = dict(kernel="tree_accept", dtype=name, t=t, vocab=shape["vocab"], path_len=p,
                        bytes_logits=t * shape["vocab"] * jnp.dtype(dtype).itemsize)
            ref_fn = jax.jit(functools.partial(tac.tree_accept_reference, path_len=p))
            ref = jax.block_until_ready(ref_fn(*args))
            decoded_ref = jnp.argmax(args[0], axis=-1)
            configs = [tac.TreeAcceptConfig()] + (ACCEPT_SWEEP if sweep and dtype == jnp.bfloat16 else [])
            for config in configs:
                for variant in ("pallas", "pallas argmax only"):
                    rec = dict(base, variant=variant, config=repr(config))
                    try:
                        if variant == "pallas":
                            fn = jax.jit(functools.partial(tac.tree_accept_pallas, path_len=p, config=config,
                                                           interpret=interpret))
                            out = jax.block_until_ready(fn(*args))
                            rec["exact"] = all(bool((np.asarray(a) == np.asarray(r)).all()) for a, r in zip(out, ref))
                            rec["count"] = int(out.count[0])
                            fn_args = args
                        else:
                            fn = jax.jit(functools.partial(tac.greedy_tokens_pallas, config=config,
                                                           interpret=interpret))
                            out = jax.block_until_ready(fn(args[0]))
                            rec["exact"] = bool((np.asarray(out) == np.asarray(decoded_ref)).all())
                            fn_args = args[:1]
                        rec.update(us=time_us(fn, fn_args, rounds=rounds, calls=calls), status="ok")
                    except Exception as exc:  # noqa: BLE001
                        rec.update(status="error", error=error_text(exc))
                    records.append(rec)
            for variant, fn, fn_args in (("reference", ref_fn, args),
                                         ("jnp.argmax only", jax.jit(lambda x: jnp.argmax(x, axis=-1)), args[:1])):
                rec = dict(base, variant=variant, config="")
                try:
                    rec.update(us=time_us(fn, fn_args, rounds=rounds, calls=calls), status="ok",
                               count=int(ref.count[0]) if variant == "reference" else None)
                except Exception as exc:  # noqa: BLE001
                    rec.update(status="error", error=error_text(exc))
                records.append(rec)
    for rec in records:
        if rec.get("status") == "ok":
            rec["tb_per_s"] = rec["bytes_logits"] / (rec["us"] * 1e-6) / 1e12
    return records


def print_table(records: list[dict]) -> None:
    header = f"{'kernel':<15}{'dtype':<9}{'T':>5}  {'variant':<31}{'us':>9}{'TB/s':>7}{'TF/s':>7}  {'check':<14}config"
    print(header)
    print("-" * len(header))
    for r in records:
        if r.get("status") != "ok":
            first_line = r.get("error", "").splitlines()[0] if r.get("error") else ""
            print(f"{r['kernel']:<15}{r['dtype']:<9}{r['t']:>5}  {r['variant']:<31}{'FAILED':>9}  {first_line[:120]}")
            continue
        if "rel_err" in r:
            check = f"rel {r['rel_err']:.1e}"
        elif "exact" in r:
            check = "exact" if r["exact"] else "MISMATCH"
        else:
            check = ""
        tf = f"{r['tflop_per_s']:7.1f}" if "tflop_per_s" in r else " " * 7
        cfg = r.get("config", "")
        cfg = cfg.replace("TreeAttentionConfig", "").replace("TreeAcceptConfig", "")
        print(f"{r['kernel']:<15}{r['dtype']:<9}{r['t']:>5}  {r['variant']:<31}{r['us']:9.1f}{r['tb_per_s']:7.2f}{tf}"
              f"  {check:<14}{cfg}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pallas_kernels.gpu_check", description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="directory for gpu_check.json")
    parser.add_argument("--quick", action="store_true", help="default configs only (no sweep)")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, kernels interpreted (runs without a GPU)")
    parser.add_argument("--rounds", type=int, default=15, help="timing rounds (median taken)")
    parser.add_argument("--calls", type=int, default=20, help="back-to-back calls per timing round")
    parser.add_argument("--only", choices=("attention", "accept"), default=None, help="check one kernel only")
    args = parser.parse_args(argv)
    # jax >= 0.11 warns on every Triton-lowered pallas_call; the table is what this script is for.
    warnings.filterwarnings("ignore", message=".*Pallas Triton backend is deprecated.*")

    backend = jax.default_backend()
    if backend != "gpu" and not args.smoke:
        print(f"error: no GPU (backend {backend!r}); use --smoke for an interpreted run on tiny shapes",
              file=sys.stderr)
        return 2
    shape = SMOKE if args.smoke else FULL
    interpret = args.smoke
    rounds, calls = (2, 2) if args.smoke else (args.rounds, args.calls)
    sweep = not args.quick
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    env = dict(jax=jax.__version__, python=platform.python_version(), backend=backend,
               devices=[str(d.device_kind) for d in jax.devices()], smoke=args.smoke, shape=shape,
               rounds=rounds, calls=calls, kernels_env=os.environ.get("DDTREE_JAX_KERNELS"))
    print(json.dumps(env))

    records: list[dict] = []
    started = time.time()
    for name, check in (("attention", check_attention), ("accept", check_accept)):
        if args.only not in (None, name):
            continue
        try:
            records += check(shape, interpret=interpret, sweep=sweep, rounds=rounds, calls=calls)
        except Exception as exc:  # noqa: BLE001 - a broken input builder must not lose the other kernel
            records.append(dict(kernel=name, dtype="", t=0, variant="(setup)", status="error",
                                error=error_text(exc) + "\n" + traceback.format_exc(limit=5)))
    print_table(records)
    summary = dict(env, seconds=round(time.time() - started, 1), records=records)
    path = out_dir / "gpu_check.json"
    path.write_text(json.dumps(summary, indent=1, default=str))
    failed = sum(r.get("status") != "ok" for r in records)
    print(f"wrote {path} ({len(records)} records, {failed} failed, {summary['seconds']} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
