"""python -m diloco_jax.elastic --config=configs/tiny.py --workdir=DIR:
a run on elastic islands (each island its own process under Ray)."""

import importlib.util
import sys

from absl import app
from absl import flags
from absl import logging
from ml_collections import config_flags

from diloco_jax.config import config_files
from diloco_jax.config import flag_errors
from diloco_jax.config import problems
from diloco_jax.config import validation

if importlib.util.find_spec("ray") is None:
  raise SystemExit(
      "error: elastic islands run under Ray, which requirements.txt leaves "
      "out: pip install -e '.[elastic]' (or -r requirements-dev.txt)")

# pylint: disable=g-import-not-at-top,wrong-import-position
from diloco_jax.elastic import driver
from diloco_jax.elastic import settings
from diloco_jax.storage import workdir
from diloco_jax.telemetry import quiet_logs

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "A config file (configs/*.py), as for diloco_jax.main.")
_WORKDIR = flags.DEFINE_string(
    "workdir", None, "The run's directory: metrics, the coordinator's "
    "checkpoints; rerun with the same one to resume.")
_RAY_ADDRESS = flags.DEFINE_string(
    "ray_address", None, "A running Ray cluster (ray start --head; "
    "'auto' for this machine's); default: start one here on 127.0.0.1.")
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
  del argv
  logging.get_absl_handler().addFilter(quiet_logs.QuietLibraries())
  config = _CONFIG.value
  try:
    # Every island is a program of its own: the mesh check counts one
    # island's devices, the islands' count being the run's.
    run_config = validation.validate_config(
        config, config.diloco.islands * config.mesh.data, elastic=True)
    settings.check(run_config)
    if _RAY_ADDRESS.value not in (None, "auto"):
      settings.check_answers(_RAY_ADDRESS.value)
  except problems.ConfigError as error:
    raise SystemExit(f"error: {error}") from None
  try:
    summary = driver.run(run_config, _WORKDIR.value, _RAY_ADDRESS.value)
  except (workdir.WorkdirError,  # another coordinator holds it
          problems.ConfigError) as error:  # the cluster cannot place it
    raise SystemExit(f"error: {error}") from None
  said = (f"final eval loss {summary['final_eval_loss']:.4f}, goodput "
          + ("none" if summary["goodput"] is None  # no round ran
             else f"{summary['goodput']:.3f}"))
  if summary.get(driver.ALREADY_FINISHED):
    print(f"the run in {_WORKDIR.value} already finished ({said}); "
          "summary.json is left as it is")
  else:
    print(f"{said}, {summary['wall_seconds']:.1f}s")


def _parse_flags(argv: list[str]) -> list[str]:
  """The flags, or one `error:` line for a mistake in them."""
  remaining, problem = flag_errors.parse_flags(argv, _CONFIG)
  if problem:
    raise SystemExit(f"error: {problem}")
  return remaining


if __name__ == "__main__":
  # Configs that import their siblings load from any directory.
  config_files.importable(sys.argv)
  app.run(main, flags_parser=_parse_flags)
