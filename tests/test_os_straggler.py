"""The threshold detector on the workers' per-second run-queue wait share (observer.py,
straggler.SecondTable / unit 'excess'). The metric itself is tested against a real busy process
in tests/test_monitor.py; here the detector's logic on noisy series of the measured spread."""
import numpy as np
import pytest

from mscale_jax.observability import straggler
from mscale_jax.observability.observer import Observer
from mscale_jax.resilience import events

T0 = 1_800_000_000


class _Proc:
  def poll(self):
    return None


class _Group:
  attempt, started = 0, 0.0

  def __init__(self, n):
    self.slots = list(range(10, 10 + n))
    self.procs = [_Proc() for _ in range(n)]


def _beat(rank, second, share, majflt=0.0):
  return events.Heartbeat(rank=rank, host="h", pid=1, phase=events.TRAINING, step=second,
                          monitor=[{"t": T0 + second + 0.3, "runq_wait_share": share,
                                    "majflt_per_s": majflt}])


def _run(workdir, n, victim, *, shift, seed, os_detector=True, seconds=60, onset=20,
         faults=0.0):
  """Feeds `seconds` heartbeats per rank: shares 0.6 + a load term common to all ranks
  N(0, 0.045) + each rank's own N(0, 0.031) (healthy ranks in the fault drill's fault-free run:
  0.058 per rank, 0.044 between two ranks, per second; straggler.OS_THRESHOLDS),
  `victim` + `shift` from `onset` on; major faults ~ Poisson(1) on every rank, +
  Poisson(`faults`) on the victim from `onset` on."""
  rng = np.random.default_rng(seed)
  observer = Observer(str(workdir), lambda _: None, status_every_s=0, os_detector=os_detector)
  observer.start_group(_Group(n))
  for sec in range(seconds):
    load = rng.normal(0.0, 0.045)
    for rank in range(n):
      hit = rank == victim and sec >= onset
      share = 0.6 + load + rng.normal(0.0, 0.031) + (shift if hit else 0.0)
      majflt = rng.poisson(1.0) + (rng.poisson(faults) if hit else 0)
      observer.receive(_beat(rank, sec, float(share), float(majflt)), 0.0)
    observer.observe(now=sec)
  return observer.flags


@pytest.mark.parametrize("n", [2, 4])
def test_a_rank_waiting_for_cpu_is_flagged_after_the_window(tmp_path, n):
  victim = int(np.random.default_rng(n).integers(n))
  flags = _run(tmp_path, n, victim, shift=0.2, seed=n)
  assert [f["rank"] for f in flags] == [victim]
  (flag,) = flags
  assert flag["metric"] == "runq_wait_share" and flag["unit"] == "excess"
  assert T0 + 20 <= flag["since"] and flag["at"] - flag["since"] >= 9    # window 10 s
  assert f"rank {victim}: runq_wait_share" in flag["message"]
  assert (tmp_path / "resilience" / "monitor.jsonl").stat().st_size > 0


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_healthy_noise_flags_nobody(tmp_path, seed):
  assert _run(tmp_path, 3, None, shift=0.0, seed=seed, seconds=300) == []


@pytest.mark.parametrize("n", [2, 3])
def test_a_busy_neighbour_as_small_as_measured_is_flagged(tmp_path, n):
  """The drill's busy process on one rank's core: only ~0.08 above its peer on a loaded host
  (mean over the streak the replay flagged), for 30 s (straggler.OS_THRESHOLDS)."""
  flags = _run(tmp_path, n, n - 1, shift=0.08, seed=11 + n, seconds=50, onset=20)
  assert [(f["rank"], f["metric"]) for f in flags] == [(n - 1, "runq_wait_share")]


def test_a_rank_with_major_faults_is_flagged(tmp_path):
  flags = _run(tmp_path, 3, 2, shift=0.0, seed=7, faults=2000.0)
  assert [(f["rank"], f["metric"]) for f in flags] == [(2, "majflt_per_s")]


def test_off_when_asked(tmp_path):
  assert _run(tmp_path, 2, 1, shift=0.3, seed=5, faults=2000.0, os_detector=False) == []


def test_second_table_lines_up_ranks_and_skips_junk():
  table = straggler.SecondTable()
  table.add(0, [{"t": T0 + 0.5, "runq_wait_share": 0.5}, {"t": T0 + 1.2, "runq_wait_share": 0.4},
                "junk", {"t": "x"}, {"t": T0 + 2.1, "runq_wait_share": None}])
  table.add(1, [{"t": T0 + 0.9, "runq_wait_share": 0.7}, {"t": T0 + 2.5, "runq_wait_share": 0.1}])
  assert list(table.ready([0, 1])) == [(T0, {0: {"runq_wait_share": 0.5},
                                             1: {"runq_wait_share": 0.7}})]
  table.add(1, [{"t": T0 + 1.0, "runq_wait_share": 0.2}])
  assert list(table.ready([0, 1])) == [(T0 + 1, {0: {"runq_wait_share": 0.4},
                                                 1: {"runq_wait_share": 0.2}})]
