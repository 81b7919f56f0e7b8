r"""Every study, one after another: the results page's tables and plots
from one command.

  python -m experiments.all --out=docs/results    # each study's seeds (most 3)
  python -m experiments.all --out=docs/results --scale=large

Runs already in --runs are read back, not run again, so with the runs of
earlier study commands this rewrites every STUDY.json, .md and .png in a
minute; from nothing it runs every point (many hours on 2 CPU cores; each
study's docstring gives its own time). --studies picks some by name.
--scale applies to the compute-optimal studies (configs/scaling.py); the
others run configs/study.py and are skipped at --scale=large.
"""

from absl import flags

from experiments import codecs
from experiments import eager_own_weight
from experiments import eager_warmup
from experiments import h_sweep
from experiments import iid_vs_noniid
from experiments import k_sweep
from experiments import muloco
from experiments import outer_optimizers
from experiments import outer_vs_island_mean
from experiments import overlap_sweep
from experiments import overlaps
from experiments import scaling_k_sweep
from experiments import scaling_outer
from experiments import scaling_overlaps
from experiments import scaling_table2
from experiments import sign_pruning
from experiments import sparseloco
from experiments import study_lib
from experiments import table2

MODULES = (table2, h_sweep, k_sweep, iid_vs_noniid, outer_optimizers,
           sign_pruning, codecs, outer_vs_island_mean, overlaps,
           overlap_sweep, scaling_table2, scaling_outer, scaling_k_sweep,
           sparseloco, muloco, scaling_overlaps, eager_own_weight,
           eager_warmup)
STUDIES = {module.STUDY.name: module.STUDY for module in MODULES}

_STUDIES = flags.DEFINE_list(
    "studies", None, f"Which studies (default: all): {', '.join(STUDIES)}.")


def chosen(names, scale: str) -> list[study_lib.Study]:
  """The studies named (all when None) that run at `scale`."""
  unknown = sorted(set(names or ()) - set(STUDIES))
  if unknown:
    raise SystemExit(f"--studies: unknown {', '.join(unknown)}; "
                     f"the studies are {', '.join(STUDIES)}")
  studies = [STUDIES[name] for name in (names or STUDIES)]
  return [s for s in studies if scale == "small" or s.base == "scaling"]


if __name__ == "__main__":
  study_lib.main_many(lambda scale: chosen(_STUDIES.value, scale))
