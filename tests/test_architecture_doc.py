"""docs/architecture.md stays true to the package's tree.

Guards two things: every module the page names exists (no module that was
removed or renamed lingers on the page), and the page's module map names
every package of diloco_jax/ (a new subpackage cannot go unmentioned).

How the page writes paths (the convention parsed here): a path is a
backticked span outside code blocks, ending in `.py` (a module) or in `/`
(a package). It is under diloco_jax/ (a leading `diloco_jax/` is allowed),
unless its first directory is another top-level directory of the
repository (`tests/test_layers.py`). A bare name (`outer_checks.py`) is in
the diloco_jax/ directory of the path named before it in the same table
row or paragraph (`algorithm/outer_state.py`, `outer_checks.py`; `data/`
| ... `read_ahead.py`), or at the top of diloco_jax/ if none was
(`main.py`). The "before" column of a table
(the page's moved modules) names modules that are gone by design and is
skipped. Reads the page only: no jax import.
"""

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "diloco_jax"
PAGE = ROOT / "docs" / "architecture.md"
MODULE_MAP = "## Module map"

_MODULE = re.compile(r"((?:\w+/)*)(\w+\.py)")
_PACKAGE = re.compile(r"((?:\w+/)+)")
_LIST_ITEM = re.compile(r"\s*(?:\d+\.|[-*])\s")


def _scopes(text: str):
  """(section, line number, text) of each table row and each paragraph or
  list item outside code blocks; the cells of a "before" column are left
  out."""
  section, headers, paragraph, in_code = "", None, [], False

  def flush():
    if paragraph:
      yield section, paragraph[0][0], " ".join(t for _, t in paragraph)
      paragraph.clear()

  for number, line in enumerate(text.splitlines(), 1):
    if line.lstrip().startswith("```"):
      yield from flush()
      in_code = not in_code
      continue
    if in_code:
      continue
    if line.startswith("#"):
      yield from flush()
      section = line.strip()
      continue
    if line.startswith("|"):
      yield from flush()
      cells = [c.strip() for c in line.strip().strip("|").split("|")]
      if headers is None:
        headers = [c.lower() for c in cells]
      yield section, number, " | ".join(
          cell for header, cell in zip(headers, cells) if header != "before")
      continue
    headers = None
    if not line.strip() or _LIST_ITEM.match(line):
      yield from flush()
    if line.strip():
      paragraph.append((number, line))
  yield from flush()


def _repository_dirs() -> set[str]:
  return {p.name for p in ROOT.iterdir()
          if p.is_dir() and p.name != "diloco_jax"}


def named_paths(text: str, repository_dirs: frozenset[str] = frozenset()):
  """(section, line, as written, path) of every module and package the
  page names; path is relative to the repository's root."""
  found = []
  for section, number, scope in _scopes(text):
    directory = ""
    for span in re.findall(r"`([^`\n]+)`", scope):
      span = span.strip()
      path = span.removeprefix("diloco_jax/")
      module, package = _MODULE.fullmatch(path), _PACKAGE.fullmatch(path)
      if module:
        if module.group(1):
          directory = module.group(1)
        name = directory + module.group(2)
      elif package:
        directory = package.group(1)
        name = directory
      else:
        continue
      if name.split("/")[0] in repository_dirs:  # tests/..., of the repo
        found.append((section, number, span, name))
        directory = ""  # a bare name after it is still under diloco_jax/
        continue
      if span == "diloco_jax/":  # the package itself
        directory = ""
        continue
      found.append((section, number, span, "diloco_jax/" + name))
  return found


def _packages() -> list[str]:
  """Every package under diloco_jax/: 'elastic', 'run', ..."""
  return sorted(str(p.parent.relative_to(PACKAGE))
                for p in PACKAGE.rglob("__init__.py")
                if p.parent != PACKAGE and "__pycache__" not in p.parts)


def test_every_module_the_page_names_exists():
  names = named_paths(PAGE.read_text(), frozenset(_repository_dirs()))
  assert len(names) > 50, f"parsed only {len(names)} paths from {PAGE}"
  missing = [f"{PAGE.name}:{line} ({section}): `{span}` -> {name}"
             for section, line, span, name in names
             if not (ROOT / name).exists()]
  assert not missing, ("docs/architecture.md names modules that do not "
                       "exist:\n" + "\n".join(missing))


def test_the_module_map_names_every_package():
  text = PAGE.read_text()
  assert MODULE_MAP in text, f"{PAGE.name} has no '{MODULE_MAP}' section"
  named = set()
  for section, _, _, name in named_paths(text):
    if section == MODULE_MAP and name.startswith("diloco_jax/"):
      parts = name[len("diloco_jax/"):].rstrip("/").split("/")
      if not name.endswith("/"):
        parts = parts[:-1]  # a module: its directory
      named.update("/".join(parts[:i]) for i in range(1, len(parts) + 1))
  packages = _packages()
  assert "elastic" in packages and "run" in packages, packages
  missing = [p for p in packages if p not in named]
  assert not missing, (
      f"the module map of docs/architecture.md does not name these "
      f"packages of diloco_jax/: {', '.join(p + '/' for p in missing)}")


def test_the_convention_resolves_bare_names_and_skips_before():
  text = "\n".join([
      "Intro `tests/test_layers.py`, then `main.py`; `diloco_jax/`.",
      "",
      "| before | now |",
      "|---|---|",
      "| `gone.py` | `run/a.py`, `b.py`; `algorithm/` (same names) `c.py` |",
      "",
      "| module | concern |",
      "|---|---|",
      "| `model/` | `d.py` |",
      "",
      "- `diloco_jax/data/x.py` and `y.py`",
      "- `z.py`",
      "```",
      "`code.py`",
      "```",
  ])
  names = [name for *_, name in named_paths(text, frozenset({"tests"}))]
  assert names == ["tests/test_layers.py", "diloco_jax/main.py",
                   "diloco_jax/run/a.py", "diloco_jax/run/b.py",
                   "diloco_jax/algorithm/", "diloco_jax/algorithm/c.py",
                   "diloco_jax/model/", "diloco_jax/model/d.py",
                   "diloco_jax/data/x.py", "diloco_jax/data/y.py",
                   "diloco_jax/z.py"]
