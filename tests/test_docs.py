"""The docs stay true to the code: every command they show names modules,
files and config fields that exist, and every link and module path resolves.

The commands themselves are not run here (most train for minutes); the
README's test command is what CI runs, and its training command is the
default config, which tests/test_configs.py validates.
"""

import importlib.util
import pathlib
import re

import pytest

from diloco_jax.config import schema as config_schema

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGES = sorted([ROOT / "README.md", ROOT / "BUILD.md",
                *(ROOT / "docs").glob("*.md")])
LAYERS = ("codecs", "parallel", "algorithm", "config", "model", "data",
          "analysis", "run")


def _ids(paths):
  return [str(p.relative_to(ROOT)) for p in paths]


def _shell_lines(page: pathlib.Path) -> list[str]:
  """The lines of the page's bash/sh code blocks, continuations joined."""
  blocks = re.findall(r"```(?:bash|sh|shell)\n(.*?)```", page.read_text(),
                      re.S)
  return [line for block in blocks
          for line in block.replace("\\\n", " ").splitlines()
          if line.strip() and not line.lstrip().startswith("#")]


def _placeholder(name: str) -> bool:
  """CONFIG, FIELD, STUDY: a name the reader fills in."""
  return any(part.isupper() for part in re.split(r"[./]", name))


def _config_fields() -> set[str]:
  def walk(node, prefix=""):
    for key in node.keys():
      value = node[key]
      if hasattr(value, "keys"):
        yield from walk(value, f"{prefix}{key}.")
      else:
        yield prefix + key
  return set(walk(config_schema.base_config()))


@pytest.mark.parametrize("page", PAGES, ids=_ids(PAGES))
def test_commands_name_what_exists(page):
  fields = _config_fields()
  problems = []
  for line in _shell_lines(page):
    for module in re.findall(r"python3? -m ([\w.]+)", line):
      if (module.split(".")[0] in ("diloco_jax", "experiments", "benchmarks")
          and not _placeholder(module)):
        if importlib.util.find_spec(module) is None:
          problems.append(f"no module {module}: {line}")
    for script in re.findall(r"python3? ((?:experiments|benchmarks)/\w+\.py)",
                             line):
      if not (ROOT / script).exists():
        problems.append(f"no script {script}: {line}")
    for config in re.findall(r"--config=([\w/.]+\.py)", line):
      if not _placeholder(config) and not (ROOT / config).exists():
        problems.append(f"no config {config}: {line}")
    for field in re.findall(r"--config\.([\w.]+)=", line):
      if not _placeholder(field) and field not in fields:
        problems.append(f"no config field {field}: {line}")
  assert not problems, "\n".join(problems)


@pytest.mark.parametrize("page", PAGES, ids=_ids(PAGES))
def test_links_and_module_paths_resolve(page):
  # docs/architecture.md ends with the modules' names before the layers.
  text = page.read_text().split("## Moved modules")[0]
  problems = []
  for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
    if not re.match(r"\w+://", target) and not (
        page.parent / target).exists():
      problems.append(f"link to {target}")
  # Module paths: diloco_jax/x.py, or LAYER/x.py under diloco_jax/.
  for path in re.findall(r"(?<![\w/])(?:diloco_jax/)?((?:" + "|".join(LAYERS)
                         + r")/\w+\.py)", text):
    if not (ROOT / "diloco_jax" / path).exists():
      problems.append(f"module path {path}")
  for path in re.findall(r"(?<![\w/])diloco_jax/(\w+\.py)", text):
    if not (ROOT / "diloco_jax" / path).exists():
      problems.append(f"module path diloco_jax/{path}")
  assert not problems, "\n".join(problems)
