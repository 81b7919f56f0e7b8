"""What a newcomer installs: requirements.txt is what a run needs, pinned
with everything it pulls in; requirements-dev.txt adds the rest the suite
uses; setup.py's ranges and extras are the same split; the README's
commands and CI install them; a run on the built-in corpora imports none
of the extras, and a feature that needs one says which in one line.
"""

import importlib.metadata
import pathlib
import re
import subprocess
import sys

from packaging.requirements import Requirement
import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
# The extras' top-level modules, which a run on the built-in corpora (and
# `import diloco_jax`, the library) must not import.
OPTIONAL_MODULES = ("ray", "tensorflow_datasets", "sentencepiece",
                    "matplotlib", "pytest", "nbclient", "ipykernel", "grain")


def _name(requirement: str) -> str:
  return re.sub(r"[-_.]+", "-", Requirement(requirement).name).lower()


def _pins(path: pathlib.Path) -> dict[str, str]:
  """{normalized name: version} of a requirements file's `name==version`
  lines (its `-r` lines left out)."""
  pins = {}
  for line in path.read_text().splitlines():
    line = line.split("#", 1)[0].strip()
    if line and not line.startswith("-"):
      name, _, version = line.partition("==")
      assert version, f"{path.name}: {line} is not pinned"
      pins[_name(name)] = version
  return pins


def _setup_arguments() -> dict:
  """setup()'s keyword arguments, read by running setup.py with setup()
  replaced."""
  seen = {}
  import setuptools  # pylint: disable=g-import-not-at-top
  original = setuptools.setup
  setuptools.setup = lambda **kwargs: seen.update(kwargs)
  try:
    source = (REPO / "setup.py").read_text()
    exec(compile(source, "setup.py", "exec"), {"__name__": "setup"})  # pylint: disable=exec-used
  finally:
    setuptools.setup = original
  return seen


def _closure(requirements: list[str]) -> dict[str, str]:
  """{normalized name: installed version} of `requirements` and all they
  need, extras included, as installed here."""
  installed = {re.sub(r"[-_.]+", "-", d.metadata["Name"]).lower(): d
               for d in importlib.metadata.distributions()}
  found, done = {}, set()
  stack = [Requirement(r) for r in requirements]
  while stack:
    requirement = stack.pop()
    name = re.sub(r"[-_.]+", "-", requirement.name).lower()
    distribution = installed[name]
    found[name] = distribution.version
    for extra in ("", *sorted(requirement.extras)):
      if (name, extra) in done:
        continue
      done.add((name, extra))
      for needed in map(Requirement, distribution.requires or []):
        wanted = (needed.marker.evaluate({"extra": extra}) if needed.marker
                  else not extra)
        if wanted:
          stack.append(needed)
  return found


def test_requirements_txt_pins_what_setup_py_requires_and_no_more():
  run = _pins(REPO / "requirements.txt")
  setup = _setup_arguments()
  assert run == _closure(setup["install_requires"])


def test_requirements_dev_txt_adds_what_every_extra_requires():
  lines = [line for line in
           (REPO / "requirements-dev.txt").read_text().splitlines()
           if line.strip() and not line.startswith("#")]
  assert lines[0] == "-r requirements.txt"
  run = _pins(REPO / "requirements.txt")
  dev = _pins(REPO / "requirements-dev.txt")
  assert not set(run) & set(dev)
  setup = _setup_arguments()
  extras = [r for requirements in setup["extras_require"].values()
            for r in requirements]
  assert {**run, **dev} == _closure(setup["install_requires"] + extras)
  # The test extra is every other extra and the test tools.
  everything = {_name(r) for r in extras}
  assert {_name(r) for r in setup["extras_require"]["test"]} == everything
  # Nothing optional is a requirement of a run.
  assert not {_name(r) for r in setup["install_requires"]} & {
      _name(r) for name, requirements in setup["extras_require"].items()
      for r in requirements}


def _quickstart() -> list[str]:
  readme = (REPO / "README.md").read_text()
  section = readme.split("## Quickstart", 1)[1]
  block = re.search(r"```bash\n(.*?)```", section, flags=re.S)[1]
  return [line for line in block.splitlines()
          if line.strip() and not line.startswith("#")]


def test_the_readme_installs_the_run_set_to_run_and_everything_to_test():
  run, test = _quickstart()
  assert "pip install -r requirements.txt -e ." in run
  assert run.endswith("-m diloco_jax.main --config=configs/default.py "
                      "--workdir=runs/default")
  assert "pip install -r requirements-dev.txt -e ." in test
  assert test.endswith("-m pytest -q")
  # CI runs the README's test command, verbatim.
  ci = [line for line in (REPO / ".ci" / "run").read_text().splitlines()
        if line.strip() and not line.startswith(("#", "set ", "cd "))]
  assert ci == [test]


_BLOCKER = f"""
import importlib.abc, sys
class _Blocked(importlib.abc.MetaPathFinder):
  def find_spec(self, name, path=None, target=None):
    if name.split(".")[0] in {OPTIONAL_MODULES!r}:
      raise ModuleNotFoundError(f"No module named {{name!r}} (blocked)",
                                name=name)
    return None
sys.meta_path.insert(0, _Blocked())
import importlib.util
_find_spec = importlib.util.find_spec
def _missing(name, package=None):  # what find_spec says of a missing one
  if name.split(".")[0] in {OPTIONAL_MODULES!r}:
    return None
  return _find_spec(name, package)
importlib.util.find_spec = _missing
"""


def _without_extras(code: str, *argv: str, cwd=REPO):
  """Runs `code` in a fresh interpreter where the extras' modules cannot
  be imported, as in a venv of requirements.txt alone."""
  return subprocess.run(
      [sys.executable, "-c", _BLOCKER + code, *argv], cwd=cwd,
      capture_output=True, text=True, timeout=600, check=False)


def test_the_package_and_the_library_import_without_the_extras():
  result = _without_extras(
      "import diloco_jax\n"
      "from diloco_jax.algorithm import library\n"
      "from diloco_jax import library as top\n"
      "import diloco_jax.main, diloco_jax.launch\n"
      "from diloco_jax.data import sources, settings, prepare, "
      "train_tokenizer\n"
      "from diloco_jax.run import train\n"
      f"print(sorted(m for m in sys.modules if m.split('.')[0] in "
      f"{OPTIONAL_MODULES!r}))\n")
  assert result.returncode == 0, result.stderr[-3000:]
  assert result.stdout.strip() == "[]"


@pytest.mark.slow
def test_the_tiny_config_runs_without_the_extras(tmp_path):
  workdir = tmp_path / "run"
  result = _without_extras(
      "import runpy\n"
      "sys.argv = ['main'] + sys.argv[1:]\n"
      "runpy.run_module('diloco_jax.main', run_name='__main__')\n",
      "--config=configs/tiny.py", f"--workdir={workdir}")
  assert result.returncode == 0, result.stderr[-3000:]
  assert (workdir / "summary.json").exists()
  assert "done: final eval loss" in result.stderr


@pytest.mark.parametrize("flags, line", [
    (["--config=configs/tiny.py", "--config.data.corpus=embedded",
      "--config.data.tokenizer=sentencepiece",
      "--config.data.tokenizer_path=MODEL"],
     "error: a SentencePiece tokenizer needs the sentencepiece package, "
     "which requirements.txt leaves out: pip install -e '.[c4]' (or -r "
     "requirements-dev.txt)"),
    (["--config=configs/c4_small.py:quick", "--config.data.tfds_name=c4/en",
      "--config.data.path=DIR", "--config.data.tokenizer_path=MODEL"],
     "error: config.data.tfds_name='c4/en' needs the tensorflow-datasets "
     "package, which requirements.txt leaves out: pip install -e '.[c4]' (or "
     "-r requirements-dev.txt)"),
])
def test_a_feature_of_an_extra_names_it_in_one_line(tmp_path, flags, line):
  model = tmp_path / "spm.model"
  model.write_bytes(b"not read: the package is missing first")
  flags = [flag.replace("MODEL", str(model)).replace("DIR", str(tmp_path))
           for flag in flags]
  workdir = tmp_path / "run"
  result = _without_extras(
      "import runpy\n"
      "sys.argv = ['main'] + sys.argv[1:]\n"
      "runpy.run_module('diloco_jax.main', run_name='__main__')\n",
      f"--workdir={workdir}", *flags)
  assert result.returncode == 1, result.stderr[-3000:]
  assert result.stderr.strip() == line
  assert not workdir.exists()


def test_the_tokenizer_trainer_names_the_extra_too(tmp_path):
  (tmp_path / "c4-train.00000-of-00001.jsonl").write_text(
      '{"text": "a few words"}\n')
  (tmp_path / "c4-validation.00000-of-00001.jsonl").write_text(
      '{"text": "more words"}\n')
  result = _without_extras(
      "import runpy\n"
      "sys.argv = ['train_tokenizer'] + sys.argv[1:]\n"
      "runpy.run_module('diloco_jax.data.train_tokenizer', "
      "run_name='__main__')\n",
      f"--path={tmp_path}", "--vocab_size=300", "--megabytes=1")
  assert result.returncode == 1, result.stderr[-3000:]
  assert result.stderr.strip() == (
      "error: a SentencePiece tokenizer needs the sentencepiece package, "
      "which requirements.txt leaves out: pip install -e '.[c4]' (or -r "
      "requirements-dev.txt)")
