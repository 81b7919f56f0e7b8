"""benchmarks/spmd_restarts.py: the SPMD job's kill moments, taken from the
elastic failure schedule, and the watcher's reading of metrics.jsonl."""
import json

from benchmarks import spmd_restarts


def test_a_short_last_round_dies_at_its_only_step():
  # 9 steps of H=4: round 3 is step 9 alone. Whatever step of the round
  # each island's draw gives, the elastic island dies before its last one
  # (step 9), so the SPMD job is killed once step 8 is recorded.
  moments = spmd_restarts.kills([(i, 3) for i in range(4)], 0, seed=0,
                                inner_steps=4, total_steps=9)
  assert [k.step for k in moments] == [8] * 4
  assert not any(k.at_checkpoint for k in moments)


def test_kills_come_in_order_within_their_rounds():
  moments = spmd_restarts.kills([(0, 5), (1, 2)], 3, seed=7, inner_steps=4,
                                total_steps=40)
  assert [k.what for k in moments] == [
      "island 1 in round 2", "coordinator after round 3",
      "island 0 in round 5"]
  island_2, coordinator, island_5 = moments
  assert 4 <= island_2.step < 8 and 16 <= island_5.step < 20
  assert coordinator.step == 12 and coordinator.at_checkpoint


def test_the_coordinator_of_the_last_round_dies_at_the_last_checkpoint():
  (kill,) = spmd_restarts.kills([], 3, seed=0, inner_steps=4, total_steps=9)
  assert kill.step == 9 and kill.at_checkpoint


def test_last_recorded_step_skips_a_torn_line(tmp_path):
  metrics = tmp_path / "metrics.jsonl"
  assert spmd_restarts.last_recorded_step(metrics) == 0  # not written yet
  # More than the tail the watcher reads, and a last line cut by a kill.
  records = [json.dumps({"step": s, "train_loss": 1.0, "pad": "x" * 200})
             for s in range(1, 101)]
  metrics.write_text("\n".join(records) + '\n{"step": 101, "tra')
  assert spmd_restarts.last_recorded_step(metrics) == 100
