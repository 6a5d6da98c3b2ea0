"""The driver's adaptive hang limit (resilience/driver/hang_limit.py, Driver.hang_limit): the
long floor only until the job's step time is known, then a multiple of its median (its steady
step) with a short floor."""
import os
import random

from mscale_jax.resilience.driver.hang_limit import WARMUP as HANG_WARMUP
from mscale_jax.resilience.driver.supervisor import Driver, DriverOptions, _Group


def driver(tmp_path, **options):
  return Driver(DriverOptions(worker_command=["true"], workdir=str(tmp_path), standby=False,
                              status_every_s=0, **options), out=open(os.devnull, "w"))


def test_the_long_floor_holds_until_the_step_time_is_known_then_the_limit_follows_it(tmp_path):
  d, group = driver(tmp_path), _Group(0, [0, 1])
  rng = random.Random(0)
  times = [rng.uniform(0.4, 0.6) for _ in range(HANG_WARMUP - 1)]
  group.step_times = times
  assert d.hang_limit(group) == 60.0   # warming up: max(60, 20 x ~0.5)
  group.step_times = times + [0.5]
  assert 20 * 0.4 < d.hang_limit(group) < 20 * 0.6   # known: 20 x its median (over the floor)
  group.step_times = [rng.uniform(0.1, 0.3) for _ in range(HANG_WARMUP)]
  assert d.hang_limit(group) == 10.0   # fast steps: the short floor
  slow = [rng.uniform(0.9, 1.1) for _ in range(HANG_WARMUP)]
  group.step_times = slow
  assert 20 * min(slow) < d.hang_limit(group) < 20 * max(slow)


def test_steps_that_carry_a_save_or_a_loaded_box_noise_do_not_stretch_the_limit(tmp_path):
  """As in the fault drill: 0.5-0.6-s steps, every 10th one carrying a save's 1-3-s stall (a
  heartbeat's step time runs from step to step) and a tenth more a loaded box's 1-1.5-s
  hiccups. The limit stays 20 x the steady step; a 95th percentile would have made it 20 x
  the stalls."""
  d, group = driver(tmp_path), _Group(0, [0, 1])
  rng = random.Random(1)
  times = []
  for step in range(1, 101):
    slow = step % 10 == 0 or rng.random() < 0.1
    times.append(rng.uniform(1.0, 3.0) if slow else rng.uniform(0.5, 0.6))
  group.step_times = times
  assert 20 * 0.5 < d.hang_limit(group) <= 20 * 0.6 + 1e-9
  # A box that slows every step down (most step times 3 x longer): the limit follows it.
  group.step_times = times[:40] + [3 * t for t in times[40:]]
  assert d.hang_limit(group) > 20 * 1.5


def test_earlier_groups_step_times_count_and_a_lower_user_limit_is_kept(tmp_path):
  d, group = driver(tmp_path, hang_timeout_s=4.0, hang_step_factor=1.0), _Group(1, [0, 1])
  d._step_times = [0.05] * HANG_WARMUP   # the groups before a restart: the same job's steps
  assert d.hang_limit(group) == 4.0    # --hang_timeout_s=4 is never raised to the 10 s floor
  assert driver(tmp_path, hang_floor_s=2.0, hang_step_factor=1.0).hang_limit(
      _Group(0, [0])) == 60.0           # no step time yet


def test_a_new_step_counts_from_when_it_was_checked_a_new_phase_from_when_it_came(tmp_path):
  """The hang clock of a rank (Driver._note_progress): heartbeats come every few seconds, so a
  step reported by one that came 1.5 s after the step was checked (its step_age_s) counts from
  1.5 s before it came; a phase change (sent at once) from when it came; never before the rank's
  previous change."""
  from mscale_jax.resilience import events
  d, group = driver(tmp_path), _Group(0, [0])
  group.started = 90.0

  def hear(received, **beat):
    d._note_progress(group, {0: (events.Heartbeat(rank=0, host="h", pid=1, **beat), received)})
    return group.progress[0]

  assert hear(100.0, phase=events.TRAINING, step=5, step_age_s=0.4) == (5, events.TRAINING, 100.0)
  assert hear(103.0, phase=events.TRAINING, step=6, step_age_s=1.5) == (6, events.TRAINING, 101.5)
  assert hear(104.0, phase=events.TRAINING, step=6, step_age_s=2.5) == (6, events.TRAINING, 101.5)
  assert hear(105.0, phase=events.CHECKPOINTING, step=6, step_age_s=3.5) == \
      (6, events.CHECKPOINTING, 105.0)
  assert hear(106.0, phase=events.CHECKPOINTING, step=7, step_age_s=9.0) == \
      (7, events.CHECKPOINTING, 105.0)   # an age past the previous change: from that change
  assert hear(108.0, phase=events.CHECKPOINTING, step=8) == (8, events.CHECKPOINTING, 108.0)
