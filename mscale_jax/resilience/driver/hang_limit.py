"""The driver's adaptive hang limit: how long a group may go without a new step (supervisor.py).

A watchdog must adapt to the job (a fixed limit is either too long for fast steps or too short
for slow ones). Until the job has reported WARMUP step times (its first steps: compilation,
first saves) the limit is the launcher's hang_timeout_s; then it is hang_step_factor x the
median of the job's recent step times (its steady step), at least hang_floor_s (and never above
hang_timeout_s's floor).

The median, not a high percentile. The slow steps of a healthy job have their own allowance:
a save or an evaluation is a phase the heartbeat reports (io_timeout_s), the group's first step
gets startup_timeout_s, and the driver's clock restarts at each new step or phase. A heartbeat's
step time, though, runs from one step to the next, so the step after each save carries that
save's stall, and a 95th percentile counted those stalls (and a loaded box's noise) a second
time: in the fault drill (results/fault_drill-gpt_tiny-cpu-20261126T215235.json) it was 1.8 x
the median, a 20-s limit for 0.55-s steps, and a hang was found 21.8 s after it began. In the
drill's fault-free runs, past the first save and evaluation, no step (its save included) took
5 x the median: 20 x the median keeps a 4-fold margin. The median moves when most steps slow
down (a loaded box), so the limit follows the box.
"""
import statistics

# Step times (one per heartbeat) before the limit adapts, and how many recent ones it reads.
WARMUP, WINDOW = 20, 100


def limit_s(step_times: list[float], timeout_s: float, floor_s: float, factor: float) -> float:
  """Seconds without a new step that make a hang, given the job's recent `step_times`."""
  steady = statistics.median(step_times) if step_times else 0.0
  if len(step_times) < WARMUP:
    return max(timeout_s, factor * steady)
  return max(min(floor_s, timeout_s), factor * steady)
