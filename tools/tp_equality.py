"""Greedy AR / DFlash / DDTree output on random Qwen3-8B-shaped weights: one device against a mesh.

    python tools/tp_equality.py --shape qwen3-8b --devices 2 --parallel tp [--max-new-tokens 32]

Builds the same random weights twice (jax's partitionable threefry gives the same values whatever the
sharding), once on the first device and once laid out for the mesh, generates greedily from the same
prompts in every mode, and prints whether the tokens are identical (exit 1 if not). In bf16 a
difference can only come from a near-tie of the top-2 logits; the first differing position is printed.
"""

from __future__ import annotations

import argparse
import json
import sys


def main(argv=None) -> int:
    import jax

    from ddtree_jax.measure.workload import random_pair
    from ddtree_jax.engine import DecodeOptions, Mode, generate
    from ddtree_jax.parallel import Parallel, make_parallel

    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="qwen3-8b")
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--parallel", choices=["tp", "dp"], default="tp")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--budget", type=int, default=64)
    args = p.parse_args(argv)

    results = {}
    modes = (Mode.AR, Mode.DFLASH, Mode.DDTREE)  # what a random pair runs (a shape's target has no MTP head)
    for name, parallel in (("single", Parallel()), (args.parallel, make_parallel(args.devices, args.parallel))):
        target, drafter = random_pair(args.shape, parallel)
        vocab = target.config.vocab_size - 1  # the last row is the drafter's mask token
        prompts = [[(7 * i + 3) % vocab for i in range(40)], [(11 * i + 5) % vocab for i in range(23)]]
        for mode in modes:
            options = DecodeOptions(mode=mode, max_new_tokens=args.max_new_tokens, budget=args.budget,
                                    block_size=16, parallel=parallel)
            results[(name, mode.value)] = generate(target, prompts, options, drafter=drafter).output_ids
        del target, drafter
    ok = True
    for mode in modes:
        a, b = results[("single", mode.value)], results[(args.parallel, mode.value)]
        first = next(((r, i) for r, (x, y) in enumerate(zip(a, b)) for i, (u, v) in enumerate(zip(x, y)) if u != v),
                     None)
        print(json.dumps({"mode": mode.value, "identical": a == b, "first_difference": first}), flush=True)
        ok &= a == b
    print(f"devices {jax.device_count()}, {args.parallel}: {'identical' if ok else 'DIFFERENT'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
