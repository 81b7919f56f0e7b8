"""Each study in experiments/ runs end to end in its --quick setting."""

import json
import math
import os

import pytest

from experiments import codecs
from experiments import h_sweep
from experiments import iid_vs_noniid
from experiments import k_sweep
from experiments import muloco
from experiments import outer_optimizers
from experiments import outer_vs_island_mean
from experiments import overlap_sweep
from experiments import overlaps
from experiments import scaling_outer
from experiments import scaling_overlaps
from experiments import scaling_table2
from experiments import sign_pruning
from experiments import sparseloco
from experiments import plots
from experiments import tables
from experiments import study_lib
from experiments import table2

STUDIES = (table2, h_sweep, k_sweep, iid_vs_noniid, outer_optimizers,
           sign_pruning, codecs, outer_vs_island_mean, overlaps,
           overlap_sweep, scaling_table2, scaling_outer, sparseloco, muloco,
           scaling_overlaps)


@pytest.fixture(scope="module")
def shared_runs(tmp_path_factory):
  """One runs directory for the studies a test process runs: as with
  `--runs`, a point several studies share (the reference DiLoCo run) runs
  once and the others read it back."""
  return str(tmp_path_factory.mktemp("study_runs"))


@pytest.mark.parametrize("module", STUDIES, ids=lambda m: m.STUDY.name)
def test_each_study_runs_quick_and_writes_json_png_and_table(module,
                                                             shared_runs,
                                                             tmp_path):
  study = module.STUDY
  # The spread over seeds is study_lib's, the same for every study: the H
  # sweep (2 points) runs --quick's seeds, the others one seed each, which
  # checks their points, runs and outputs in half the time.
  seeds = list(range(study_lib.QUICK_SEEDS if module is h_sweep else 1))
  out = tmp_path / "out"
  results = study_lib.run_study(study, shared_runs, seeds, quick=True,
                                out_dir=str(out))
  with open(out / f"{study.name}.json") as f:
    assert json.load(f) == json.loads(json.dumps(results))
  with open(out / f"{study.name}.png", "rb") as f:
    assert f.read(8) == b"\x89PNG\r\n\x1a\n"
  table = (out / f"{study.name}.md").read_text()
  points = study_lib.study_points(study, quick=True)
  assert [row["name"] for row in results["points"]] == [p.name
                                                        for p in points]
  for row in results["points"]:
    assert f"| {row['name']} |" in table
    finished = row["eval_loss"]["n"] + row["diverged"]
    assert finished == len(seeds)
  if study.report is not None:  # e.g. the overlaps' utilization
    assert study.report(results) in table
  reference = next(row for row in results["points"]
                   if row["name"] == study.reference)
  assert reference["perplexity_change_vs_reference"]["mean"] == 0.0


def test_a_study_resumes_without_rerunning_finished_runs(tmp_path):
  study = sign_pruning.STUDY
  kwargs = dict(runs_dir=str(tmp_path / "runs"), seeds=[0], quick=True,
                out_dir=str(tmp_path / "out"))
  first = study_lib.run_study(study, **kwargs)
  summary = os.path.join(first["points"][-1]["runs"][0]["workdir"],
                         "summary.json")
  stamp = os.path.getmtime(summary)
  again = study_lib.run_study(study, **kwargs)
  assert os.path.getmtime(summary) == stamp  # read back, not run again
  assert again["points"] == first["points"]


def test_identical_points_of_two_studies_share_one_run(tmp_path):
  one = study_lib.point_config(table2.STUDY, study_lib.Point("diloco", {}),
                               0, quick=True)
  other = study_lib.point_config(sign_pruning.STUDY, sign_pruning.STUDY.points[0],
                                 0, quick=True)
  assert (study_lib.run_workdir("r", one) == study_lib.run_workdir("r", other))
  reseeded = study_lib.point_config(table2.STUDY,
                                    study_lib.Point("diloco", {}), 1, True)
  assert study_lib.run_workdir("r", reseeded) != study_lib.run_workdir("r", one)


def test_paired_perplexity_change_and_spread():
  study = study_lib.Study("s", "t", "c", (), "ref", plots.bar_plot)
  run = lambda seed, loss: {"seed": seed, "status": "done",
                            "final_eval_loss": loss, "comm_bytes": 1,
                            "wall_s": 1.0,
                            "final_eval_loss_island_mean": loss + 0.1}
  runs = {"ref": [run(0, 2.0), run(1, 3.0)],
          "b": [run(0, 2.1), run(1, 3.1)],
          "c": [run(0, 2.1), run(1, 3.0)]}
  points = [study_lib.Point("ref", {}), study_lib.Point("b", {}),
            study_lib.Point("c", {}, reference="b")]
  results = tables.summarize(study, runs, [0, 1], False, points)
  b = results["points"][1]
  assert b["eval_loss"]["mean"] == pytest.approx(2.6)
  assert b["eval_loss"]["std"] == pytest.approx(0.7071068)
  # Paired by seed: the seeds' own spread cancels.
  change = b["perplexity_change_vs_reference"]
  assert change["mean"] == pytest.approx(0.1051709)
  assert change["std"] == pytest.approx(0.0, abs=1e-12)
  # A point may name its own reference.
  c = results["points"][2]
  assert c["reference"] == "b"
  assert c["perplexity_change_vs_reference"]["mean"] == pytest.approx(
      (math.exp(-0.1) - 1) / 2)
  assert "(vs b)" in tables.markdown_table(results)
  # The outer params against the islands' average, per seed.
  assert b["outer_vs_island_mean"]["mean"] == pytest.approx(math.exp(-0.1) - 1)
  assert "outer params vs islands' average" in tables.markdown_table(
      results)
