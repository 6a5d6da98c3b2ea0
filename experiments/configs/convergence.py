r"""MegaScale Figure 10 at small scale: one byte-level GPT, each variant trained on equal tokens.

  python -m experiments.convergence                      # fig10a + fig10b, 3 seeds (~20-45 min)
  python -m experiments.convergence --quick              # smoke version (~3 min)
  python -m experiments.convergence --figures=fig10b --config.seeds=5

`run` is the baseline run at batch B: sequential block, full causal attention, AdamW. Every
variant of `experiments/convergence.py` is this run with one switch changed; the 4B variants
take `batch_scale` times the batch for 1/batch_scale of the steps (warmup, logging and eval
cadence scale with them), so all variants see the same number of tokens. Learning rates at 4B
follow the square-root rule of the LAMB paper (You et al., 2020): lr(4B) = lr(B) * sqrt(4),
from `run.optimizer.learning_rate` for AdamW and from `lamb_learning_rate` for LAMB.
`quick` holds the sizes that `--quick` puts in place of the full ones (override them too, e.g.
`--quick --config.quick.run.train.steps=8`).
"""
import ml_collections

from experiments.configs import base


def get_config():
  config = ml_collections.ConfigDict()
  run = base.base_config()
  run.name = "convergence"
  run.model.vocab_size = 256
  run.model.num_layers = 2
  run.model.hidden = 128
  run.model.num_heads = 4
  run.model.mlp_dim = 512
  run.model.seq_len = 128
  run.model.block = "sequential"
  run.mesh.data = 1                        # one device: the step is too small to shard
  run.optimizer.name = "adamw"
  run.optimizer.learning_rate = 2e-3
  run.optimizer.warmup_steps = 16
  run.data.kind = "stdlib"
  run.train.steps = 384                    # 384 x 8 x 128 = 393,216 tokens per run
  run.train.global_batch = 8
  run.train.log_every = 8
  run.train.eval_every = 48
  run.train.eval_batches = 16              # 128 held-out windows = 16,384 tokens, every variant
  run.train.checkpoint_every = 384         # only the final state (sample.py reads it)
  run.train.keep_checkpoints = 1
  config.run = run

  config.seeds = 3                         # seed s: init seed s and data-order seed s
  config.window = 32                       # attention window of the sliding-window variants
  config.batch_scale = 4                   # fig10b: "4B"
  # LAMB's rate at batch B, before sqrt scaling (so 4e-2 at 4B). Picked from a one-seed probe
  # of LAMB at 4B with 64 steps: lr 1e-2 / 2e-2 / 4e-2 gave held-out loss 3.05 / 2.51 / 2.43;
  # larger rates were not tried. AdamW's 2e-3 sits between 1e-3 and 3e-3 (2.385 / 2.374 at B).
  config.lamb_learning_rate = 2e-2

  config.quick = ml_collections.ConfigDict({
      "seeds": 2,
      "window": 16,
      "run": {"model": {"hidden": 64, "mlp_dim": 256, "seq_len": 64},
              "optimizer": {"warmup_steps": 8},
              "train": {"steps": 64, "global_batch": 4, "log_every": 4, "eval_every": 16,
                        "eval_batches": 8, "checkpoint_every": 64}},
  })
  return config
