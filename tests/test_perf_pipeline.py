"""The performance model's pipeline: ZB-H1's bubble, the passes it is timed with, recompute."""
import dataclasses

import pytest

from experiments import plan
from mscale_jax.errors import ConfigError
from mscale_jax.perf import iteration, layer, paper
from mscale_jax.perf.constants import DEFAULT
from mscale_jax.perf.hardware import A100_MEGASCALE as A100
from mscale_jax.perf.workload import GPT_175B, Layout

TECH = paper.MEGASCALE
ONE_CHUNK = Layout(tp=8, pp=8, vpp=1, dp=4, micro_batch=1, global_batch=256)


def _slowest(lay, tech, recompute):
  stage = layer.layer_cost(GPT_175B, lay, tech, recompute, A100, DEFAULT).scale(
      GPT_175B.num_layers / lay.pp)
  last = stage + layer.head_cost(GPT_175B, lay, tech, A100, DEFAULT)
  return last if last.total >= stage.total else stage


@pytest.mark.parametrize("recompute", ["none", "full"])
def test_passes_split_the_layer_cost(recompute):
  """F + B + W is the whole cost; W is the weight-gradient GEMMs (as much FLOPs as the
  forward's GEMMs); full recomputation adds exactly one forward, inside B."""
  cost = layer.layer_cost(GPT_175B, ONE_CHUNK, TECH, recompute, A100, DEFAULT)
  f, b, w = cost.passes
  assert f + b + w == pytest.approx(cost.total)
  assert 0 < w < cost.gemm and 0 < f < b
  none = layer.layer_cost(GPT_175B, ONE_CHUNK, TECH, "none", A100, DEFAULT).passes
  if recompute == "full":
    assert (f, w) == pytest.approx(none[::2]) and b == pytest.approx(none[1] + none[0])


@pytest.mark.parametrize("pp_overlap", [False, True])
def test_zb_h1_bubble_is_the_papers_formula_on_the_slowest_stage(pp_overlap):
  """(pp-1)(T_F + T_B - T_W) of the slowest stage (Qi et al., ICLR 2024), plus the 2(pp-1)
  hops of the fill and drain with decoupled sends; 1F1B's is (pp-1)(T_F + T_B + T_W)."""
  tech = dataclasses.replace(TECH, pp_overlap=pp_overlap)
  zb = iteration.predict(GPT_175B, ONE_CHUNK, dataclasses.replace(tech, zb_h1=True), A100,
                         DEFAULT, recompute="none")
  one = iteration.predict(GPT_175B, ONE_CHUNK, tech, A100, DEFAULT, recompute="none")
  hop = iteration.p2p_time(GPT_175B, ONE_CHUNK, A100, DEFAULT)
  f, b, w = _slowest(ONE_CHUNK, tech, "none").passes
  p = ONE_CHUNK.pp
  if pp_overlap:
    fill = 2 * (p - 1) * hop
  else:                                    # a blocking send after every F and every B
    f, b, fill = f + hop, b + hop, 0.0
  assert zb.breakdown["bubble"] == pytest.approx((p - 1) * (f + b - w) + fill, rel=1e-9)
  assert one.breakdown["bubble"] == pytest.approx((p - 1) * (f + b + w) + fill, rel=1e-9)
  # Same stash (1F1B's first stage holds pp microbatches, every ZB-H1 stage at most that).
  assert zb.memory.total == one.memory.total and zb.mfu > one.mfu


def test_zb_h1_refuses_interleaving():
  with pytest.raises(ConfigError, match="vpp=6 is invalid: 1 with the zb_h1 schedule"):
    iteration.predict(GPT_175B, Layout(8, 8, 6, 4, 1, 256), dataclasses.replace(TECH, zb_h1=True),
                      A100, DEFAULT)


def test_full_recompute_costs_a_forward_and_saves_activation_memory():
  none = iteration.predict(GPT_175B, ONE_CHUNK, TECH, A100, DEFAULT, recompute="none")
  full = iteration.predict(GPT_175B, ONE_CHUNK, TECH, A100, DEFAULT, recompute="full")
  assert full.iteration_s > none.iteration_s
  assert full.memory.activations < none.memory.activations


def test_plan_names_the_schedule():
  zb = iteration.predict(GPT_175B, ONE_CHUNK, dataclasses.replace(TECH, zb_h1=True), A100,
                         DEFAULT)
  assert " zb_h1 | " in plan.describe(zb)
  inter = iteration.predict(GPT_175B, Layout(8, 8, 6, 4, 1, 256), TECH, A100, DEFAULT)
  assert " interleaved_1f1b | " in plan.describe(inter)


def test_search_tries_zb_h1_on_every_one_chunk_pipeline(monkeypatch):
  from mscale_jax.perf import search
  tried = []
  real = search.predict

  def spy(model, lay, tech, hw, c):
    tried.append((lay, tech.zb_h1))
    return real(model, lay, tech, hw, c)

  monkeypatch.setattr(search, "predict", spy)
  search.search(GPT_175B, 256, A100, 768, TECH, top=1)
  zb = {lay for lay, on in tried if on}
  assert zb and all(lay.vpp == 1 and lay.pp > 1 for lay in zb)
  assert zb == {lay for lay, on in tried if not on and lay.vpp == 1 and lay.pp > 1}
