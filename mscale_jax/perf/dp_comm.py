"""What a data-parallel communication scheme buys: one layout predicted with `none` and `sdp4bit`.

The planner (`experiments/plan.py`), `experiments/scaling_curves.py --dp_comm=sdp4bit` and
`experiments/sdp4bit_speedup.py` all ask the same question, "on a cluster with N Gb/s between
nodes, what does SDP4Bit buy?", through these three functions:

* `techniques(tech, dp_comm)`: the switches with `none`'s NCCL rings or SDP4Bit's two-level
  quantized collectives (`compressed.DPCompression`, the defaults of `config.SDP4BitConfig`);
* `at_node_gbps(hw, gbps)`: the cluster with `gbps` Gb/s per node and direction between nodes,
  spread evenly over the node's NICs;
* `compare(...)`: both predictions of one layout at the same activation recomputation, so the
  data-parallel collectives are the only difference.

`none` is what Megatron-LM and MegaScale run: NCCL's ring reduce-scatter and all-gather over
the data-parallel group, paced by its busiest link (`comm.ring_link`: the NICs with one rank
per node, as on every MegaScale row; NVLink or the NICs when tensor parallelism leaves several
in a node). With one rank per node it is also SDP4Bit's schedule uncompressed, so a speedup
over it is SDP4Bit's gain alone; with several the two schedules differ (the ring pipelines
its NVLink and network links, the two levels run one after the other but send less across few
nodes), and a speedup over `none` includes that difference. `DPCompression.uncompressed()` is
the two-level baseline without it.
"""
import dataclasses

from mscale_jax.config import DP_COMMS
from mscale_jax.errors import ConfigError
from mscale_jax.perf.compressed import DPCompression
from mscale_jax.perf.constants import DEFAULT, Constants
from mscale_jax.perf.hardware import Hardware
from mscale_jax.perf.iteration import Prediction, predict
from mscale_jax.perf.workload import Layout, ModelSpec, Techniques


def techniques(tech: Techniques, dp_comm: str,
               compression: DPCompression | None = None) -> Techniques:
  """`tech` with the data-parallel collectives of `dp_comm` ('none' or 'sdp4bit').

  'none' keeps `tech`'s own (NCCL's rings, or an explicit uncompressed two-level schedule);
  'sdp4bit' sets `compression` (default: SDP4Bit's bit widths and group sizes).
  """
  if dp_comm not in DP_COMMS:
    raise ConfigError("dp_comm", dp_comm, f"one of {list(DP_COMMS)}")
  if dp_comm == "none":
    return tech
  return dataclasses.replace(tech, dp_compression=compression or DPCompression())


def at_node_gbps(hw: Hardware, gbps: float | None) -> Hardware:
  """`hw` with `gbps` Gb/s per node (one direction, all NICs together); None or 0 keeps `hw`."""
  if not gbps:
    return hw
  if gbps < 0:
    raise ConfigError("node_gbps", gbps, "a positive bandwidth in Gb/s per node")
  return dataclasses.replace(hw, nic_bw=gbps * 1e9 / 8 / hw.nics_per_node)


def node_gbps(hw: Hardware) -> float:
  """The inter-node bandwidth per node of `hw` in Gb/s (one direction, all NICs)."""
  return hw.nics_per_node * hw.nic_bw * 8 / 1e9


@dataclasses.dataclass(frozen=True)
class Comparison:
  """One layout with `none` and with `sdp4bit`; speedup = none's iteration / sdp4bit's."""
  none: Prediction
  sdp4bit: Prediction

  @property
  def speedup(self) -> float:
    return self.none.iteration_s / self.sdp4bit.iteration_s

  @property
  def dp_share(self) -> float:
    """The share of `none`'s iteration that is exposed data-parallel communication."""
    return self.none.breakdown["dp_exposed"] / self.none.iteration_s


def compare(model: ModelSpec, layout: Layout, tech: Techniques, hw: Hardware,
            c: Constants = DEFAULT, recompute: str = "auto",
            compression: DPCompression | None = None) -> Comparison:
  """`layout` predicted with `tech` as given ('none') and with SDP4Bit's collectives.

  The SDP4Bit run takes the recomputation the 'none' run chose (the performance model counts
  no extra memory for qWD's reference weights), so only the DP collectives differ.
  """
  none = predict(model, layout, tech, hw, c, recompute)
  quick = predict(model, layout, techniques(tech, "sdp4bit", compression), hw, c,
                  none.recompute)
  return Comparison(none, quick)
