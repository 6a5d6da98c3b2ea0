r"""GPT-3 Small (125M) on one GPU, bf16, with synthetic tokens unless a token file is given.

  python -m experiments.train --config=experiments/configs/gpt_125m.py
  python -m experiments.train --config=experiments/configs/gpt_125m.py \
      --config.data.kind=tokens --config.data.path=/data/owt_train.bin

GPT-3 Small's shape (vocab padded to 50304, a multiple of 128) to measure single-device MFU;
remat 'dots' keeps the matmul outputs so little is recomputed at this size.
"""
from experiments.configs import base


def get_config():
  config = base.base_config()
  config.name = "gpt_125m"

  config.model.vocab_size = 50304
  config.model.num_layers = 12
  config.model.hidden = 768
  config.model.num_heads = 12
  config.model.mlp_dim = 3072
  config.model.seq_len = 2048
  config.model.dtype = "bfloat16"
  config.model.remat = "dots"

  config.mesh.data = -1

  config.optimizer.learning_rate = 2e-3
  config.optimizer.warmup_steps = 100

  config.data.kind = "synthetic"

  config.train.steps = 500
  config.train.global_batch = 16
  config.train.log_every = 25
  config.train.eval_every = 250
  config.train.checkpoint_every = 500
  return config
