"""Seeing where time goes (MegaScale §5): per-rank phases and timeline, their merge, the
heat-map, the profiler window, straggler detection and hang localisation.

  phases.py     the training loop's phase state machine (the timeline, heartbeats and the
                driver's coarse phases all read it)
  timeline.py   one rank's spans on disk (WORKDIR/timeline/rank{R}.jsonl)
  trace.py      the ranks' timelines merged: Chrome trace, summary (and the heat-map)
  heatmap.py    ranks x steps and ranks x phases (MegaScale Figure 6)
  profiler.py   `train.profile_steps`: a jax.profiler trace of a window of steps
  straggler.py  the straggler detector (per-rank metrics against the others', continuity)
  hang.py       stack dumps on a signal, and naming the rank that is not where the others are
  minder/       Minder (NSDI'25): per-metric LSTM-VAE embeddings, similarity across machines,
                continuity and a learned metric priority (the faulty-machine detector)
  observer.py   the driver's eyes: feeds heartbeats to the detectors, localises hangs, status

Workers use phases, timeline, profiler and the stack dump of hang.py; the driver uses the
observer. Everything here is below both (it imports only `resilience.events` among them).
"""
