"""The paper's runs as rows (setup + reported MFU), and the one rule that lays each row out.

Every row is predicted with the same `Constants`; rows differ only in what the paper varied:
model, GPU count, global batch and the technique switches. The layout is the paper's (Table 1:
TP, PP, virtual stages; DP fills the GPUs). The micro-batch size, which the paper does not give,
follows one rule, shared with `experiments/plan.py`: of 1, 2, 4 and 8, those that divide the
per-pipeline batch, leave at least pp micro-batches and fit in memory without full
recomputation are the candidates (`micro_batch_choices`), and the run is predicted at the
fastest of them, as a team tuning its job would pick. The candidates' spread is the
micro-batch's nuisance range, which the prediction intervals carry.
"""
import dataclasses

from mscale_jax.flops import megatron_flops_per_token, mfu
from mscale_jax.perf.constants import DEFAULT, Constants
from mscale_jax.perf.hardware import A100_MEGASCALE, Hardware
from mscale_jax.perf.iteration import Prediction, predict
from mscale_jax.perf.memory import memory_per_device
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


# Paper Table 2, 175B: {(global batch, GPUs): (Megatron-LM, MegaScale)} as printed (our
# megascale.md): MFU in percent; the throughput as tokens/s for batch 768 (four significant
# digits, more than its iteration times) and as iteration seconds for batch 6,144. The
# batch-6,144 rows were added after the first out-of-sample round (issue 25):
# `experiments/scaling_curves.py --protocol=first_contact` recorded the model's errors on
# them before any change.
TABLE2_MFU = {(768, 256): (53.0, 65.3), (768, 512): (49.9, 63.5), (768, 768): (46.7, 61.3),
              (768, 1024): (44.7, 59.0), (6144, 3072): (48.7, 59.1), (6144, 6144): (47.8, 57.3),
              (6144, 8192): (43.3, 54.9), (6144, 12288): (41.2, 55.2)}
TABLE2_TOKENS_PER_S = {(768, 256): (39.3e3, 49.0e3), (768, 512): (74.1e3, 95.1e3),
                       (768, 768): (103.8e3, 136.7e3), (768, 1024): (132.7e3, 176.9e3)}
TABLE2_ITERATION_S = {(6144, 3072): (29.02, 23.66), (6144, 6144): (14.78, 12.21),
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


def paper_iteration_s(row: Row) -> float | None:
  """The iteration seconds the paper reports for `row`'s run (None where it gives none).

  Table 3's last step is Table 2's 256-GPU MegaScale run, so it has one too.
  """
  system = {MEGATRON: 0, MEGASCALE: 1}.get(row.techniques)
  key = (row.global_batch, row.gpus)
  if row.table not in ("table2", "table3") or row.model is not GPT_175B or system is None:
    return None
  if key in TABLE2_TOKENS_PER_S:
    return row.global_batch * row.model.seq_len / TABLE2_TOKENS_PER_S[key][system]
  if key in TABLE2_ITERATION_S:
    return TABLE2_ITERATION_S[key][system]
  return None


def throughput_mfu(row: Row) -> float | None:
  """MFU in percent of the paper's own throughput for `row`, counted by the Megatron formula.

  The paper's Megatron-LM MFU column equals this to 0.2% on all 8 Table 2 rows; its MegaScale
  column is 0.989-0.991 of it on 7 of 8 (0.998 at 768 GPUs): MegaScale's MFU evidently counts
  fewer FLOPs per token than the formula. Comparing the model (which counts by the formula)
  with the printed MegaScale MFU would charge it ~0.6 points for a counting difference.
  """
  seconds = paper_iteration_s(row)
  if seconds is None:
    return None
  tokens_per_s = row.global_batch * row.model.seq_len / seconds
  flops = megatron_flops_per_token(row.model.num_layers, row.model.hidden, row.model.seq_len,
                                   row.model.vocab)
  return 100 * mfu(tokens_per_s, flops, row.gpus, A100_MEGASCALE.peak())


def target_mfu(row: Row) -> float | None:
  """The paper figure a prediction is compared with: `throughput_mfu` where the paper gives a
  throughput (every Table 2 row and Table 3's last), its printed MFU elsewhere, else None."""
  measured = throughput_mfu(row)
  return row.paper_mfu if measured is None else measured


def micro_batch_choices(model: ModelSpec, gpus: int, global_batch: int, tech: Techniques,
                        hw: Hardware = A100_MEGASCALE, c: Constants = DEFAULT) -> list:
  """Predictions of the paper's layout of `model` on `gpus` at every candidate micro-batch.

  Candidates: each of MICRO_BATCHES that divides the per-pipeline batch, leaves at least pp
  micro-batches and fits in memory without full recomputation (which costs a third more
  compute: no team runs it when a layout fits without); only if none does, those that fit
  with it. Empty if the paper's TP x PP does not divide `gpus` or nothing fits.
  """
  tp, pp, vpp = PARALLELISM[model.name]
  if gpus % (tp * pp) or global_batch % (gpus // (tp * pp)):
    return []
  dp = gpus // (tp * pp)
  per_pipeline = global_batch // dp
  layouts = [Layout(tp, pp, vpp, dp, mb, global_batch) for mb in MICRO_BATCHES
             if per_pipeline % mb == 0 and per_pipeline // mb >= pp]
  partial = [lay for lay in layouts if any(
      memory_per_device(model, lay, tech, option, hw.hbm_bytes, c).fits
      for option in ("none", "selective"))]
  preds = [predict(model, lay, tech, hw, c) for lay in (partial or layouts)]
  return [p for p in preds if p.fits]


def tuned(predictions: list) -> Prediction:
  """The rule: the fastest candidate (highest MFU; the larger micro-batch on a tie)."""
  return max(predictions, key=lambda p: (round(p.mfu, 12), p.layout.micro_batch))


def predict_row(row: Row, hw: Hardware = A100_MEGASCALE, c: Constants = DEFAULT) -> Prediction:
  """Predicts one row with the shared constants `c` at the rule's micro-batch.

  If no micro-batch fits, the prediction at micro-batch 1 says so (`fits` is False).
  """
  choices = micro_batch_choices(row.model, row.gpus, row.global_batch, row.techniques, hw, c)
  if choices:
    return tuned(choices)
  tp, pp, vpp = PARALLELISM[row.model.name]
  layout = Layout(tp, pp, vpp, row.gpus // (tp * pp), 1, row.global_batch)
  return predict(row.model, layout, row.techniques, hw, c)


def row_layout(row: Row, hw: Hardware = A100_MEGASCALE, c: Constants = DEFAULT) -> Layout:
  """The layout `predict_row` uses: the paper's TP/PP/virtual stages, the rule's micro-batch."""
  return predict_row(row, hw, c).layout


def time_split(system: str, global_batch: int, seconds=None) -> dict:
  """The paper's own Table 2 iteration times as `seconds = per_sequence * n + fixed`.

  n is the sequences each pipeline runs per iteration (global batch / DP, the paper's layout).
  A least-squares line over the four GPU counts of one system and batch: `per_sequence` holds
  what grows with the micro-batches (the steady state), `fixed` what does not (bubble, exposed
  DP, optimizer). Uses no model: it says where the paper's time goes between its runs.
  `seconds(row)` replaces the paper's times (e.g. a model's predictions, to compare).
  Returns {'per_sequence', 'fixed', 'residuals': {gpus: seconds}}.
  """
  column = {"megatron": 0, "megascale": 1}[system]
  seconds = seconds or paper_iteration_s
  tp, pp, _ = PARALLELISM["175B"]
  points = []
  for (batch, gpus) in TABLE2_MFU:
    if batch == global_batch:
      row = Row("table2", GPT_175B, system, gpus, batch,
                (MEGATRON, MEGASCALE)[column], None)
      points.append((gpus, batch // (gpus // (tp * pp)), seconds(row)))
  mean_n = sum(n for _, n, _ in points) / len(points)
  mean_t = sum(t for _, _, t in points) / len(points)
  slope = (sum((n - mean_n) * (t - mean_t) for _, n, t in points)
           / sum((n - mean_n) ** 2 for _, n, _ in points))
  fixed = mean_t - slope * mean_n
  return {"per_sequence": slope, "fixed": fixed,
          "residuals": {g: t - (slope * n + fixed) for g, n, t in points}}
