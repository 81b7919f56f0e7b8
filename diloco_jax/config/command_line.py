"""What --config.* flags changed of the config file they override.

main.py builds a run's config from a config file (--config=PATH[:ARG])
and --config.FIELD=VALUE flags. Most fields mean the same whoever set
them, but a few of a file's choices are made for the file's own value of
another field: its outer optimizer for its own overlap mode, its learning
rate for its own outer optimizer (outer_choice.py). A flag that changes
that other field leaves such choices behind, which only a record of the
file's own config and of the flags' fields can tell.
"""

import dataclasses

import ml_collections
from ml_collections import config_flags


@dataclasses.dataclass(frozen=True)
class CommandLine:
  """A config built from a config file and changed by --config.* flags.

  Attributes:
    path: the config file as --config named it ('configs/default.py', or
      with its argument, 'configs/scaling.py:small').
    file_config: the config as the file built it, before the flags.
    flags: the dotted fields the flags set ('diloco.overlap'), or the
      section a flag set whole ('diloco.outer_optimizer').
  """
  path: str
  file_config: ml_collections.ConfigDict
  flags: frozenset[str]

  def sets(self, field: str) -> bool:
    """Whether a flag set the dotted `field` or a section holding it."""
    return any(field == name or field.startswith(name + ".")
               for name in self.flags)


def from_flag(config_flag) -> CommandLine:
  """The CommandLine of a parsed config-file flag (main.py's --config).

  The file's own config is the file loaded again, as the flag loaded it
  before applying the flags (a config file's get_config() builds the same
  config each time).
  """
  path = config_flags.get_config_filename(config_flag)
  parser = config_flags.config_flags.ConfigFileFlagParser(
      name=config_flag.name, lock_config=False)
  return CommandLine(
      path=path, file_config=parser.parse(path),
      flags=frozenset(config_flags.get_override_values(config_flag)))
