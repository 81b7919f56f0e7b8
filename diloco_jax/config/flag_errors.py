"""One line for a command line whose --config flags cannot be parsed.

ml_collections reports an unknown `--config.x.y` field, or a config file
that does not load, as a chain of tracebacks; `describe` names the flag
instead, with the nearest config field for a misspelled one.
"""

import difflib
import os
import re

from absl import flags

from diloco_jax.config import schema


def field_names(config=None) -> list[str]:
  """Every dotted leaf field of `config` (default: the schema's)."""
  config = schema.base_config() if config is None else config
  names = []

  def walk(node, prefix):
    for key, value in node.items():
      if hasattr(value, "items"):
        walk(value, f"{prefix}{key}.")
      else:
        names.append(prefix + key)

  walk(config, "")
  return names


def _flag_values(argv: list[str], name: str) -> list[str]:
  """The values given to --name (as --name=V or --name V), in order."""
  values = []
  for i, arg in enumerate(argv):
    if arg.startswith(f"--{name}="):
      values.append(arg.split("=", 1)[1])
    elif arg == f"--{name}" and i + 1 < len(argv):
      values.append(argv[i + 1])
  return values


def _config_overrides(argv: list[str]) -> list[str]:
  """The dotted fields the --config.x.y flags of `argv` set."""
  fields = []
  for arg in argv:
    if arg.startswith("--config."):
      fields.append(arg[len("--config."):].split("=", 1)[0])
  return fields


def unknown_field(argv: list[str]) -> str | None:
  """The first --config.x.y flag naming no config field, described with
  the nearest field; None when every one names a field."""
  names = field_names()
  known = set(names)
  sections = {name.rsplit(".", 1)[0] for name in names if "." in name}
  for field in _config_overrides(argv):
    if field in known:
      continue
    line = f"--config.{field}: no such config field"
    if field in sections:
      return line + f" (config.{field} is a section: set one of its fields)"
    nearest = difflib.get_close_matches(field, names, n=1, cutoff=0.6)
    return line + (f"; did you mean --config.{nearest[0]}?" if nearest
                   else " (config/schema.py lists the fields)")
  return None


def describe(error: BaseException, argv: list[str]) -> str:
  """One line for `error`, raised while parsing `argv`'s flags."""
  unknown = unknown_field(argv)
  if unknown:
    return unknown
  for value in _flag_values(argv, "config")[-1:]:  # the last one counts
    path, _, argument = value.partition(":")
    if not os.path.isfile(path):
      return f"--config={value}: no such file"
    lines = [line.strip() for line in str(error).strip().splitlines()
             if line.strip()]
    last = lines[-1] if lines else type(error).__name__
    if argument and re.fullmatch(
        r"TypeError: get_config\(\) takes 0 positional arguments but 1 "
        r"was given", last):
      return (f"--config={value}: {path} takes no ':ARGUMENT'; use "
              f"--config={path}")
    if argument and last.startswith("ValueError: "):
      # The config's own refusal of its argument (configs/c4_small.py:
      # "takes gpu, colab, quick, not 'small'").
      return f"--config={value}: {last[len('ValueError: '):]}"
    return f"--config={value}: cannot load it: {last}"
  lines = str(error).strip().splitlines()
  return lines[-1] if lines else type(error).__name__


def parse_flags(argv: list[str], config_flag) -> tuple[list[str], str | None]:
  """absl's flag parsing of `argv`, each mistake one line: (the arguments
  left, None), or ([], the line) for an unknown config field (with the
  nearest one), a bad value, a config file that does not load (or does
  not take its ':ARGUMENT'), or an argument that is not a flag.
  `config_flag`: the entry point's DEFINE_config_file holder."""
  try:
    remaining = flags.FLAGS(argv)
    config_flag.value.keys()  # a config file that failed to load raises here
  except flags.Error as e:
    message = str(e).strip()
    # A config file whose get_config raised: absl's message holds the
    # traceback; the line names the file and what it said.
    return [], (describe(e, argv) if "\n" in message else message)
  except Exception as e:  # pylint: disable=broad-except
    return [], describe(e, argv)
  if len(remaining) > 1:  # absl would print its whole help first
    return [], (f"unexpected arguments {remaining[1:]}: every setting is a "
                "flag (--workdir=DIR, --config.FIELD=VALUE)")
  return remaining, None
