"""What `--parallel tp` puts on each device, from shapes alone (nothing allocated, no accelerator needed).

    PYTHONPATH=. python tools/tp_layout.py --shape qwen3.6-27b --devices 2 [--json]

For a named shape (`ddtree_jax.shapes`) in bf16 it lays the abstract target out by the tp rules
(`parallel.param_shardings`, as a checkpoint load does) and prints, per block (the embedding and lm_head,
attention, Gated DeltaNet, MLP, all norm weights), the weight bytes one device holds against the whole model, and
what stays whole because its heads do not divide (the same warning a load gives). It adds what the
collectives of a verify move per token, as the bytes each device receives under ring algorithms: an
all-reduce of e values after every attention or Gated DeltaNet output projection and after every MLP
(2 (N - 1) / N of its size), and, per Gated DeltaNet layer, the all-gather of its C conv-output channels
that re-lays them by heads ((N - 1) / N; models/qwen3_5.py).
"""

from __future__ import annotations

import argparse
import json
import re
import sys


def block_of(name: str) -> str:
    """The block a parameter belongs to: 'linear_attn', 'self_attn', 'mlp', 'embeddings' or 'norms' (every
    norm weight, the per-head ones inside attention and Gated DeltaNet included: they stay whole)."""
    if "norm" in name:
        return "norms"
    layer = re.match(r"model\.layers\.\d+\.([^.]+)\.", name)
    if layer and layer.group(1) in ("linear_attn", "self_attn", "mlp"):
        return layer.group(1)
    return "embeddings" if name.split(".")[-2] in ("embed_tokens", "lm_head") else "norms"


def layout(shape: str, devices: int) -> dict:
    import jax.numpy as jnp
    import numpy as np

    from ddtree_jax.config import TARGET_PARSERS
    from ddtree_jax.models import target_family
    from ddtree_jax.parallel import make_parallel, param_shardings
    from ddtree_jax.shapes import shape_configs

    raw, _ = shape_configs(shape)
    config = TARGET_PARSERS[raw["model_type"]](raw)
    params = target_family(config).abstract(config, jnp.bfloat16)
    shardings = param_shardings(params, make_parallel(devices, "tp"))
    blocks: dict[str, dict[str, int]] = {}
    for name, array in params.state_flat().items():
        entry = blocks.setdefault(block_of(name), {"bytes": 0, "bytes_per_device": 0})
        entry["bytes"] += array.size * array.dtype.itemsize
        entry["bytes_per_device"] += int(np.prod(shardings[name].shard_shape(array.shape))) * array.dtype.itemsize
    linear = len(getattr(config, "linear_layers", ()))
    itemsize, share = 2, (devices - 1) / devices
    gathered = linear * config.linear_conv_dim * itemsize if linear else 0
    return {"shape": shape, "devices": devices, "blocks": blocks,
            "bytes": sum(b["bytes"] for b in blocks.values()),
            "bytes_per_device": sum(b["bytes_per_device"] for b in blocks.values()),
            "all_reduces_per_token": 2 * config.num_layers, "all_gathers_per_token": linear,
            "all_reduce_received_per_token": 2 * share * 2 * config.num_layers * config.hidden_size * itemsize,
            "all_gather_received_per_token": share * gathered}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", default="qwen3.6-27b")
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--json", action="store_true", help="print the figures as one JSON object")
    args = p.parse_args(argv)
    import jax

    # Shardings of abstract arrays need devices but no accelerator: N host devices, wherever this runs.
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", args.devices)
    report = layout(args.shape, args.devices)
    if args.json:
        print(json.dumps(report))
        return 0
    gib = 2 ** 30
    print(f"{args.shape}, bf16, --parallel tp on {args.devices} devices: GiB per device (of the whole)")
    for block, b in sorted(report["blocks"].items()):
        print(f"  {block:<12} {b['bytes_per_device'] / gib:8.2f} of {b['bytes'] / gib:8.2f}")
    print(f"  {'total':<12} {report['bytes_per_device'] / gib:8.2f} of {report['bytes'] / gib:8.2f}")
    print(f"collectives per verified token, received per device (ring): {report['all_reduces_per_token']} "
          f"all-reduces {report['all_reduce_received_per_token'] / 1024:.1f} KiB, "
          f"{report['all_gathers_per_token']} all-gathers {report['all_gather_received_per_token'] / 1024:.1f} KiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
