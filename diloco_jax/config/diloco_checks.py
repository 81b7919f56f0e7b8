"""Checks of config.diloco: the codec, which islands take part, the overlap,
the outer step's placement and Streaming DiLoCo; each records its problems
(validation.py collects them)."""

from diloco_jax.algorithm import compression
from diloco_jax.algorithm import overlap as overlap_lib
from diloco_jax.algorithm import participation
from diloco_jax.codecs import dense as dense_codecs
from diloco_jax.config.problems import Problems
from diloco_jax.config import run_config
from diloco_jax.parallel import outer_devices


def check(config, problems: Problems) -> None:
  """Every check of config.diloco (and of what it asks of the mode)."""
  _check_compression(config, problems)
  _check_participation(config, problems)
  _check_overlap_and_placement(config, problems)
  _check_streaming(config, problems)


def _check_compression(config, problems: Problems) -> None:
  diloco = config.diloco
  problems.require(
      diloco.codec in compression.CODECS, "diloco.codec",
      f"config.diloco.codec={diloco.codec!r} is not one of "
      f"{compression.CODECS}")
  if problems.positive_int(config, "diloco.codec_block_size"):
    problems.require(
        diloco.codec_block_size % 2 == 0, "diloco.codec_block_size",
        f"config.diloco.codec_block_size={diloco.codec_block_size} must be "
        "even (int4 and fp4 pack two values per byte)")
  for field, value in (("fallback_codec", diloco.fallback_codec),
                       ("lowrank.factor_codec", diloco.lowrank.factor_codec)):
    problems.require(
        value in dense_codecs.DENSE_CODECS, f"diloco.{field}",
        f"config.diloco.{field}={value!r} is not one of "
        f"{dense_codecs.DENSE_CODECS}")
  for field, value in (("prune_rate", diloco.prune_rate),
                       ("topk_fraction", diloco.topk_fraction),
                       ("lowrank.energy_fraction",
                        diloco.lowrank.energy_fraction)):
    problems.require(
        isinstance(value, (int, float)) and 0 < value < 1, f"diloco.{field}",
        f"config.diloco.{field}={value!r} must be in (0, 1)")
  ranks = [problems.positive_int(config, f"diloco.lowrank.{name}")
           for name in ("rank", "min_rank", "max_rank")]
  if all(ranks):
    problems.require(
        diloco.lowrank.min_rank <= diloco.lowrank.max_rank,
        "diloco.lowrank.min_rank",
        f"config.diloco.lowrank.min_rank={diloco.lowrank.min_rank} exceeds "
        f"config.diloco.lowrank.max_rank={diloco.lowrank.max_rank}")


def _check_participation(config, problems: Problems) -> None:
  """island_schedule, drop_probability, dropped_islands and the testing
  hook that makes an island diverge."""
  diloco, mode = config.diloco, config.mode
  if diloco.island_schedule and problems.ok("diloco.islands"):
    _parses(problems, "diloco.island_schedule", participation.parse_schedule,
            diloco.island_schedule, diloco.islands)
  problems.require(
      0 <= diloco.drop_probability < 1, "diloco.drop_probability",
      f"config.diloco.drop_probability={diloco.drop_probability} must be in "
      "[0, 1)")
  problems.require(
      diloco.dropped_islands in participation.DROPPED_ISLANDS,
      "diloco.dropped_islands",
      f"config.diloco.dropped_islands={diloco.dropped_islands!r} is not one "
      f"of {participation.DROPPED_ISLANDS}")
  problems.require(
      mode == "diloco" or not (diloco.island_schedule
                               or diloco.drop_probability),
      "diloco.island_schedule",
      "config.diloco.island_schedule and drop_probability are DiLoCo's "
      f"(islands that skip outer steps); config.mode={mode!r}")
  nan_island = config.testing.nan_island
  if nan_island:
    problems.require(
        mode == "diloco", "testing.nan_island",
        f"config.testing.nan_island is for DiLoCo runs; config.mode={mode!r}")
    if problems.ok("diloco.islands"):
      _parses(problems, "testing.nan_island", participation.parse_nan_island,
              nan_island, diloco.islands)


def _parses(problems: Problems, field: str, parse, *args) -> None:
  """Records parse(*args)'s ValueError as the problem of `field`."""
  try:
    parse(*args)
  except ValueError as e:
    problems.require(False, field, f"config.{field}: {e}")


def _check_overlap_warmup(diloco, problems: Problems) -> None:
  warmup = diloco.overlap_warmup_rounds
  if warmup is None:
    return
  field = "diloco.overlap_warmup_rounds"
  problems.require(
      isinstance(warmup, int) and warmup >= 0, field,
      f"config.{field}={warmup} must be a whole number of rounds >= 0")
  problems.require(
      warmup == 0 or overlap_lib.is_eager(diloco.overlap), field,
      f"config.{field}={warmup} delays the start of eager updates; "
      f"config.diloco.overlap={diloco.overlap!r} is not 'eager' or "
      "'eager_share'")


def _check_overlap_and_placement(config, problems: Problems) -> None:
  diloco, mode = config.diloco, config.mode
  problems.require(
      diloco.overlap in overlap_lib.OVERLAPS, "diloco.overlap",
      f"config.diloco.overlap={diloco.overlap!r} is not one of "
      f"{overlap_lib.OVERLAPS}")
  problems.require(
      mode == "diloco" or diloco.overlap == "none", "diloco.overlap",
      f"config.diloco.overlap={diloco.overlap!r} overlaps DiLoCo's outer "
      f"steps; config.mode={mode!r} has none")
  own_weight = diloco.eager_own_weight
  if own_weight is not None:
    problems.require(
        diloco.overlap == "eager", "diloco.eager_own_weight",
        f"config.diloco.eager_own_weight={own_weight} weighs eager updates' "
        f"own pseudo-gradient; config.diloco.overlap={diloco.overlap!r} has "
        "none (set overlap='eager' or leave the weight unset)")
    problems.require(
        0 < own_weight <= 1, "diloco.eager_own_weight",
        f"config.diloco.eager_own_weight={own_weight} must be in (0, 1]")
  _check_overlap_warmup(diloco, problems)
  problems.require(
      diloco.outer_placement in outer_devices.PLACEMENTS,
      "diloco.outer_placement",
      f"config.diloco.outer_placement={diloco.outer_placement!r} is not one "
      f"of {outer_devices.PLACEMENTS}")
  problems.require(
      diloco.outer_placement != "host" or mode == "diloco",
      "diloco.outer_placement",
      "config.diloco.outer_placement='host' places DiLoCo's outer step; "
      f"config.mode={mode!r} has none")


def _check_streaming(config, problems: Problems) -> None:
  """fragments, fragment_delay and fragment_alpha (Streaming DiLoCo)."""
  diloco = config.diloco
  fragments, delay = diloco.fragments, diloco.fragment_delay
  alpha = diloco.fragment_alpha
  if problems.positive_int(config, "diloco.fragments"):
    if problems.ok("model.num_layers"):
      problems.require(
          fragments <= config.model.num_layers, "diloco.fragments",
          f"config.diloco.fragments={fragments} exceeds config.model."
          f"num_layers={config.model.num_layers} (fragments are groups of "
          "consecutive blocks)")
    if problems.ok("diloco.inner_steps"):
      problems.require(
          fragments <= diloco.inner_steps, "diloco.fragments",
          f"config.diloco.fragments={fragments} exceeds config.diloco."
          f"inner_steps={diloco.inner_steps} (each fragment syncs at its own "
          "step of the round)")
  if problems.ok("diloco.inner_steps"):
    problems.require(
        isinstance(delay, int) and not isinstance(delay, bool)
        and 0 <= delay < diloco.inner_steps, "diloco.fragment_delay",
        f"config.diloco.fragment_delay={delay!r} must be an integer in "
        f"[0, config.diloco.inner_steps={diloco.inner_steps})")
  problems.require(
      isinstance(alpha, (int, float)) and 0 <= alpha < 1,
      "diloco.fragment_alpha",
      f"config.diloco.fragment_alpha={alpha!r} must be in [0, 1)")
  if not problems.ok("diloco.fragments", "diloco.fragment_delay",
                     "diloco.fragment_alpha"):
    return
  _check_streaming_composes(config, problems)


def _check_streaming_composes(config, problems: Problems) -> None:
  """What Streaming DiLoCo cannot be combined with."""
  diloco = config.diloco
  if not run_config.is_streaming(diloco):
    return
  problems.require(
      config.mode == "diloco", "diloco.fragments",
      "config.diloco.fragments, fragment_delay and fragment_alpha are "
      f"Streaming DiLoCo's; config.mode={config.mode!r}")
  problems.require(
      diloco.overlap == "none", "diloco.overlap",
      f"config.diloco.overlap={diloco.overlap!r} and Streaming DiLoCo "
      "(fragments, fragment_delay, fragment_alpha) are two ways to overlap; "
      "choose one (fragment_delay overlaps a fragment's sync)")
  problems.require(
      diloco.dropped_islands != "idle", "diloco.dropped_islands",
      "config.diloco.dropped_islands='idle' restarts whole islands at an "
      "outer step; Streaming DiLoCo has none (use 'train')")
