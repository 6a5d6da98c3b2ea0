"""The loop's callback protocol (mscale_jax/callbacks/base.py): which events a run calls, in
what order, with what; and the README's example callback, run as an experiment would."""
import json
import os
import re

import pytest

from mscale_jax.callbacks import Callback
from mscale_jax.callbacks.base import EVENTS, Callbacks
from mscale_jax.callbacks.worker import FaultInjection
from mscale_jax.resilience.faults import parse_faults
from mscale_jax.train import Trainer

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class Recorder(Callback):
  """Every event it hears, as (event, step) (phases as ('phase', name))."""

  def __init__(self, fail_at=None):
    self.events, self.fail_at = [], fail_at

  def on_run_start(self, run):
    self.events.append(("run_start", run.step))

  def on_loop_start(self, run):
    self.events.append(("loop_start", run.start))

  def on_step_start(self, run, step):
    self.events.append(("step_start", step))
    if step == self.fail_at:
      raise RuntimeError("boom")

  def on_step_checked(self, run, checked):
    self.events.append(("checked", checked.step, checked.finite))

  def on_log(self, run, record):
    self.events.append(("log", record["step"]))

  def on_save(self, run, step):
    self.events.append(("save", step))

  def on_rewind(self, run, step):
    self.events.append(("rewind", step))

  def on_error(self, run, error):
    self.events.append(("error", str(error)))

  def on_loop_end(self, run):
    self.events.append(("loop_end", run.step))

  def on_run_end(self, run, summary):
    self.events.append(("run_end", summary["last_loss"] is not None))

  def on_phase(self, run, name, step):
    self.events.append(("phase", name))

  def of(self, kind):
    return [e[1:] if len(e) > 2 else e[1] for e in self.events if e[0] == kind]


def _config(tiny_config, **train):
  return tiny_config(train=dict(dict(steps=8, global_batch=4, log_every=2, eval_every=8,
                                     checkpoint_every=4, on_nonfinite="rollback"), **train))


@pytest.mark.slow   # one of the fast tier's heaviest (a trainer run or a full search)
def test_a_run_calls_every_event_in_order_through_a_rollback(tiny_config, tmp_path):
  recorder = Recorder()
  Trainer(_config(tiny_config), tmp_path, show_progress=False,
          callbacks=[FaultInjection(parse_faults(["nan:step=5"])), recorder]).train()
  kinds = [e[0] for e in recorder.events if e[0] != "phase"]
  assert kinds[:2] == ["run_start", "loop_start"] and kinds[-2:] == ["loop_end", "run_end"]
  assert recorder.of("step_start") == [1, 2, 3, 4, 5, 6, 5, 6, 7, 8]
  # Step 5 is found non-finite one step late (once step 6 is dispatched), then the run goes
  # back to the step-4 checkpoint and replays 5..8 on the batches after the bad one.
  assert recorder.of("checked") == [(s, s != 5) for s in (1, 2, 3, 4, 5)] + \
      [(s, True) for s in (5, 6, 7, 8)]
  assert recorder.of("rewind") == [4]
  assert recorder.of("log") == [1, 2, 4, 6, 8] and recorder.of("save") == [4, 8]
  with open(tmp_path / "metrics.jsonl") as f:
    assert [json.loads(line)["step"] for line in f] == [1, 2, 4, 6, 8]
  phases = recorder.of("phase")
  assert phases[:2] == ["restore", "compile"] and "restore" in phases[2:]   # the rollback
  assert {"data_wait", "dispatch", "sync", "host", "log", "eval", "checkpoint_stall"} <= \
      set(phases)
  assert recorder.of("run_end") == [True]


@pytest.mark.slow   # one of the fast tier's heaviest (a trainer run or a fleet replay)
def test_an_error_is_heard_before_the_cleanup_and_the_run_does_not_end(tiny_config, tmp_path):
  recorder = Recorder(fail_at=3)
  with pytest.raises(RuntimeError, match="boom"):
    Trainer(_config(tiny_config), tmp_path, show_progress=False, callbacks=[recorder]).train()
  kinds = [e[0] for e in recorder.events if e[0] != "phase"]
  assert kinds[-2:] == ["error", "loop_end"] and "run_end" not in kinds


def test_callbacks_call_only_what_each_one_overrides():
  class Logs(Callback):
    def __init__(self):
      self.seen = []

    def on_log(self, run, record):
      self.seen.append(record)

  a, b = Logs(), Logs()
  callbacks = Callbacks([a, Callback(), b])
  callbacks.on_log(None, {"step": 1})
  callbacks.on_save(None, 1)                  # nobody overrides it: a no-op
  assert a.seen == b.seen == [{"step": 1}]
  assert callbacks.listening == {"on_log"} and "on_phase" in EVENTS
  assert callbacks.find(Logs) is a


def test_every_callback_gets_its_cleanup_even_when_an_earlier_one_raises():
  """on_loop_end (and on_error) reach every callback; the first error is raised after."""
  heard = []

  class Breaks(Callback):
    def __init__(self, name):
      self.name = name

    def on_loop_end(self, run):
      heard.append(self.name)
      raise RuntimeError(f"{self.name} broke")

  class Closes(Callback):
    def on_loop_end(self, run):
      heard.append("closes")

    def on_log(self, run, record):
      raise RuntimeError("on_log stops at once")

  callbacks = Callbacks([Breaks("first"), Closes(), Breaks("second")])
  with pytest.raises(RuntimeError, match="first broke"):
    callbacks.on_loop_end(None)
  assert heard == ["first", "closes", "second"]
  with pytest.raises(RuntimeError, match="on_log stops"):   # other events: the first error ends it
    callbacks.on_log(None, {})


def test_the_readme_example_runs_as_an_experiment_would(tiny_config, tmp_path, capsys):
  readme = open(os.path.join(REPO, "README.md")).read()
  section = readme[readme.index("### Adding to the training loop"):]
  code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
  definitions = code[:code.index("\nconfig = ")]   # the run itself: a tiny config instead
  namespace = {}
  exec(definitions, namespace)
  alarm = namespace["GradNormAlarm"](factor=1e-3)   # any step after the first is "a jump"
  Trainer(_config(tiny_config, on_nonfinite="stop"), tmp_path, show_progress=False,
          callbacks=[alarm]).train()
  assert alarm.alarms == list(range(2, 9)) and alarm.mean > 0
  assert "step 8: gradient norm" in capsys.readouterr().out


class _Timeline:
  def __init__(self):
    self.saved = []

  def checkpoint_saved(self, save):
    self.saved.append(save["step"])


def test_the_timeline_records_a_save_only_if_it_was_not_refused():
  """Checkpointing drops a refused save from `saves`: a refused first save records nothing
  (it did raise IndexError), a later one does not record the previous save again."""
  from types import SimpleNamespace

  from mscale_jax.callbacks.observability import TimelineRecorder
  saves = []
  run = SimpleNamespace(trainer=SimpleNamespace(checkpointer=SimpleNamespace(saves=saves)))
  recorder = TimelineRecorder()
  recorder.timeline = _Timeline()
  recorder.on_save(run, 4)   # refused
  saves.append({"step": 8})
  recorder.on_save(run, 8)
  recorder.on_save(run, 12)   # refused
  assert recorder.timeline.saved == [8]


def test_waiting_for_a_save_at_the_end_or_a_rollback_is_a_checkpoint_phase():
  """The final close() and a rollback's wait() block on the background write: they run in
  phase checkpoint_stall (the driver's CHECKPOINTING, allowed io_timeout_s), not in the
  step's phase (TRAINING, whose hang limit is a few step times)."""
  from types import SimpleNamespace

  from mscale_jax.callbacks.base import Checked
  from mscale_jax.callbacks.checkpointing import Checkpointing
  from mscale_jax.callbacks.nonfinite import Rollback
  from mscale_jax.observability.phases import COARSE
  from mscale_jax.resilience import events
  phases, waited_in = ["host"], []
  checkpointer = SimpleNamespace(close=lambda: waited_in.append(phases[-1]),
                                 wait=lambda: waited_in.append(phases[-1]),
                                 latest_step=lambda: None)
  data = {"step": 7}
  trainer = SimpleNamespace(checkpointer=checkpointer, init_state=lambda: "fresh",
                            train_iter=SimpleNamespace(get_state=lambda: data,
                                                       set_state=data.update))
  run = SimpleNamespace(trainer=trainer, rollbacks=0, rewind=lambda *a: None,
                        phase=lambda name, step=None: phases.append(name))
  Rollback().handle(run, Checked(step=5, loss=float("nan"), grad_norm=float("nan"),
                                 finite=False, data_wait_s=0.0, data_pos=5))
  Checkpointing().on_loop_end(run)
  assert [COARSE[p] for p in waited_in] == [events.CHECKPOINTING] * 2
