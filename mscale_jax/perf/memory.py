"""Memory per device: parameters, gradients, optimizer state, activations, and the OOM verdict."""
import dataclasses

from mscale_jax.parallel import schedule
from mscale_jax.perf.constants import Constants
from mscale_jax.perf.workload import Layout, ModelSpec, Techniques

RECOMPUTES = ("none", "selective", "full")


@dataclasses.dataclass(frozen=True)
class Memory:
  """Bytes per device on the busiest (first) pipeline stage."""
  params: float
  grads: float
  optimizer: float
  activations: float
  reserved: float
  capacity: float
  # The asynchronous save's device copy of the train state (params and optimizer state), held
  # while its write launches (Techniques.async_checkpoint); 0 without it.
  checkpoint_copy: float = 0.0

  @property
  def total(self) -> float:
    """All bytes the device needs."""
    return (self.params + self.grads + self.optimizer + self.activations + self.reserved
            + self.checkpoint_copy)

  @property
  def fits(self) -> bool:
    """The out-of-memory verdict: False when `total` exceeds the device's capacity."""
    return self.total <= self.capacity


def params_per_device(model: ModelSpec, layout: Layout) -> float:
  """Parameters held by a first-stage device: its layers and its shard of the embedding."""
  layers = model.num_layers / layout.pp
  return (layers * model.params_per_layer + model.vocab * model.hidden) / layout.tp


def activation_bytes_per_layer(model: ModelSpec, layout: Layout, tech: Techniques,
                               recompute: str, c: Constants) -> float:
  """Stashed activations of one layer for one micro-batch under TP+SP (Korthikanti et al.)."""
  sbh = model.seq_len * layout.micro_batch * model.hidden
  if recompute == "full":
    return 2.0 * sbh / layout.tp                      # only the layer input, bf16
  per = c.act_bytes_parallel if tech.parallel_block else c.act_bytes_sequential
  total = per * sbh / layout.tp
  if recompute == "none" and not tech.efficient_ops:
    # Unfused attention keeps the softmax output (2 bytes) and its mask (1) and the scores
    # input to the softmax backward (2): 5 bytes per computed (query, key) pair per head.
    w = model.seq_len if tech.sliding_window is None else min(tech.sliding_window,
                                                              model.seq_len)
    total += 5.0 * model.num_heads * model.seq_len * w * layout.micro_batch / layout.tp
  return total


def memory_per_device(model: ModelSpec, layout: Layout, tech: Techniques, recompute: str,
                      capacity: float, c: Constants) -> Memory:
  """Memory of a first-stage device (it stashes the most micro-batches in 1F1B)."""
  n = params_per_device(model, layout)
  # The first stage's peak of stashed chunk inputs in the schedule table (parallel/schedule.py),
  # each num_layers / (pp * vpp) layers of one micro-batch: pp * vpp + pp - 1 of them in
  # interleaved 1F1B (Korthikanti et al., section 4.2.3), min(m, pp) in 1F1B.
  peak = schedule.megatron_summary(layout.pp, layout.vpp, layout.num_micro_batches)[1][0]
  inflight_layers = model.num_layers * peak / (layout.pp * layout.vpp)
  acts = inflight_layers * activation_bytes_per_layer(model, layout, tech, recompute, c)
  if recompute == "full":
    acts += activation_bytes_per_layer(model, layout, tech, "selective", c)
  params, optimizer = n * c.param_bytes, n * c.optim_state_bytes / layout.dp
  # An asynchronous save copies the train state (params and optimizer state, as sharded) into
  # fresh device buffers before its background write (mscale_jax/checkpoint.py).
  return Memory(params=params, grads=n * c.grad_bytes, optimizer=optimizer, activations=acts,
                reserved=c.reserved_bytes, capacity=capacity,
                checkpoint_copy=params + optimizer if tech.async_checkpoint else 0.0)
