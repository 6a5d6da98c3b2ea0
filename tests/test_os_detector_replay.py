"""experiments/os_detector_replay.py on a recorded-looking run: a busy neighbour for 30 s."""
import json

import numpy as np

from experiments import os_detector_replay

T0 = 1_800_000_000


def _run(tmp_path, shift):
  """Two ranks, 150 s of per-second shares ~ 0.8 + common load + own noise (the measured
  spread); rank 1 + `shift` while its contend fault runs (seconds 60-90)."""
  rng = np.random.default_rng(3)
  (tmp_path / "resilience" / "faults").mkdir(parents=True)
  (tmp_path / "resilience" / "faults" / "0-contend-driver.json").write_text(json.dumps(
      {"fault": "contend:rank=1:step=9:seconds=30", "time": T0 + 60.0}))
  with open(tmp_path / "resilience" / "monitor.jsonl", "w") as f:
    for second in range(150):
      load = rng.normal(0, 0.045)
      for rank in (0, 1):
        share = 0.8 + load + rng.normal(0, 0.031) + (shift if rank == 1 and 60 <= second <= 90
                                                     else 0.0)
        f.write(json.dumps({"attempt": 0, "rank": rank,
                            "samples": [{"t": T0 + second + 0.2, "runq_wait_share": share}]})
                + "\n")
  return os_detector_replay.one_run(str(tmp_path), [(5, 0.1), (10, 0.05)])


def test_the_victim_is_flagged_at_the_new_setting_and_healthy_seconds_are_measured(tmp_path):
  out = _run(tmp_path, shift=0.08)
  (contend,) = out["contend"]
  assert contend["rank"] == 1 and 0.03 < contend["excess_median"] < 0.13
  new = out["settings"]["smooth 10 s, threshold 0.05"]
  assert new["other_flags"] == 0 and 10 <= new["victim_flagged_after_s"] <= 31
  spread = out["healthy_spread"]["10s_means"]
  assert spread["seconds"] == 60 and spread["max"] < 0.05   # the fault and 60 s after: out


def test_nothing_is_flagged_without_a_fault(tmp_path):
  out = _run(tmp_path, shift=0.0)
  assert all(s["victim_flagged_after_s"] is None and s["other_flags"] == 0
             for s in out["settings"].values())
