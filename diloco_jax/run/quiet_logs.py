"""What the entry points keep out of the log: other libraries' chatter."""

import os


class QuietLibraries:
  """Keeps orbax's log to what is news.

  orbax logs through absl at INFO several lines per save, drowning the
  progress lines: those are dropped. Its errors come without their
  tracebacks: every failure it logs reaches the run as an exception, which
  ends the run with one line naming the path and the reason.
  """

  def filter(self, record) -> bool:
    if f"{os.sep}orbax{os.sep}" not in record.pathname:
      return True
    record.exc_info = record.exc_text = None
    return record.levelno > 20  # 20 = INFO
