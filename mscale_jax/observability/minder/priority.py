"""Metric prioritisation: which metrics to trust first, learned from labelled episodes.

Minder (§4.5) does not weigh all metrics alike: some (its production table puts network and CPU
metrics on top) point at faulty machines far more often than others, which are noisy. It trains
a decision tree on labelled fault and normal cases, with each metric's detection result as a
feature, and checks metrics in the order of their importance in the tree, most indicative first;
the first metric that yields a detection names the machine.

The tree is a small CART (Gini impurity, binary splits at midpoints between sorted values). It is
written here rather than imported: about sixty lines, against adding scikit-learn to the
dependencies for one fit of a depth-4 tree on a few hundred rows. A metric's importance is the
total impurity decrease of its splits, weighted by the rows that reach them; metrics the tree
does not use follow, ordered by the gain of their best single split.
"""
import dataclasses

import numpy as np


def _gini(y: np.ndarray) -> float:
  if len(y) == 0:
    return 0.0
  p = np.mean(y)
  return 2.0 * p * (1.0 - p)


def best_split(x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
  """Best threshold on one feature x [n] for binary labels y [n]: (impurity decrease, threshold);
  (0.0, nan) when no split helps."""
  order = np.argsort(x, kind="stable")
  xs, ys = x[order], y[order].astype(np.float64)
  n = len(xs)
  left_pos = np.cumsum(ys)[:-1]
  left_n = np.arange(1, n)
  right_pos, right_n = ys.sum() - left_pos, n - left_n
  gl = 2 * (left_pos / left_n) * (1 - left_pos / left_n)
  gr = 2 * (right_pos / right_n) * (1 - right_pos / right_n)
  gain = _gini(ys) - (left_n * gl + right_n * gr) / n
  valid = xs[1:] > xs[:-1]                 # only between distinct values
  if not valid.any():
    return 0.0, float("nan")
  gain = np.where(valid, gain, -np.inf)
  i = int(np.argmax(gain))
  return float(max(gain[i], 0.0)), float((xs[i] + xs[i + 1]) / 2)


@dataclasses.dataclass
class Node:
  """One node of the decision tree: a split on `x[feature] <= threshold`, or a leaf."""
  feature: int | None = None         # None: a leaf
  threshold: float = 0.0
  left: "Node | None" = None         # x[feature] <= threshold
  right: "Node | None" = None
  p_fault: float = 0.0               # fraction of fault rows that reached the node


def fit_tree(x: np.ndarray, y: np.ndarray, *, max_depth: int = 4, min_rows: int = 4
             ) -> tuple[Node, np.ndarray]:
  """CART on features x [n, K] and labels y [n] (1 fault, 0 normal): (root, importances [K])."""
  x, y = np.asarray(x, np.float64), np.asarray(y).astype(int)
  importance = np.zeros(x.shape[1])

  def grow(rows: np.ndarray, depth: int) -> Node:
    node = Node(p_fault=float(np.mean(y[rows])) if len(rows) else 0.0)
    if depth >= max_depth or len(rows) < min_rows or _gini(y[rows]) == 0.0:
      return node
    gains = [best_split(x[rows, k], y[rows]) for k in range(x.shape[1])]
    k = int(np.argmax([g for g, _ in gains]))
    gain, threshold = gains[k]
    if gain <= 0.0:
      return node
    importance[k] += gain * len(rows) / len(y)
    go_left = x[rows, k] <= threshold
    node.feature, node.threshold = k, threshold
    node.left, node.right = grow(rows[go_left], depth + 1), grow(rows[~go_left], depth + 1)
    return node

  return grow(np.arange(len(y)), 0), importance


def predict(node: Node, x: np.ndarray) -> np.ndarray:
  """Fault probability of each row of x [n, K] by the tree's leaves."""
  out = np.empty(len(x))
  for i, row in enumerate(np.asarray(x, np.float64)):
    n = node
    while n.feature is not None:
      n = n.left if row[n.feature] <= n.threshold else n.right
    out[i] = n.p_fault
  return out


def metric_priority(features: np.ndarray, labels: np.ndarray, metrics: list[str], *,
                    max_depth: int = 4) -> tuple[list[str], dict[str, float]]:
  """Metrics ordered most indicative first, and each metric's importance.

  Args:
    features: [episodes, K], per episode and metric a detection score (e.g. how far the most
      distinct machine stood out, detector.episode_features).
    labels: [episodes], 1 where a fault was present, 0 for a healthy stretch.
    metrics: the K metric names, in the order of the feature columns.
  """
  features, labels = np.asarray(features, np.float64), np.asarray(labels).astype(int)
  if features.shape != (len(labels), len(metrics)):
    raise ValueError(f"features {features.shape} do not match {len(labels)} labels x "
                     f"{len(metrics)} metrics")
  _, importance = fit_tree(features, labels, max_depth=max_depth)
  single = [best_split(features[:, k], labels)[0] for k in range(len(metrics))]
  order = sorted(range(len(metrics)), key=lambda k: (-importance[k], -single[k]))
  return [metrics[k] for k in order], {metrics[k]: float(importance[k]) for k in order}
