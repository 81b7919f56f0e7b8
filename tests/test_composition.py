"""What composes with what: every codec x overlap x island layout.

The cells are configs/composition.py's: the tiny config with 2 layers,
batch 8 and 2 islands over the 8 CPU devices conftest forces. Every cell
validates (or would be refused with one line per pair of settings that
cannot be combined, the line naming both settings; REFUSED_PAIRS lists
them, each a limit docs/islands.md states), and a cover of 24 cells
trains: every (overlap, layout) pair once, the 7 codecs spread over them
(benchmarks/composition.py trains all 168).
"""

import itertools
import json
import math
import pathlib
import subprocess
import sys

import jax
import numpy as np
import pytest

from configs import composition
from diloco_jax.config import validation
from diloco_jax.parallel import outer_devices
from tests import helpers
from tests import test_checkpoint

REPO = pathlib.Path(__file__).resolve().parents[1]
CODECS = composition.CODECS
OVERLAPS = composition.OVERLAPS
LAYOUTS = composition.LAYOUTS
# Each refused pair: when it applies to a cell, and the two settings its
# one line names (as they appear in the message). Every cell composes now;
# the check stays for the next limit (and a refusal outside the matrix is
# tested below).
REFUSED_PAIRS = {}


def _config(codec: str, overlap: str, layout: str):
  return composition.cell_config(codec, overlap, layout)


def _validate(config):
  """Validates as train does: the outer device comes out of the devices."""
  devices = jax.devices()
  if config.diloco.outer_placement == "host":
    devices, _ = outer_devices.split_devices(devices)
  validation.validate_config(config, len(devices))


def _problem_lines(error: validation.ConfigError) -> list[str]:
  message = str(error)
  if "\n" not in message:
    return [message]
  return [line.strip() for line in message.splitlines()[1:]]


def _names(line: str, setting: str) -> bool:
  return any(name in line for name in setting.split("|"))


CELLS = list(composition.CELLS)


def test_the_matrix_accepts_all_but_the_refused_pairs():
  accepted, refused_lines = [], {}
  for cell in CELLS:
    pairs = [name for name, (applies, _) in REFUSED_PAIRS.items()
             if applies(*cell)]
    try:
      _validate(_config(*cell))
    except validation.ConfigError as e:
      lines = _problem_lines(e)
      assert pairs, f"{cell} refused: {e}"
      # One line per refused pair, each naming both of its settings.
      assert len(lines) == len(pairs), (cell, lines)
      for name in pairs:
        settings = REFUSED_PAIRS[name][1]
        assert any(all(_names(line, s) for s in settings) for line in lines), (
            cell, name, lines)
      refused_lines[cell] = lines
    else:
      assert not pairs, f"{cell} validated, but {pairs} should refuse it"
      accepted.append(cell)
  # The count docs/islands.md's table states.
  assert (len(accepted), len(CELLS)) == (168, 168)


def test_fragments_that_are_not_the_stages_are_one_line_naming_both():
  """On pipelined islands a fragment is a stage: any other count is
  refused in one line that names both settings and the count to set."""
  for fragments in (1, 4):
    config = _config("fp32", "streaming", "stages")
    config.model.num_layers = 4  # room for 4 fragments
    config.diloco.fragments = fragments
    config.diloco.fragment_delay = 1
    try:
      _validate(config)
    except validation.ConfigError as e:
      lines = _problem_lines(e)
    else:
      raise AssertionError(f"fragments={fragments} with 2 stages validated")
    assert len(lines) == 1, lines
    assert all(name in lines[0] for name in (
        f"config.diloco.fragments={fragments}", "config.mesh.stage=2",
        "--config.diloco.fragments=2")), lines


def _cover() -> list[tuple[str, str, str]]:
  """Every (overlap, layout) pair once, the codecs in turn over them (the
  pairs taken overlap by overlap, so each codec meets several overlaps and
  layouts), started so that SparseLoCo takes eager updates on 2 stages:
  the cell that once crashed at its first outer step."""
  pairs = list(itertools.product(OVERLAPS, LAYOUTS))
  codecs = list(CODECS)
  offset = (codecs.index("sparseloco")
            - pairs.index(("eager", "stages"))) % len(codecs)
  return [(codecs[(i + offset) % len(codecs)], overlap, layout)
          for i, (overlap, layout) in enumerate(pairs)]


COVER = _cover()


def test_the_cover_spreads_every_codec_over_the_layouts():
  assert len(COVER) == len(OVERLAPS) * len(LAYOUTS) == 24
  assert {(o, l) for _, o, l in COVER} == set(itertools.product(OVERLAPS,
                                                                LAYOUTS))
  for codec in CODECS:
    cells = [c for c in COVER if c[0] == codec]
    assert len(cells) >= 3, codec
    assert len({layout for _, _, layout in cells}) >= 3, codec
    assert len({overlap for _, overlap, _ in cells}) >= 2, codec
  assert ("sparseloco", "eager", "stages") in COVER


def _run(codec: str, overlap: str, layout: str):
  """The cell's 2 rounds, trained once per test run: (workdir, summary)."""
  return helpers.shared_run(f"composition_{codec}_{overlap}_{layout}",
                            _config(codec, overlap, layout))


@pytest.mark.slow
@pytest.mark.parametrize("codec,overlap,layout", COVER,
                         ids=[",".join(c) for c in COVER])
def test_a_cell_of_the_cover_trains(codec, overlap, layout):
  """2 rounds: every step recorded once, the loss finite, the final eval
  below the first (after round 1), and bytes sent through the codec."""
  workdir, summary = _run(codec, overlap, layout)
  records = test_checkpoint._metrics(workdir)
  assert [r["step"] for r in records] == list(range(1, 9))
  assert all(math.isfinite(r["train_loss"]) for r in records)
  evals = [r["eval_loss"] for r in records if "eval_loss" in r]
  assert len(evals) == 2 and evals[-1] == summary["final_eval_loss"]
  assert math.isfinite(evals[-1]) and evals[-1] < evals[0], evals
  assert summary["rounds"] == 2 and summary["comm_bytes"] > 0


# Float32 sums over the same values in another order (the pipeline's 4
# microbatches against one batch, each stage's collective against one over
# every leaf) differ by a few ulp a step; after 8 steps of AdamW at these
# sizes the runs' losses agree to about 1e-6 relative (test_pipeline.py's
# one-stage equalities measure the same).
LOSS_RTOL = 1e-5
PARAMS_RTOL, PARAMS_ATOL = 1e-4, 1e-5  # as test_pipeline.py's


@pytest.mark.slow
def test_eager_updates_on_two_stages_equal_the_unpipelined_run():
  """Eager updates on 2 stages (fp32) take the same operations as on one:
  the same run to float reassociation."""
  staged, staged_summary = _run("fp32", "eager", "stages")
  plain, plain_summary = _run("fp32", "eager", "plain")
  for a, b in zip(test_checkpoint._metrics(staged),
                  test_checkpoint._metrics(plain), strict=True):
    assert a["train_loss"] == pytest.approx(b["train_loss"], rel=LOSS_RTOL)
  assert staged_summary["final_eval_loss"] == pytest.approx(
      plain_summary["final_eval_loss"], rel=LOSS_RTOL)


@pytest.mark.slow
def test_sparseloco_on_two_stages_chunks_each_stage_s_piece():
  """The cell that crashed (SparseLoCo, eager updates, 2 stages) after its
  first outer step, against the same on one stage. Each layer lives whole
  on one stage and is chunked as on one: its values equal the unpipelined
  run's to float reassociation. The other leaves (the embedding, the final
  norm) are cut in S pieces, one per stage, and each stage's top-k picks
  within the chunks of its own piece: other chunks than the whole leaf's,
  so another (equally sparse) selection, by design."""
  runs = {}
  for layout in ("stages", "plain"):
    config = _config("sparseloco", "eager", layout)
    config.total_steps = config.diloco.inner_steps  # one round
    workdir, _ = helpers.shared_run(f"composition_one_round_{layout}",
                                    config)
    runs[layout] = test_checkpoint._final_state(workdir)
  for part in ("global_params", "island_params"):
    staged, plain = runs["stages"][part], runs["plain"][part]
    helpers.assert_trees_close(staged["blocks"], plain["blocks"],
                               rtol=PARAMS_RTOL, atol=PARAMS_ATOL)
    differs = jax.tree.map(
        lambda a, b: not np.allclose(a, b, rtol=PARAMS_RTOL,
                                     atol=PARAMS_ATOL),
        staged["embed"], plain["embed"])
    assert any(jax.tree.leaves(differs)), part  # the chunks differ there


@pytest.mark.slow
def test_the_script_runs_a_cell_and_names_a_refusal(tmp_path):
  """benchmarks/composition.py end to end on a cell elastic islands refuse
  (the outer step on devices of its own): its record says 'refused' with
  the run's one line, and its table counts it."""
  out = tmp_path / "cells.json"
  done = subprocess.run(
      [sys.executable, str(REPO / "benchmarks" / "composition.py"),
       "--runtime=elastic", "--cell=fp32,none,outer_device",
       f"--out={out}"], cwd=REPO, capture_output=True, text=True,
      timeout=300, check=False)
  assert done.returncode == 0, done.stderr[-3000:]
  [record] = json.loads(out.read_text())["cells"]
  assert record["outcome"] == "refused", record
  assert record["line"].startswith(
      "error: config.diloco.outer_placement='host'"), record
  assert "1 refused of 1 cells" in done.stdout
