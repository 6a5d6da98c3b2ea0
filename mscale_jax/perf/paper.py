"""The paper's runs as rows (setup + reported MFU), and the one rule that lays each row out.

Every row is predicted with the same `Constants`; rows differ only in what the paper varied:
model, GPU count, global batch and the technique switches. The micro-batch size, which the
paper does not give, follows one rule for every row: the largest of 1, 2, 4, 8 that divides the
per-pipeline batch, leaves at least pp micro-batches and fits in memory without recomputation
once MegaScale's operators are on (Megatron-LM then recomputes what it must to fit).
"""
import dataclasses

from mscale_jax.perf.constants import DEFAULT, Constants
from mscale_jax.perf.hardware import A100_MEGASCALE, Hardware
from mscale_jax.perf.memory import memory_per_device
from mscale_jax.perf.iteration import Prediction, predict
from mscale_jax.perf.workload import GPT_175B, GPT_530B, Layout, ModelSpec, Techniques

# The paper gives no window; half the 2,048-token context.
SWA_WINDOW = 1024

MEGATRON = Techniques()
MEGASCALE = Techniques(parallel_block=True, sliding_window=SWA_WINDOW, tp_overlap=True,
                       pp_overlap=True, dp_overlap=True, efficient_ops=True, async_data=True,
                       lamb=True)

# Paper Table 1: TP, PP, virtual stages per model.
PARALLELISM = {"175B": (8, 8, 6), "530B": (8, 35, 3)}
MICRO_BATCHES = (8, 4, 2, 1)


@dataclasses.dataclass(frozen=True)
class Row:
  """One reported run: `system` is 'megatron', 'megascale' or a Table 3 step name."""
  table: str
  model: ModelSpec
  system: str
  gpus: int
  global_batch: int
  techniques: Techniques
  paper_mfu: float | None        # percent, None where megascale.md gives no number


def ablation_steps() -> list:
  """Paper Table 3: (step name, cumulative techniques, global batch, paper MFU %)."""
  steps = [("baseline", {}, 47.7), ("parallel_block", {"parallel_block": True}, 52.3),
           ("sliding_window", {"sliding_window": SWA_WINDOW}, 53.3),
           ("tp_overlap", {"tp_overlap": True}, 55.5), ("pp_overlap", {"pp_overlap": True}, 58.0),
           ("dp_overlap", {"dp_overlap": True}, 59.5),
           ("efficient_ops", {"efficient_ops": True}, 61.2),
           ("misc", {"async_data": True}, 62.3), ("lamb", {"lamb": True}, 65.3)]
  out, switches = [], {}
  for name, change, paper in steps:
    switches.update(change)
    batch = 768 if switches.get("lamb") else 256
    out.append((name, Techniques(**switches), batch, paper))
  return out


# Paper Table 2, 175B: {(global batch, GPUs): (Megatron-LM, MegaScale)} MFU in percent and
# iteration seconds (our megascale.md). The batch-6,144 rows were added after the first
# out-of-sample round (issue 25); `experiments/scaling_curves.py --protocol=first_contact`
# recorded the model's errors on them before any change.
TABLE2_MFU = {(768, 256): (53.0, 65.3), (768, 512): (49.9, 63.5), (768, 768): (46.7, 61.3),
              (768, 1024): (44.7, 59.0), (6144, 3072): (48.7, 59.1), (6144, 6144): (47.8, 57.3),
              (6144, 8192): (43.3, 54.9), (6144, 12288): (41.2, 55.2)}
TABLE2_ITERATION_S = {(768, 256): (40.0, 32.0), (768, 512): (21.2, 16.5),
                      (768, 768): (15.2, 11.5), (768, 1024): (11.9, 8.9),
                      (6144, 3072): (29.02, 23.66), (6144, 6144): (14.78, 12.21),
                      (6144, 8192): (12.24, 9.56), (6144, 12288): (8.57, 6.34)}
# Figure 9 (530B weak scaling, batch = GPUs): no figure in our notes.
FIGURE9_GPUS = (2240, 4480, 11200)


def rows() -> list:
  """Every row scaling_curves.py predicts: Table 3, Table 2 (both batches), Figure 9 runs."""
  out = [Row("table3", GPT_175B, name, 256, batch, tech, paper)
         for name, tech, batch, paper in ablation_steps()]
  for (batch, gpus), (meg, ms) in TABLE2_MFU.items():
    out.append(Row("table2", GPT_175B, "megatron", gpus, batch, MEGATRON, meg))
    out.append(Row("table2", GPT_175B, "megascale", gpus, batch, MEGASCALE, ms))
  for gpus in FIGURE9_GPUS:
    out.append(Row("fig9", GPT_530B, "megatron", gpus, gpus, MEGATRON, None))
    out.append(Row("fig9", GPT_530B, "megascale", gpus, gpus, MEGASCALE, None))
  return out


def row_layout(row: Row, hw: Hardware = A100_MEGASCALE, c: Constants = DEFAULT) -> Layout:
  """The paper's TP/PP/virtual stages and the micro-batch rule of this module's docstring."""
  tp, pp, vpp = PARALLELISM[row.model.name]
  dp = row.gpus // (tp * pp)
  per_pipeline = row.global_batch // dp
  flash_on = dataclasses.replace(row.techniques, efficient_ops=True)
  for mb in MICRO_BATCHES:
    layout = Layout(tp, pp, vpp, dp, mb, row.global_batch)
    if per_pipeline % mb or per_pipeline // mb < pp:
      continue
    if memory_per_device(row.model, layout, flash_on, "none", hw.hbm_bytes, c).fits:
      return layout
  return Layout(tp, pp, vpp, dp, 1, row.global_batch)


def predict_row(row: Row, hw: Hardware = A100_MEGASCALE, c: Constants = DEFAULT) -> Prediction:
  """Predicts one row with the shared constants `c`."""
  return predict(row.model, row_layout(row, hw, c), row.techniques, hw, c)
