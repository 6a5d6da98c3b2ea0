r"""What the per-rank timeline costs the default main job (goal: < 1% of the step time).

  python -m experiments.timeline_overhead                  # direct + A/B (4 short runs)
  python -m experiments.timeline_overhead --ab_runs=0      # direct measurement only

Direct: the median time of one `PhaseMachine.phase()` call with a Timeline as its sink (the
loop's hot path: a perf_counter read, a deque append and the per-iteration sums; median over
repeats of 100,000 calls, the writer thread running), and
the writer's cost per span (JSON + file append, on its own thread), times the spans one
iteration records, over the mean iteration time of a run of the default main job
(experiments/configs/gpt_tiny.py on 8 simulated CPU devices) with the timeline on.
A/B: the same job with `train.timeline` on and off, alternating, `ab_runs` times each; the
steady-state tokens/s of each run (summary['mean_tokens_per_s']). On a shared 2-core machine
the run-to-run spread is far larger than 1%, so the A/B bounds the overhead only loosely; the
direct figure is the one to quote. Writes results/timeline_overhead-*.json.
"""
from experiments.host_devices import simulate_cpu_devices

simulate_cpu_devices(8)

import os  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

from absl import app, flags  # noqa: E402

_STEPS = flags.DEFINE_integer("steps", 60, "Steps of each run of the main job.")
_AB_RUNS = flags.DEFINE_integer("ab_runs", 2, "Runs with the timeline on and off, each.")


def phase_call_cost(calls: int = 100_000, repeats: int = 7) -> dict:
  """Median seconds per phase change and per span written by the writer thread."""
  from mscale_jax.observability.phases import LOOP_PHASES, PhaseMachine
  from mscale_jax.observability.timeline import Timeline
  names = LOOP_PHASES[:5]
  per_call, per_write = [], []
  with tempfile.TemporaryDirectory() as directory:
    for _ in range(repeats):
      tl = Timeline(directory, 0, flush_every_s=3600)
      machine = PhaseMachine(sink=tl)
      start = time.perf_counter()
      for i in range(calls):
        machine.phase(names[i % 5], i // 5)
      per_call.append((time.perf_counter() - start) / calls)
      start = time.perf_counter()
      tl.flush()
      per_write.append((time.perf_counter() - start) / calls)
      tl.close()
      os.remove(tl.path)
  return {"phase_call_s": statistics.median(per_call), "phase_call_s_all": per_call,
          "write_per_span_s": statistics.median(per_write)}


def run_main_job(timeline: bool, steps: int, cache: str) -> dict:
  """One run of the default main job for `steps` steps; its summary and timeline counts."""
  import jax
  from experiments.configs import gpt_tiny
  from mscale_jax.config import Config
  from mscale_jax.observability import trace
  from mscale_jax.train import Trainer
  jax.config.update("jax_compilation_cache_dir", cache)
  config = Config.from_dict(gpt_tiny.get_config().to_dict()).replace(
      train=dict(steps=steps, timeline=timeline, eval_every=steps, checkpoint_every=steps))
  with tempfile.TemporaryDirectory() as workdir:
    summary = Trainer(config, workdir, show_progress=False).train()
    out = {"timeline": timeline, "mean_tokens_per_s": summary["mean_tokens_per_s"],
           "step_time_s": config.train.global_batch * config.model.seq_len
           / summary["mean_tokens_per_s"]}
    if timeline:
      data = trace.load(workdir)
      spans = [s for s in data["ranks"][0]["spans"] if s["track"] == "loop"
               and s["step"] is not None]
      iterations = len({s["step"] for s in spans})
      out["spans_per_iteration"] = len(spans) / iterations
      out["mean_iteration_s"] = trace.summarize(data)["ranks"][0]["mean_iteration_s"]
  return out


def main(argv):
  del argv
  from experiments import results
  cost = phase_call_cost()
  print(f"[overhead] PhaseMachine.phase() into a Timeline: {1e9 * cost['phase_call_s']:.0f} ns "
        f"per call; writer {1e6 * cost['write_per_span_s']:.2f} us per span (its own thread)",
        flush=True)
  runs = []
  with tempfile.TemporaryDirectory() as cache:
    run_main_job(True, 30, cache)   # warms the compilation cache: measured runs compile alike
    for _ in range(max(_AB_RUNS.value, 1)):
      for timeline in ((True, False) if _AB_RUNS.value else (True,)):
        runs.append(run_main_job(timeline, _STEPS.value, cache))
        print(f"[overhead] timeline={timeline}: {runs[-1]['mean_tokens_per_s']:,.0f} tokens/s",
              flush=True)
  on = [r for r in runs if r["timeline"]]
  off = [r for r in runs if not r["timeline"]]
  spans = statistics.mean(r["spans_per_iteration"] for r in on)
  iteration_s = statistics.mean(r["mean_iteration_s"] for r in on)
  direct = cost["phase_call_s"] * spans / iteration_s
  figures = {**cost, "spans_per_iteration": spans, "mean_iteration_s": iteration_s,
             "hot_path_overhead_fraction": direct,
             "writer_cpu_fraction": cost["write_per_span_s"] * spans / iteration_s,
             "runs": runs, "steps_per_run": _STEPS.value}
  if off:
    tps_on = [r["mean_tokens_per_s"] for r in on]
    tps_off = [r["mean_tokens_per_s"] for r in off]
    figures["ab_tokens_per_s_on"] = tps_on
    figures["ab_tokens_per_s_off"] = tps_off
    figures["ab_slowdown_fraction"] = 1 - statistics.mean(tps_on) / statistics.mean(tps_off)
    figures["ab_run_to_run_spread_fraction"] = (max(tps_on + tps_off) - min(tps_on + tps_off)) \
        / statistics.mean(tps_on + tps_off)
  path = results.write_record("timeline_overhead", figures, extra={
      "method": "hot path: median ns per PhaseMachine.phase() (Timeline sink) x spans per "
                "iteration / mean iteration time of the default main job (gpt_tiny, 8 "
                "simulated CPU devices) with the timeline on; writer: the same for its per-span write, on its own "
                "thread; A/B: steady-state tokens/s with train.timeline on vs off, "
                "alternating runs on a shared 2-core machine"})
  print(f"[overhead] hot path {100 * direct:.4f}% of a {1e3 * iteration_s:.0f} ms iteration "
        f"({spans:.1f} spans/iteration); writer thread {100 * figures['writer_cpu_fraction']:.4f}%"
        + (f"; A/B slowdown {100 * figures['ab_slowdown_fraction']:+.1f}% (run-to-run spread "
           f"{100 * figures['ab_run_to_run_spread_fraction']:.1f}%)" if off else ""))
  print(f"[overhead] wrote {path}")


if __name__ == "__main__":
  app.run(main)
