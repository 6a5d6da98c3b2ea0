"""A worker without JAX for the driver-policy tests: it speaks the real heartbeat protocol
(HeartbeatClient, MSCALE_* environment) and misbehaves as FAKE_PLAN says.

  FAKE_PLAN = {"steps": 8, "step_s": 0.05, "checkpoint_every": 2,
               "misbehave": [{"attempt": 0, "rank": 1, "step": 5, "do": "exit"}, ...]}

A restarted group (MSCALE_SELF_CHECK=1) self-checks first: slots in `bad_slots` fail it (rank 0
writes the verdict, every rank reports the failure and exits as the real self-check does).

Healthy but slow steps, on every rank of every attempt: `save_s` (each save's stall, in phase
'checkpointing'), `eval_every` and `eval_s` (an evaluation, in phase 'evaluating'),
`slow_every` and `slow_s` (a step in the training phase that takes `slow_s`, as on a loaded box).

`do`: exit (status 1), failure (reports an exception at the step, then exits 1), fatal (prints
a fatal log line and stays alive), hang (stops in its host phase; its peers wait in 'sync'),
straggle (its host phase takes most of every step), malformed (also posts broken heartbeats
with the right token). Ranks step together (a file barrier stands in for the step's collective:
a rank whose peer died waits), rank 0 writes WORKDIR/checkpoints/<step> every
`checkpoint_every` steps (one the file system refuses is reported as a refused save, and the
worker goes on), and a (re)started group resumes after the latest one.

  python tests/fake_worker.py driver OPTIONS_JSON   runs the real Driver on these workers
"""
import json
import os
import sys
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from mscale_jax.observability import hang  # noqa: E402
from mscale_jax.resilience import events  # noqa: E402
from mscale_jax.resilience.worker.heartbeat import HeartbeatClient  # noqa: E402


class Phases:
  """Stands in for the loop's PhaseMachine: per-step phase seconds and where the loop is."""

  def __init__(self):
    self.completed, self.now = [], ["host", 0, 0.0]

  def drain(self):
    out, self.completed = self.completed, []
    return out

  def where(self):
    return list(self.now)


def host_work(seconds):   # a rank hung here is "in its host phase"
  time.sleep(seconds)


def wait_for_result(seconds):   # its peers wait here for a step that never comes
  time.sleep(seconds)


def worker(workdir):
  plan = json.loads(os.environ["FAKE_PLAN"])
  rank, attempt = int(os.environ["MSCALE_PROCESS_ID"]), int(os.environ["MSCALE_ATTEMPT"])
  mine = {m["step"]: m["do"] for m in plan.get("misbehave", [])
          if m["attempt"] == attempt and m["rank"] == rank}
  hung_at = {m["step"] for m in plan.get("misbehave", [])
             if m["attempt"] == attempt and m["do"] == "hang"}
  hang.install_stack_dump(os.path.join(workdir, "resilience", "stacks",
                                       f"attempt{attempt}-rank{rank}.txt"))
  client, phases = HeartbeatClient.from_env(), Phases()
  client.start(phases)
  if os.environ.get("MSCALE_SELF_CHECK") == "1":
    self_check(client, workdir, plan.get("bad_slots", []), attempt, rank)
  client.phase(events.TRAINING)
  step_s = plan.get("step_s", 0.05)
  done = [int(d) for d in os.listdir(os.path.join(workdir, "checkpoints"))] \
      if os.path.isdir(os.path.join(workdir, "checkpoints")) else []
  for step in range(max(done, default=0) + 1, plan["steps"] + 1):
    do = mine.get(step)
    if step in hung_at:   # the step that hangs: the odd rank in 'host', the others in 'sync'
      phases.now = ["host" if do == "hang" else "sync", step, 0.0]
      client.post()
      (host_work if do == "hang" else wait_for_result)(3600)
    if do == "exit":
      sys.exit(1)
    if do == "failure":
      client.failure(events.EXCEPTION, "RuntimeError: injected by the plan", step=step)
      sys.exit(1)
    if do == "fatal":
      print("F0000 Check failed: the plan says so", flush=True)
      time.sleep(3600)
    if do == "malformed" or mine.get("every") == "malformed":
      _post_raw(client, json.dumps({"rank": 99, "host": "h", "pid": 1}).encode())
      _post_raw(client, json.dumps({"rank": rank, "host": "h", "pid": 1,
                                    "failure": "notadict"}).encode())
      _post_raw(client, b'{"rank": 0, "host": ')
    host_s = 0.8 * step_s if mine.get("every") == "straggle" else 0.05 * step_s
    time.sleep(plan["slow_s"] if step % plan.get("slow_every", 10**9) == 0 else step_s)
    barrier(workdir, attempt, step, rank)
    phases.completed.append([step, {"host": host_s, "sync": step_s - host_s}])
    if step % plan.get("eval_every", 10**9) == 0:
      stall(client, events.EVALUATING, plan["eval_s"])
    if step % plan.get("checkpoint_every", 10**9) == 0:
      stall(client, events.CHECKPOINTING, plan.get("save_s", 0.0))
    if rank == 0 and step % plan.get("checkpoint_every", 10**9) == 0:
      try:
        os.makedirs(os.path.join(workdir, "checkpoints", str(step)), exist_ok=True)
      except OSError as e:
        client.recovered(events.SAVE_REFUSED, f"checkpoint step {step}: {e}", step=step)
    phases.now = ["host", step + 1, 0.0]
    if mine.get(step + 1) == "hang":
      time.sleep(1.0)   # its peers report this step first: it is not the least recent to advance
    client.progress(step, 3.0 - 0.1 * step, 1.0, 0.0)
    client.post()
  client.close(events.DONE)


def self_check(client, workdir, bad_slots, attempt, rank):
  """The group's self-check: the same verdict on every rank; a failing slot ends the group."""
  client.phase(events.SELF_CHECK)
  barrier(workdir, attempt, "selfcheck", rank)
  with open(os.path.join(workdir, "barrier", f"slots-a{attempt}"), "a") as f:
    f.write(os.environ["MSCALE_SLOT"] + "\n")
  barrier(workdir, attempt, "selfcheck-slots", rank)
  with open(os.path.join(workdir, "barrier", f"slots-a{attempt}")) as f:
    slots = sorted(int(line) for line in f)
  excluded = {str(s): "the plan says it is bad" for s in slots if s in bad_slots}
  if rank == 0:
    folder = os.path.join(workdir, "resilience", f"selfcheck-{attempt}")
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "verdict.json"), "w") as f:
      json.dump({"seconds": 0.0, "results": {}, "excluded": excluded}, f)
  barrier(workdir, attempt, "selfcheck-verdict", rank)
  if excluded:
    client.failure(events.SELF_CHECK_FAILED, f"slots {sorted(excluded)} fail")
    sys.exit(events.EXIT_SELF_CHECK_FAILED)
  client.phase(events.TRAINING)


def stall(client, phase, seconds):
  """A save or an evaluation: `seconds` in `phase` (reported), then back to training."""
  if seconds:
    client.phase(phase)
    time.sleep(seconds)
    client.phase(events.TRAINING)


def barrier(workdir, attempt, step, rank):
  """Returns once every rank of the group has reached `step` (waits forever otherwise)."""
  folder = os.path.join(workdir, "barrier")
  os.makedirs(folder, exist_ok=True)
  open(os.path.join(folder, f"a{attempt}-s{step}-r{rank}"), "w").close()
  count = int(os.environ["MSCALE_NUM_PROCESSES"])
  while sum(os.path.exists(os.path.join(folder, f"a{attempt}-s{step}-r{r}"))
            for r in range(count)) < count:
    time.sleep(0.005)


def _post_raw(client, body):
  request = urllib.request.Request(client.url, data=body, method="POST",
                                   headers={"Authorization": f"Bearer {client.token}"})
  try:
    urllib.request.urlopen(request, timeout=2).close()
  except OSError:
    pass


def driver(options_json):
  from mscale_jax.resilience.driver.supervisor import Driver, DriverOptions
  from mscale_jax.resilience.faults import parse_faults
  options = json.loads(options_json)
  options = DriverOptions(**dict(options, faults=tuple(parse_faults(options.get("faults")))))
  report = Driver(options).run()
  sys.exit(0 if report["completed"] else 1)


if __name__ == "__main__":
  if sys.argv[1] == "driver":
    driver(sys.argv[2])
  else:
    worker(next(a.split("=", 1)[1] for a in sys.argv if a.startswith("--workdir=")))
