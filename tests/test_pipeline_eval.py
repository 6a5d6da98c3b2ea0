"""The forward-only (evaluation) pipeline, and the Pallas flash-attention kernel inside a stage.

Both against the unpipelined model on the same parameters and batch (`test_pipeline.py`'s
tiny models): the forward-only pipeline for every schedule and v, the kernel (the Pallas
interpreter on CPU) in a pipelined step's loss and every gradient.
"""
import dataclasses
import functools

import jax
import numpy as np
import pytest

from mscale_jax import mesh as mesh_lib
from mscale_jax.model import abstract_model
from mscale_jax.parallel import pipeline
from mscale_jax.step import loss_fn

import test_pipeline as base

LAYERS = 4


def _placed(config, p, v, tensor):
  mesh = mesh_lib.make_mesh({"data": 8 // (p * tensor), "fsdp": 1, "stage": p,
                             "tensor": tensor})
  graphdef, _, names = abstract_model(config)
  params = pipeline.reorder_layers(base._params(LAYERS, config.block), LAYERS, (1, 1), (p, v))
  params = jax.device_put(params, mesh_lib.shardings_for(mesh, names))
  batch = jax.device_put(base._batch(), mesh_lib.batch_sharding(mesh))
  return mesh, graphdef, params, batch


# (schedule, stages, virtual, microbatches, tensor, overlap)
EVAL_VARIANTS = [
    ("1f1b", 2, 1, 4, 2, True),
    ("gpipe", 4, 1, 8, 2, False),
    ("interleaved_1f1b", 2, 2, 4, 2, True),
    ("zb_h1", 2, 1, 2, 1, False),
]


@pytest.mark.parametrize("variant", EVAL_VARIANTS[:1] + [
    pytest.param(v, marks=pytest.mark.slow) for v in EVAL_VARIANTS[1:]],
    ids=lambda v: "-".join(map(str, v)))
def test_forward_only_pipeline_loss_equals_unpipelined(variant):
  schedule, p, v, m, tensor, overlap = variant
  config = base._model_config(LAYERS, "parallel")
  mesh, graphdef, params, batch = _placed(config, p, v, tensor)
  evaluate = jax.jit(functools.partial(pipeline.loss, graphdef=graphdef, schedule=schedule,
                                       stages=p, virtual=v, microbatches=m, overlap=overlap))
  with jax.set_mesh(mesh):
    lowered = evaluate.lower(params, batch=batch)
    loss = lowered.compile()(params, batch=batch)
  want, _ = base._reference(LAYERS, "parallel")
  assert float(loss) == pytest.approx(want, rel=1e-6)
  # Forwards only: no transposes of the chunk's matmuls, i.e. nothing differentiated.
  assert "transpose(jvp" not in lowered.as_text()


def test_forward_only_plan_has_no_backward():
  plan = pipeline.plan_lib.make_plan("1f1b", 4, 1, 8, overlap=True, forward=True)
  assert {op.kind for op in plan.ops} == {"idle", "F"}
  assert plan.table.ticks < pipeline.plan_lib.make_plan("1f1b", 4, 1, 8).table.ticks
  # Each stage runs its forwards in a row once its first input is there.
  for s, starts in enumerate(plan.table.starts):
    assert list(starts) == list(range(starts[0], starts[0] + 8))


@pytest.mark.slow
def test_pallas_flash_attention_inside_a_stage():
  """The Pallas flash-attention kernel (interpreted on CPU) in every chunk of a pipelined
  step: loss and every gradient equal the unpipelined XLA-attention model's."""
  config = dataclasses.replace(base._model_config(LAYERS, "parallel"), attention_impl="pallas",
                               attention_window=None)
  reference = dataclasses.replace(config, attention_impl="xla")
  graphdef, _, _ = abstract_model(reference)
  with jax.set_mesh(mesh_lib.make_mesh({"data": 1, "fsdp": 1, "stage": 1, "tensor": 1})):
    want_loss, want_grads = jax.jit(jax.value_and_grad(loss_fn), static_argnums=1)(
        base._params(LAYERS, "parallel"), graphdef, base._batch())
  mesh, graphdef, params, batch = _placed(config, 2, 1, 1)
  step = jax.jit(functools.partial(pipeline.value_and_grad, graphdef=graphdef, schedule="1f1b",
                                   stages=2, virtual=1, microbatches=2, recompute="none"))
  with jax.set_mesh(mesh):
    jaxpr = str(jax.make_jaxpr(step)(params, batch=batch))
    loss, grads = step(params, batch=batch)
  assert "pallas_call" in jaxpr          # the kernel, not XLA's attention, runs in the stage
  grads = pipeline.reorder_layers(jax.tree.map(np.asarray, grads), LAYERS, (2, 1), (1, 1))
  assert float(loss) == pytest.approx(float(want_loss), rel=1e-5)
  for (path, want), got in zip(jax.tree_util.tree_leaves_with_path(want_grads),
                               jax.tree.leaves(grads)):
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-4 * np.abs(want).max(),
                               err_msg=jax.tree_util.keystr(path))
