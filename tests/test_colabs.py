"""The colabs/ notebooks run top to bottom, and are kept without outputs."""

import glob
import os

import nbclient
import nbformat
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOKS = sorted(glob.glob(os.path.join(REPO, "colabs", "*.ipynb")))


def test_the_three_notebooks_exist():
  assert [os.path.basename(p) for p in NOTEBOOKS] == [
      "01_quickstart.ipynb", "02_c4_repro.ipynb", "03_communication.ipynb"]


def _with_quick_parameters(notebook, runs_dir: str):
  """Inserts QUICK = True after the cell tagged 'parameters' (as papermill
  injects parameters)."""
  index = next(i for i, cell in enumerate(notebook.cells)
               if "parameters" in cell.metadata.get("tags", []))
  notebook.cells.insert(index + 1, nbformat.v4.new_code_cell(
      f"QUICK = True\nRUNS_DIR = {runs_dir!r}"))
  return notebook


@pytest.mark.parametrize("path", NOTEBOOKS, ids=os.path.basename)
def test_a_notebook_runs_top_to_bottom(path, tmp_path):
  notebook = _with_quick_parameters(nbformat.read(path, as_version=4),
                                    str(tmp_path / "runs"))
  nbclient.NotebookClient(
      notebook, timeout=600, kernel_name="python3",
      resources={"metadata": {"path": os.path.dirname(path)}}).execute()
  outputs = [output for cell in notebook.cells if cell.cell_type == "code"
             for output in cell.outputs]
  assert not [o for o in outputs if o.output_type == "error"]
  # Every notebook ends with a plot.
  assert any("image/png" in o.get("data", {}) for o in outputs)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=os.path.basename)
def test_a_notebook_is_committed_without_outputs(path):
  notebook = nbformat.read(path, as_version=4)
  nbformat.validate(notebook)
  for cell in notebook.cells:
    if cell.cell_type == "code":
      assert cell.outputs == [] and cell.execution_count is None
