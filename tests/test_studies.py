"""The studies in experiments/: every point of every study is a valid
config, and the studies that between them use every plot, report and
base config run end to end in their --quick setting."""

import json
import math
import os
import shutil

import pytest

from diloco_jax.config import validation

from experiments import all as all_studies
from experiments import codecs
from experiments import h_sweep
from experiments import iid_vs_noniid
from experiments import overlaps
from experiments import scaling_table2
from experiments import sign_pruning
from experiments import plots
from experiments import tables
from experiments import study_lib
from experiments import table2

STUDIES = all_studies.MODULES
# Run end to end: between them every plot function (bar, sweep, pareto,
# curves, bars and curves, the overlaps' own), the one report, both base
# configs and the spread over seeds. The others differ from these only in
# their points, which test_every_point_of_every_study_is_a_valid_config
# checks without training; a quick run costs 10-80 s of CI.
END_TO_END = (table2, h_sweep, iid_vs_noniid, codecs, overlaps,
              scaling_table2)


@pytest.fixture(scope="module")
def shared_runs(tmp_path_factory):
  """One runs directory for the studies a test process runs: as with
  `--runs`, a point several studies share (the reference DiLoCo run) runs
  once and the others read it back."""
  return str(tmp_path_factory.mktemp("study_runs"))


@pytest.mark.parametrize("module", STUDIES, ids=lambda m: m.STUDY.name)
def test_every_point_of_every_study_is_a_valid_config(module):
  studies = [module.STUDY]
  if module.STUDY.base == "scaling":
    studies = [study_lib.at_scale(module.STUDY, scale)
               for scale in ("small", "large")]
  for study in studies:
    for quick in (False, True):
      points = study_lib.study_points(study, quick)
      assert len({p.name for p in points}) == len(points)
      for point in points:
        config = study_lib.point_config(study, point, seed=1, quick=quick)
        validation.validate_config(config, num_devices=8)
      references = {p.reference or study.reference for p in points}
      assert references <= {p.name for p in points}


@pytest.mark.slow
@pytest.mark.parametrize("module", END_TO_END, ids=lambda m: m.STUDY.name)
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
  # Each point against its reference, from the summaries the runs wrote:
  # the perplexity change, seed by seed, and the table's figure.
  final_losses = {row["name"]: {run["seed"]: _summary(run)["final_eval_loss"]
                                for run in row["runs"]
                                if run["status"] == "done"}
                  for row in results["points"]}
  changes = []
  for row in results["points"]:
    reference = final_losses[row["reference"]]
    paired = [math.exp(loss - reference[seed]) - 1
              for seed, loss in final_losses[row["name"]].items()
              if seed in reference]
    change = row["perplexity_change_vs_reference"]["mean"]
    if not paired:  # every seed diverged
      assert change is None
      continue
    assert change == pytest.approx(sum(paired) / len(paired), abs=1e-12)
    if row["name"] != row["reference"]:
      assert f"{100 * change:+.2f}%" in table
      changes.append(change)
  # The points differ: some change is not 0 (a change taken against the
  # point itself would be exactly 0 everywhere).
  assert any(change != 0 for change in changes)


def _summary(run: dict) -> dict:
  with open(os.path.join(run["workdir"], "summary.json")) as f:
    return json.load(f)


@pytest.mark.slow
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
  # Runs copied from another machine without their checkpoints: the
  # summaries alone count as finished runs.
  for row in first["points"]:
    for run in row["runs"]:
      shutil.rmtree(os.path.join(run["workdir"], "checkpoints"),
                    ignore_errors=True)
  without_checkpoints = study_lib.run_study(study, **kwargs)
  assert os.path.getmtime(summary) == stamp
  assert without_checkpoints["points"] == first["points"]


def test_identical_points_of_two_studies_share_one_run(tmp_path):
  one = study_lib.point_config(table2.STUDY, study_lib.Point("diloco", {}),
                               0, quick=True)
  other = study_lib.point_config(sign_pruning.STUDY, sign_pruning.STUDY.points[0],
                                 0, quick=True)
  assert (study_lib.run_workdir("r", one) == study_lib.run_workdir("r", other))
  reseeded = study_lib.point_config(table2.STUDY,
                                    study_lib.Point("diloco", {}), 1, True)
  assert study_lib.run_workdir("r", reseeded) != study_lib.run_workdir("r", one)


def test_eager_runs_are_found_by_the_rule_they_ran():
  """'eager' unset and with an own weight of 1 are one run; the share
  ('eager_share', cached as 'eager' before the rename) is another."""
  def workdir(overrides):
    return study_lib.run_workdir("r", study_lib.point_config(
        table2.STUDY, study_lib.Point("p", overrides), 0, quick=True))
  eager = workdir({"diloco.overlap": "eager"})
  assert eager == workdir({"diloco.overlap": "eager",
                           "diloco.eager_own_weight": 1.0})
  assert eager != workdir({"diloco.overlap": "eager_share"})
  assert eager != workdir({"diloco.overlap": "eager",
                           "diloco.eager_own_weight": 0.5})
  # Eager's warm-up (2 rounds unless set) is another run than the rule
  # from its first round, which is found as runs cached before the field.
  assert eager == workdir({"diloco.overlap": "eager",
                           "diloco.overlap_warmup_rounds": 2})
  at_once = workdir({"diloco.overlap": "eager",
                     "diloco.overlap_warmup_rounds": 0})
  assert eager != at_once
  before = study_lib.point_config(
      table2.STUDY, study_lib.Point("p", {"diloco.overlap": "eager",
                                            "diloco.eager_own_weight": 1.0}),
      0, quick=True)
  with before.unlocked():
    del before.diloco["overlap_warmup_rounds"]
  assert at_once == study_lib.run_workdir("r", before)
  assert workdir({"diloco.overlap": "eager_share"}) == workdir(
      {"diloco.overlap": "eager_share", "diloco.overlap_warmup_rounds": 0})


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


def test_a_sweep_plot_against_the_reference_shows_the_paired_changes(
    tmp_path, monkeypatch):
  import matplotlib.axes  # pylint: disable=g-import-not-at-top
  drawn = []
  monkeypatch.setattr(matplotlib.axes.Axes, "errorbar",
                      lambda self, x, y, yerr, **_: drawn.append((x, y, yerr)))
  study = study_lib.Study("s", "t", "c", (), "ref", plots.bar_plot)
  run = lambda seed, loss: {"seed": seed, "status": "done",
                            "final_eval_loss": loss, "comm_bytes": 1,
                            "wall_s": 1.0}
  runs = {"ref": [run(0, 2.0), run(1, 3.0)],
          "a": [run(0, 2.1), run(1, 3.1)],
          "b": [run(0, 2.0), run(1, 3.2)]}
  points = [study_lib.Point("ref", {}), study_lib.Point("a", {}, x=0.5),
            study_lib.Point("b", {}, x=1.0)]
  results = tables.summarize(study, runs, [0, 1], False, points)
  path = tmp_path / "sweep.png"
  plots.sweep_plot("x", versus_reference=True)(results, str(path))
  # One line over the points with an x (the reference has none), in percent
  # of perplexity against the reference, spread by seed.
  [(xs, changes, spreads)] = drawn
  assert xs == [0.5, 1.0]
  assert changes == pytest.approx(
      [100 * (math.exp(0.1) - 1), 100 * (math.exp(0.2) - 1) / 2])
  assert spreads[0] == pytest.approx(0.0, abs=1e-9)
  assert spreads[1] == pytest.approx(100 * (math.exp(0.2) - 1) / math.sqrt(2))
  assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_all_runs_every_study_module_once_and_checks_names():
  modules = {os.path.splitext(name)[0] for name in os.listdir("experiments")
             if name.endswith(".py")}
  # Not studies: the library, the network model's tables, the codec
  # sweep over main (one run per codec) and the run comparer.
  helpers = {"__init__", "all", "study_lib", "tables", "plots",
             "network_model", "codec_sweep", "compare_runs"}
  assert {m.__name__.split(".")[-1] for m in STUDIES} == modules - helpers
  assert [s.name for s in all_studies.chosen(None, "large")] == [
      m.STUDY.name for m in STUDIES if m.STUDY.base == "scaling"]
  assert all_studies.chosen(["table2"], "small") == [table2.STUDY]
  with pytest.raises(SystemExit, match="unknown tabel2"):
    all_studies.chosen(["tabel2"], "small")
