"""The driver's claim on a workdir: WORKDIR/resilience/driver.json.

While a driver runs a job it keeps there its own process id, its workers' process ids (each
with the process's start time, so that a recycled id is never mistaken for ours) and the job's
history so far (attempts, failures, excluded slots, restarts spent). If the driver dies (kill -9,
a lost login node), running the same launch command again reads the claim: it refuses to start
while that driver lives (no second job in one workdir), otherwise it ends the workers the dead
driver left running and carries the job's history on, so that the report covers the whole job.
"""
import glob
import json
import os
import signal

from mscale_jax.files import checkpoint_steps, verify_manifest, write_json
from mscale_jax.resilience import events
from mscale_jax.resilience.faults import bad_slot_marker

NAME = "driver.json"


def start_time(pid: int) -> int | None:
  """The start time of process `pid` (clock ticks since boot, /proc/PID/stat), None if gone."""
  try:
    with open(f"/proc/{pid}/stat") as f:
      return int(f.read().rsplit(")", 1)[1].split()[19])
  except (OSError, IndexError, ValueError):
    return None


def same_process(entry: dict) -> bool:
  """Whether {'pid', 'start'} still names the process it was written for."""
  return entry.get("start") is not None and start_time(entry["pid"]) == entry["start"]


def read(state_dir: str) -> dict | None:
  """The claim under `state_dir` as `write` left it, or None when there is none."""
  path = os.path.join(state_dir, NAME)
  if not os.path.exists(path):
    return None
  with open(path) as f:
    return json.load(f)


def write(state_dir: str, worker_pids: list[int], history: dict) -> None:
  """Records this driver, its current workers and the job's `history`."""
  me = os.getpid()
  write_json(os.path.join(state_dir, NAME), {
      "driver": {"pid": me, "start": start_time(me)},
      "workers": [{"pid": p, "start": start_time(p)} for p in worker_pids],
      **history}, indent=1, default=str)


def live_driver(state_dir: str) -> int | None:
  """The process id of another driver still running the job in this workdir, or None."""
  claim = read(state_dir)
  if claim and claim["driver"]["pid"] != os.getpid() and same_process(claim["driver"]):
    return claim["driver"]["pid"]
  return None


def end_leftover_workers(claim: dict) -> list[int]:
  """SIGKILLs the process groups of the workers a dead driver left running; their pids."""
  ended = []
  for entry in claim.get("workers", []):
    if same_process(entry):
      try:
        os.killpg(entry["pid"], signal.SIGKILL)
        ended.append(entry["pid"])
      except ProcessLookupError:
        pass
  return ended


def lost_driver(claim: dict, ended: list[int], workdir: str) -> tuple[dict, dict]:
  """The failure record and the attempt record of a driver that died (its `claim`), as the next
  driver files them: the fault marker that killed it, if injected, the last step logged and the
  checkpoint the job restarts from."""
  fired = fired_since(os.path.join(workdir, "resilience"),
                      claim["attempts"][-1]["ended"] if claim["attempts"] else claim["started"])
  last_step, restore_step = last_logged_step(workdir), latest_checkpoint(workdir)
  failure = events.Failure(events.DRIVER_LOST, None,
                           f"driver pid {claim['driver']['pid']} died; the next driver ended "
                           f"the {len(ended)} workers it left running",
                           happened_at=fired and fired["time"], step=last_step)
  record = failure.to_json()
  record.update(attempt=len(claim["attempts"]), slot=None, last_step=last_step,
                injected=fired and fired["fault"], restart_s=None,
                detection_latency_s=(failure.detected_at - failure.happened_at
                                     if failure.happened_at else None),
                restore_step=restore_step, steps_lost=max(last_step - restore_step, 0))
  group = claim.get("group") or {}
  attempt = {"attempt": len(claim["attempts"]), "slots": group.get("slots"),
             "started": group.get("started"),
             "ended": failure.detected_at, "max_step": last_step, "warm_processes": 0,
             "failure": events.DRIVER_LOST}
  return record, attempt


# What the driver reads from a workdir.

def latest_checkpoint(workdir: str) -> int:
  """Newest complete checkpoint step in WORKDIR/checkpoints (orbax renames when complete) whose
  files match their checksum manifest (the worker sets a corrupt one aside and restores the
  one before it: mscale_jax/checkpoint.py)."""
  directory = os.path.join(workdir, "checkpoints")
  return next((s for s in checkpoint_steps(directory)
               if verify_manifest(os.path.join(directory, str(s))) is None), 0)


def last_logged_step(workdir: str) -> int:
  """The last step in WORKDIR/metrics.jsonl (0 if none)."""
  last = 0
  try:
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
      for line in f:
        try:
          last = max(last, json.loads(line)["step"])
        except (ValueError, KeyError):
          pass
  except OSError:
    pass
  return last


def fired_since(state_dir: str, since: float, kind: str = "") -> dict | None:
  """The newest fault marker written since `since` (an injected fault's when and where), of
  a fault of kind `kind` if given."""
  markers = []
  for path in glob.glob(os.path.join(state_dir, "faults", "*.json")):
    with open(path) as f:
      marker = json.load(f)
    if marker["time"] >= since and (not kind or marker["fault"].split(":")[0] == kind):
      markers.append(marker)
  return max(markers, key=lambda m: m["time"], default=None)


def bad_slot_fired(workdir: str, faults, slots) -> dict | None:
  """The `bad_slot` fault among `faults` on one of `slots` that has fired, as a fault marker
  ({'fault', 'time', 'step'}: when training first ran on the bad slot), or None: what caused a
  replica divergence in a drill (the worker's marker, faults.bad_slot_marker)."""
  for f in faults:
    path = bad_slot_marker(workdir, f.slot) if f.kind == "bad_slot" else None
    if path and f.slot in slots and os.path.exists(path):
      with open(path) as fh:
        return {"fault": f.spec, "time": os.path.getmtime(path), "step": json.load(fh)["step"]}
  return None
