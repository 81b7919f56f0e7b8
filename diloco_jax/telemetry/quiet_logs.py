"""What the entry points keep out of the log: other libraries' chatter."""

import os


class QuietLibraries:
  """Keeps orbax's and JAX's logs to what is news.

  orbax logs through absl at INFO several lines per save, drowning the
  progress lines: those are dropped. Its errors come without their
  tracebacks: every failure it logs reaches the run as an exception, which
  ends the run with one line naming the path and the reason.

  JAX says at INFO which platforms it found missing while probing for
  them ("Unable to initialize backend 'tpu': ... libtpu.so ..." on every
  machine without a TPU): dropped. Its warnings (a GPU present but no
  CUDA-enabled jaxlib) stay.
  """

  def filter(self, record) -> bool:
    if (record.pathname.endswith(f"{os.sep}xla_bridge.py")
        and record.levelno <= 20
        and str(record.msg).startswith("Unable to initialize backend")):
      return False
    if f"{os.sep}orbax{os.sep}" not in record.pathname:
      return True
    record.exc_info = record.exc_text = None
    return record.levelno > 20  # 20 = INFO
