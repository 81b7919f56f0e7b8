"""The default run set up for a slow link between islands (~10 Mbit/s).

Of the ways to overlap communication with training, the overlaps study
(docs/results.md, configs/study.py, 3 seeds) found Streaming DiLoCo with
4-bit floats the one that wins on both counts at 10 Mbit/s: it loses
nothing measurable against DiLoCo without overlap, and its syncs are hidden
behind training (utilization 1.0 in the network model), each fragment's
collective running on a device of its own while the islands take tau more
steps. Sending e2m1 floats cuts the bytes 7.7x against fp32.

  python -m diloco_jax.main --config=configs/slow_link.py --workdir=runs/slow_link

Where a fragment's sync takes longer than tau inner steps (a slower link,
a bigger model), a whole-round overlap hides more, at a cost in loss over
few rounds (docs/islands.md), best at its own measured outer step in place
of the averaging (sgd, lr 1) this config inherits, which every overlap
keeps unless flags set another:

  --config.diloco.fragments=1 --config.diloco.fragment_delay=0
  --config.diloco.fragment_alpha=0 --config.diloco.overlap=eager
  --config.diloco.outer_optimizer.name=nesterov
  --config.diloco.outer_optimizer.learning_rate=0.5
  --config.diloco.outer_optimizer.momentum=0.7

(one_step_delay_rebase: lr 0.7, momentum 0.5). The log's "outer step:" line
names the overlap's measured step and its flags where the run takes
another. SparseLoCo (--config.diloco.outer_optimizer.name=sparseloco
--config.diloco.codec=fp32) sends its own chunked top-k in place of fp4
and steps by config.diloco.sparseloco.alpha (1, the lr set here); another
alpha takes --config.diloco.outer_optimizer.learning_rate at its value too.
"""

from configs import default


def get_config():
  config = default.get_config()
  # Streaming DiLoCo: 2 fragments of 2 layers, synced at staggered steps;
  # each sync overlaps tau = 5 of the round's 10 steps and is merged half
  # and half with the islands' own progress.
  config.diloco.fragments = 2
  config.diloco.fragment_delay = 5
  config.diloco.fragment_alpha = 0.5
  config.diloco.codec = "fp4"
  # The collectives and outer steps on a device of their own, so they run
  # beside the inner steps (a CPU device set aside on CPU-only hosts).
  config.diloco.outer_placement = "host"
  return config
