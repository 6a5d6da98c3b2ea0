"""Similarity across machines: the machine whose embedding is far from everyone else's.

Minder's first observation (§3, §4.3): in data-parallel training every healthy machine runs the
same work, so its metrics look like its peers'; a faulty machine's look different. Per metric and
per window, Minder measures each machine's distance to every other machine's embedding and takes
the machine with the largest total as the candidate, if it stands out enough.

We use Euclidean distances between the VAE embeddings (the paper's choice among the distances it
compared), a machine's score is its mean distance to the others, and the candidate must stand
out in two ways: its score is `ratio` times the median machine's (scale-free, so one threshold
serves every metric) and at least `floor` in embedding units (when all machines agree to within
noise the ratio alone would flag noise).
"""
import dataclasses

import numpy as np


def dissimilarity(embeddings: np.ndarray) -> np.ndarray:
  """[M, D] -> [M]: each machine's mean Euclidean distance to the other M-1 machines."""
  e = np.asarray(embeddings, np.float64)
  m = len(e)
  if m < 2:
    return np.zeros(m)
  sq = np.sum(e * e, axis=1)
  d2 = np.maximum(sq[:, None] + sq[None, :] - 2.0 * e @ e.T, 0.0)
  return np.sqrt(d2).sum(axis=1) / (m - 1)


@dataclasses.dataclass(frozen=True)
class Candidate:
  """The machine that stands out on one metric in one window."""
  machine: int
  score: float      # its mean distance to the others (embedding units)
  ratio: float      # score / median score of all machines

  def stands_out(self, *, ratio: float, floor: float) -> bool:
    """Whether its score is at least `ratio` x the median score and at least `floor`."""
    return self.ratio >= ratio and self.score >= floor


def most_distinct(embeddings: np.ndarray) -> Candidate | None:
  """The machine whose embedding is furthest from the others' (whether or not it stands out);
  None with fewer than 3 machines (with two, both are equally far from each other)."""
  scores = dissimilarity(embeddings)
  if len(scores) < 3:
    return None
  top = int(np.argmax(scores))
  median = float(np.median(scores))
  return Candidate(top, float(scores[top]), float(scores[top] / max(median, 1e-12)))


def outlier(embeddings: np.ndarray, *, ratio: float, floor: float) -> Candidate | None:
  """The most distinct machine if its score is at least `ratio` x the median score and at
  least `floor`; else None."""
  top = most_distinct(embeddings)
  if top is not None and top.stands_out(ratio=ratio, floor=floor):
    return top
  return None
