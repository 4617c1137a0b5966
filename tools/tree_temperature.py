"""Whether a temperature on the drafter's marginals, per depth, shapes better trees: tau on a pair (any device).

    python tools/tree_temperature.py [--first 32] [--prompts 40] [--budget 31] [--max-new-tokens 128]
        [--temps 1,0.7,1.2] [--ramps 1:0.8,1:1.25] [--target DIR --drafter DIR --prompt-file FILE]

DDTree's tree is the B most probable prefixes under the drafter's per-depth marginals (`round.propose`). A drafter
whose marginals are over- or under-confident at some depths would build better trees from logits / T_d, and the
verification stays exact whatever the tree (greedy and sample-and-match alike check every node against the target's
own rule). Each setting runs `engine.generate` in DDTree mode with `round.propose` given logits / T (a scalar of
--temps, or per depth a linear ramp a:b from the first draft position to the last, of --ramps) and prints one JSON
line: the setting, tau (tokens committed per round), rounds and tokens. Defaults: the shipped demo pair in float32,
its selection prompts (33-72 of prompts.jsonl; the README's figures use 1-32), the pure-JAX kernels.
"""

from __future__ import annotations

import argparse
import json
import sys


def temperatures(setting: str, depths: int):
    """'T' -> [T] * depths; 'a:b' -> a linear ramp from a (first draft position) to b (last). float32 [depths]."""
    import numpy as np

    a, _, b = setting.partition(":")
    temps = np.linspace(float(a), float(b or a), depths, dtype=np.float32)
    if not (temps > 0).all():
        raise ValueError(f"{setting}: temperatures must be > 0")
    return temps


def tempered(propose, temps):
    """`round.propose` building DDTree's tree from logits / temps (per depth, [bs - 1]); other modes unchanged."""
    import jax.numpy as jnp

    from ddtree_jax.round import Mode

    def tempered_propose(logits, last_token, options):
        if options.mode is Mode.DDTREE:
            logits = logits / jnp.asarray(temps)[None, :logits.shape[1], None]
        return propose(logits, last_token, options)

    return tempered_propose


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target")
    p.add_argument("--drafter")
    p.add_argument("--prompt-file")
    p.add_argument("--first", type=int, default=32, help="the first prompt's index in the file (0-based)")
    p.add_argument("--prompts", type=int, default=40)
    p.add_argument("--budget", type=int, default=31, help="B; 0: DFlash's chain (the temperatures then change nothing)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temps", default="1", help="scalar temperatures, comma-separated")
    p.add_argument("--ramps", default="", help="per-depth ramps a:b, comma-separated")
    args = p.parse_args(argv)
    settings = [s for s in args.temps.split(",") + args.ramps.split(",") if s]
    try:
        for s in settings:
            temperatures(s, 2)
    except ValueError as e:
        print(f"error: --temps/--ramps: {e}", file=sys.stderr)
        return 2

    import jax
    import jax.numpy as jnp

    from ddtree_jax import engine
    from ddtree_jax import round as rounds
    from ddtree_jax.bench import read_prompts
    from ddtree_jax.checkpoint import load_drafter, load_target
    from ddtree_jax.demo_pair import demo_drafter, demo_prompts, demo_target

    target_dir = args.target or demo_target()
    target = load_target(target_dir, jnp.float32)
    drafter = load_drafter(args.drafter or demo_drafter(), target.config, jnp.float32)
    prompts = read_prompts(args.prompt_file or demo_prompts(), target_dir, target.config.vocab_size)
    prompts = prompts[args.first:args.first + args.prompts]
    options = engine.DecodeOptions(mode=engine.Mode.DDTREE if args.budget else engine.Mode.DFLASH,
                                   max_new_tokens=args.max_new_tokens, budget=args.budget or 64, kernels="jax")
    depths = drafter.config.block_size - 1
    propose = rounds.propose
    try:
        for s in settings:
            rounds.propose = tempered(propose, temperatures(s, depths))
            jax.clear_caches()  # the round is traced again with this setting's propose
            engine._COMPILED.clear()
            result = engine.generate(target, prompts, options, drafter=drafter)
            print(json.dumps({"temperature": s, "budget": args.budget, "tau": round(result.tau, 4),
                              "rounds": sum(map(len, result.acceptance_lengths)), "tokens": result.new_tokens}),
                  flush=True)
    finally:
        rounds.propose = propose
        jax.clear_caches()
        engine._COMPILED.clear()
    return 0


if __name__ == "__main__":
    sys.exit(main())
