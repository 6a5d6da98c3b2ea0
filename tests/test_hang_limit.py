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
