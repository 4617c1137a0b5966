"""GPU check of the Pallas kernels: correctness against the references, and time per layer against the floor.

    python tools/kernel_check.py --out DIR            # the full grid (issue 5), a few minutes on an H200
    python tools/kernel_check.py --out DIR --quick    # a corner of the grid, about a minute
    python tools/kernel_check.py --out DIR --smoke    # tiny shapes, kernels interpreted: runs on a CPU

Qwen3-8B shapes, batch 1: 32 query heads, 8 KV heads, head dim 128, vocabulary 151936.

How time is measured (device time per layer, not per call). A call's host dispatch grows with its
argument count: for a 36-layer program (about 200 arrays) it is several hundred microseconds on the H200,
more than the device work of the small points, and it overlaps nothing when the call is timed alone (an
earlier version of this script divided such call times by L and reported 27 us per layer where a
profiler trace of the same kernel showed 6.6 us). So every variant runs over L layers *inside one jitted
program* (L distinct layers' inputs, separate arrays as in the model, so no slice is copied and the caches
do not stay in L2: L=36 at S=1024 is 150 MB of K/V, at S=16384 2.4 GB), and the program repeats its L
layers a given number of times in a device loop, each pass's outputs feeding the next pass's queries.
Each call is timed alone, once with 1 pass and once with R passes (`--repeats`, default 8): time per
layer = (median t_R - median t_1) / ((R - 1) L), which cancels the dispatch (compilation and a warm-up
excluded). The loop's own per-pass cost is included, spread over the L layers.

Sections:
- ceilings: copy bandwidth (2 GiB bf16, `a*2+1`, bytes read + written) and bf16 matmul rate (8192^3),
  measured in the same run by `ddtree_jax.measure.ceilings.measure_ceilings`.
- attention (timing): S in {1024, 4096, 16384} (cache length == S) x T in {1, 16, 65, 257} (a chain for
  T=16, random trees of depth <= 15 otherwise), bf16: the Pallas kernel, the jnp reference under XLA,
  and `jax.nn.dot_product_attention` with implementation "xla" and "cudnn" on cache and new tokens
  concatenated beforehand with a boolean [b, 1, T, S+T] mask. Each row: us per layer, the floor
  max(bytes / copy bandwidth, FLOPs / matmul rate) with bytes = K/V cache + q, k/v new, output, mask and
  FLOPs = 4 * Hq * D * T * (S + T), the ratio to it, and the relative error against the reference.
- attention (correctness): batch 2 with rows of different lengths (S=4096, lengths 4096 and 1371), T in
  {1, 16, 65, 257, 513}, bf16 and float32, one layer: kernel vs the reference at highest precision.
- accept (timing + exactness): T in {17, 65, 257, 513} nodes, float32 (what the engine's logits are) and
  bf16 logits, copies of independent [1, T, V] logits so that their total (>= 256 MiB) is several times
  the L2: the fused Pallas path vs the XLA argmax-plus-walk reference; exact agreement of every output;
  floor = logit bytes / copy bandwidth.
cuDNN's attention takes only bf16/fp16: any other dtype is recorded as "n/a", not as a failure.
A variant that fails to lower or run is recorded with its error and the script goes on. Writes
DIR/kernel_check.json (every record) and DIR/kernel_check.md (the summary tables); exit status 1 if a
correctness check failed.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import platform
import sys
import time
import traceback
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from ddtree_jax.measure import costs
from ddtree_jax.measure.ceilings import ceilings_text, measure_ceilings
from ddtree_jax.measure.timing import in_loop_seconds
from pallas_kernels import tree_accept as tac
from pallas_kernels import tree_attention as ta

MIB = 1 << 20

# Qwen3-8B, batch 1. `layers`: L of the per-layer timing; `accept_bytes`: least total logit bytes of the
# copies timed together (the H200's L2 is 50 MB); `accept_copies`: bounds on their number.
FULL = dict(b=1, hq=32, n=8, d=128, vocab=151936, path_len=16, layers=36,
            s=(1024, 4096, 16384), t=(1, 16, 65, 257),
            check_s=4096, check_lengths=(4096, 1371), check_t=(1, 16, 65, 257, 513),
            accept_t=(17, 65, 257, 513), accept_bytes=256 * MIB, accept_copies=(8, 64))
QUICK = dict(FULL, s=(1024, 16384), t=(1, 257), check_t=(1, 65), accept_t=(17, 513))
SMOKE = dict(b=1, hq=4, n=2, d=16, vocab=300, path_len=4, layers=2,
             s=(40,), t=(1, 5), check_s=45, check_lengths=(45, 13), check_t=(5,),
             accept_t=(5, 17), accept_bytes=0, accept_copies=(2, 2))

# Alternatives to the kernels' defaults, timed with --sweep (bf16 only); offline compiles
# (tools/triton_offline.py) put all of them within sm_90's shared memory.
ATTN_SWEEP = [
    ta.TreeAttentionConfig(block_q=16),
    ta.TreeAttentionConfig(block_q=32),
    ta.TreeAttentionConfig(num_warps=8),
    ta.TreeAttentionConfig(block_q=128, num_warps=8),
    ta.TreeAttentionConfig(block_k=32),
    ta.TreeAttentionConfig(block_k=128, num_warps=8),
    ta.TreeAttentionConfig(block_q=128, block_k=128, num_warps=8),
    ta.TreeAttentionConfig(block_k=128, num_stages=3),
    ta.TreeAttentionConfig(num_stages=1),
    ta.TreeAttentionConfig(num_stages=2),
    ta.TreeAttentionConfig(num_chunks=8),
    ta.TreeAttentionConfig(num_chunks=16),
]
ACCEPT_SWEEP = [
    tac.TreeAcceptConfig(block_t=16, block_v=512),
    tac.TreeAcceptConfig(block_t=4, block_v=2048),
    tac.TreeAcceptConfig(block_t=8, block_v=1024, num_warps=8),
    tac.TreeAcceptConfig(block_t=8, block_v=2048, num_warps=8),
]

# ||out - ref|| / ||ref|| allowed (bf16 operands land between 1e-3 and 1e-2; float32 far under 1e-4).
TOLERANCE = {"bfloat16": 2e-2, "float32": 1e-4}
CUDNN_DTYPES = ("bfloat16", "float16")


def error_text(exc: BaseException, limit: int = 1500) -> str:
    text = f"{type(exc).__name__}: {exc}"
    return text if len(text) <= limit else text[: limit // 2] + " ... " + text[-limit // 2:]


def log(message: str) -> None:
    print(message, flush=True)


# ----------------------------------------------------------------------------------------------------
# Timing


def compile_program(fn, args: tuple):
    """AOT-compile fn for these arguments; returns (compiled, seconds)."""
    start = time.perf_counter()
    compiled = jax.jit(fn).lower(*args).compile()
    return compiled, time.perf_counter() - start


def time_program(compiled, args: tuple, units: int, *, rounds: int, repeats: int = 8) -> float:
    """Device seconds per unit (layer or copy) of a program built by `attention_program`, `dpa_program` or
    `accept_program`, whose last argument is how many times it runs its units back to back on the device:
    `measure.timing.in_loop_seconds` over `rounds` calls of 1 and of `repeats` passes, divided by the units
    (a 36-layer program's dispatch is hundreds of microseconds, more than the device work of small points)."""
    return in_loop_seconds(lambda n: compiled(*args, jnp.int32(n)), rounds, iterations=repeats)[0] / units


def rel_err(out, ref) -> float:
    """||out - ref|| / ||ref|| over matching lists (or single arrays) of outputs, in float64."""
    outs, refs = (out, ref) if isinstance(out, (list, tuple)) else ([out], [ref])
    num = sum(float(np.sum((np.asarray(o, np.float64) - np.asarray(r, np.float64)) ** 2)) for o, r in zip(outs, refs))
    den = sum(float(np.sum(np.asarray(r, np.float64) ** 2)) for r in refs)
    return math.sqrt(num) / max(math.sqrt(den), 1e-30)


def all_finite(outs) -> bool:
    return all(bool(np.isfinite(np.asarray(o, np.float32)).all()) for o in outs)


# ----------------------------------------------------------------------------------------------------
# Inputs: drawn on the device, one small cached jitted initialiser per (shape, dtype)


@functools.lru_cache(maxsize=None)
def _normal(shape: tuple, dtype: str):
    return jax.jit(lambda key: jax.random.normal(key, shape, jnp.float32).astype(dtype))


def normal(key, shape: tuple, dtype) -> jax.Array:
    return _normal(tuple(shape), jnp.dtype(dtype).name)(key)


@jax.jit
def _concat_new(cache, new):
    return jnp.concatenate([cache, new], axis=1)


@jax.jit
def _plant(logits, decoded):
    """logits [1, t, v] with logit 8 at each node's `decoded` token (above every standard normal draw here)."""
    return logits.at[0, jnp.arange(logits.shape[1]), decoded].set(jnp.asarray(8.0, logits.dtype))


def random_tree(rng: np.random.Generator, t: int, max_depth: int, chain: bool):
    """(ancestor mask [t, t], depths [t], parents [t]) of a chain or of a random tree of depth <= max_depth."""
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


def tree_arrays(shape: dict, b: int, t: int, lengths, seed: int) -> dict:
    """The inputs every layer shares: cache lengths, the tree's mask and positions (a chain for t == 16)."""
    rng = np.random.default_rng(seed)
    mask, depths, _ = random_tree(rng, t, shape["path_len"] - 1, chain=(t == 16))
    lengths = np.asarray(lengths, np.int32)
    return dict(cache_lengths=jnp.asarray(lengths), new_mask=jnp.asarray(np.broadcast_to(mask, (b, t, t))),
                positions=jnp.asarray(lengths[:, None] + depths[None, :], jnp.int32))


def layer_arrays(shape: dict, b: int, s: int, t: int, dtype, layers: int, seed: int) -> dict:
    """Per-layer q, k/v cache, k/v new: tuples of `layers` distinct arrays each."""
    hq, n, d = shape["hq"], shape["n"], shape["d"]
    key = jax.random.key(seed)
    dims = dict(q=(b, t, hq, d), k_cache=(b, s, n, d), v_cache=(b, s, n, d), k_new=(b, t, n, d), v_new=(b, t, n, d))
    return {name: tuple(normal(jax.random.fold_in(key, 8 * i + j), dim, dtype) for i in range(layers))
            for j, (name, dim) in enumerate(dims.items())}


def dpa_mask(shared: dict, s: int) -> jax.Array:
    """[b, 1, t, s + t] bool: the cache slots below each row's length, then the tree's mask."""
    lengths, new_mask = shared["cache_lengths"], shared["new_mask"]
    b, t, _ = new_mask.shape
    seen_cache = jnp.broadcast_to(jnp.arange(s)[None, None, :] < lengths[:, None, None], (b, t, s))
    return jnp.concatenate([seen_cache, new_mask], axis=-1)[:, None]


# ----------------------------------------------------------------------------------------------------
# Programs: L layers back to back in one jitted function


def attention_program(layer_fn, layers: int):
    """L layers back to back, `repeats` passes (a device loop; each pass's outputs are the next pass's
    queries, so no pass can be hoisted or skipped). Returns the last pass's outputs."""
    def run(q, k_cache, v_cache, k_new, v_new, cache_lengths, new_mask, positions, repeats):
        def one_pass(_, qs):
            return tuple(layer_fn(qs[i], k_cache[i], v_cache[i], cache_lengths, k_new[i], v_new[i], new_mask,
                                  positions).astype(qs[i].dtype) for i in range(layers))
        return jax.lax.fori_loop(0, repeats, one_pass, tuple(q))
    return run


def dpa_program(implementation: str, scale: float, layers: int):
    def run(q, keys, values, mask, repeats):
        def one_pass(_, qs):
            return tuple(jax.nn.dot_product_attention(qs[i], keys[i], values[i], None, mask, scale=scale,
                                                      implementation=implementation).astype(qs[i].dtype)
                         for i in range(layers))
        return jax.lax.fori_loop(0, repeats, one_pass, tuple(q))
    return run


def accept_program(accept_fn, copies: int):
    """`copies` acceptances over independent logits, `repeats` passes. Each pass depends on the previous
    pass's counts (through a term that is always 0, which XLA cannot know), and its logits pass through an
    optimization barrier with that term, so no part of a pass (the reference's argmax over the logits
    either) can be hoisted out of the loop. Returns the last pass's outputs."""
    def run(logits, tokens, parents, depths, valid, repeats):
        def once(salt):
            outs = []
            for i in range(copies):
                lg, salt_i = jax.lax.optimization_barrier((logits[i], salt))
                outs.append(accept_fn(lg, tokens + salt_i, parents, depths, valid))
            return tuple(outs)

        def one_pass(_, carry):
            outs = once(carry[0])
            salt = sum(jnp.where(o.count < 0, 1, 0).sum() for o in outs).astype(tokens.dtype)
            return salt, outs

        init = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), jax.eval_shape(once, jnp.zeros((), tokens.dtype)))
        return jax.lax.fori_loop(0, repeats, one_pass, (jnp.zeros((), tokens.dtype), init))[1]
    return run


# ----------------------------------------------------------------------------------------------------
# Sections


def attention_cost(shape: dict, b: int, s: int, t: int, dtype) -> tuple[int, int]:
    """(bytes, FLOPs) of one layer's tree attention (`measure.costs.attention_cost`)."""
    return costs.attention_cost(b, s, t, shape["hq"], shape["n"], shape["d"], jnp.dtype(dtype).itemsize)


def time_attention(shape: dict, ceilings: dict, records: list, save, *, interpret: bool, sweep: bool, rounds: int,
                   repeats: int, dtype=jnp.bfloat16, configs: tuple | None = None, alternatives: bool = True) -> None:
    """configs: the Pallas variants timed beside the default (None: ATTN_SWEEP with `sweep`, else none).
    alternatives: also time the jnp reference and dot_product_attention (else the reference only checks)."""
    variants = [ta.TreeAttentionConfig()] + list(configs if configs is not None else ATTN_SWEEP if sweep else [])
    b, layers, d = shape["b"], shape["layers"], shape["d"]
    scale = d ** -0.5
    name = jnp.dtype(dtype).name
    on_gpu = jax.default_backend() == "gpu"
    for s in shape["s"]:
        for t in shape["t"]:
            point_start = time.perf_counter()
            bytes_, flops = attention_cost(shape, b, s, t, dtype)
            floor, bound = costs.floor(bytes_, flops, ceilings)
            base = dict(section="attention", kernel="tree_attention", dtype=name, s=s, length=s, t=t, b=b,
                        hq=shape["hq"], n=shape["n"], d=d, layers=layers, bytes=bytes_, flops=flops,
                        floor_us=floor * 1e6, bound=bound)
            records_here = []

            def run_variant(variant: str, config: str, fn, args, reference=None, timed: bool = True):
                rec = dict(base, variant=variant, config=config)
                try:
                    compiled, rec["compile_s"] = compile_program(fn, args + (jnp.int32(1),))
                    outs = jax.block_until_ready(compiled(*args, jnp.int32(1)))
                    rec["finite"] = all_finite(outs)
                    if reference is not None:
                        rec["rel_err"] = rel_err(outs, reference)
                        rec["check_ok"] = rec["finite"] and rec["rel_err"] <= TOLERANCE[name]
                    if not timed:
                        return outs
                    seconds = time_program(compiled, args, layers, rounds=rounds, repeats=repeats)
                    rec.update(us=seconds * 1e6, repeats=repeats, status="ok")
                    rec["ratio"] = rec["us"] / rec["floor_us"]
                except Exception as exc:  # noqa: BLE001 - record and go on
                    rec.update(status="error", error=error_text(exc))
                    outs = None
                records_here.append(rec)
                return outs

            try:
                shared = tree_arrays(shape, b, t, [s] * b, seed=t)
                x = layer_arrays(shape, b, s, t, dtype, layers, seed=1000 * s + t)
                args = (x["q"], x["k_cache"], x["v_cache"], x["k_new"], x["v_new"], shared["cache_lengths"],
                        shared["new_mask"], shared["positions"])
                ref_fn = attention_program(functools.partial(ta.tree_attention_reference, scale=scale), layers)
                reference = run_variant("reference (jnp, XLA)", "", ref_fn, args, timed=alternatives)
                for config in variants:
                    fn = attention_program(functools.partial(ta.tree_attention_pallas, scale=scale, config=config,
                                                             interpret=interpret), layers)
                    run_variant("pallas", _short(config), fn, args, reference)
                if not alternatives:
                    records_here = [r for r in records_here if r["variant"] != "reference (jnp, XLA)"]
                    raise _Skip
                # dot_product_attention sees the cache and the new tokens concatenated beforehand.
                q = x["q"]
                keys = tuple(_concat_new(k, kn) for k, kn in zip(x["k_cache"], x["k_new"]))
                values = tuple(_concat_new(v, vn) for v, vn in zip(x["v_cache"], x["v_new"]))
                del x, args
                mask = dpa_mask(shared, s)
                for impl in ("xla", "cudnn"):
                    variant = f"dot_product_attention[{impl}]"
                    if impl == "cudnn" and (interpret or not on_gpu or name not in CUDNN_DTYPES):
                        why = ("needs a GPU" if not on_gpu else "smoke run" if interpret
                               else f"cuDNN attention takes only bf16/fp16, not {name}")
                        records_here.append(dict(base, variant=variant, config="", status="n/a", note=why))
                        continue
                    run_variant(variant, "k/v concatenated beforehand, boolean mask",
                                dpa_program(impl, scale, layers), (q, keys, values, mask), reference)
                del q, keys, values, mask, reference
            except _Skip:
                pass
            except Exception as exc:  # noqa: BLE001 - a broken input builder must not lose the other points
                records_here.append(dict(base, variant="(setup)", config="", status="error",
                                         error=error_text(exc) + "\n" + traceback.format_exc(limit=5)))
            records += records_here
            save()
            log(f"attention S={s} T={t}: floor {floor * 1e6:.1f} us ({bound}); "
                + "; ".join(f"{r['variant']} {r['us']:.1f} us" if r.get("status") == "ok" else
                            f"{r['variant']} {r.get('status')}" for r in records_here)
                + f"  [{time.perf_counter() - point_start:.1f} s]")


class _Skip(Exception):
    """The rest of an attention point is not wanted (--no-alternatives)."""


def check_attention(shape: dict, records: list, save, *, interpret: bool) -> None:
    """Batch 2, rows of different lengths, bf16 and float32: one layer against the reference at highest precision."""
    b, s, d = len(shape["check_lengths"]), shape["check_s"], shape["d"]
    scale = d ** -0.5
    for t in shape["check_t"]:
        for dtype in (jnp.bfloat16, jnp.float32):
            name = jnp.dtype(dtype).name
            rec = dict(section="attention check", kernel="tree_attention", dtype=name, s=s,
                       lengths=list(shape["check_lengths"]), t=t, b=b, variant="pallas",
                       config=_short(ta.TreeAttentionConfig()))
            try:
                shared = tree_arrays(shape, b, t, shape["check_lengths"], seed=7 * t + 1)
                x = {k: v[0] for k, v in layer_arrays(shape, b, s, t, dtype, 1, seed=31 * t + 3).items()}
                x.update(shared)
                with jax.default_matmul_precision("highest"):
                    ref = jax.block_until_ready(
                        jax.jit(functools.partial(ta.tree_attention_reference, scale=scale))(**x))
                fn = jax.jit(functools.partial(ta.tree_attention_pallas, scale=scale, interpret=interpret))
                out = jax.block_until_ready(fn(**x))
                rec.update(rel_err=rel_err(out, ref), finite=all_finite([out]), status="ok")
                rec["check_ok"] = rec["finite"] and rec["rel_err"] <= TOLERANCE[name]
            except Exception as exc:  # noqa: BLE001
                rec.update(status="error", error=error_text(exc))
            records.append(rec)
            save()
            log(f"attention check T={t} {name} lengths {shape['check_lengths']}: "
                + (f"rel err {rec['rel_err']:.1e} {'ok' if rec['check_ok'] else 'MISMATCH'}"
                   if rec["status"] == "ok" else rec["error"].splitlines()[0][:200]))


def accept_copies(shape: dict, t: int, dtype) -> int:
    per_copy = t * shape["vocab"] * jnp.dtype(dtype).itemsize
    low, high = shape["accept_copies"]
    return max(low, min(high, math.ceil(shape["accept_bytes"] / per_copy)))


def time_accept(shape: dict, ceilings: dict, records: list, save, *, interpret: bool, sweep: bool,
                rounds: int, repeats: int) -> None:
    p, vocab = shape["path_len"], shape["vocab"]
    for t in shape["accept_t"]:
        for dtype in (jnp.float32, jnp.bfloat16):
            name = jnp.dtype(dtype).name
            copies = accept_copies(shape, t, dtype)
            bytes_ = t * vocab * jnp.dtype(dtype).itemsize + 6 * t * 4
            floor, bound = costs.floor(bytes_, 0, ceilings)
            base = dict(section="accept", kernel="tree_accept", dtype=name, t=t, vocab=vocab, path_len=p,
                        copies=copies, bytes=bytes_, floor_us=floor * 1e6, bound=bound)
            here = []
            try:
                rng = np.random.default_rng(t)
                _, depths, parents = random_tree(rng, t, p - 1, chain=False)
                tokens = rng.integers(0, vocab, size=t)
                decoded = rng.integers(0, vocab, size=t)
                node = int(np.argmax(depths))  # plant the root path of the first deepest node
                while node != 0:
                    decoded[parents[node]] = tokens[node]
                    node = int(parents[node])
                key = jax.random.key(10_000 + t)
                decoded_dev = jnp.asarray(decoded, jnp.int32)
                logits = tuple(_plant(normal(jax.random.fold_in(key, i), (1, t, vocab), dtype), decoded_dev)
                               for i in range(copies))
                tree = (jnp.asarray(tokens[None], jnp.int32), jnp.asarray(parents[None], jnp.int32),
                        jnp.asarray(depths[None], jnp.int32), jnp.ones((1, t), bool))
                args = (logits,) + tree
                expected_count = int(depths.max()) + 1
                variants = [("reference (XLA argmax + walk)", "",
                             functools.partial(tac.tree_accept_reference, path_len=p))]
                variants += [("pallas", _short(c), functools.partial(tac.tree_accept_pallas, path_len=p, config=c,
                                                                      interpret=interpret))
                             for c in [tac.TreeAcceptConfig()] + (ACCEPT_SWEEP if sweep and name == "bfloat16" else [])]
                reference = None
                for variant, config, fn in variants:
                    rec = dict(base, variant=variant, config=config)
                    try:
                        compiled, rec["compile_s"] = compile_program(accept_program(fn, copies),
                                                                     args + (jnp.int32(1),))
                        outs = jax.block_until_ready(compiled(*args, jnp.int32(1)))
                        counts = [int(o.count[0]) for o in outs]
                        rec["count"] = counts[0]
                        rec["count_ok"] = all(c == expected_count for c in counts)
                        if reference is None:
                            reference = outs
                        else:
                            rec["exact"] = all(bool((np.asarray(a) == np.asarray(r)).all())
                                               for o, ro in zip(outs, reference) for a, r in zip(o, ro))
                        rec["check_ok"] = rec["count_ok"] and rec.get("exact", True)
                        seconds = time_program(compiled, args, copies, rounds=rounds, repeats=repeats)
                        rec.update(us=seconds * 1e6, repeats=repeats, status="ok")
                        rec["ratio"] = rec["us"] / rec["floor_us"]
                    except Exception as exc:  # noqa: BLE001
                        rec.update(status="error", error=error_text(exc))
                    here.append(rec)
                del logits, args, reference
            except Exception as exc:  # noqa: BLE001
                here.append(dict(base, variant="(setup)", config="", status="error",
                                 error=error_text(exc) + "\n" + traceback.format_exc(limit=5)))
            records += here
            save()
            log(f"accept T={t} {name} x{copies}: floor {floor * 1e6:.1f} us; "
                + "; ".join(f"{r['variant']} {r['us']:.1f} us{'' if r.get('check_ok') else ' MISMATCH'}"
                            if r.get("status") == "ok" else f"{r['variant']} {r.get('status')}" for r in here))


def _short(config) -> str:
    return repr(config).replace("TreeAttentionConfig", "").replace("TreeAcceptConfig", "")


# ----------------------------------------------------------------------------------------------------
# Report


def _cell(rec: dict | None, floor_us: float | None = None) -> str:
    if rec is None:
        return "-"
    if rec.get("status") == "n/a":
        return "n/a"
    if rec.get("status") != "ok":
        return "FAILED"
    text = f"{rec['us']:.1f}"
    if floor_us:
        text += f" ({rec['us'] / floor_us:.2f}x)"
    if rec.get("check_ok") is False:
        text += " MISMATCH"
    return text


def summary_markdown(records: list[dict], env: dict) -> str:
    lines = []
    ceil = env.get("ceilings") or {}
    if ceil:

        lines.append(ceilings_text(ceil).replace("Measured ceilings", "Ceilings measured in this run"))
        lines.append("")
    att = [r for r in records if r.get("section") == "attention"]
    if att:
        lines.append(f"Tree attention, device microseconds per layer ({env.get('layers')} layers per pass, "
                     f"{env.get('repeats', 1)} passes against 1 in one "
                     "program), bf16, batch 1, cache length = S; in brackets: time / floor.")
        lines.append("")
        lines.append("| S | T | floor us (bound) | pallas | reference (XLA) | dpa xla | dpa cudnn | "
                     "pallas vs cudnn | goal <= 1.5x floor | faster than cudnn |")
        lines.append("|---|---|---|---|---|---|---|---|---|---|")
        points = list(dict.fromkeys((r["s"], r["t"]) for r in att))
        for s, t in points:
            rows = [r for r in att if (r["s"], r["t"]) == (s, t)]
            pick = lambda v: next((r for r in rows if r["variant"] == v), None)  # noqa: E731
            pallas = next((r for r in rows if r["variant"] == "pallas"), None)  # the default config comes first
            cudnn = pick("dot_product_attention[cudnn]")
            floor_us = rows[0]["floor_us"]
            ok = lambda r: r is not None and r.get("status") == "ok"  # noqa: E731
            versus = f"{pallas['us'] / cudnn['us']:.2f}x" if ok(pallas) and ok(cudnn) else "-"
            goal = ("met" if pallas["ratio"] <= 1.5 else "missed") if ok(pallas) else "-"
            faster = ("yes" if pallas["us"] < cudnn["us"] else "no") if ok(pallas) and ok(cudnn) else "-"
            lines.append(f"| {s} | {t} | {floor_us:.1f} ({rows[0]['bound']}) | {_cell(pallas, floor_us)} | "
                         f"{_cell(pick('reference (jnp, XLA)'), floor_us)} | "
                         f"{_cell(pick('dot_product_attention[xla]'), floor_us)} | {_cell(cudnn, floor_us)} | "
                         f"{versus} | {goal} | {faster} |")
        lines.append("")
    chk = [r for r in records if r.get("section") == "attention check"]
    if chk:
        lines.append("Tree attention correctness, batch 2 with rows of lengths "
                     f"{chk[0]['lengths']} (S={chk[0]['s']}), kernel vs reference at highest precision:")
        lines.append("")
        lines.append("| T | dtype | rel err | check |")
        lines.append("|---|---|---|---|")
        for r in chk:
            if r.get("status") == "ok":
                verdict = "ok" if r["check_ok"] else "MISMATCH"
                lines.append(f"| {r['t']} | {r['dtype']} | {r['rel_err']:.1e} | {verdict} |")
            else:
                lines.append(f"| {r['t']} | {r['dtype']} | - | FAILED |")
        lines.append("")
    acc = [r for r in records if r.get("section") == "accept"]
    if acc:
        lines.append(f"Tree acceptance (greedy), device microseconds per acceptance, V={acc[0]['vocab']} (copies "
                     f"per pass, {env.get('repeats', 1)} passes against 1 in one program); in brackets: time / "
                     "floor (logit bytes / bandwidth).")
        lines.append("")
        lines.append("| T | logits | copies | floor us | pallas (fused) | reference (XLA argmax + walk) | exact |")
        lines.append("|---|---|---|---|---|---|---|")
        for t, name in dict.fromkeys((r["t"], r["dtype"]) for r in acc):
            rows = [r for r in acc if (r["t"], r["dtype"]) == (t, name)]
            pallas = next((r for r in rows if r["variant"] == "pallas"), None)
            ref = next((r for r in rows if r["variant"].startswith("reference")), None)
            floor_us = rows[0]["floor_us"]
            exact = "yes" if all(r.get("check_ok") for r in rows if r.get("status") == "ok") else "NO"
            lines.append(f"| {t} | {name} | {rows[0]['copies']} | {floor_us:.1f} | {_cell(pallas, floor_us)} | "
                         f"{_cell(ref, floor_us)} | {exact} |")
        lines.append("")
    return "\n".join(lines)


def print_records(records: list[dict]) -> None:
    header = (f"{'section':<16}{'dtype':<9}{'S':>6}{'T':>5}  {'variant':<31}{'us':>9}{'floor':>8}{'ratio':>7}"
              f"  {'check':<14}config")
    log(header)
    log("-" * len(header))
    for r in records:
        head = f"{r['section']:<16}{r.get('dtype', ''):<9}{r.get('s', '-')!s:>6}{r.get('t', 0):>5}  {r['variant']:<31}"
        if r.get("status") == "n/a":
            log(f"{head}{'n/a':>9}  {r.get('note', '')}")
            continue
        if r.get("status") != "ok":
            first = r.get("error", "").splitlines()[0] if r.get("error") else ""
            log(f"{head}{'FAILED':>9}  {first[:120]}")
            continue
        if "rel_err" in r:
            check = f"rel {r['rel_err']:.1e}" + ("" if r.get("check_ok") else " BAD")
        elif "check_ok" in r:
            check = "exact" if r["check_ok"] else "MISMATCH"
        else:
            check = ""
        us = f"{r['us']:9.1f}" if "us" in r else " " * 9
        floor = f"{r['floor_us']:8.1f}" if "floor_us" in r else " " * 8
        ratio = f"{r['ratio']:7.2f}" if "ratio" in r else " " * 7
        log(f"{head}{us}{floor}{ratio}  {check:<14}{r.get('config', '')}")


# ----------------------------------------------------------------------------------------------------


def _sections(text: str) -> tuple[str, ...]:
    names = tuple(x for x in text.split(",") if x)
    bad = [x for x in names if x not in ("check", "accept", "attention")]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"expected a comma list of check, accept, attention; got {text!r}")
    return names


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x)


def _knob_value(text: str) -> int | bool:
    return text.lower() == "true" if text.lower() in ("true", "false") else int(text)


def _attention_configs(text: str) -> tuple[ta.TreeAttentionConfig, ...]:
    """'KNOB=V,KNOB=V;KNOB=V' -> one TreeAttentionConfig per ';'-separated item (the defaults plus its knobs; V an
    int, or true / false)."""
    try:
        return tuple(ta.TreeAttentionConfig(**{k: _knob_value(v) for k, v in (knob.split("=") for knob in
                                                                                item.split(","))})
                     for item in text.split(";") if item)
    except (TypeError, ValueError) as e:
        raise argparse.ArgumentTypeError(f"expected 'KNOB=N,...;KNOB=N,...' with TreeAttentionConfig knobs; got "
                                         f"{text!r} ({e})") from None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python tools/kernel_check.py", description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="directory for kernel_check.json and kernel_check.md")
    parser.add_argument("--quick", action="store_true",
                        help="S in {1024, 16384}, T in {1, 257}; checks at T in {1, 65}; acceptance at T in {17, 513}")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, kernels interpreted (runs without a GPU)")
    parser.add_argument("--sweep", action="store_true", help="also time the alternative kernel configs (slow)")
    parser.add_argument("--attention-configs", type=_attention_configs, default=None, metavar="KNOB=N,..;..",
                        help="attention: time these TreeAttentionConfig variants beside the default (instead of "
                             "--sweep's), e.g. 'num_chunks=32;block_k=32,num_stages=2;lean_steps=true'")
    parser.add_argument("--no-alternatives", action="store_true",
                        help="attention: skip the jnp reference's timing and dot_product_attention (XLA, cuDNN)")
    parser.add_argument("--only", type=_sections, default=None,
                        help="comma list of the sections to run (check, accept, attention; default all)")
    parser.add_argument("--s", type=_ints, default=None, help="comma list of cache lengths S (timing grid)")
    parser.add_argument("--t", type=_ints, default=None, help="comma list of new-token counts T (timing grid)")
    parser.add_argument("--accept-t", type=_ints, default=None, help="comma list of tree sizes for acceptance")
    parser.add_argument("--check-t", type=_ints, default=None, help="comma list of T for the correctness check")
    parser.add_argument("--layers", type=int, default=None, help="layers per timed program (default 36)")
    parser.add_argument("--rounds", type=int, default=7, help="timing rounds (median taken)")
    parser.add_argument("--repeats", type=int, default=8,
                        help="device passes of the long program (time per unit = difference to 1 pass)")
    args = parser.parse_args(argv)
    # jax >= 0.11 warns on every Triton-lowered pallas_call; the table is what this script is for.
    warnings.filterwarnings("ignore", message=".*Pallas Triton backend is deprecated.*")

    backend = jax.default_backend()
    if backend != "gpu" and not args.smoke:
        print(f"error: no GPU (backend {backend!r}); use --smoke for an interpreted run on tiny shapes",
              file=sys.stderr)
        return 2
    shape = dict(SMOKE if args.smoke else QUICK if args.quick else FULL)
    for key in ("s", "t", "accept_t", "check_t", "layers"):
        if getattr(args, key) is not None:
            shape[key] = getattr(args, key)
    interpret = args.smoke
    rounds = 3 if args.smoke else args.rounds
    repeats = args.repeats
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)

    started = time.time()

    ceilings = measure_ceilings(repeats=3 if args.smoke else 10, small=args.smoke)
    env = dict(jax=jax.__version__, python=platform.python_version(), backend=backend,
               devices=[str(d.device_kind) for d in jax.devices()], smoke=args.smoke, quick=args.quick,
               sweep=args.sweep, shape=shape, layers=shape["layers"], rounds=rounds, repeats=repeats,
               kernels_env=os.environ.get("DDTREE_JAX_KERNELS"), ceilings=ceilings,
               date=time.strftime("%Y-%m-%d"), argv=list(argv if argv is not None else sys.argv[1:]))
    log(json.dumps(env))
    log(f"{ceilings_text(ceilings)}  [{time.time() - started:.1f} s]")

    records: list[dict] = []
    seconds: dict = {}
    json_path, md_path = out_dir / "kernel_check.json", out_dir / "kernel_check.md"

    def save() -> None:
        """Write what is measured so far (a run cut short by a time limit keeps its finished points)."""
        summary = dict(env, seconds=round(time.time() - started, 1), section_seconds=seconds, records=records)
        json_path.write_text(json.dumps(summary, indent=1, default=str))
        md_path.write_text(summary_markdown(records, env) + "\n")

    # Correctness first, then the cheap acceptance timing, then the long attention grid (saved point by point).
    sections = (("check", lambda: check_attention(shape, records, save, interpret=interpret)),
                ("accept", lambda: time_accept(shape, ceilings, records, save, interpret=interpret,
                                               sweep=args.sweep, rounds=rounds, repeats=repeats)),
                ("attention", lambda: time_attention(shape, ceilings, records, save, interpret=interpret,
                                                     sweep=args.sweep, rounds=rounds, repeats=repeats,
                                                     configs=args.attention_configs,
                                                     alternatives=not args.no_alternatives)))
    for name, run in sections:
        if args.only is not None and name not in args.only:
            continue
        start = time.time()
        try:
            run()
        except Exception as exc:  # noqa: BLE001 - a broken section must not lose the others
            records.append(dict(section=name, variant="(setup)", status="error",
                                error=error_text(exc) + "\n" + traceback.format_exc(limit=5)))
        seconds[name] = round(time.time() - start, 1)
    save()
    print_records(records)
    log("")
    log(summary_markdown(records, env))
    total = round(time.time() - started, 1)
    failed = sum(r.get("status") == "error" for r in records)
    wrong = sum(r.get("check_ok") is False for r in records)
    log(f"wrote {json_path} and {md_path.name} ({len(records)} records, {failed} failed to run, {wrong} wrong, "
        f"{total} s; sections {seconds})")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
