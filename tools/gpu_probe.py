"""Where a batch-1 decode step loses time against the weight-streaming floor, measured on the GPU.

    PYTHONPATH=. python tools/gpu_probe.py --out DIR [--layers 36] [--tokens 1,16,65] [--smoke]

Three sections, all in one process, each number a median over repeated device-synchronised calls:
1. Bandwidth ceilings by several methods (`measure.ceilings.measure_ceilings`: copy, read, gemv and a torch
   device-to-device copy when torch sees the GPU): the floors of the bench use the highest.
2. The projections of `--layers` Qwen3-8B decoder layers in one program, without attention or norms
   (x -> q,k,v -> o -> residual -> gate,up -> down -> residual), at T tokens, in several forms:
   `hf`   separate einsums on HF-layout [out, in] weights (what the models do now);
   `fused` q|k|v and gate|up concatenated into one weight each (fewer, larger matmuls);
   `io`   separate einsums on [in, out] weights;
   `stream`, `stream_fused` the weight-streaming Pallas matmul (`pallas_kernels.stream_matmul`) on the hf or
   fused weights, for every T;
   `fp8`  the hf weights as block-scaled FP8 (128 x 128 blocks, `ddtree_jax/models/fp8.py`), dequantised and
   multiplied by XLA (what the models' FP8 projections do with `--fp8-matmul dequantize`);
   `stream_fp8` the same FP8 weights streamed as FP8 by the Pallas matmul (dequantised inside it; what they do
   with `--fp8-matmul stream --kernels pallas`, auto's choice on a GPU);
   `stream_w8a8` the same, each layer input quantised to FP8 per row and 128 features, both operands on FP8
   tensor cores (`--fp8-matmul w8a8`), the quantisation inside the kernel (`quantize_x`, where a step is one
   group: what the models do); `stream_w8a8_apart` with the quantisation in XLA first (timed with it);
   `stream_fp8_fused`, `stream_w8a8_fused`, `stream_w8a8_apart_fused` the same on q|k|v and gate|up as one FP8
   weight each (what the models run where the scale blocks divide the
   heads: packed FP8 projections). The streaming forms' knobs fit each weight as the models' do
   (`pallas_kernels.stream_matmul.fitted_config`).
   Each against its floor: the layers' weight bytes over the measured bandwidth.
3. The output head alone ([151936, 4096] bf16 times T vectors, float32 logits).

Projections are timed in a device loop (`measure.timing.in_loop_seconds`: 4 passes over the layers against 1,
each layer's input RMS-normalised so that values stay finite), so the call's dispatch cancels out; the head is
one call timed alone (dispatch included). Run it under different XLA_FLAGS with `--label` to compare XLA's
matmul choices.
Writes probe.json under --out and prints a table. `--smoke` runs tiny shapes (CPU, interpreted Pallas) so
the tests can run the script.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
from pathlib import Path

QWEN3_8B = dict(hidden=4096, q=4096, kv=1024, mlp=12288, vocab=151936)
FP8_BLOCK = (128, 128)  # the published checkpoints' weight_block_size
FP8_FORMS = ("fp8", "stream_fp8", "stream_w8a8", "stream_w8a8_apart", "stream_fp8_fused", "stream_w8a8_fused",
             "stream_w8a8_apart_fused")


def _fused(form: str) -> bool:
    """Whether a form multiplies q|k|v and gate|up as one weight each (as the models' packed projections do)."""
    return form == "fused" or form.endswith("_fused")
SMOKE = dict(hidden=64, q=64, kv=32, mlp=128, vocab=320)


def _layer_weights(shape: dict, layers: int, form: str):
    import jax
    import jax.numpy as jnp

    e, q, kv, f = shape["hidden"], shape["q"], shape["kv"], shape["mlp"]
    parts = {"q": (q, e), "k": (kv, e), "v": (kv, e), "o": (e, q), "gate": (f, e), "up": (f, e), "down": (e, f)}
    if _fused(form):
        parts = {"qkv": (q + 2 * kv, e), "o": (e, q), "gate_up": (2 * f, e), "down": (e, f)}

    @functools.lru_cache(maxsize=None)
    def maker(shp):
        # std 0.1 / sqrt(fan-in): without norms between them, 36 layers of std-0.02 weights overflow bf16 to
        # inf (the 2026-12-01 run compared NaNs).
        std = 0.1 / shp[0 if form == "io" else 1] ** 0.5
        return jax.jit(lambda key: (jax.random.normal(key, shp, jnp.float32) * std).astype(jnp.bfloat16))

    from ddtree_jax.models import fp8

    quantize = jax.jit(functools.partial(fp8.quantize, block=FP8_BLOCK))
    out = []
    for layer in range(layers):
        ws = {}
        for i, (name, (o, n_in)) in enumerate(parts.items()):
            shp = (n_in, o) if form == "io" else (o, n_in)
            ws[name] = maker(shp)(jax.random.key(layer * 16 + i))
            if form in FP8_FORMS:
                ws[name] = quantize(ws[name])  # (float8_e4m3fn weight, float32 scales)
        out.append(ws)
    return out


def _as_hf(weights, shape: dict, form: str):
    """The same weights in the HF form (split fused matrices, transpose [in, out] ones, dequantise FP8 ones)."""
    import jax.numpy as jnp

    from ddtree_jax.models import fp8

    q, kv, f = shape["q"], shape["kv"], shape["mlp"]
    out = []
    for ws in weights:
        if form in FP8_FORMS:
            ws = {k: fp8.dequantize(*w, FP8_BLOCK, jnp.bfloat16) for k, w in ws.items()}
        if form == "stream" or (form in FP8_FORMS and not _fused(form)):
            out.append(ws)
        elif form == "io":
            out.append({k: w.T for k, w in ws.items()})
        else:
            qkv, gu = ws["qkv"], ws["gate_up"]
            out.append({"q": qkv[:q], "k": qkv[q:q + kv], "v": qkv[q + kv:], "o": ws["o"], "gate": gu[:f],
                        "up": gu[f:], "down": ws["down"]})
    return out


def _projections(shape: dict, form: str, interpret: bool, stream_config: str = "64x128x4x4"):
    """fn(weights, x [T, e]) -> [T, e]: every layer's projections with residuals, no attention."""
    import jax
    import jax.numpy as jnp

    from pallas_kernels.stream_matmul import StreamMatmulConfig, fitted_config, stream_matmul_pallas

    q, kv = shape["q"], shape["kv"]

    from ddtree_jax.models import fp8

    def mm(x, w):
        if form == "io":
            return jnp.einsum("ti,io->to", x, w)
        if form == "fp8":
            return jnp.einsum("ti,oi->to", x, fp8.dequantize(*w, FP8_BLOCK, x.dtype))
        if form.startswith("stream"):
            bn, bk, warps, stages, *extra = (int(v) for v in stream_config.split("x"))
            w, scales = w if form in FP8_FORMS else (w, None)
            block = FP8_BLOCK if form in FP8_FORMS else None
            knobs = StreamMatmulConfig(block_n=bn, block_k=bk, num_warps=warps, num_stages=stages,
                                       fp8_bits=extra[0] if extra else 0,
                                       row_tile=extra[1] if len(extra) > 1 and extra[1] else None,
                                       promote_k=extra[2] if len(extra) > 2 else None,
                                       splits=extra[3] if len(extra) > 3 and extra[3] else None)
            config = fitted_config(*w.shape, block, knobs)
            x_scale, quantize_x = None, "w8a8" in form and "apart" not in form and config.block_k == FP8_BLOCK[1]
            if "w8a8" in form and not quantize_x:
                x, x_scale = fp8.quantize_rows(x, FP8_BLOCK[1])
            return stream_matmul_pallas(x, w, scales, block=block, x_scale=x_scale, quantize_x=quantize_x,
                                        config=config, out_dtype=jnp.bfloat16, interpret=interpret)
        return jnp.einsum("ti,oi->to", x, w)

    def layers(weights, x):
        for ws in weights:
            x = x * jax.lax.rsqrt(jnp.mean(jnp.square(x.astype(jnp.float32)), -1, keepdims=True) + 1e-6).astype(x.dtype)
            if _fused(form):
                qkv = mm(x, ws["qkv"])
                attn = qkv[:, :q] + jnp.tile(qkv[:, q:q + kv] + qkv[:, q + kv:], (1, q // kv))
                x = x + mm(attn, ws["o"])
                g, u = jnp.split(mm(x, ws["gate_up"]), 2, axis=-1)
            else:
                attn = mm(x, ws["q"]) + jnp.tile(mm(x, ws["k"]) + mm(x, ws["v"]), (1, q // kv))
                x = x + mm(attn, ws["o"])
                g, u = mm(x, ws["gate"]), mm(x, ws["up"])
            x = x + mm(jax.nn.silu(g) * u, ws["down"])
        return x

    def fn(weights, x, passes):
        # `passes` times over the layers in one device loop (each pass feeds the next), so that
        # `in_loop_seconds` cancels the call's dispatch.
        return jax.lax.fori_loop(0, passes, lambda _, h: layers(weights, h), x)

    return jax.jit(fn)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--layers", type=int, default=36)
    p.add_argument("--tokens", default="1,16,17,32,64,65,128")
    p.add_argument("--forms", default="hf,fused,stream,stream_fused")
    p.add_argument("--no-ceilings", action="store_true", help="skip the ceilings (floors then use --bandwidth)")
    p.add_argument("--bandwidth", type=float, default=4.25e12, help="bytes/s for the floors with --no-ceilings")
    p.add_argument("--stream-configs", default="64x128x4x4",
                   help="the streaming forms' configs, block_n x block_k x warps x stages [x fp8_bits [x row_tile [x "
                        "promote_k [x splits]]]], comma list (one row each; row_tile 0: powers of two, largest first; "
                        "promote_k 0: no FP8 wgmma, absent: block_k; splits 0 or absent: about two programs per "
                        "multiprocessor, else that many slices of k where they divide it: 1 leaves no split sums)")
    p.add_argument("--label", default="", help="a name for this run (e.g. the XLA_FLAGS variant), in every row")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--smoke", action="store_true")
    args = p.parse_args(argv)

    import jax
    import jax.numpy as jnp

    from ddtree_jax.measure.ceilings import ceilings_text, measure_ceilings
    from ddtree_jax.measure.timing import in_loop_seconds, median_seconds

    shape = SMOKE if args.smoke else QWEN3_8B
    layers = 2 if args.smoke else args.layers
    interpret = jax.default_backend() != "gpu"
    report = {"jax": jax.__version__, "device": str(jax.devices()[0].device_kind), "shape": shape, "layers": layers,
              "date": time.strftime("%Y-%m-%d"), "rows": []}
    ceilings = ({"bandwidth_bytes_per_s": args.bandwidth} if args.no_ceilings
                else measure_ceilings(3 if args.smoke else 10, args.smoke))
    report["ceilings"] = ceilings
    report["label"] = args.label
    report["xla_flags"] = os.environ.get("XLA_FLAGS", "")
    if not args.no_ceilings:
        print(ceilings_text(ceilings), flush=True)
    bandwidth = ceilings["bandwidth_bytes_per_s"]
    args.out.mkdir(parents=True, exist_ok=True)

    def record(row):
        report["rows"].append(row)
        print(json.dumps(row), flush=True)
        (args.out / "probe.json").write_text(json.dumps(report, indent=1))

    for form in args.forms.split(","):
        weights = None  # the previous form's layers go before the next are drawn
        weights = _layer_weights(shape, layers,
                                 "fused" if form == "stream_fused" else "hf" if form == "stream" else form)
        n_bytes = sum(w.nbytes for w in jax.tree.leaves(weights))  # FP8: its weights and scales
        for stream_config, t in [(c, int(v)) for c in (args.stream_configs.split(",") if form.startswith("stream")
                                                         else [""]) for v in args.tokens.split(",")]:
            fn = _projections(shape, form, interpret, stream_config or "64x128x4x4")
            x = jax.random.normal(jax.random.key(t), (t, shape["hidden"]), jnp.bfloat16)
            try:
                seconds = in_loop_seconds(lambda n: fn(weights, x, jnp.int32(n)), args.repeats, iterations=4)[0]
            except Exception as e:  # noqa: BLE001 - a form that does not compile is a finding, not a crash
                record({"section": "projections", "form": form + (f"[{stream_config}]" if stream_config else ""),
                        "tokens": t, "error": str(e).splitlines()[0][:300]})
                continue
            floor = n_bytes / bandwidth
            extra = {}
            if form != "hf":  # the same function as the models' form, up to bf16 rounding
                ref = _projections(shape, "hf", interpret)(weights if form == "stream" else
                                                           _as_hf(weights, shape, form), x, jnp.int32(1))
                got = fn(weights, x, jnp.int32(1))
                extra["rel_err_vs_hf"] = float(jnp.linalg.norm((got - ref).astype(jnp.float32))
                                               / jnp.linalg.norm(ref.astype(jnp.float32)))
            record({"section": "projections", "form": form + (f"[{stream_config}]" if stream_config else ""),
                    "label": args.label, "tokens": t, "layers": layers, **extra,
                    "ms": seconds * 1e3,
                    "us_per_layer": seconds * 1e6 / layers, "weight_bytes": n_bytes, "floor_ms": floor * 1e3,
                    "x_floor": seconds / floor, "tb_per_s": n_bytes / max(seconds, 1e-12) / 1e12})
    weights = None
    head = jax.jit(lambda h, w: jnp.einsum("te,ve->tv", h, w, preferred_element_type=jnp.float32))
    w = jax.random.normal(jax.random.key(99), (shape["vocab"], shape["hidden"]), jnp.bfloat16)
    for t in [int(v) for v in args.tokens.split(",")]:
        h = jax.random.normal(jax.random.key(t), (t, shape["hidden"]), jnp.bfloat16)
        seconds = median_seconds(lambda: head(h, w), args.repeats)
        record({"section": "lm_head", "tokens": t, "ms": seconds * 1e3, "floor_ms": w.nbytes / bandwidth * 1e3,
                "x_floor": seconds / (w.nbytes / bandwidth), "tb_per_s": w.nbytes / seconds / 1e12})
    print("\n| section | form | T | ms | floor ms | x floor | TB/s |\n|---|---|---|---|---|---|---|")
    for r in report["rows"]:
        if "error" in r:
            print(f"| {r['section']} | {r.get('form', '-')} | {r['tokens']} | error: {r['error'][:80]} | | | |")
        else:
            print(f"| {r['section']} | {r.get('form', '-')} | {r['tokens']} | {r['ms']:.3f} | {r['floor_ms']:.3f} | "
                  f"{r['x_floor']:.2f} | {r['tb_per_s']:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
