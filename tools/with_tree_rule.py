"""Run a module with the Gated DeltaNet tree-rule kernel's knobs changed past one block of nodes, to A/B a knob
in whole rounds on a GPU without committing it (`tools/with_knobs.py tree_rule:KNOBS`, the general form); or name the
fastest knobs a `tools/gdn_probe.py` run measured.

    python tools/with_tree_rule.py unrolled_chain=1,value_block=32 -m ddtree_jax.bench --shape qwen3.6-27b ...
    python tools/with_tree_rule.py --best gdn_probe.json --t 65      # prints e.g. num_warps=4,...,unrolled_chain=1

KNOBS are `TreeDeltaRuleConfig` fields (integers; 0 / 1 for the booleans) laid over
`pallas_kernels.tree_delta_rule.default_config(t)` for every t past one block (17 nodes and more), which is what the
models use when they pass no config. `--best` reads the probe's kernel rows at `--t` (those without an error) and
prints the knobs of the one with the smallest `rule_us`, as KNOBS; exit 1 if there is none.
"""

from __future__ import annotations

import argparse
import json
import runpy
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pallas_kernels import tree_delta_rule  # noqa: E402
import with_knobs  # noqa: E402  (tools/ is on the path: this script's folder)


def parse_knobs(text: str) -> dict:
    """'unrolled_chain=1,value_block=32' -> {'unrolled_chain': True, 'value_block': 32} (`with_knobs.parse_knobs`)."""
    return with_knobs.parse_knobs(text, tree_delta_rule.TreeDeltaRuleConfig)


def override(knobs: dict) -> None:
    """Lay `knobs` over `default_config(t)` past one block, in this process (`with_knobs.override`)."""
    with_knobs.override("tree_rule", knobs)


def best_knobs(probe: dict, t: int) -> str | None:
    """The KNOBS text of the fastest kernel row of a gdn_probe.json at `t` nodes, None if it has none."""
    rows = [r for r in probe["rows"] if r["t"] == t and "config" in r and "error" not in r and "rule_us" in r]
    if not rows:
        return None
    config = min(rows, key=lambda r: r["rule_us"])["config"]
    return ",".join(f"{k}={int(v)}" for k, v in config.items())


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--best":
        p = argparse.ArgumentParser(description="the fastest knobs of a gdn_probe.json")
        p.add_argument("--best", type=Path, required=True)
        p.add_argument("--t", type=int, default=65)
        args = p.parse_args(argv)
        try:
            probe = json.loads(args.best.read_text())
        except (OSError, ValueError) as e:
            print(f"error: --best {args.best}: {e}", file=sys.stderr)
            return 2
        knobs = best_knobs(probe, args.t)
        if knobs is None:
            print(f"error: {args.best} has no kernel row at T = {args.t}", file=sys.stderr)
            return 1
        print(knobs)
        return 0
    if len(argv) < 3 or argv[1] != "-m":
        print("error: usage: with_tree_rule.py KNOBS -m MODULE [ARGS...] | --best GDN_PROBE_JSON [--t T]",
              file=sys.stderr)
        return 2
    try:
        override(parse_knobs(argv[0]))
    except (ValueError, TypeError) as e:
        print(f"error: KNOBS {argv[0]!r}: {e}", file=sys.stderr)
        return 2
    sys.argv = [argv[2], *argv[3:]]
    runpy.run_module(argv[2], run_name="__main__", alter_sys=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
