"""When the supervisor looks at its group again: every poll interval, or at once when what it
looks for has happened (a worker process exited, a worker reported a failure).

Without it a fault waits for the rest of the interval before the driver sees it (0.25 s at
most, half that on average), on every fault of a job. A worker's exit is seen by a thread that
waits for the process (`Popen.wait`; `poll()` elsewhere says None until that thread has reaped
it, then the exit status); a reported failure by the heartbeat server's listener.
"""
import subprocess
import threading


class Wake:
  """The event the supervisor waits on between polls of its group."""

  def __init__(self):
    self._event = threading.Event()

  def watch(self, proc: subprocess.Popen) -> None:
    """Wakes the supervisor when `proc` exits."""
    def reap():
      proc.wait()
      self._event.set()
    threading.Thread(target=reap, name=f"wake-on-exit-{proc.pid}", daemon=True).start()

  def on_heartbeat(self, beat, received: float) -> None:
    """A HeartbeatServer listener: wakes the supervisor when a worker reports a failure."""
    del received
    if beat.failure is not None:
      self._event.set()

  def wait(self, timeout_s: float) -> bool:
    """Waits up to `timeout_s` for a wake-up; whether one came. Call it after looking at the
    group: what happened since then wakes it at once."""
    woken = self._event.wait(timeout_s)
    self._event.clear()
    return woken
