"""Where logged records go: WORKDIR/metrics.jsonl, TensorBoard, and the console.

A run resumed (or rolled back) at step N replays the steps after N: their records from the lost
run are dropped from metrics.jsonl, and TensorBoard is told to purge events from step N + 1 on,
so each step appears once. All three write on the main process only.
"""
import json
import os

from tqdm import tqdm

from mscale_jax.callbacks.base import Callback


class _StepWriter(Callback):
  """A writer of logged records on the main process that forgets the steps after the one a
  run resumes or rolls back to (subclasses: `_open(workdir, keep_until)`, `_close()`)."""
  _handle = None

  def on_loop_start(self, run):
    if run.trainer.is_main:
      self._open(run.trainer.workdir, run.start)

  def on_rewind(self, run, step):
    if self._handle is not None:
      self._close()
      self._open(run.trainer.workdir, step)

  def on_loop_end(self, run):
    if self._handle is not None:
      self._close()
      self._handle = None


class MetricsFile(_StepWriter):
  """WORKDIR/metrics.jsonl: one JSON object per logged step."""

  def _open(self, workdir: str, keep_until: int) -> None:
    path = os.path.join(workdir, "metrics.jsonl")
    if os.path.exists(path):
      with open(path) as f:
        kept = [line for line in f if _step_of(line) <= keep_until]
      with open(path + ".tmp", "w") as f:
        f.writelines(kept)
      os.replace(path + ".tmp", path)
    self._handle = open(path, "a")

  def _close(self) -> None:
    self._handle.close()

  def on_log(self, run, record):
    if self._handle is not None:
      self._handle.write(json.dumps(record) + "\n")
      self._handle.flush()


def _step_of(line: str) -> float:
  """The step of a metrics.jsonl line; infinity for a torn line (a kill mid-write)."""
  try:
    return json.loads(line)["step"]
  except (ValueError, KeyError):
    return float("inf")


class TensorBoard(_StepWriter):
  """Every record's scalars in WORKDIR/tensorboard (`tensorboard --logdir runs`)."""

  _opened = 0   # event files opened in this process

  def _open(self, workdir: str, keep_until: int) -> None:
    from tensorboardX import SummaryWriter
    # Event files are named by the second they were opened: a rewind, or a second run of the
    # workdir in this process, within the same second would open (and truncate) the same file,
    # so each open in the process gets its own suffix.
    TensorBoard._opened += 1
    self._handle = SummaryWriter(os.path.join(workdir, "tensorboard"),
                                 purge_step=keep_until + 1 if keep_until else None,
                                 filename_suffix=f".{TensorBoard._opened:04d}")

  def _close(self) -> None:
    self._handle.close()

  def on_log(self, run, record):
    if self._handle is not None:
      for key, value in record.items():
        if key != "step":
          self._handle.add_scalar(key, value, record["step"])


class ProgressBar(Callback):
  """A tqdm bar of the run's steps and, per logged step, one line of its record.

  `enabled`: None shows it on the main process only.
  """

  def __init__(self, enabled: bool | None = None):
    self.enabled = enabled
    self._bar = None

  def on_loop_start(self, run):
    main = run.trainer.is_main
    self._bar = tqdm(total=run.config.train.steps, initial=run.start, desc="train",
                     unit="step", dynamic_ncols=True,
                     disable=(None if main else True) if self.enabled is None
                     else not self.enabled)

  def on_step_dispatched(self, run, step, metrics):
    self._bar.update(1)

  def on_rewind(self, run, step):
    self._bar.n = step

  def on_log(self, run, record):
    self._bar.set_postfix(loss=f"{record['loss']:.3f}", tok_s=f"{record['tokens_per_s']:,.0f}",
                          mfu=f"{100 * record['mfu']:.2f}%")
    if run.trainer.is_main:
      self._bar.write(format_record(record, run.config.train.steps))

  def on_loop_end(self, run):
    if self._bar is not None:
      self._bar.close()
      self._bar = None


def format_record(r: dict, total: int) -> str:
  """The console line of a logged record."""
  line = (f"step {r['step']:>6}/{total}  loss {r['loss']:.4f}  gnorm {r['grad_norm']:.3f}  "
          f"lr {r['learning_rate']:.2e}  {1e3 * r['step_time_s']:.0f} ms/step  "
          f"{r['tokens_per_s']:,.0f} tok/s  MFU {100 * r['mfu']:.2f}%")
  if "eval_loss" in r:
    line += f"  eval {r['eval_loss']:.4f}"
  return line
