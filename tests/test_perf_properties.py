"""Properties any sane model of training time must have, checked over a grid of layouts."""
import dataclasses
import subprocess
import sys

import pytest

from mscale_jax.perf import paper
from mscale_jax.perf.constants import DEFAULT
from mscale_jax.perf.hardware import A100_MEGASCALE as A100
from mscale_jax.perf.iteration import predict
from mscale_jax.perf.workload import GPT_175B, GPT_530B, Layout, Techniques

LAYOUTS = [Layout(8, 8, 6, 4, 1, 256), Layout(8, 8, 6, 16, 2, 768), Layout(4, 8, 3, 8, 1, 512),
           Layout(8, 4, 8, 8, 2, 768), Layout(8, 8, 1, 4, 4, 256)]
TECHS = [paper.MEGATRON, paper.MEGASCALE, Techniques(parallel_block=True, efficient_ops=True)]
OVERLAPS = ("tp_overlap", "pp_overlap", "dp_overlap", "async_data")


def _time(layout, tech, hw=A100, c=DEFAULT):
  return predict(GPT_175B, layout, tech, hw, c, recompute="selective").iteration_s


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("field", ["intra_node_bw", "nic_bw", "hbm_bw"])
def test_more_bandwidth_is_never_slower(layout, field):
  faster = dataclasses.replace(A100, **{field: 2 * getattr(A100, field)})
  for tech in TECHS:
    assert _time(layout, tech, faster) <= _time(layout, tech) + 1e-12


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("switch", OVERLAPS)
def test_turning_on_an_overlap_is_never_slower_on_large_gemms(layout, switch):
  for tech in TECHS:
    off = dataclasses.replace(tech, **{switch: False})
    on = dataclasses.replace(tech, **{switch: True})
    assert _time(layout, on) <= _time(layout, off) + 1e-12


def test_bubble_shrinks_as_micro_batches_grow():
  fractions = []
  for batch in (64, 128, 256, 512, 1024):
    pred = predict(GPT_175B, Layout(8, 8, 6, 4, 1, batch), paper.MEGASCALE, A100)
    fractions.append(pred.breakdown["bubble"] / pred.iteration_s)
  assert fractions == sorted(fractions, reverse=True)
  assert fractions[-1] < fractions[0] / 4


def test_memory_grows_with_micro_batch_size():
  totals = [predict(GPT_175B, Layout(8, 8, 6, 4, mb, 256), tech, A100, recompute="none")
            .memory.total for tech in TECHS for mb in (1, 2, 4, 8)]
  for tech_totals in (totals[0:4], totals[4:8], totals[8:12]):
    assert tech_totals == sorted(tech_totals) and tech_totals[0] < tech_totals[-1]


def test_out_of_memory_verdict():
  big = predict(GPT_530B, Layout(8, 35, 3, 8, 8, 2240), paper.MEGASCALE, A100, recompute="none")
  assert not big.fits
  small = predict(GPT_530B, Layout(8, 35, 3, 8, 1, 2240), paper.MEGASCALE, A100)
  assert small.fits and small.recompute == "none"


def test_importing_perf_does_not_import_jax():
  code = ("import sys, mscale_jax.perf, mscale_jax.perf.paper, mscale_jax.perf.search, "
          "mscale_jax.perf.calibrate; print('jax' in sys.modules)")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
  assert out.stdout.strip() == "False"
