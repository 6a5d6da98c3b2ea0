"""Every notebook in notebooks/ runs top to bottom at its tiny CPU size, as CI runs it."""
import pathlib

import nbclient
import nbformat
import pytest

from experiments.job import TEST_XLA

REPO = pathlib.Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((REPO / "notebooks").glob("*.ipynb"))


def test_there_are_notebooks():
  assert {p.stem for p in NOTEBOOKS} >= {"collective_matmul", "flash_attention", "lamb"}


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_executes(path, monkeypatch):
  # The kernel is a fresh process: it finds the repository through PYTHONPATH and starts
  # with no device count of ours (each notebook sets up its own CPU devices), only the
  # compile-time flags every test compiles with (conftest.py: results equal up to float
  # rounding; the notebooks assert nothing on digits) and this process's compilation cache.
  monkeypatch.setenv("PYTHONPATH", str(REPO))
  monkeypatch.setenv("JAX_PLATFORMS", "cpu")
  monkeypatch.setenv("XLA_FLAGS", TEST_XLA)
  notebook = nbformat.read(path, as_version=4)
  client = nbclient.NotebookClient(notebook, timeout=600, kernel_name="python3",
                                    resources={"metadata": {"path": str(path.parent)}})
  client.execute()
  errors = [out for cell in notebook.cells if cell.cell_type == "code"
            for out in cell.get("outputs", []) if out.get("output_type") == "error"]
  assert not errors
