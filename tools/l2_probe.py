"""Does a weight read into L2 by a latency-bound kernel before its projection make the projection faster?

    PYTHONPATH=. python tools/l2_probe.py --out DIR [--shapes 4096x4096,6144x4096] [--fractions 0.5,1] [--smoke]

A decode step's small kernels (norms, q/k-norm + RoPE, the attention and its merge, split sums) leave the memory
idle for ~20 us of each 8B layer's ~120 on the H200 (docs/performance.md). If programs added to such a kernel read
the next projection's weight into L2 (50 MB on the H100 and H200) while the kernel's own program waits out its
latencies, the projection would find that part of its weight in L2. This probe measures it without the models, in
one device loop over `--layers` distinct weights (so that no weight is in L2 from the previous use), per weight:

- `matmul`: the streaming projection alone (`pallas_kernels.stream_matmul`, the models' knobs for one row);
- `matmul_hot`: the same on one weight every time (what a weight that fits in L2 costs from there);
- `host`: a stand-in latency-bound kernel alone: one program chasing `--chase` dependent loads;
- `host+matmul`: the two in sequence (what a layer does now);
- `host+prefetch`: the stand-in with programs that read the first `fraction` of the weight (their values folded
  into a flag nothing uses unless they are NaN, so the loads stay), `eviction_policy="evict_last"`;
- `host+prefetch+matmul`: that, then the projection: the figure to beat `host+matmul` by.

Each figure is microseconds per weight from `measure.timing.in_loop_seconds` (the loop's dispatch cancels out).
`--smoke` runs tiny shapes interpreted on a CPU (the test of the script).
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from ddtree_jax.measure.timing import in_loop_seconds
from pallas_kernels import on_gpu
from pallas_kernels import stream_matmul as sm

ROWS_PER_PROGRAM = 4  # weight rows a prefetch program reads: many programs, each load in flight at once
COLUMNS_PER_STEP = 4096  # of them per load: a [4, 4096] bf16 tile, 32 KiB (256 bytes a thread)


def _host_kernel(chain_ref, w_ref, out_ref, *, chase: int, prefetch_rows: int, k: int):
    """Program 0 chases `chase` dependent loads through `chain_ref`; programs 1.. each read ROWS_PER_PROGRAM rows
    of the first `prefetch_rows` of `w_ref` and fold them into a flag (stored only if the sum is NaN)."""
    pid = pl.program_id(0)

    @pl.when(pid == 0)
    def _():
        # volatile: each load goes to L2 (~0.5 us), as a small kernel's dependent steps wait on memory, not L1
        at = lax.fori_loop(0, chase, lambda _, i: plt.load(chain_ref.at[pl.ds(i, 1)], volatile=True)[0], jnp.int32(0))
        out_ref[pl.ds(0, 1)] = jnp.full((1,), at, jnp.int32)

    step_cols = min(k, COLUMNS_PER_STEP)
    if prefetch_rows:
        @pl.when(pid > 0)
        def _():
            row0 = (pid - 1) * ROWS_PER_PROGRAM
            rows = row0 + jnp.arange(ROWS_PER_PROGRAM, dtype=jnp.int32)

            def step(c, acc):
                cols = c * step_cols + jnp.arange(step_cols, dtype=jnp.int32)
                tile = plt.load(w_ref.at[pl.ds(row0, ROWS_PER_PROGRAM), pl.ds(c * step_cols, step_cols)],
                                mask=(rows < prefetch_rows)[:, None] & (cols < k)[None, :], other=0,
                                eviction_policy="evict_last")
                return acc + jnp.sum(tile.astype(jnp.float32))

            total = lax.fori_loop(0, -(-k // step_cols), step, jnp.float32(0))
            plt.store(out_ref.at[pl.ds(pid, 1)], jnp.full((1,), pid, jnp.int32), mask=jnp.full((1,), total != total))


def host(chain: jax.Array, w: jax.Array, *, chase: int, fraction: float, interpret: bool) -> jax.Array:
    """The stand-in kernel: [1 + programs] int32 (entry 0 the chase's end, the rest untouched unless NaN)."""
    n, k = w.shape
    prefetch_rows = int(round(n * fraction)) // ROWS_PER_PROGRAM * ROWS_PER_PROGRAM
    programs = 1 + prefetch_rows // ROWS_PER_PROGRAM
    return pl.pallas_call(
        functools.partial(_host_kernel, chase=chase, prefetch_rows=prefetch_rows, k=k),
        grid=(programs,),
        in_specs=[pl.BlockSpec(chain.shape, lambda i: (0,)), pl.BlockSpec(w.shape, lambda i: (0, 0))],
        out_specs=pl.BlockSpec((programs,), lambda i: (0,)),
        out_shape=jax.ShapeDtypeStruct((programs,), jnp.int32),
        compiler_params=plt.CompilerParams(num_warps=4, num_stages=2),
        interpret=interpret,
        name="l2_host",
    )(chain, w)


def weight_loop(*, use_host: bool, prefetch_fraction: float, use_matmul: bool, hot: bool, chase: int,
                chain: jax.Array, interpret: bool):
    """run(passes, ws, x): `passes` times over the weights ws (a tuple, one operand each), per weight the stand-in
    kernel (prefetching `prefetch_fraction` of it) and/or the streaming projection of x by it (the models' knobs for
    one row); `hot`: weight 0 every time. Each step's input depends on the last step's output."""
    config = sm.StreamMatmulConfig()

    @functools.partial(jax.jit, static_argnums=0)
    def run(passes, ws, x):
        def one_pass(_, x):
            for i in range(len(ws)):  # unrolled: each weight its own operand
                w = ws[0 if hot else i]
                if use_host:
                    h = host(chain, w, chase=chase, fraction=prefetch_fraction, interpret=interpret)
                    x = x.at[0, 0].add((h[0] == -1).astype(x.dtype))  # the projection waits for the host kernel
                if use_matmul:
                    y = sm.stream_matmul(x, w, config=config, implementation="pallas", interpret=interpret)
                    x = x.at[0, 1].add(1e-3 * y[0, 0].astype(x.dtype))  # the next weight's turn waits for it
            return x
        return lax.fori_loop(0, passes, one_pass, x)
    return run


def measure(shape: tuple[int, int], fraction: float, *, layers: int, chase: int, repeats: int, iterations: int,
            interpret: bool) -> dict:
    n, k = shape
    keys = jax.random.split(jax.random.PRNGKey(0), 2)
    # Separate arrays, each call's operand as it is: a weight sliced out of one stacked array inside the loop is
    # copied by XLA before the kernel can take it (a read and a write of the whole weight per call).
    ws = tuple((jax.random.normal(key, (n, k), jnp.float32) * 0.02).astype(jnp.bfloat16)
               for key in jax.random.split(keys[0], layers))
    x0 = jax.random.normal(keys[1], (1, k), jnp.float32).astype(jnp.bfloat16)
    chain = jnp.roll(jnp.arange(max(chase, 1) + 1, dtype=jnp.int32), -1)  # i -> i + 1: every load depends on the last

    def form(use_host: bool, prefetch: bool, use_matmul: bool, hot: bool = False):
        run = weight_loop(use_host=use_host, prefetch_fraction=fraction if prefetch else 0.0, use_matmul=use_matmul,
                          hot=hot, chase=chase, chain=chain, interpret=interpret)
        return lambda p: run(p, ws, x0)

    forms = {"matmul": (False, False, True), "matmul_hot": (False, False, True, True), "host": (True, False, False),
             "host+matmul": (True, False, True),
             "host+prefetch": (True, True, False), "host+prefetch+matmul": (True, True, True)}
    record = {"shape": list(shape), "fraction": fraction, "weight_mb": n * k * 2 / 1e6, "layers": layers,
              "chase": chase}
    for name, spec in forms.items():
        per_pass, _ = in_loop_seconds(form(*spec), repeats, iterations=iterations)
        record[name + "_us"] = per_pass / layers * 1e6
    record["gain_us"] = record["host+matmul_us"] - record["host+prefetch+matmul_us"]
    return record


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--shapes", default="4096x4096,6144x4096", help="comma list of weight shapes NxK (bf16)")
    p.add_argument("--fractions", default="0.5,1", help="comma list of the weight fractions prefetched")
    p.add_argument("--layers", type=int, default=12, help="distinct weights the loop cycles through")
    p.add_argument("--chase", type=int, default=24, help="dependent loads of the stand-in kernel's own program")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--smoke", action="store_true", help="tiny shapes, interpreted (CPU)")
    args = p.parse_args(argv)
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    fractions = [float(f) for f in args.fractions.split(",")]
    layers, repeats, iterations, chase = args.layers, args.repeats, 4, args.chase
    if args.smoke:
        shapes, fractions, layers, repeats, iterations, chase = [(128, 256)], [1.0], 2, 1, 2, 3
    interpret = args.smoke or not on_gpu()
    records = []
    print("| weight | MB | prefetched | matmul | matmul, hot | host | host+matmul | host+prefetch | "
          "host+prefetch+matmul | gain |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for shape in shapes:
        for fraction in fractions:
            r = measure(shape, fraction, layers=layers, chase=chase, repeats=repeats, iterations=iterations,
                        interpret=interpret)
            records.append(r)
            print(f"| {shape[0]}x{shape[1]} | {r['weight_mb']:.1f} | {fraction:g} | {r['matmul_us']:.2f} | "
                  f"{r['matmul_hot_us']:.2f} | "
                  f"{r['host_us']:.2f} | {r['host+matmul_us']:.2f} | {r['host+prefetch_us']:.2f} | "
                  f"{r['host+prefetch+matmul_us']:.2f} | {r['gain_us']:.2f} |", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    command = " ".join(["python tools/l2_probe.py", *(sys.argv[1:] if argv is None else argv)])
    report = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "command": command, "records": records}
    (args.out / "l2_probe.json").write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
