"""Does the driver see the `contend` fault? One 2-process job, the driver's own OS fault.

  python -m experiments.contend_check

The driver (default detector) runs a tiny GPT on 2 processes; at step `--step` its injector
fires `contend:rank=1` (resilience/driver/injector.py: each worker pinned to a core of its own,
a busy process on rank 1's core for `--seconds`). The record holds each rank's median of every
monitoring metric before, during and after the fault (WORKDIR/resilience/monitor.jsonl), and
the driver's straggler flags with their delay from the fault.
"""
import json
import os

import numpy as np
from absl import app, flags

from experiments import job
from experiments.results import write_record
from mscale_jax.resilience.worker.monitor import FIELDS

_STEP = flags.DEFINE_integer("step", 200, "Step at which the fault fires.")
_SECONDS = flags.DEFINE_integer("seconds", 40, "Seconds the busy process runs.")
_STEPS = flags.DEFINE_integer("steps", 900, "Training steps.")
_WORKDIR = flags.DEFINE_string("workdir", "/tmp/contend_check", "Run folder.")
SETTLE_S = 3


def main(argv):
  del argv
  spec = f"contend:rank=1:step={_STEP.value}:seconds={_SECONDS.value}"
  launcher = ["--num_processes=2", "--devices_per_process=1", "--heartbeat_s=1",
              "--max_restarts=0", "--status_every_s=30", f"--fault={spec}",
              f"--xla_flags={job.FAST_XLA}"]
  train = [*job.TINY_GPT, "--config.mesh.data=-1", "--config.mesh.tensor=1",
           "--config.train.global_batch=4", f"--config.train.steps={_STEPS.value}",
           "--config.train.log_every=100", "--config.train.eval_every=100000",
           "--config.train.checkpoint_every=100000"]
  result = job.run(_WORKDIR.value, launcher, train, timeout_s=900, echo=True)
  state = os.path.join(result.workdir, "resilience")
  (marker,) = [json.load(open(os.path.join(state, "faults", f)))
               for f in os.listdir(os.path.join(state, "faults"))]
  t0, t1 = marker["time"], marker["time"] + _SECONDS.value
  samples: dict[int, list[dict]] = {}
  with open(os.path.join(state, "monitor.jsonl")) as f:
    for beat in map(json.loads, f):
      samples.setdefault(beat["rank"], []).extend(beat["samples"])
  spans = {"before": (t0 - 60, t0), "during": (t0 + SETTLE_S, t1), "after": (t1 + SETTLE_S, t1 + 60)}
  medians = {}
  for rank, ss in sorted(samples.items()):
    for name, (a, b) in spans.items():
      sel = [s for s in ss if a <= s["t"] < b]
      medians.setdefault(str(rank), {})[name] = {
          m: float(np.median([s[m] for s in sel if s.get(m) is not None]))
          for m in FIELDS if m not in ("t", "step") and any(s.get(m) is not None for s in sel)}
      medians[str(rank)][name]["samples"] = len(sel)
  flags_ = [{**f, "after_fault_s": f["time"] - t0}
            for f in result.report["observability"]["straggler_flags"]]
  figures = {"fault": spec, "fired_at_step": marker["step"], "medians": medians,
             "flags": flags_, "status": result.status}
  path = write_record("contend_check", figures, device={"platform": "cpu", "processes": 2,
                                                         "host_cpu_count": os.cpu_count()})
  for rank, by in medians.items():
    print(f"rank {rank}: " + "; ".join(
        f"{name} share {v.get('runq_wait_share', float('nan')):.2f} cpu {v['cpu_frac']:.2f}"
        for name, v in by.items()))
  for f in flags_:
    print(f"{f['after_fault_s']:.0f} s after the fault: {f['message']}")
  print(f"record {path}")


if __name__ == "__main__":
  app.run(main)
