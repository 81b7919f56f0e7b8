"""The one exception the data pipeline raises for unusable data."""


class DataError(ValueError):
  """A data file or data setting that cannot be used.

  The message names the file (path, and line where it helps) or the config
  field, and the problem, in one line. A ValueError, so callers that catch
  ValueError for bad input keep working.
  """
