"""Pure-Python performance model of 3D-parallel GPT training (no JAX import).

  from mscale_jax.perf import predict, GPT_175B, Layout, Techniques, A100_MEGASCALE
  p = predict(GPT_175B, Layout(tp=8, pp=8, vpp=6, dp=4, micro_batch=4, global_batch=768),
              Techniques(parallel_block=True, tp_overlap=True), A100_MEGASCALE)
  p.mfu, p.iteration_s, p.breakdown, p.memory.fits

Modules: hardware (presets), workload (model, layout, switches, validation), constants (the one
constant set, its ranges, which are fitted), compute / comm / layer / memory (cost terms), scale
(costs that grow with the number of ranks), iteration (one step), paper (the paper's rows, their
figures and the shared micro-batch rule), search (layout planner), calibrate (measured GEMM
efficiency), fit (grid-search fit and the validation protocols), intervals (prediction intervals
from the out-of-sample errors, and their coverage), sensitivity (+-10% per constant; the
constants' ranges varied jointly), compressed (SDP4Bit's two-level quantized DP collectives),
dp_comm (one layout with `none` and with SDP4Bit, at a given inter-node bandwidth).
"""
from mscale_jax.perf.constants import DEFAULT, Constants
from mscale_jax.perf.hardware import (A100_MEGASCALE, H100_DGX, H800_DGX, TPU_V5P, Hardware,
                                      get_hardware)
from mscale_jax.perf.iteration import Prediction, predict
from mscale_jax.perf.workload import (GPT_175B, GPT_530B, Layout, ModelSpec, Techniques,
                                      layout_for, validate)

__all__ = ["DEFAULT", "Constants", "A100_MEGASCALE", "H100_DGX", "H800_DGX", "TPU_V5P",
           "Hardware", "get_hardware", "Prediction", "predict", "GPT_175B", "GPT_530B", "Layout",
           "ModelSpec", "Techniques", "layout_for", "validate"]
