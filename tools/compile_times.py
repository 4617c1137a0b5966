"""Lower and compile times (and HLO sizes) of one decoding round and of each of its stages, on abstract inputs.

    PYTHONPATH=. python tools/compile_times.py --shape qwen3-8b --budgets 16,64,256 --layers 4,36 \
        [--stages round,tree] [--timeout 120]
    # a CUDA compile without a GPU (needs jax-cuda12-plugin/-pjrt of jax's version installed):
    JAX_PLATFORMS=cpu JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 PYTHONPATH=. python tools/compile_times.py \
        --gpu-target-config h200 --timeout 300

Nothing is allocated: parameters, caches and the decode state are `jax.ShapeDtypeStruct`s (the shapes the
benchmark builds, `measure.workload`: batch 1, bf16, a cache of `--context` tokens), and every
program is AOT-lowered with `jax.jit(f).lower(...)` and compiled with `.compile()` on the default backend
(or for the `--gpu-target-config` GPU), so an 8B round compiles on a CPU or shows in seconds on a GPU where
the time goes. Per (layers, mode, budget, stage) it prints lower and compile seconds, the StableHLO op count
of the lowered module, the instruction count of the optimised HLO and its sort / gather / scatter / while
ops (a Python loop unrolled over layers, depths or nodes shows as counts that grow with it), and the
largest constant in the optimised HLO. `--timeout` runs each measurement in a child process and reports
one that runs past it instead of hanging.

Stages: round (the whole round, state donated) and the round's own stage functions (`round.STAGES`: draft,
tree, verify, accept, commit), as the benchmark compiles them (`measure.workload.stage_programs`); any target
family, the hybrid shapes included.

What this found (CPU cannot show it: XLA's CPU backend compiled the old round in 10 s): the DDTree round
did not compile on the GPU because `tree.ancestor_mask`'s 15-level chain `parents[parents[...]]` was fused
into one kernel whose emitter re-emits every earlier gather for each later one; the tree stage alone ran
past 240 s at every budget (deviceless H200 compile), 4 s after the fix.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time

STAGES = ("round", "draft", "tree", "verify", "accept", "commit")

# The H200's public hardware figures as a stream_executor.GpuTargetConfigProto (text format), for deviceless
# compilation with `--gpu-target-config h200`: 132 SMs, compute capability 9.0, 228 KiB shared memory per SM
# (227 KiB per block opt-in), 64 Ki registers, 50 MiB L2, 141 GB HBM3e at 4.8 TB/s, 1.98 GHz boost clock.
H200_TARGET_CONFIG = """
gpu_device_info {
  threads_per_block_limit: 1024  threads_per_warp: 32  shared_memory_per_block: 49152
  shared_memory_per_core: 233472  threads_per_core_limit: 2048  core_count: 132  fpus_per_core: 128
  block_dim_limit_x: 2147483647  block_dim_limit_y: 65535  block_dim_limit_z: 65535
  memory_bandwidth: 4800000000000  l2_cache_size: 52428800  clock_rate_ghz: 1.98
  device_memory_size: 151397597184  shared_memory_per_block_optin: 232448
  cuda_compute_capability { major: 9 }  registers_per_core_limit: 65536  registers_per_block_limit: 65536
}
platform_name: "CUDA"
dnn_version_info { major: 9 minor: 10 }
device_description_str: "NVIDIA H200"
"""


def _configs(shape: str, layers: int | None):
    """Parsed target and drafter configs of a named shape, the target cut to `layers` decoder layers."""
    from ddtree_jax.config import TARGET_PARSERS, parse_dflash
    from ddtree_jax.shapes import shape_configs

    target_raw, drafter_raw = shape_configs(shape, layers)
    return TARGET_PARSERS[target_raw["model_type"]](target_raw), parse_dflash(drafter_raw)


def _stage_programs(target, drafter, context: int, options) -> dict:
    """{stage: (function, abstract args, static kwargs, donate_argnums)}: the whole round (state donated)
    and the round's own stage functions (`measure.workload.stage_programs`, `round.STAGES`) on the decode
    state the benchmark builds (`measure.workload.empty_state`, 6 rounds of room), shapes only."""
    import jax

    from ddtree_jax import round as rnd
    from ddtree_jax.measure import workload

    state = jax.eval_shape(lambda: workload.empty_state(target.config, drafter.config, context, options, 6))
    programs = {"round": (rnd.ROUNDS[options.mode], (target, drafter, state), {"options": options}, (2,))}
    if options.mode.needs_drafter:
        stages = workload.stage_programs(target, drafter, state, options,
                                         lambda name, fn, args, static: jax.eval_shape(
                                             lambda *a: fn(*a, **static), *args))
        programs.update({name: (fn, args, static, ()) for name, (fn, args, static) in stages.items()})
    return programs


_CONSTANT = re.compile(r"= (\w+)\[([\d,]*)\]\S* constant\(")


def _hlo_stats(lowered_text: str, compiled_text: str) -> dict:
    """Op counts of the StableHLO module and the optimised HLO; the largest HLO constant (elements)."""
    stablehlo_ops = sum(1 for line in lowered_text.splitlines()
                        if re.match(r"^\s*(%\S+ = |\"?stablehlo\.|func\.)", line)
                        and ("stablehlo." in line or "func.call" in line or "chlo." in line))
    hlo_ops = sum(1 for line in compiled_text.splitlines() if re.match(r"^\s*(ROOT )?%?[\w.\-]+ = ", line))
    largest = 0
    for m in _CONSTANT.finditer(compiled_text):
        n = 1
        for dim in filter(None, m.group(2).split(",")):
            n *= int(dim)
        largest = max(largest, n)
    kinds = {kind: len(re.findall(rf" {kind}\(", compiled_text)) for kind in ("sort", "gather", "scatter", "while")}
    return {"stablehlo_ops": stablehlo_ops, "stablehlo_chars": len(lowered_text), "hlo_ops": hlo_ops,
            "largest_constant": largest, **kinds}


def _on_device(tree, device):
    """Every ShapeDtypeStruct leaf of `tree` placed on `device` (a compile-only device of a topology)."""
    import jax
    from jax.sharding import SingleDeviceSharding

    sharding = SingleDeviceSharding(device)
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding)
                        if isinstance(a, jax.ShapeDtypeStruct) else a, tree)


def gpu_topology_device(target_config: str):
    """A compile-only CUDA device: "h200" (H200_TARGET_CONFIG) or a GpuTargetConfigProto text file.

    Deviceless AOT: needs jax's CUDA plugin (jax-cuda12-plugin and -pjrt of jax's version) but no GPU; run
    with JAX_PLATFORMS=cpu JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 on a machine without one. XLA runs its whole GPU
    pipeline and code generation, but no autotuning, and large sorts fall back from CUB to XLA's own sort
    kernels (slower to compile), so the times approximate, not reproduce, a compile on the GPU.
    """
    from jax.experimental import topologies

    if target_config == "h200":
        text = H200_TARGET_CONFIG
    else:
        with open(target_config) as f:
            text = f.read()
    return topologies.get_topology_desc("", "cuda", topology="1x1x1", target_config=text).devices[0]


def measure(fn, args, static=None, donate=(), compile_=True, device=None) -> dict:
    import jax

    static = static or {}
    jitted = jax.jit(fn, static_argnames=tuple(static), donate_argnums=donate)
    start = time.perf_counter()
    if device is None:
        lowered = jitted.lower(*args, **static)
    else:
        lowered = jitted.trace(*_on_device(args, device), **static).lower(lowering_platforms=("cuda",))
    lower_s = time.perf_counter() - start
    text = lowered.as_text()
    out = {"lower_s": round(lower_s, 2)}
    compiled_text = ""
    if compile_:
        start = time.perf_counter()
        compiled = lowered.compile()
        out["compile_s"] = round(time.perf_counter() - start, 2)
        compiled_text = compiled.as_text() or ""
    out.update(_hlo_stats(text, compiled_text))
    return out


def _print_row(row: dict, as_json: bool) -> None:
    if as_json:
        print(json.dumps(row), flush=True)
        return
    if "error" in row:
        print(f"{row['layers']:>6} {row['mode']:>6} {row['budget'] or '-':>4} {row['stage']:>7}  {row['error']}",
              flush=True)
        return
    print(f"{row['layers']:>6} {row['mode']:>6} {row['budget'] or '-':>4} {row['stage']:>7} {row['lower_s']:>8.2f} "
          f"{row.get('compile_s', float('nan')):>9.2f} {row['stablehlo_ops']:>9} {row['hlo_ops']:>8} "
          f"{row['sort']:>5} {row['gather']:>6} {row['scatter']:>7} {row['while']:>5} {row['largest_constant']:>10}",
          flush=True)


def _isolated(args, n_layers, mode: str, budget, stage: str) -> dict:
    """One measurement in a child process with a time limit (a compile that hangs cannot be interrupted
    from Python)."""
    cmd = [sys.executable, os.path.abspath(__file__), "--json", "--shape", args.shape, "--modes", mode,
           "--stages", stage, "--context", str(args.context), "--kernels", args.kernels,
           "--budgets", str(budget or 64), "--layers", str(n_layers)]
    cmd += ["--lower-only"] * args.lower_only
    cmd += ["--gpu-target-config", args.gpu_target_config] if args.gpu_target_config else []
    row = {"layers": n_layers, "mode": mode, "budget": budget, "stage": stage}
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        return {**row, "error": f"did not finish within {args.timeout:g} s"}
    rows = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode or not rows:
        return {**row, "error": f"exit {done.returncode}: {(done.stderr.strip().splitlines() or [''])[-1][:200]}"}
    return json.loads(rows[-1])


def main(argv=None) -> int:
    import warnings

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", default="qwen3-8b", help="a ddtree_jax.shapes.SHAPES name")
    p.add_argument("--budgets", default="16,64,256", help="DDTree budgets, comma-separated")
    p.add_argument("--layers", default="", help="target decoder layer counts, comma-separated (default: the shape's)")
    p.add_argument("--modes", default="dflash,ddtree", help="comma-separated of ar, dflash, ddtree")
    p.add_argument("--stages", default=",".join(STAGES), help=f"comma-separated of {', '.join(STAGES)}")
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--kernels", default="jax", choices=["jax", "pallas"])
    p.add_argument("--lower-only", action="store_true", help="skip .compile() (StableHLO op counts only)")
    p.add_argument("--timeout", type=float, default=0,
                   help="seconds per measurement, each in a child process (0: all in this process, no limit)")
    p.add_argument("--json", action="store_true", help="one JSON object per line instead of a table")
    p.add_argument("--gpu-target-config", default=None, metavar="h200|TXTPB",
                   help="compile for a CUDA GPU without one (deviceless AOT; see gpu_topology_device)")
    args = p.parse_args(argv)
    warnings.filterwarnings("ignore", message=".*donated.*")  # CPU cannot donate; irrelevant here

    import jax

    from ddtree_jax.engine import DecodeOptions, Mode
    from ddtree_jax.models import dflash, target_family

    budgets = [int(x) for x in args.budgets.split(",") if x]
    stages = [s for s in args.stages.split(",") if s]
    modes = [m for m in args.modes.split(",") if m]
    device = gpu_topology_device(args.gpu_target_config) if args.gpu_target_config and not args.timeout else None
    if not args.json:
        where = ("cuda (deviceless AOT)" if args.gpu_target_config
                 else f"{jax.default_backend()} ({jax.devices()[0].device_kind})")
        print(f"backend {where}, jax {jax.__version__}; hlo_ops and the op kinds count the optimised HLO",
              flush=True)
        print(f"{'layers':>6} {'mode':>6} {'B':>4} {'stage':>7} {'lower_s':>8} {'compile_s':>9} {'shlo_ops':>9} "
              f"{'hlo_ops':>8} {'sort':>5} {'gather':>6} {'scatter':>7} {'while':>5} {'max_const':>10}", flush=True)
    layer_counts = [int(x) for x in args.layers.split(",") if x] or [None]
    for n_layers in layer_counts:
        t_cfg, d_cfg = _configs(args.shape, n_layers)
        target, drafter = target_family(t_cfg).abstract(t_cfg), dflash.abstract(d_cfg, t_cfg.hidden_size)
        plan = [(m, None) for m in modes if m != "ddtree"] + [("ddtree", b) for b in budgets if "ddtree" in modes]
        for mode, budget in plan:
            options = DecodeOptions(mode=Mode(mode), max_new_tokens=4096, block_size=16, budget=budget or 64,
                                    kernels=args.kernels)
            programs = _stage_programs(target, drafter, args.context, options)
            for stage in (s for s in stages if s in programs):
                if args.timeout:
                    row = _isolated(args, t_cfg.num_layers, mode, budget, stage)
                else:
                    fn, fn_args, static, donate = programs[stage]
                    row = {"layers": t_cfg.num_layers, "mode": mode, "budget": budget, "stage": stage,
                           **measure(fn, fn_args, static, donate, not args.lower_only, device)}
                _print_row(row, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
