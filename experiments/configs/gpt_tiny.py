r"""Tiny byte-level GPT on the stdlib corpus: the default main job.

  python -m experiments.train --config=experiments/configs/gpt_tiny.py
  python -m experiments.train --config=experiments/configs/gpt_tiny.py \
      --config.mesh.data=4 --config.mesh.tensor=2 --config.model.block=sequential

Exercises data x tensor(+sequence) parallelism, the parallel block, sliding-window attention and
LAMB at a size whose 300 steps take ~2.5 min on 8 simulated devices of a 2-core CPU (eval loss
5.5 -> 2.25 nats/byte); on fewer devices (one GPU, say) the mesh shrinks to fit.
"""
from experiments.configs import base


def get_config():
  config = base.base_config()
  config.name = "gpt_tiny"

  config.model.vocab_size = 256
  config.model.num_layers = 2
  config.model.hidden = 128
  config.model.num_heads = 4
  config.model.mlp_dim = 512
  config.model.seq_len = 128
  config.model.block = "parallel"
  config.model.attention_window = 32

  config.mesh.data = 2
  config.mesh.tensor = 4
  config.mesh.shrink_to_fit = True

  config.optimizer.name = "lamb"
  config.optimizer.learning_rate = 2e-2
  config.optimizer.warmup_steps = 20

  config.data.kind = "stdlib"

  config.train.steps = 300
  config.train.global_batch = 16
  config.train.log_every = 10
  config.train.eval_every = 50
  config.train.checkpoint_every = 100
  return config
