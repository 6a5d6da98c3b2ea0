"""The Trainer: sharded init or exact resume, the jit train step, evaluation, logging, checkpoints.

The train state is a plain pytree `{'step', 'params', 'opt_state'}`: `params` is the model's
`nnx.Param` state as a pure dict (merged back into the NNX model inside the step), and the
optimizer state is sharded exactly like the parameters. Every logged step goes to the progress
bar, to TensorBoard event files and to `WORKDIR/metrics.jsonl`.
"""
import dataclasses
import functools
import json
import logging
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from tqdm import tqdm

from mscale_jax import compile_cache
from mscale_jax import data as data_lib
from mscale_jax import flops as flops_lib
from mscale_jax import mesh as mesh_lib
from mscale_jax import optim
from mscale_jax.checkpoint import Checkpointer, abstract_like
from mscale_jax.config import Config, ModelConfig, validate
from mscale_jax.errors import NonFiniteError
from mscale_jax.model import GPT, count_params
from mscale_jax.parallel import pipeline
from mscale_jax.resilience import events
from mscale_jax.resilience import timeline as timeline_lib
from mscale_jax.resilience.profiler import ProfilerWindow
from mscale_jax.resilience.worker import WorkerHooks

log = logging.getLogger("mscale_jax")

# train.on_nonfinite='rollback' gives up (NonFiniteError) after this many rollbacks in a run.
MAX_ROLLBACKS = 3


def abstract_model(config: ModelConfig):
  """(graphdef, abstract params, logical names of params), allocating nothing."""
  with nnx.use_eager_sharding(False):
    model = nnx.eval_shape(lambda: GPT(config, rngs=nnx.Rngs(0)))
  graphdef, params = nnx.split(model, nnx.Param)
  return graphdef, nnx.to_pure_dict(params), mesh_lib.logical_names(params)


def loss_fn(params, graphdef, batch) -> jax.Array:
  """Mean next-token cross-entropy of `batch` {'inputs', 'targets': int32 [b, s]} (and
  'segment_ids' [b, s] under data.document_mask: attention stays within documents)."""
  model = nnx.merge(graphdef, params)
  logits = model(batch["inputs"], batch.get("segment_ids"))
  return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()


@dataclasses.dataclass(frozen=True)
class Peak:
  """The FLOP/s that MFU divides by, and where the number comes from."""
  flops: float
  source: str


def peak_flops(config: Config, devices) -> Peak:
  """Data-sheet dense bf16 peak of the accelerators, or this host's measured matmul rate on CPU.

  On accelerators the denominator is the bf16 peak whatever the compute dtype, as in the paper
  (float32 matmuls run as TF32 on A100/H100 by default). CPU has no data sheet: its matmul rate
  is measured in the compute dtype, once, and cached.
  """
  kind, dtype = devices[0].device_kind, config.model.dtype
  if devices[0].platform == "cpu":
    host = flops_lib.measure_cpu_peak(dtype)
    return Peak(host, f"measured {dtype} matmul rate of this host ({host / 1e9:.1f} GFLOP/s), "
                      f"shared by the {len(devices)} simulated CPU devices")
  per_device = flops_lib.known_peak(kind, "bfloat16")
  if per_device is None:
    log.warning("no peak FLOP/s known for %r: MFU is not reported (add it to "
                "mscale_jax.flops.PEAK_FLOPS)", kind)
    return Peak(float("nan"), f"unknown: no peak known for {kind}")
  return Peak(per_device * len(devices), f"{len(devices)} x {kind} dense bf16 peak "
                                         f"({per_device / 1e12:.0f} TFLOP/s each)")


class Trainer:
  """Trains `config` in `workdir`, resuming from the latest checkpoint there if any.

  Everything that can be wrong with the configuration, the data or an existing checkpoint is
  checked in the constructor, before anything compiles (ConfigError).
  """

  def __init__(self, config: Config, workdir: str, *, devices=None, show_progress=None,
               hooks: WorkerHooks | None = None):
    self.config = config
    self.hooks = hooks or WorkerHooks()   # heartbeats and fault points (resilience/worker.py)
    self.workdir = os.path.abspath(workdir)
    self.devices = list(devices if devices is not None else jax.devices())
    self.show_progress = show_progress
    mesh_shape = validate(config, len(self.devices), platform=self.devices[0].platform)
    self.mesh = mesh_lib.make_mesh(mesh_shape, self.devices)
    # Block parameters are stored in the pipeline's layer order (identity without one).
    stages = mesh_shape["stage"]
    self.layer_layout = (stages, config.pipeline.virtual_stages if stages > 1 else 1)
    self.corpus = data_lib.load_corpus(config.data, config.model.vocab_size)
    t = config.train
    self.checkpointer = Checkpointer(os.path.join(self.workdir, "checkpoints"),
                                     keep=t.keep_checkpoints, async_save=t.async_checkpoint)
    if jax.process_index() == 0:    # the tokenizer and manifest of a prepared corpus
      data_lib.record_corpus(self.corpus, self.workdir)
    self.graphdef, abstract_params, names = abstract_model(config.model)
    self.num_params = count_params(abstract_params)
    param_shardings = mesh_lib.shardings_for(self.mesh, names)
    self.tx = optim.make_optimizer(config.optimizer, t.steps, param_names=names,
                                   param_shardings=param_shardings)
    self.schedule = optim.make_schedule(config.optimizer, t.steps)
    replicated = mesh_lib.named_sharding(self.mesh, ())
    abstract_opt = jax.eval_shape(self.tx.init, abstract_params)
    self.state_shardings = {
        "step": replicated,
        "params": param_shardings,
        "opt_state": optax.tree_map_params(self.tx, lambda _, s: s, abstract_opt,
                                           param_shardings,
                                           transform_non_params=lambda _: replicated),
    }
    self.batch_sharding = mesh_lib.batch_sharding(self.mesh)
    # Each process loads only the rows its devices hold: the loader's process index/count are
    # this process's position among the batch shards (exactly 1 process x N devices' order).
    first_row, end_row = mesh_lib.process_rows(self.batch_sharding, t.global_batch)
    rows_index = first_row // (end_row - first_row)
    self._row_shards = t.global_batch // (end_row - first_row)
    m = config.model
    self.flops_per_token = flops_lib.model_flops_per_token(m)
    self.peak = peak_flops(config, self.devices)
    self.train_iter = data_lib.make_train_iterator(
        self.corpus, seq_len=m.seq_len, global_batch=t.global_batch, seed=config.data.seed,
        process_index=rows_index, process_count=self._row_shards, prefetch=config.data.prefetch)
    self.eval_batches = data_lib.make_eval_batches(
        self.corpus, seq_len=m.seq_len, batch_size=t.global_batch, num_batches=t.eval_batches,
        process_index=rows_index, process_count=self._row_shards)
    self.resume_step = self.checkpointer.latest_step()
    if self.resume_step is not None:
      self.checkpointer.check_compatible(self.resume_step, config)
      self.train_iter.set_state(self.checkpointer.restore_data_state(self.resume_step))
    self._train_step = jax.jit(self._step, donate_argnums=0,
                               out_shardings=(self.state_shardings, None))
    self._eval_loss = jax.jit(lambda params, batch: loss_fn(self._natural_order(params),
                                                            self.graphdef, batch))
    self._eval_executable = None

  # -- state ---------------------------------------------------------------------------------

  def _fresh_state(self):
    with nnx.use_eager_sharding(False):
      model = GPT(self.config.model, rngs=nnx.Rngs(self.config.train.seed))
    params = self._pipeline_order(nnx.to_pure_dict(nnx.state(model, nnx.Param)))
    return {"step": jnp.zeros((), jnp.int32), "params": params,
            "opt_state": self.tx.init(params)}

  def init_state(self):
    """Fresh train state, created directly in its sharded layout."""
    with jax.set_mesh(self.mesh):
      return jax.jit(self._fresh_state, out_shardings=self.state_shardings)()

  def restore_or_init(self):
    """(state, start step): the latest checkpoint in the workdir, or a fresh state.

    The data iterator was already moved to the checkpoint's position in the constructor.
    """
    step = self.resume_step
    if step is None:
      return self.init_state(), 0
    state = self._restore(step)
    log.info("resumed from %s at step %d", self.checkpointer.directory, step)
    return state, int(step)

  def _restore(self, step: int):
    """Checkpoint `step` in this run's sharding and pipeline layer order."""
    with jax.set_mesh(self.mesh):
      target = abstract_like(jax.eval_shape(self._fresh_state), self.state_shardings)
    state = self.checkpointer.restore(step, target)
    saved_layout = self.checkpointer.layer_layout(step)
    if saved_layout != self.layer_layout:
      # Written by another pipeline layout: move the layers to this one's order.
      with jax.set_mesh(self.mesh):
        state = jax.jit(functools.partial(self._pipeline_order, source=saved_layout),
                        out_shardings=self.state_shardings)(state)
      log.info("moved the checkpoint's layers from pipeline layout (stage, virtual) = %s to %s",
               saved_layout, self.layer_layout)
    return state

  def _pipeline_order(self, tree, source=(1, 1)):
    """`tree`'s block leaves moved from `source`'s layer order to this run's."""
    return pipeline.reorder_layers(tree, self.config.model.num_layers, source,
                                   self.layer_layout)

  def _natural_order(self, params):
    return pipeline.reorder_layers(params, self.config.model.num_layers, self.layer_layout,
                                   (1, 1))

  # -- steps ---------------------------------------------------------------------------------

  def _step(self, state, batch, loss_scale):
    # loss_scale is 1.0 (bitwise a no-op) except on a step a `nan` fault poisons.
    if self.layer_layout[0] > 1:
      p = self.config.pipeline
      loss, grads = pipeline.value_and_grad(
          state["params"], self.graphdef, batch, schedule=p.schedule,
          stages=self.layer_layout[0], virtual=p.virtual_stages, microbatches=p.microbatches,
          overlap=p.overlap)
      loss, grads = loss * loss_scale, jax.tree.map(lambda g: g * loss_scale, grads)
    else:
      loss, grads = jax.value_and_grad(
          lambda p: loss_fn(p, self.graphdef, batch) * loss_scale)(state["params"])
    updates, opt_state = self.tx.update(grads, state["opt_state"], state["params"])
    params = optax.apply_updates(state["params"], updates)
    grad_norm = optax.tree.norm(grads)
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    # A non-finite step applies no update, so no state (and no checkpoint) ever holds one;
    # train.on_nonfinite decides on the host what happens next.
    params, opt_state = jax.tree.map(lambda new, old: jnp.where(finite, new, old),
                                     (params, opt_state), (state["params"], state["opt_state"]))
    metrics = {"loss": loss, "grad_norm": grad_norm, "finite": finite,
               "learning_rate": self.schedule(state["step"])}
    return {"step": state["step"] + 1, "params": params, "opt_state": opt_state}, metrics

  def device_batch(self, batch: dict[str, np.ndarray]) -> dict[str, jax.Array]:
    """This process's rows -> global arrays sharded over (data, fsdp)."""
    return {key: jax.make_array_from_process_local_data(
                self.batch_sharding, value, (value.shape[0] * self._row_shards,) + value.shape[1:])
            for key, value in batch.items()}

  def train_step(self, state, batch):
    with jax.set_mesh(self.mesh):
      return self._train_step(state, self.device_batch(batch), jnp.float32(1.0))

  def evaluate(self, params) -> float:
    """Mean loss over the fixed held-out batches."""
    with jax.set_mesh(self.mesh):
      batches = [self.device_batch(b) for b in self.eval_batches]
      if self._eval_executable is None:
        self._eval_executable, _ = compile_cache.compile_or_load(
            self._eval_loss.lower(params, batches[0]), "eval_loss", self.mesh.size)
      losses = [self._eval_executable(params, b) for b in batches]
    return float(np.mean([float(x) for x in losses]))

  # -- loop ----------------------------------------------------------------------------------

  def train(self, stop_at: int | None = None) -> dict:
    """Runs to `config.train.steps` (or stops after step `stop_at`, as a preempted run would).

    Returns the run summary, also written to WORKDIR/summary.json. Each step's finiteness is
    fetched one step late (while the next step runs), and before every log and save, so the
    check adds no device sync; `train.on_nonfinite` then stops, skips or rolls back.
    """
    cfg, t, hooks = self.config, self.config.train, self.hooks
    is_main = jax.process_index() == 0
    os.makedirs(self.workdir, exist_ok=True)
    hooks.start(self.workdir)
    # Spans of this rank's loop (WORKDIR/timeline) and the profiler window: resilience/.
    tl = self.timeline = timeline_lib.start_for_trainer(self.workdir, self.mesh, hooks,
                                                        enabled=t.timeline)
    profiler = ProfilerWindow(t.profile_steps, t.steps, self.workdir, jax.process_index(), tl)
    hooks.phase(events.RESTORING)
    tl.phase("restore")
    state, start = self.restore_or_init()
    writer = _MetricsWriter(self.workdir, enabled=is_main, resume_step=start)
    hooks.phase(events.COMPILING)
    tl.phase("compile")
    compile_start = time.perf_counter()
    with jax.set_mesh(self.mesh):
      first = self.device_batch(next(self.train_iter))
      train_step, loaded = compile_cache.compile_or_load(
          self._train_step.lower(state, first, jnp.float32(1.0)), "train_step", self.mesh.size)
    compile_s = time.perf_counter() - compile_start
    log.info("%s the train step in %.1f s", "loaded" if loaded else "compiled", compile_s)
    hooks.phase(events.TRAINING)
    history, timed = [], []   # timed: (steps, seconds) of each logged interval
    self.nonfinite_steps, self.rollbacks = [], 0
    bar = tqdm(total=t.steps, initial=start, desc="train", unit="step", dynamic_ncols=True,
               disable=(None if is_main else True) if self.show_progress is None
               else not self.show_progress)
    interval_start, interval_steps = time.perf_counter(), 0
    end = t.steps if stop_at is None else min(stop_at, t.steps)
    # The batch the step was compiled with is the first step's batch.
    step, batch, unchecked = start, first, []
    data_pos = self.train_iter.get_state()["step"]   # global batches taken so far
    try:
      while step < end:
        done = step + 1
        hooks.injector.before_step(done)
        profiler.before_step(done)
        tl.phase("data_wait", done)
        wait_start = time.perf_counter()
        if batch is None:
          rows = next(self.train_iter)
          tl.phase("host_to_device")
          batch = self.device_batch(rows)
          data_pos += 1
        data_wait = time.perf_counter() - wait_start
        tl.phase("dispatch")
        with jax.set_mesh(self.mesh):
          state, metrics = train_step(state, batch, jnp.float32(hooks.injector.loss_scale(done)))
        tl.phase("host")
        profiler.after_step(done, metrics)
        batch = None
        interval_steps += 1
        logged = done % t.log_every == 0 or done == end or done == start + 1
        saving = done % t.checkpoint_every == 0 or done == end
        unchecked.append((done, metrics, data_wait, data_pos))
        # Check the steps before this one now, this one too if it is logged or saved.
        checks, unchecked = (unchecked, []) if logged or saving else (unchecked[:-1],
                                                                      unchecked[-1:])
        bad = self._check(checks)
        if bad is not None and t.on_nonfinite == "rollback":
          state, step = self._rollback(bad, writer, history)
          data_pos = bad[1]
          bar.n = step
          unchecked, interval_steps, interval_start = [], 0, time.perf_counter()
          continue
        if logged:
          tl.phase("log")
          record = self._log(state, metrics, done, interval_steps, interval_start,
                             self.peak.flops)
          history.append(record)
          timed.append((interval_steps, interval_steps * record["step_time_s"]))
          writer.write(record)
          bar.set_postfix(loss=f"{record['loss']:.3f}", tok_s=f"{record['tokens_per_s']:,.0f}",
                          mfu=f"{100 * record['mfu']:.2f}%")
          if is_main:
            bar.write(_format_record(record, t.steps))
          interval_steps = 0
        if saving:
          hooks.phase(events.CHECKPOINTING)
          tl.phase("checkpoint_stall")
          self.checkpointer.save(done, state, self.train_iter.get_state(), cfg,
                                 layer_layout=self.layer_layout)
          tl.checkpoint_saved(self.checkpointer.saves[-1])
          hooks.injector.after_save_started(done)
          hooks.phase(events.TRAINING)
        tl.phase("host")
        if interval_steps == 0:
          # Evaluation and checkpoint saves fall on logged steps (validate() ensures it), so
          # restarting the clock here keeps them out of the throughput.
          interval_start = time.perf_counter()
        bar.update(1)
        step = done
    finally:
      profiler.stop()
      bar.close()
      self.checkpointer.close()
      tl.close()
      writer.close()
      self.train_iter.close()
    summary = self._summary(history, timed, compile_s, start)
    if is_main:
      with open(os.path.join(self.workdir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    hooks.close()
    self.final_state = state
    return summary

  def _check(self, checks) -> tuple[int, int] | None:
    """Fetches the finiteness of `checks` [(step, metrics, data wait, data position)].

    Reports progress; returns (step, data position after its batch) of the first non-finite
    step (policy 'stop' raises NonFiniteError instead), or None.
    """
    policy = self.config.train.on_nonfinite
    for done, metrics, data_wait, data_pos in checks:
      self.timeline.phase("sync")
      finite, loss, grad_norm = jax.device_get(
          (metrics["finite"], metrics["loss"], metrics["grad_norm"]))
      self.timeline.phase("host")
      self.hooks.progress(done, float(loss), float(grad_norm), data_wait)
      self.hooks.injector.slow_down(done)
      if finite:
        continue
      detail = f"loss {float(loss)}, gradient norm {float(grad_norm)}"
      self.nonfinite_steps.append(done)
      self.hooks.nonfinite(done)
      if policy == "stop":
        self.hooks.failure(events.NONFINITE, detail, step=done)
        raise NonFiniteError(done, detail)
      log.warning("step %d: %s; its update was not applied (%s)", done, detail, policy)
      if policy == "rollback":
        return done, data_pos
    return None

  def _rollback(self, bad: tuple[int, int], writer, history) -> tuple[dict, int]:
    """(state, step) of the latest checkpoint (or a fresh start), with the data moved past
    the offending batch; the logs of the abandoned steps are dropped."""
    bad_step, data_pos = bad
    self.checkpointer.wait()
    step = self.checkpointer.latest_step() or 0
    self.rollbacks += 1
    if self.rollbacks > MAX_ROLLBACKS:
      self.hooks.failure(events.NONFINITE, f"{self.rollbacks - 1} rollbacks", step=bad_step)
      raise NonFiniteError(bad_step, f"still non-finite after {MAX_ROLLBACKS} rollbacks")
    self.hooks.phase(events.RESTORING)
    self.timeline.phase("restore")
    if step:
      state = self._restore(step)
    else:
      state = self.init_state()
    data_state = self.train_iter.get_state()
    self.train_iter.set_state({**data_state, "step": data_pos})
    log.warning("rolled back to step %d; the data goes on after step %d's batch",
                step, bad_step)
    writer.rewind(step)
    history[:] = [r for r in history if r["step"] <= step]
    self.hooks.rewind(step)
    self.hooks.phase(events.TRAINING)
    return state, step

  def _log(self, state, metrics, step: int, steps: int, since: float, peak: float) -> dict:
    """The record of one logged step: metrics of `step`, throughput of the `steps` since `since`.

    Fetching the metrics waits for the step to finish, so the interval is timed after it.
    """
    metrics = jax.device_get(metrics)
    elapsed = time.perf_counter() - since
    tokens_per_s = steps * self.config.train.global_batch * self.config.model.seq_len / elapsed
    record = {"step": step, "loss": float(metrics["loss"]),
              "grad_norm": float(metrics["grad_norm"]),
              "learning_rate": float(metrics["learning_rate"]),
              "step_time_s": elapsed / steps, "tokens_per_s": tokens_per_s,
              "mfu": tokens_per_s * self.flops_per_token / peak, "time": time.time()}
    t = self.config.train
    if step % t.eval_every == 0 or step == t.steps:
      self.hooks.phase(events.EVALUATING)
      self.timeline.phase("eval")
      record["eval_loss"] = self.evaluate(state["params"])
      self.hooks.phase(events.TRAINING)
    return record

  def _summary(self, history, timed, compile_s: float, start: int) -> dict:
    # The first logged interval (one step, right after compilation) is warm-up: leave it out.
    steady = timed[1:] or timed
    tokens_per_step = self.config.train.global_batch * self.config.model.seq_len
    mean_tps = (sum(n for n, _ in steady) * tokens_per_step / sum(t for _, t in steady)
                if steady else 0.0)
    peak = self.peak
    evals = [r["eval_loss"] for r in history if "eval_loss" in r]
    return {
        "config": self.config.name,
        "devices": f"{len(self.devices)} x {self.devices[0].device_kind}",
        "mesh": dict(self.mesh.shape),
        "num_params": self.num_params,
        "start_step": start,
        "steps": self.config.train.steps,
        "first_loss": history[0]["loss"] if history else None,
        "last_loss": history[-1]["loss"] if history else None,
        "last_eval_loss": evals[-1] if evals else None,
        "mean_tokens_per_s": mean_tps,
        "flops_per_token": self.flops_per_token,
        "flops_formula": "Megatron-LM: 72 l h^2 (1 + s/(6h) + V/(16 l h)), no recomputation "
                         "(mscale_jax.flops.model_flops_per_token)" + (
                             "; the pipeline's backward recomputes each chunk's forward, "
                             "work this count leaves out" if self.layer_layout[0] > 1 else ""),
        "mfu": mean_tps * self.flops_per_token / peak.flops,
        "peak_flops": peak.flops,
        "peak_source": peak.source,
        "compile_s": compile_s,
        "data": self.corpus.description,
        "workdir": self.workdir,
        "metrics": os.path.join(self.workdir, "metrics.jsonl"),
        "tensorboard": os.path.join(self.workdir, "tensorboard"),
        "checkpoints": self.checkpointer.directory,
        "nonfinite_steps": self.nonfinite_steps,
        "on_nonfinite": self.config.train.on_nonfinite,
        "rollbacks": self.rollbacks,
        # Per save: seconds the loop was blocked, then seconds of background write.
        "checkpoint_saves": self.checkpointer.saves,
        "restore_s": self.checkpointer.restore_s,
    }


def _format_record(r: dict, total: int) -> str:
  line = (f"step {r['step']:>6}/{total}  loss {r['loss']:.4f}  gnorm {r['grad_norm']:.3f}  "
          f"lr {r['learning_rate']:.2e}  {1e3 * r['step_time_s']:.0f} ms/step  "
          f"{r['tokens_per_s']:,.0f} tok/s  MFU {100 * r['mfu']:.2f}%")
  if "eval_loss" in r:
    line += f"  eval {r['eval_loss']:.4f}"
  return line


class _MetricsWriter:
  """metrics.jsonl (one JSON object per logged step) and TensorBoard scalars.

  A run resumed (or rolled back) at step N replays the steps after N: their records from the
  lost run are dropped from metrics.jsonl, and TensorBoard is told to purge events from step
  N + 1 on, so each step appears once.
  """

  def __init__(self, workdir: str, enabled: bool, resume_step: int = 0):
    self.enabled = enabled
    self.workdir = workdir
    if enabled:
      self._open(resume_step)

  def _open(self, resume_step: int) -> None:
    from tensorboardX import SummaryWriter
    path = os.path.join(self.workdir, "metrics.jsonl")
    if os.path.exists(path):
      with open(path) as f:
        kept = [line for line in f if _step_of(line) <= resume_step]
      with open(path + ".tmp", "w") as f:
        f.writelines(kept)
      os.replace(path + ".tmp", path)
    self._jsonl = open(path, "a")
    self._tb = SummaryWriter(os.path.join(self.workdir, "tensorboard"),
                             purge_step=resume_step + 1 if resume_step else None)

  def rewind(self, step: int) -> None:
    """Forgets every record after `step` (the run went back there)."""
    if self.enabled:
      self.close()
      self._open(step)

  def write(self, record: dict) -> None:
    if not self.enabled:
      return
    self._jsonl.write(json.dumps(record) + "\n")
    self._jsonl.flush()
    for key, value in record.items():
      if key != "step":
        self._tb.add_scalar(key, value, record["step"])

  def close(self) -> None:
    if self.enabled:
      self._jsonl.close()
      self._tb.close()


def _step_of(line: str) -> float:
  """The step of a metrics.jsonl line; infinity for a torn line (a kill mid-write)."""
  try:
    return json.loads(line)["step"]
  except (ValueError, KeyError):
    return float("inf")
