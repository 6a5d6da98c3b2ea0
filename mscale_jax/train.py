"""The Trainer: sharded init or exact resume, the compiled train step, evaluation, and the loop.

`Trainer.train` is the loop on one screen: take a batch, dispatch the step, fetch the step
before it (one step late, so the check adds no device sync), log, save. What happens around
those points is callbacks (mscale_jax/callbacks/): the standard ones write metrics.jsonl,
TensorBoard and the console, checkpoint, record the timeline and the profiler window; more can
be passed in (heartbeats and fault injection under the driver; anything an experiment needs).
The step itself is `mscale_jax/step.py`; the non-finite policy is `callbacks/nonfinite.py`.
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

from mscale_jax import compile_cache
from mscale_jax import data as data_lib
from mscale_jax import flops as flops_lib
from mscale_jax import mesh as mesh_lib
from mscale_jax import optim
from mscale_jax import step as step_lib
from mscale_jax.callbacks import nonfinite
from mscale_jax.callbacks.base import Callbacks, Checked, Pending, Run
from mscale_jax.callbacks.checkpointing import Checkpointing
from mscale_jax.callbacks.metrics import MetricsFile, ProgressBar, TensorBoard
from mscale_jax.callbacks.observability import Profiler, StackDump, TimelineRecorder
from mscale_jax.checkpoint import Checkpointer, abstract_like
from mscale_jax.config import Config, validate
from mscale_jax.model import GPT, abstract_model, count_params
from mscale_jax.parallel import pipeline
from mscale_jax.sdp4bit.data_parallel import DataParallel

log = logging.getLogger("mscale_jax")

# MSCALE_OVERLAPPED_RESTORE=1: a resuming process loads its train step beside the restore, not
# after it. Off by default: on the 2-core CPU host it showed no gain (restore and load both take
# the host's CPU; results/restart_cost-overlapped_restore-*); experiments.restart_cost
# --compare=overlapped_restore measures it on a host with cores to spare.
OVERLAP_SWITCH = "MSCALE_OVERLAPPED_RESTORE"


@dataclasses.dataclass(frozen=True)
class Peak:
  """The FLOP/s that MFU divides by, and where the number comes from."""
  flops: float
  source: str


def program_recipe(config: Config) -> str:
  """What the train and eval steps are built from besides the source and their inputs (the
  compile cache's pre-key): the resolved config, every field."""
  return json.dumps(config.to_dict(), sort_keys=True, default=repr)


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
  checked in the constructor, before anything compiles (ConfigError). `callbacks` run after the
  standard ones (`standard_callbacks`); `attempt` is which (re)start of a supervised job this
  process is (it names the timeline's and the stack dump's files).
  """

  def __init__(self, config: Config, workdir: str, *, devices=None, show_progress=None,
               callbacks=(), attempt: int = 0):
    self.config = config
    self.workdir = os.path.abspath(workdir)
    self.devices = list(devices if devices is not None else jax.devices())
    self.show_progress = show_progress
    self.callbacks = list(callbacks)
    self.attempt = attempt
    self.process_index = jax.process_index()
    self.is_main = self.process_index == 0
    mesh_shape = validate(config, len(self.devices), platform=self.devices[0].platform)
    self.mesh = mesh_lib.make_mesh(mesh_shape, self.devices)
    # Block parameters are stored in the pipeline's layer order (identity without one).
    stages = mesh_shape["stage"]
    self.layer_layout = (stages, config.pipeline.virtual_stages if stages > 1 else 1)
    # Where a compile cache folder is configured (the driver gives its workers one, which
    # restarts reuse), the stdlib corpus's tokens are kept beside it: a restarted process
    # does not read ~1,800 files again.
    cache = jax.config.jax_compilation_cache_dir
    self.corpus = data_lib.load_corpus(config.data, config.model.vocab_size,
                                       cache_dir=cache and os.path.join(cache, "corpus"))
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
    # SDP4Bit: quantized data-parallel collectives and the reference weights they need.
    self.data_parallel = None
    if config.optimizer.dp_comm == "sdp4bit":
      self.data_parallel = DataParallel(config.optimizer.sdp4bit, names)
      self.state_shardings["reference"] = self.data_parallel.reference_shardings(
          param_shardings)
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
    gradients = step_lib.make_gradients(self.graphdef, config.pipeline, self.layer_layout,
                                        self.data_parallel)
    gather = {} if self.data_parallel is None else {"gather": self.data_parallel.gather}
    self._train_step = jax.jit(
        functools.partial(step_lib.train_step, gradients=gradients, tx=self.tx,
                          schedule=self.schedule, **gather),
        donate_argnums=0, out_shardings=(self.state_shardings, None))
    self._eval_loss = jax.jit(step_lib.make_loss(self.graphdef, config.pipeline,
                                                 self.layer_layout))
    self._eval_executable = None
    self._abstract_state = None
    self.program_recipe = program_recipe(config)
    self.nonfinite_policy = nonfinite.policy(t.on_nonfinite)

  def standard_callbacks(self) -> list:
    """What every run has: the profiler window, checkpoints, the timeline (unless
    train.timeline is off), the stack dump, metrics.jsonl, TensorBoard and the progress bar."""
    timeline = [TimelineRecorder(self.attempt)] if self.config.train.timeline else []
    return [Profiler(), Checkpointing(), *timeline, StackDump(self.attempt), MetricsFile(),
            TensorBoard(), ProgressBar(self.show_progress)]

  # -- state ---------------------------------------------------------------------------------

  def _fresh_state(self):
    with nnx.use_eager_sharding(False):
      model = GPT(self.config.model, rngs=nnx.Rngs(self.config.train.seed))
    params = self._pipeline_order(nnx.to_pure_dict(nnx.state(model, nnx.Param)))
    state = {"step": jnp.zeros((), jnp.int32), "params": params,
             "opt_state": self.tx.init(params)}
    if self.data_parallel is not None:
      state["reference"] = params        # every rank starts from the exact weights
    return state

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
    state = self.restore(step)
    log.info("resumed from %s at step %d", self.checkpointer.directory, step)
    return state, int(step)

  def abstract_state(self):
    """The train state's shapes, dtypes and shardings (`jax.ShapeDtypeStruct`s), untraced
    after the first call."""
    if self._abstract_state is None:
      with jax.set_mesh(self.mesh):
        self._abstract_state = jax.eval_shape(self._fresh_state)
    return abstract_like(self._abstract_state, self.state_shardings)

  def restore(self, step: int):
    """Checkpoint `step` in this run's sharding and pipeline layer order."""
    target = self.abstract_state()
    saved_reference = self.checkpointer.dp_comm(step) == "sdp4bit"
    if saved_reference and "reference" not in target:      # written with SDP4Bit: drop it
      target["reference"] = target["params"]
    elif not saved_reference:                               # written without: start exact
      target.pop("reference", None)
    state = self.checkpointer.restore(step, target)
    if self.data_parallel is None:
      state.pop("reference", None)
    elif not saved_reference:
      with jax.set_mesh(self.mesh):
        state["reference"] = jax.jit(lambda p: p, out_shardings=self.state_shardings[
            "reference"])(state["params"])
      log.info("checkpoint written with optimizer.dp_comm='none': SDP4Bit's reference "
               "weights start as its parameters")
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

  # -- steps ---------------------------------------------------------------------------------

  def device_batch(self, batch: dict[str, np.ndarray]) -> dict[str, jax.Array]:
    """This process's rows -> global arrays sharded over (data, fsdp)."""
    return {key: jax.make_array_from_process_local_data(
                self.batch_sharding, value, (value.shape[0] * self._row_shards,) + value.shape[1:])
            for key, value in batch.items()}

  def train_step(self, state, batch):
    """One step on this process's rows `batch` (the jitted program; no loop around it)."""
    with jax.set_mesh(self.mesh):
      return self._train_step(state, self.device_batch(batch))

  def lower_step(self, state, batch):
    """The train step lowered for `state` and the global `batch` (what the loop compiles)."""
    with jax.set_mesh(self.mesh):
      return self._train_step.lower(state, batch)

  def evaluate(self, params) -> float:
    """Mean loss over the fixed held-out batches."""
    with jax.set_mesh(self.mesh):
      batches = [self.device_batch(b) for b in self.eval_batches]
      if self._eval_executable is None:
        self._eval_executable, _ = compile_cache.load_or_lower(
            self._eval_loss.lower, (params, batches[0]), "eval_loss", self.mesh,
            self.program_recipe)
      losses = [self._eval_executable(params, b) for b in batches]
    return float(np.mean([float(x) for x in losses]))

  # -- the loop ------------------------------------------------------------------------------

  def train(self, stop_at: int | None = None) -> dict:
    """Runs to `config.train.steps` (or stops after step `stop_at`, as a preempted run would).

    Returns the run summary, also written to WORKDIR/summary.json. Each step's finiteness is
    fetched one step late (while the next step runs), and before every log and save, so the
    check adds no device sync; the non-finite policy then stops, skips or rolls back.
    """
    t = self.config.train
    run = Run(self, Callbacks(self.standard_callbacks() + self.callbacks),
              end=t.steps if stop_at is None else min(stop_at, t.steps))
    try:
      step_program = self._start(run)
      while run.step < run.end:
        step = run.step + 1
        run.callbacks.on_step_start(run, step)     # fault points, profiler window
        batch, data_wait = self._next_batch(run, step)
        run.phase("dispatch")
        with jax.set_mesh(self.mesh):
          run.state, metrics = step_program(run.state, batch)
        run.phase("host")
        run.callbacks.on_step_dispatched(run, step, metrics)
        run.interval_steps += 1
        logged = step % t.log_every == 0 or step == run.end or step == run.start + 1
        saving = step % t.checkpoint_every == 0 or step == run.end
        run.pending.append(Pending(step, metrics, data_wait, run.data_pos))
        # The steps before this one are fetched now; this one too if it is logged or saved.
        if self._check(run, through_last=logged or saving):
          continue                                   # the policy rolled back
        if logged:
          self._log(run, step, metrics)
        if saving:
          run.phase("checkpoint_stall")
          run.callbacks.on_save(run, step)
        run.phase("host")
        if logged:
          # Evaluation and saves fall on logged steps (validate() ensures it): restarting the
          # clock after them keeps them out of the throughput.
          run.restart_interval()
        run.step = step
    except BaseException as error:
      run.callbacks.on_error(run, error)
      raise
    finally:
      run.callbacks.on_loop_end(run)
      self.train_iter.close()
    summary = self._summary(run)
    if self.is_main:
      with open(os.path.join(self.workdir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    run.callbacks.on_run_end(run, summary)
    self.final_state = run.state
    return summary

  def _start(self, run: Run):
    """Restores (or creates) the state and gets the step's executable for the first batch
    (compiled, or loaded from the compile cache); returns the executable.

    With MSCALE_OVERLAPPED_RESTORE=1 a resuming process loads the executable on a thread of its
    own while it restores (the program needs only the state's abstract values): a restart pays
    the longer of the two, not their sum, where they do not compete for the same cores."""
    os.makedirs(self.workdir, exist_ok=True)
    run.callbacks.on_run_start(run)
    run.phase("restore")
    run.batch = self.device_batch(next(self.train_iter))   # the first step's batch
    loading = None
    if self.resume_step is not None and os.environ.get(OVERLAP_SWITCH) == "1":
      loading = compile_cache.Loading(self.lower_step, (self.abstract_state(), run.batch),
                                      "train_step", self.mesh, self.program_recipe)
    run.state, run.start = self.restore_or_init()
    run.step = run.start
    run.phase("compile")
    compile_start = time.perf_counter()
    if loading is not None:
      program, served = loading.result((run.state, run.batch))
      run.compile_s = loading.seconds
      log.info("%s the train step in %.1f s beside the restore (then waited %.1f s for it)",
               served, run.compile_s, time.perf_counter() - compile_start)
    else:   # keyed before tracing: a restarted process loads its executable without lowering
      program, served = compile_cache.load_or_lower(
          self.lower_step, (run.state, run.batch), "train_step", self.mesh,
          self.program_recipe)
      run.compile_s = time.perf_counter() - compile_start
      log.info("%s the train step in %.1f s", served, run.compile_s)
    run.data_pos = self.train_iter.get_state()["step"]   # global batches taken so far
    run.callbacks.on_loop_start(run)
    run.restart_interval()
    return program

  def _next_batch(self, run: Run, step: int):
    """(the step's global batch, seconds waited for it): the compile's batch first."""
    run.phase("data_wait", step)
    wait_start = time.perf_counter()
    if run.batch is None:
      rows = next(self.train_iter)
      run.phase("host_to_device")
      run.batch = self.device_batch(rows)
      run.data_pos += 1
    batch, run.batch = run.batch, None
    return batch, time.perf_counter() - wait_start

  def _check(self, run: Run, through_last: bool) -> bool:
    """Fetches the pending steps' results (all, or all but the newest), tells the callbacks,
    and hands a non-finite one to the policy; True if the policy rewound the run."""
    checks = run.pending if through_last else run.pending[:-1]
    run.pending = [] if through_last else run.pending[-1:]
    rewinds = run.rewinds
    for p in checks:
      run.phase("sync")
      finite, loss, grad_norm = jax.device_get(
          (p.metrics["finite"], p.metrics["loss"], p.metrics["grad_norm"]))
      run.phase("host")
      checked = Checked(p.step, float(loss), float(grad_norm), bool(finite), p.data_wait_s,
                        p.data_pos)
      if not checked.finite:
        run.nonfinite_steps.append(p.step)
      run.callbacks.on_step_checked(run, checked)
      if not checked.finite:
        self.nonfinite_policy.handle(run, checked)
        if run.rewinds != rewinds:
          return True
    return False

  def _log(self, run: Run, step: int, metrics) -> None:
    """The record of logged step `step`: its metrics, the throughput of the interval that
    ends with it, and the held-out loss when due; handed to the callbacks (`on_log`).

    Fetching the metrics waits for the step to finish, so the interval is timed after it.
    """
    run.phase("log")
    metrics = jax.device_get(metrics)
    steps, elapsed = run.interval_steps, time.perf_counter() - run.interval_start
    tokens_per_s = steps * self.config.train.global_batch * self.config.model.seq_len / elapsed
    record = {"step": step, "loss": float(metrics["loss"]),
              "grad_norm": float(metrics["grad_norm"]),
              "learning_rate": float(metrics["learning_rate"]),
              "step_time_s": elapsed / steps, "tokens_per_s": tokens_per_s,
              "mfu": tokens_per_s * self.flops_per_token / self.peak.flops, "time": time.time()}
    t = self.config.train
    if step % t.eval_every == 0 or step == t.steps:
      run.phase("eval")
      record["eval_loss"] = self.evaluate(run.state["params"])
      run.phase("log")
    run.history.append(record)
    run.timed.append((steps, steps * record["step_time_s"]))
    run.callbacks.on_log(run, record)

  def _summary(self, run: Run) -> dict:
    # The first logged interval (one step, right after compilation) is warm-up: leave it out.
    steady = run.timed[1:] or run.timed
    tokens_per_step = self.config.train.global_batch * self.config.model.seq_len
    mean_tps = (sum(n for n, _ in steady) * tokens_per_step / sum(t for _, t in steady)
                if steady else 0.0)
    peak, history = self.peak, run.history
    evals = [r["eval_loss"] for r in history if "eval_loss" in r]
    return {
        "config": self.config.name,
        "devices": f"{len(self.devices)} x {self.devices[0].device_kind}",
        "mesh": dict(self.mesh.shape),
        "num_params": self.num_params,
        "start_step": run.start,
        "steps": self.config.train.steps,
        "first_loss": history[0]["loss"] if history else None,
        "last_loss": history[-1]["loss"] if history else None,
        "last_eval_loss": evals[-1] if evals else None,
        "mean_tokens_per_s": mean_tps,
        "flops_per_token": self.flops_per_token,
        "flops_formula": "Megatron-LM: 72 l h^2 (1 + s/(6h) + V/(16 l h)), no recomputation "
                         "(mscale_jax.flops.model_flops_per_token)" + (
                             "; the pipeline's backward recomputes (pipeline.recompute="
                             f"{self.config.pipeline.recompute!r}), work this count leaves "
                             "out" if self.layer_layout[0] > 1
                             and self.config.pipeline.recompute != "none" else ""),
        "mfu": mean_tps * self.flops_per_token / peak.flops,
        "peak_flops": peak.flops,
        "peak_source": peak.source,
        "compile_s": run.compile_s,
        "data": self.corpus.description,
        "workdir": self.workdir,
        "metrics": os.path.join(self.workdir, "metrics.jsonl"),
        "tensorboard": os.path.join(self.workdir, "tensorboard"),
        "checkpoints": self.checkpointer.directory,
        "nonfinite_steps": run.nonfinite_steps,
        "on_nonfinite": self.config.train.on_nonfinite,
        "rollbacks": run.rollbacks,
        # Per save: seconds the loop was blocked, then seconds of background write.
        "checkpoint_saves": self.checkpointer.saves,
        "refused_saves": run.refused_saves,   # dropped, training went on
        "restore_s": self.checkpointer.restore_s,
    }
