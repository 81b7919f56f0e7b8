"""Resume compares configs: a change of meaning needs the user's say-so.

A checkpoint carries the config it was written with. Resuming under another
value of a field that changes what the run computes (the schedule, the
optimizers, the codec, the data, the mode, the seed, the model, the eval
set) would continue a different experiment under the old run's name, so it
is refused, listing each changed field with both values, unless the field
is named in `config.resume.allow_changes` (comma-separated dotted names; a
section name such as `data` allows all its fields). The mode can never
change in place. Allowed changes are
recorded in the checkpoints that follow and in summary.json.

Fields that only say where or how the same computation runs (device
placement and pipeline stages, attention kernel, remat, microbatching) or
how the run is kept
(checkpointing, logging, the non-finite policy) may change freely, as may
the island count, which resume adapts to (elastic islands).
"""

# A checkpoint of another mode cannot continue in place: ddp and single
# never update the global params, so a diloco run resumed from one would
# silently restart from the random initialization.
NEVER_ALLOWED = ("mode",)

FREE_FIELDS = ("mesh", "pipeline", "model.attention", "model.remat",
               "data.microbatches", "data.read_timeout_s",
               "checkpoint", "log_every_seconds",
               "nonfinite", "max_rollbacks", "resume", "diloco.islands",
               "diloco.outer_placement", "network", "eval.island_mean",
               "eval.every_rounds")


def flatten(config: dict, prefix: str = "") -> dict:
  """{'a.b.c': value} for a nested config dict."""
  flat = {}
  for key, value in config.items():
    name = f"{prefix}{key}"
    if isinstance(value, dict):
      flat.update(flatten(value, name + "."))
    else:
      flat[name] = value
  return flat


def _covered(name: str, patterns) -> bool:
  return any(name == p or name.startswith(p + ".") for p in patterns)


def parse_allowed(allow_changes: str) -> list[str]:
  """The field names of config.resume.allow_changes."""
  return [name.strip() for name in (allow_changes or "").split(",")
          if name.strip()]


def unknown_fields(names: list[str], config: dict) -> list[str]:
  """The names that are neither a config field nor a section of one."""
  fields = flatten(config)
  return [name for name in names
          if name not in fields and not any(f.startswith(name + ".")
                                            for f in fields)]


def changes(saved: dict, current: dict) -> list[dict]:
  """[{'field', 'checkpoint', 'now'}] for each field whose value differs.

  Fields present in only one of the two (a config written by an older
  version) are not compared; nor are FREE_FIELDS.
  """
  saved, current = flatten(saved), flatten(current)
  return [{"field": name, "checkpoint": saved[name], "now": current[name]}
          for name in sorted(saved.keys() & current.keys())
          if saved[name] != current[name]
          and not _covered(name, FREE_FIELDS)]


def refused(changed: list[dict], allow_changes: str) -> list[dict]:
  """The changes not covered by config.resume.allow_changes (which
  validation keeps from naming NEVER_ALLOWED fields)."""
  allowed = parse_allowed(allow_changes)
  return [c for c in changed if not _covered(c["field"], allowed)]


def describe(changed: list[dict]) -> str:
  """'total_steps 8 -> 16, diloco.codec 'fp32' -> 'int8''."""
  return ", ".join(f"{c['field']} {c['checkpoint']!r} -> {c['now']!r}"
                   for c in changed)
