"""Compile the kernels for sm_90 on a machine without a GPU, and report their resources (a development aid).

    pip install triton            # not a project dependency; 3.9 was used here (3.5 reads the same)
    python tools/triton_offline.py [--quick] [--only TEXT] [--by-line N]

For each kernel at the kernel_check shapes and configs: jax lowers the Pallas kernel to Triton IR (as it
does on a GPU), the pip `triton` compiles that IR for compute capability 9.0, and `cuobjdump` (shipped
with triton) reads the cubin's registers, spill stack and shared memory, from which programs per SM
follow, and counts its F2F conversions (the FP8 streaming matmul's bound, `pallas_kernels.stream_matmul`).
`--by-line N` adds the N kernel source lines with the most SASS instructions (`nvdisasm`'s line table, static
counts: where a kernel's instructions are, for a kernel bound by its instruction issue on few multiprocessors).
This catches Triton compile errors and shared-memory overflows before spending device time;
XLA's own Triton (inside jaxlib) may still differ in detail, so the GPU run remains the judge.
Reads a private jax hook (`jax._src.pallas.triton.lowering.lower_jaxpr_to_triton_module`).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib.util
import os
import re
import subprocess
import sys
import tempfile
import types

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import kernel_check  # noqa: E402
from pallas_kernels import commit_rows as cr  # noqa: E402
from pallas_kernels import launch as kernel_launch  # noqa: E402
from pallas_kernels import tree_accept as tac  # noqa: E402
from pallas_kernels import tree_attention as ta  # noqa: E402
from pallas_kernels import qk_norm_rope as qk  # noqa: E402
from pallas_kernels import rms_norm as rn  # noqa: E402
from pallas_kernels import stream_matmul as smm  # noqa: E402
from pallas_kernels import tree_build as tbk  # noqa: E402
from pallas_kernels import tree_delta_rule as tdr  # noqa: E402
from pallas_kernels import vocab_top_k as vtk  # noqa: E402
from ddtree_jax.models import layers  # noqa: E402
from ddtree_jax.models.contract import Kernels, Runtime  # noqa: E402

SMEM_PER_SM = smm.SHARED_MEMORY_PER_CORE  # bytes on sm_90 (228 KiB); one block may take up to 227 KiB
SMEM_PER_BLOCK = 232448
REGS_PER_SM = 65536
MERGE = ta.TreeAttentionConfig(num_warps=4, num_stages=1)  # the merge kernel's launch settings (tree_attention._merge_partials)


def triton_ir(fn, args, which: int = 0, debug_info: bool = False) -> str:
    """The Triton IR (text) of the `which`-th pallas_call that lowering `fn(*args)` for CUDA produces (the tree
    attention's first is the attention, its second the merge of its chunks); with debug_info, each op's source
    location (`#loc` lines), which the compiled code's line table then carries."""
    from jax._src.pallas.triton import lowering

    captured = []
    original = lowering.lower_jaxpr_to_triton_module

    def capture(*a, **k):
        result = original(*a, **k)
        captured.append(result.module.operation.get_asm(enable_debug_info=debug_info))
        return result

    lowering.lower_jaxpr_to_triton_module = capture
    jax.clear_caches()  # a kernel lowered before (another `which` of the same fn) would not be lowered again
    try:
        jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
    finally:
        lowering.lower_jaxpr_to_triton_module = original
    return captured[which]


def instructions_by_line(sass: str, ir_text: str, top: int) -> list[tuple[int, str]]:
    """The `top` source lines with the most SASS instructions, most first: (count, "file:line: text"), from
    `nvdisasm -g -c`'s listing (a `//## File ..., line N` comment before the instructions of line N; its file
    name is lost on the way) and the IR's `#loc` table, which names the files that have an op at line N (every
    one of them is shown, with its text where the file can be read). Static counts: an instruction inside a loop
    counts once, whatever its trips."""
    files_at: dict[int, set[str]] = {}
    for path, line in re.findall(r'^#loc\d* = loc\("([^"]+)":(\d+):', ir_text, re.M):
        files_at.setdefault(int(line), set()).add(path)
    counts: dict[int | None, int] = {}
    line = None
    for text in sass.splitlines():
        found = re.search(r"//## File .*, line (\d+)", text)
        if found:
            line = int(found.group(1))
        elif re.match(r"\s+/\*[0-9a-f]{4,}\*/\s+\S", text):  # an instruction: /*offset*/ [predicate] OPCODE
            counts[line] = counts.get(line, 0) + 1
    rows = []
    for line, count in sorted(counts.items(), key=lambda item: -item[1])[:top]:
        places = []
        for path in sorted(files_at.get(line, ())) if line is not None else ():
            try:
                with open(path) as f:
                    source = f.read().splitlines()[line - 1].strip()
            except (OSError, IndexError):
                source = ""
            places.append(f"{os.path.relpath(path)}:{line}: {source}")
        rows.append((count, " | ".join(places) or f"line {line}"))
    return rows


def resources(ir_text: str, num_warps: int, num_stages: int, by_line: int = 0) -> dict:
    import triton
    from triton.backends.compiler import GPUTarget

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.ttir")
        with open(path, "w") as f:
            f.write(ir_text)
        kernel = triton.compile(path, target=GPUTarget("cuda", 90, 32),
                                options=dict(num_warps=num_warps, num_stages=num_stages))
        cubin = os.path.join(tmp, "kernel.cubin")
        with open(cubin, "wb") as f:
            f.write(kernel.asm["cubin"])
        tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
        usage = subprocess.run([tool, "-res-usage", cubin], capture_output=True, text=True, check=True).stdout
        sass = subprocess.run([tool, "-sass", cubin], capture_output=True, text=True, check=True).stdout
        ptx = kernel.asm["ptx"]
        if by_line:
            disasm = os.path.join(os.path.dirname(tool), "nvdisasm")
            listing = subprocess.run([disasm, "-g", "-c", cubin], capture_output=True, text=True, check=True).stdout
    smem = int(kernel.metadata.shared)
    regs = int(re.search(r"REG:(\d+)", usage).group(1))
    stack = int(re.search(r"STACK:(\d+)", usage).group(1))
    threads = 32 * num_warps
    per_sm = min(SMEM_PER_SM // (smem + smm.SHARED_MEMORY_RESERVED), REGS_PER_SM // (-(-regs // 8) * 8 * threads),
                 64 // num_warps, 32)
    found = dict(smem=smem, regs=regs, spill_stack=stack, programs_per_sm=per_sm, fits=smem <= SMEM_PER_BLOCK,
                 mma=_mma(ptx), conversions=len(re.findall(r"\bF2F\.", sass)),
                 ptx_cvt=len(re.findall(r"\bcvt\.", ptx)))
    if by_line:
        found["by_line"] = instructions_by_line(listing, ir_text, by_line)
    return found


def dense_streamed_weights(shape_names) -> list[tuple[str, tuple[int, int]]]:
    """(shape name, [out, in]) of every distinct dense projection of the named shapes' targets and drafters that a call
    of few rows streams (`layers.dense_stream_config`: not the lm_head, weights of `DENSE_STREAM_MIN_BYTES` and more)."""
    from flax import nnx

    from ddtree_jax import shapes
    from ddtree_jax.config import parse_dflash, parse_target
    from ddtree_jax.models import dflash, target_family

    found = []
    for name in shape_names:
        target_raw, drafter_raw = shapes.shape_configs(name)
        target, drafter = parse_target(target_raw), parse_dflash(drafter_raw)
        family = target_family(target)
        weights = set()
        for module in (nnx.eval_shape(lambda: family.build(target)(nnx.Rngs(0))),
                       nnx.eval_shape(lambda: dflash.build(drafter, target.hidden_size)(nnx.Rngs(0)))):
            for path, child in nnx.iter_modules(module):
                if isinstance(child, layers.PackedProjections) and child.packed:
                    g, u, r, n_in = child.weight.shape
                    weights.add((g * u * r, n_in))
                elif isinstance(child, layers.Linear) and path[-1] != "lm_head":
                    weights.add(tuple(child.weight.shape))
        found += [(name, w) for w in sorted(weights)
                  if layers.dense_stream_config(w, 1, Runtime(Kernels.PALLAS)) is not None]
    return found


def _mma(ptx: str) -> str:
    """The tensor-core instruction of a PTX text with its shape and operand types, e.g. "wgmma
    m64n16k32.f32.e4m3.e4m3" or "mma.sync m16n8k16.row.col.f32.f16.f16.f32"; "none" without one."""
    found = re.search(r"wgmma\.mma_async\.sync\.aligned\.(\S+?)[\s{]", ptx)
    if found:
        return f"wgmma {found.group(1)}"
    found = re.search(r"mma\.sync\.aligned\.(\S+?)[\s{]", ptx)
    return f"mma.sync {found.group(1)}" if found else "none"


def _with_split_sums_kernel(fn):
    """fn traced with `stream_matmul.SPLIT_SUMS_KERNEL` on (read when the kernel's program is traced)."""
    def traced(*args):
        smm.SPLIT_SUMS_KERNEL, before = True, smm.SPLIT_SUMS_KERNEL
        try:
            return fn(*args)
        finally:
            smm.SPLIT_SUMS_KERNEL = before
    return traced


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python tools/triton_offline.py", description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="default configs only")
    parser.add_argument("--only", default="", help="only the kernels whose label contains this text")
    parser.add_argument("--by-line", type=int, default=0, metavar="N",
                        help="also the N source lines with the most SASS instructions (static counts), per kernel")
    args = parser.parse_args(argv)
    if importlib.util.find_spec("triton") is None:
        print("error: needs the `triton` package (pip install triton)", file=sys.stderr)
        return 2
    kernel_launch.early_launch_supported = lambda: True  # for sm_90: with the launch signal, as a GPU runs them
    shape = kernel_check.FULL
    sds = jax.ShapeDtypeStruct
    b, hq, n, d = (shape[k] for k in ("b", "hq", "n", "d"))
    s = max(shape["s"])  # the longest timed cache: resources hardly depend on it
    jobs = []
    for dtype in (jnp.bfloat16, jnp.float32):
        configs = [ta.TreeAttentionConfig()] + ([] if args.quick or dtype == jnp.float32 else kernel_check.ATTN_SWEEP)
        for t in shape["t"]:
            attn_args = [sds((b, t, hq, d), dtype), sds((b, s, n, d), dtype), sds((b, s, n, d), dtype),
                         sds((b,), jnp.int32), sds((b, t, n, d), dtype), sds((b, t, n, d), dtype),
                         sds((b, t, t), bool), sds((b, t), jnp.int32)]
            for config in configs + [ta.TreeAttentionConfig(row_invariant=True, num_stages=st) for st in (1, 2)]:
                fn = functools.partial(ta.tree_attention_pallas, scale=d ** -0.5, config=config)
                kind = "tree_attention row_invariant" if config.row_invariant else "tree_attention"
                jobs.append((f"{kind} {jnp.dtype(dtype).name} T={t}", config, fn, attn_args))
            fn = functools.partial(ta.tree_attention_pallas, scale=d ** -0.5)
            jobs.append((f"attention merge {jnp.dtype(dtype).name} T={t}", MERGE, fn, attn_args, 1))
        for rows in (1, 65):
            jobs.append((f"add_rms_norm {jnp.dtype(dtype).name} rows={rows}", rn.RMSNormConfig(),
                         functools.partial(rn.add_rms_norm_pallas, eps=1e-6),
                         [sds((rows, 4096), dtype), sds((rows, 4096), dtype), sds((4096,), dtype)]))
            jobs.append((f"qk_norm_rope {jnp.dtype(dtype).name} rows={rows}", rn.RMSNormConfig(),
                         functools.partial(qk.qk_norm_rope_pallas, eps=1e-6),
                         [sds((rows, n, hq // n + 2, d), dtype), sds((d,), dtype), sds((d,), dtype),
                          sds((rows, d), jnp.float32), sds((rows, d), jnp.float32)]))
            if dtype == jnp.bfloat16:  # W8A8's rows quantised here
                jobs.append((f"add_rms_norm fp8 rows rows={rows}", rn.RMSNormConfig(),
                             functools.partial(rn.add_rms_norm_pallas, eps=1e-6, quantize_group=128),
                             [sds((rows, 4096), dtype), sds((rows, 4096), dtype), sds((4096,), dtype)]))
            jobs.append((f"qk_norm_rope kv_write {jnp.dtype(dtype).name} rows={rows}", rn.RMSNormConfig(),
                         functools.partial(qk.qk_norm_rope_pallas, eps=1e-6),
                         [sds((1, rows, n, hq // n + 2, d), dtype), sds((d,), dtype), sds((d,), dtype),
                          sds((1, rows, d), jnp.float32), sds((1, rows, d), jnp.float32),
                          sds((1, s, n, d), dtype), sds((1, s, n, d), dtype), sds((1,), jnp.int32)]))
        configs = [tac.TreeAcceptConfig()] + ([] if args.quick or dtype == jnp.float32 else kernel_check.ACCEPT_SWEEP)
        for t in shape["accept_t"]:
            acc_args = [sds((1, t, shape["vocab"]), dtype)]
            for config in configs:
                fn = functools.partial(tac.greedy_tokens_pallas, config=config)
                jobs.append((f"tree_accept {jnp.dtype(dtype).name} T={t}", config, fn, acc_args))
    for budget in (16, 64, 128, 256, 512):  # the tree build after the top-k, L = 15 (block 16), batch 1 and 4
        for rows in (1, 4):
            build_args = [sds((rows, 15, budget), jnp.float32), sds((rows, 15, budget), jnp.int32),
                          sds((rows,), jnp.int32)]
            default = tbk.default_config(budget)
            configs = [default] + ([] if args.quick or rows > 1 else [
                dataclasses.replace(default, **knobs) for knobs in (
                    dict(block_rows=256), dict(num_warps=4), dict(block_rows=256, num_warps=4), dict(prune=0),
                    dict(fuse_above=1), dict(fuse_above=1, num_warps=4), dict(hoist_pairs=1),
                    dict(fuse_above=1, hoist_pairs=1), dict(merge_search=1), dict(block_rows=512), dict(block=64),
                    dict(num_warps=16))])
            for config in dict.fromkeys(configs):  # a variant equal to the default (above B = 128) compiled once
                fn = functools.partial(tbk.tree_build_pallas, budget=budget, config=config)
                jobs.append((f"tree_build B={budget} b={rows}", config, fn, build_args))
    for k in (16, 64, 128, 256, 512):  # the vocabulary top-k's three launches, 15 rows of the Qwen vocabulary
        config = vtk.default_config(151936, k)
        fn = functools.partial(vtk.vocab_top_k_pallas, k=k, config=config)
        for which, launch in enumerate(("chunk maxima", "compact", "select")):
            stages = config.num_stages if which < 2 else 1
            jobs.append((f"vocab_top_k k={k} {launch}", dataclasses.replace(config, num_stages=stages), fn,
                         [sds((15, 151936), jnp.float32)], which))
        # The hot chunks gathered a step at a time, other steps than the default's 1024 (62-71 registers, 3-4 programs
        # a multiprocessor; 4096-entry steps: 128-197, 1-2)
        for gathered in [] if args.quick else [dataclasses.replace(config, skip_cold=2, step=step)
                                               for step in (512, 2048, 4096)]:
            jobs.append((f"vocab_top_k k={k} compact", gathered,
                         functools.partial(vtk.vocab_top_k_pallas, k=k, config=gathered),
                         [sds((15, 151936), jnp.float32)], 1))
        if not args.quick:  # the selection over one program per row, or one per row block (the default above 128)
            split = dataclasses.replace(config, split_select=1 - config.split_select, num_stages=1)
            jobs.append((f"vocab_top_k k={k} select", split,
                         functools.partial(vtk.vocab_top_k_pallas, k=k, config=split),
                         [sds((15, 151936), jnp.float32)], 2))
    for rows in (1, 16, 65):  # the weight-streaming matmul on a Qwen3-8B projection, bf16 and block-scaled FP8
        x = sds((rows, 4096), jnp.bfloat16)
        models = dataclasses.replace(layers.FP8_STREAM_KNOBS, splits=1)  # the models' knobs (prefetch, fp8_bits)
        for config in (smm.StreamMatmulConfig(splits=1), smm.StreamMatmulConfig(splits=1, fp8_bits=1), models):
            fn = functools.partial(smm.stream_matmul_pallas, block=(128, 128), config=config)
            jobs.append((f"stream_matmul fp8 rows={rows}", config, fn,
                         [x, sds((4096, 4096), jnp.float8_e4m3fn), sds((32, 32), jnp.float32)]))
        config = smm.StreamMatmulConfig(splits=1)
        fn = functools.partial(smm.stream_matmul_pallas, config=config)
        jobs.append((f"stream_matmul bf16 rows={rows}", config, fn, [x, sds((4096, 4096), jnp.bfloat16)]))
        # FP8 rows (W8A8): Hopper's FP8 wgmma only where `pallas_kernels._fp8_dot` sets maxNumImpreciseAcc
        # (promote_k 0, Pallas's own dot: mma.sync on float16 copies)
        for config in (smm.StreamMatmulConfig(splits=1), smm.StreamMatmulConfig(splits=1, promote_k=0)):
            fn = functools.partial(smm.stream_matmul_pallas, block=(128, 128), config=config, out_dtype=jnp.bfloat16)
            jobs.append((f"stream_matmul w8a8 rows={rows}", config,
                         lambda xq, w, s, xs, fn=fn: fn(xq, w, s, x_scale=xs),
                         [sds((rows, 4096), jnp.float8_e4m3fn), sds((4096, 4096), jnp.float8_e4m3fn),
                          sds((32, 32), jnp.float32), sds((rows, 32), jnp.float32)]))
        for config in (smm.StreamMatmulConfig(splits=1), models):  # W8A8, the bf16 rows quantised inside the kernel
            jobs.append((f"stream_matmul w8a8 quantize_x rows={rows}", config,
                         functools.partial(smm.stream_matmul_pallas, block=(128, 128), quantize_x=True, config=config),
                         [x, sds((4096, 4096), jnp.float8_e4m3fn), sds((32, 32), jnp.float32)]))
        config = smm.StreamMatmulConfig(splits=4)  # k in 4 splits, the partial sums stored [s, tp, n] (transposed)
        jobs.append((f"stream_matmul w8a8 quantize_x splits=4 rows={rows}", config,
                     functools.partial(smm.stream_matmul_pallas, block=(128, 128), quantize_x=True, config=config),
                     [x, sds((4096, 4096), jnp.float8_e4m3fn), sds((32, 32), jnp.float32)]))
    for label, w in dense_streamed_weights(("qwen3-8b", "qwen3.6-27b")):  # small calls' bf16 projections, as streamed
        for rows in (1, 17, 32):
            config = layers.dense_stream_config(w, rows, Runtime(Kernels.PALLAS))
            jobs.append((f"stream_matmul dense {label} {w[0]}x{w[1]} rows={rows}", config,
                         functools.partial(smm.stream_matmul_pallas, config=config),
                         [sds((rows, w[1]), jnp.bfloat16), sds(w, jnp.bfloat16)]))
            glu = layers.dense_stream_config(w, rows, Runtime(Kernels.PALLAS), glu=True)
            if w[0] % 2 == 0 and glu is not None:  # as if gate|up: SwiGLU in the epilogue where one split
                jobs.append((f"stream_matmul dense glu {label} {w[0]}x{w[1]} rows={rows}", glu,
                             functools.partial(smm.stream_matmul_pallas, config=glu, glu=True),
                             [sds((rows, w[1]), jnp.bfloat16), sds(w, jnp.bfloat16)]))
    for rows in (1, 17, 32, 65):  # the split sums' own kernel (`SPLIT_SUMS_KERNEL`), the second launch
        config = smm.StreamMatmulConfig(splits=4)
        jobs.append((f"stream_matmul split sums rows={rows}", types.SimpleNamespace(num_warps=4, num_stages=1),
                     _with_split_sums_kernel(functools.partial(smm.stream_matmul_pallas, config=config)),
                     [sds((rows, 4096), jnp.bfloat16), sds((6144, 4096), jnp.bfloat16)], 1))
    arrays = 72  # every layer's K and V at the Qwen3-8B shape: a round's kept rows in one launch
    commit = types.SimpleNamespace(num_warps=1, num_stages=1)
    jobs.append((f"commit_rows arrays={arrays} P=16", commit,
                 lambda *a: cr.commit_rows_pallas(a[:arrays], a[arrays:2 * arrays], a[-2], a[-1]),
                 [sds((1, s, n, d), jnp.bfloat16)] * arrays + [sds((1, 65, n, d), jnp.bfloat16)] * arrays
                 + [sds((1,), jnp.int32), sds((1, 16), jnp.int32)]))
    for t in (16, 17, 65, 128):  # the Gated DeltaNet tree rule at the Qwen3.6-27B shape (48 value heads, 16 key)
        for precision in ("default", "highest"):
            # the one-launch form
            default = dataclasses.replace(tdr.default_config(t), two_launch=False, unrolled_chain=False, direct=False,
                                          inverse_passes=0, num_stages=1)
            configs = [default] + ([] if args.quick else [
                dataclasses.replace(default, num_warps=4 if default.num_warps == 8 else 8),
                dataclasses.replace(default, value_block=32)])
            rule_args = [sds((1, t, 16, 128), jnp.float32), sds((1, t, 16, 128), jnp.float32),
                         sds((1, t, 48, 128), jnp.float32), sds((1, t, 48), jnp.float32), sds((1, t, 48), jnp.float32),
                         sds((1, 48, 128, 128), jnp.float32), sds((1, t, t), bool)]
            for config in configs:
                fn = functools.partial(tdr.tree_delta_rule_pallas, precision=precision, config=config)
                jobs.append((f"tree_delta_rule {precision} T={t}", config, fn, rule_args))
            two = dataclasses.replace(default, two_launch=True)  # its tile launch, then its chain
            fn = functools.partial(tdr.tree_delta_rule_pallas, precision=precision, config=two)
            jobs.append((f"tree_delta_rule {precision} T={t} tiles",
                         dataclasses.replace(two, num_warps=two.tile_warps, num_stages=1), fn, rule_args, 0))
            two32 = dataclasses.replace(two, block_rows=32, unrolled_chain=True)
            jobs.append((f"tree_delta_rule {precision} T={t} tiles32",
                         dataclasses.replace(two32, num_warps=two32.tile_warps, num_stages=1),
                         functools.partial(tdr.tree_delta_rule_pallas, precision=precision, config=two32),
                         rule_args, 0))
            jobs.append((f"tree_delta_rule {precision} T={t} chain", two, fn, rule_args, 1))
            for warps, vb, passes in ((4, 64, 1), (8, 64, 1), (8, 128, 1), (8, 64, 3), (8, 64, 0)):  # direct form
                direct = dataclasses.replace(default, direct=True, num_warps=warps, value_block=vb,
                                             inverse_passes=passes)
                jobs.append((f"tree_delta_rule {precision} T={t} direct", direct,
                             functools.partial(tdr.tree_delta_rule_pallas, precision=precision, config=direct),
                             rule_args))
            for knobs in ({"s0_in_xla": True}, {"unrolled_chain": True}, {"unrolled_chain": True, "block_rows": 32},
                          {"unrolled_chain": True, "block_rows": 32, "num_warps": 8}):  # the chain's variants
                variant = dataclasses.replace(two, **knobs)
                jobs.append((f"tree_delta_rule {precision} T={t} chain {','.join(knobs)}", variant,
                             functools.partial(tdr.tree_delta_rule_pallas, precision=precision, config=variant),
                             rule_args, 1))
    jobs = [job for job in jobs if args.only in job[0]]
    for name, config, fn, fn_args, *which in jobs:
        label = f"{name:<32} {config!r}".replace("TreeAttentionConfig", "").replace("TreeAcceptConfig", "").replace(
            "TreeBuildConfig", "").replace("VocabTopKConfig", "").replace("TreeDeltaRuleConfig", "").replace(
            "StreamMatmulConfig", "")
        try:
            found = resources(triton_ir(fn, fn_args, *which, debug_info=bool(args.by_line)), config.num_warps,
                              config.num_stages, by_line=args.by_line)
            rows = found.pop("by_line", [])
            print(label, found, flush=True)
            for count, place in rows:
                print(f"  {count:6d}  {place}", flush=True)
        except Exception as exc:  # noqa: BLE001 - report and go on
            print(label, "FAILED", kernel_check.error_text(exc, 400).replace("\n", " | "), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
