"""The one place goodput asks the performance model (mscale_jax.perf) for anything.

Only public entry points are used (`paper.Row`, `paper.predict_row`, `paper.MEGASCALE`,
`GPT_175B`), the ones experiments/scaling_curves.py and experiments/plan.py use, so a change
inside perf/ reaches the simulator through this file alone.
"""
import dataclasses

from mscale_jax.perf import paper
from mscale_jax.perf.workload import GPT_175B


@dataclasses.dataclass(frozen=True)
class Step:
  """One predicted iteration of MegaScale's 175B setup on `gpus` GPUs."""
  gpus: int
  global_batch: int
  iteration_s: float
  tokens_per_iteration: int
  mfu: float
  num_params: int

  @property
  def tokens_per_s(self) -> float:
    return self.tokens_per_iteration / self.iteration_s


def megascale_batch(gpus: int) -> int:
  """The paper's global batch: 768 sequences up to 1,024 GPUs, 6,144 up to 12,288 (Table 2);
  beyond that, the same 0.5 sequences per GPU as at 12,288 (our extrapolation)."""
  if gpus <= 1024:
    return 768
  return 6144 if gpus <= 12288 else gpus // 2


def megascale_step(gpus: int) -> Step:
  """Iteration time and throughput of 175B with every MegaScale technique on `gpus` A100s, in
  the paper's layout (TP 8, PP 8, 6 virtual stages, DP fills the rest)."""
  batch = megascale_batch(gpus)
  row = paper.Row("goodput", GPT_175B, "megascale", gpus, batch, paper.MEGASCALE, None)
  pred = paper.predict_row(row)
  return Step(gpus, batch, pred.iteration_s, batch * GPT_175B.seq_len, pred.mfu,
              GPT_175B.num_params)
