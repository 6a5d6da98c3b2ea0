"""Checkpoints with orbax: asynchronous, atomic, kept K deep, restorable into another mesh.

A checkpoint at step N holds three items:
  state  the train state pytree {step, params, opt_state} (and SDP4Bit's reference weights)
         (sharded arrays);
  data   the data iterator's state (JSON), so a resumed run sees the same batches;
  meta   the model and optimizer configs (JSON), so resuming a different model shape or
         optimizer fails clearly.

Saves run in the background: `save` holds the loop only while every process agrees that it can
start and the state is copied into fresh device buffers (one dispatched copy: the next step may
donate the originals); orbax's synchronous part (its directories and barriers, the
device-to-host copy of that copy) runs on a launch thread and its write in orbax's threads.
(Orbax's barriers go through jax.distributed, not compiled programs, so a launch thread never
runs a collective program beside the loop's.) The copy holds one more state's device memory
for the launch (~0.3 s on the main job). Orbax writes into a temporary directory and renames it
when complete, so a run killed mid-save leaves the previous checkpoint as the latest; leftover
temporary directories are removed on the next start.

When a save's files are written, process 0 adds a checksum manifest to its folder
(`files.write_manifest`: size and SHA-256 of every file of its items) before orbax commits it.
On start, a checkpoint whose files no longer match their manifest (bit rot, a bad disk, a torn
copy) is set aside into WORKDIR/checkpoints_corrupt/ with a warning (`files.set_aside_corrupt`),
and the previous complete one becomes the latest: nothing is deleted, nothing corrupt restored.
A save that cannot be written (a read-only or full disk) raises `CheckpointWriteError` naming
the step, the folder and the checkpoint that stays the latest; orbax's temporary folder never
counts as a checkpoint, and `discard` removes it (at once, or before the next save where the
folder still refuses changes). Every process agrees whether a save can start (`_agree`), so
that none enters orbax's collective save alone.

Every save's two stages are timed (MegaScale's two-stage checkpointing): `stall_s`, how long
`save` held the training loop (agreement and device copy, and waiting for a previous save still
being written), and `write_s`, how long the background write took after that; `parts` splits
them (`STALL_PARTS`). Restores are timed too.
"""
import dataclasses
import glob
import hashlib
import logging
import os
import shutil
import threading
import time

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp

from mscale_jax.checkpoint_barriers import Barriers
from mscale_jax.config import Config
from mscale_jax.errors import ConfigError
from mscale_jax.files import can_write, checkpoint_steps, set_aside_corrupt, write_manifest

log = logging.getLogger("mscale_jax")

# Off GPU, orbax splits every replicated shard among its replicas and slices each piece on the
# device, one dispatched op per piece: hundreds per save of the main job, which held the loop
# several times longer than the copy itself. Splitting pays only for large pieces, so it stays
# on for those (MIN_REPLICA_PARALLEL_BYTES and up). Orbax's handler registry is process-wide.
MIN_REPLICA_PARALLEL_BYTES = 4 << 20
ocp.type_handlers.register_type_handler(
    jax.Array, ocp.type_handlers.ArrayHandler(
        min_slice_bytes_for_replica_parallel=MIN_REPLICA_PARALLEL_BYTES), override=True)


ITEMS = ("state", "data", "meta")

# Where a save's time goes (`Checkpointer.saves[i]['parts']`, seconds). On the loop: waiting for
# the previous save's write, the write probe and every process's agreement, and (asynchronous
# saves) copying the state into fresh device buffers and starting the launch thread. On that
# launch thread, off the loop (asynchronous saves; on the loop for synchronous ones): the
# save's `verify` (the replica check's verdict), then orbax's synchronous part, of which (as
# orbax reports them through jax.monitoring, on the thread making the save) its barriers
# between processes and the device-to-host copy.
STALL_PARTS = ("wait_previous_s", "agree_s", "copy_s", "verify_s", "orbax_s",
               "orbax_barriers_s", "orbax_d2h_s")
_ORBAX_EVENTS = {"/jax/checkpoint/sync_global_devices_duration_sec": "orbax_barriers_s",
                 "/jax/orbax/write/blocking_d2h_duration_secs": "orbax_d2h_s"}
_saving = threading.local()   # .parts: the parts of the save this thread is making


def _on_orbax_event(event: str, duration: float, **kwargs) -> None:
  parts = getattr(_saving, "parts", None)
  if parts is not None and event in _ORBAX_EVENTS:
    parts[_ORBAX_EVENTS[event]] += duration


jax.monitoring.register_event_duration_secs_listener(_on_orbax_event)

# The state in fresh device buffers, laid out as it is: one dispatched program (a few ms on the
# main job, where a non-aliasing `jax.device_put` took ~20 ms, one transfer per array).
_device_copy = jax.jit(lambda tree: jax.tree.map(jnp.copy, tree))


class CheckpointWriteError(RuntimeError):
  """A checkpoint could not be written; the previous complete one stays the latest."""

  def __init__(self, message: str, step: int | None = None):
    super().__init__(message)
    self.step = step


TMP_MARK = ".orbax-checkpoint-tmp"   # orbax's temporary folder: STEP + TMP_MARK + suffix


class Checkpointer:
  """Saves and restores train state, data-iterator state and model config under `directory`."""

  _made: dict[str, int] = {}   # directory -> Checkpointers made for it in this process

  def __init__(self, directory: str, *, keep: int = 2, async_save: bool = True):
    self.directory = os.path.abspath(directory)
    self.async_save = async_save
    self.saves: list[dict] = []        # per save: {'step', 'stall_s', 'write_s', 'parts'}
    self.restore_s: float | None = None
    self._lock = threading.Lock()
    self._stalled_until = None
    self._checked_step = None          # the newest save whose write was checked
    self._refused: set[int] = set()    # refused saves whose temporary folder may remain
    self._probes = 0                   # saves started (names the processes' agreement)
    self._launch = None                # the newest async save's launch thread (`save`)
    self._launch_error = None          # (step, error, refused by orbax) if that save stopped
    # Names of this Checkpointer's keys in jax.distributed's key-value store: its folder and
    # how many Checkpointers of that folder this process made before (the same everywhere).
    made = Checkpointer._made[self.directory] = Checkpointer._made.get(self.directory, 0) + 1
    folder_id = hashlib.sha256(self.directory.encode()).hexdigest()[:16]
    self._kv_prefix = f"mscale_checkpointer/{folder_id}/{made}"
    self._barriers = Barriers(self._kv_prefix) if jax.process_count() > 1 else None
    os.makedirs(self.directory, exist_ok=True)
    self.set_aside = self._check_newest()
    options = ocp.CheckpointManagerOptions(
        max_to_keep=keep, create=False, enable_async_checkpointing=async_save,
        cleanup_tmp_directories=True,
        # Naming every process active sends orbax's own barriers in `save` (five a save)
        # through jax.distributed's barrier rather than a compiled all-device program each,
        # which on a busy host held the loop for tens of ms a save (experiments/save_stall.py).
        multiprocessing_options=ocp.options.MultiprocessingOptions(
            active_processes=set(range(jax.process_count()))),
        # orbax accepts the write-finished callback only from its async checkpointer.
        # Folders are made before `save` returns, so a directory that refuses them fails the
        # save there (a failure in orbax's background mkdir leaves its threads waiting
        # minutes for a signal that never comes, holding the process at exit).
        async_options=(ocp.AsyncOptions(post_finalization_callback=self._written,
                                        create_directories_asynchronously=False,
                                        barrier_sync_fn=self._barriers)
                       if async_save else None))
    self._manager = ocp.CheckpointManager(self.directory, options=options,
                                          item_names=ITEMS)

  def _check_newest(self) -> list[dict]:
    """Process 0 sets corrupt newest checkpoints aside (every process waits for it)."""
    moved = set_aside_corrupt(self.directory) if jax.process_index() == 0 else []
    for m in moved:
      log.warning("checkpoint step %d is corrupt (%s): moved to %s; the previous complete "
                  "checkpoint is restored instead", m["step"], m["problem"], m["moved_to"])
    if jax.process_count() > 1:
      from jax.experimental import multihost_utils
      multihost_utils.sync_global_devices("checkpoints checked")
    return moved

  def latest_step(self) -> int | None:
    """The newest complete checkpoint's step, or None (half-written ones do not count)."""
    return next(iter(reversed(self.all_steps())), None)

  def save(self, step: int, state, data_state: dict, config: Config, *,
           layer_layout: tuple[int, int] = (1, 1), verify=None) -> None:
    """Starts saving step `step` (returns once every process agreed and the state is copied).

    `layer_layout` (pipeline stages, virtual stages) names the order of the stacked layers
    (`parallel.pipeline.layer_order`), so another layout can restore them. How long the loop
    was held (`stall_s`) and the background write took (`write_s`) go to `self.saves`.
    A previous save still being written is waited for first: if it failed, its
    CheckpointWriteError (its step) is raised and this one is not started. `verify()`, if
    given, runs before orbax starts (on the launch thread of an asynchronous save; at once if
    the processes agree the save is refused): an error it raises (a replica check's verdict)
    stops the save, and `check` or `wait` raises it as it is; it must give every process the
    same answer, so that none starts orbax alone.
    """
    start = time.perf_counter()
    parts = dict.fromkeys(STALL_PARTS, 0.0)
    self.wait()
    self._remove_refused()
    waited = time.perf_counter()
    try:
      self._agree(can_write(self.directory))
    except Exception as e:
      if verify is not None:   # the replica check's verdict first: it names this step
        verify()
      raise self._write_error(step, e) from e
    agreed = time.perf_counter()
    parts.update(wait_previous_s=waited - start, agree_s=agreed - waited)
    if self._barriers is not None:
      self._barriers.save = self._probes
    entry = {"step": step, "stall_s": None, "write_s": None if self.async_save else 0.0,
             "parts": parts}
    if self.async_save:   # orbax's synchronous part runs on a copy, off the loop
      state = _device_copy(state)
      with self._lock:
        self.saves.append(entry)
        self._stalled_until = time.perf_counter()
      self._launch = threading.Thread(target=self._launch_save, name=f"checkpoint-{step}",
                                      args=(step, state, data_state, config, layer_layout,
                                            parts, verify), daemon=True)
      self._launch.start()
      parts["copy_s"] = time.perf_counter() - agreed
    else:
      if verify is not None:
        verify()
      try:
        self._orbax_save(step, state, data_state, config, layer_layout, parts)
      except Exception as e:
        raise self._write_error(step, e) from e
      self._manifest(step)
      with self._lock:
        self.saves.append(entry)
    entry["stall_s"] = time.perf_counter() - start

  def _orbax_save(self, step, state, data_state, config, layer_layout, parts) -> None:
    """Orbax's synchronous part of the save (directories, barriers, device-to-host copy),
    timed into `parts`."""
    start = time.perf_counter()
    _saving.parts = parts
    try:
      self._save(step, state, data_state, config, layer_layout)
    finally:
      _saving.parts = None
      parts["orbax_s"] = time.perf_counter() - start

  def _launch_save(self, step, state, data_state, config, layer_layout, parts,
                   verify) -> None:
    """The launch thread of an asynchronous save: `verify`, then orbax's synchronous part, on
    a copy of the state that the loop does not donate; a failure is reported by `check` or
    `wait`."""
    if verify is not None:
      start = time.perf_counter()
      try:
        verify()
      except Exception as e:   # noqa: BLE001 (raised as it is on the loop's thread)
        self._launch_error = (step, e, False)
        return
      finally:
        parts["verify_s"] = time.perf_counter() - start
    try:   # orbax raises a failed write's error once in every thread that waits for it; the
      self._manager.wait_until_finished()   # loop's thread reported it already (`save`)
    except Exception:   # noqa: BLE001
      pass
    try:
      self._orbax_save(step, state, data_state, config, layer_layout, parts)
    except Exception as e:   # noqa: BLE001 (reported on the loop's thread)
      self._launch_error = (step, e, True)

  def launched(self) -> None:
    """Waits for the newest save's launch thread (tens of ms after `save` returned): orbax has
    then started that save's write, or refused it (reported by `check` or `wait`). Orbax's
    manager is used by one thread at a time."""
    if self._launch is not None:
      self._launch.join()
      self._launch = None

  def _join_launch(self) -> None:
    """`launched`, then CheckpointWriteError if orbax refused to start that save."""
    self.launched()
    if self._launch_error is not None:
      (step, error, refused), self._launch_error = self._launch_error, None
      self._checked_step = step   # reported here, not again by `_check_newest_written`
      if not refused:
        raise error
      raise self._write_error(step, error) from error

  def _agree(self, problem: str) -> None:
    """Raises OSError unless every process can write (`problem` is this one's, '' if none).

    Orbax's save waits at barriers for every process, so a process that gave up alone would
    leave its peers there; the answers go through jax.distributed's key-value store (no
    compiled program), each read as soon as it is there (a blocking read, not a poll)."""
    self._probes += 1
    if jax.process_count() > 1:
      folder = f"{self._kv_prefix}/probe/{self._probes}/"
      client = ocp.multihost.get_jax_distributed_client()
      client.key_value_set(f"{folder}{jax.process_index()}", problem or "ok")
      answers = [client.blocking_key_value_get(f"{folder}{i}", 300_000)
                 for i in range(jax.process_count())]
      problem = next((f"process {i}: {a}" for i, a in enumerate(answers) if a != "ok"), "")
    if problem:
      raise OSError(problem)

  def discard(self, step: int) -> None:
    """Drops refused save `step`: its temporary folder goes (process 0, which renames it; now
    or before the next save, where the directory still refuses changes), the previous
    complete checkpoint stays the latest. (An old checkpoint orbax could not delete while the
    directory refused changes stays, complete; orbax's list is not re-read: that takes a
    barrier of every process, which may find the refusal steps apart. `all_steps` and
    `latest_step` list only the steps on disk.)"""
    self.launched()
    if self._launch_error is not None and self._launch_error[0] == step:
      self._launch_error = None
    self._refused.add(step)
    if self._barriers is not None:   # peers still waiting in its barriers go on
      self._barriers.give_up()
    # Orbax drops a failed save from its list only where its own thread failed; elsewhere the
    # step would stay listed, and orbax would refuse to save that step again (a rollback).
    listed = getattr(self._manager, "_checkpoints", None)   # orbax 0.12-0.13's own list
    if listed is not None:
      listed.delete_if(lambda info: info.step == step)
    self._remove_refused()

  def _remove_refused(self) -> None:
    if jax.process_index() != 0:
      self._refused.clear()
      return
    for step in sorted(self._refused):
      for path in glob.glob(os.path.join(self.directory, f"{step}{TMP_MARK}*")):
        shutil.rmtree(path, ignore_errors=True)
      if not glob.glob(os.path.join(self.directory, f"{step}{TMP_MARK}*")):
        self._refused.discard(step)

  def _written(self) -> None:
    """orbax's callback once the background write of the newest save is complete (process 0,
    just before orbax renames its folder). With peers, the save is given up now, so that they
    do not wait for its commit, if the directory refuses that rename, and not committed (this
    raises) if a peer gave it up: its own write failed, so its part of the checkpoint is
    missing (orbax let process 0 through the barrier after the writes only because of that)."""
    with self._lock:
      if self.saves and self.saves[-1]["write_s"] is None:
        self.saves[-1]["write_s"] = time.perf_counter() - self._stalled_until
      step = self._newest_save()
    if self._barriers is None:
      if step is not None:
        self._manifest(step)
      return
    try:
      peers = self._barriers.peers_gave_up()
      if peers:
        raise OSError(f"process(es) {peers} could not write their part of checkpoint step "
                      f"{step}: not committed")
      if step is not None:
        self._manifest(step)
    except BaseException:
      self._barriers.give_up()
      raise
    if can_write(self.directory):   # the rename orbax does next would fail
      self._barriers.give_up()

  def _manifest(self, step: int) -> None:
    """Process 0 writes the checksum manifest of checkpoint `step` once its files are written:
    into orbax's temporary folder when that is still to be renamed (an async save's callback
    runs just before the rename, so the manifest is committed with the checkpoint), else into
    the final folder."""
    if jax.process_index() != 0:
      return
    pending = glob.glob(os.path.join(self.directory, f"{step}{TMP_MARK}*"))
    final = os.path.join(self.directory, str(step))
    path = pending[0] if len(pending) == 1 else final if os.path.isdir(final) else None
    if path is not None:   # the items; orbax rewrites its own step metadata when committing
      write_manifest(path, folders=ITEMS)

  def _write_error(self, step: int | None, error: Exception) -> CheckpointWriteError:
    what = f"checkpoint step {step}" if step is not None else "a checkpoint"
    # The manager counts a save as soon as it starts; a complete one is a renamed folder.
    latest = next(iter(checkpoint_steps(self.directory)), None)
    return CheckpointWriteError(
        f"{what} could not be written under {self.directory} ({type(error).__name__}: "
        f"{error}); " + (f"the latest complete checkpoint is still step {latest}, intact: a "
                         "restart resumes from it" if latest is not None else
                         "there is no complete checkpoint yet: a restart starts afresh"), step)

  def _save(self, step: int, state, data_state: dict, config: Config,
            layer_layout: tuple[int, int]) -> None:
    self._manager.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(state),
        data=ocp.args.JsonSave(data_state),
        meta=ocp.args.JsonSave({"model": dataclasses.asdict(config.model),
                                "optimizer": dataclasses.asdict(config.optimizer),
                                "data": dataclasses.asdict(config.data),
                                "train_steps": config.train.steps,
                                "layer_layout": list(layer_layout)})))

  def check_compatible(self, step: int, config: Config) -> None:
    """Raises ConfigError if checkpoint `step` was written by another model shape or optimizer.

    A different `train.steps` is allowed (to extend a run) but changes the learning-rate
    schedule from here on, so it is logged.
    """
    meta = self.restore_meta(step)
    if meta["optimizer"]["name"] != config.optimizer.name:
      raise ConfigError("optimizer.name", config.optimizer.name,
                        f"the checkpoint in {self.directory} (step {step}) holds "
                        f"{meta['optimizer']['name']!r} state; use that optimizer or a new "
                        f"--workdir")
    if meta["train_steps"] != config.train.steps:
      log.warning("resuming a run planned for %d steps with train.steps=%d: the learning-rate "
                  "schedule changes from here on", meta["train_steps"], config.train.steps)
    saved, current = meta["model"], dataclasses.asdict(config.model)
    shape_fields = ("vocab_size", "num_layers", "hidden", "num_heads", "mlp_dim", "seq_len",
                    "mlp_activation", "norm", "positions", "use_bias", "tie_embeddings",
                    "scan_layers", "block")
    for field in shape_fields:
      if saved.get(field) != current[field]:
        raise ConfigError(f"model.{field}", current[field],
                          f"the checkpoint in {self.directory} (step {step}) was written with "
                          f"model.{field}={saved.get(field)!r}; use that value or a new "
                          f"--workdir")

  def all_steps(self) -> list[int]:
    """Steps of the complete checkpoints, oldest first: orbax's list, less the steps not on
    disk (still being written, or refused: a process other than 0 keeps a save whose commit
    process 0 refused in orbax's list, which is not re-read, see `discard`)."""
    self.launched()
    on_disk = set(checkpoint_steps(self.directory))
    return sorted(s for s in self._manager.all_steps() if s in on_disk)

  def restore_meta(self, step: int) -> dict:
    """The configs saved with `step`: {'model', 'optimizer', 'train_steps'} (and 'data')."""
    return self._manager.restore(step, args=ocp.args.Composite(
        meta=ocp.args.JsonRestore()))["meta"]

  def layer_layout(self, step: int) -> tuple[int, int]:
    """(stages, virtual stages) whose layer order checkpoint `step` holds ((1, 1): natural)."""
    return tuple(self.restore_meta(step).get("layer_layout", (1, 1)))

  def dp_comm(self, step: int) -> str:
    """optimizer.dp_comm of the run that wrote checkpoint `step` ('none' before it existed);
    'sdp4bit' checkpoints hold the reference weights too."""
    return self.restore_meta(step)["optimizer"].get("dp_comm", "none")

  def restore_data_state(self, step: int) -> dict:
    """The data iterator's state saved with `step`."""
    return self._manager.restore(step, args=ocp.args.Composite(
        data=ocp.args.JsonRestore()))["data"]

  def restore(self, step: int, abstract_state):
    """Restores the train state of `step`, laid out as `abstract_state`'s shardings say.

    `abstract_state` is a pytree of `jax.ShapeDtypeStruct`s with shardings; they may describe a
    different mesh from the one the checkpoint was saved on (orbax reshards on load).
    """
    start = time.perf_counter()
    self.launched()
    state = self._manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract_state)))["state"]
    self.restore_s = time.perf_counter() - start
    return state

  def check(self) -> None:
    """Raises CheckpointWriteError if a background write has failed since the last call
    (each failed save once, whichever of `check` and `wait` finds it first). A save's launch
    thread is joined (it has normally ended by the step after the save), so that every process
    raises its verdict or refusal at the same step, none entering the next collective alone."""
    self._join_launch()
    try:
      self._manager.check_for_errors()
    except Exception as e:
      self._report_failed(e)
    if not self._manager.is_saving_in_progress():
      self._check_newest_written()

  def wait(self) -> None:
    """Blocks until every started save is on disk (CheckpointWriteError if one failed and
    was not reported yet)."""
    self._join_launch()
    try:
      self._manager.wait_until_finished()
    except Exception as e:
      self._report_failed(e)
    self._check_newest_written()

  def _report_failed(self, error: Exception) -> None:
    """Raises orbax's `error` for the newest save, unless that save was reported already:
    orbax's finalizing thread raises its error again in the first `wait` after a `check`
    that found the checkpoint missing."""
    step = self._newest_save()
    if step is not None and step == self._checked_step:
      return
    self._checked_step = step
    raise self._write_error(step, error) from error

  def _newest_save(self) -> int | None:
    return self.saves[-1]["step"] if self.saves else None

  def _check_newest_written(self) -> None:
    """Once the newest save's background write has ended: CheckpointWriteError unless it left
    a complete checkpoint. Orbax's own finalizing thread may take a failed write's error first
    and only log it, so `check_for_errors` alone can miss one."""
    step = self._newest_save()
    if step is None or step == self._checked_step:
      return
    self._checked_step = step   # reported once
    if step not in checkpoint_steps(self.directory):
      raise self._write_error(step, RuntimeError(
          "its background write ended without a complete checkpoint; the log above says why"))

  def close(self) -> None:
    """Waits for pending saves and releases the manager's threads."""
    try:
      self.wait()
    finally:
      self._manager.close()
      self._remove_refused()


def abstract_like(tree, shardings):
  """ShapeDtypeStructs of `tree`'s leaves with the given shardings (a restore target)."""
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                      tree, shardings)
