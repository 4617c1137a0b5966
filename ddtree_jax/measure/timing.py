"""Timing on a device: medians of synchronised calls, and the time one iteration adds inside a device loop.

A call of a compiled program costs a host dispatch that grows with its argument count (1.7-2.6 ms for
the ~550 arrays of an 8B decode loop on the H200), more than many kernels' device time. Where a program
runs n iterations of its work in a device loop (`n` an argument), calling it with n = 1 and n = N and
taking (t_N - t_1) / (N - 1) cancels the dispatch: that is the time an iteration adds on the device, the
way `generate` runs rounds. The benchmark times rounds this way and `tools/kernel_check.py` kernels.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

LOOP_ROUNDS = 8  # iterations per call of the many-iterations call


def median_seconds(fn: Callable[[], Any], repeats: int, warmup: int = 2) -> float:
    """Median wall seconds of `fn()` over `repeats` calls, each synchronised on the device, after `warmup`."""
    import jax

    for _ in range(warmup):
        jax.block_until_ready(fn())
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def in_loop_seconds(call: Callable[[int], Any], repeats: int, iterations: int = LOOP_ROUNDS,
                    warmup: int = 2) -> tuple[float, float]:
    """(seconds one iteration adds inside the device loop, seconds of a call of one iteration).

    `call(n)` runs n iterations in one device call. Medians of `repeats` synchronised calls of each size;
    the difference is clamped at 0 (on a CPU, noise can make it negative for tiny programs)."""
    one = median_seconds(lambda: call(1), repeats, warmup)
    many = median_seconds(lambda: call(iterations), repeats, warmup)
    return max(many - one, 0.0) / (iterations - 1), one


def record_trace(trace_dir: Path, fn: Callable[[], Any]) -> Any:
    """`fn()` under a profiler trace (TensorBoard files and a Perfetto JSON under `trace_dir`), synchronised, run
    once. A profiler that cannot start or write costs the trace (one warning), not the work; an error of `fn`
    itself propagates."""
    import jax

    def warn(e: Exception) -> None:
        print(f"warning: no trace in {trace_dir}: {str(e).splitlines()[0][:200]}", file=sys.stderr)

    try:
        jax.profiler.start_trace(str(trace_dir), create_perfetto_trace=True)
    except Exception as e:  # noqa: BLE001 - the profiler's own failure
        warn(e)
        return jax.block_until_ready(fn())
    try:
        return jax.block_until_ready(fn())
    finally:
        try:
            jax.profiler.stop_trace()
        except Exception as e:  # noqa: BLE001
            warn(e)
