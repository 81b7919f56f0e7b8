"""The package's layers: imports point downward only.

Reads every module's import statements (those inside functions too) and
checks each against the layer order diloco_jax/__init__.py states, so an
import that climbs back up fails here rather than growing a cycle.
"""

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "diloco_jax"

# Lower layers first. A module may import its own subpackage and any layer
# of a lower rank; subpackages of one rank are independent of each other.
RANKS = {
    "codecs": 0, "data": 0, "model": 0,
    "parallel": 1,
    "algorithm": 2,
    "config": 3,
    "analysis": 4,
    "run": 5,
    "elastic": 6,
}
ENTRY_POINTS = {"__init__", "main", "launch"}  # above every layer


def _modules():
  return sorted(PACKAGE.rglob("*.py"))


def _layer(path: pathlib.Path) -> str:
  """The subpackage a module lives in, or its name for a top-level one."""
  parts = path.relative_to(PACKAGE).with_suffix("").parts
  return parts[0]


def _imported_layers(path: pathlib.Path) -> list[tuple[int, str]]:
  """(line, layer) of every diloco_jax module `path` imports."""
  found = []
  for node in ast.walk(ast.parse(path.read_text(), str(path))):
    if isinstance(node, ast.ImportFrom) and node.level:
      raise AssertionError(f"{path}:{node.lineno}: relative import")
    names = []
    if isinstance(node, ast.ImportFrom) and node.module:
      names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
    elif isinstance(node, ast.Import):
      names = [a.name for a in node.names]
    for name in names:
      parts = name.split(".")
      if parts[0] == "diloco_jax" and len(parts) > 1:
        found.append((node.lineno, parts[1]))
  return found


def test_every_import_points_down_the_layers():
  climbs = []
  for path in _modules():
    layer = _layer(path)
    if layer in ENTRY_POINTS:
      continue
    assert layer in RANKS, f"{path}: a module outside the layers"
    for line, imported in _imported_layers(path):
      if imported == layer or imported not in RANKS:
        # Its own layer; or a name imported from the package itself,
        # which the walk also sees as `from diloco_jax import name`.
        continue
      if RANKS[imported] >= RANKS[layer]:
        climbs.append(f"{path.relative_to(PACKAGE.parent)}:{line}: "
                      f"{layer}/ imports {imported}/")
  assert not climbs, "imports that climb the layers:\n" + "\n".join(climbs)


def test_the_package_holds_only_layers_and_entry_points():
  loose = {p.stem for p in PACKAGE.glob("*.py")} - ENTRY_POINTS
  assert not loose, f"modules beside the layers: {sorted(loose)}"
  assert {p.name for p in PACKAGE.iterdir() if p.is_dir()
          and (p / "__init__.py").exists()} == set(RANKS)


@pytest.mark.parametrize("layer", sorted(RANKS))
def test_each_layer_says_what_it_owns_and_may_import(layer):
  docstring = ast.get_docstring(ast.parse(
      (PACKAGE / layer / "__init__.py").read_text()))
  assert docstring and "import" in docstring, layer


def test_the_check_sees_a_climbing_import(tmp_path):
  """The walk finds imports inside functions, under any alias."""
  module = tmp_path / "m.py"
  module.write_text("def f():\n  from diloco_jax.run import train as t\n")
  assert _imported_layers(module) == [(2, "run"), (2, "run")]


def test_the_old_names_users_import_still_work_with_a_warning():
  """Config files import config_schema and scripts call
  train.train_and_evaluate by their names before the layers."""
  import diloco_jax  # pylint: disable=g-import-not-at-top
  from diloco_jax.config import schema  # pylint: disable=g-import-not-at-top
  from diloco_jax.run import train  # pylint: disable=g-import-not-at-top
  for name, module in (("config_schema", schema), ("train", train)):
    diloco_jax.__dict__.pop(name, None)
    with pytest.warns(DeprecationWarning, match=module.__name__):
      assert getattr(diloco_jax, name) is module
  with pytest.raises(AttributeError):
    diloco_jax.diloco  # pylint: disable=pointless-statement


def _config_reads(path: pathlib.Path) -> list[str]:
  """Where the module at `path` could read a config: an import of
  ml_collections, or a function taking a parameter named `config` or
  `*_config` (a config section passed down)."""
  found = []
  for node in ast.walk(ast.parse(path.read_text(), str(path))):
    if isinstance(node, ast.Import):
      names = [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom):
      names = [node.module or ""]
    else:
      names = []
    found += [f"{path.name}:{node.lineno}: imports {name}" for name in names
              if name.split(".")[0] == "ml_collections"]
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
      args = node.args
      for arg in (*args.posonlyargs, *args.args, *args.kwonlyargs):
        if arg.arg == "config" or arg.arg.endswith("_config"):
          found.append(f"{path.name}:{node.lineno}: takes {arg.arg}")
  return found


def test_the_algorithm_layer_reads_no_config():
  """algorithm/ takes typed settings (dataclasses, scalars); config/
  builds them from a run's config (run_config.py), as docs/architecture.md
  says."""
  reads = [read for path in sorted((PACKAGE / "algorithm").glob("*.py"))
           for read in _config_reads(path)]
  assert not reads, "config reads in algorithm/:\n" + "\n".join(reads)


def test_the_config_check_sees_an_import_and_a_section(tmp_path):
  module = tmp_path / "m.py"
  module.write_text("import ml_collections\n"
                    "def f(inner_config, *, config=None):\n  pass\n")
  assert _config_reads(module) == ["m.py:1: imports ml_collections",
                                   "m.py:2: takes inner_config",
                                   "m.py:2: takes config"]
