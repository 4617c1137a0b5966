"""Where a verify and the AR steps part, layer by layer (issue 20).

    python tools/invariant_layers.py [--target DIR] [--prompt 1] [--max-new-tokens 128] [--chains 16,127]
                                     [--capacities 256,384] [--fast] [--out FILE.json]

Greedy speculative decoding equals AR only if a verified node gets the bits the AR step gets for the same
prefix. `tools/greedy_equality.py` sees where whole decodes part; this looks inside: one prompt of the demo
pair (or `--target`, bf16) is decoded by AR, the prompt is prefilled once, and then over that same cache (a)
the AR steps feed the output one token at a time and (b) chain verifies of C tokens each (the cache before
each chain filled by the AR steps) run the same tokens. Every layer's output (the taps) and the logits of
every position are compared bit for bit; the first position and part that differ are reported, per chain
length C and cache capacity (the capacity changes the attention's chunking unless it is row-invariant).
`--fast` runs the default kernels instead of `--row-invariant`'s (the negative control on a GPU: they differ).
Kernels: Pallas (interpreted where there is no GPU). Prints one JSON line per (capacity, C).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from ddtree_jax import cache as kv
from ddtree_jax.accept import chain_tree
from ddtree_jax.cli import atomic_path
from ddtree_jax.engine import PROMPT_BUCKET
from ddtree_jax.models import target_family
from ddtree_jax.models.contract import ForwardMeta, Kernels, Runtime


def first_difference(together: np.ndarray, alone: list[np.ndarray], layers: int, start: int):
    """together [C, L * e] taps (or [C, v] logits with layers 1) of positions start..start + C - 1; alone: the AR
    steps' rows of every position. (position, layer index or None for the logits part, max |diff|), or None."""
    e = together.shape[-1] // layers
    for i, row in enumerate(together):
        want = alone[start + i]
        for layer in range(layers):
            a, b = row[layer * e:(layer + 1) * e], want[layer * e:(layer + 1) * e]
            if not np.array_equal(a.view(np.uint8), b.view(np.uint8)):
                return start + i, layer, float(np.abs(a.astype(np.float32) - b.astype(np.float32)).max())
    return None


def compare(target, prompt: list[int], output: list[int], runtime: Runtime, chain: int, capacity: int) -> dict:
    """The AR steps against chain verifies of `chain` tokens over one prefilled cache of `capacity` slots."""
    family = target_family(target.config)
    layers = target.config.num_layers
    taps = tuple(range(layers))
    p = len(prompt)
    width = -(-p // PROMPT_BUCKET) * PROMPT_BUCKET  # as the engine pads it
    tokens = jnp.asarray([list(prompt) + [0] * (width - p)], jnp.int32)
    cache = family.create_cache(target.config, 1, capacity, target.array("model.embed_tokens.weight").dtype)
    out = jax.jit(lambda c: family.forward(target, tokens, ForwardMeta.prompt(jnp.asarray([p]), width), c,
                                           runtime=runtime))(cache)
    prefilled = kv.advance(out.cache, jnp.asarray([p]))

    @jax.jit
    def step(token, c):
        o = family.forward(target, token, ForwardMeta.step(c.lengths, jnp.asarray([True])), c, tap_layers=taps,
                           runtime=runtime)
        return o.taps[0], family.logits(target, o.hidden, runtime)[0], kv.advance(o.cache, jnp.asarray([1]))

    @jax.jit
    def verify(chain_tokens, c):
        tree = chain_tree(chain_tokens)
        meta = ForwardMeta.tree(c.lengths, tree.parents, tree.depths, tree.ancestor)
        o = family.forward(target, chain_tokens, meta, c, tap_layers=taps, runtime=runtime)
        return o.taps[0], family.logits(target, o.hidden, runtime)[0]

    n = len(output) - 1  # the last token is never fed
    ar_taps, ar_logits, caches = [], [], [prefilled]
    for j in range(n):
        tap, logit, c = step(jnp.asarray([[output[j]]], jnp.int32), caches[-1])
        ar_taps.append(np.asarray(tap[0]))
        ar_logits.append(np.asarray(logit[0]))
        caches.append(c)
    for start in range(0, n, chain):
        t = min(chain, n - start)
        tap, logit = verify(jnp.asarray([output[start:start + t]], jnp.int32), caches[start])
        tap, logit = np.asarray(tap), np.asarray(logit)
        found = first_difference(tap, ar_taps, layers, start)
        part = None if found is None else f"layer {found[1]}"
        if found is None:
            found = first_difference(logit, ar_logits, 1, start)
            part = None if found is None else "logits"
        if found is not None:
            return {"chain": chain, "capacity": capacity, "positions": n, "first_difference": {
                "position": found[0], "part": part, "max_abs_diff": found[2]}}
    return {"chain": chain, "capacity": capacity, "positions": n, "first_difference": None}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--target", type=Path, default=None, help="target checkpoint (default: the demo pair's)")
    p.add_argument("--prompt", type=int, default=1, help="index among the demo's held-out prompts")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--chains", default="16,127", help="tokens per chain verify")
    p.add_argument("--capacities", default="256,384", help="cache slots")
    p.add_argument("--fast", action="store_true", help="the default kernels, not the row-invariant ones")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    try:
        chains = [int(x) for x in args.chains.split(",")]
        capacities = [int(x) for x in args.capacities.split(",")]
    except ValueError:
        print("error: --chains and --capacities take comma-separated integers", file=sys.stderr)
        return 2
    from ddtree_jax.bench import read_prompts
    from ddtree_jax.checkpoint import load_target
    from ddtree_jax.demo_pair import demo_prompts, demo_target
    from ddtree_jax.engine import generate
    from ddtree_jax.round import DecodeOptions, Mode

    t_dir = args.target or demo_target()
    target = load_target(t_dir, jnp.bfloat16)
    prompts = read_prompts(demo_prompts(), t_dir, target.config.vocab_size)
    if not 0 <= args.prompt < len(prompts):
        print(f"error: --prompt {args.prompt}: expected 0..{len(prompts) - 1}", file=sys.stderr)
        return 2
    prompt = prompts[args.prompt]
    need = -(-len(prompt) // PROMPT_BUCKET) * PROMPT_BUCKET + args.max_new_tokens
    if min(capacities) < need:
        print(f"error: --capacities: every cache needs at least {need} slots (the padded prompt and the output)",
              file=sys.stderr)
        return 2
    runtime = Runtime(Kernels.PALLAS, row_invariant=not args.fast)
    output = generate(target, [prompt], DecodeOptions(mode=Mode.AR, max_new_tokens=args.max_new_tokens,
                                                      kernels="pallas", row_invariant=not args.fast)).output_ids[0]
    rows = []
    for capacity in capacities:
        for chain in chains:
            rows.append(compare(target, prompt, output, runtime, chain, capacity))
            print(json.dumps(rows[-1]), flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        with atomic_path(args.out) as tmp:
            tmp.write_text(json.dumps({"prompt": args.prompt, "row_invariant": not args.fast, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
