"""The architecture's boundaries, checked: one definition of a round (the benchmark and the tools run the
round's own stage functions), kernels that import nothing from the application, and no module reaching
into another's private names."""

from __future__ import annotations

import ast
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("ddtree_jax", "pallas_kernels", "conversions", "tools")


def _imports(path: Path):
    """(module, names) of every import in a file; `import a.b` gives ("a.b", [])."""
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            yield node.module, [a.name for a in node.names]
        elif isinstance(node, ast.Import):
            for a in node.names:
                yield a.name, []


def _sources(*packages: str):
    for package in packages:
        yield from sorted((ROOT / package).rglob("*.py"))


def test_kernels_import_nothing_from_the_application():
    offenders = [(p.relative_to(ROOT), m) for p in _sources("pallas_kernels") for m, _ in _imports(p)
                 if m.split(".")[0] == "ddtree_jax"]
    assert offenders == []


def test_no_module_imports_another_modules_private_names():
    """`from project.module import _name` (or `import project._module` from outside its package)."""
    offenders = []
    for path in _sources(*PACKAGES):
        own_package = path.relative_to(ROOT).parts[0]
        for module, names in _imports(path):
            top = module.split(".")[0]
            if top not in PACKAGES[:3]:
                continue
            private = [n for n in names if n.startswith("_") and not n.startswith("__")]
            private_module = any(part.startswith("_") and not part.startswith("__") for part in module.split("."))
            if private or (private_module and top != own_package):
                offenders.append((str(path.relative_to(ROOT)), module, private))
    assert offenders == []


def test_the_negative_control_lives_in_the_tests():
    assert "FOR_TESTS" not in (ROOT / "ddtree_jax" / "models" / "qwen3_5.py").read_text()


@pytest.mark.parametrize("kernels,fused", [("jax", False), ("pallas", True)])
def test_benchmark_stages_are_the_rounds_own(tiny_abstract_pair, kernels, fused):
    """`measure.workload.stage_programs` (what `bench` and `tools/compile_times.py` compile and time) hands
    out the very functions `round.speculative_round` calls, with the arguments the round passes; for a
    greedy Pallas row the accept stage is the fused kernel (a `pallas_call` in its program), as in `generate`."""
    from ddtree_jax import round as rnd
    from ddtree_jax.measure import workload

    target, drafter = tiny_abstract_pair
    options = rnd.DecodeOptions(mode=rnd.Mode.DDTREE, max_new_tokens=32, block_size=4, budget=6, kernels=kernels)
    state = jax.eval_shape(lambda: workload.empty_state(target.config, drafter.config, 16, options, 2,
                                                        dtype=jnp.float32))
    seen = []

    def evaluate(name, fn, args, static):
        seen.append(name)
        return jax.eval_shape(lambda *a: fn(*a, **static), *args)

    programs = workload.stage_programs(target, drafter, state, options, evaluate)
    assert seen == list(programs) == list(rnd.STAGES) == ["draft", "tree", "verify", "accept", "commit"]
    for name, (fn, _, static) in programs.items():
        assert fn is rnd.STAGES[name] and static["options"] is options
    fn, args, static = programs["accept"]
    jaxpr = str(jax.make_jaxpr(lambda *a: fn(*a, **static))(*args))
    assert ("pallas_call" in jaxpr) == fused


def test_no_test_folder_shadows_a_package():
    """pytest puts tests/ on sys.path; a folder there named like a top-level package (no __init__.py) would be
    imported as an empty namespace package in its place wherever the project is installed in editable mode, as
    CI installs it (tests/pallas_kernels did that to `pallas_kernels`)."""
    folders = {p.name for p in (ROOT / "tests").iterdir() if p.is_dir() and not p.name.startswith((".", "_"))}
    assert folders & set(PACKAGES) == set()
