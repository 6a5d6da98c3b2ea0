"""Failures the workers recovered from in their own processes (events.RECOVERED_KINDS: a save
the file system refused, dropped while training went on), as the driver hears of them in the
heartbeats. Each is recorded once (with every rank that reported it), said on a driver line and
linked to the injected fault that caused it (an io_error), which ends there if it lasts until
its failure is detected. They cost no restart: the report lists them apart from its failures.
"""
from mscale_jax.resilience import events
from mscale_jax.resilience.driver import claim

# The injected fault kind each recovered kind comes from, when a drill injected one.
CAUSES = {events.SAVE_REFUSED: "io_error"}


class RecoveredLog:
  """The job's recovered failures (`records`, oldest first); `injector`: the driver's
  OsInjector, `say` prints a driver line."""

  def __init__(self, state_dir: str, injector, say, records=()):
    self.state_dir, self.injector, self.say = state_dir, injector, say
    self.records: list[dict] = list(records)
    self._seen: set[tuple] = set()   # (attempt, rank, seq) read already

  def note(self, group, beats: dict) -> None:
    """Records what the heartbeats `beats` (rank -> (heartbeat, time received)) of `group`
    (the driver's _Group) report recovered for the first time."""
    for rank, (beat, received) in sorted(beats.items()):
      for item in beat.recovered:
        if (beat.attempt, rank, item["seq"]) not in self._seen:
          self._seen.add((beat.attempt, rank, item["seq"]))
          self._add(group, rank, item, received)

  def _add(self, group, rank: int, item: dict, received: float) -> None:
    same = next((r for r in self.records if (r["attempt"], r["kind"], r["step"]) ==
                 (group.attempt, item["kind"], item["step"]) and item["step"] is not None), None)
    if same is not None:   # another rank's report of the same save (or the same rank's again)
      same["ranks"] = sorted(set(same["ranks"]) | {rank})
      return
    self.injector.failure_detected()
    fired = claim.fired_since(self.state_dir, group.started, CAUSES.get(item["kind"], "-"))
    if fired and any(r["injected"] == fired["fault"] for r in self.records):
      fired = None   # linked already: a later refusal of the same fault is not its detection
    record = {"kind": item["kind"], "ranks": [rank], "attempt": group.attempt,
              "step": item["step"], "detail": item["detail"], "reported_at": item["time"],
              "detected_at": received, "injected": fired and fired["fault"],
              "happened_at": fired and fired["time"],
              "detection_latency_s": fired and received - fired["time"]}
    self.records.append(record)
    self.say(f"recovered in the process: {item['kind']} at step {item['step']} on rank {rank}: "
             f"{item['detail'][:300]}" + (f" (injected {fired['fault']}, "
                                          f"{record['detection_latency_s']:.1f} s before)"
                                          if fired else ""))
