"""Orbax's barriers between processes for our checkpoints, kept in jax.distributed's key-value
store (mscale_jax/checkpoint.py): a save whose commit fails lets the other processes go instead
of leaving them waiting minutes at orbax's next barrier."""
import collections
import time

import jax
import orbax.checkpoint as ocp


def every_process(folders: list[str], timeout_ms: int, what: str) -> dict[str, str]:
  """Waits until jax.distributed's key-value store `folders` hold, together, a key of every
  process (each key ends in its process index); returns {index: value}. Polls, backing off
  from 2 ms to 50 ms, so that a barrier of P processes costs the coordinator few reads."""
  client = ocp.multihost.get_jax_distributed_client()
  deadline, pause = time.monotonic() + timeout_ms / 1000, 0.002
  while True:
    found = {k.rsplit("/", 1)[1]: v for folder in folders
             for k, v in client.key_value_dir_get(folder)}
    if len(found) >= jax.process_count():
      return found
    if time.monotonic() > deadline:
      raise TimeoutError(f"{what}: not every process came in {timeout_ms} ms")
    time.sleep(pause)
    pause = min(2 * pause, 0.05)


class Barriers:
  """Orbax's barriers between processes (its AsyncOptions.barrier_sync_fn), kept in
  jax.distributed's key-value store under `prefix` so that a save whose commit fails lets the
  others go: orbax's process 0, whose final rename fails, never reaches that save's last
  barrier, and the others would wait there for minutes, holding their next save. A process
  that gave save `n` up (`give_up`) counts as arrived at every barrier of save `n`; the others
  then find the checkpoint missing themselves (Checkpointer.check). Each barrier is named by
  its save and its use within that save, so a barrier a process skipped in a given-up save
  (re-saved at the same step or not) cannot shift the names of later ones."""

  def __init__(self, prefix: str):
    self.prefix = prefix
    self.uses = collections.Counter()   # (save, orbax key) -> uses (the same everywhere)
    self.save = 0                       # the save being written (Checkpointer._probes)
    self._given_up: set[int] = set()

  def __call__(self, *, key: str, timeout_ms: int) -> None:
    save = self.save
    self.uses[save, key] += 1
    if self._failed(save, key):
      self.give_up()
    name = f"{self.prefix}/barrier/{save}/{key}/{self.uses[save, key]}/"
    client = ocp.multihost.get_jax_distributed_client()
    client.key_value_set(f"{name}{jax.process_index()}", "1")
    every_process([name, self._gave_up_folder(save)], timeout_ms, f"barrier {key!r}")

  def _failed(self, save: int, key: str) -> bool:
    """Whether this process failed its part of save `save` (its write, or process 0's
    commit): orbax's thread came to the save's last barrier (its progress flag set back: the
    flag's 2nd set of the save, the 1st is at its start) without the commit's barrier. Given
    up there, before the peers wait for it, so that process 0 does not commit the save
    (`Checkpointer._written`): found only at the next save otherwise, which waits for that
    barrier, a deadlock. (Orbax's key names, 0.12-0.13; with others, the deadlock lasts until
    orbax's timeout.)"""
    return ("set_value_start" in key and self.uses[save, key] == 2 and
            not any(s == save and "async_commit_complete" in k for s, k in self.uses))

  def _gave_up_folder(self, save: int) -> str:
    return f"{self.prefix}/gave_up/{save}/"

  def give_up(self) -> None:
    """This process will not finish the save being written."""
    if self.save not in self._given_up:
      self._given_up.add(self.save)
      client = ocp.multihost.get_jax_distributed_client()
      client.key_value_set(f"{self._gave_up_folder(self.save)}{jax.process_index()}", "1")

  def peers_gave_up(self) -> list[int]:
    """The other processes that gave the save being written up (their part is missing)."""
    client = ocp.multihost.get_jax_distributed_client()
    return sorted(int(k.rsplit("/", 1)[1]) for k, _ in
                  client.key_value_dir_get(self._gave_up_folder(self.save))
                  if int(k.rsplit("/", 1)[1]) != jax.process_index())
