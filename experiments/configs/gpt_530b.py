r"""MegaScale's 530B model (paper Table 1) on 2240 GPUs: TP=8, PP=35, DP=8; for the dry run only.

  python -m experiments.train --config=experiments/configs/gpt_530b.py --dry_run

The dry run prints parameter count, FLOPs per token and per-device memory from jax.eval_shape on
this mesh, allocating nothing. Table 1's shape and parallelism; the paper's 530B batch is not in
our summary, so 1920 (MT-NLG's); 1F1B with micro-batches of one sequence (240 per pipeline).
Table 1's 3 virtual stages would need interleaved 1F1B, whose micro-batch count must be a
multiple of the 35 stages, and 240 is not; the SWA window is not given.
"""
from experiments.configs import base


def get_config():
  config = base.base_config()
  config.name = "gpt_530b"

  config.model.vocab_size = 64000
  config.model.num_layers = 105
  config.model.hidden = 20480
  config.model.num_heads = 160
  config.model.mlp_dim = 4 * 20480
  config.model.seq_len = 2048
  config.model.block = "parallel"
  config.model.dtype = "bfloat16"
  config.model.remat = "full"

  config.mesh.data = 8
  config.mesh.stage = 35
  config.mesh.tensor = 8

  config.pipeline.schedule = "1f1b"
  config.pipeline.microbatches = 240
  config.pipeline.recompute = "full"   # memory-bound at this size, as model.remat

  config.optimizer.name = "lamb"

  config.data.kind = "synthetic"

  config.train.global_batch = 1920
  return config
