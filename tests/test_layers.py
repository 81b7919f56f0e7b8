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
    "storage": 5,
    "compiled": 6, "telemetry": 6,
    "run": 7,
    "elastic": 8,
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


# The layers above config/ read config.diloco as RunConfig.diloco
# (DiLoCoSettings, built once by config/run_config.py), not field by field
# from a config. What stands before `.diloco` tells them apart: a RunConfig
# under the name `run_config` (or an attribute `run_config`/`_run_config`)
# is typed; any other `<something>.diloco.<field>` read (`config.diloco.X`,
# `self._config.diloco.X`, `run_config.config.diloco.X`) is the raw field,
# and a bare `<something>.diloco` hands the raw section on (an alias, or a
# helper reading it).
TYPED_DILOCO_HOLDERS = {"run_config", "_run_config"}
DILOCO_READERS = ("storage", "compiled", "telemetry", "run", "elastic")
WHOLE_SECTION = "(whole section)"

# The raw reads that stay: (module under diloco_jax/, field) -> why.
# Writes are not reads: warm_start.py builds its pretraining config by
# setting pretrain.diloco.* (no entry needed).
RAW_DILOCO_READS = {
    # outer_placement='host' splits the devices before validation, which
    # counts the devices left to the islands: no RunConfig exists yet.
    ("run/train.py", "get"): "pre-validation device split",
    # The device count validate_config checks an elastic run with (one
    # island's devices x the islands): no RunConfig exists yet.
    ("elastic/__main__.py", "islands"): "pre-validation device count",
}


def _raw_diloco_reads(path: pathlib.Path) -> list[tuple[int, str]]:
  """(line, field) of every read of `<something>.diloco` in the module at
  `path` whose <something> is not a RunConfig (TYPED_DILOCO_HOLDERS): the
  field read from it (`.X`, `[...]` as '[]'), or WHOLE_SECTION where the
  section itself is read. Writes (`config.diloco.X = ...`) and calls (a
  function named diloco) are left out."""
  tree = ast.parse(path.read_text(), str(path))
  fields = {}  # id of a `.diloco` node -> what is read from it, or None
  for node in ast.walk(tree):
    if isinstance(node, (ast.Attribute, ast.Subscript)):
      inner, loads = node.value, isinstance(node.ctx, ast.Load)
      field = node.attr if isinstance(node, ast.Attribute) else "[]"
    elif isinstance(node, ast.Call):
      inner, loads, field = node.func, False, None
    else:
      continue
    if isinstance(inner, ast.Attribute) and inner.attr == "diloco":
      fields[id(inner)] = field if loads else None
  found = []
  for node in ast.walk(tree):
    if not (isinstance(node, ast.Attribute) and node.attr == "diloco"
            and isinstance(node.ctx, ast.Load)):
      continue
    holder = node.value
    holder_name = (holder.id if isinstance(holder, ast.Name) else
                   holder.attr if isinstance(holder, ast.Attribute) else None)
    field = fields.get(id(node), WHOLE_SECTION)
    if holder_name not in TYPED_DILOCO_HOLDERS and field is not None:
      found.append((node.lineno, field))
  return sorted(found)


def test_the_run_and_elastic_layers_read_config_diloco_typed():
  """The layers above config/ read run_config.diloco (DiLoCoSettings); each raw
  read left is in RAW_DILOCO_READS, and each entry there is still needed."""
  raw, used = [], set()
  for layer in DILOCO_READERS:
    for path in sorted((PACKAGE / layer).rglob("*.py")):
      module = path.relative_to(PACKAGE).as_posix()
      for line, field in _raw_diloco_reads(path):
        if (module, field) in RAW_DILOCO_READS:
          used.add((module, field))
        else:
          raw.append(f"diloco_jax/{module}:{line}: .diloco {field}")
  assert not raw, (
      "raw config.diloco reads above config/ (read run_config.diloco, "
      "adding a DiLoCoSettings field where one is missing):\n"
      + "\n".join(raw))
  stale = sorted(set(RAW_DILOCO_READS) - used)
  assert not stale, f"RAW_DILOCO_READS entries no longer needed: {stale}"


def test_the_diloco_check_tells_raw_reads_from_typed_ones(tmp_path):
  module = tmp_path / "m.py"
  module.write_text(
      "def f(config, run_config, setup, self, library):\n"
      "  a = config.diloco.inner_steps\n"
      "  b = run_config.config.diloco.codec\n"
      "  c = self._config.diloco['overlap']\n"
      "  d = config.diloco\n"
      "  e = run_config.diloco.inner_steps + run_config.diloco.codec\n"
      "  f = setup.run_config.diloco.codec + self._run_config.diloco.codec\n"
      "  config.diloco.fragments = 1\n"
      "  return library.diloco(codec=None)\n")
  assert _raw_diloco_reads(module) == [
      (2, "inner_steps"), (3, "codec"), (4, "[]"), (5, WHOLE_SECTION)]
