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
    value = _get(config, field)
    return self.require(
        isinstance(value, int) and not isinstance(value, bool) and value >= 1,
        field, f"config.{field}={value!r} must be an integer >= 1")

  def number_in(self, config, field: str, low: float, high: float,
                bounds: str = "[]", integer: bool = False) -> bool:
    """Requires config's dotted `field` to be a number (an integer if
    `integer`) between `low` and `high`, each bound included where
    `bounds` ('[]', '[)', '(]' or '()') says; an infinite bound is open."""
    value = _get(config, field)
    kind = int if integer else (int, float)
    ok = isinstance(value, kind) and not isinstance(value, bool)
    if ok:
      above = value >= low if bounds[0] == "[" else value > low
      below = value <= high if bounds[1] == "]" else value < high
      ok = above and below
    if high == float("inf"):
      wanted = f"{'>=' if bounds[0] == '[' else '>'} {low:g}"
    else:
      wanted = f"in {bounds[0]}{low:g}, {high:g}{bounds[1]}"
    return self.require(
        ok, field, f"config.{field}={value!r} must be "
        f"{'an integer' if integer else 'a number'} {wanted}")

  def one_of(self, config, field: str, choices) -> bool:
    """Requires config's dotted `field` to be one of `choices`."""
    value = _get(config, field)
    choices = tuple(choices)
    if all(isinstance(choice, bool) for choice in choices):
      ok = isinstance(value, bool)  # 1 == True, but 1 is no flag
    else:
      ok = not isinstance(value, bool) and value in choices
    return self.require(
        ok, field, f"config.{field}={value!r} is not one of {choices}")

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


def _get(config, field: str):
  """config's dotted `field`."""
  for part in field.split("."):
    config = config[part]
  return config
