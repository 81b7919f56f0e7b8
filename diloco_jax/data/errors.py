"""The one exception the data pipeline raises for unusable data."""


class DataError(ValueError):
  """A data file or data setting that cannot be used.

  The message names the file (path, and line where it helps) or the config
  field, and the problem, in one line. A ValueError, so callers that catch
  ValueError for bad input keep working.
  """


# What installs the C4 tools' packages (sentencepiece, tensorflow-datasets),
# which requirements.txt, the run set, leaves out.
C4_EXTRA = "pip install -e '.[c4]' (or -r requirements-dev.txt)"


def missing_package(what: str, package: str) -> DataError:
  """The one line for `what` needing the C4 extra's `package`."""
  return DataError(f"{what} needs the {package} package, which "
                   f"requirements.txt leaves out: {C4_EXTRA}")
