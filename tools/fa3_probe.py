"""What would a FlashAttention-3-style (Mosaic GPU) kernel give the tree attention at decode shapes?

    PYTHONPATH=.:tests python tools/fa3_probe.py --out DIR [--s 2048] [--t 65,257] [--tq 128,256] [--smoke]

Issue 19 asks for the tree attention within 2x of its floor at T = 65 and 257; the Triton kernel
(`pallas_kernels.tree_attention`) is latency-bound there (docs/kernels.md). Before building a Mosaic GPU kernel
(warpgroup MMAs fed by TMA, the form of FlashAttention-3) this probe times jax's own one
(`jax.experimental.pallas.ops.gpu.attention_mgpu`: no mask, no split of the keys, float16, since its shared-memory
tiles are float16) at the Qwen3-8B attention shape beside the tree attention and cuDNN without a mask, per layer:

- `tree_attention`: this project's kernel (bf16; its merge kernel included) for `--t` new tokens over `--s` cached
  keys, a random tree (tools/kernel_check.py's inputs);
- `cudnn`: `jax.nn.dot_product_attention(implementation="cudnn")`, `--tq` query tokens over `--s` keys, no mask;
- `fa3_mgpu`: jax's Mosaic GPU kernel at the same point, for each `--fa3-configs` (block_q x block_kv x stages).

Microseconds per layer: `--layers` layers of distinct arrays in one device loop (tools/kernel_check.py's
`time_program`). A form that cannot run records its error. `--smoke` runs tiny shapes with the tree attention
interpreted on a CPU (jax's Mosaic GPU kernel then records why it cannot run: it needs a GPU).
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parent))
import kernel_check as kc  # noqa: E402  (the same inputs and timing as the kernels' checks)

from pallas_kernels import on_gpu  # noqa: E402
from pallas_kernels import tree_attention as ta  # noqa: E402

SHAPE = dict(hq=32, n=8, d=128, path_len=16)  # Qwen3-8B's attention (kernel_check's shape)


def tree_attention_us(s: int, t: int, layers: int, *, interpret: bool, rounds: int) -> float:
    arrays = kc.layer_arrays(SHAPE, 1, s, t, jnp.bfloat16, layers, seed=1)
    shared = kc.tree_arrays(SHAPE, 1, t, [s], seed=0)
    layer = functools.partial(ta.tree_attention_pallas, scale=SHAPE["d"] ** -0.5, interpret=interpret)
    args = (arrays["q"], arrays["k_cache"], arrays["v_cache"], arrays["k_new"], arrays["v_new"],
            shared["cache_lengths"], shared["new_mask"], shared["positions"])
    compiled, _ = kc.compile_program(kc.attention_program(layer, layers), args + (jnp.int32(1),))
    return kc.time_program(compiled, args, layers, rounds=rounds) * 1e6


def dense_us(attend, s: int, tq: int, layers: int, dtype, *, rounds: int) -> float:
    """`attend(q [1, tq, hq, d], k, v [1, s, n, d])` per layer, `layers` distinct inputs in a device loop."""
    key = jax.random.key(0)
    hq, n, d = SHAPE["hq"], SHAPE["n"], SHAPE["d"]

    def arrays(offset, shape):
        return tuple(jax.random.normal(jax.random.fold_in(key, offset + i), shape, dtype) for i in range(layers))

    q, k, v = arrays(0, (1, tq, hq, d)), arrays(1000, (1, s, n, d)), arrays(2000, (1, s, n, d))

    def run(q, k, v, repeats):
        def one_pass(_, qs):
            return tuple(attend(qs[i], k[i], v[i]).astype(dtype) for i in range(layers))
        return jax.lax.fori_loop(0, repeats, one_pass, tuple(q))

    compiled, _ = kc.compile_program(run, (q, k, v, jnp.int32(1)))
    return kc.time_program(compiled, (q, k, v), layers, rounds=rounds) * 1e6


def fa3(config: tuple[int, int, int]):
    from jax.experimental.pallas.ops.gpu import attention_mgpu

    block_q, block_kv, stages = config
    tuning = attention_mgpu.TuningConfig(block_q=block_q, block_kv=block_kv, max_concurrent_steps=stages)
    return lambda q, k, v: attention_mgpu.attention(q, k, v, tuning)


def cudnn(q, k, v):
    return jax.nn.dot_product_attention(q, k, v, implementation="cudnn")


def probe(args) -> list[dict]:
    records = []

    def record(row: dict, measure) -> None:
        try:
            row["us"] = measure()
        except Exception as e:  # noqa: BLE001 - a form that cannot run here is a row with its reason
            row["error"] = kc.error_text(e, 300)
        kc.log(json.dumps(row))
        records.append(row)

    for s in args.s:
        for t in args.t:
            record(dict(kernel="tree_attention", dtype="bfloat16", s=s, t=t),
                   lambda: tree_attention_us(s, t, args.layers, interpret=args.smoke, rounds=args.rounds))
        for tq in args.tq:
            if not args.smoke:
                record(dict(kernel="cudnn", dtype="bfloat16", s=s, tq=tq),
                       lambda: dense_us(cudnn, s, tq, args.layers, jnp.bfloat16, rounds=args.rounds))
            for config in args.fa3_configs:
                record(dict(kernel="fa3_mgpu", dtype="float16", s=s, tq=tq, config=list(config)),
                       lambda: dense_us(fa3(config), s, tq, args.layers, jnp.float16, rounds=args.rounds))
    return records


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--s", type=kc._ints, default=[2048], help="cached keys (default 2048)")
    parser.add_argument("--t", type=kc._ints, default=[65, 257], help="the tree attention's new tokens")
    parser.add_argument("--tq", type=kc._ints, default=[128, 256],
                        help="jax's kernel's query tokens (multiples of 2 x block_q)")
    parser.add_argument("--fa3-configs", type=lambda v: [tuple(map(int, c.split("x"))) for c in v.split(",")],
                        default=[(64, 64, 2), (64, 128, 2), (64, 128, 3)], help="block_q x block_kv x stages, ...")
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, the tree attention interpreted (a CPU)")
    args = parser.parse_args(argv)
    if args.smoke:
        args.s, args.t, args.tq, args.layers, args.rounds = [64], [5], [128], 1, 1
    elif not on_gpu():
        print("error: tools/fa3_probe.py needs a CUDA GPU (or --smoke)", file=sys.stderr)
        return 2
    records = probe(args)
    args.out.mkdir(parents=True, exist_ok=True)
    given = list(sys.argv[1:] if argv is None else argv)
    if "--out" in given:  # no machine path in the record
        del given[given.index("--out"):given.index("--out") + 2]
    meta = dict(device=str(jax.devices()[0].device_kind), jax=jax.__version__, shape=SHAPE,
                command=" ".join(["python tools/fa3_probe.py --out DIR", *given]))
    tmp = args.out / "fa3_probe.json.tmp"
    tmp.write_text(json.dumps(dict(meta, records=records), indent=1))
    tmp.replace(args.out / "fa3_probe.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
