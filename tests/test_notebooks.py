"""The notebooks in notebooks/ run top to bottom on the real model, and are stored without outputs.

Each notebook is executed with nbclient in a fresh `python3` kernel (jupyter_client launches the
kernelspec's `python` as this interpreter, i.e. the virtual environment's), with notebooks/ as the
working directory. A cell that raises (including a failed `assert` inside a notebook) fails the test
with the cell's source and traceback. The kernel runs with JAXSMOL_NOTEBOOK_QUICK=1: notebook 02 then
plots prefixes of up to 512 tokens (not 1024), and notebook 03 runs its workloads with fewer and shorter
requests (the same checks, less time).
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

NOTEBOOK_DIR = Path(__file__).resolve().parent.parent / "notebooks"
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb"))
CELL_TIMEOUT_S = 600


def test_notebooks_exist():
    names = {p.name for p in NOTEBOOKS}
    missing = {"01_quickstart.ipynb", "02_prefix_cache.ipynb", "03_scenarios.ipynb"} - names
    assert not missing, f"missing notebooks: {sorted(missing)}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_is_stored_without_outputs(path):
    import nbformat

    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    dirty = [i for i, c in enumerate(nb.cells)
             if c.cell_type == "code" and (c.get("outputs") or c.get("execution_count") is not None)]
    assert not dirty, f"{path.name}: cells {dirty} hold outputs; clear them before saving"


@pytest.mark.real
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs(path, model_dir, monkeypatch):  # model_dir: a missing default model fails here, clearly
    import nbformat
    from nbclient import NotebookClient

    monkeypatch.setenv("JAXSMOL_NOTEBOOK_QUICK", "1")  # the kernel inherits it

    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(nb, timeout=CELL_TIMEOUT_S, kernel_name="python3",
                            resources={"metadata": {"path": str(NOTEBOOK_DIR)}})
    t0 = time.perf_counter()
    client.execute()  # raises CellExecutionError on the first failing cell
    print(f"{path.name}: {time.perf_counter() - t0:.1f} s")
