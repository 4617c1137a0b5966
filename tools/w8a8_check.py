"""The W8A8 streaming matmul (FP8 rows times an FP8 weight) compiled on the GPU, one call at a time.

    PYTHONPATH=. python tools/w8a8_check.py [--n 4096 --k 4096] [--rows 1,16,65] [--promote 0,block,32]

For each `promote_k` (0: Pallas's own dot; block: one promotion per block_k, the default; or a count) and row
count: one kernel call on a Qwen3-8B-sized projection with the rows quantised first (`quantize_rows`, given as
`x_scale`), checked against `stream_matmul_reference`, then one with the bf16 rows quantised inside the kernel
(`quantize_x`, what the models run), which must give the same bits; each printed (relative error, seconds) as
soon as it finishes, so that a kernel that fails to compile, computes wrong sums or
never returns shows as the last line printed. A first device call of a new kernel form runs this before any
timing (docs/performance.md, "Next device session"). Without a GPU the kernels are interpreted (use small --n/--k).
"""

from __future__ import annotations

import argparse
import sys
import time


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--n", type=int, default=4096, help="output features")
    p.add_argument("--k", type=int, default=4096, help="input features")
    p.add_argument("--rows", default="1,16,65")
    p.add_argument("--promote", default="0,block,32", help="comma list of promote_k: 0, block (None) or a count")
    args = p.parse_args(argv)

    import jax
    import jax.numpy as jnp
    import numpy as np

    from ddtree_jax.models import fp8
    from pallas_kernels import stream_matmul as sm

    block = (128, 128)
    interpret = jax.default_backend() != "gpu"
    rng = np.random.default_rng(0)
    q, scale = fp8.quantize(jnp.asarray(rng.standard_normal((args.n, args.k)) / args.k ** 0.5, jnp.float32), block)
    worst, mismatches = 0.0, 0
    for promote in args.promote.split(","):
        knobs = sm.StreamMatmulConfig(promote_k=None if promote == "block" else int(promote))
        config = sm.fitted_config(args.n, args.k, block, knobs)
        for rows in (int(r) for r in args.rows.split(",")):
            x = jnp.asarray(rng.standard_normal((rows, args.k)), jnp.bfloat16)
            xq, xs = fp8.quantize_rows(x, block[1])
            start = time.perf_counter()
            got = np.asarray(sm.stream_matmul_pallas(xq, q, scale, block=block, x_scale=xs, out_dtype=jnp.float32,
                                                     config=config, interpret=interpret))
            seconds = time.perf_counter() - start
            want = np.asarray(sm.stream_matmul_reference(xq, q, scale, block=block, x_scale=xs, out_dtype=jnp.float32))
            error = float(np.abs(got - want).max() / np.abs(want).max())
            worst = max(worst, error)
            print(f"promote_k={promote} rows={rows}: max |error| / max |want| = {error:.2e} ({seconds:.1f} s, "
                  "compile included)", flush=True)
            start = time.perf_counter()
            inside = np.asarray(sm.stream_matmul_pallas(x, q, scale, block=block, quantize_x=True,
                                                        out_dtype=jnp.float32, config=config, interpret=interpret))
            seconds = time.perf_counter() - start
            differ = int(np.sum(inside.view(np.int32) != got.view(np.int32)))
            mismatches += differ
            print(f"promote_k={promote} rows={rows} quantize_x: {differ} of {inside.size} outputs differ from the "
                  f"rows quantised first ({seconds:.1f} s, compile included)", flush=True)
    print(f"worst {worst:.2e}, {mismatches} outputs of quantize_x not the same bits")
    return 0 if worst < 1e-3 and mismatches == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
