"""Config files that import their siblings load from any directory.

The repository's configs build on each other (`from configs import
c4_common`), which Python resolves only where `configs` is importable:
from the repository's root. `importable` puts the parent of each config
file's package on sys.path before the flags load the file, so
`python -m diloco_jax.main --config=/path/to/repo/configs/c4_small.py`
works from any directory, and so does a user's own package of configs.
"""

import os
import sys


def config_paths(argv: list[str]) -> list[str]:
  """The files of argv's --config=PATH[:ARG] flags (and --config PATH)."""
  paths = []
  for i, arg in enumerate(argv):
    if arg.startswith("--config="):
      value = arg.split("=", 1)[1]
    elif arg == "--config" and i + 1 < len(argv):
      value = argv[i + 1]
    else:
      continue
    paths.append(value.split(":", 1)[0])
  return paths


def importable(argv: list[str]) -> None:
  """For each config file of `argv` that sits in a package (a directory
  with an __init__.py), the package's parent first on sys.path."""
  for path in config_paths(argv):
    package = os.path.dirname(os.path.abspath(path))
    if os.path.isfile(os.path.join(package, "__init__.py")):
      root = os.path.dirname(package)
      if root not in sys.path:
        sys.path.insert(0, root)
