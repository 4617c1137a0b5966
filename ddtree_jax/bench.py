"""`python -m ddtree_jax.bench`: time AR, DFlash and DDTree rounds, by stage, against hardware floors.

Two ways to run:
- `--shape qwen3-8b` (or qwen3-4b, qwen3-32b, tiny): random bf16 weights of that shape built on the
  device, a matching random drafter (5 layers, block 16), a cache filled with `--context` tokens. Times
  per round, separately and in total: draft, tree build, verify, accept, commit, for AR, DFlash and
  DDTree at `--budgets`. Random weights accept almost nothing, so tokens/s are also projected at a
  given tau (`--tau`, default the paper's MATH-500 Qwen3-8B values), marked as projected.
- `--target DIR --drafter DIR --prompts FILE.jsonl`: all modes on real prompts: tau, tokens/s, speedup
  over AR measured in the same run, and the first greedy divergence from AR.

The same run measures copy bandwidth and the bf16 matmul rate; every row prints its floor
(max(bytes / bandwidth, FLOPs / matmul rate)) and the ratio to it. Warm-up is excluded, times are
medians of repeats, each synchronised on the device. Writes a JSON file with every figure, a markdown
table and a plot (time per round against budget, with the floor).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

SHAPES = {
    # HF config fields of the targets; the drafter follows the published DFlash layout for each.
    "qwen3-8b": dict(hidden_size=4096, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                     head_dim=128, intermediate_size=12288, vocab_size=151936, tie_word_embeddings=False,
                     rope_theta=1e6),
    "qwen3-4b": dict(hidden_size=2560, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                     head_dim=128, intermediate_size=9728, vocab_size=151936, tie_word_embeddings=True,
                     rope_theta=1e6),
    "qwen3-32b": dict(hidden_size=5120, num_hidden_layers=64, num_attention_heads=64, num_key_value_heads=8,
                      head_dim=128, intermediate_size=25600, vocab_size=151936, tie_word_embeddings=False,
                      rope_theta=1e6),
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                 intermediate_size=128, vocab_size=320, tie_word_embeddings=False, rope_theta=1e4),
}
# The paper's Table 1, MATH-500, Qwen3-8B, T = 0: DFlash tau 7.79; DDTree tau 10.73 at its best budget.
# Per-budget values are not published; these defaults use the DDTree figure for every budget >= 64 and
# interpolate below. Override with --tau.
DEFAULT_TAU = {"ar": 1.0, "dflash": 7.79, 16: 9.0, 64: 10.73, 256: 10.73, 512: 10.73}


def _projected_tau(taus: dict, mode: str, budget: int | None) -> float:
    """tau for a mode (and DDTree budget): the given value, else the nearest smaller listed budget's."""
    if mode != "ddtree":
        return taus.get(mode, 1.0)
    budgets = sorted(k for k in taus if isinstance(k, int))
    below = [k for k in budgets if k <= budget]
    return taus[budget] if budget in taus else taus[below[-1] if below else budgets[0]]


def _median_seconds(fn, repeats: int, warmup: int = 2) -> float:
    import jax

    for _ in range(warmup):
        jax.block_until_ready(fn())
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure_ceilings(repeats: int, small: bool) -> dict:
    """Copy bandwidth (bytes read + written per second) and bf16 matmul FLOP/s on the default device."""
    import jax
    import jax.numpy as jnp

    n = 2**22 if small else 2**30  # elements of bf16: 8 MiB or 2 GiB
    x = jax.random.normal(jax.random.key(0), (n,), jnp.bfloat16)
    copy = jax.jit(lambda a: a * 2 + 1)
    bandwidth = 2 * x.nbytes / _median_seconds(lambda: copy(x), repeats)
    m = 512 if small else 8192
    a = jax.random.normal(jax.random.key(1), (m, m), jnp.bfloat16)
    b = jax.random.normal(jax.random.key(2), (m, m), jnp.bfloat16)
    mm = jax.jit(lambda p, q: p @ q)
    matmul = 2 * m**3 / _median_seconds(lambda: mm(a, b), repeats)
    return {"copy_bytes_per_s": bandwidth, "bf16_flops_per_s": matmul}


def _random_pair(shape: str, parallel):
    """Random bf16 target and drafter of a named shape, initialised on the device."""
    import jax

    from ddtree_jax.config import parse_dflash, parse_qwen3
    from ddtree_jax.models import dflash, qwen3
    from ddtree_jax.models.params import ModelParams
    from ddtree_jax.parallel import param_shardings
    from ddtree_jax.random_checkpoint import tiny_dflash_config, tiny_qwen3_config

    target_raw = tiny_qwen3_config(**SHAPES[shape])
    n_layers = target_raw["num_hidden_layers"]
    big = shape != "tiny"
    taps = [1, 9, 17, 25, 33] if n_layers == 36 else sorted({round(1 + i * (n_layers - 4) / 4) for i in range(5)})
    drafter_raw = tiny_dflash_config(
        target_raw, num_hidden_layers=5 if big else 2, layer_types=["full_attention"] * (5 if big else 2),
        num_attention_heads=32 if big else 4, num_key_value_heads=8 if big else 2, head_dim=128 if big else 16,
        intermediate_size=target_raw["intermediate_size"], block_size=16,
        dflash_config={"mask_token_id": target_raw["vocab_size"] - 1,
                       "target_layer_ids": taps if big else [0, n_layers - 1]})
    t_cfg, d_cfg = parse_qwen3(target_raw), parse_dflash(drafter_raw)

    def init(abstract: ModelParams, seed: int) -> ModelParams:
        # One small jitted initialiser per (shape, sharding), not one program for the whole model: XLA
        # takes many minutes to compile a single random-init program of an 8B model.
        shardings = param_shardings(abstract, parallel)
        arrays = {}
        for i, (name, leaf) in enumerate(abstract.flat().items()):
            ones = "norm" in name
            arrays[name] = _random_array(leaf.shape, str(leaf.dtype), ones, shardings[name])(
                jax.random.fold_in(jax.random.key(seed), i))
        return abstract.replace_flat(arrays)

    target = init(qwen3.abstract(t_cfg), 0)
    drafter = init(dflash.abstract(d_cfg, t_cfg.hidden_size), 1)
    return target, drafter


@functools.lru_cache(maxsize=None)
def _random_array(shape, dtype: str, ones: bool, sharding):
    import jax
    import jax.numpy as jnp

    def make(key):
        if ones:
            return jnp.ones(shape, dtype)
        return (jax.random.normal(key, shape, jnp.float32) * 0.02).astype(dtype)

    return jax.jit(make, out_shardings=sharding)


def _param_bytes(params) -> int:
    return sum(a.size * a.dtype.itemsize for a in params.flat().values())


def _filled_state(target, drafter, context: int, options, parallel, rounds: int):
    """A decode state whose caches hold `context` committed tokens of random K/V, with room for `rounds`
    rounds of full acceptance."""
    import jax
    import jax.numpy as jnp

    from ddtree_jax.engine import DecodeState, RoundTrace
    from ddtree_jax.models import dflash, qwen3

    b = 1
    # Tight capacity: the pure-JAX attention reads every slot (masked), so spare room would be timed too.
    per_round = options.block_size + 1 if options.mode.needs_drafter else 1
    capacity = -(-(context + rounds * per_round + options.verify_width) // 128) * 128
    dtype = jnp.bfloat16

    def filled(cache, seed: int):
        # One small cached initialiser per shape (a single program that draws every layer's K/V compiled
        # for minutes on the H200).
        sharding = parallel.sharding(parallel.kv_spec(cache.k[0].shape[2]))
        make = _random_array(cache.k[0].shape, "bfloat16", False, sharding)
        ks = tuple(make(jax.random.key(seed * 1000 + i)) for i in range(len(cache.k)))
        vs = tuple(make(jax.random.key(seed * 1000 + 500 + i)) for i in range(len(cache.v)))
        return dataclasses.replace(cache, k=ks, v=vs, lengths=jnp.full((b,), context, jnp.int32))

    cache = filled(jax.eval_shape(lambda: qwen3.create_cache(target.config, b, capacity, dtype)), 1)
    draft_cache = None
    if options.mode.needs_drafter:
        draft_cache = filled(jax.eval_shape(lambda: dflash.create_cache(drafter.config, b, capacity, dtype)), 2)
    return DecodeState(
        cache=cache, draft_cache=draft_cache, last_token=jnp.ones((b,), jnp.int32),
        output=jnp.zeros((b, options.max_new_tokens), jnp.int32), num_generated=jnp.ones((b,), jnp.int32),
        done=jnp.zeros((b,), bool), round_lengths=jnp.zeros((b, options.max_rounds), jnp.int32),
        num_rounds=jnp.zeros((b,), jnp.int32), rng=jax.random.key(0), step=jnp.zeros((), jnp.int32),
        trace=RoundTrace.empty(b, options.verify_width, options.block_size) if options.record_trees else None)


def time_stages(target, drafter, options, context: int, repeats: int, parallel) -> dict:
    """Median seconds of each stage of one round on a filled cache, and of the whole round."""
    import jax
    import jax.numpy as jnp

    from ddtree_jax.accept import accept_tree, chain_tree
    from ddtree_jax.cache import advance, commit_path
    from ddtree_jax.engine import Mode, ROUNDS
    from ddtree_jax.models import dflash, qwen3
    from ddtree_jax.sampling import decode_tokens
    from ddtree_jax.tree import build_tree

    rounds = repeats + 2  # _median_seconds' warm-up included
    # Every array reaches a jitted stage as an argument: one closed over becomes a constant of the
    # program (16 GB of them at 8B, which XLA then tries to constant-fold for minutes).
    round_fn = jax.jit(lambda t, d, s: ROUNDS[options.mode](t, d, s, options), donate_argnums=2)
    holder = {"state": _filled_state(target, drafter, context, options, parallel, rounds)}

    def one_round():
        holder["state"] = round_fn(target, drafter, holder["state"])
        return holder["state"].step

    out = {"round": _median_seconds(one_round, repeats)}
    del holder
    if options.mode is Mode.AR:
        out["verify"] = out["round"]
        return out
    state = _filled_state(target, drafter, context, options, parallel, rounds)
    kernels = options.attention_kernels

    bs, b = options.block_size, 1
    block = jnp.concatenate([state.last_token[:, None],
                             jnp.full((b, bs - 1), drafter.config.mask_token_id, jnp.int32)], axis=1)
    draft = jax.jit(lambda d, t, blk, dc: dflash.draft_logits(d, t, blk, dc, kernels))
    logits = draft(drafter, target, block, state.draft_cache)
    if options.mode is Mode.DDTREE:
        tree_fn = jax.jit(lambda lg, last: build_tree(jax.nn.log_softmax(lg, -1), last, options.budget))
    else:
        tree_fn = jax.jit(lambda lg, last: chain_tree(jnp.concatenate(
            [last[:, None], jnp.argmax(lg, -1).astype(jnp.int32)], axis=1)))
    tree = tree_fn(logits, state.last_token)

    def verify_fn(t, tr, cache, rng):
        fwd = qwen3.forward(t, tr.tokens, cache.lengths[:, None] + tr.depths, cache, tr.ancestor,
                            tap_layers=drafter.config.target_layer_ids, kernels=kernels)
        return fwd, decode_tokens(qwen3.logits(t, fwd.hidden), rng, options.sampling)

    verify = jax.jit(verify_fn)
    fwd, decoded = verify(target, tree, state.cache, state.rng)
    accept = jax.jit(lambda tr, dec: accept_tree(tr, dec, bs))
    acc = accept(tree, decoded)

    def commit_fn(d, f, a, draft_cache):
        if options.mode is Mode.DDTREE:
            cache = commit_path(f.cache, a.path, a.count)
            taps = jnp.take_along_axis(f.taps, a.path[:, :, None], axis=1)
        else:
            cache, taps = advance(f.cache, a.count), f.taps
        return cache, dflash.ingest_context(d, taps, a.count, draft_cache)

    commit = jax.jit(commit_fn)
    out["draft"] = _median_seconds(lambda: draft(drafter, target, block, state.draft_cache), repeats)
    out["tree"] = _median_seconds(lambda: tree_fn(logits, state.last_token), repeats)
    out["verify"] = _median_seconds(lambda: verify(target, tree, state.cache, state.rng), repeats)
    out["accept"] = _median_seconds(lambda: accept(tree, decoded), repeats)
    out["commit"] = _median_seconds(lambda: commit(drafter, fwd, acc, state.draft_cache), repeats)
    return out


def floor_seconds(target, drafter, mode: str, tokens: int, context: int, ceilings: dict) -> float:
    """max(bytes / bandwidth, FLOPs / matmul rate) for one round: every weight and the cache read once."""
    cfg = target.config
    kv_bytes = 2 * cfg.num_layers * context * cfg.num_kv_heads * cfg.head_dim * 2
    weight_bytes = _param_bytes(target) + (_param_bytes(drafter) if mode != "ar" else 0)
    flops = 2 * (cfg.num_params() - cfg.vocab_size * cfg.hidden_size * (0 if cfg.tie_word_embeddings else 1)) * tokens
    flops += 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim * context * tokens  # attention over the cache
    if mode != "ar":
        flops += 2 * (_param_bytes(drafter) // 2) * 16  # the drafter's block
    return max((weight_bytes + kv_bytes) / ceilings["copy_bytes_per_s"], flops / ceilings["bf16_flops_per_s"])


def run_shape(args, parallel) -> dict:
    import jax
    from tqdm import tqdm

    from ddtree_jax.engine import DecodeOptions, Mode

    small = args.shape == "tiny"
    start = time.perf_counter()
    ceilings = measure_ceilings(args.repeats, small)
    print(f"ceilings {ceilings}", flush=True)
    target, drafter = _random_pair(args.shape, parallel)
    jax.block_until_ready(target.flat())
    print(f"random weights ready after {time.perf_counter() - start:.0f} s", flush=True)
    rows = []
    modes = [("ar", None)] * ("ar" in args.modes) + [("dflash", None)] * ("dflash" in args.modes) + \
        [("ddtree", b) for b in args.budgets if "ddtree" in args.modes]
    # Each mode with every attention/acceptance implementation in turn, so a cut-short run still compares.
    plan = [(mode, budget, k) for mode, budget in modes for k in args.kernels]
    taus = dict(DEFAULT_TAU)
    taus.update(args.tau or {})
    for mode, budget, kernels in tqdm(plan, desc="bench", disable=None):
        options = DecodeOptions(mode=Mode(mode), max_new_tokens=4096, block_size=16, budget=budget or 64,
                                parallel=parallel, kernels=kernels)
        stages = time_stages(target, drafter, options, args.context, args.repeats, parallel)
        tokens = options.verify_width
        floor = floor_seconds(target, drafter, mode, tokens, args.context, ceilings)
        tau = _projected_tau(taus, mode, budget)
        rows.append({"mode": mode, "budget": budget, "kernels": kernels, "verify_tokens": tokens, **{f"{k}_s": v for k, v in stages.items()},
                     "floor_s": floor, "ratio_to_floor": stages["round"] / floor, "tau_projected": tau,
                     "tokens_per_s_projected": tau / stages["round"]})
        # Progress that survives a cut-short run: one line and a partial JSON per row.
        print(json.dumps({k: v for k, v in rows[-1].items()}), flush=True)
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "bench.partial.json").write_text(json.dumps({"ceilings": ceilings, "rows": rows}, indent=1))
    for r in rows:
        ar = next((a for a in rows if a["mode"] == "ar" and a["kernels"] == r["kernels"]), None)
        r["round_over_ar_step"] = r["round_s"] / ar["round_s"] if ar else None
    return {"kind": "shape", "shape": args.shape, "context": args.context, "device": str(jax.devices()[0].device_kind),
            "devices": parallel.size, "parallel": parallel.mode, "jax": jax.__version__, "ceilings": ceilings,
            "target_bytes": _param_bytes(target), "drafter_bytes": _param_bytes(drafter), "rows": rows}


def _read_prompts(path: Path, tokenizer) -> list[list[int]]:
    prompts = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError:
            raise ValueError(f"{path}:{n}: not JSON") from None
        if "prompt_ids" in item:
            prompts.append([int(i) for i in item["prompt_ids"]])
        elif "prompt" in item and tokenizer is not None:
            prompts.append(tokenizer(item["prompt"], add_special_tokens=False)["input_ids"])
        else:
            raise ValueError(f"{path}:{n}: expected 'prompt_ids', or 'prompt' with a tokenizer in the target folder")
    if not prompts:
        raise ValueError(f"{path}: no prompts")
    return prompts


def run_checkpoints(args, parallel) -> dict:
    import jax
    import jax.numpy as jnp
    from tqdm import tqdm

    from ddtree_jax.checkpoint import load_drafter, load_target
    from ddtree_jax.engine import DecodeOptions, Mode, generate
    from ddtree_jax.generate import _load_tokenizer

    dtype = {"bfloat16": jnp.bfloat16, "float32": jnp.float32}[args.dtype]
    target = load_target(args.target, dtype, parallel=parallel)
    drafter = load_drafter(args.drafter, target.config, dtype, parallel=parallel)
    prompts = _read_prompts(args.prompts, _load_tokenizer(args.target))[:args.num_prompts]
    plan = [("ar", None)] + [("dflash", None)] * ("dflash" in args.modes) + \
        [("ddtree", b) for b in args.budgets if "ddtree" in args.modes]
    rows, reference = [], None
    for mode, budget in tqdm(plan, desc="bench", disable=None):
        options = DecodeOptions(mode=Mode(mode), max_new_tokens=args.max_new_tokens, budget=budget or 64,
                                parallel=parallel)
        generate(target, prompts[:1], options, drafter=drafter)  # warm-up (compilation)
        results = [generate(target, [p], options, drafter=drafter) for p in prompts]
        outputs = [r.output_ids[0] for r in results]
        decode_s = sum(r.decode_seconds for r in results)
        tokens = sum(len(o) for o in outputs)
        rounds = [n for r in results for n in r.acceptance_lengths[0]]
        divergence = None
        if reference is None:
            reference = outputs
        else:
            for i, (a, b) in enumerate(zip(reference, outputs)):
                if a != b:
                    at = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
                    divergence = {"prompt": i, "token": at}
                    break
        rows.append({"mode": mode, "budget": budget, "tau": float(np.mean(rounds)), "tokens": tokens,
                     "decode_s": decode_s, "tokens_per_s": tokens / decode_s, "first_divergence": divergence})
    for r in rows:
        r["speedup_over_ar"] = r["tokens_per_s"] / rows[0]["tokens_per_s"]
    return {"kind": "checkpoints", "target": str(args.target), "drafter": str(args.drafter),
            "prompts": len(prompts), "device": str(jax.devices()[0].device_kind), "devices": parallel.size,
            "parallel": parallel.mode, "jax": jax.__version__, "rows": rows}


def markdown(report: dict) -> str:
    if report["kind"] == "shape":
        head = ("| mode | B | kernels | verify tokens | draft ms | tree ms | verify ms | accept ms | commit ms | round ms | "
                "floor ms | x floor | x AR step | projected tok/s (tau) |\n|" + "---|" * 14 + "\n")
        ms = lambda r, k: f"{r[k] * 1e3:.2f}" if k in r else "-"  # noqa: E731
        lines = [f"| {r['mode']} | {r['budget'] or '-'} | {r.get('kernels', 'jax')} | {r['verify_tokens']} | {ms(r, 'draft_s')} | "
                 f"{ms(r, 'tree_s')} | {ms(r, 'verify_s')} | {ms(r, 'accept_s')} | {ms(r, 'commit_s')} | "
                 f"{ms(r, 'round_s')} | {ms(r, 'floor_s')} | {r['ratio_to_floor']:.2f} | "
                 f"{r['round_over_ar_step'] or float('nan'):.2f} | {r['tokens_per_s_projected']:.0f} ({r['tau_projected']:.2f}) |"
                 for r in report["rows"]]
        c = report["ceilings"]
        return (head + "\n".join(lines) + f"\n\nMeasured ceilings: copy {c['copy_bytes_per_s'] / 1e12:.2f} TB/s, "
                f"bf16 matmul {c['bf16_flops_per_s'] / 1e12:.0f} TFLOP/s. Projected tokens/s = tau / round time.\n")
    head = "| mode | B | tau | tokens/s | speedup over AR | first divergence from AR |\n|---|---|---|---|---|---|\n"
    return head + "\n".join(f"| {r['mode']} | {r['budget'] or '-'} | {r['tau']:.2f} | {r['tokens_per_s']:.1f} | "
                            f"{r['speedup_over_ar']:.2f} | {r['first_divergence'] or 'none'} |"
                            for r in report["rows"]) + "\n"


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    if report["kind"] == "shape":
        kernels = list(dict.fromkeys(r.get("kernels", "jax") for r in report["rows"]))
        for i, k in enumerate(kernels):
            rows = [r for r in report["rows"] if r.get("kernels", "jax") == k]
            tree = [r for r in rows if r["mode"] == "ddtree"]
            if tree:
                ax.plot([r["budget"] for r in tree], [r["round_s"] * 1e3 for r in tree], "o-", color=f"C{3 * i}",
                        label=f"DDTree round ({k})")
                if i == 0:
                    ax.plot([r["budget"] for r in tree], [r["floor_s"] * 1e3 for r in tree], "k--", label="floor")
                ax.set_xscale("log", base=2)
            for r in rows:
                if r["mode"] != "ddtree":
                    ax.axhline(r["round_s"] * 1e3, ls=":" if i == 0 else "-.",
                               color=f"C{3 * i + (1 if r['mode'] == 'ar' else 2)}",
                               label=f"{r['mode']} {'step' if r['mode'] == 'ar' else 'round'} ({k})")
        ax.set_xlabel("tree budget B (nodes verified = B + 1)")
        ax.set_ylabel("ms per round")
        ax.set_title(f"{report['shape']}, context {report['context']}, {report['device']}")
        ax.legend()
    else:
        ax.bar([f"{r['mode']}{'' if r['budget'] is None else ' ' + str(r['budget'])}" for r in report["rows"]],
               [r["tokens_per_s"] for r in report["rows"]])
        ax.set_ylabel("tokens/s")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    from ddtree_jax.generate import BadInput, add_parallel_args, parallel_from_args

    p = argparse.ArgumentParser(prog="python -m ddtree_jax.bench", description=__doc__.split("\n")[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default=None)
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--budgets", default="16,64,256,512")
    p.add_argument("--modes", default="ar,dflash,ddtree")
    p.add_argument("--kernels", default="jax",
                   help="comma list of jax,pallas: attention/acceptance implementations timed (--shape only)")
    p.add_argument("--tau", default=None, help="projected tau, e.g. 'dflash=7.8,64=10.7,256=10.7'")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--target", type=Path, default=None)
    p.add_argument("--drafter", type=Path, default=None)
    p.add_argument("--prompts", type=Path, default=None)
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    p.add_argument("--out", type=Path, default=Path("bench_out"), help="folder for JSON, markdown and plot")
    add_parallel_args(p)
    args = p.parse_args(argv)
    try:
        args.budgets = [int(b) for b in args.budgets.split(",") if b]
        args.modes = [m for m in args.modes.split(",") if m]
        args.kernels = [k for k in args.kernels.split(",") if k]
        if not args.kernels or any(k not in ("jax", "pallas") for k in args.kernels):
            raise ValueError("kernels")
        if args.tau:
            args.tau = {(k if k in ("ar", "dflash") else int(k)): float(v)
                        for k, v in (item.split("=") for item in args.tau.split(","))}
    except ValueError:
        print("error: --budgets takes integers, --kernels a comma list of jax,pallas, --tau KEY=VALUE pairs",
              file=sys.stderr)
        return 2
    if (args.shape is None) == (args.target is None):
        print("error: give either --shape NAME or --target DIR --drafter DIR --prompts FILE", file=sys.stderr)
        return 2
    from ddtree_jax.checkpoint import CheckpointError
    from ddtree_jax.config import ConfigError

    try:
        parallel = parallel_from_args(args)
        if args.shape is not None:
            report = run_shape(args, parallel)
        else:
            if args.drafter is None or args.prompts is None:
                raise BadInput("--target needs --drafter DIR and --prompts FILE.jsonl")
            report = run_checkpoints(args, parallel)
    except (BadInput, CheckpointError, ConfigError, ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    report["command"] = "python -m ddtree_jax.bench " + " ".join(sys.argv[1:] if argv is None else argv)
    report["date"] = time.strftime("%Y-%m-%d")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench.json").write_text(json.dumps(report, indent=2))
    table = markdown(report)
    (args.out / "bench.md").write_text(table)
    plot(report, args.out / "bench.png")
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
