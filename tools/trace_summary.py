"""Summarise the GPU side of the profiler traces that `python -m ddtree_jax.bench --trace DIR` writes.

    python tools/trace_summary.py DIR [--top 12] [--sequence START:COUNT] [--gaps N] [--against DIR_B]

For every row folder under DIR (its `perfetto_trace.json.gz`), over the traced rounds: wall time from the
first kernel's start to the last kernel's end, the sum of kernel times (busy), the gaps between kernels
(idle = wall - busy), the kernel count, the busy time by kind of kernel (matmul, tree attention, sort/top-k,
...), and the kernels grouped by name with their share of the busy time.
Per round = divided by the number of rounds traced (`--rounds`: the bench traces one call of its device
loop, `bench.LOOP_ROUNDS` = 8 rounds; its checkpoint mode traces one decode and writes its round count in
ROW/rounds.json). Times come from the profiler, which slows dispatch but not kernels: busy time is the figure
to compare with the bench's round time. A kernel's time is its own: from the end of the kernel before it where it was
placed before that ended (`gpu_kernels`; before 2026-12-06 evening the profiler's spans were summed, so a Pallas
kernel's successor, placed early since the kernels signal at entry, counted its wait too and busy could exceed wall).
`--against DIR_B` aligns each row's first round with the same row traced under DIR_B (a knob's A/B) and lists the
stretches where their kernels differ, grouped, with each side's time a round: which swapped kernels gain or lose.
`--gaps N` prints each trace's N longest idle gaps with the kernels around them (where a call waits for the
host). `--sequence 300:30` prints kernels 300..329 of each trace in launch order with their times (e.g. one decoder
layer, to see which small kernels sit between its matmuls; map their names to fusions with an HLO dump, the
`hlo` step of tools/h200_run.sh).
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import re
import sys
from pathlib import Path


def gpu_kernels(path: Path) -> list[tuple[float, float, str]]:
    """(start us, duration us, name) of every event on the GPU's streams, in launch order: each kernel's own time,
    from the later of its start and the end of every kernel before it (a kernel placed early, behind one that lets
    it be launched, Hopper's programmatic dependent launch, shows from its placement, but waits at its entry until
    that kernel has ended), so that the times add up to the busy time and the gaps are idle."""
    data = json.load(gzip.open(path))
    events = data["traceEvents"] if isinstance(data, dict) else data
    gpu_pids = {e["pid"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"
                and "GPU" in str(e.get("args", {}).get("name", ""))}
    spans = sorted((float(e["ts"]), float(e.get("dur", 0.0)), e.get("name", "?")) for e in events
                   if e.get("ph") == "X" and e.get("pid") in gpu_pids)
    out, last_end = [], float("-inf")
    for start, dur, name in spans:
        end = start + dur
        own_start = min(max(start, last_end), end)
        out.append((own_start, end - own_start, name))
        last_end = max(last_end, end)
    return out


def family(name: str) -> str:
    """Kernel names without their numeric suffixes (fusion_123 -> fusion, loop_add_fusion_7 -> loop_add_fusion)."""
    return re.sub(r"(_\d+)+$", "", re.sub(r"\.\d+", "", name))


def category(name: str) -> str:
    """The kind of a kernel, by its name: matmul (XLA's gemm fusions, cuBLAS's nvjet/cutlass kernels), tree
    attention or tree accept (the Pallas kernels), sort/top-k (XLA sorts, cub radix sorts, XLA's TopK), or
    other (every other fusion)."""
    if name.startswith(("nvjet", "cutlass")) or "gemm" in name:
        return "matmul"
    if name.startswith("tree_attention"):
        return "tree attention"
    if name.startswith("tree_accept"):
        return "tree accept"
    if "sort" in name.lower() or "topk" in name.lower() or name.startswith("void stream_executor::cuda::Run<"):
        return "sort/top-k"
    return "other"


def summarise(path: Path, rounds: int, top: int = 12, by_kernel: bool = False) -> dict:
    """Per round: wall, busy and idle time, kernels, time by kind, and the `top` kernel families (numeric suffixes
    dropped) or, `by_kernel`, the top compiled kernels by their own names (each its own shape: a projection's
    weight, say), each with its count, time and mean duration."""
    kernels = gpu_kernels(path)
    if not kernels:
        return {"kernels": 0}
    wall = kernels[-1][0] + kernels[-1][1] - kernels[0][0]
    busy = sum(d for _, d, _ in kernels)
    groups = collections.defaultdict(lambda: [0, 0.0])
    for _, d, name in kernels:
        key = name if by_kernel else family(name)
        groups[key][0] += 1
        groups[key][1] += d
    ranked = sorted(groups.items(), key=lambda kv: -kv[1][1])[:top]
    kinds = collections.defaultdict(lambda: [0, 0.0])
    for _, d, name in kernels:
        kinds[category(name)][0] += 1
        kinds[category(name)][1] += d
    return {"rounds": rounds, "wall_ms_per_round": wall / rounds / 1e3, "busy_ms_per_round": busy / rounds / 1e3,
            "idle_ms_per_round": (wall - busy) / rounds / 1e3, "kernels_per_round": len(kernels) / rounds,
            "by_kind": {k: {"count_per_round": c / rounds, "ms_per_round": t / rounds / 1e3}
                        for k, (c, t) in sorted(kinds.items(), key=lambda kv: -kv[1][1])},
            "top": [{"name": n, "count_per_round": c / rounds, "ms_per_round": t / rounds / 1e3, "mean_us": t / c,
                     "share_of_busy": t / busy} for n, (c, t) in ranked]}


def largest_gaps(path: Path, count: int) -> list[dict]:
    """The `count` longest idle stretches of a trace (a kernel's end to the next one's start, us), largest first,
    with the index and name of the kernel before and after each and its start after the trace's first kernel:
    where a call waits for the host (a loop's exit test, a conditional's branch)."""
    kernels = gpu_kernels(path)
    gaps = [{"us": b[0] - (a[0] + a[1]), "at_us": b[0] - kernels[0][0], "index": i + 1, "before": a[2], "after": b[2]}
            for i, (a, b) in enumerate(zip(kernels, kernels[1:]))]
    return sorted(gaps, key=lambda g: -g["us"])[:count]


def sequence(path: Path, start: int, count: int) -> list[tuple[str, float]]:
    """(name, us) of kernels start .. start + count - 1 of a trace, in launch order."""
    return [(name, dur) for _, dur, name in gpu_kernels(path)[start:start + count]]


def differences(path_a: Path, path_b: Path, rounds: int) -> list[dict]:
    """Where two traces of the same program with some kernels swapped (streamed projections against XLA's, say)
    differ, per round: the first round's kernels of each (the first 1 / rounds of the trace) aligned by their
    families (difflib), and every stretch that differs grouped by what it is: the anchor kernel before it (a family
    both run), its kernels in A and in B (their own names: one compiled shape each), how often a round runs it and
    the us each side spends there a round. Largest |A - B| first."""
    import difflib

    a, b = gpu_kernels(path_a), gpu_kernels(path_b)
    a, b = a[:max(1, len(a) // rounds)], b[:max(1, len(b) // rounds)]
    fam_a, fam_b = [family(n) for _, _, n in a], [family(n) for _, _, n in b]
    groups = {}
    for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(None, fam_a, fam_b, autojunk=False).get_opcodes():
        if tag == "equal":
            continue
        key = (fam_a[i1 - 1] if i1 else "(start)", tuple(n for _, _, n in a[i1:i2]), tuple(n for _, _, n in b[j1:j2]))
        g = groups.setdefault(key, {"after": key[0], "a": list(key[1]), "b": list(key[2]), "count": 0, "a_us": 0.0,
                                    "b_us": 0.0})
        g["count"] += 1
        g["a_us"] += sum(d for _, d, _ in a[i1:i2])
        g["b_us"] += sum(d for _, d, _ in b[j1:j2])
    return sorted(groups.values(), key=lambda g: -abs(g["a_us"] - g["b_us"]))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("dir", type=Path)
    p.add_argument("--top", type=int, default=12)
    p.add_argument("--rounds", type=int, default=8,
                   help="rounds in each trace (bench --shape: LOOP_ROUNDS); a row's rounds.json overrides it")
    p.add_argument("--json", action="store_true")
    p.add_argument("--by-kernel", action="store_true",
                   help="rank compiled kernels by their own names (numeric suffixes kept: one shape each), not "
                        "their families")
    p.add_argument("--sequence", default=None, metavar="START:COUNT",
                   help="also print these kernels of each trace in launch order")
    p.add_argument("--gaps", type=int, default=0, metavar="N", help="also print each trace's N longest idle gaps")
    p.add_argument("--against", type=Path, default=None, metavar="DIR_B",
                   help="also align each row's first round with the same row's under DIR_B and list where they "
                        "differ (kernels swapped by a knob: which of them gain or lose)")
    args = p.parse_args(argv)
    report, traces = {}, {}
    for trace in sorted(args.dir.glob("*/**/perfetto_trace.json.gz")):
        row = trace.relative_to(args.dir).parts[0]
        counted = args.dir / row / "rounds.json"  # the bench's checkpoint mode: the traced decode's rounds
        rounds = json.loads(counted.read_text())["rounds"] if counted.exists() else args.rounds
        report[row], traces[row] = summarise(trace, rounds, top=args.top, by_kernel=args.by_kernel), trace
    if args.sequence:
        start, count = (int(x) for x in args.sequence.split(":"))
        for row, trace in traces.items():
            report[row]["sequence"] = [{"name": n, "us": us} for n, us in sequence(trace, start, count)]
    if args.gaps:
        for row, trace in traces.items():
            report[row]["gaps"] = largest_gaps(trace, args.gaps)
    if args.against:
        for row, trace in traces.items():
            other = sorted((args.against / row).glob("**/perfetto_trace.json.gz"))
            if other:
                report[row]["against"] = differences(trace, other[0], report[row].get("rounds", args.rounds))
    if args.json:
        print(json.dumps(report, indent=1))
        return 0
    for row, s in report.items():
        if not s.get("kernels_per_round"):
            print(f"{row}: no GPU kernels in the trace")
            continue
        print(f"\n{row}: wall {s['wall_ms_per_round']:.2f} ms/round, kernels busy {s['busy_ms_per_round']:.2f}, "
              f"idle {s['idle_ms_per_round']:.2f}, {s['kernels_per_round']:.0f} kernels/round")
        print("  by kind: " + ", ".join(f"{k} {v['ms_per_round']:.2f} ms ({v['count_per_round']:.0f})"
                                        for k, v in s["by_kind"].items()))
        for k in s["top"]:
            print(f"  {k['ms_per_round']:7.3f} ms  {k['share_of_busy']:5.1%}  x{k['count_per_round']:<5.0f} "
                  f"{k['mean_us']:8.2f} us  {k['name'][:90]}")
        for g in s.get("gaps", []):
            print(f"  gap {g['us']:8.2f} us at {g['at_us']:9.1f} us, kernel {g['index']}: {g['before'][:40]} -> "
                  f"{g['after'][:40]}")
        for g in s.get("against", [])[:args.top]:
            print(f"  x{g['count']:<4} {g['a_us']:9.1f} us against {g['b_us']:9.1f} a round, after {g['after'][:30]}: "
                  f"{' + '.join(g['a'])[:60] or '-'}  |  {' + '.join(g['b'])[:60] or '-'}")
        if "sequence" in s:
            print(f"  kernels {args.sequence} in launch order:")
            for k in s["sequence"]:
                print(f"    {k['us']:8.2f} us  {k['name'][:90]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
