"""The notebooks in notebooks/ run top to bottom on the demo pair (CPU) and show their pictures.

Each notebook runs with nbclient in a kernel of this very interpreter (a kernelspec written to a temporary
folder put first on JUPYTER_PATH, so no installed `python3` kernel of another environment is picked up), from notebooks/, with this
process's environment: conftest's JAX_PLATFORMS=cpu carries over, and the repository root is put on
PYTHONPATH so that `ddtree_jax` imports as it does here. The committed notebooks carry no outputs.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK_DIR = ROOT / "notebooks"
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb"))
CELL_TIMEOUT_S = 300
KERNEL_NAME = "ddtree-jax-test"


def test_notebooks_exist():
    assert {p.name for p in NOTEBOOKS} >= {"quickstart.ipynb", "tree_anatomy.ipynb"}


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_committed_without_outputs(path):
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    dirty = [i for i, cell in enumerate(nb.cells)
             if cell.cell_type == "code" and (cell.outputs or cell.execution_count is not None)]
    assert not dirty, f"{path.name}: code cells {dirty} carry outputs; clear them before committing"


@pytest.fixture
def kernel_name(tmp_path, monkeypatch) -> str:
    """The name of a kernelspec that starts an IPython kernel with this interpreter, found first on JUPYTER_PATH."""
    spec = tmp_path / "jupyter" / "kernels" / KERNEL_NAME
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": f"Python ({sys.executable})",
        "language": "python",
    }))
    monkeypatch.setenv("JUPYTER_PATH", os.pathsep.join([str(tmp_path / "jupyter")] + [
        p for p in os.environ.get("JUPYTER_PATH", "").split(os.pathsep) if p]))
    return KERNEL_NAME


def _kernel_env() -> dict[str, str]:
    env = dict(os.environ)  # JAX_PLATFORMS=cpu and the matmul precision come from conftest
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env["PYDEVD_DISABLE_FILE_VALIDATION"] = "1"  # debugpy's frozen-modules warning on kernel start
    # The notebooks' smaller workload for tests (every cell still runs; unset, as for a user, the full one):
    # quickstart.ipynb decodes 24 new tokens instead of 64; tree_anatomy.ipynb 24 instead of 48, and sweeps three
    # budgets instead of five.
    env["DDTREE_JAX_NOTEBOOK_QUICK"] = "1"
    return env


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs_and_shows_pictures(path, kernel_name):
    nb = nbformat.read(path, as_version=4)
    nb.cells.append(nbformat.v4.new_code_cell("import sys; print(sys.executable, end='')"))  # which kernel ran
    # The client owns its kernel and shuts it down when the notebook ends (or fails).
    client = NotebookClient(nb, kernel_name=kernel_name, timeout=CELL_TIMEOUT_S, startup_timeout=120,
                            resources={"metadata": {"path": str(NOTEBOOK_DIR)}})
    start = time.perf_counter()
    client.execute(env=_kernel_env())  # a failing cell raises CellExecutionError with its traceback
    seconds = time.perf_counter() - start
    images = [i for i, cell in enumerate(nb.cells) if cell.cell_type == "code"
              for out in cell.outputs if "image/png" in out.get("data", {})]
    assert images, f"{path.name}: no cell produced a picture (image/png)"
    assert nb.cells[-1].outputs[0]["text"] == sys.executable, "the notebook ran in another interpreter"
    print(f"{path.name}: {seconds:.1f} s, pictures in cells {sorted(set(images))}")
