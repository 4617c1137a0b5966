"""`python -m ddtree_jax.bench`: time AR, DFlash and DDTree rounds, by stage, against hardware floors.

Two ways to run:
- `--shape qwen3-8b` (or another `ddtree_jax.shapes` name, e.g. the hybrid qwen3.6-27b, tiny, tiny-hybrid):
  random bf16 weights of that shape built on the device, a matching random drafter (the published DFlash
  layout of that target, block 16), caches filled with `--context` tokens (a comma list sweeps them; for a
  hybrid also random recurrent states and conv windows), `--batch` rows (a comma list sweeps them). Times
  the round as `generate` runs it (inside the device loop) and each stage of a round alone (draft, tree,
  verify, accept, commit: the engine's own stage functions, `round.STAGES`), for AR, DFlash and DDTree at
  `--budgets`, next to the floor. Random weights accept almost nothing, so tokens/s are projected at a
  given tau (`--tau`, default the paper's MATH-500 Qwen3-8B values), marked as projected. `--weights fp8`
  makes the target's projections block-scaled FP8 (the floors count those bytes). `--modes mtp` (a
  Qwen3.5/3.6 shape) adds rows of the target's own MTP head (random, `--mtp-steps` drafts per round),
  projected only at a tau given with `--tau mtp=X`.
- `--target DIR --drafter DIR --prompts FILE.jsonl`: all modes on real prompts: tau, tokens/s, speedup
  over AR measured in the same run, and the first greedy divergence from AR. `--budgets 16,64,auto` adds a
  `--budget auto` row over `--budget-candidates` (its round costs calibrated, or read from the cost cache, by
  `generate` itself, outside the timed decode), with how often each budget was chosen. Every row compiles and
  warms up first, then each prompt is decoded by every row in turn (drift weighs on all rows alike). With
  neither `--shape` nor `--target`: the demo target, with the shipped drafter and held-out prompts unless given.

Writes bench.json (every figure), bench.md (the table) and bench.png (time per round against the budget,
with the floor) under `--out`; `--trace DIR` adds a profiler trace per row. The measuring itself
(ceilings, floors, timers, workloads) is `ddtree_jax.measure`.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

from ddtree_jax.cli import atomic_path, write_lines_atomic
from ddtree_jax.measure.timing import LOOP_ROUNDS
from ddtree_jax.shapes import SHAPES, SMALL_SHAPES, shape_configs

# The paper's Table 1, MATH-500, Qwen3-8B, T = 0: DFlash tau 7.79; DDTree tau 10.73 at its best budget.
# Per-budget values are not published; these defaults use the DDTree figure for every budget >= 64 and an
# assumed 9.0 at 16, and `projected_tau` interpolates between listed budgets. Override with --tau.
DEFAULT_TAU = {"ar": 1.0, "dflash": 7.79, 16: 9.0, 64: 10.73, 256: 10.73, 512: 10.73}


def projected_tau(taus: dict, mode: str, budget: int | None) -> float | None:
    """tau for a mode (and DDTree budget): the given value; between two listed budgets, linear in log2(budget)
    (a budget of 63 gets 10.71 from 16's 9.0 and 64's 10.73: one node less than 64 loses almost nothing, as
    measured on the demo pair, docs/performance.md); below the smallest or above the largest, that one's. None
    for MTP unless given (`--tau mtp=X`: no published tau of the Qwen3.6 head to default to)."""
    if mode != "ddtree":
        return taus.get(mode)
    if budget in taus:
        return taus[budget]
    budgets = sorted(k for k in taus if isinstance(k, int))
    below, above = [k for k in budgets if k < budget], [k for k in budgets if k > budget]
    if not below or not above:
        return taus[below[-1] if below else above[0]]
    lo, hi = below[-1], above[0]
    share = (np.log2(budget) - np.log2(lo)) / (np.log2(hi) - np.log2(lo))
    return float(taus[lo] + share * (taus[hi] - taus[lo]))


def _out_of_memory(e: Exception) -> bool:
    return "RESOURCE_EXHAUSTED" in str(e) or "out of memory" in str(e).lower()


def _run_facts(parallel) -> dict:
    """What every bench.json records of the machine and software: the device, how many and how they are used,
    jax's version, and whether the Pallas kernels signal their dependents at entry (`pallas_kernels.launch`;
    Hopper GPUs; rows timed before 2026-12-06 08:00 ran without it)."""
    import jax

    from pallas_kernels import launch

    signal = bool(launch.EARLY_LAUNCH and launch.early_launch_supported())
    return {"device": str(jax.devices()[0].device_kind), "devices": parallel.size, "parallel": parallel.mode,
            "jax": jax.__version__, "kernel_launch_signal": signal}


def run_shape(args, parallel) -> dict:
    import jax
    import jax.numpy as jnp
    from tqdm import tqdm

    from ddtree_jax.engine import DecodeOptions, Mode, resolve_options
    from ddtree_jax.measure import costs, workload
    from ddtree_jax.measure.ceilings import measure_ceilings
    from ddtree_jax.models import is_recurrent

    start = time.perf_counter()
    ceilings = measure_ceilings(args.repeats, args.shape in SMALL_SHAPES)
    print(f"ceilings {ceilings}", flush=True)
    dtype = {"bfloat16": jnp.bfloat16, "float32": jnp.float32}[args.dtype]
    target, drafter = workload.random_pair(args.shape, parallel, dtype, fp8=args.weights == "fp8")
    head = workload.random_mtp_head(target, parallel, dtype) if "mtp" in args.modes else None
    jax.block_until_ready((target.state, head.state if head else None))
    print(f"random weights ready after {time.perf_counter() - start:.0f} s", flush=True)
    hybrid = is_recurrent(target.config)
    modes = [("ar", None)] * ("ar" in args.modes) + [("dflash", None)] * ("dflash" in args.modes) + \
        [("mtp", None)] * ("mtp" in args.modes) + [("ddtree", b) for b in args.budgets if "ddtree" in args.modes]
    drafters = {"mtp": head}  # the target's own head drafts MTP rows; DFlash's drafter every other mode

    def drafter_of(mode: str):
        return drafters.get(mode, drafter)

    # Each mode with every attention/acceptance implementation in turn, so a cut-short run still compares.
    plan = [(mode, budget, kernels, batch, context) for batch in args.batch for context in args.context
            for mode, budget in modes for kernels in args.kernels]
    taus = {**DEFAULT_TAU, **(args.tau or {})}
    plan_options = [resolve_options(DecodeOptions(mode=Mode(mode), max_new_tokens=4096,
                                                  block_size=0 if mode == "mtp" else 16, budget=budget or 64,
                                                  mtp_steps=args.mtp_steps, parallel=parallel, kernels=kernels,
                                                  matmul_precision=args.matmul_precision, split_k=args.split_k,
                                                  fp8_matmul=args.fp8_matmul, row_invariant=args.row_invariant),
                                   drafter_of(mode), dtype)
                    for mode, budget, kernels, _, _ in plan]

    def prepare(i):
        try:
            return workload.prepare_row(target, drafter_of(plan[i][0]), plan_options[i], plan[i][4], args.repeats,
                                        parallel, batch=plan[i][3])
        except Exception as e:  # noqa: BLE001 - only running out of device memory is survivable
            if not _out_of_memory(e):
                raise
            return e

    # A hybrid's rows hold large verify outputs (per-node vectors of every GDN layer, 54 GB of weights beside
    # them at 27B): prepare those one at a time, just before they are timed. Otherwise compile every row
    # first, in parallel threads, then time them one by one (no two programs on the device at once while
    # timing).
    # On a CPU too (small shapes, where compiling is quick): jaxlib 0.10.2's CPU backend crashed (segfault)
    # compiling two rows at once, twice in this project's test suite on 2026-12-01.
    workers = 1 if hybrid or jax.default_backend() == "cpu" else max(1, args.compile_workers)
    prepared = [None] * len(plan)
    if workers > 1:
        with concurrent.futures.ThreadPoolExecutor(workers) as pool:
            futures = {pool.submit(prepare, i): i for i in range(len(plan))}
            for f in tqdm(concurrent.futures.as_completed(futures), total=len(futures), desc="compile rows",
                          disable=None):
                prepared[futures[f]] = f.result()
        print(f"{len(plan)} rows compiled after {time.perf_counter() - start:.0f} s ({workers} threads)", flush=True)
    rows, skipped = [], []
    for i in tqdm(range(len(plan)), desc="time rows", disable=None):
        (mode, budget, kernels, batch, context), options = plan[i], plan_options[i]
        row, prepared[i] = (prepared[i] if workers > 1 else prepare(i)), None
        tokens = options.verify_width
        # Per-node recurrent states kept by the verify (hybrid targets; AR updates its state in place).
        node_bytes = costs.recurrent_node_bytes(target.config, tokens) if mode != "ar" else 0
        label = f"{mode}{budget or ''}-{kernels}-b{batch}-c{context}"
        trace = args.trace / label if args.trace else None
        try:
            if isinstance(row, Exception):
                raise row
            stages = workload.time_row(row, args.repeats, trace)
        except Exception as e:  # noqa: BLE001 - only running out of device memory is survivable
            if not _out_of_memory(e):
                raise
            # e.g. a large budget on a hybrid: what T nodes keep of every GDN layer did not fit. Keep going.
            skipped.append({"mode": mode, "budget": budget, "kernels": kernels, "batch": batch, "context": context,
                            "verify_tokens": tokens, "recurrent_state_bytes": node_bytes,
                            "error": str(e).splitlines()[0][:300]})
            print(json.dumps(skipped[-1]), flush=True)
            continue
        finally:
            del row
        terms = costs.floor_terms(target, drafter_of(mode), mode, tokens, context, options.block_size, batch=batch)
        floor = costs.floor(terms["bytes"], terms["flops"], ceilings)[0]
        tau = projected_tau(taus, mode, budget)
        rows.append({"mode": mode, "budget": budget, "kernels": kernels, "split_k": options.split_k,
                     "fp8_matmul": options.fp8_matmul, "row_invariant": options.row_invariant, "batch": batch,
                     "context": context, "verify_tokens": tokens, **{f"{k}_s": v for k, v in stages.items()},
                     "floor_s": floor, "ratio_to_floor": stages["round"] / floor, "tau_projected": tau,
                     # (on a CPU a tiny round can time as 0: the difference of two medians)
                     "tokens_per_s_projected": batch * tau / stages["round"] if stages["round"] > 0 and tau else None,
                     "recurrent_state_bytes": node_bytes, "recurrent_state_mib": node_bytes / 2**20,
                     "floor_bytes": terms["bytes"], "floor_recurrent_bytes": terms["recurrent_bytes"],
                     "floor_flops": terms["flops"]})
        # Progress that survives a cut-short run: one line and a partial JSON per row.
        print(json.dumps(rows[-1]), flush=True)
        write_lines_atomic(args.out / "bench.partial.json",
                           [json.dumps({"ceilings": ceilings, "rows": rows, "skipped": skipped}, indent=1)])
    for r in rows:
        ar = next((a for a in rows if a["mode"] == "ar" and all(a[k] == r[k] for k in ("kernels", "batch", "context"))),
                  None)
        r["round_over_ar_step"] = r["round_s"] / ar["round_s"] if ar and ar["round_s"] > 0 else None
    return {"kind": "shape", "shape": args.shape, "context": args.context, "batch": args.batch,
            **_run_facts(parallel), "ceilings": ceilings, "dtype": args.dtype, "weights": args.weights,
            "matmul_precision": plan_options[0].matmul_precision if plan_options else None,
            "target_bytes": costs.param_bytes(target), "drafter_bytes": costs.param_bytes(drafter),
            "mtp_bytes": costs.param_bytes(head) if head else None, "mtp_steps": args.mtp_steps if head else None,
            "target_config": shape_configs(args.shape)[0], "hybrid": hybrid,
            "recurrent_committed_bytes": costs.committed_recurrent_bytes(target.config),
            "recurrent_bytes_per_node": costs.recurrent_node_bytes(target.config, 1), "rows": rows,
            "skipped": skipped}


def read_prompts(path: Path, target_dir: Path, vocab_size: int) -> list[list[int]]:
    """Token ids of a JSONL prompt file (`cli.read_prompt_file`: {"prompt"}, {"messages"} or {"prompt_ids"} per
    line, with the target folder's tokenizer); a line that cannot run is bad input here."""
    from ddtree_jax.cli import BadInput, ChatOptions, load_tokenizer, read_prompt_file

    lines = read_prompt_file(path, load_tokenizer(target_dir), target_dir, ChatOptions(), vocab_size)
    bad = [p.error for p in lines if p.error]
    if bad:
        raise BadInput(bad[0])
    return [p.ids for p in lines]


def shown_path(path) -> str:
    """A checkpoint folder as a record shows it: relative to the working directory when it lies under it (the
    shipped demo pair's records then carry no machine paths), else as given."""
    try:
        return str(Path(path).resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


def costs_of(warm) -> dict:
    """generate's keyword arguments that reuse a warm-up's `--budget auto` costs (none for a fixed row)."""
    if warm.round_costs is None:
        return {}
    return {"round_costs": warm.round_costs, "change_cost": warm.change_cost}


def run_checkpoints(args, parallel) -> dict:
    import jax.numpy as jnp
    from tqdm import tqdm

    from ddtree_jax.checkpoint import load_drafter, load_target
    from ddtree_jax.engine import DecodeOptions, Mode, cache_shape, generate, kept_record, resolve_options
    from ddtree_jax.measure.timing import record_trace

    dtype = {"bfloat16": jnp.bfloat16, "float32": jnp.float32}[args.dtype]
    target = load_target(args.target, dtype, parallel=parallel)
    drafter = load_drafter(args.drafter, target.config, dtype, parallel=parallel)
    prompts = read_prompts(args.prompts, args.target, target.config.vocab_size)[:args.num_prompts]
    # (mode, budget, auto scope): the scope only for budget "auto", one row per --auto-scope
    plan = [("ar", None, None)] + [("dflash", None, None)] * ("dflash" in args.modes) + \
        [("ddtree", b, scope) for b in args.budgets if "ddtree" in args.modes
         for scope in (args.auto_scope if b == "auto" else (None,))]
    options_of, warm_of = {}, {}
    for key in tqdm(plan, desc="compile", disable=None):
        mode, budget, scope = key
        auto = budget == "auto"
        options = DecodeOptions(mode=Mode(mode), max_new_tokens=args.max_new_tokens,
                                budget=64 if auto or budget is None else budget,
                                budgets=args.budget_candidates if auto else (), auto_scope=scope or "call",
                                parallel=parallel, matmul_precision=args.matmul_precision, split_k=args.split_k,
                                fp8_matmul=args.fp8_matmul, row_invariant=args.row_invariant)
        options_of[key] = options
        # Warm-up: compilation, and for auto per round the round costs (calibrated unless cached, on the first
        # prompt), then used for every prompt: one cost table per run (a prompt of another cache size has its own
        # cache entry, which --recalibrate would not refresh). Auto per call runs the candidates' fixed programs:
        # each is warmed up (and nothing is recorded).
        for warm in ([options.candidate(b) for b in options.budgets] if options.auto_per_call else [options]):
            warm_of[key] = generate(target, prompts[:1], warm, drafter=drafter,
                                    recalibrate=auto and args.recalibrate)
            # And one untimed call of every further program the prompts need (another prompt width or cache
            # size): a program's first run sets it up on the device (on a GPU, XLA's command buffers, more of them
            # the more control flow the program has), which the timed calls would otherwise pay once per row and
            # program.
            resolved = resolve_options(warm, drafter, dtype)
            shapes = {cache_shape(len(prompts[0]), resolved)}
            for p in prompts[1:]:
                if (shape := cache_shape(len(p), resolved)) not in shapes:
                    shapes.add(shape)
                    generate(target, [p], warm, drafter=drafter, **costs_of(warm_of[key]))
    # Timed: prompt by prompt, every row in turn, so that what drifts during the run (a GPU's clock, a shared
    # CPU's load) weighs on every row alike; the rows decoded one after the other had moved by up to 1.7x on
    # this project's CPU.
    # Auto carries what it learned from one prompt to the next (as `generate --prompts` does from batch to batch):
    # per round starting from nothing at the first timed prompt, per call from the record kept on disk (from
    # nothing with --recalibrate).
    results_of = {key: [] for key in plan}
    record_before = {}  # auto per call: the calls of each candidate in the record the first prompt starts from
    for key in plan:
        if options_of[key].auto_per_call:
            kept = None if args.recalibrate else kept_record(target, prompts[:1], options_of[key], drafter)[1]
            record_before[key] = [0] * len(options_of[key].budgets) if kept is None else list(kept.calls)
    for p in tqdm(prompts, desc="bench", disable=None):
        for key in plan:
            learned = results_of[key][-1].auto_learned if results_of[key] else None
            results_of[key].append(generate(target, [p], options_of[key], drafter=drafter, auto_learned=learned,
                                            recalibrate=args.recalibrate and not results_of[key],
                                            **costs_of(warm_of[key])))
    rows, reference = [], None
    for key in plan:
        (mode, budget, scope), options, warm, results = key, options_of[key], warm_of[key], results_of[key]
        auto = budget == "auto"
        if args.trace:  # one more decode of the first prompt, profiled (prefill included), outside the timing
            trace_dir = args.trace / f"{mode}{budget or ''}{'_' + scope if auto else ''}"
            traced = record_trace(trace_dir, lambda: generate(target, prompts[:1], options, drafter=drafter,
                                                              **costs_of(warm)))
            with atomic_path(trace_dir / "rounds.json") as tmp:  # tools/trace_summary.py's divisor
                tmp.write_text(json.dumps({"rounds": len(traced.acceptance_lengths[0])}))
        outputs = [r.output_ids[0] for r in results]
        decode_s = sum(r.decode_seconds for r in results)
        tokens = sum(len(o) for o in outputs)
        rounds = [n for r in results for n in r.acceptance_lengths[0]]
        divergence = None
        if reference is None:
            reference = outputs
        else:
            for i, (a, b) in enumerate(zip(reference, outputs)):
                if a != b:
                    at = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
                    divergence = {"prompt": i, "token": at}
                    break
        resolved = resolve_options(options, drafter, dtype)
        rows.append({"mode": mode, "budget": budget, "split_k": resolved.split_k, "fp8_matmul": resolved.fp8_matmul,
                     "row_invariant": resolved.row_invariant,
                     "tau": float(np.mean(rounds)), "tokens": tokens,
                     "decode_s": decode_s, "tokens_per_s": tokens / decode_s, "first_divergence": divergence,
                     "decode_s_by_prompt": [r.decode_seconds for r in results]})
        if auto:
            chosen = [b for r in results for b in r.budgets_chosen[0]]
            rows[-1].update(auto_scope=scope, budget_candidates=list(options.budgets),
                            rounds_by_budget={str(b): chosen.count(b) for b in options.budgets},
                            budgets_by_round=[r.budgets_chosen[0] for r in results])
            if scope == "round":
                rows[-1].update(round_costs_s=warm.round_costs, change_cost_s=warm.change_cost,
                                calibration_s=warm.calibration_seconds)
            else:  # the calls of each candidate in this run, and in the record it started from
                calls = [r.budgets_chosen[0][0] for r in results if r.budgets_chosen[0]]
                run_calls = [calls.count(b) for b in options.budgets]
                rows[-1].update(calls_by_budget={str(b): n for b, n in zip(options.budgets, run_calls)},
                                record_calls_before=dict(zip(map(str, options.budgets), record_before[key])),
                                record_calls_after=dict(zip(map(str, options.budgets),
                                                            results[-1].auto_learned["calls"])),
                                calibration_s=sum(r.calibration_seconds for r in results))
    for r in rows:
        r["speedup_over_ar"] = r["tokens_per_s"] / rows[0]["tokens_per_s"]
    return {"kind": "checkpoints", "target": shown_path(args.target), "drafter": shown_path(args.drafter),
            "prompts": len(prompts), **_run_facts(parallel), "dtype": args.dtype,
            "matmul_precision": resolve_options(options, drafter, dtype).matmul_precision, "rows": rows}


# ----------------------------------------------------------------------------------------------------
# Report


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f}" if n >= 2**20 else f"{n / 2**20:.3f}"


def markdown(report: dict) -> str:
    """The report as a markdown table with its notes."""
    from ddtree_jax.measure.ceilings import ceilings_text

    streamed = (" Row-invariant arithmetic (`--row-invariant`: the weight-streaming matmul for the projections and "
                "the lm_head, the row-invariant attention)." if any(r.get("row_invariant") for r in report["rows"])
                else "")
    if report["kind"] == "shape":
        head = ("| mode | B | kernels | batch | context | verify tokens | draft ms | tree ms | verify ms | accept ms | "
                "commit ms | round ms | floor ms | x floor | x AR step | 1 round per call ms | projected tok/s (tau) | "
                "recurrent state MiB |\n|" + "---|" * 18 + "\n")
        ms = lambda r, k: f"{r[k] * 1e3:.2f}" if k in r else "-"  # noqa: E731
        hybrid = report.get("hybrid", False)
        mib = lambda r: _mib(r.get("recurrent_state_bytes", 0)) if hybrid else "-"  # noqa: E731
        ratio = lambda x: "-" if x is None else f"{x:.2f}"  # noqa: E731
        projected = lambda r: ("-" if r["tau_projected"] is None  # noqa: E731
                               else f"{r['tokens_per_s_projected'] or float('nan'):.0f} ({r['tau_projected']:.2f})")
        lines = [f"| {r['mode']} | {r['budget'] or '-'} | {r['kernels']} | {r['batch']} | {r['context']} | "
                 f"{r['verify_tokens']} | {ms(r, 'draft_s')} | {ms(r, 'tree_s')} | {ms(r, 'verify_s')} | "
                 f"{ms(r, 'accept_s')} | {ms(r, 'commit_s')} | {ms(r, 'round_s')} | {ms(r, 'floor_s')} | "
                 f"{r['ratio_to_floor']:.2f} | {ratio(r['round_over_ar_step'])} | {ms(r, 'round_call_s')} | "
                 f"{projected(r)} | {mib(r)} |"
                 for r in report["rows"]]
        fp8_matmuls = ", ".join(dict.fromkeys(r.get("fp8_matmul", "dequantize") for r in report["rows"]))
        notes = (f" Target projections in block-scaled FP8 (`--weights fp8`), multiplied by {fp8_matmuls} "
                 "(`--fp8-matmul`)." if report.get("weights") == "fp8" else "")
        notes += streamed
        if hybrid:
            notes += (f" Recurrent state MiB: what the verify keeps per node for the commit (every Gated DeltaNet "
                      f"layer's key, written value and log decay in float32, and the conv input), "
                      f"{_mib(report['recurrent_bytes_per_node'])} MiB per node (AR: none, it updates the committed "
                      f"{_mib(report['recurrent_committed_bytes'])} MiB in place); the floor counts them written "
                      f"and read back once.")
        for r in report.get("skipped", []):
            notes += (f"\n\nNot measured: {r['mode']} B={r['budget'] or '-'} ({r['kernels']}, batch {r['batch']}, "
                      f"context {r['context']}), {r['verify_tokens']} verify tokens, "
                      f"{_mib(r['recurrent_state_bytes'])} MiB of node states: {r['error']}")
        return (head + "\n".join(lines) + f"\n\n{ceilings_text(report['ceilings'])} Round: the time a round adds "
                f"inside the device loop ({LOOP_ROUNDS} rounds per call against 1); stages: the round's stage "
                f"functions each compiled and called alone (dispatch included). Floor: the larger of the bytes a round "
                f"must move (each weight once per pass that reads it: the lm_head once per pass that makes logits, "
                f"not an untied embedding table; the K/V cache) over the bandwidth, and its FLOPs over the matmul "
                f"rate. Projected tokens/s = batch x tau / round time." + notes + "\n")
    head = "| mode | B | tau | tokens/s | speedup over AR | first divergence from AR |\n|---|---|---|---|---|---|\n"
    notes = "".join(_auto_note(r) for r in report["rows"] if r["budget"] == "auto")
    notes += "\n\n" + streamed.strip() if streamed else ""
    return head + "\n".join(f"| {r['mode']} | {_budget_label(r)} | {r['tau']:.2f} | {r['tokens_per_s']:.1f} | "
                            f"{r['speedup_over_ar']:.2f} | {r['first_divergence'] or 'none'} |"
                            for r in report["rows"]) + notes + "\n"


def _budget_label(row: dict) -> str:
    """A row's budget as the tables show it: '-', B, or 'auto (call)' / 'auto (round)'."""
    if row["budget"] == "auto":
        return f"auto ({row.get('auto_scope', 'round')})"
    return "-" if row["budget"] is None else str(row["budget"])


def _auto_note(row: dict) -> str:
    """What a `--budget auto` row chose and from what (0: the chain)."""
    if row.get("auto_scope", "round") == "round":
        return (f"\n\nddtree auto per round: rounds by budget {row['rounds_by_budget']} (0: the chain), round costs "
                f"{', '.join(f'{c * 1e3:.2f}' for c in row['round_costs_s'])} ms, a change of candidate "
                f"{row.get('change_cost_s', 0.0) * 1e3:.2f} ms.")
    return (f"\n\nddtree auto per call: calls by budget {row['calls_by_budget']} (0: the chain), the record it "
            f"started from had {row['record_calls_before']}; calibration {row['calibration_s']:.3f} s (each candidate "
            f"on the first prompts, paired; not in its tokens/s).")


def plot(report: dict, path: Path) -> None:
    """Round time against the budget (per kernels, the first batch and context), with the floor; or tokens/s
    per mode for checkpoints."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    auto = [r for r in report["rows"] if r.get("budgets_by_round")]
    fig, axes = plt.subplots(1, 1 + len(auto), figsize=(6.4 * (1 + len(auto)), 4.2), squeeze=False)
    ax = axes[0, 0]
    for i, row in enumerate(auto):  # checkpoints with --budget auto: the budget each round of each prompt verified
        _plot_chosen_budgets(axes[0, 1 + i], row)
    if report["kind"] == "shape":
        first = [r for r in report["rows"] if r["batch"] == report["batch"][0] and r["context"] == report["context"][0]]
        kernels = list(dict.fromkeys(r["kernels"] for r in first))
        for i, k in enumerate(kernels):
            rows = [r for r in first if r["kernels"] == k]
            tree = [r for r in rows if r["mode"] == "ddtree"]
            if tree:
                ax.plot([r["budget"] for r in tree], [r["round_s"] * 1e3 for r in tree], "o-", color=f"C{3 * i}",
                        label=f"DDTree round ({k})")
                if i == 0:
                    ax.plot([r["budget"] for r in tree], [r["floor_s"] * 1e3 for r in tree], "k--", label="floor")
                ax.set_xscale("log", base=2)
            for r in rows:
                if r["mode"] != "ddtree":
                    ax.axhline(r["round_s"] * 1e3, ls=":" if i == 0 else "-.",
                               color=f"C{3 * i + {'ar': 1, 'dflash': 2}.get(r['mode'], 9)}",
                               label=f"{r['mode']} {'step' if r['mode'] == 'ar' else 'round'} ({k})")
        ax.set_xlabel("tree budget B (nodes verified = B + 1)")
        ax.set_ylabel("ms per round")
        ax.set_title(f"{report['shape']}, batch {report['batch'][0]}, context {report['context'][0]}, "
                     f"{report['device']}")
        ax.legend()
    else:
        ax.bar([f"{r['mode']}{'' if r['budget'] is None else ' ' + _budget_label(r)}" for r in report["rows"]],
               [r["tokens_per_s"] for r in report["rows"]])
        ax.set_ylabel("tokens/s")
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=120, format="png")
    plt.close(fig)


def _plot_chosen_budgets(ax, row: dict) -> None:
    """A prompts x rounds grid of the candidate each `--budget auto` round verified (blank: the prompt was done)."""
    import matplotlib.pyplot as plt
    from matplotlib.colors import BoundaryNorm, ListedColormap

    candidates = row["budget_candidates"]
    per_prompt = row["budgets_by_round"]
    grid = np.full((len(per_prompt), max(map(len, per_prompt))), np.nan)
    for i, chosen in enumerate(per_prompt):
        grid[i, :len(chosen)] = [candidates.index(b) for b in chosen]
    colors = ListedColormap([plt.get_cmap("tab10")(i) for i in range(len(candidates))])
    image = ax.imshow(grid, aspect="auto", interpolation="nearest", cmap=colors,
                      norm=BoundaryNorm(np.arange(len(candidates) + 1) - 0.5, len(candidates)))
    bar = ax.figure.colorbar(image, ax=ax, ticks=range(len(candidates)))
    bar.ax.set_yticklabels(["chain" if b == 0 else f"B = {b}" for b in candidates])
    ax.set_xlabel("round")
    ax.set_ylabel("prompt")
    ax.set_title(f"--budget auto per {row.get('auto_scope', 'round')}: the budget each round verified")


def _ints(text: str, flag: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v]
    except ValueError:
        raise ValueError(f"{flag} takes a comma list of integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise ValueError(f"{flag} takes a comma list of integers >= 1, got {text!r}")
    return values


def parse_args(argv=None) -> argparse.Namespace:
    from ddtree_jax.budget import DEFAULT_CANDIDATES, candidates_text
    from ddtree_jax.cli import add_compilation_cache_args, add_matmul_args, add_parallel_args

    p = argparse.ArgumentParser(prog="python -m ddtree_jax.bench", description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--shape", choices=sorted(SHAPES), default=None,
                   help="time rounds on random weights of this shape (else --target, else the demo pair)")
    p.add_argument("--context", default="2048", help="--shape: committed tokens in the caches (comma list: a sweep)")
    p.add_argument("--batch", default="1", help="--shape: rows per call (comma list: a sweep)")
    p.add_argument("--budgets", default="16,64,256,512",
                   help="DDTree budgets B (comma list); with checkpoints also auto (`generate --budget auto`)")
    p.add_argument("--budget-candidates", default=candidates_text(DEFAULT_CANDIDATES),
                   help="--budgets auto: the budgets it chooses from (chain or 0: a DFlash round)")
    p.add_argument("--auto-scope", default="call",
                   help="--budgets auto: comma list of call (choose per prompt among the candidates' fixed programs)"
                        " and round (choose every round on the device), a row each")
    p.add_argument("--recalibrate", action="store_true",
                   help="--budgets auto: per round, measure the round costs afresh even when the cost cache has "
                        "them; per call, start from an empty record, not the one kept on disk")
    p.add_argument("--modes", default="ar,dflash,ddtree",
                   help="comma list of ar, dflash, ddtree, mtp (mtp: a Qwen3.5/3.6 --shape, its random MTP head)")
    p.add_argument("--mtp-steps", type=int, default=3, help="--modes mtp: the head's drafts per round")
    p.add_argument("--kernels", default="jax",
                   help="--shape: comma list of jax,pallas, the attention/acceptance implementations timed")
    p.add_argument("--tau", default=None,
                   help="--shape: projected tau per mode or budget, e.g. 'dflash=7.8,64=10.7,mtp=2.5' (default: the "
                        "paper's; MTP: none)")
    p.add_argument("--repeats", type=int, default=10, help="timed calls per measurement (medians)")
    p.add_argument("--compile-workers", type=int, default=min(8, os.cpu_count() or 1),
                   help="--shape: threads compiling the rows before any is timed (hybrid shapes and CPUs: 1)")
    p.add_argument("--trace", type=Path, default=None,
                   help=f"a profiler trace (TensorBoard + Perfetto JSON) per row under DIR/ROW: --shape, {LOOP_ROUNDS} "
                        "rounds in the device loop; --target, one more decode of the first prompt (prefill "
                        "included; its round count in DIR/ROW/rounds.json)")
    p.add_argument("--target", type=Path, default=None, help="target checkpoint folder (HF or orbax)")
    p.add_argument("--drafter", type=Path, default=None,
                   help="DFlash drafter checkpoint folder (without --target: with the demo target)")
    p.add_argument("--prompts", type=Path, default=None,
                   help="--target: JSONL prompts, {\"prompt\": ...} or {\"prompt_ids\": [...]} per line")
    p.add_argument("--num-prompts", type=int, default=8, help="--target: the first N prompts of the file")
    p.add_argument("--max-new-tokens", type=int, default=128, help="--target: tokens generated per prompt")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16",
                   help="weights, activations and caches")
    p.add_argument("--weights", choices=["dtype", "fp8"], default="dtype",
                   help="--shape: the weights in --dtype, or the target's projections in block-scaled FP8 (128 x 128 "
                        "blocks, float32 scales; embeddings, lm_head, norms and the drafter in --dtype)")
    add_matmul_args(p)
    p.add_argument("--out", type=Path, default=Path("bench_out"), help="folder for bench.json, bench.md, bench.png")
    add_parallel_args(p)
    add_compilation_cache_args(p)
    return p.parse_args(argv)


def main(argv=None) -> int:
    from ddtree_jax.checkpoint import CheckpointError
    from ddtree_jax.config import ConfigError
    from ddtree_jax.cli import EXIT_BAD_INPUT, BadInput, parallel_from_args, recorded_command, setup_compilation_cache

    args = parse_args(argv)
    try:
        from ddtree_jax.budget import AUTO_SCOPES, parse_candidates

        budgets = [b for b in args.budgets.split(",") if b]
        fixed = [b for b in budgets if b != "auto"]
        args.budgets = _ints(",".join(fixed), "--budgets") if fixed or "auto" not in budgets else []
        if "auto" in budgets:
            if args.shape is not None:
                raise ValueError("--budgets auto needs checkpoints (--target, or the demo pair): it chooses from "
                                 "the drafter's confidence, which random --shape weights do not have")
            args.budgets.append("auto")
            try:
                args.budget_candidates = parse_candidates(args.budget_candidates)
            except ValueError as e:
                raise ValueError(f"--budget-candidates: {e}") from None
        args.auto_scope = list(dict.fromkeys(s for s in args.auto_scope.split(",") if s))
        if not args.auto_scope or any(s not in AUTO_SCOPES for s in args.auto_scope):
            raise ValueError(f"--auto-scope takes a comma list of {', '.join(AUTO_SCOPES)}, got "
                             f"{','.join(args.auto_scope)!r}")
        args.context = _ints(args.context, "--context")
        args.batch = _ints(args.batch, "--batch")
        args.modes = [m for m in args.modes.split(",") if m]
        if not args.modes or any(m not in ("ar", "dflash", "ddtree", "mtp") for m in args.modes):
            raise ValueError(f"--modes takes a comma list of ar, dflash, ddtree, mtp, got {','.join(args.modes)!r}")
        if "mtp" in args.modes:
            hybrid_shapes = [s for s in sorted(SHAPES) if shape_configs(s)[0]["model_type"] == "qwen3_5_text"]
            if args.shape not in hybrid_shapes:
                raise ValueError(f"--modes mtp times the target's own MTP head: it needs a Qwen3.5/3.6 --shape "
                                 f"({', '.join(hybrid_shapes)})")
        if args.mtp_steps < 1:
            raise ValueError(f"--mtp-steps must be >= 1, got {args.mtp_steps}")
        args.kernels = [k for k in args.kernels.split(",") if k]
        if not args.kernels or any(k not in ("jax", "pallas") for k in args.kernels):
            raise ValueError(f"--kernels takes a comma list of jax, pallas, got {','.join(args.kernels)!r}")
        if args.tau:
            try:
                args.tau = {(k if k in ("ar", "dflash", "mtp") else int(k)): float(v)
                            for k, v in (item.split("=") for item in args.tau.split(","))}
            except ValueError:
                raise ValueError(f"--tau takes KEY=VALUE pairs (KEY ar, dflash, mtp or a budget), "
                                 f"got {args.tau!r}") from None
        if args.num_prompts < 1:
            raise ValueError(f"--num-prompts must be >= 1, got {args.num_prompts}")
        if args.repeats < 1:
            raise ValueError(f"--repeats must be >= 1, got {args.repeats}")
        if args.shape is not None and args.target is not None:
            raise ValueError("give either --shape NAME or --target DIR --drafter DIR --prompts FILE")
        if args.weights == "fp8" and args.shape is None:
            raise ValueError("--weights fp8 applies to --shape runs (a checkpoint's config says whether it is FP8)")
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    if args.shape is None and args.target is None:  # the demo target; its drafter and prompts unless given
        from ddtree_jax.demo_pair import DEMO_NOTE, demo_drafter, demo_prompts, demo_target

        args.target, args.drafter, args.prompts = demo_target(), args.drafter or demo_drafter(), \
            args.prompts or demo_prompts()
        print(f"note: no --shape or --target given, so this runs the demo pair: {DEMO_NOTE}.", file=sys.stderr)
    setup_compilation_cache(args)
    try:
        parallel = parallel_from_args(args)
        if args.shape is not None:
            report = run_shape(args, parallel)
        else:
            if args.drafter is None or args.prompts is None:
                raise BadInput("--target needs --drafter DIR and --prompts FILE.jsonl")
            report = run_checkpoints(args, parallel)
    except (BadInput, CheckpointError, ConfigError, ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    report["command"] = recorded_command("python -m ddtree_jax.bench", sys.argv[1:] if argv is None else argv)
    report["xla_flags"] = os.environ.get("XLA_FLAGS") or None  # what the command line does not show
    report["date"] = time.strftime("%Y-%m-%d")
    write_lines_atomic(args.out / "bench.json", [json.dumps(report, indent=2)])
    table = markdown(report)
    write_lines_atomic(args.out / "bench.md", [table])
    plot(report, args.out / "bench.png")
    print(table)
    print(f"wrote {args.out / 'bench'}.{{json,md,png}}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
