"""What starting warm standbys costs the job that starts them, beside another job.

  python -m experiments.standby_cost [--trials=3] [--window_s=12]

Under Linux's autogroup scheduling (/proc/sys/kernel/sched_autogroup_enabled) the CPU is first
shared between sessions, then among each session's processes. The fault drill runs its fault run
and its fault-free reference in sessions of their own, and the fault run's driver starts two
warm standbys (mscale_jax/resilience/driver/standby.py) right after every restart.

Each trial runs two sessions side by side, A and B, each one `busy` process: a jitted matmul
loop on XLA:CPU that keeps every thread of its pool busy, as a worker's steps do. After
`--settle_s`, A's process starts two processes that import what a standby imports:
`normal` at normal priority (the standby before this change), `low` through `standby.preload`
(a thread at nice 19), or `none`. The record holds, per mode (trials interleaved), A's and B's
iterations per second from that moment for `--window_s` and their ratio (and the same ratio
before it), the ratio over the window and `--tail_s` together (`a_over_b_whole`, long enough
for imports at nice 19, which outlast the window) and that ratio over the one before
(`a_over_b_whole_vs_before`, A's loss with the two sides' own difference taken out), the
importers' CPU seconds, and how long after their start their imports ended.
"""
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

from absl import app, flags

from experiments import results

FLAGS = flags.FLAGS
MODES = ("none", "normal", "low")
IMPORTER = {
    "normal": "import importlib\nfrom mscale_jax.resilience.driver.standby import PRELOAD\n"
              "for n in PRELOAD: importlib.import_module(n)\n",
    "low": "from mscale_jax.resilience.driver.standby import preload\npreload()[0].join()\n",
}


def define_flags():
  flags.DEFINE_enum("role", "main", ["main", "busy"], "main runs the trials; busy is one side.")
  flags.DEFINE_enum("mode", "none", MODES, "busy: what it starts after --settle_s.")
  flags.DEFINE_string("out", None, "busy: where it writes its timings (JSON).")
  flags.DEFINE_integer("trials", 3, "Trials per mode (interleaved).")
  flags.DEFINE_float("settle_s", 6.0, "Seconds both sides run before A starts the importers.")
  flags.DEFINE_float("window_s", 12.0, "Seconds measured after A starts the importers.")
  flags.DEFINE_float("tail_s", 20.0, "Seconds both sides go on after the window (slow imports end).")
  flags.DEFINE_string("out_dir", None, "Record folder (default: results/).")


def busy(mode: str, out: str) -> None:
  """Runs the matmul loop; starts the importers (mode) after --settle_s; writes its timings."""
  import jax
  import jax.numpy as jnp
  step = jax.jit(lambda x: jnp.tanh(x @ x) @ x)
  x = jnp.ones((384, 384), jnp.float32) / 384
  step(x).block_until_ready()
  start = time.time()
  spawned, procs, ends, done_at = None, [], [], None
  end = start + FLAGS.settle_s + FLAGS.window_s + FLAGS.tail_s
  while time.time() < end:
    if spawned is None and time.time() - start >= FLAGS.settle_s:
      spawned = time.time()
      if mode != "none":
        procs = [subprocess.Popen([sys.executable, "-c", IMPORTER[mode]],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                 for _ in range(2)]
    step(x).block_until_ready()
    ends.append(time.time())
    if procs and done_at is None and all(p.poll() is not None for p in procs):
      done_at = time.time()
  for p in procs:
    p.wait()
  cpu = resource.getrusage(resource.RUSAGE_CHILDREN)
  with open(out, "w") as f:
    json.dump({"start": start, "spawned": spawned, "ends": ends,
               "importers_done_s": done_at - spawned if done_at else None,
               "importers_cpu_s": cpu.ru_utime + cpu.ru_stime}, f)


def rate(ends: list[float], t0: float, t1: float) -> float:
  """Iterations per second that ended in [t0, t1)."""
  return sum(t0 <= t < t1 for t in ends) / (t1 - t0)


def _read_json(path: str) -> dict:
  with open(path) as f:
    return json.load(f)


def trial(mode: str, folder: str) -> dict:
  """A (starting the importers of `mode`) and B side by side, each in a session of its own."""
  procs, outs = [], []
  for side, side_mode in (("a", mode), ("b", "none")):
    outs.append(os.path.join(folder, f"{mode}-{side}-{time.time():.0f}.json"))
    procs.append(subprocess.Popen(
        [sys.executable, "-m", "experiments.standby_cost", "--role=busy", f"--mode={side_mode}",
         f"--out={outs[-1]}", f"--settle_s={FLAGS.settle_s}", f"--window_s={FLAGS.window_s}",
         f"--tail_s={FLAGS.tail_s}"],
        start_new_session=True, env=dict(os.environ, JAX_PLATFORMS="cpu")))
  for p in procs:
    if p.wait() != 0:
      raise RuntimeError(f"a busy process failed (exit {p.returncode})")
  a, b = (_read_json(o) for o in outs)
  t = a["spawned"]
  window = (t, t + FLAGS.window_s)
  whole = (t, t + FLAGS.window_s + FLAGS.tail_s)
  before = (t - FLAGS.settle_s + 2, t)   # the first 2 s left out (both still starting)
  ratio = lambda w: rate(a["ends"], *w) / max(rate(b["ends"], *w), 1e-9)
  return {"mode": mode, "a_per_s": rate(a["ends"], *window), "b_per_s": rate(b["ends"], *window),
          "a_over_b": ratio(window), "a_over_b_before": ratio(before),
          "a_over_b_whole": ratio(whole), "a_over_b_whole_vs_before": ratio(whole) / ratio(before),
          "importers_cpu_s": a["importers_cpu_s"], "importers_done_s": a["importers_done_s"]}


def main(argv):
  del argv
  if FLAGS.role == "busy":
    return busy(FLAGS.mode, FLAGS.out)
  autogroup = open("/proc/sys/kernel/sched_autogroup_enabled").read().strip() \
      if os.path.exists("/proc/sys/kernel/sched_autogroup_enabled") else None
  rows = []
  with tempfile.TemporaryDirectory() as folder:
    for i in range(FLAGS.trials):
      for mode in MODES[i % len(MODES):] + MODES[:i % len(MODES)]:
        rows.append(trial(mode, folder))
        print(json.dumps(rows[-1]), flush=True)
  summary = {}
  for mode in MODES:
    mine = [r for r in rows if r["mode"] == mode]
    summary[mode] = {k: statistics.median(r[k] for r in mine if r[k] is not None)
                     if any(r[k] is not None for r in mine) else None
                     for k in ("a_over_b", "a_over_b_before", "a_over_b_whole",
                               "a_over_b_whole_vs_before", "importers_cpu_s",
                               "importers_done_s")}
  print(json.dumps(summary, indent=1))
  print(results.write_record("standby_cost", {"by_mode": summary, "trials": rows,
                                              "sched_autogroup_enabled": autogroup,
                                              "load_average": os.getloadavg()},
                             out_dir=FLAGS.out_dir))


if __name__ == "__main__":
  define_flags()
  app.run(main)
