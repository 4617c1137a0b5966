"""Device time of the draft-tree build, and of its vocabulary top-k alone, against a baseline implementation.

For each vocabulary size, budget B, chunk and vocabulary top-k (`--top-k`: `build_tree`'s `top_k`, "threshold",
"pallas" or "chunked"): `build_tree(log_softmax(logits), roots, B, chunk, top_k=...)` on [batch, L, V] float32 drafter
logits, timed in a device loop (`measure.timing.in_loop_seconds`: --passes passes against 1 in one call, so the call's
dispatch cancels out; each pass depends on the previous one through an optimization barrier, so nothing is hoisted).
`top-k <name>` times the first step alone (the top K = min(B, V) of every depth's vocabulary, `tree.threshold_top_k`,
`tree.kernel_top_k` ("pallas", or "pallas:step=8192:num_warps=16" with those `VocabTopKConfig` knobs laid over the
kernel's `default_config(V)`, what the engine runs) or `tree.chunked_top_k`), checked equal to one lax.top_k. With
`--baseline FILE` (another version's tree.py, e.g. `git show REV:ddtree_jax/tree.py > old_tree.py`) that version's
build is timed beside it (with its own defaults) and every tree is checked equal to it (tokens, parents, depths,
valid, scores, ancestor mask); without, every tree is checked against the first chunk's with the first top-k and the
first `--tree-build` (`reference`, the XLA builder, or `pallas`, the tree-build kernel: `current <top-k> pallas` in
the table). `threshold_fits` says whether threshold_top_k's fast path held the candidates for these logits (else it
took its fallback). Writes topk_probe.json and topk_probe.md under --out.
`--trace DIR`: each `top-k` point also runs one call of --passes passes under the profiler, in DIR/V_B_NAME
(`python tools/trace_summary.py DIR --rounds PASSES`: its launches by name, per pass).

    python tools/topk_probe.py --out DIR [--vocab 151936,248320] [--budgets 16,64,256,512]
                               [--chunks auto] [--top-k threshold,chunked,pallas,pallas:step=8192]
                               [--tree-build reference,pallas,pallas:block_rows=256:num_warps=8]
                               [--baseline old_tree.py] [--trace DIR] [--batch 1]
                               (chunk 0: one lax.top_k)
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import importlib.util
import json
import re
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ddtree_jax import tree as current  # noqa: E402
from ddtree_jax.measure.timing import in_loop_seconds, record_trace  # noqa: E402
from ddtree_jax.cli import recorded_command  # noqa: E402
from ddtree_jax.engine import compile_program  # noqa: E402
from pallas_kernels import tree_build as tree_build_kernel  # noqa: E402
from pallas_kernels import vocab_top_k  # noqa: E402

FIELDS = ("tokens", "parents", "depths", "valid", "scores", "ancestor")


def _knobs(knobs: list[str]) -> dict[str, int]:
    """['num_warps=8', 'step=2048'] (the ':'-separated tail of a --tree-build or --top-k item) -> kernel knobs."""
    return {k: int(v) for k, v in (knob.split("=") for knob in knobs)}


def tree_program(build_tree, budget: int, chunk, top_k: str | None = None, tree_build: str | None = None):
    """(logits [batch, L, V] f32, roots [batch] i32, passes) -> the last pass's tree fields. top_k / tree_build None:
    the build's own default (a baseline's build may not take the arguments); tree_build: build_tree's
    `implementation` after the top-k ("reference": the XLA builder, "pallas": the tree-build kernel, and
    "pallas:KNOB=N:..." the kernel with those `TreeBuildConfig` knobs laid over its `default_config(B)`, what the
    engine runs)."""
    kwargs = {} if top_k is None else dict(top_k=top_k)
    if tree_build is not None:
        implementation, *knobs = tree_build.split(":")
        kwargs["implementation"] = implementation
        if knobs:
            kwargs["kernel_config"] = dataclasses.replace(tree_build_kernel.default_config(budget), **_knobs(knobs))

    def run(logits, roots, passes):
        def once(salt):
            lg, s = jax.lax.optimization_barrier((logits, salt))
            tree = build_tree(jax.nn.log_softmax(lg + s, axis=-1), roots, budget, chunk, **kwargs)
            return tuple(getattr(tree, f) for f in FIELDS)

        return _passes(once, passes)
    return run


def top_k_function(budget: int, chunk, top_k: str, vocab: int):
    """log-probs [batch, L, V] -> the per-depth top-K values and indices by build_tree's top_k `top_k` (with
    `VocabTopKConfig` knobs after ':'), K = min(B, V)."""
    k = min(budget, vocab)
    c = current.default_top_k_chunk(budget, vocab) if chunk == "auto" else chunk
    name, *knobs = top_k.split(":")
    if name == "threshold":
        return lambda lp: current.threshold_top_k(lp, k, fallback_chunk=c)
    if name == "pallas":
        config = dataclasses.replace(vocab_top_k.default_config(vocab, k), **_knobs(knobs))
        return lambda lp: current.kernel_top_k(lp, k, fallback_chunk=c, config=config)
    return lambda lp: current.chunked_top_k(lp, k, c)


def top_k_program(budget: int, chunk, top_k: str):
    """(logits, roots, passes) -> the last pass's per-depth top-K values and indices (the build's first step)."""
    def run(logits, roots, passes):
        top_k_of = top_k_function(budget, chunk, top_k, logits.shape[-1])

        def once(salt):
            lg, s = jax.lax.optimization_barrier((logits, salt))
            return top_k_of(jax.nn.log_softmax(lg + s, axis=-1))

        return _passes(once, passes)
    return run


def same_top_k(budget: int, chunk, top_k: str, logits: jax.Array) -> bool:
    """Whether a top-k (`top_k_function`) of log_softmax(logits) [batch, L, V] keeps lax.top_k's contract (value desc,
    lower index first among equals) on the very log-probs it took (one program returns both; NumPy orders the
    reference): a GPU's own lax.top_k of a log-softmax compiled apart differed from the threshold top-k at B = 256
    (V = 151936, H200, 2026-12-04), where 14 of 15 i.i.d. rows hold equal values within their top 256."""
    top_k_of = top_k_function(budget, chunk, top_k, logits.shape[-1])

    @jax.jit
    def log_probs_and_top_k(lg):
        lp = jax.nn.log_softmax(lg, axis=-1)
        return lp, *top_k_of(lp)

    lp, values, indices = (np.asarray(x) for x in log_probs_and_top_k(logits))
    order = np.argsort(-lp, axis=-1, kind="stable")[..., :values.shape[-1]]  # ties: lower index first
    return bool(np.array_equal(indices, order) and np.array_equal(values, np.take_along_axis(lp, order, -1)))


def threshold_fits(logits: jax.Array, budget: int) -> bool:
    """Whether threshold_top_k's fast path holds the candidates of log_softmax(logits) [batch, L, V] (its
    fallback replaced by a marker to see which branch ran)."""
    k = min(budget, logits.shape[-1])
    original = current.chunked_top_k
    current.chunked_top_k = lambda x, k, chunk: (jnp.full(x.shape[:-1] + (k,), jnp.nan),
                                                 jnp.full(x.shape[:-1] + (k,), -1, jnp.int32))
    try:
        index = jax.jit(lambda lg: current.threshold_top_k(jax.nn.log_softmax(lg, axis=-1), k)[1])(logits)
    finally:
        current.chunked_top_k = original
    return bool(np.asarray(index).min() >= 0)


def _passes(once, passes):
    def one_pass(_, carry):
        outs = once(carry[0])
        return jnp.where(jax.tree.leaves(outs)[0].ravel()[0] < -1e30, 1.0, 0.0).astype(jnp.float32), outs

    init = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), jax.eval_shape(once, jnp.float32(0)))
    return jax.lax.fori_loop(0, passes, one_pass, (jnp.float32(0), init))[1]


def load_tree_module(path: Path):
    spec = importlib.util.spec_from_file_location("baseline_tree", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _chunks(text: str) -> list:
    return [c if c == "auto" else (int(c) or None) for c in text.split(",") if c.strip()]


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--vocab", default="151936,248320")
    p.add_argument("--budgets", default="16,64,256,512")
    p.add_argument("--chunks", default="auto", help="comma list: auto, 0 (one lax.top_k) or a chunk size")
    p.add_argument("--top-k", default="threshold,chunked", help="comma list of build_tree's top_k values")
    p.add_argument("--tree-build", default="reference",
                   help="comma list of build_tree's implementation after the top-k: reference (XLA), pallas (kernel), "
                        "pallas:block_rows=256:num_warps=8 (the kernel with those knobs)")
    p.add_argument("--baseline", type=Path, default=None, help="another version's tree.py, timed and compared")
    p.add_argument("--depths", type=int, default=15, help="L: the drafter's block size - 1")
    p.add_argument("--batch", type=int, default=1, help="rows of the decode batch (each with its L depths)")
    p.add_argument("--peak", type=float, default=0.0,
                   help="added to one token's logit per depth: a confident drafter's deep tree (0: i.i.d. logits, "
                        "shallow trees)")
    p.add_argument("--rounds", type=int, default=7, help="timed calls per size (medians)")
    p.add_argument("--passes", type=int, default=64,
                   help="passes in the long call (against 1): at 8 the host's jitter over a call moved a ~50 us "
                        "build by 2x between runs (H200, 2026-12-02)")
    p.add_argument("--workers", type=int, default=8, help="compile threads")
    p.add_argument("--trace", type=Path, default=None, metavar="DIR",
                   help="a profiler trace of one call per top-k point, under DIR/V_B_NAME")
    args = p.parse_args(argv)
    if args.passes < 2:  # the time of a pass is the long call's against one pass's
        p.error(f"--passes {args.passes}: must be at least 2")
    args.out.mkdir(parents=True, exist_ok=True)
    top_ks = [t.strip() for t in args.top_k.split(",") if t.strip()]
    builds = [x.strip() for x in args.tree_build.split(",") if x.strip()]
    # A top-k with kernel knobs ("pallas:step=8192") is timed alone with them, in trees with the defaults.
    tree_top_ks = list(dict.fromkeys(t.split(":")[0] for t in top_ks))
    impls = {f"current {t}" + ("" if tb == "reference" else f" {tb}"): (current.build_tree, t, tb)
             for t in tree_top_ks for tb in builds}
    if args.baseline:
        impls["baseline"] = (load_tree_module(args.baseline).build_tree, None, None)
    chunks = _chunks(args.chunks)
    names = [*impls, *(f"top-k {t}" for t in top_ks)]
    points = [(v, b, c, impl) for v in _ints(args.vocab) for b in _ints(args.budgets) for c in chunks
              for impl in names]
    inputs = {}
    for v in _ints(args.vocab):
        logits = 2.0 * jax.random.normal(jax.random.key(v), (args.batch, args.depths, v), jnp.float32)
        logits = logits.at[:, jnp.arange(args.depths), (7 * jnp.arange(args.depths)) % v].add(args.peak)
        inputs[v] = (logits, jnp.full((args.batch,), 3, jnp.int32))

    start = time.perf_counter()

    def build(point):
        v, b, c, impl = point
        program = top_k_program(b, c, impl[len("top-k "):]) if impl.startswith("top-k ") else tree_program(
            impls[impl][0], b, c, *impls[impl][1:])
        t0 = time.perf_counter()
        compiled = compile_program(program, (*inputs[v], jnp.int32(1)))
        return point, compiled, time.perf_counter() - t0

    with concurrent.futures.ThreadPoolExecutor(args.workers) as pool:
        programs = {point: (compiled, s) for point, compiled, s in pool.map(build, points)}
    print(f"{len(points)} programs compiled in {time.perf_counter() - start:.0f} s", flush=True)

    # Every tree is compared with the baseline's at the same point, or (no baseline) with the first chunk's
    # and first top-k's.
    def reference_key(v, b, c):
        return (v, b, c, "baseline") if args.baseline else (v, b, chunks[0], next(iter(impls)))

    fits = {(v, b): threshold_fits(inputs[v][0], b) for v in _ints(args.vocab) for b in _ints(args.budgets)}

    records, trees = [], {}
    for v, b, c, impl in points:
        compiled, compile_s = programs[(v, b, c, impl)]
        seconds = in_loop_seconds(lambda n: compiled(*inputs[v], jnp.int32(n)), args.rounds,
                                 iterations=args.passes)[0]
        records.append(dict(vocab=v, budget=b, chunk=c, impl=impl, us=seconds * 1e6, compile_s=compile_s,
                            threshold_fits=fits[(v, b)]))
        if impl.startswith("top-k "):  # one pass: the log-softmax of the logits themselves
            records[-1]["same_top_k"] = same_top_k(b, c, impl[len("top-k "):], inputs[v][0])
            if args.trace:
                name = re.sub(r"[^A-Za-z0-9=_.-]+", "_", impl[len("top-k "):])
                record_trace(args.trace / f"{v}_{b}_{name}", lambda: compiled(*inputs[v], jnp.int32(args.passes)))
        else:
            trees[(v, b, c, impl)] = [np.asarray(x) for x in compiled(*inputs[v], jnp.int32(1))]
    for r in records:
        if not r["impl"].startswith("top-k "):
            ref = trees[reference_key(r["vocab"], r["budget"], r["chunk"])]
            r["same_tree"] = all(np.array_equal(a, b) for a, b in zip(trees[(r["vocab"], r["budget"], r["chunk"],
                                                                             r["impl"])], ref))
        print(json.dumps(r), flush=True)

    lines = ["| V | B | chunk | " + " | ".join(f"{n} us" for n in names) + " | threshold fits |",
             "|---|---|---|" + "---|" * (len(names) + 1)]
    for v in _ints(args.vocab):
        for b in _ints(args.budgets):
            for c in chunks:
                cells = []
                for n in names:
                    r = next(r for r in records if (r["vocab"], r["budget"], r["chunk"], r["impl"]) == (v, b, c, n))
                    same = r.get("same_tree", True) and r.get("same_top_k", True)
                    cells.append(f"{r['us']:.1f}" + ("" if same else " (DIFFERENT)"))
                lines.append(f"| {v} | {b} | {c or 'none'} | " + " | ".join(cells) + f" | {fits[(v, b)]} |")
    table = "\n".join(lines)
    print(table)
    report = dict(device=str(jax.devices()[0].device_kind), jax=jax.__version__, depths=args.depths, batch=args.batch,
                  peak=args.peak, date=time.strftime("%Y-%m-%d"),
                  command=recorded_command("python tools/topk_probe.py", sys.argv[1:] if argv is None else argv),
                  records=records)
    (args.out / "topk_probe.json").write_text(json.dumps(report, indent=1))
    (args.out / "topk_probe.md").write_text(
        f"Tree build, device us per round (L = {args.depths}, batch {args.batch})\n\n" + table + "\n")
    return 0 if all(r.get("same_tree", True) and r.get("same_top_k", True) for r in records) else 1


if __name__ == "__main__":
    raise SystemExit(main())
