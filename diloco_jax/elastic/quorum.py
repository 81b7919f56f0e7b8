"""When an elastic round closes: once `min_islands` islands have sent
their params and `grace_seconds` more have passed (or every island has
answered). An island whose process died is out of the round; one still
training at the close is late: its call is handed back pending, for the
driver to keep (the staleness rule) or drop (it then trains the same
batches again in a later round: nothing it did not contribute counts).
"""

import dataclasses
import time

import ray.exceptions

from diloco_jax.elastic import fetches as fetches_lib


@dataclasses.dataclass
class RoundResults:
  """What came back of one round's calls.

  Attributes:
    results: island -> IslandProgram.train_round's result.
    failed: island -> why its call failed (its process died, or raised).
    late: the islands still training when the round closed.
    pending: their calls (ObjectRefs), still running.
    seconds: from the round's start to its close.
  """
  results: dict
  failed: dict
  late: list
  pending: list
  seconds: float


def collect(calls: dict, min_islands: int, grace_seconds: float,
            fetches: fetches_lib.Fetches) -> RoundResults:
  """Waits for the round's calls (ObjectRef -> island) under the quorum
  rule and returns what came back. `fetches` pulls every call's result
  at once (fetches.py), each taken as it is here."""
  start = time.monotonic()
  results, failed = {}, {}
  pending = list(calls)

  def take(ready):
    for ref in ready:
      pending.remove(ref)
      island = calls[ref]
      try:
        results[island] = fetches.take(ref)
      except (ray.exceptions.RayActorError,
              ray.exceptions.RayTaskError) as error:
        failed[island] = f"{type(error).__name__}: {str(error)[:200]}"

  # Failed islands do not count towards the quorum; with too few islands
  # alive to reach it, the round closes when every call has answered.
  while pending and len(results) < min_islands:
    take(fetches.wait(pending))
  deadline = time.monotonic() + grace_seconds
  while pending:
    left = deadline - time.monotonic()
    if left <= 0:
      break
    take(fetches.wait(pending, timeout=left))
  return RoundResults(results, failed, [calls[ref] for ref in pending],
                      pending, time.monotonic() - start)
