"""Merging the ranks' timelines: one Chrome trace (Perfetto / chrome://tracing), a summary.

Reads WORKDIR/timeline/rank{R}.jsonl (timeline.py), the driver's events in driver.jsonl and
the per-rank clock offsets the driver measured (clock_offsets.json: seconds to add to a rank's
wall clock to get the driver's), and writes

  trace.json     Chrome trace: one process track per rank (pid = rank; thread 'loop' holds
                 the training loop's spans, thread 'checkpoint' the background writes), and a
                 'driver' track (restarts, straggler flags, hangs) when the driver wrote events
  summary.json   per rank and phase: mean seconds per iteration; which rank is furthest out
"""
import collections
import glob
import json
import os
import re

import numpy as np

from mscale_jax.files import write_json
from mscale_jax.observability import heatmap
from mscale_jax.observability import phases as phases_lib
from mscale_jax.observability import timeline as timeline_lib

DRIVER_PID = -1
_TIDS = {phases_lib.LOOP: 0, phases_lib.CHECKPOINT: 1}


def load(run_dir: str) -> dict:
  """{'ranks': {rank: {'metas', 'spans'}}, 'driver': [events], 'offsets': {rank: s}}."""
  directory = os.path.join(run_dir, "timeline")
  ranks = {}
  for path in glob.glob(os.path.join(directory, "rank*.jsonl")):
    match = re.fullmatch(r"rank(\d+)\.jsonl", os.path.basename(path))
    if match:
      metas, spans = timeline_lib.read_rank_file(path)
      ranks[int(match.group(1))] = {"metas": metas, "spans": spans}
  driver = []
  if os.path.exists(os.path.join(directory, "driver.jsonl")):
    driver = timeline_lib.read_rank_file(os.path.join(directory, "driver.jsonl"))[1]
  offsets = {}
  if os.path.exists(os.path.join(directory, "clock_offsets.json")):
    with open(os.path.join(directory, "clock_offsets.json")) as f:
      offsets = {int(k): float(v) for k, v in json.load(f).items()}
  return {"ranks": dict(sorted(ranks.items())), "driver": driver, "offsets": offsets}


def chrome_trace(data: dict) -> dict:
  """The Chrome trace (JSON object format) of `load()`'s data; times in µs from the first span."""
  offsets = data["offsets"]
  starts = [s["start"] + offsets.get(r, 0.0) for r, d in data["ranks"].items()
            for s in d["spans"]] + [e["start"] for e in data["driver"]]
  origin = min(starts, default=0.0)

  def us(t: float) -> int:
    return int(round((t - origin) * 1e6))

  events = []
  for rank, d in data["ranks"].items():
    meta = d["metas"][-1] if d["metas"] else {}
    label = f"rank {rank}" + (f" ({meta['host']})" if meta.get("host") else "")
    events += [{"ph": "M", "name": "process_name", "pid": rank, "args": {"name": label}},
               {"ph": "M", "name": "process_sort_index", "pid": rank, "args": {"sort_index": rank}}]
    events += [{"ph": "M", "name": "thread_name", "pid": rank, "tid": tid, "args": {"name": track}}
               for track, tid in _TIDS.items()]
    off = offsets.get(rank, 0.0)
    for s in d["spans"]:
      start, end = us(s["start"] + off), us(s["end"] + off)
      events.append({"ph": "X", "name": s["name"], "pid": rank, "tid": _TIDS.get(s["track"], 0),
                     "ts": start, "dur": end - start, "args": {"step": s["step"]}})
  if data["driver"]:
    events.append({"ph": "M", "name": "process_name", "pid": DRIVER_PID,
                   "args": {"name": "driver"}})
    for e in data["driver"]:
      start, end = us(e["start"]), us(e.get("end", e["start"]))
      if end == start:   # a moment: a straggler flag, a declared hang
        events.append({"ph": "i", "s": "p", "name": e["name"], "pid": DRIVER_PID, "tid": 2,
                       "ts": start, "args": e.get("args", {})})
      else:              # attempts on one thread, restarts (which overlap them) on another
        events.append({"ph": "X", "name": e["name"], "pid": DRIVER_PID,
                       "tid": 1 if e["name"] == "restart" else 0, "ts": start,
                       "dur": end - start, "args": e.get("args", {})})
  return {"traceEvents": events, "displayTimeUnit": "ms",
          "otherData": {"origin_unix_s": origin, "clock": "each rank's wall clock plus the "
                        "offset the driver measured from its heartbeats (clock_offsets.json)"}}


def summarize(data: dict) -> dict:
  """Per rank: iterations, mean seconds per phase per iteration, own time, one-off phases;
  per phase: the rank furthest above the median of the others."""
  ranks = {}
  for rank, d in data["ranks"].items():
    iters = timeline_lib.per_iteration(d["spans"])
    steps = sorted(iters)
    phases = sorted({p for v in iters.values() for p in v}, key=phases_lib.LOOP_PHASES.index)
    once = collections.defaultdict(float)
    for s in d["spans"]:
      if s["name"] in ("compile", "restore", "checkpoint_write", "profile"):
        once[s["name"]] += s["end"] - s["start"]
    ranks[rank] = {
        "iterations": len(steps), "first_step": steps[0] if steps else None,
        "last_step": steps[-1] if steps else None,
        "mean_s": {p: float(np.mean([iters[s].get(p, 0.0) for s in steps])) for p in phases},
        "mean_iteration_s": float(np.mean([sum(iters[s].values()) for s in steps]))
        if steps else None,
        "mean_own_s": float(np.mean([timeline_lib.own_time(iters[s]) for s in steps]))
        if steps else None,
        "total_s": dict(once),
    }
  outliers = {}
  for phase in phases_lib.LOOP_PHASES:
    values = {r: v["mean_s"][phase] for r, v in ranks.items() if phase in v["mean_s"]}
    if len(values) < 2:
      continue
    excess = {r: v - float(np.median([w for q, w in values.items() if q != r]))
              for r, v in values.items()}
    worst = max(excess, key=excess.get)
    outliers[phase] = {"rank": worst, "excess_s": excess[worst], "mean_s": values[worst]}
  return {"ranks": ranks, "furthest_above_others": outliers}


def merge(run_dir: str) -> dict:
  """Writes trace.json and summary.json (and the heat-map) under RUN_DIR/timeline; returns
  {'trace', 'summary', 'heatmap': paths, 'data', 'summary_data'}."""
  directory = os.path.join(run_dir, "timeline")
  data = load(run_dir)
  if not data["ranks"]:
    raise FileNotFoundError(f"no rank*.jsonl timeline files in {directory}")
  trace_path = os.path.join(directory, "trace.json")
  write_json(trace_path, chrome_trace(data))
  summary = summarize(data)
  summary_path = os.path.join(directory, "summary.json")
  write_json(summary_path, summary)
  png = heatmap.write(data, os.path.join(directory, "heatmap.png"))
  return {"trace": trace_path, "summary": summary_path, "heatmap": png, "data": data,
          "summary_data": summary}

