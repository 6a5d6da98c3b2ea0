r"""MegaScale's 175B model (paper Table 1) on 256 GPUs: TP=8, PP=8, DP=4; for the dry run only.

  python -m experiments.train --config=experiments/configs/gpt_175b.py --dry_run

The dry run prints parameter count, FLOPs per token and per-device memory from jax.eval_shape on
this mesh, allocating nothing. Table 1's shape and parallelism with the Table 2 global batch of
768, interleaved 1F1B with Table 1's 6 virtual stages per pipeline rank and micro-batches of one
sequence (192 per pipeline); the SWA window is not given.
"""
from experiments.configs import base


def get_config():
  config = base.base_config()
  config.name = "gpt_175b"

  config.model.vocab_size = 64000
  config.model.num_layers = 96
  config.model.hidden = 12288
  config.model.num_heads = 128
  config.model.mlp_dim = 4 * 12288
  config.model.seq_len = 2048
  config.model.block = "parallel"
  config.model.dtype = "bfloat16"
  config.model.remat = "full"

  config.mesh.data = 4
  config.mesh.stage = 8
  config.mesh.tensor = 8

  config.pipeline.schedule = "interleaved_1f1b"
  config.pipeline.virtual_stages = 6
  config.pipeline.microbatches = 192
  config.pipeline.recompute = "full"   # memory-bound at this size, as model.remat

  config.optimizer.name = "lamb"

  config.data.kind = "synthetic"

  config.train.global_batch = 768
  return config
