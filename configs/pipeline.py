"""DiLoCoX-style islands: the default run with each island a pipeline of 2
stages (4 islands x 2 stages = 8 devices; a CPU run creates them).

Stage 0 holds layers 0-1 and stage 1 layers 2-3; each keeps the inner AdamW
state and the outer params and Nesterov state of its own layers only (the
embedding, final norm and head are cut into one piece per stage), and the
outer step reduces each stage across the islands in a collective of its
own. It trains as configs/default.py does (the same losses, to float
reassociation), with per-device memory of params and both optimizer states
about halved:

  python -m diloco_jax.main --config=configs/pipeline.py --workdir=runs/pipeline

Try --config.pipeline.schedule=circular --config.pipeline.repeats=2 (half
the bubble), --config.mesh.stage=4, or --config.mesh.stage=1 to compare.
See docs/pipeline.md.
"""

from configs import default


def get_config():
  config = default.get_config()
  config.mesh.stage = 2
  # 2 x stage microbatches (the default, 0): bubble (2 - 1) / (4 + 1) = 20%.
  config.pipeline.microbatches = 0
  config.pipeline.schedule = "gpipe"
  return config
