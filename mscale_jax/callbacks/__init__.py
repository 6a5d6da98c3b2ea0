"""Callbacks of the training loop (`Trainer.train`): the protocol and the standard ones.

  base.py           the protocol: `Callback` (override the events you need), `Run`, `Checked`
  metrics.py        MetricsFile (metrics.jsonl), TensorBoard, ProgressBar
  checkpointing.py  Checkpointing
  nonfinite.py      the non-finite policies (stop / skip_step / rollback), a strategy
  observability.py  TimelineRecorder, Profiler (the profile window), StackDump
  worker.py         Heartbeats and FaultInjection, for workers under the driver

An experiment adds its own with `Trainer(config, workdir, callbacks=[...])` (README).
"""
from mscale_jax.callbacks.base import Callback, Checked, Run

__all__ = ["Callback", "Checked", "Run"]
