"""The one set of efficiency constants every prediction uses.

Hardware presets hold data-sheet peaks; these say how much of a peak real software reaches,
and how many memory passes an operator makes. Each value carries its justification. Nothing here
is per row or per table: `scaling_curves.py` and the tests use `DEFAULT` for every row, and
`calibrate.py` derives a new instance from measurements.

How the efficiency values were set: each has a range from public measurements (in its comment);
within those ranges one set was chosen, once and jointly, to bring the paper's Table 3 and
batch-768 Table 2 rows closest (worst error 1.31 MFU points over 17 rows). The larger runs
(Figure 9, 530B) were not used: they are predictions.
"""
import dataclasses


@dataclasses.dataclass(frozen=True)
class Constants:
  """Achieved-efficiency model. Times are seconds, sizes bytes."""
  # GEMM efficiency: eff(m,k,n) = gemm_eff_max / (1 + gemm_edge * (1/m + 1/k + 1/n)).
  # cuBLAS bf16 on A100 SXM reaches 230-260 TFLOP/s (74-83% of 312) on large GEMMs; a node of
  # eight GPUs training flat out sits at its power limit and clocks down, so we take the low
  # end (0.74: 231 TFLOP/s). Small dimensions lose tile and wave efficiency, which the edge
  # term averages: a GEMM cut into 1,024-row chunks runs ~3% slower than the whole 8,192 rows.
  gemm_eff_max: float = 0.74
  gemm_edge: float = 32.0
  # Flash attention (FA2 paper, A100): 50-73% of peak forward+backward at head dims 64/128;
  # head dim 96 (no power-of-two tile) and causal or windowed masking, which leaves diagonal
  # blocks part-empty, run below that. FLOPs counted as forward 4*pairs*d, backward 2.5x that.
  flash_attn_eff: float = 0.45
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
  # end for rings that cross a shared Clos fabric rather than one idle switch.
  nvlink_eff: float = 0.78
  net_eff: float = 0.78
  # Pipeline send/recv across nodes: NCCL opens only 2 channels per network peer for p2p and each
  # blocking transfer waits for its peer, so a transfer reaches about half the NIC rate.
  p2p_eff: float = 0.46
  p2p_latency_s: float = 50e-6     # launch, rendezvous and completion of one blocking transfer
  # SMs a concurrent NCCL collective occupies: NCCL runs one thread block per channel, 8-16
  # channels on A100 rings. Compute that overlaps communication loses this share of the
  # device's SMs (comm.sm_share: 13/108 on A100) for the communication's duration.
  comm_sms: int = 13
  # Host work on the critical path without MegaScale's data pipeline ('misc'): per micro-batch,
  # a synchronous next() on the loader, collation, host-to-device copy and the TP broadcast of
  # the batch; per iteration, timers and .item() syncs (loss, grad norm) that stall the stream.
  # These are assumptions (the paper gives only the step's total), not measurements.
  host_per_micro_batch_s: float = 2.5e-3
  host_per_iteration_s: float = 0.05
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


DEFAULT = Constants()
