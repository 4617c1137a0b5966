"""The shared training loop: the best held-out evaluation's parameters are returned; patience stops."""

import jax.numpy as jnp
import pytest

from ddtree_jax.train import common


def _run(tmp_path, held_out: list[float], best, patience):
    """Ten steps; the 'parameter' counts steps; evaluation k (after step k) reports held_out[k - 1]."""
    run = common.TrainRun(tmp_path / "work", title="test")

    def step_fn(state, lr):
        return {**state, "params": {"w": state["params"]["w"] + 1}}, {"loss": jnp.float32(1.0)}

    def evaluate(state):
        return {"loss": held_out[int(state["params"]["w"]) - 1]}

    state = {"params": {"w": jnp.zeros((), jnp.int32)}}
    return common.train_loop(
        run=run, state=state, start_step=0, total=len(held_out), budget_seconds=None,
        schedule_for=lambda total: common.Schedule(1e-3, 2, total), step_fn=step_fn, batch_for=lambda step: (),
        evaluate=evaluate, eval_every=1, save_every=100, log_every=1, desc="test", best=best, patience=patience), run


@pytest.mark.parametrize("direction, expect_w", [("min", 3), ("max", 6)])
def test_best_evaluation_parameters_are_returned(tmp_path, direction, expect_w):
    held_out = [5.0, 4.0, 1.0, 2.0, 3.0, 9.0, 8.0]
    (state, steps), run = _run(tmp_path, held_out, ("loss", direction), None)
    assert steps == len(held_out)
    assert int(state["params"]["w"]) == expect_w
    assert run.meta["best_step"] == expect_w
    assert run.meta["best_value"] == held_out[expect_w - 1]


def test_patience_stops_after_evaluations_without_improvement(tmp_path):
    (state, steps), run = _run(tmp_path, [5.0, 4.0, 1.0, 2.0, 3.0, 0.5, 0.1], ("loss", "min"), 2)
    assert steps == 5  # evaluations 4 and 5 did not beat step 3's; 6 and 7 never ran
    assert int(state["params"]["w"]) == 3


def test_without_best_the_last_parameters_are_returned(tmp_path):
    (state, steps), run = _run(tmp_path, [5.0, 4.0, 1.0, 2.0], None, None)
    assert int(state["params"]["w"]) == 4
    assert "best_step" not in run.meta
