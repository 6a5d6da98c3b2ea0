"""Replica consistency before a save (mscale_jax/replicas.py): replicas that hold the same bits
pass; one replica changed on one device, by one bit, is caught and named, and the trainer then
refuses the save so the previous checkpoint stays the latest. The corruption here is made by
hand (a perturbed shard put back on its device), not by the `bad_slot` fault's code."""
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from mscale_jax import replicas
from mscale_jax.callbacks import Callback
from mscale_jax.resilience import events
from mscale_jax.resilience.driver import blame
from mscale_jax.resilience.driver.server import Rejected, parse_heartbeat
from mscale_jax.train import Trainer


def _state(mesh, seed):
  """A train-state-like tree on `mesh`: float32/bfloat16 params sharded over 'tensor' (and
  replicated over 'data'), adam's state, an int32 step; random values."""
  rng = np.random.default_rng(seed)
  params = {"w": rng.normal(size=(16, 24)).astype(np.float32),
            "b": rng.normal(size=(24,)).astype(jnp.bfloat16),
            "e": rng.normal(size=(8, 16)).astype(np.float32)}
  specs = {"w": P(None, "tensor"), "b": P("tensor"), "e": P()}
  params = {k: jax.device_put(v, NamedSharding(mesh, specs[k])) for k, v in params.items()}
  with jax.set_mesh(mesh):
    opt = jax.jit(optax.adam(1e-3).init)(params)
  return {"step": jax.device_put(jnp.int32(seed), NamedSharding(mesh, P())),
          "params": params, "opt_state": opt}


def _flip_bit(x: jax.Array, device_id: int, rng) -> jax.Array:
  """`x` with one random bit of one random element flipped in `device_id`'s shard only."""
  shards = []
  for s in x.addressable_shards:
    data = np.array(s.data)
    if s.device.id == device_id:
      raw = data.view(f"uint{8 * data.itemsize}").reshape(-1)
      raw[rng.integers(raw.size)] ^= raw.dtype.type(1 << int(rng.integers(8 * data.itemsize)))
    shards.append(jax.device_put(data, s.device))
  return jax.make_array_from_single_device_arrays(x.shape, x.sharding, shards)


@pytest.mark.parametrize("shape", [(4, 2), (2, 4)])
def test_identical_replicas_pass(shape):
  mesh = jax.make_mesh(shape, ("data", "tensor"))
  for seed in range(3):
    assert replicas.divergences(_state(mesh, seed)) == []
    replicas.check(_state(mesh, seed), step=seed)


@pytest.mark.parametrize("leaf", ["w", "b", "e"])
def test_one_flipped_bit_on_one_device_is_caught_and_named(leaf):
  mesh = jax.make_mesh((4, 2), ("data", "tensor"))
  rng = np.random.default_rng(hash(leaf) % 1000)
  for trial in range(4):
    state = _state(mesh, trial)
    bad_device = int(rng.choice([d.id for d in mesh.devices.flat]))
    state["params"][leaf] = _flip_bit(state["params"][leaf], bad_device, rng)
    found = replicas.divergences(state)
    assert len(found) == 1, found
    d = found[0]
    assert d.path == f"['params']['{leaf}']"
    # every other replica of that block agrees; the flipped one is the minority and named
    copies = 8 if leaf == "e" else 4   # 'e' is replicated over both axes
    assert d.majority and [dev for dev, _ in d.groups[1][1]] == [bad_device]
    assert len(d.groups) == 2 and len(d.groups[0][1]) == copies - 1
    with pytest.raises(replicas.ReplicaDivergenceError, match=f"at step 9: process 0") as e:
      replicas.check(state, step=9)
    assert e.value.culprit == 0 and e.value.step == 9


@pytest.fixture
def cache_dir(tmp_path):
  previous = jax.config.jax_compilation_cache_dir
  jax.config.update("jax_compilation_cache_dir", str(tmp_path))
  replicas._program.cache_clear()
  yield tmp_path
  jax.config.update("jax_compilation_cache_dir", previous)
  replicas._program.cache_clear()


def test_a_restarted_process_loads_the_check_from_the_compile_cache(cache_dir, monkeypatch):
  """What a restart sees: the in-process memo empty, the per-process cache entry written by the
  run before. The loaded program is the one that catches a flipped bit."""
  served = []
  load_or_lower = replicas.compile_cache.load_or_lower

  def spy(*args, **kwargs):
    executable, how = load_or_lower(*args, **kwargs)
    served.append(how)
    return executable, how

  monkeypatch.setattr(replicas.compile_cache, "load_or_lower", spy)
  mesh = jax.make_mesh((4, 2), ("data", "tensor"))   # every device: the cache serves it
  rng = np.random.default_rng(7)
  replicas.check(_state(mesh, 0))
  assert served == ["compiled"]
  assert sorted(f.split("-p0-")[0] + f[-4:] for f in os.listdir(cache_dir / "per-process")) == [
      "replica_check.pkl", "replica_check.pre"]
  replicas._program.cache_clear()   # a new process
  state = _state(mesh, 1)
  state["params"]["w"] = _flip_bit(state["params"]["w"], 5, rng)
  with pytest.raises(replicas.ReplicaDivergenceError, match="process 0 differs"):
    replicas.check(state, step=3)
  assert served == ["compiled", "loaded before lowering"]


def test_two_replicas_that_differ_name_no_majority():
  mesh = jax.make_mesh((2, 4), ("data", "tensor"))
  state = _state(mesh, 1)
  m = state["opt_state"][0].mu["w"]   # optimizer state is checked too
  state["opt_state"][0].mu["w"] = _flip_bit(m, mesh.devices[1, 2].id,
                                            np.random.default_rng(3))
  [d] = replicas.divergences(state)
  assert "mu" in d.path and not d.majority
  assert sorted(dev for _, members in d.groups for dev, _ in members) == sorted(
      [mesh.devices[0, 2].id, mesh.devices[1, 2].id])
  with pytest.raises(replicas.ReplicaDivergenceError, match="no majority") as e:
    replicas.check(state)
  assert e.value.culprit is None


def test_the_driver_blames_the_rank_a_divergence_names_and_rejects_other_ranks():
  failure = events.Failure(events.REPLICA_DIVERGENCE, 1, "replicas disagree", step=110)
  beat = events.Heartbeat(rank=0, host="h", pid=1, failure=failure.to_json())
  blamed = blame.reported({0: (beat, 0.0)}, 2)
  assert (blamed.kind, blamed.rank, blamed.step) == (events.REPLICA_DIVERGENCE, 1, 110)
  out_of_range = dict(beat.to_json(), failure=dict(failure.to_json(), rank=7))
  with pytest.raises(Rejected, match="failure"):
    parse_heartbeat(json.dumps(out_of_range).encode(), 2)
  assert parse_heartbeat(json.dumps(beat.to_json()).encode(), 2).failure["rank"] == 1


class FlipAfter(Callback):
  """Flips one bit of one device's copy of the first parameter after step `step` (by hand)."""

  def __init__(self, step, device_id):
    self.step, self.device_id = step, device_id

  def on_step_dispatched(self, run, step, metrics):
    if step == self.step:
      leaves, treedef = jax.tree.flatten(run.state["params"])
      leaves[0] = _flip_bit(leaves[0], self.device_id, np.random.default_rng(step))
      run.state = {**run.state, "params": jax.tree.unflatten(treedef, leaves)}


class Steps(Callback):
  """The steps that were dispatched."""

  def __init__(self):
    self.dispatched = []

  def on_step_dispatched(self, run, step, metrics):
    self.dispatched.append(step)


@pytest.mark.slow   # a real training run
def test_a_save_before_the_last_reads_its_verdict_off_the_loop_and_is_not_written(
    tiny_config, tmp_path):
  """Step 8's check runs beside the next step and stops that save before orbax starts it;
  the error comes at a later step (or save), names step 8, and no step-8 checkpoint exists."""
  config = tiny_config(mesh=dict(data=4, tensor=2),
                       train=dict(steps=16, global_batch=8, log_every=2, eval_every=16,
                                  checkpoint_every=4))
  steps = Steps()
  trainer = Trainer(config, tmp_path, show_progress=False,
                    callbacks=[FlipAfter(6, device_id=5), steps])
  with pytest.raises(replicas.ReplicaDivergenceError, match="at step 8") as e:
    trainer.train()
  assert e.value.culprit == 0
  assert 8 < steps.dispatched[-1] <= 12   # found after the save, by the next save at the latest
  assert trainer.checkpointer.all_steps() == [4]
  assert not [d for d in os.listdir(trainer.checkpointer.directory) if d.startswith("8")]


@pytest.mark.slow   # two trainer runs
def test_a_divergent_state_is_not_saved_and_the_previous_checkpoint_stays_latest(
    tiny_config, tmp_path):
  config = tiny_config(mesh=dict(data=4, tensor=2),
                       train=dict(steps=8, global_batch=8, log_every=2, eval_every=8,
                                  checkpoint_every=4))
  trainer = Trainer(config, tmp_path / "bad", show_progress=False,
                    callbacks=[FlipAfter(6, device_id=5)])
  with pytest.raises(replicas.ReplicaDivergenceError, match="at step 8") as e:
    trainer.train()
  assert e.value.culprit == 0 and any(dev == 5 for d in e.value.divergences
                                      for dev, _ in d.groups[-1][1])
  assert trainer.checkpointer.all_steps() == [4]
  healthy = Trainer(config, tmp_path / "good", show_progress=False)
  summary = healthy.train()
  assert healthy.checkpointer.all_steps() == [4, 8]
  assert all(s["replica_check_s"] >= 0 for s in summary["checkpoint_saves"])


def test_a_divergence_is_filed_under_the_bad_slot_that_fired(tmp_path):
  from mscale_jax.files import write_json
  from mscale_jax.resilience.driver import claim
  from mscale_jax.resilience.faults import bad_slot_marker, parse_faults
  faults = parse_faults(["kill:rank=1:step=3", "bad_slot:slot=2:step=5"])
  assert claim.bad_slot_fired(str(tmp_path), faults, [0, 2]) is None   # not fired yet
  write_json(bad_slot_marker(str(tmp_path), 2), {"slot": 2, "step": 5, "rank": 1})
  assert claim.bad_slot_fired(str(tmp_path), faults, [0, 1]) is None   # not in the group
  fired = claim.bad_slot_fired(str(tmp_path), faults, [0, 2])
  assert (fired["fault"], fired["step"]) == ("bad_slot:slot=2:step=5", 5) and fired["time"] > 0


def test_a_worker_reports_the_minority_process_as_the_rank_at_fault():
  from mscale_jax.callbacks.worker import Heartbeats
  from mscale_jax.resilience.worker.heartbeat import HeartbeatClient
  majority = replicas.Divergence("['params']['w']", ((0, 4),), [
      ((1, 2), [(0, 0), (1, 0), (4, 2)]), ((3, 4), [(2, 1)])])
  tie = replicas.Divergence("['params']['w']", ((0, 4),), [((1, 2), [(0, 0)]), ((3, 4), [(2, 1)])])
  for divergence, at_fault in ((majority, 1), (tie, 0)):   # a tie: the reporting rank's own
    client = HeartbeatClient(rank=0)   # no URL: nothing is sent
    Heartbeats(client).on_error(None, replicas.ReplicaDivergenceError(110, [divergence]))
    failure = client.beat.failure
    assert (failure["kind"], failure["rank"], failure["step"]) == (
        events.REPLICA_DIVERGENCE, at_fault, 110)
    assert ("process 1 differs from the majority" in failure["detail"]) == (at_fault == 1)


def test_a_save_refused_at_the_agreement_still_raises_its_replica_verdict(tmp_path):
  """The write probe refuses save 4 of a divergent state (a read-only folder): the divergence is
  raised there,
  named step 4, not left unread (it surfaced only at a later save, named with that step)."""
  import functools

  from mscale_jax.checkpoint import Checkpointer
  from mscale_jax.config import Config
  mesh = jax.make_mesh((4, 2), ("data", "tensor"))
  state = _state(mesh, 2)
  state["params"]["e"] = _flip_bit(state["params"]["e"], 6, np.random.default_rng(4))
  from mscale_jax.resilience.driver import injector
  directory = str(tmp_path / "checkpoints")
  checkpointer = Checkpointer(directory)
  injector.make_read_only(directory)   # the kernel refuses the write probe
  try:
    verify = functools.partial(replicas.start_check(state), 4)
    with pytest.raises(replicas.ReplicaDivergenceError) as error:
      checkpointer.save(4, state, {"position": 4}, Config(), verify=verify)
  finally:
    injector.make_writable(directory)
  assert error.value.step == 4 and error.value.culprit is not None
  checkpointer.close()
  assert checkpointer.all_steps() == []
