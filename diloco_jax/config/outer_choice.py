"""Which outer step a run uses, and why, in one line.

Where a config leaves the outer optimizer's learning rate or momentum
unset, the overlap mode's measured defaults fill them
(overlap_defaults.py). A config built on the command line (main.py: a
config file, then --config.* flags) follows two more rules, because some
of a file's choices hold only for the file's own value of another field:

- A config file's outer optimizer is its choice for its own overlap mode.
  A flag that turns on another overlap, with no flag for the outer
  optimizer, gives that mode's measured outer step (Nesterov at the
  mode's learning rate and momentum): configs/default.py's plain
  averaging (sgd, lr 1) won without overlap and is not its choice for
  eager updates, which average the stale mean measurably worse. A file
  that chose SparseLoCo keeps it: its step is sparseloco.alpha.
- A learning rate and momentum a file set belong to its own outer
  optimizer: a flag naming another one leaves them unset (its defaults
  apply), and a flag naming SparseLoCo, which sends its own compressed
  mean, also leaves the file's codec behind ('fp32', SparseLoCo's).

Flags for the outer optimizer (name, learning_rate, momentum) are the
user's choice and are always kept. A config built in Python (the studies,
the tests) is its author's choice throughout: nothing is set aside.
"""

from diloco_jax.algorithm import compression
from diloco_jax.config import command_line as command_line_lib

_OUTER = "diloco.outer_optimizer"
# The fields that choose the outer step.
_FIELDS = ("name", "learning_rate", "momentum")
_WITH_MOMENTUM = ("nesterov", "momentum")


def choose(config, command_line: command_line_lib.CommandLine | None):
  """`config` with the outer settings its file made for another overlap
  mode or outer optimizer set aside (a copy; `config` is unchanged).

  Args:
    config: the run's config.
    command_line: the file and flags `config` was built from, or None for
      a config built in Python (then nothing is set aside).

  Returns:
    (config, note): the note says what was set aside and why ('' when
    nothing was).
  """
  if command_line is None:
    return config, ""
  flagged = [f for f in _FIELDS if command_line.sets(f"{_OUTER}.{f}")]
  if not flagged:
    aside, note = _for_another_overlap(config, command_line)
  else:
    aside, note = _for_another_optimizer(config, command_line, flagged)
  if not aside:
    return config, ""
  chosen = config.copy_and_resolve_references()
  for field, value in aside.items():
    *parents, leaf = field.split(".")
    section = chosen
    for part in parents:
      section = section[part]
    section[leaf] = value
  return chosen, note


def _for_another_overlap(config, command_line) -> tuple[dict, str]:
  """({dotted field: value} to set, note): the overlap's measured step
  where a flag changed the overlap its file chose an outer step for."""
  file = command_line.file_config.diloco
  if (config.diloco.overlap == file.overlap
      or not _chose_a_step(file.outer_optimizer)):
    return {}, ""
  aside = {f"{_OUTER}.name": "nesterov", f"{_OUTER}.learning_rate": None,
           f"{_OUTER}.momentum": None}
  return aside, (
      f"{command_line.path} chose {_settings(file.outer_optimizer)} for "
      f"overlap={file.overlap!r}; set --config.diloco.outer_optimizer.* for "
      "another")


def _for_another_optimizer(config, command_line,
                           flagged) -> tuple[dict, str]:
  """({dotted field: value} to set, note): the file's learning rate,
  momentum (and for SparseLoCo codec) left unset where a flag named
  another outer optimizer than its file's."""
  file = command_line.file_config.diloco
  name = config.diloco.outer_optimizer.name
  file_name = file.outer_optimizer.name
  if name == file_name:
    return {}, ""
  left = {f"{_OUTER}.{f}": file.outer_optimizer[f]
          for f in ("learning_rate", "momentum")
          if f not in flagged and file.outer_optimizer[f] is not None}
  if (name == compression.SPARSELOCO and file.codec != "fp32"
      and not command_line.sets("diloco.codec")):
    left["diloco.codec"] = file.codec
  if not left:
    return {}, ""
  aside = {field: ("fp32" if field == "diloco.codec" else None)
           for field in left}
  said = " and ".join(f"{field.rsplit('.', 1)[1]}={value!r}"
                      for field, value in left.items())
  return aside, (f"{command_line.path} set {said} for its {file_name}, not "
                 f"for {name}")


def describe(config, set_outer: dict, note: str = "") -> str:
  """The outer step of a checked, resolved config and why, in one line
  ('' outside DiLoCo: no outer step).

  Args:
    config: the config with its defaults filled in.
    set_outer: the outer optimizer's learning_rate and momentum before the
      defaults filled them (None where unset).
    note: what choose() set aside, if anything.
  """
  if config.mode != "diloco":
    return ""
  diloco = config.diloco
  outer = diloco.outer_optimizer
  where = note
  if outer.name == compression.SPARSELOCO:
    sparse = diloco.sparseloco
    line = (f"outer step: sparseloco alpha {sparse.alpha:g}, its error "
            f"feedback (beta {sparse.beta:g}) the momentum, as "
            "config.diloco.sparseloco sets them")
  else:
    used = _FIELDS[1:] if outer.name in _WITH_MOMENTUM else _FIELDS[1:2]
    step = f"{outer.name} lr {outer.learning_rate:g}"
    if "momentum" in used:
      step += f" momentum {outer.momentum:g}"
    unset = [f for f in used if set_outer[f] is None]
    why = _why(outer.name, diloco.overlap, used, unset)
    line = f"outer step: {step}, {why}"
    where = note or ("config/overlap_defaults.py" if unset else "")
  return f"{line} ({where})" if where else line


def _why(name: str, overlap: str, used, unset) -> str:
  """Where a step's values (`used`, of which `unset` took defaults) came
  from."""
  if not unset:
    return "as the config sets it"
  source = (f"the measured default for overlap={overlap!r}"
            if name == "nesterov" else "the default")
  if len(unset) == len(used):
    return source
  short = {"learning_rate": "lr", "momentum": "momentum"}
  kept = [f for f in used if f not in unset][0]
  return f"{short[kept]} as the config sets it, {short[unset[0]]} {source}"


def _chose_a_step(outer) -> bool:
  """Whether a config's outer optimizer is a choice of its own: anything
  but SparseLoCo (whose step is its alpha) and Nesterov left at the
  overlap mode's defaults."""
  if outer.name == compression.SPARSELOCO:
    return False
  return not (outer.name == "nesterov" and outer.learning_rate is None
              and outer.momentum is None)


def _settings(outer) -> str:
  """'sgd lr 1', 'nesterov lr 1 momentum 0': what a config set."""
  text = outer.name
  if outer.learning_rate is not None:
    text += f" lr {outer.learning_rate:g}"
  if outer.momentum is not None and outer.name in _WITH_MOMENTUM:
    text += f" momentum {outer.momentum:g}"
  return text
