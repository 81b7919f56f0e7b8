"""The problems found in a config, collected to be reported together."""


class ConfigError(ValueError):
  """An invalid config; the message names the field of every problem."""


class Problems:
  """Collects one line per problem, each naming its field.

  Checks record what they find with `require`; a check that depends on a
  field asks `ok(field)` first, so a bad value is reported once, not again
  by every check that reads it.
  """

  def __init__(self):
    self.messages: list[str] = []
    self._fields: set[str] = set()

  def require(self, condition: bool, field: str, message: str) -> bool:
    """Records `message` against `field` (dotted, without 'config.')
    unless `condition` holds; returns the condition."""
    if not condition:
      self.messages.append(message)
      self._fields.add(field)
    return bool(condition)

  def positive_int(self, config, field: str) -> bool:
    """Requires config's dotted `field` to be an integer >= 1."""
    value = config
    for part in field.split("."):
      value = value[part]
    return self.require(
        isinstance(value, int) and not isinstance(value, bool) and value >= 1,
        field, f"config.{field}={value!r} must be an integer >= 1")

  def ok(self, *fields: str) -> bool:
    """Whether none of `fields` has had a problem."""
    return not self._fields.intersection(fields)

  def raise_if_any(self) -> None:
    """Raises one ConfigError listing every problem, one per line."""
    if len(self.messages) == 1:
      raise ConfigError(self.messages[0])
    if self.messages:
      raise ConfigError(f"{len(self.messages)} problems in the config:\n  "
                        + "\n  ".join(self.messages))
