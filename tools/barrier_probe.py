"""Would a layer's projections run faster in one persistent kernel, its phases met at grid barriers, than a launch each?

    PYTHONPATH=. python tools/barrier_probe.py --out DIR [--layers 2] [--configs 16x256x4x4d,...] [--smoke]

What stands between the 8B AR step and its floor is fixed cost per kernel: ~13 launches a layer, each filling and
draining its pipeline, each waiting for every program of the one before (docs/performance.md). The form left to try
was fewer boundaries: a layer in one kernel whose programs stay resident and meet at grid barriers (an arrival count
in global memory). Before building that, this probe measures what the form costs at the Qwen3-8B AR shapes (one row,
bf16 weights: q|k|v 6144 x 4096, o_proj 4096 x 4096, gate|up 24576 x 4096, down_proj 4096 x 12288; 386 MB a layer),
microseconds per layer over `--layers` distinct layers in one device loop (`measure.timing.in_loop_seconds`):

- `launches`: the four projections as the engine streams one row (`pallas_kernels.stream_matmul`, the models'
  knobs: split sums after the kernel included), a launch each;
- `persistent`: one kernel a layer, one program per multiprocessor, four phases; each phase's input is the last
  phase's output (its first k entries), read after a grid barrier; program i streams row blocks i, i + P, ... of the
  phase's weight, whole rows (no split sums); a layer's input is the last layer's output;
- `unsynced`: the same kernel without its barriers, each phase reading a fixed input: the streaming alone;
- `barriers`: the persistent kernel's launch and its three barriers, no work; `empty`: its launch alone.

Each persistent config (`--configs`: rows x inputs a step x warps x stages) also checks its chained result against
the same chain in XLA (float32): a barrier that let a program read rows before they were written fails it.
A barrier: every thread's stores issued (`bar.sync`), one arrival per program (an acq_rel atomic add on the count,
whose old value v says the generation: the barrier is passed when the count reaches (v // P + 1) P), the count polled
by atomic adds of 0 until then, `bar.sync` again. P programs must all be resident at once: P is the multiprocessor
count, one program each. The count only grows (int32: ~16M barriers, enough for a probe; an engine would reset it).
`--smoke` runs tiny shapes interpreted on a CPU, the phases as separate kernels (interpreted programs run one after
another, so a barrier would wait forever).
Measured on an H100 (2026-12-06, docs/performance.md): a barrier costs what a kernel boundary costs (2.6-2.9 us).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from ddtree_jax.measure.timing import in_loop_seconds
from pallas_kernels import core_count, on_gpu
from pallas_kernels import stream_matmul as sm

# [out, in] of a Qwen3-8B layer's projections in the order a layer runs them; each phase reads the first `in`
# entries of the last phase's output.
LAYER_8B = ((6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288))
LAYER_SMOKE = ((192, 128), (128, 128), (512, 128), (128, 256))  # the streaming kernel's tiles


@dataclasses.dataclass(frozen=True)
class PersistentConfig:
    block_n: int = 8     # weight rows of a row block
    block_k: int = 1024  # inputs a step
    num_warps: int = 8
    num_stages: int = 3
    dot: bool = False    # the tensor cores (x as the first column of a [block_k, 16] bf16 tile), else FMAs

    @classmethod
    def parse(cls, text: str) -> "PersistentConfig":
        dot = text.endswith("d")
        n, k, w, s = (int(v) for v in text.removesuffix("d").split("x"))
        return cls(n, k, w, s, dot)

    def label(self) -> str:
        return f"{self.block_n}x{self.block_k}x{self.num_warps}x{self.num_stages}{'d' if self.dot else ''}"


def _barrier(count_ref, programs: int) -> None:
    """Every program of the grid waits here until all have arrived (module docstring)."""
    plt.debug_barrier()  # this program's threads have issued their stores
    arrived = plt.atomic_add(count_ref, 0, jnp.int32(1))  # acq_rel: releases the stores above
    target = (arrived // programs + 1) * programs

    def poll(_):  # an atomic read: its value comes to thread 0 and is shared with every thread of the program
        plt.debug_barrier()  # every thread has read the last poll's value before the next one overwrites it
        return plt.atomic_add(count_ref, 0, jnp.int32(0))

    # Not a volatile load by each thread: warps reading different counts could leave the loop on different polls and
    # then meet at different CTA barriers (the probe's second GPU run, which polled so, never finished its first
    # persistent row). The atomic's value is the same for every thread.
    lax.while_loop(lambda seen: seen < target, poll, arrived + 1)
    plt.debug_barrier()


def _phase(x_ref, w_ref, y_ref, *, pid, programs: int, config: PersistentConfig) -> None:
    """y [n] float32 = w [n, k] @ x [:k] for the row blocks pid, pid + programs, ...: whole rows, float32 sums."""
    n, k = w_ref.shape
    bn, bk = config.block_n, min(config.block_k, k)
    blocks = n // bn

    def row_block(j, carry):
        block = pid + j * programs

        @pl.when(block < blocks)
        def _():
            row0 = block * bn

            if config.dot:
                first = lax.broadcasted_iota(jnp.int32, (bk, 16), 1) == 0

                def step(s, acc):
                    xs = jnp.where(first, x_ref[pl.ds(s * bk, bk)][:, None], 0.0).astype(jnp.bfloat16)
                    return acc + jnp.dot(w_ref[pl.ds(row0, bn), pl.ds(s * bk, bk)], xs,
                                         preferred_element_type=jnp.float32)

                acc = lax.fori_loop(0, k // bk, step, jnp.zeros((bn, 16), jnp.float32))
                column0 = lax.broadcasted_iota(jnp.int32, (bn, 16), 1) == 0
                y_ref[pl.ds(row0, bn)] = jnp.sum(jnp.where(column0, acc, 0.0), axis=1)
            else:
                def step(s, acc):
                    w = w_ref[pl.ds(row0, bn), pl.ds(s * bk, bk)].astype(jnp.float32)
                    return acc + w * x_ref[pl.ds(s * bk, bk)][None, :]

                acc = lax.fori_loop(0, k // bk, step, jnp.zeros((bn, bk), jnp.float32))
                y_ref[pl.ds(row0, bn)] = jnp.sum(acc, axis=1)
        return carry

    lax.fori_loop(0, -(-blocks // programs), row_block, 0)


def _layer_kernel(*refs, programs: int, config: PersistentConfig, phases: tuple[int, ...], synced: bool):
    """refs: x [k0] float32, h [k3] float32 (the unsynced fourth phase's input), w_0..w_3, count (in), y_0..y_3
    float32, count (out, the same buffer). Runs `phases` of the layer (all four on a GPU; one when interpreted)."""
    x_ref, h_ref, *rest = refs
    w_refs, y_refs, count_ref = rest[:4], rest[5:9], rest[9]
    pid = pl.program_id(0)
    for i in phases:
        if i == 0:
            source = x_ref
        elif synced:
            source = y_refs[i - 1]
        else:
            source = h_ref if i == 3 else x_ref
        if synced and i > phases[0]:
            _barrier(count_ref, programs)
        _phase(source, w_refs[i], y_refs[i], pid=pid, programs=programs, config=config)


def persistent_layer(x, h, ws, count, *, config: PersistentConfig, synced: bool = True, interpret: bool = False,
                     programs: int | None = None):
    """One layer's four projections in one kernel (interpreted: one kernel a phase). x [k0] float32, h [k3] float32,
    ws four bf16 [n_i, k_i], count int32 [1] (donated through) -> ((y_0, ..., y_3) float32, count)."""
    if programs is None:
        programs = 4 if interpret else _multiprocessors()
    for n, in_k in (w.shape for w in ws):
        if n % config.block_n or in_k % min(config.block_k, in_k):
            raise ValueError(f"{config.label()}: block_n must divide every weight's rows and block_k its inputs")
    out_shape = [jax.ShapeDtypeStruct((w.shape[0],), jnp.float32) for w in ws] + [count]

    def call(phases, args):
        return pl.pallas_call(
            functools.partial(_layer_kernel, programs=programs, config=config, phases=phases, synced=synced),
            grid=(programs,), out_shape=out_shape, input_output_aliases={6: 4},
            compiler_params=plt.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages),
            interpret=interpret, name="persistent_layer")(*args)

    if not interpret:
        *ys, count = call((0, 1, 2, 3), (x, h, *ws, count))
        return tuple(ys), count
    ys = []
    for i in range(4):  # each phase its own kernel; only its own output y_i is kept from each call
        source = x if i == 0 or not synced else ys[-1][: ws[i].shape[1]]  # a compiled phase reads these in place
        outs = call((i,), (source, h, *ws, count))
        ys.append(outs[i])
        count = outs[4]
    return tuple(ys), count


PROGRAMS_PER_SM = 1  # resident programs a multiprocessor; more than fit at once would wait at the first barrier forever


def _multiprocessors() -> int:
    """The grid of a persistent kernel: PROGRAMS_PER_SM programs a multiprocessor."""
    return PROGRAMS_PER_SM * core_count()


def chain_reference(x, ws):
    """The persistent kernel's chain in XLA, float32: y_i = w_i @ (y_{i-1}[:k_i]) with y_{-1} = x."""
    ys, v = [], x
    for w in ws:
        y = jnp.dot(w.astype(jnp.float32), v[: w.shape[1]], precision=lax.Precision.HIGHEST)
        ys.append(y)
        v = y
    return ys


def make_layers(shapes, layers: int, seed: int = 0):
    """`layers` distinct layers of bf16 weights, each entry ~ N(0, 1 / k) (a chain of them keeps its scale)."""
    keys = jax.random.split(jax.random.PRNGKey(seed), layers * len(shapes))
    it = iter(keys)
    return tuple(tuple((jax.random.normal(next(it), (n, k), jnp.float32) * k ** -0.5).astype(jnp.bfloat16)
                       for n, k in shapes) for _ in range(layers))


def check_chain(config: PersistentConfig, shapes, *, interpret: bool) -> float:
    """Largest |kernel - XLA| / max |XLA| over the four outputs of the chained kernel, on the second of two inputs
    (so that a buffer still holding the first call's rows cannot pass for this call's)."""
    (ws,) = make_layers(shapes, 1, seed=7)
    run = jax.jit(functools.partial(persistent_layer, config=config, interpret=interpret))
    count = jnp.zeros((1,), jnp.int32)
    h = jnp.zeros((shapes[3][1],), jnp.float32)
    worst = 0.0
    for seed in (1, 2):
        x = jax.random.normal(jax.random.PRNGKey(seed), (shapes[0][1],), jnp.float32)
        ys, count = run(x, h, ws, count)
    for got, want in zip(ys, chain_reference(x, ws)):
        got, want = np.asarray(got), np.asarray(want)
        worst = max(worst, float(np.max(np.abs(got - want)) / np.max(np.abs(want))))
    return worst


def layer_loop(form: str, layers_ws, *, config: PersistentConfig, interpret: bool):
    """run(passes, x, h): `passes` times over the layers, each layer in `form`; returns the last output (each pass's
    input depends on the last pass's output, so nothing leaves the loop)."""
    stream_config = sm.StreamMatmulConfig()

    @jax.jit  # `passes` traced: one compile for every count
    def run(passes, x, h):
        def one_pass(_, carry):
            x, count = carry
            if form == "launches":
                xb, hb = x.astype(jnp.bfloat16)[None], h.astype(jnp.bfloat16)[None]
                used = jnp.float32(0)  # every projection's output feeds the carry: none is dead code
                for ws in layers_ws:
                    for i, w in enumerate(ws):
                        y = sm.stream_matmul(hb if i == 3 else xb, w, config=stream_config, implementation="pallas",
                                             interpret=interpret)
                        used = used + y[0, 0].astype(jnp.float32)
                return x.at[0].add(1e-3 * used), count
            if form in ("persistent", "unsynced"):
                for ws in layers_ws:
                    ys, count = persistent_layer(x, h, ws, count, config=config, synced=form == "persistent",
                                                 interpret=interpret)
                    if form == "persistent":
                        x = ys[3]  # the next layer's input (a layer's output has its input's size)
                # the count, donated from each kernel to the next, keeps every layer's kernel (none is dead code)
                return x.at[0].add(1e-3 * ys[3][0]), count
            for _ in layers_ws:  # barriers / empty: the persistent kernel's launch (and barriers) with no weights
                count = _bare(count, barriers=3 if form == "barriers" else 0, interpret=interpret)
            return x.at[0].add(1e-3 * count[0].astype(jnp.float32)), count
        return lax.fori_loop(0, passes, one_pass, (x, jnp.zeros((1,), jnp.int32)))[0]
    return run


def _bare_kernel(count_in, count_out, *, programs: int, barriers: int):
    del count_in  # the same buffer as count_out
    for _ in range(barriers):
        _barrier(count_out, programs)


def _bare(count, *, barriers: int, interpret: bool):
    programs = 4 if interpret else _multiprocessors()
    if interpret:
        barriers = 0  # interpreted programs run one after another: a barrier would wait forever
    return pl.pallas_call(functools.partial(_bare_kernel, programs=programs, barriers=barriers), grid=(programs,),
                          out_shape=count, input_output_aliases={0: 0},
                          compiler_params=plt.CompilerParams(num_warps=4, num_stages=1), interpret=interpret,
                          name="barriers" if barriers else "empty")(count)


def measure(form: str, layers_ws, shapes, *, config: PersistentConfig, repeats: int, iterations: int,
            interpret: bool) -> dict:
    run = layer_loop(form, layers_ws, config=config, interpret=interpret)
    x = jax.random.normal(jax.random.PRNGKey(3), (shapes[0][1],), jnp.float32)
    h = jax.random.normal(jax.random.PRNGKey(4), (shapes[3][1],), jnp.float32)
    per_pass, _ = in_loop_seconds(lambda p: run(jnp.int32(p), x, h), repeats, iterations=iterations)
    us = per_pass / len(layers_ws) * 1e6
    layer_bytes = sum(n * k * 2 for n, k in shapes)
    record = {"form": form, "us_per_layer": us}
    if form in ("launches", "persistent", "unsynced"):
        record["gb_per_s"] = layer_bytes / (us * 1e-6) / 1e9 if us > 0 else None
    if form in ("persistent", "unsynced"):
        record["config"] = config.label()
    return record


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--layers", type=int, default=2,
                   help="distinct layers the loop cycles through (a layer's 386 MB already leave nothing in L2)")
    p.add_argument("--configs", default="8x1024x8x3,16x512x8x3,16x256x4x4d,32x256x4x4d",
                   help="comma list of persistent-kernel configs: rows x inputs a step x warps x stages, a trailing "
                        "d for the tensor cores")
    p.add_argument("--programs-per-sm", type=int, default=1, help="resident programs a multiprocessor (all must fit)")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--smoke", action="store_true", help="tiny shapes, interpreted (CPU)")
    args = p.parse_args(argv)
    try:
        configs = [PersistentConfig.parse(c) for c in args.configs.split(",")]
    except ValueError:
        print(f"error: --configs {args.configs!r}: expected comma-separated ROWSxINPUTSxWARPSxSTAGES, e.g. "
              "8x1024x8x3", file=sys.stderr)
        return 2
    shapes, layers, repeats, iterations = LAYER_8B, args.layers, args.repeats, 4
    if args.smoke:
        shapes, layers, repeats, iterations = LAYER_SMOKE, 2, 1, 2
        configs = [PersistentConfig(8, 64, 4, 2), PersistentConfig(16, 64, 4, 2, dot=True)]
    global PROGRAMS_PER_SM
    PROGRAMS_PER_SM = args.programs_per_sm
    interpret = args.smoke or not on_gpu()
    layers_ws = make_layers(shapes, layers)
    records = []
    command = " ".join(["python tools/barrier_probe.py", *(sys.argv[1:] if argv is None else argv)])
    args.out.mkdir(parents=True, exist_ok=True)
    print("| form | config | us per layer | GB/s | chained result, max rel. error |")
    print("|---|---|---|---|---|")

    def emit(r):  # the report rewritten after each row (temporary file, then rename): a cut run keeps its rows
        records.append(r)
        gbs = f"{r['gb_per_s']:.0f}" if r.get("gb_per_s") else ""
        err = f"{r['check_rel_error']:.1e}" if "check_rel_error" in r else ""
        print(f"| {r['form']} | {r.get('config', '')} | {r['us_per_layer']:.2f} | {gbs} | {err} |", flush=True)
        report = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "command": command,
                  "programs_per_sm": PROGRAMS_PER_SM, "layer_shapes": [list(s) for s in shapes], "layers": layers,
                  "records": records}
        partial = args.out / "barrier_probe.json.partial"
        partial.write_text(json.dumps(report, indent=1))
        partial.replace(args.out / "barrier_probe.json")

    for form in ("empty", "barriers", "launches"):
        emit(measure(form, layers_ws, shapes, config=configs[0], repeats=repeats, iterations=iterations,
                     interpret=interpret))
    for config in configs:
        for form in ("persistent", "unsynced"):
            r = measure(form, layers_ws, shapes, config=config, repeats=repeats, iterations=iterations,
                        interpret=interpret)
            if form == "persistent":
                r["check_rel_error"] = check_chain(config, shapes, interpret=interpret)
            emit(r)
    return 0


if __name__ == "__main__":
    sys.exit(main())
