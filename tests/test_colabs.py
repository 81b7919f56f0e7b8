"""The colabs/ notebooks run top to bottom, and are kept without outputs."""

import ast
import glob
import json
import os
import shutil
import subprocess
import sys
import sysconfig

import jax
import nbclient
import nbformat
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOKS = sorted(glob.glob(os.path.join(REPO, "colabs", "*.ipynb")))


def test_the_notebooks_exist():
  assert [os.path.basename(p) for p in NOTEBOOKS] == [
      "01_quickstart.ipynb", "02_c4_repro.ipynb", "03_communication.ipynb",
      "04_your_own_loop.ipynb"]


def _with_quick_parameters(notebook, runs_dir: str):
  """Inserts QUICK = True after the cell tagged 'parameters' (as papermill
  injects parameters)."""
  index = next(i for i, cell in enumerate(notebook.cells)
               if "parameters" in cell.metadata.get("tags", []))
  notebook.cells.insert(index + 1, nbformat.v4.new_code_cell(
      f"QUICK = True\nRUNS_DIR = {runs_dir!r}"))
  return notebook


# Notebook 01 runs top to bottom in the fresh-runtime test below, which
# also takes the install cell's other branch.
@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS[1:], ids=os.path.basename)
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


# --- The install cell, as a fresh Colab runtime runs it ---------------------

def _install_cell(path):
  return nbformat.read(path, as_version=4).cells[1].source


def test_the_notebooks_share_one_install_cell():
  sources = {_install_cell(path) for path in NOTEBOOKS}
  assert len(sources) == 1 and "REPO_URL" in sources.pop()


def _install_cell_functions():
  """The install cell's functions, defined without running the cell."""
  tree = ast.parse(_install_cell(NOTEBOOKS[0]))
  keep = [node for node in tree.body
          if isinstance(node, (ast.Import, ast.FunctionDef))
          or (isinstance(node, ast.Assign)
              and node.targets[0].id in ("CLONE_DIR", "JAX_MINIMUM"))]
  namespace = {}
  exec(compile(ast.Module(keep, type_ignores=[]), "cell1", "exec"), namespace)  # pylint: disable=exec-used
  return namespace


def test_the_install_keeps_a_new_enough_jax_and_upgrades_an_old_one():
  plan = _install_cell_functions()["install_plan"]
  args, what = plan("0.10.2", "jax[cuda12]")
  assert "--constraint" in args and "jax[cuda12]" not in args
  assert "keeping the runtime's jax 0.10.2" in what
  args, what = plan("0.11.2rc1", "jax[tpu]")
  assert "--constraint" in args
  # An older jax is upgraded for the runtime's accelerator, never replaced
  # by the CPU-only wheel on a GPU or TPU runtime, and the cell says so.
  args, what = plan("0.7.1", "jax[cuda12]")
  assert args[-2:] == ["--upgrade", "jax[cuda12]"]
  assert "older" in what and "jax[cuda12]" in what
  args, what = plan(None, "jax[tpu]")
  assert "jax[tpu]" in args and "no jax" in what


def test_the_install_picks_the_runtime_s_cuda_plugin(monkeypatch):
  functions = _install_cell_functions()
  installed = {"jax-cuda13-plugin": "0.11.2"}
  functions["_version"] = installed.get  # the cell's own lookup, replaced
  assert functions["_accelerator_jax"]() == "jax[cuda13]"
  installed.clear()
  monkeypatch.setattr(functions["shutil"], "which", lambda _: None)
  monkeypatch.delenv("COLAB_TPU_ADDR", raising=False)
  monkeypatch.delenv("TPU_NAME", raising=False)
  monkeypatch.setattr(functions["os"].path, "exists", lambda _: False)
  monkeypatch.setattr(functions["os"].path, "isdir", lambda _: False)
  assert functions["_accelerator_jax"]() == "jax"


def _snapshot_repo(destination):
  """A git repository holding the working tree as it is (committed or
  not): what a user's REPO_URL would clone."""
  files = subprocess.run(
      ["git", "ls-files", "-co", "--exclude-standard"], cwd=REPO, check=True,
      capture_output=True, text=True).stdout.splitlines()
  for name in files:
    if os.path.isfile(os.path.join(REPO, name)):
      os.makedirs(os.path.join(destination, os.path.dirname(name)),
                  exist_ok=True)
      shutil.copy2(os.path.join(REPO, name), os.path.join(destination, name))
  git = ["git", "-c", "user.name=test", "-c", "user.email=test@localhost"]
  for command in (["init", "-q"], ["add", "-A"], ["commit", "-q", "-m", "s"]):
    subprocess.run(git + command, cwd=destination, check=True)


def _fresh_runtime(root):
  """A venv that sees this environment's packages (jax among them) but not
  diloco_jax, and a Jupyter kernel running in it."""
  venv = root / "venv"
  subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
  purelib = subprocess.run(
      [str(venv / "bin" / "python"), "-c",
       "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
      check=True, capture_output=True, text=True).stdout.strip()
  # A path line in a .pth file adds the directory but runs none of its own
  # .pth files, so the editable install's import hook stays out.
  with open(os.path.join(purelib, "runtime_packages.pth"), "w") as f:
    f.write(sysconfig.get_paths()["purelib"] + "\n")
  kernel = root / "jupyter" / "kernels" / "fresh"
  kernel.mkdir(parents=True)
  (kernel / "kernel.json").write_text(json.dumps({
      "argv": [str(venv / "bin" / "python"), "-m", "ipykernel_launcher",
               "-f", "{connection_file}"],
      "display_name": "fresh runtime", "language": "python"}))
  return venv, purelib


@pytest.mark.slow
def test_a_fresh_runtime_clones_installs_and_runs_the_quickstart(
    tmp_path, monkeypatch):
  """Notebook 01 on a runtime with jax and no diloco_jax, from an empty
  working directory, with REPO_URL set: the cell clones, pip-installs into
  the runtime (keeping its jax), and the QUICK run trains."""
  source = tmp_path / "source"
  _snapshot_repo(source)
  venv, purelib = _fresh_runtime(tmp_path)
  monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))
  work = tmp_path / "content"  # Colab's working directory, empty
  work.mkdir()
  notebook = _with_quick_parameters(
      nbformat.read(NOTEBOOKS[0], as_version=4), str(tmp_path / "runs"))
  cell = notebook.cells[1]
  assert 'REPO_URL = ""' in cell.source
  cell.source = cell.source.replace('REPO_URL = ""',
                                    f'REPO_URL = "file://{source}"')
  nbclient.NotebookClient(notebook, timeout=600, kernel_name="fresh",
                          resources={"metadata": {"path": str(work)}}
                          ).execute()
  errors = [o for c in notebook.cells if c.cell_type == "code"
            for o in c.outputs if o.output_type == "error"]
  assert not errors, errors[0]["evalue"]
  said = "".join(o.get("text", "") for o in cell.outputs)
  assert f"keeping the runtime's jax {jax.__version__}" in said
  assert f"diloco_jax at {work / 'diloco_jax_repo'}" in said
  # Installed into the runtime itself, so a restarted kernel imports it.
  assert glob.glob(os.path.join(purelib, "__editable__*diloco_jax*"))
  restarted = subprocess.run(
      [str(venv / "bin" / "python"), "-c",
       "import diloco_jax.main, jax; print(diloco_jax.__file__, jax.__version__)"],
      cwd=tmp_path, check=True, capture_output=True, text=True).stdout
  assert restarted.startswith(str(work / "diloco_jax_repo"))
  assert restarted.split()[-1] == jax.__version__
