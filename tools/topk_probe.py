"""Device time of the draft-tree build with one `lax.top_k` per site against the two-stage `chunked_top_k`.

For each vocabulary size, budget B and chunk: `build_tree(log_softmax(logits), roots, B, chunk)` on
[1, L, V] float32 drafter logits, timed in a device loop (`pallas_kernels.gpu_check.time_program`: 8
passes against 1 in one call, so the call's dispatch cancels out; each pass depends on the previous one
through an optimization barrier, so nothing is hoisted). Every chunked tree is checked against the
unchunked one on the same device (tokens, parents, depths, valid, scores equal). Writes topk_probe.json
and topk_probe.md under --out.

    python tools/topk_probe.py --out DIR [--vocab 151936,248320] [--budgets 16,64,256,512]
                               [--chunks 0,2048,4096,8192,16384]      (0: one lax.top_k)
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ddtree_jax.tree import build_tree  # noqa: E402
from pallas_kernels.gpu_check import compile_program, time_program  # noqa: E402

FIELDS = ("tokens", "parents", "depths", "valid", "scores")


def tree_program(budget: int, chunk: int | None):
    """(logits [1, L, V] f32, roots [1] i32, passes) -> the last pass's tree fields."""
    def run(logits, roots, passes):
        def once(salt):
            lg, s = jax.lax.optimization_barrier((logits, salt))
            tree = build_tree(jax.nn.log_softmax(lg + s, axis=-1), roots, budget, chunk)
            return tuple(getattr(tree, f) for f in FIELDS)

        def one_pass(_, carry):
            outs = once(carry[0])
            return jnp.where(outs[0][0, 1] < 0, 1.0, 0.0).astype(jnp.float32), outs

        init = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), jax.eval_shape(once, jnp.float32(0)))
        return jax.lax.fori_loop(0, passes, one_pass, (jnp.float32(0), init))[1]
    return run


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--vocab", default="151936,248320")
    p.add_argument("--budgets", default="16,64,256,512")
    p.add_argument("--chunks", default="0,2048,4096,8192,16384")
    p.add_argument("--depths", type=int, default=15, help="L: the drafter's block size - 1")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--workers", type=int, default=8, help="compile threads")
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    points = [(v, b, c or None) for v in _ints(args.vocab) for b in _ints(args.budgets) for c in _ints(args.chunks)]
    inputs = {}
    for v in _ints(args.vocab):
        logits = 2.0 * jax.random.normal(jax.random.key(v), (1, args.depths, v), jnp.float32)
        inputs[v] = (logits, jnp.array([3], jnp.int32))

    start = time.perf_counter()

    def build(point):
        v, b, c = point
        compiled, seconds = compile_program(tree_program(b, c), (*inputs[v], jnp.int32(1)))
        return point, compiled, seconds

    with concurrent.futures.ThreadPoolExecutor(args.workers) as pool:
        programs = {point: (compiled, s) for point, compiled, s in pool.map(build, points)}
    print(f"{len(points)} programs compiled in {time.perf_counter() - start:.0f} s", flush=True)

    records, plain = [], {}
    for v, b, c in points:
        compiled, compile_s = programs[(v, b, c)]
        seconds = time_program(compiled, (*inputs[v],), 1, rounds=args.rounds)
        outs = [np.asarray(x) for x in compiled(*inputs[v], jnp.int32(1))]
        if c is None:
            plain[(v, b)] = outs
        same = all(np.array_equal(a, r) for a, r in zip(outs, plain[(v, b)]))
        records.append(dict(vocab=v, budget=b, chunk=c, us=seconds * 1e6, compile_s=compile_s, same_tree=same))
        print(f"V={v} B={b} chunk={c}: {seconds * 1e6:.1f} us  same tree: {same}", flush=True)

    lines = ["| V | B | " + " | ".join(f"chunk {c or 'none'}" for c in _ints(args.chunks)) + " |",
             "|---|---|" + "---|" * len(_ints(args.chunks))]
    for v in _ints(args.vocab):
        for b in _ints(args.budgets):
            cells = [f"{r['us']:.1f}" + ("" if r["same_tree"] else " (DIFFERENT)")
                     for r in records if r["vocab"] == v and r["budget"] == b]
            lines.append(f"| {v} | {b} | " + " | ".join(cells) + " |")
    table = "\n".join(lines)
    print(table)
    report = dict(device=str(jax.devices()[0].device_kind), jax=jax.__version__, depths=args.depths,
                  date=time.strftime("%Y-%m-%d"), argv=sys.argv[1:], records=records)
    (args.out / "topk_probe.json").write_text(json.dumps(report, indent=1))
    (args.out / "topk_probe.md").write_text(f"Tree build, device us per round (L = {args.depths}, batch 1)\n\n"
                                           + table + "\n")
    return 0 if all(r["same_tree"] for r in records) else 1


if __name__ == "__main__":
    raise SystemExit(main())
