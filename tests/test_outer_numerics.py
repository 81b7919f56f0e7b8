"""The outer step's numbers do not move: a few cells of
benchmarks/outer_numerics.py trained again, each equal to the committed
fixture bit for bit (x's sha256, the final eval loss, the bytes sent).

The fixture holds every cell (overlap x codec x layout on configs/tiny.py),
written by

  python benchmarks/outer_numerics.py --write=tests/fixtures/outer_numerics.json

under this suite's CPU devices and XLA flags (tests/xla_settings.py). These cells cover each overlap family and each
layout at least once, and every codec; `python benchmarks/outer_numerics.py
--check=tests/fixtures/outer_numerics.json` runs all of them. A change
meant to move the numbers (other operations, another summation order)
rewrites the fixture in the same commit, saying why.
"""

import json
import pathlib

import pytest

from benchmarks import outer_cells

FIXTURE = pathlib.Path(__file__).parent / "fixtures" / "outer_numerics.json"

CELLS = [
    # SparseLoCo's chunked top-k on each FSDP device's pieces.
    "none/sparseloco/fsdp",
    # The plain delay: a mean in flight, flushed at the end.
    "one_step_delay/fp32/plain",
    # The outer side on its own device: anchors crossing, int8 with
    # error feedback (host_outer.RoundOuter).
    "one_step_delay_rebase/int8/host",
    # Eager updates per pipeline stage, past their 2 warm-up rounds, with
    # SparseLoCo's per-island outer states, which hold no array (this cell
    # failed at its first step until they were staged without vmap).
    "eager/sparseloco/stages",
    # Streaming DiLoCo's sends on the outer device (host_outer.FragmentOuter).
    "streaming/int8/host",
]


@pytest.fixture(scope="module")
def fixture():
  if not FIXTURE.exists():
    pytest.fail(f"{FIXTURE} is missing: write it with python "
                f"benchmarks/outer_numerics.py --write={FIXTURE}")
  with open(FIXTURE) as f:
    return json.load(f)


def test_the_cells_cover_each_overlap_layout_and_codec():
  parts = [set(c.split("/")[i] for c in CELLS) for i in range(3)]
  families = {o.split("_rebase")[0].split("_share")[0] for o in parts[0]}
  assert families == {"none", "one_step_delay", "eager", "streaming"}
  assert parts[1] == set(outer_cells.CODECS)
  assert parts[2] == set(outer_cells.DEFAULT_LAYOUTS)


# Elsewhere than where the fixture was written (another CPU model, jax or
# XLA flags), XLA's CPU code may vectorize reductions differently: float
# reassociation over 16 steps of a 2-layer model, so there the numbers
# need only agree to this relative tolerance (and the bytes exactly).
OTHER_MACHINE_RTOL = 1e-4


@pytest.mark.slow
@pytest.mark.parametrize("cell", CELLS)
def test_the_cell_trains_as_the_fixture_says(cell, fixture, tmp_path):
  assert cell in fixture["cells"], f"{cell} is not in {FIXTURE}"
  expected = fixture["cells"][cell]
  got = outer_cells.run_cell(cell, str(tmp_path / "run"))
  notes = outer_cells.environment_note(fixture["environment"],
                                       outer_cells.environment())
  result = outer_cells.compare(
      expected, got, rtol=OTHER_MACHINE_RTOL if notes else 0.0)
  if result["status"] not in (("exact", "close") if notes else ("exact",)):
    pytest.fail(
        f"{cell} moved: {result['why']}; relative differences: eval loss "
        f"{result.get('eval_loss')}, sum of x {result.get('sum')}, sum of "
        f"squares {result.get('sum_squares')}"
        + (f" (the fixture was written elsewhere: {'; '.join(notes)})"
           if notes else ""))
