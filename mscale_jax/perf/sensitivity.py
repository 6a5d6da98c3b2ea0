"""How much each efficiency constant moves the reproduced rows: the fit's robustness, in numbers."""
import dataclasses

from mscale_jax.perf import paper
from mscale_jax.perf.constants import DEFAULT, Constants
from mscale_jax.perf.hardware import A100_MEGASCALE, Hardware


def scalar_fields(c: Constants) -> list:
  """Names of the float constants (efficiencies, latencies, host times) a sweep can scale."""
  return [f.name for f in dataclasses.fields(c) if isinstance(getattr(c, f.name), float)]


def sensitivity(rows: list, step: float = 0.1, hw: Hardware = A100_MEGASCALE,
                c: Constants = DEFAULT) -> list:
  """Per float constant: (name, largest MFU move in points over `rows`, worst error after).

  Each constant is scaled by (1 - step) and (1 + step) in turn, all others held; efficiencies
  are capped at 1. The worst error is against the paper's MFU of the rows that have one.
  """
  base = {id(r): paper.predict_row(r, hw, c).mfu for r in rows}
  out = []
  for name in scalar_fields(c):
    move, worst = 0.0, 0.0
    for factor in (1.0 - step, 1.0 + step):
      value = getattr(c, name) * factor
      if name.endswith("_eff") or name == "gemm_eff_max":
        value = min(value, 1.0)
      trial = dataclasses.replace(c, **{name: value})
      for row in rows:
        mfu = paper.predict_row(row, hw, trial).mfu
        move = max(move, 100 * abs(mfu - base[id(row)]))
        if row.paper_mfu is not None:
          worst = max(worst, abs(100 * mfu - row.paper_mfu))
    out.append((name, move, worst))
  return sorted(out, key=lambda t: -t[1])
