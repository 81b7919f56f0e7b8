"""What an elastic run is allowed to be: config.elastic checked, and the
settings elastic islands do not run yet refused, each in one line before
Ray or any compile starts."""

import dataclasses
import os
import socket

from diloco_jax.algorithm import participation
from diloco_jax.config import problems as problems_lib
from diloco_jax.config import run_config as run_config_lib
from diloco_jax.elastic import netns
from diloco_jax.elastic import speeds as speeds_lib


@dataclasses.dataclass(frozen=True)
class ElasticSettings:
  """config.elastic, checked.

  Attributes:
    min_islands: a round closes once this many islands have sent.
    grace_seconds: how long it then waits for the others.
    max_restarts: how often a dead island's process is restarted.
    kill_islands: (island, 1-based round) pairs: that island's process
      kills itself once during that round (tests, benchmarks).
    slow_islands: (island, 1-based round) pairs: that island sleeps
      `slow_seconds` before that round's first step (a straggler).
    stale_rounds: how many rounds late an island's result may arrive and
      still be applied (0: a late result is dropped).
    round_budget: 'steps' (H inner steps per island a round) or 'time'
      (the fastest island's H steps' time; speeds.py).
    asynchronous: each result applied as it arrives, no island waiting
      for a round (arrivals.py).
    kill_after: (island, 1-based round) pairs: that island's process
      kills itself once right after its result of that round reached the
      coordinator (tests: config.testing.kill_island's 'ISLAND@ROUND:after').
    speeds: per island, the factor its steps are slowed by (tests,
      benchmarks; all 1.0 normally).
    pin_islands: island i runs only on a node offering the Ray resource
      diloco_island_i (fleet.island_resource), not where SPREAD puts it.
  """
  min_islands: int
  grace_seconds: float
  max_restarts: int
  kill_islands: tuple[tuple[int, int], ...]
  slow_islands: tuple[tuple[int, int], ...] = ()
  slow_seconds: float = 0.0
  stale_rounds: int = 0
  round_budget: str = "steps"
  speeds: tuple[float, ...] = ()
  pin_islands: bool = False
  kill_after: tuple[tuple[int, int], ...] = ()
  link_mbit: float = 0.0
  link_delay_ms: float = 0.0
  overlap_rounds: bool = True
  asynchronous: bool = False


# (setting, the value elastic islands need, why) for what they do not run
# yet: each island is one program of one island, synced by the plain outer
# step at the coordinator.
_NOT_YET = (
    ("mode", "diloco", "elastic islands run DiLoCo"),
    ("diloco.outer_placement", "device",
     "the coordinator holds the outer state"),
    ("diloco.drop_probability", 0.0,
     "elastic rounds leave out the islands that fail, not drawn ones"),
    ("pretrain_steps", 0, "elastic runs start from the seed's model"),
    ("init_from", "", "elastic runs start from the seed's model"),
    ("testing.nan_island", "",
     "elastic islands are tested by killing their processes"),
)
# The same for Streaming DiLoCo's runs (fragments, fragment_delay or
# fragment_alpha set).
_STREAMING_NOT_YET = (
    ("mesh.stage", 1, "Streaming DiLoCo on pipelined islands sends each "
     "stage's share of every leaf (algorithm/stage_fragments.py); elastic "
     "islands send fragments of whole blocks"),
    ("elastic.stale_rounds", 0, "under Streaming DiLoCo a late result "
     "carries another fragment than the round it lands in sends"),
    ("diloco.island_schedule", "", "an elastic island out of the membership "
     "has no process, and Streaming DiLoCo's islands out of it train on "
     "(dropped_islands='train')"),
)


def check(run_config: run_config_lib.RunConfig) -> ElasticSettings:
  """config.elastic of a validated run, or ConfigError in one line."""
  config = run_config.config
  for name, needed, why in _NOT_YET + (
      _STREAMING_NOT_YET if run_config.streaming else ()):
    value = config
    for part in name.split("."):
      value = value[part]
    if value != needed:
      raise problems_lib.ConfigError(
          f"config.{name}={value!r} with python -m diloco_jax.elastic: "
          f"{why} (config.{name}={needed!r})")
  diloco = run_config.diloco
  if diloco.island_schedule and not diloco.restart_dropped:
    raise problems_lib.ConfigError(
        f"config.diloco.island_schedule={diloco.island_schedule!r} "
        f"with config.diloco.dropped_islands="
        f"{diloco.dropped_islands!r}: an elastic island out of the "
        "membership has no process, so it cannot train on "
        "(config.diloco.dropped_islands='idle')")
  elastic, islands = config.elastic, run_config.islands
  min_islands = elastic.min_islands or islands
  if not (isinstance(elastic.min_islands, int)
          and 0 <= elastic.min_islands <= islands):
    raise problems_lib.ConfigError(
        f"config.elastic.min_islands={elastic.min_islands!r} must be 0 (all) "
        f"to config.diloco.islands={islands}")
  grace = elastic.grace_seconds
  if isinstance(grace, bool) or not isinstance(grace, (int, float)) or not (
      grace >= 0):
    raise problems_lib.ConfigError(
        f"config.elastic.grace_seconds={grace!r} must be a number >= 0")
  restarts = elastic.max_restarts
  if isinstance(restarts, bool) or not isinstance(restarts, int) or (
      restarts < 0):
    raise problems_lib.ConfigError(
        f"config.elastic.max_restarts={restarts!r} must be a whole number "
        ">= 0")
  stale = elastic.stale_rounds
  if isinstance(stale, bool) or not isinstance(stale, int) or stale < 0:
    raise problems_lib.ConfigError(
        f"config.elastic.stale_rounds={stale!r} must be a whole number >= 0")
  kill, kill_after = _kills(config.testing.kill_island, islands)
  slow = _islands_at(config.testing.slow_island, "slow_island", islands)
  slow_seconds = config.testing.slow_seconds
  if slow and not (isinstance(slow_seconds, (int, float))
                   and slow_seconds >= 0):
    raise problems_lib.ConfigError(
        f"config.testing.slow_seconds={slow_seconds!r} must be >= 0")
  if elastic.round_budget not in speeds_lib.ROUND_BUDGETS:
    raise problems_lib.ConfigError(
        f"config.elastic.round_budget={elastic.round_budget!r} is not one "
        f"of {speeds_lib.ROUND_BUDGETS}")
  if elastic.round_budget == "time" and run_config.streaming:
    raise problems_lib.ConfigError(
        "config.elastic.round_budget='time' with config.diloco.fragments="
        f"{run_config.diloco.fragments}: Streaming DiLoCo's rounds end at its "
        "fragments' sends, on the schedule's steps "
        "(config.elastic.round_budget='steps')")
  try:
    speeds = speeds_lib.parse_speeds(config.testing.island_speeds, islands)
  except ValueError as error:
    raise problems_lib.ConfigError(
        f"config.testing.island_speeds: {error}") from None
  if not isinstance(elastic.overlap_rounds, bool):
    raise problems_lib.ConfigError(
        f"config.elastic.overlap_rounds={elastic.overlap_rounds!r} must be "
        "True or False")
  if not isinstance(elastic.pin_islands, bool):
    raise problems_lib.ConfigError(
        f"config.elastic.pin_islands={elastic.pin_islands!r} must be True "
        "or False")
  _check_asynchronous(run_config)
  link_mbit, link_delay_ms = _link(elastic)
  return ElasticSettings(min_islands, float(grace), restarts, kill, slow,
                         float(slow_seconds), stale, elastic.round_budget,
                         speeds, kill_after=kill_after,
                         pin_islands=elastic.pin_islands or link_mbit > 0,
                         link_mbit=link_mbit, link_delay_ms=link_delay_ms,
                         overlap_rounds=elastic.overlap_rounds,
                         asynchronous=elastic.asynchronous)


def _check_asynchronous(run_config) -> None:
  """config.elastic.asynchronous, and what it cannot go with: the
  overlaps (they hide a round's wait, and asynchronous islands never
  wait) and the quorum's settings (no round closes on a quorum)."""
  elastic = run_config.config.elastic
  if not isinstance(elastic.asynchronous, bool):
    raise problems_lib.ConfigError(
        f"config.elastic.asynchronous={elastic.asynchronous!r} must be True "
        "or False")
  if not elastic.asynchronous:
    return
  why = ("asynchronous islands never wait for a round, which is the wait "
         "the overlaps hide")
  if run_config.streaming:
    raise problems_lib.ConfigError(
        f"config.diloco.fragments={run_config.diloco.fragments} with "
        f"config.elastic.asynchronous=True: {why} (Streaming DiLoCo: "
        "config.diloco.fragments=0)")
  if run_config.diloco.overlap_mode != "none":
    raise problems_lib.ConfigError(
        f"config.diloco.overlap={run_config.diloco.overlap_mode!r} with "
        f"config.elastic.asynchronous=True: {why} "
        "(config.diloco.overlap='none')")
  for name, default in (("min_islands", 0), ("grace_seconds", 0.0),
                        ("stale_rounds", 0)):
    if elastic[name] != default:
      raise problems_lib.ConfigError(
          f"config.elastic.{name}={elastic[name]!r} with "
          "config.elastic.asynchronous=True: no round closes on a quorum; "
          "each result is applied when it arrives, weighed down when "
          f"overtaken (config.elastic.{name}={default!r})")


def _link(elastic) -> tuple[float, float]:
  """(link_mbit, link_delay_ms) of config.elastic, checked: numbers >= 0,
  a delay only on a shaped link, and the shaping's needs (root; netem for
  a delay) met on this machine."""
  values = {}
  for name in ("link_mbit", "link_delay_ms"):
    value = elastic[name]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
        0 <= value < float("inf")):
      raise problems_lib.ConfigError(
          f"config.elastic.{name}={value!r} must be a number >= 0")
    values[name] = float(value)
  mbit, delay = values["link_mbit"], values["link_delay_ms"]
  if delay and not mbit:
    raise problems_lib.ConfigError(
        f"config.elastic.link_delay_ms={delay:g} needs a shaped link: set "
        "config.elastic.link_mbit too")
  if mbit and os.geteuid() != 0:
    raise problems_lib.ConfigError(
        f"config.elastic.link_mbit={mbit:g} puts each island behind a "
        "shaped link in a network namespace of its own, which needs root: "
        "run the command as root, or leave config.elastic.link_mbit at 0")
  if delay and not netns.netem_available():
    raise problems_lib.ConfigError(
        f"config.elastic.link_delay_ms={delay:g} needs tc's netem, which "
        "this kernel lacks (modprobe sch_netem): leave the delay at 0 for a "
        "rate-limited link alone")
  return mbit, delay


def _kills(spec: str, islands: int) -> tuple[tuple[tuple[int, int], ...],
                                             tuple[tuple[int, int], ...]]:
  """config.testing.kill_island's (island, round) pairs: those killed
  during the round ('ISLAND@ROUND'), and those killed right after their
  result of the round reached the coordinator ('ISLAND@ROUND:after')."""
  during, after = [], []
  for entry in spec.split(","):
    at, _, when = entry.partition(":")
    if when.strip() not in ("", "after"):
      raise problems_lib.ConfigError(
          f"config.testing.kill_island: {entry.strip()!r} is not "
          "'ISLAND@ROUND' or 'ISLAND@ROUND:after'")
    (after if when.strip() else during).append(at)
  return (_islands_at(",".join(during), "kill_island", islands),
          _islands_at(",".join(after), "kill_island", islands))


def _islands_at(spec: str, name: str,
                islands: int) -> tuple[tuple[int, int], ...]:
  """'ISLAND@ROUND[,ISLAND@ROUND...]' of config.testing.<name> as
  (island, round) pairs."""
  try:
    return tuple(participation.parse_nan_island(entry, islands)
                 for entry in spec.split(",") if entry.strip())
  except ValueError as error:
    raise problems_lib.ConfigError(
        f"config.testing.{name}: {error}") from None


def check_answers(address: str, timeout_seconds: float = 5.0) -> None:
  """ConfigError in one line unless a Ray cluster's HOST:PORT accepts a
  connection (before anything is written or compiled)."""
  host, _, port = address.rpartition(":")
  try:
    with socket.create_connection((host, int(port)), timeout_seconds):
      pass
  except (OSError, ValueError) as error:
    raise problems_lib.ConfigError(
        f"--ray_address={address!r} does not answer ({error}): start the "
        "cluster first (ray start --head) or leave the flag out") from None
