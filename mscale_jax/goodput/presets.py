"""Jobs built from `sources.INPUTS`: MegaScale's setup at any size, and the published runs the
simulator is calibrated against (MegaScale's production run, Llama 3's 54 days, Meta's RSC-1).

Failure kinds and their split come from Llama 3's Table 5, the only per-kind table of a single
large run we found; the total rate is Llama 3's, RSC-1's (Kokolis et al.) or the one MegaScale's
own restart count implies.
"""
import dataclasses

from mscale_jax.errors import ConfigError
from mscale_jax.goodput import perf_adapter
from mscale_jax.goodput.job import Checkpointing, Detection, FailureKind, Job, Recovery
from mscale_jax.goodput.sources import LLAMA3_TABLE5, llama3_node_hours, value

GPUS_PER_NODE = 8     # MegaScale's and Llama 3's servers (megascale.md 2; Llama 3 3.3.1)


def llama3_kinds(total_per_node_hour: float | None = None, planned: bool = True) -> tuple:
  """Llama 3's interruption kinds at their per-node-hour rates (Table 5 over 54 days on 2,048
  nodes); with `total_per_node_hour`, the unplanned ones scaled to that total."""
  hours = llama3_node_hours()
  scale = 1.0
  if total_per_node_hour is not None:
    scale = total_per_node_hour / (value("llama3.unexpected") / hours)
  kinds = [FailureKind(name, scale * sum(parts.values()) / hours, detected_by, replace)
           for name, (detected_by, replace, parts) in LLAMA3_TABLE5.items()]
  if planned:
    kinds.append(FailureKind("planned", value("llama3.planned") / hours, "planned", False))
  return tuple(kinds)


def rsc1_kinds(per_1000_node_days: float | None = None) -> tuple:
  """RSC-1's failure rate (Kokolis et al., per 1,000 node-days) split as Llama 3's kinds."""
  rate = value("rsc1.failures_per_1000_node_days") if per_1000_node_days is None \
      else per_1000_node_days
  return llama3_kinds(rate / 1000.0 / 24.0, planned=False)


def megascale_count_kinds() -> tuple:
  """The rate MegaScale's production run implies: 100 restarts over 3 weeks on 12,288 GPUs
  (all kinds, planned ones included, split as Llama 3's)."""
  nodes = value("megascale.gpus") / GPUS_PER_NODE
  per_node_hour = value("megascale.restarts") / (nodes * value("megascale.weeks") * 7 * 24)
  llama = llama3_kinds()
  total = sum(k.per_node_hour for k in llama)
  return tuple(dataclasses.replace(k, per_node_hour=k.per_node_hour * per_node_hour / total)
               for k in llama)


RATES = {"llama3": llama3_kinds, "rsc1": rsc1_kinds, "megascale": megascale_count_kinds}


@dataclasses.dataclass(frozen=True)
class Policy:
  """The operator's knobs the what-if questions turn (defaults: MegaScale as published).

  Values come from `sources` when a job is built, so an input overridden there (a sensitivity
  run) reaches every policy."""
  warm_spares: bool = False          # keep `warm_spares` pre-checked nodes ready
  fast_detection: bool = False       # Minder's reaction time instead of the NCCL hang timeout
  memory_checkpoints: bool = False   # Gemini-style in-memory checkpoints every iteration
  cold_replace_s: float | None = None   # None: the `cold_replace_s` input


BASELINE = Policy()
WARM_SPARES = Policy(warm_spares=True)
FAST_DETECTION = Policy(fast_detection=True)
IN_MEMORY = Policy(memory_checkpoints=True)
ALL = Policy(warm_spares=True, fast_detection=True, memory_checkpoints=True)


def megascale_job(gpus: int, interval_s: float = 1800.0, rates: str = "llama3",
                  policy: Policy = BASELINE, iteration_s: float | None = None,
                  num_params: int | None = None) -> Job:
  """175B (or a model of `num_params`) with every MegaScale technique on `gpus` A100s, failing
  at `rates` ('llama3', 'rsc1' or 'megascale') and recovering as MegaScale describes: self-checks
  within its 10-minute detection-and-diagnosis bound, a restart of process start, collective
  initialisation and compilation, a restore reading the state once at the storage bandwidth
  ByteCheckpoint measured, two-stage checkpoints every `interval_s` (a short stall, then a
  background persist at the write bandwidth). The iteration time comes from mscale_jax.perf for
  the paper's layout unless `iteration_s` is given."""
  if rates not in RATES:
    raise ConfigError("rates", rates, f"one of {sorted(RATES)}")
  if gpus % GPUS_PER_NODE:
    raise ConfigError("gpus", gpus, f"a multiple of {GPUS_PER_NODE} GPUs per node")
  if iteration_s is None or num_params is None:
    step = perf_adapter.megascale_step(gpus)
    iteration_s = step.iteration_s if iteration_s is None else iteration_s
    num_params = step.num_params if num_params is None else num_params
  state_gb = num_params * value("bytes_per_param") / 1e9
  exit_s = value("drill.exit_detection_s")
  restart_s = value("process_start_s") + value("megascale.init_s") + value("compile_s")
  restore_s = state_gb / value("storage_read_gb_per_s")
  memory_every = iteration_s if policy.memory_checkpoints else None
  hang_s = value("minder.reaction_s") if policy.fast_detection else value("hang_timeout_s")
  cold_s = value("cold_replace_s") if policy.cold_replace_s is None else policy.cold_replace_s
  return Job(
      nodes=gpus // GPUS_PER_NODE, iteration_s=iteration_s, kinds=RATES[rates](),
      detection=Detection(exit_s=exit_s, hang_s=hang_s),
      recovery=Recovery(self_check_s=value("megascale.detect_diagnose_s") - exit_s,
                        restart_s=restart_s, restore_s=restore_s,
                        warm_spares=int(value("warm_spares")) if policy.warm_spares else 0,
                        spare_swap_s=value("spare_swap_s"), cold_replace_s=cold_s,
                        spare_restock_s=value("spare_restock_s")),
      checkpointing=Checkpointing(every_s=interval_s, stall_s=value("megascale.stall_s"),
                                  persist_s=state_gb / value("storage_write_gb_per_s"),
                                  memory_every_s=memory_every,
                                  memory_stall_s=value("gemini.memory_stall_s"),
                                  memory_restore_s=value("memory_restore_s")),
      startup_s=restart_s + restore_s, gpus_per_node=GPUS_PER_NODE)


def megascale_production_job() -> Job:
  """MegaScale's production run as the paper bounds it: the failure rate of 100 restarts in 3
  weeks, detection and diagnosis at the 10-minute bound, and checkpoints often enough that
  restore plus the longest replay (interval + persist) fits the 15-minute catch-up bound."""
  job = megascale_job(int(value("megascale.gpus")), rates="megascale")
  interval = value("megascale.catch_up_s") - job.checkpointing.persist_s - job.recovery.restore_s
  return dataclasses.replace(job, checkpointing=dataclasses.replace(job.checkpointing,
                                                                    every_s=interval))


def lumped_job(gpus: int, kinds: tuple, restart_overhead_s: float, interval_s: float,
               stall_s: float, persist_s: float = 0.0) -> Job:
  """A job whose whole recovery (failure to training again, replay aside) costs one number,
  as Kokolis et al. model it (u0). The iteration time (1 s) only rounds intervals."""
  return Job(nodes=gpus // GPUS_PER_NODE, iteration_s=1.0, kinds=kinds,
             detection=Detection(0.0, 0.0),
             recovery=Recovery(self_check_s=0.0, restart_s=restart_overhead_s, restore_s=0.0),
             checkpointing=Checkpointing(every_s=interval_s, stall_s=stall_s,
                                         persist_s=persist_s),
             gpus_per_node=GPUS_PER_NODE)


def llama3_job(restart_overhead_s: float, interval_s: float) -> Job:
  """Llama 3's run (16,384 GPUs, its interruptions by kind) with an assumed recovery overhead
  and interval (the report gives neither), MegaScale's stall and a persist at Tectonic's
  sustained bandwidth (405B x 14 bytes / 2 TB/s = 2.8 s)."""
  persist = 405e9 * value("bytes_per_param") / (value("llama3.state_tb_per_s") * 1e12)
  return lumped_job(int(value("llama3.gpus")), llama3_kinds(), restart_overhead_s, interval_s,
                    value("megascale.stall_s"), persist)


def rsc1_job(write_s: float, restart_overhead_s: float, interval_s: float,
             per_1000_node_days: float | None = None) -> Job:
  """Kokolis et al.'s largest feasible RSC-1 run (~12,000 GPUs): checkpoint writes that stall
  training for `write_s`, restart overhead u0, RSC-1's failure rate (or another)."""
  return lumped_job(int(value("rsc1.claim_gpus")), rsc1_kinds(per_1000_node_days),
                    restart_overhead_s, interval_s, write_s)
