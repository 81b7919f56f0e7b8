"""A run's compiled programs, built from shapes, and the outer side on
devices of its own.

  programs.py       the inner step, outer step, eval and checks, compiled
                    from shapes in the background (background.py) while
                    the state loads.
  model_loss.py     the model's loss for the run's layout (pipelined over
                    stages where the islands are staged).
  host_outer.py     config.diloco.outer_placement='host': the outer
                    object's x side on other devices (outer_side.py their
                    base); host_fragments.py Streaming DiLoCo's sends
                    there.
  stage_sends.py    Streaming DiLoCo on pipelined islands: each stage's
                    send and merge compiled on its own devices.

May import storage/ (a checkpoint's integrity check is compiled here) and
the layers below it; knows nothing of the loop or the metrics.
"""
