"""What the target and drafter trainers share.

- Parameters as a nested dict of arrays keyed by the parts of their HF names (`{"model": {"layers":
  {"0": ...}}}`): a plain pytree that optax and orbax both handle, turned back into `ModelParams` with
  `to_params` inside the jitted step.
- The optimizer: optax AdamW (weight decay on matrices only) after global-norm clipping, with the
  learning rate injected as a hyperparameter so the host sets it every step from `Schedule`.
- `Schedule`: linear warm-up then cosine decay to `min_ratio * peak` (optax's warmup_cosine_decay
  formula, evaluated on the host). A run given a time budget fixes its total step count after measuring
  the speed of the first warm-up steps (`fix_total_from_budget`), before any cosine step is taken.
- `TrainRun`: the work folder of one run: run.json (settings and the fixed total), orbax checkpoints of
  the whole training state (resumed when present), log.json and loss.png.
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
import time
from pathlib import Path
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from ddtree_jax.checkpoint import flatten, nest  # noqa: F401  (re-exported for the trainers)
from ddtree_jax.models.params import ModelParams

# ----------------------------------------------------------------------------------------------------
# Parameters as nested dicts


def param_tree(params: ModelParams, dtype=jnp.float32) -> dict:
    """ModelParams -> nested dict of arrays in `dtype` (the trainable master copy)."""
    return nest({name: jnp.asarray(a, dtype) for name, a in params.flat().items()})


def to_params(skeleton: ModelParams, tree: dict, dtype=None) -> ModelParams:
    """Nested dict -> ModelParams with `skeleton`'s graph and config (an abstract skeleton is enough);
    arrays cast to `dtype` (the compute dtype) when given. Differentiable, so usable inside a loss."""
    flat = flatten(tree)
    if dtype is not None:
        flat = {n: a.astype(dtype) for n, a in flat.items()}
    return skeleton.replace_flat(flat)


def count_params(tree) -> int:
    return int(sum(np.prod(a.shape) for a in jax.tree.leaves(tree)))


def check_out_folder(out: str | Path) -> Path:
    """The export replaces `out` at the end: refuse a folder that holds something other than a checkpoint."""
    out = Path(out)
    if out.exists() and (not out.is_dir() or (any(out.iterdir()) and not (out / "config.json").exists())):
        raise ValueError(f"{out}: exists and is not a checkpoint folder (no config.json); the export would replace it")
    return out


def compute_dtype(name: str):
    """'auto' (bfloat16 on a GPU, float32 elsewhere) | 'bfloat16' | 'float32' -> a jnp dtype."""
    if name == "auto":
        return jnp.bfloat16 if jax.default_backend() == "gpu" else jnp.float32
    table = {"bfloat16": jnp.bfloat16, "bf16": jnp.bfloat16, "float32": jnp.float32, "fp32": jnp.float32}
    if name not in table:
        raise ValueError(f"dtype {name!r} is not supported (expected auto, bfloat16 or float32)")
    return table[name]


# ----------------------------------------------------------------------------------------------------
# Optimizer and schedule


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    lr: float
    warmup: int  # steps of linear warm-up
    min_ratio: float = 0.1  # final lr = min_ratio * lr
    weight_decay: float = 0.1
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    clip: float = 1.0  # global gradient norm


def make_optimizer(opt: OptimConfig, params_tree) -> optax.GradientTransformation:
    """clip_by_global_norm -> AdamW (decay on arrays of rank >= 2), learning rate injected (set per step
    with `set_lr`)."""
    decay_mask = jax.tree.map(lambda a: a.ndim >= 2, params_tree)

    def build(learning_rate):
        return optax.chain(
            optax.clip_by_global_norm(opt.clip),
            optax.adamw(learning_rate, b1=opt.b1, b2=opt.b2, eps=opt.eps, weight_decay=opt.weight_decay,
                        mask=decay_mask),
        )

    return optax.inject_hyperparams(build)(learning_rate=0.0)


def set_lr(opt_state, lr):
    """The optimizer state with its injected learning rate set to `lr` (inside or outside jit)."""
    hyper = dict(opt_state.hyperparams)
    hyper["learning_rate"] = jnp.asarray(lr, jnp.float32)
    return opt_state._replace(hyperparams=hyper)


@dataclasses.dataclass(frozen=True)
class Schedule:
    """Linear warm-up over `warmup` steps to `peak`, then cosine to `min_ratio * peak` at `total`."""

    peak: float
    warmup: int
    total: int
    min_ratio: float = 0.1

    def __call__(self, step: int) -> float:
        if step < self.warmup:
            return self.peak * (step + 1) / self.warmup
        span = max(1, self.total - self.warmup)
        progress = min(1.0, (step - self.warmup) / span)
        return self.peak * (self.min_ratio + (1 - self.min_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def apply_step(params_tree, opt_state, grads, optimizer: optax.GradientTransformation, lr):
    """One AdamW update; returns (params, opt_state, grad_norm before clipping)."""
    opt_state = set_lr(opt_state, lr)
    updates, opt_state = optimizer.update(grads, opt_state, params_tree)
    return optax.apply_updates(params_tree, updates), opt_state, global_norm(grads)


def global_norm(tree) -> jax.Array:
    return jnp.sqrt(sum(jnp.sum(jnp.square(g.astype(jnp.float32))) for g in jax.tree.leaves(tree)))


# ----------------------------------------------------------------------------------------------------
# The work folder of one run


class TrainRun:
    """A run's work folder: run.json, checkpoints/ (orbax), log.json and loss.png.

    `state` is any pytree of arrays (params, optimizer state, step). `resume` restores the newest
    checkpoint if there is one; `history` entries past the restored step are dropped, so a resumed run
    logs as if it had never stopped.
    """

    def __init__(self, work: str | Path, *, title: str, keep: int = 2):
        import orbax.checkpoint as ocp

        self.work = Path(work)
        self.work.mkdir(parents=True, exist_ok=True)
        self.title = title
        self.manager = ocp.CheckpointManager(
            (self.work / "checkpoints").absolute(),
            options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True, enable_async_checkpointing=False))
        self.meta: dict = {}
        self.history: list[dict] = []
        self.evals: list[dict] = []
        if (self.work / "log.json").exists():
            log = json.loads((self.work / "log.json").read_text())
            self.history, self.evals = log.get("history", []), log.get("eval", [])
        if (self.work / "run.json").exists():
            self.meta = json.loads((self.work / "run.json").read_text())

    # settings
    def save_meta(self, **meta) -> None:
        self.meta.update(meta)
        (self.work / "run.json").write_text(json.dumps(self.meta, indent=2, default=str) + "\n")

    # checkpoints
    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def resume(self, state):
        """(state, step): the newest checkpoint restored into `state`'s structure, or (state, 0)."""
        import orbax.checkpoint as ocp

        step = self.latest_step()
        if step is None:  # nothing saved: a log left by a run that stopped before its first checkpoint is stale
            self.history, self.evals = [], []
            return state, 0
        abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), state)
        restored = self.manager.restore(step, args=ocp.args.StandardRestore(abstract))
        self.history = [h for h in self.history if h["step"] <= step]
        self.evals = [e for e in self.evals if e["step"] <= step]
        return restored, step

    def save(self, step: int, state) -> None:
        import orbax.checkpoint as ocp

        if self.latest_step() == step:
            return
        self.manager.save(step, args=ocp.args.StandardSave(state), force=True)
        self.manager.wait_until_finished()

    # log
    def log(self, record: dict) -> None:
        self.history.append(record)

    def log_eval(self, record: dict) -> None:
        self.evals.append(record)

    def write_log(self, **extra) -> None:
        log = {"title": self.title, "meta": self.meta, "history": self.history, "eval": self.evals, **extra}
        (self.work / "log.json").write_text(json.dumps(log, indent=1, default=_json_default) + "\n")
        self.plot()
        self.plot_acceptance()

    def plot(self) -> Path | None:
        """loss.png: training loss (and eval loss) against step."""
        if not self.history:
            return None
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
        steps = [h["step"] for h in self.history]
        ax.plot(steps, [h["loss"] for h in self.history], lw=1, label="train")
        if self.evals:
            ax.plot([e["step"] for e in self.evals], [e["loss"] for e in self.evals], "o-", ms=3, label="held out")
        if all(h["loss"] > 0 for h in self.history):  # the first steps' loss would flatten the rest on a linear axis
            ax.set_yscale("log")
        ax.set_xlabel("step")
        ax.set_ylabel(self.meta.get("loss_name", "loss"))
        ax.set_title(self.title)
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        path = self.work / "loss.png"
        fig.savefig(path)
        plt.close(fig)
        return path

    def plot_acceptance(self) -> Path | None:
        """acceptance.png: the held-out acceptance rate per draft position at each evaluation that decoded
        prompts (records with `position_acceptance`), later evaluations darker, the selected one bold."""
        evals = [e for e in self.evals if e.get("position_acceptance")]
        if not evals:
            return None
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
        colors = plt.get_cmap("viridis_r")(np.linspace(0.15, 1.0, len(evals)))
        chosen = self.meta.get("best_step", evals[-1]["step"])
        for e, color in zip(evals, colors):
            rates = e["position_acceptance"]
            bold = e["step"] == chosen
            label = (f"step {e['step']}" + (f", tau {e['tau']:.2f}" if "tau" in e else "")
                     + (" (selected)" if bold else ""))
            ax.plot(range(len(rates)), rates, "o-" if bold else "-", color=color, lw=2.5 if bold else 1, ms=4,
                    label=label if bold or len(evals) <= 8 or e is evals[-1] else None)
        ax.set_xlabel("draft position (0: the first draft after the bonus token)")
        ax.set_ylabel("rounds accepting it")
        ax.set_ylim(0, 1)
        ax.set_title(f"{self.title}: held-out acceptance per draft position")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = self.work / "acceptance.png"
        fig.savefig(path)
        plt.close(fig)
        return path


def _json_default(x):
    if isinstance(x, (np.generic, jax.Array)):
        return np.asarray(x).tolist()
    return str(x)


# ----------------------------------------------------------------------------------------------------
# Progress


class Progress:
    """A tqdm bar on a terminal; plain `desc step N/T key value ...` lines otherwise (scripts, logs)."""

    def __init__(self, total: int, initial: int, desc: str):
        from tqdm import tqdm

        self.desc, self.total = desc, total
        self.bar = (tqdm(total=total, initial=initial, desc=desc, unit="step", dynamic_ncols=True)
                    if sys.stderr.isatty() else None)

    def set_total(self, total: int) -> None:
        self.total = total
        if self.bar is not None:
            self.bar.total = total
            self.bar.refresh()

    def tick(self) -> None:
        if self.bar is not None:
            self.bar.update(1)

    def show(self, step: int, info: dict[str, float]) -> None:
        if self.bar is not None:
            self.bar.set_postfix({k: f"{v:.4g}" for k, v in info.items()})
        else:
            self.write(f"{self.desc} step {step}/{self.total} " + " ".join(f"{k} {v:.4g}" for k, v in info.items()))

    def write(self, text: str) -> None:
        if self.bar is not None:
            self.bar.write(text, file=sys.stderr)
        else:
            print(text, file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def fix_total_from_budget(step_seconds: float, steps_done: int, elapsed: float, budget_seconds: float,
                          min_total: int) -> int:
    """Total steps for a time budget: those done plus what the rest of the budget allows at the measured
    speed, at least `min_total` (the warm-up)."""
    remaining = max(0.0, budget_seconds - elapsed)
    return max(min_total, steps_done + int(remaining / max(step_seconds, 1e-6)))


class Timer:
    def __init__(self):
        self.start = time.perf_counter()

    def __call__(self) -> float:
        return time.perf_counter() - self.start


def train_loop(*, run: TrainRun, state, start_step: int, total: int | None, budget_seconds: float | None,
               schedule_for: Callable[[int], Schedule], step_fn: Callable, batch_for: Callable[[int], tuple],
               evaluate: Callable[[Any], dict] | None, eval_every: int, save_every: int, log_every: int,
               desc: str, calibrate_steps: int = 10, best: tuple[str, str] | None = None,
               patience: int | None = None):
    """The loop both trainers run.

    `step_fn(state, *batch, lr) -> (state, metrics)` is jitted, metrics a dict of scalars holding at
    least "loss"; `batch_for(step)` builds the inputs of one step (deterministic in the step, so a
    resumed run sees the same batches); `schedule_for(total)` gives the schedule once the total is
    known (its warm-up must not depend on the total). With `budget_seconds` and no fixed total, the
    total is fixed after `calibrate_steps` timed steps (compilation excluded) and saved in run.json, so
    a resumed run keeps it; a given `total` wins (so a finished run can be extended). Metrics are read
    back (a device sync) only every `log_every` steps.
    `best = (metric, "min" | "max")`: the returned state carries the parameters of the evaluation that
    was best on that held-out metric (small corpora overfit: the last step is not the best model), and
    `patience` stops the run after that many evaluations without improvement. The choice is saved in
    run.json (best_step, best_value).
    Returns (state, steps done).
    """
    if total is None:  # a time budget: a resumed run keeps the total its first run fixed
        total = run.meta.get("total_steps")
    warmup = schedule_for(1 << 30).warmup
    if total is None:
        if budget_seconds is None:
            raise ValueError("give a step count or a time budget")
        if warmup <= calibrate_steps + 1:
            raise ValueError(f"a time budget needs a warm-up longer than {calibrate_steps + 1} steps "
                             f"(the total is fixed while warming up), got {warmup}")
    else:
        run.save_meta(total_steps=total)
    progress = Progress(total or warmup, start_step, desc)
    schedule = schedule_for(total if total is not None else 1 << 30)
    step, clock, timed_from = start_step, None, None
    pending: list[tuple[int, float, dict]] = []
    best_record: dict = {}  # step, value, params of the best evaluation so far
    since_best = 0

    def flush():
        info = {}
        for s, lr, metrics in pending:
            info = {k: float(v) for k, v in metrics.items()}
            run.log({"step": s, "lr": lr, **info, "seconds": round(clock(), 2) if clock else 0.0})
        if pending:
            progress.show(pending[-1][0], {"loss": info["loss"], "lr": pending[-1][1]})
        pending.clear()

    try:
        while total is None or step < total:
            lr = schedule(step)
            state, metrics = step_fn(state, *batch_for(step), jnp.asarray(lr, jnp.float32))
            step += 1
            progress.tick()
            pending.append((step, lr, metrics))
            if clock is None:  # the first step compiled: time from here
                jax.block_until_ready(metrics)
                clock, timed_from = Timer(), step
            elif total is None and step - timed_from == calibrate_steps:
                jax.block_until_ready(metrics)
                per_step = clock() / calibrate_steps
                total = fix_total_from_budget(per_step, step, clock(), budget_seconds, warmup + 1)
                schedule = schedule_for(total)
                run.save_meta(total_steps=total, measured_step_seconds=per_step)
                progress.set_total(total)
                progress.write(f"{desc}: {per_step * 1e3:.1f} ms/step, so the {budget_seconds:.0f} s budget "
                               f"gives {total} steps")
            last = step == total
            if step % log_every == 0 or last:
                flush()
            if evaluate is not None and (step % eval_every == 0 or last):
                record = {"step": step}
                for k, v in evaluate(state).items():
                    record[k] = float(v) if np.ndim(v) == 0 else np.asarray(v).tolist()
                run.log_eval(record)
                progress.write(f"{desc} held-out @ {step}: " + " ".join(
                    f"{k} {v:.4g}" if isinstance(v, float) else f"{k} [{' '.join(f'{x:.2f}' for x in v)}]"
                    for k, v in record.items() if k != "step"))
                if best is not None:
                    value = record[best[0]]
                    better = not best_record or (value < best_record["value"] if best[1] == "min"
                                                 else value > best_record["value"])
                    if better:
                        best_record = {"step": step, "value": value,
                                       "params": jax.tree.map(jnp.copy, state["params"])}
                        since_best = 0
                    else:
                        since_best += 1
            stop = patience is not None and since_best >= patience
            if step % save_every == 0 or last or stop:
                run.save(step, state)
                run.write_log()
            if stop:
                progress.write(f"{desc}: stopping at step {step}: held-out {best[0]} has not improved on step "
                               f"{best_record['step']}'s {best_record['value']:.4g} for {patience} evaluations")
                break
    finally:
        flush()
        progress.close()
    run.write_log()
    if best_record:
        run.save_meta(best_step=best_record["step"], best_value=best_record["value"])
        if best_record["step"] != step:
            print(f"{desc}: keeping step {best_record['step']}'s parameters (held-out {best[0]} "
                  f"{best_record['value']:.4g})", file=sys.stderr)
        state = {**state, "params": best_record["params"]}
    return state, step
