"""Search of 3D-parallel layouts and technique switches for the highest predicted MFU that fits."""
import dataclasses

from mscale_jax.errors import ConfigError
from mscale_jax.perf.constants import DEFAULT, Constants
from mscale_jax.perf.hardware import Hardware
from mscale_jax.perf.iteration import predict
from mscale_jax.perf.workload import Layout, ModelSpec, Techniques

MICRO_BATCHES = (1, 2, 4, 8)
SWITCHES = ("parallel_block", "sliding_window", "tp_overlap", "pp_overlap", "dp_overlap",
            "efficient_ops", "async_data")


def divisors(n: int) -> list:
  """Positive divisors of `n`, ascending."""
  return [d for d in range(1, n + 1) if n % d == 0]


def technique_options(all_on: Techniques) -> list:
  """Megatron-LM's baseline, everything on, and everything on but one switch (to show each)."""
  options = [Techniques(), all_on]
  for name in SWITCHES:
    off = None if name == "sliding_window" else False
    options.append(dataclasses.replace(all_on, **{name: off}))
  return options


def candidate_layouts(model: ModelSpec, devices: int, hw: Hardware, global_batches: list,
                      max_vpp: int = 8) -> list:
  """Every valid layout: TP within a node and dividing the heads, PP*vpp dividing the layers."""
  out = []
  tps = [t for t in divisors(model.num_heads) if t <= hw.devices_per_node]
  for tp in tps:
    for pp in divisors(model.num_layers):
      if devices % (tp * pp):
        continue
      dp = devices // (tp * pp)
      for vpp in divisors(model.num_layers // pp):
        if vpp > max_vpp or (pp == 1 and vpp > 1):
          continue
        for batch in global_batches:
          for mb in MICRO_BATCHES:
            if batch % (dp * mb):
              continue
            m = batch // (dp * mb)
            if vpp > 1 and m < pp:
              continue
            out.append(Layout(tp, pp, vpp, dp, mb, batch))
  return out


def search(model: ModelSpec, devices: int, hw: Hardware, global_batch: int, all_on: Techniques,
           c: Constants = DEFAULT, max_batch_scale: int = 1, top: int = 5) -> list:
  """The `top` fitting predictions by MFU over layouts x technique switches x schedule.

  Every layout is tried with `all_on` (and, with one chunk per stage, also with the ZB-H1
  schedule); each prediction takes the cheapest recomputation that fits (`predict`); the best
  `top` layouts are then tried with each option of `technique_options` (a switch can cost more
  than it saves, e.g. TP overlap on small GEMMs). Global batches from `global_batch` up to
  `max_batch_scale` times it are tried only with LAMB on (the optimizer that keeps quality at
  the larger batch).
  """
  if devices < 1:
    raise ConfigError("devices", devices, "a positive integer")
  batches = [global_batch * k for k in range(1, max_batch_scale + 1)]
  layouts = [l for l in candidate_layouts(model, devices, hw, batches)
             if l.global_batch == global_batch or all_on.lamb]
  # ZB-H1 runs one chunk per stage: tried beside (interleaved) 1F1B on every vpp=1 pipeline.
  tries = [(l, all_on) for l in layouts]
  tries += [(l, dataclasses.replace(all_on, zb_h1=True)) for l in layouts
            if l.vpp == 1 and l.pp > 1]
  first = [p for p in (predict(model, l, t, hw, c) for l, t in tries) if p.fits]
  if not first:
    raise ConfigError("devices", devices,
                      f"a count on which some TP x PP x DP layout of {model.name} with global "
                      f"batch {global_batch} fits in memory")
  first.sort(key=lambda p: -p.mfu)
  results = []
  for best in first[:top]:
    for tech in technique_options(dataclasses.replace(all_on, zb_h1=best.techniques.zb_h1)):
      if best.layout.global_batch > global_batch and not tech.lamb:
        continue
      pred = predict(model, best.layout, tech, hw, c)
      if pred.fits:
        results.append(pred)
  results.sort(key=lambda p: -p.mfu)
  unique = []
  for pred in results:
    if all((pred.layout, pred.techniques) != (u.layout, u.techniques) for u in unique):
      unique.append(pred)
  return unique[:top]
