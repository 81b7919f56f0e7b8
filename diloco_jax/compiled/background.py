"""Work started in a thread of its own: compiling while the state loads.

Compiling needs only shapes, and XLA compiles outside the GIL, so a run
starts its compiles at once and initializes (or restores) its state
meanwhile: start-up costs about max(compile, init) instead of their sum.
"""

import concurrent.futures


def submit(thread_name: str, fn, *args, **kwargs) -> concurrent.futures.Future:
  """Starts fn(*args, **kwargs) in a new thread named `thread_name`;
  .result() waits for it (and raises what it raised)."""
  pool = concurrent.futures.ThreadPoolExecutor(
      max_workers=1, thread_name_prefix=thread_name)
  future = pool.submit(fn, *args, **kwargs)
  pool.shutdown(wait=False)  # the thread ends with its one task
  return future
