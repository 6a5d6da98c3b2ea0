"""The pipeline bench's FLOPs accounting (`experiments/pipeline_bench.py`)."""
import pytest

from experiments import pipeline_bench
from mscale_jax.parallel.pipeline_plan import Op


@pytest.mark.parametrize("recompute", ["none", "full"])
def test_split_backward_costs_what_the_unsplit_backward_does(recompute):
  """ZB-H1's B and W, each compiled alone, add up to 1F1B's backward of the same chunk (the
  loss head's: it holds the tensor-sharded unembedding). A W fed its kept values laid out
  otherwise than its B leaves them would count the unembedding's weight gradient whole."""
  last = Op("B", first=False, last=True)
  cost = lambda op, split: pipeline_bench.op_flops(op, recompute, split, microbatches=8)
  split = cost(last, True) + cost(last._replace(kind="W"), True)
  assert split == pytest.approx(cost(last, False), rel=0.005)
