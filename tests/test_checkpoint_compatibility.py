"""Checkpoints written by earlier versions of diloco_jax resume.

tests/fixtures/checkpoint_96e0b9f holds step 4 of an 8-step run written
before the package was split into subpackages (see its README). Its state
carries every optional field (error-feedback residuals, a low-rank codec
state, a mean in flight, per-island anchors), so a renamed field, a moved
class that changes the pytree or a new required field fails here.

tests/fixtures/checkpoints_21e50ab holds step 4 of an 8-step run per
overlap (one-step delay, eager updates, Streaming DiLoCo, SparseLoCo),
written by tests/fixtures/write_checkpoint_fixtures.py before the
TrainState held the outer object's state as one field: each resumes
through the converter (storage/legacy_state.py).
"""

import json
import os
import shutil

import pytest

from diloco_jax.config import schema as config_schema
from diloco_jax.run import train

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")
FIXTURE = os.path.join(FIXTURES, "checkpoint_96e0b9f")
PER_OVERLAP = os.path.join(FIXTURES, "checkpoints_21e50ab")


def _resumes_as_the_uninterrupted_run(fixture: str, workdir) -> None:
  """The fixture's run, resumed from its step 4 checkpoint with the
  current code, ends where the same run ended uninterrupted."""
  shutil.copytree(fixture, workdir)
  with open(workdir / "config.json") as f:
    config = config_schema.from_record(json.load(f))
  with open(workdir / "expected.json") as f:
    expected = json.load(f)
  summary = train.train_and_evaluate(config, str(workdir))
  # Restoring checks every array against the digests saved with it, and a
  # checkpoint that fails is set aside and the run starts at step 0: a
  # resume from step 4 means the old arrays read back bit for bit (and,
  # for an older state, were converted).
  assert summary["resumed_from_step"] == expected["checkpoint_step"]
  assert summary["rounds"] == 2
  # The 4 steps after the resume recompute what the uninterrupted run did
  # on the machine that wrote the fixture. On another CPU XLA may order
  # sums differently (float32 reassociation, ~1e-7 relative per sum),
  # which 4 AdamW steps and an outer step amplify to about 1e-5 relative
  # in the eval loss at most; 1e-4 leaves a margin of 10.
  assert summary["final_eval_loss"] == pytest.approx(
      expected["final_eval_loss_uninterrupted"], rel=1e-4)


@pytest.mark.slow
def test_a_checkpoint_written_before_the_subpackages_resumes(tmp_path):
  _resumes_as_the_uninterrupted_run(FIXTURE, tmp_path / "run")


@pytest.mark.slow
@pytest.mark.parametrize("overlap", sorted(
    name for name in os.listdir(PER_OVERLAP)
    if os.path.isdir(os.path.join(PER_OVERLAP, name))))
def test_a_checkpoint_of_each_overlap_written_before_the_outer_field_resumes(
    tmp_path, overlap):
  _resumes_as_the_uninterrupted_run(os.path.join(PER_OVERLAP, overlap),
                                    tmp_path / "run")
