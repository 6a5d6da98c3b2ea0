r"""GPT-3 XL (1.3B) on one GPU, bf16, full remat, synthetic tokens unless a token file is given.

  python -m experiments.train --config=experiments/configs/gpt_1p3b.py
  python -m experiments.train --config=experiments/configs/gpt_1p3b.py \
      --config.data.kind=tokens --config.data.path=/data/owt_train.bin --config.model.remat=dots

GPT-3 XL's shape (vocab padded to 50304) to measure single-device MFU at a size where the GEMMs
are large; full remat keeps activations small next to ~21 GB of fp32 weights and LAMB state.
"""
from experiments.configs import base


def get_config():
  config = base.base_config()
  config.name = "gpt_1p3b"

  config.model.vocab_size = 50304
  config.model.num_layers = 24
  config.model.hidden = 2048
  config.model.num_heads = 16
  config.model.mlp_dim = 8192
  config.model.seq_len = 2048
  config.model.dtype = "bfloat16"
  config.model.remat = "full"

  config.mesh.data = -1

  config.optimizer.learning_rate = 1e-3
  config.optimizer.warmup_steps = 100

  config.data.kind = "synthetic"

  config.train.steps = 200
  config.train.global_batch = 8
  config.train.log_every = 10
  config.train.eval_every = 100
  config.train.checkpoint_every = 200
  return config
