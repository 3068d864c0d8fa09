"""The notebooks run top to bottom on CPU (they hold their own checks: the quickstart
asserts its run is bitwise equal to eager). Stored without outputs."""

from __future__ import annotations

import os

import pytest

from tests.utils import REPO

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

pytestmark = pytest.mark.slow

FOLDER = os.path.join(REPO, "notebooks")
NOTEBOOKS = sorted(f for f in os.listdir(FOLDER) if f.endswith(".ipynb"))


def test_the_notebooks_are_found():
    assert {"quickstart.ipynb", "heuristics.ipynb"} <= set(NOTEBOOKS)


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_runs(name, monkeypatch):
    # The kernel is another process: it gets conftest's one intra-op thread through the
    # environment (OpenMP threads spinning against each other on a small shared machine
    # made runs many times slower), and the inline backend that draws the figures.
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("MKL_NUM_THREADS", "1")
    monkeypatch.delenv("MPLBACKEND", raising=False)
    nb = nbformat.read(os.path.join(FOLDER, name), as_version=4)
    assert all(not c.get("outputs") for c in nb.cells if c.cell_type == "code"), (
        f"{name} is stored with outputs; clear them before committing"
    )
    client = nbclient.NotebookClient(
        nb,
        timeout=300,
        startup_timeout=300,
        kernel_name="python3",
        resources={"metadata": {"path": FOLDER}},
    )
    client.execute()  # raises CellExecutionError with the failing cell's traceback
    figures = [
        o
        for c in nb.cells
        if c.cell_type == "code"
        for o in c.outputs
        if "image/png" in o.get("data", {})
    ]
    assert figures, f"{name} drew no figure"
