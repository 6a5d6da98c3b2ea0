"""The one set of efficiency constants every prediction uses.

Hardware presets hold data-sheet peaks; these say how much of a peak real software reaches,
and how many memory passes an operator makes. Each value carries its justification. Nothing here
is per row or per table: `scaling_curves.py` and the tests use `DEFAULT` for every row, and
`calibrate.py` derives a new instance from measurements.

How the values were set: each has a range from public measurements or physics (`RANGES`, and
its comment). The eight constants of `FITTED` are what `fit.fit` returns when fitted to every
paper row with a figure (Table 3 and both batches of Table 2: 25 rows, 24 runs; a deterministic
grid search within the ranges, RMS error 0.97, worst 2.90 MFU points); the rest keep their
source values. The 530B runs (Figure 9) have no figure in our notes: they are predictions, with
intervals from the model's out-of-sample errors (`intervals`) and, as a separate component,
the constants' ranges (`sensitivity.constant_range_band`).
"""
import dataclasses


@dataclasses.dataclass(frozen=True)
class Constants:
  """Achieved-efficiency model. Times are seconds, sizes bytes."""
  # GEMM efficiency: eff(m,k,n) = gemm_eff_max / (1 + gemm_edge * (1/m + 1/k + 1/n)).
  # cuBLAS bf16 on A100 SXM reaches 230-260 TFLOP/s (74-83% of 312) on large GEMMs; a node of
  # eight GPUs training flat out sits at its power limit and clocks down, so we take the low
  # end; fitted 0.75 (234 TFLOP/s; range 0.70-0.82). Small dimensions lose tile and wave
  # efficiency, which the edge term averages: a GEMM cut into 1,024-row chunks runs ~3% slower
  # than the whole 8,192 rows.
  gemm_eff_max: float = 0.75
  gemm_edge: float = 32.0
  # Flash attention (FA2 paper, A100): 50-73% of peak forward+backward at head dims 64/128;
  # head dim 96 (no power-of-two tile) and causal or windowed masking, which leaves diagonal
  # blocks part-empty, run below that (range 0.35-0.59; fitted 0.39). FLOPs
  # counted as forward 4*pairs*d, backward 2.5x that.
  flash_attn_eff: float = 0.39
  # Achievable HBM bandwidth for streaming elementwise kernels (STREAM-like: 80-90% of peak).
  hbm_eff: float = 0.80
  # Gap between dependent small kernels on the GPU (launch and tail), per memory-bound kernel.
  kernel_gap_s: float = 4e-6
  # Memory passes over the tensor (reads + writes of full-size tensors), forward / backward.
  # Fused kernels read inputs once and write outputs once; unfused ones re-read intermediates:
  # a LayerNorm kernel with separate residual, bias and cast passes; bias add then tanh-GeLU
  # as a chain of small elementwise ops.
  layernorm_passes_fused: tuple = (2, 3)
  layernorm_passes_unfused: tuple = (6, 9)
  gelu_passes_fused: tuple = (2, 3)      # bias+GeLU in one kernel
  gelu_passes_unfused: tuple = (8, 12)
  residual_passes: tuple = (3, 2)        # bias + residual add (dropout off), fused in both systems
  softmax_passes: tuple = (2, 3)         # materialised scores: read S write P / read P,dP write dS
  # NCCL bus bandwidth as a fraction of link bandwidth: nccl-tests on DGX A100 reach ~230-240
  # of 300 GB/s on NVLink for large all-gathers (0.78); rings across nodes reach 150-190 GB/s
  # of bus bandwidth per 8-NIC node, 19-24 of 25 GB/s per HDR NIC (0.78: 19.5 GB/s), the low
  # end for rings that cross a shared Clos fabric rather than one idle switch. Fitted: NVLink
  # 0.82 (range 0.70-0.82, the high edge), network 0.78 (range 0.72-0.96).
  nvlink_eff: float = 0.82
  net_eff: float = 0.78
  # Pipeline send/recv across nodes: NCCL opens only 2 channels per network peer for p2p and each
  # blocking transfer waits for its peer. Range 0.30 (half of that half) to 0.96, the peak NCCL
  # reaches on a 200G NIC (24 of 25 GB/s, per NCCL's maintainers: nccl-tests issue #119); the
  # earlier upper end, 0.60, was an assumption the fit ran into. Fitted 0.96, the high edge.
  p2p_eff: float = 0.96
  p2p_latency_s: float = 50e-6     # launch, rendezvous and completion of one blocking transfer
  # SMs a concurrent NCCL collective occupies: NCCL runs one thread block per channel, 8-16
  # channels on A100 rings. Compute that overlaps communication loses this share of the
  # device's SMs (comm.sm_share: 13/108 on A100) for the communication's duration.
  comm_sms: int = 13
  # Host work on the critical path without MegaScale's data pipeline ('misc'): per micro-batch,
  # a synchronous next() on the loader, collation, host-to-device copy and the TP broadcast of
  # the batch; per iteration, timers and .item() syncs (loss, grad norm) that stall the stream.
  # These are assumptions (the paper gives only the step's total), not measurements: ranges from
  # 0 (no stall; the earlier lower ends, 0.5 and 10 ms, were assumptions the fit ran into) to
  # 6 ms and 180 ms; fitted 3.5 ms and 90 ms.
  host_per_micro_batch_s: float = 3.5e-3
  host_per_iteration_s: float = 0.09
  # Bytes per parameter: bf16 weights; gradients accumulated and reduce-scattered in fp32
  # (Megatron-LM turns on accumulate_allreduce_grads_in_fp32 for bf16); fp32 master, m, v
  # sharded over DP (ZeRO-2).
  param_bytes: int = 2
  grad_bytes: int = 4
  grad_reduce_bytes: int = 4
  optim_state_bytes: int = 12
  # Optimizer update traffic per parameter: read grad, master, m, v (16); write master, m, v,
  # bf16 weight (14). LAMB re-reads weight and update for its trust ratio (+8).
  adam_update_bytes: int = 30
  lamb_extra_bytes: int = 8
  # Activation bytes per token per hidden unit per layer under TP+SP (Korthikanti et al. 2022):
  # 34 for the sequential block; the parallel block keeps one LayerNorm input less (32).
  act_bytes_sequential: float = 34.0
  act_bytes_parallel: float = 32.0
  # CUDA context, NCCL buffers, allocator fragmentation: memory no tensor of ours can use.
  reserved_bytes: float = 4e9

  # Scale effects (`scale.py`): each switch turns its mechanism on; off, it costs exactly 0.
  # Stragglers: a GPU's iteration time varies with this coefficient of variation (clock,
  # power and thermal variation, OS noise) once slow machines are excluded; the step waits
  # for the expected slowest of N (Gaussian tail). Assumed 0.5%, range 0.25-1.5%.
  stragglers: bool = True
  gpu_time_cv: float = 0.005
  # Slow machines (paper section 5 / our megascale.md: ~0.5% of machines were slow; excluding
  # them gained 0.7 MFU points at scale, i.e. ~1.3% of step time when one was almost surely
  # present). Slowdown range 0.5% (residual after the paper's tooling) to 10% (a slow machine
  # on its own). Fitted since the batch-6,144 rows (3,072-12,288 GPUs, where a slow machine is
  # almost surely present) pin it: 7.6%, well above the 1.3% the paper's 0.7-point figure implies.
  slow_nodes: bool = True
  slow_node_fraction: float = 0.005
  slow_node_slowdown: float = 0.07625
  # ECMP collisions on the switch tiers above the ToR (paper section 3.4): `ecmp_flows`
  # concurrent flows leave a switch over `ecmp_uplinks` uplinks (a 64-port switch, 32 up)
  # that are `ecmp_uplink_speedup` x a flow's rate (400G up, 200G down). Flows: a ring
  # segment's crossings x NCCL's 2 channels per peer plus pipeline sends; range 4-32.
  ecmp_collisions: bool = True
  ecmp_flows: float = 16.0
  ecmp_uplinks: int = 32
  ecmp_uplink_speedup: float = 2.0
  # Launch skew of the data-parallel collectives (paper section 6.3): each rank's launch
  # delay is exponential with this mean (host-side work: Python GC, stray CPU ops); 2
  # collectives per step sit on the critical path (the last reduce-scatter, the first
  # all-gather). Mean range 0.1-5 ms; 0.5 ms assumed after the paper's fix.
  launch_skew: bool = True
  launch_delay_s: float = 5e-4
  dp_sync_points: int = 2


DEFAULT = Constants()

# Documented range of every float constant that a fit or an error bar varies (low, high). The
# fitted ones are searched on 13 evenly spaced values (`fit.grid`), so their ranges are chosen
# to give round steps.
RANGES = {
    "gemm_eff_max": (0.70, 0.82),
    "gemm_edge": (16.0, 64.0),
    "flash_attn_eff": (0.35, 0.59),
    "hbm_eff": (0.80, 0.90),
    "kernel_gap_s": (2e-6, 8e-6),
    "nvlink_eff": (0.70, 0.82),
    "net_eff": (0.72, 0.96),
    "p2p_eff": (0.30, 0.96),
    "p2p_latency_s": (20e-6, 100e-6),
    "host_per_micro_batch_s": (0.0, 6e-3),
    "host_per_iteration_s": (0.0, 0.18),
    "gpu_time_cv": (0.0025, 0.015),
    "slow_node_fraction": (0.001, 0.01),
    "slow_node_slowdown": (0.005, 0.10),
    "ecmp_flows": (4.0, 32.0),
    "launch_delay_s": (1e-4, 5e-3),
}

# The constants `fit.fit` chooses (within RANGES) from the paper's rows; every other constant
# keeps its source value above. Of the scale effects only the slow machines' slowdown is fitted:
# the batch-6,144 rows pin it; the straggler jitter, ECMP and launch-skew constants barely move
# between rows the paper measured, so they keep their sources and their ranges go into the
# constant-range band.
FITTED = ("gemm_eff_max", "flash_attn_eff", "nvlink_eff", "net_eff", "p2p_eff",
          "host_per_micro_batch_s", "host_per_iteration_s", "slow_node_slowdown")
