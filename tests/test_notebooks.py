"""Every notebook in notebooks/ runs top to bottom at its tiny CPU size, as CI runs it."""
import pathlib

import nbclient
import nbformat
import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((REPO / "notebooks").glob("*.ipynb"))


def test_there_are_notebooks():
  assert {p.stem for p in NOTEBOOKS} >= {"collective_matmul", "flash_attention", "lamb"}


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_executes(path, monkeypatch):
  # The kernel is a fresh process: it finds the repository through PYTHONPATH and starts
  # with no XLA flags of ours (each notebook sets up its own CPU devices).
  monkeypatch.setenv("PYTHONPATH", str(REPO))
  monkeypatch.setenv("JAX_PLATFORMS", "cpu")
  monkeypatch.delenv("XLA_FLAGS", raising=False)
  notebook = nbformat.read(path, as_version=4)
  client = nbclient.NotebookClient(notebook, timeout=600, kernel_name="python3",
                                    resources={"metadata": {"path": str(path.parent)}})
  client.execute()
  errors = [out for cell in notebook.cells if cell.cell_type == "code"
            for out in cell.get("outputs", []) if out.get("output_type") == "error"]
  assert not errors
