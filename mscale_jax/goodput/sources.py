"""Every input of the goodput presets, with where it comes from.

Each `Input` is 'cited' (a published figure; `source` names paper and place), 'derived' (computed
from cited figures; `note` says how), 'measured' (from one of our results/ records) or 'assumed'
(no source found; `note` says why the value and what it moves). docs/goodput.md prints this
table; `experiments.goodput` writes it to results/goodput/inputs.md; a test checks that presets
read nothing that is not here.
"""
import contextlib
import dataclasses

LLAMA3 = "Llama 3 Herd of Models (arXiv:2407.21783)"
MEGASCALE = "MegaScale (NSDI'24, arXiv:2402.15627)"
KOKOLIS = "Kokolis et al., Revisiting Reliability in Large-Scale ML Research Clusters " \
          "(HPCA'25, arXiv:2410.21680 v2)"
BYTECKPT = "ByteCheckpoint (NSDI'25, arXiv:2407.20143 v4)"
GEMINI = "Gemini: fast failure recovery with in-memory checkpoints (SOSP'23)"
MINDER = "Minder: faulty machine detection for large-scale training (ByteDance, NSDI'25)"
ZERO = "ZeRO (Rajbhandari et al., SC'20), section 3.1"
TORCH_NCCL = "PyTorch PR #110947 'Change ProcessGroupNCCL default timeout to 10 min'"
DRILL = "results/fault_drill-gpt_tiny-cpu-*.json"


@dataclasses.dataclass(frozen=True)
class Input:
  """One input value, its unit, how we know it and from where."""
  value: float
  unit: str
  status: str        # 'cited' | 'derived' | 'measured' | 'assumed'
  source: str
  note: str = ""


# Llama 3 405B, 54-day snapshot (section 3.3.4, Table 5): root causes of the 419 unexpected
# interruptions, grouped by how they surface and whether a node must go. Which interruptions
# surfaced as hangs is not reported: network faults and NCCL watchdog timeouts are taken as
# hangs, everything else as crashes (an assumption; it bounds what faster hang detection buys).
LLAMA3_TABLE5 = {
    # kind: (detected_by, replace_node, {component: count})
    "gpu": ("exit", True, {"Faulty GPU": 148, "GPU HBM3 Memory": 72, "GPU SRAM Memory": 19,
                           "GPU System Processor": 17, "Silent Data Corruption": 6,
                           "GPU Thermal Interface + Sensor": 6}),
    "host": ("exit", True, {"NIC": 7, "SSD": 3, "Power Supply": 3, "Server Chassis": 2,
                            "IO Expansion Board": 2, "CPU": 2, "System Memory": 2}),
    "host_maintenance": ("exit", True, {"Host Maintenance": 32}),
    "network": ("hang", True, {"Network Switch/Cable": 35}),
    "software": ("exit", False, {"Software Bug": 54, "Dependency": 2}),
    "nccl_timeout": ("hang", False, {"NCCL Watchdog Timeouts": 7}),
}

INPUTS = {
    # -- failure rates ----------------------------------------------------------------------------
    "llama3.gpus": Input(16384, "GPUs", "cited", LLAMA3 + " 3.3.4", "the 405B pre-training run"),
    "llama3.gpus_per_node": Input(8, "GPUs", "cited", LLAMA3 + " 3.3.1",
                                  "'Each server is equipped with eight GPUs and two CPUs'"),
    "llama3.days": Input(54, "days", "cited", LLAMA3 + " 3.3.4", "the snapshot period"),
    "llama3.unexpected": Input(419, "interruptions", "cited", LLAMA3 + " 3.3.4, Table 5",
                               "split by component in Table 5 (LLAMA3_TABLE5)"),
    "llama3.planned": Input(47, "interruptions", "cited", LLAMA3 + " 3.3.4",
                            "automated maintenance and operator-initiated changes"),
    "llama3.claim": Input(0.90, "rate", "cited", LLAMA3 + " 3.3.4",
                          "'higher than 90% effective training time'"),
    "llama3.state_tb_per_s": Input(2.0, "TB/s", "cited", LLAMA3 + " 3.3.1",
                                   "Tectonic's sustainable throughput (7 TB/s peak)"),
    "rsc1.failures_per_1000_node_days": Input(6.50, "failures", "cited", KOKOLIS,
                                              "RSC-1 (A100); the paper rounds r_f to ~5e-3 for "
                                              "both clusters"),
    "rsc1.claim_gpus": Input(12000, "GPUs", "cited", KOKOLIS,
                             "'To reach ETTR of 0.9 for the largest feasible training runs on "
                             "RSC-1 (~12,000 GPUs...), checkpoint write time overhead needs to be "
                             "on the order of ~10 seconds or failure rate needs to dramatically "
                             "improve from 6.50 to ~1'"),
    "rsc1.claim_write_s": Input(10, "s", "cited", KOKOLIS, "see rsc1.claim_gpus"),
    "rsc1.claim_better_rate": Input(1.0, "failures/1000 node-days", "cited", KOKOLIS,
                                    "see rsc1.claim_gpus"),
    "rsc1.write_s": Input(300, "s", "cited", KOKOLIS, "'w_cp ~ 5 mins'"),
    "rsc1.u0_low_s": Input(300, "s", "cited", KOKOLIS,
                           "'u0 ~ 5-20 mins': restart overhead, failure to training again"),
    "rsc1.u0_high_s": Input(1200, "s", "cited", KOKOLIS, "see rsc1.u0_low_s"),
    "rsc1.interval_s": Input(3600, "s", "cited", KOKOLIS,
                             "'all jobs checkpoint hourly (... a typical checkpoint interval for "
                             "larger jobs on the RSC clusters)'"),
    "megascale.restarts": Input(100, "restarts", "cited", MEGASCALE + " 6.2",
                                "'over 100' restarts: a lower bound"),
    "megascale.weeks": Input(3, "weeks", "assumed", MEGASCALE + " 6.2",
                             "'several weeks'; 3 is the fewest that 'several' allows, which makes "
                             "the failure rate derived from 100 restarts the highest"),
    "megascale.gpus": Input(12288, "GPUs", "assumed", MEGASCALE + " 6.2",
                            "'more than 10,000 GPUs'; the paper's largest benchmark size"),
    "megascale.claim": Input(0.90, "rate", "cited", MEGASCALE + " 6.3",
                             "'maintaining over 90% effective training time rate'"),
    # -- detection and diagnosis ------------------------------------------------------------------
    "megascale.detect_diagnose_s": Input(600, "s", "cited", MEGASCALE + " 6.3",
                                         "'The average time required for detecting failure and "
                                         "executing diagnostic tests is less than 10 minutes': "
                                         "taken at its bound as the self-check time"),
    "megascale.catch_up_s": Input(900, "s", "cited", MEGASCALE + " 6.3",
                                  "'catch up to the training progress prior to the crash within "
                                  "15 minutes from the latest checkpoints'"),
    "drill.exit_detection_s": Input(0.88, "s", "measured", DRILL,
                                    "slowest detection of a process exit, exception or NaN stop "
                                    "(not an in-process rollback) over the drill records (2 "
                                    "processes)"),
    "hang_timeout_s": Input(600, "s", "cited", TORCH_NCCL,
                            "the default NCCL watchdog timeout a hang waits for"),
    "minder.reaction_s": Input(3.6, "s", "cited", MINDER,
                               "reaction time in production (precision 0.904); used as hang "
                               "detection with Minder"),
    # -- restart ----------------------------------------------------------------------------------
    "megascale.init_s": Input(30, "s", "cited", MEGASCALE + " 3.5",
                              "collective initialisation 'under 30 seconds on more than 10,000 "
                              "GPUs'"),
    "process_start_s": Input(60, "s", "assumed", "",
                             "container and process start, framework import; no public figure. "
                             "With init and restore the restart is ~2.5 min, inside Kokolis' u0 "
                             "of 5-20 min once detection and self-checks are added"),
    "bytecheckpoint.load_405b_s": Input(129.49, "s", "cited", BYTECKPT + " Table 8",
                                        "load time, 405B on 8,960 GPUs (TP 8, DP 70, PP 16); "
                                        "quoted from a public dossier of the paper, not checked "
                                        "against the PDF here"),
    "bytes_per_param": Input(14, "bytes", "derived", ZERO,
                             "mixed-precision Adam/LAMB state: bf16 weights (2) + fp32 master "
                             "weights, first and second moments (12); gradients are not saved"),
    "compile_s": Input(0, "s", "cited", MEGASCALE,
                       "a Megatron-LM (PyTorch eager) fork (docs megascale.md 1): nothing "
                       "compiles at start; a JAX job pays its compilation, or a cache hit, here"),
    # -- replacement ------------------------------------------------------------------------------
    "cold_replace_s": Input(600, "s", "assumed", "",
                            "evicting a node and getting a healthy one from the scheduler "
                            "(MegaScale 4.1 gives no time); the what-if reports 5-30 min too"),
    "spare_swap_s": Input(30, "s", "assumed", "",
                          "handing a pre-started, pre-checked node to the job"),
    "spare_restock_s": Input(86400, "s", "assumed", "",
                             "a used spare is replaced in the pool after a day (repair or a "
                             "new node)"),
    "warm_spares": Input(8, "nodes", "assumed", "",
                         "about 0.5% of 1,536 nodes; ~5 nodes fail per day at 12,288 GPUs"),
    # -- checkpoints ------------------------------------------------------------------------------
    "megascale.stall_s": Input(5, "s", "assumed", MEGASCALE + " 4.4",
                               "the device-to-host first stage takes 'several seconds'"),
    "bytecheckpoint.persist_175b_s": Input(200, "s", "cited", BYTECKPT,
                                           "'the average end-to-end time required to save "
                                           "checkpoints of a GPT 175B model, trained on 4096 "
                                           "GPUs, to HDFS can be 200 seconds' (quoted from a "
                                           "public dossier): the background persist"),
    "gemini.memory_stall_s": Input(0.0, "s", "cited", GEMINI,
                                   "'checkpoint frequency ... every iteration, and incurs no "
                                   "overhead on training throughput'"),
    "memory_restore_s": Input(0.25, "s", "derived", GEMINI,
                              "a node's state from a peer's host memory over its NICs: 175B at "
                              "TP 8 x PP 8 holds 5.5 GB of bf16 weights and 0.2 GB of optimizer "
                              "shard per GPU, 45 GB per node, over 8 x 200 Gb/s NICs "
                              "(megascale.md 2)"),
}

# Storage bandwidths the ByteCheckpoint figures imply for a checkpoint of bytes_per_param bytes
# per parameter: restores read the state once (one reader per data-parallel group, MegaScale
# 4.4), so restore time = state / read bandwidth, and the background persist = state / write.
_STATE = INPUTS["bytes_per_param"].value
INPUTS["storage_read_gb_per_s"] = Input(
    405e9 * _STATE / INPUTS["bytecheckpoint.load_405b_s"].value / 1e9, "GB/s", "derived",
    BYTECKPT + " Table 8", "405B x 14 bytes over the measured 129.49 s load")
INPUTS["storage_write_gb_per_s"] = Input(
    175e9 * _STATE / INPUTS["bytecheckpoint.persist_175b_s"].value / 1e9, "GB/s", "derived",
    BYTECKPT, "175B x 14 bytes over the 200 s end-to-end save to HDFS")


def value(name: str) -> float:
  """The value of input `name` (KeyError names an input that has no source entry)."""
  return INPUTS[name].value


@contextlib.contextmanager
def overridden(name: str, new_value: float):
  """Temporarily sets input `name` to `new_value` (for sensitivity runs), then restores it."""
  old = INPUTS[name]
  INPUTS[name] = dataclasses.replace(old, value=new_value)
  try:
    yield
  finally:
    INPUTS[name] = old


def llama3_node_hours() -> float:
  """Node-hours of Llama 3's 54-day snapshot on 16,384 GPUs."""
  return value("llama3.gpus") / value("llama3.gpus_per_node") * value("llama3.days") * 24


def markdown_table() -> str:
  """Every input as a markdown table (name, value, unit, status, source, note)."""
  lines = ["| input | value | unit | status | source | note |", "|---|---|---|---|---|---|"]
  for name, i in INPUTS.items():
    lines.append(f"| `{name}` | {i.value:g} | {i.unit} | {i.status} | {i.source} | {i.note} |")
  counts = ", ".join(f"{k} (Table 5: " + ", ".join(f"{c} {n}" for c, n in parts.items()) + ")"
                     for k, (_, _, parts) in LLAMA3_TABLE5.items())
  return "\n".join(lines) + f"\n\nLlama 3 interruptions by kind: {counts}.\n"
