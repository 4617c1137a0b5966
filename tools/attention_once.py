"""Run the Pallas tree attention (and its merge) a few times at one Qwen3-8B-shaped point, for a profiler.

    ncu --kernel-name regex:tree_attention python tools/attention_once.py --s 2048 --t 65

Random bf16 inputs, batch 1, 32 query heads over 8 KV heads of 128, a chain mask; nothing is timed here.
"""

from __future__ import annotations

import argparse
import functools

import jax
import jax.numpy as jnp

from pallas_kernels import tree_attention as ta


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python tools/attention_once.py", description=__doc__.split("\n")[0])
    p.add_argument("--s", type=int, default=2048, help="committed cache slots")
    p.add_argument("--t", type=int, default=65, help="new tokens")
    p.add_argument("--calls", type=int, default=3, help="calls (the first compiles)")
    args = p.parse_args(argv)
    b, hq, n, d, s, t = 1, 32, 8, 128, args.s, args.t
    keys = jax.random.split(jax.random.key(0), 5)
    bf16 = jnp.bfloat16
    x = dict(q=jax.random.normal(keys[0], (b, t, hq, d), bf16),
             k_cache=jax.random.normal(keys[1], (b, s, n, d), bf16),
             v_cache=jax.random.normal(keys[2], (b, s, n, d), bf16),
             cache_lengths=jnp.full((b,), s, jnp.int32), k_new=jax.random.normal(keys[3], (b, t, n, d), bf16),
             v_new=jax.random.normal(keys[4], (b, t, n, d), bf16),
             new_mask=jnp.tril(jnp.ones((t, t), bool))[None], positions=(s + jnp.arange(t, dtype=jnp.int32))[None])
    interpret = jax.default_backend() != "gpu"  # a CPU checks the script, interpreted
    fn = jax.jit(functools.partial(ta.tree_attention_pallas, scale=d ** -0.5, interpret=interpret))
    for _ in range(args.calls):
        out = jax.block_until_ready(fn(**x))
    print(f"S={s} T={t}: output {out.shape} {out.dtype}, finite: {bool(jnp.isfinite(out.astype(jnp.float32)).all())}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
