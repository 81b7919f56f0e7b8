"""Streaming DiLoCo's collectives queued on one link: the steady-state round.

When fragments' collectives outlast the gaps between their sends they queue
on the link, and the round time has no closed form. Every time in a round
is then a max of sums, so a round is a max-plus linear map of the state at
its end, and the steady state is that map's largest cycle mean.
network_model.timing calls this for the contended case.
"""

import collections

import numpy as np


def queued_round_s(h: int, p: int, tau: int, s: float, c: float,
                   apply: float) -> float:
  """Steady-state round time of streaming fragments queued on one link.

  Fragment j of a round is sent when the island finishes step
  floor((j + 1) h / p) of it, starts on the link when the link is free
  (first come, first served), holds it for c, and must be back (then
  applied in `apply` seconds) before the island runs past step send + tau.
  Results due at a step are waited for and applied before that step's send,
  as `timing`'s closed form assumes.

  Every time here is a max of sums, so one round maps the state at a round's
  end (the island's clock, when the link frees, the arrival of each result
  still due) to the next by a max-plus linear map x' = A (x) x. A round is
  run once on symbolic times (rows of max-plus coefficients over the state);
  the steady-state round time is A's largest cycle mean (Karp). A plain
  simulation would need a number of rounds that grows without bound as the
  link nears saturation, to settle.
  """
  sends = [((j + 1) * h) // p for j in range(p)]
  carried = [n + tau - h for n in sends if n + tau > h]  # due next round
  size = 2 + len(carried)
  unit = lambda i: np.where(np.arange(size) == i, 0.0, -np.inf)
  clock, link_free = unit(0), unit(1)
  due = collections.deque(  # (step it is due at, when it arrives), in order
      (step, unit(2 + i)) for i, step in enumerate(carried))
  step = 0

  def wait_through(last_step: int) -> None:
    """Runs to each result due by `last_step`, waits for it, applies it."""
    nonlocal clock, step
    while due and due[0][0] <= last_step:
      due_step, arrives = due.popleft()
      clock = np.maximum(clock + (due_step - step) * s, arrives) + apply
      step = due_step

  for send_step in sends:
    wait_through(send_step)
    clock = clock + (send_step - step) * s
    step = send_step
    link_free = np.maximum(clock, link_free) + c
    due.append((send_step + tau, link_free))
    wait_through(send_step)  # tau = 0: wait for it now
  # The same fragments are in flight at every round's end.
  assert [d - h for d, _ in due] == carried, (due, carried)
  return max_cycle_mean(np.stack([clock, link_free]
                                 + [arrives for _, arrives in due]))


def max_cycle_mean(a: np.ndarray) -> float:
  """The largest cycle mean of the max-plus matrix a (a[v, u]: the weight
  of u -> v; -inf for none): the growth per application of x -> a (x) x.

  Karp's theorem, with walks allowed to start anywhere: with W_k(v) the
  heaviest k-edge walk ending at v, the mean is
  max_v min_k (W_n(v) - W_k(v)) / (n - k).
  """
  n = len(a)
  walks = np.zeros((n + 1, n))
  for k in range(1, n + 1):
    walks[k] = np.max(a + walks[k - 1][None, :], axis=1)
  best = -np.inf
  for v in range(n):
    if walks[n, v] == -np.inf:
      continue
    best = max(best, min((walks[n, v] - walks[k, v]) / (n - k)
                         for k in range(n) if walks[k, v] > -np.inf))
  return float(best)
