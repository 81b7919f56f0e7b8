"""What runs cost, computed from shapes and configs; nothing here trains.

  flops.py          model FLOPs per token and devices' peak FLOP/s.
  link_bytes.py     bytes one island sends for each thing a run does.
  network_model.py  an analytic model of a round over a slow link: time,
                    stalls, utilization, the bandwidth a target needs;
                    link_queue.py solves collectives queued on the link.
  star_channel.py   the elastic channel: a round's exchange through a
                    central coordinator against a ring all-reduce.
  workloads.py      the network model's workloads from a params tree, a
                    codec or a run's config, and summary.json's estimate.

May import codecs/, parallel/, algorithm/, model/ and config/.
"""
