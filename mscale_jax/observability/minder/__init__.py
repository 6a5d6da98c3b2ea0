"""Minder (Deng et al., "Minder: Faulty Machine Detection for Large-scale Distributed Model
Training", NSDI 2025): find the faulty machine from its monitoring metrics.

  windows.py     per-metric min-max normalisation and the sliding windows
  vae.py         the per-metric LSTM-VAE (Flax NNX) that denoises and embeds a window
  similarity.py  each machine's distance to the others' embeddings; the one that stands out
  continuity.py  a machine is flagged only when it stands out for several checks in a row
  priority.py    a small decision tree that orders metrics by how indicative they are
  detector.py    `Minder` (the fitted models) and `MinderDetector` (the online part)

The detector reads metric arrays only ([machines, samples] per metric); how faults are made or
labelled (experiments/minder_fleet.py) is nowhere in this package.
"""
from mscale_jax.observability.minder.detector import (Minder, MinderConfig, MinderDetector,
                                                      MinderFlag, episode_features)

__all__ = ["Minder", "MinderConfig", "MinderDetector", "MinderFlag", "episode_features"]
