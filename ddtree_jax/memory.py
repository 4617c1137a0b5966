"""Will a generation request fit? Its device memory, estimated from config shapes before anything is allocated.

`estimate` counts what a request keeps on one device: the weights, the target's KV cache (or a hybrid
target's attention K/V plus its Gated DeltaNet states), the drafter's context cache, a hybrid's per-node
verify records, the decode loop's output arrays, and the buffers of the widest call (its float32 logits, the
verified nodes' K/V and, on the pure-JAX attention path, one layer's attention scores). The caches are
measured on the models' own `create_cache` under `jax.eval_shape`, so their layout has one definition. XLA's
other temporaries are not counted: the estimate is a floor, and a request above the device's memory cannot
run.

`device_memory` is what one device can hold: the accelerator's allocator limit, or on the CPU the
machine's available memory (less under a cgroup limit).
"""

from __future__ import annotations

import dataclasses
import math
import os
from pathlib import Path

import jax
import numpy as np

from ddtree_jax.engine import DecodeOptions, Mode, cache_shape
from ddtree_jax.models.params import ModelParams


@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
    """Bytes on one device for one request; `capacity` is the cache length in tokens per row."""

    weights: int
    kv_cache: int  # the target's attention K/V
    drafter_cache: int  # the drafter's context K/V
    recurrent: int  # hybrid: Gated DeltaNet state and conv window per row
    node_records: int  # hybrid: what each verified tree node keeps per Gated DeltaNet layer (cache.NodeStates)
    verify_buffers: int  # float32 logits of the widest call, the verified nodes' K/V, attention scores (pure JAX)
    outputs: int  # the decode loop's output tokens and per-round counts
    capacity: int

    @property
    def total(self) -> int:
        return (self.weights + self.kv_cache + self.drafter_cache + self.recurrent + self.node_records
                + self.verify_buffers + self.outputs)

    def breakdown(self) -> str:
        """'KV cache 12.3 GiB, verify buffers 4.1 GiB, ...': the non-zero parts, largest first."""
        parts = {"weights": self.weights, "KV cache": self.kv_cache, "drafter cache": self.drafter_cache,
                 "recurrent states": self.recurrent, "per-node verify records": self.node_records,
                 "verify buffers": self.verify_buffers, "output arrays": self.outputs}
        return ", ".join(f"{name} {format_bytes(n)}" for name, n in sorted(parts.items(), key=lambda kv: -kv[1]) if n)


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _nbytes(tree) -> int:
    return sum(math.prod(leaf.shape) * np.dtype(leaf.dtype).itemsize for leaf in jax.tree.leaves(tree))


def estimate(target: ModelParams, drafter: ModelParams | None, options: DecodeOptions, batch: int,
             max_prompt_len: int) -> MemoryEstimate:
    """Bytes per device of generating for `batch` prompts of up to `max_prompt_len` tokens.

    target, drafter: parameters or their abstract shapes (`models.target_family(config).abstract`,
    `dflash.abstract`, or the MTP head's `mtp.abstract`); options: resolved (`engine.resolve_options`: the
    block size known). Under tp the weights, caches and logits are split over the devices; under dp the rows are.
    """
    from ddtree_jax.cache import recurrent_node_bytes
    from ddtree_jax.models import dflash, mtp, target_family

    config = target.config
    dtype = target.array("model.embed_tokens.weight").dtype
    itemsize = np.dtype(dtype).itemsize
    width, capacity = cache_shape(max_prompt_len, options)
    parallel = options.parallel
    split = parallel.size if parallel.mode == "tp" else 1
    rows = -(-batch // parallel.size) if parallel.mode == "dp" else batch

    cache = jax.eval_shape(lambda: target_family(config).create_cache(config, rows, capacity, dtype))
    kv, recurrent = (cache.kv, cache.recurrent) if hasattr(cache, "recurrent") else (cache, ())
    drafter_cache = 0
    if drafter is not None and options.mode.needs_drafter:
        family = mtp if options.mode is Mode.MTP else dflash
        drafter_cache = _nbytes(jax.eval_shape(lambda: family.create_cache(drafter.config, rows, capacity, dtype)))
    nodes = options.verify_width
    # A hybrid's verify keeps records per node and Gated DeltaNet layer (AR updates its state in place).
    node_records = rows * recurrent_node_bytes(config, nodes, itemsize) if options.mode.needs_drafter else 0
    # The widest call: the verify (or the prompt's prefill, for its attention scores).
    logits = rows * nodes * config.vocab_size * 4
    if options.mode.needs_drafter:
        logits += rows * (options.block_size - 1) * config.vocab_size * 4
    # The verified nodes' K/V, held beside the cache until the commit (`cache.PendingKV`).
    _, _, kv_heads, head_dim = kv.k[0].shape
    pending = 2 * len(kv.k) * rows * nodes * kv_heads * head_dim * itemsize if options.mode.needs_drafter else 0
    scores = 0
    if not options.runtime.pallas:
        t = max(width, nodes)
        scores = rows * config.num_heads * t * (capacity + t) * 4
    weights = _nbytes(target.state) + (_nbytes(drafter.state) if drafter_cache else 0)
    return MemoryEstimate(weights=weights // split, kv_cache=_nbytes(kv) // split,
                          drafter_cache=drafter_cache // split, recurrent=_nbytes(recurrent),
                          node_records=node_records, verify_buffers=(logits + pending + scores) // split,
                          outputs=rows * 2 * options.max_new_tokens * 4, capacity=capacity)


def device_memory() -> tuple[int, str]:
    """(bytes one device can hold, what that number is): the accelerator allocator's limit less what is in
    use, or on the CPU the machine's available memory."""
    device = jax.local_devices()[0]
    try:
        stats = device.memory_stats()
    except Exception:  # some backends raise instead of returning None
        stats = None
    if stats and stats.get("bytes_limit"):
        return stats["bytes_limit"] - stats.get("bytes_in_use", 0), f"{device.device_kind} memory"
    return host_available_memory(), "available host memory"


def host_available_memory() -> int:
    """MemAvailable from /proc/meminfo (else free pages), less under a cgroup v2 or v1 memory limit."""
    available = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * 1024
    except OSError:
        pass
    if available is None:
        available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    for limit_file, usage_file in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                                   ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                                    "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        try:
            limit, usage = Path(limit_file).read_text().strip(), int(Path(usage_file).read_text())
        except (OSError, ValueError):
            continue
        if limit.isdigit():  # "max" (v2) means no limit; v1 writes a huge number instead
            available = min(available, int(limit) - usage)
    return available
