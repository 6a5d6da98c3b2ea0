"""Each process's own cache of compiled executables, so that a restarted job does not recompile.

JAX's persistent compilation cache (`jax_compilation_cache_dir`) is written by process 0 only,
and on CPU its key hashes the process's own devices, so after a restart every other process
recompiles the train step while process 0 loads it: seconds on the critical path of every
restart, since the first step waits for the slowest process. Here every process serialises
its own executable (`jax.experimental.serialize_executable`) next to JAX's cache, keyed by
the lowered program and everything that makes an executable process-specific.

Computing that key still traces and lowers the program (seconds for the train step), so
`load_or_lower` also keys each entry *before* tracing, by what determines the program: the
caller's description of it (the trainer's resolved config), its abstract inputs (tree, shapes,
dtypes, weak types, shardings), the JAX settings, and a digest of the source that builds it
(every .py of mscale_jax/ and pallas_kernels/, flax/optax versions), next to the process
identity of the program key. A hit loads the executable without tracing or lowering; a miss
lowers as before and records the pre-key -> entry mapping (`*.pre` files, one line each).

Within one process an entry is deserialised at most once: a program this process already
compiled or loaded is reused as it is (`_LIVE`). (Besides saving the load, this matters on
JAX 0.11's CPU backend, where running a deserialised executable in the process that compiled
the same program fails with NOT_FOUND for one of its functions, e.g. a second Trainer of one
config in a notebook.)

Used only where a compilation cache folder is configured (the driver configures one for its
workers); otherwise `compile_or_load` is `lowered.compile()`.
"""
import functools
import hashlib
import importlib.metadata
import json
import logging
import os
import pickle
import re
import tempfile
import time
from concurrent import futures
from typing import Any, Callable

import jax
from jax.experimental import serialize_executable

log = logging.getLogger("mscale_jax")


def cache_folder() -> str | None:
  """WHERE/per-process under JAX's compilation cache folder, or None when none is configured."""
  root = jax.config.jax_compilation_cache_dir
  return os.path.join(root, "per-process") if root else None


# MSCALE_COMPILE_CACHE_PREKEY=0 turns the pre-key off (every program is lowered for its key,
# as before it; experiments.restart_cost measures the difference).
PRE_KEY_SWITCH = "MSCALE_COMPILE_CACHE_PREKEY"

# Entry path -> the executable this process compiled or loaded for it, the most recently used
# _LIVE_MAX (a long-lived process, e.g. a test session, builds many programs).
_LIVE: dict[str, Any] = {}
_LIVE_MAX = 64


def _keep(path: str, executable) -> None:
  _LIVE.pop(path, None)
  _LIVE[path] = executable
  while len(_LIVE) > _LIVE_MAX:
    del _LIVE[next(iter(_LIVE))]

# A call back into Python (io_callback, jax.debug.print, the Pallas TPU interpreter).
_HOST_CALLBACK = re.compile(r"custom_call @\w*python\w*callback")


def cache_key(program_text: str, device_order: list[int]) -> str:
  """A digest of the program (its lowered text, or for a pre-key what determines it), the
  devices it runs on in mesh order (the text names mesh positions, not devices: two meshes of
  one shape lower alike) and what ties its executable to this process and runtime."""
  import jaxlib
  devices = [(d.id, d.process_index, d.platform, d.device_kind) for d in jax.devices()]
  parts = [jax.__version__, jaxlib.__version__, str(jax.process_index()),
           str(jax.process_count()), repr(devices), repr(device_order),
           os.environ.get("XLA_FLAGS", ""), program_text]
  return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:40]


def compile_or_load(lowered, name: str, mesh: jax.sharding.Mesh, *,
                    record_pre_key: str | None = None):
  """(executable, loaded): `lowered` compiled, or loaded from this process's cache.

  `mesh`: the mesh the program is sharded over; its devices, in order, are part of the key. A
  loaded executable is placed on all of `jax.devices()`, so a program on fewer is always
  compiled, as is one that calls back into
  Python (serialising it crashes). `loaded` says whether the cache
  served it. A missing, stale or unreadable entry is compiled afresh and (re)written
  atomically; a cache that cannot be written only logs a warning. `record_pre_key`
  (`load_or_lower`'s): also recorded as a name of the entry, once the entry is on disk.
  """
  folder = _folder_for(mesh)
  if folder is None:
    return lowered.compile(), False
  text = lowered.as_text()
  if _HOST_CALLBACK.search(text):
    return lowered.compile(), False   # such executables cannot be serialised (JAX skips them too)
  key = cache_key(text, [d.id for d in mesh.devices.flat])
  path = _entry(folder, name, key)
  executable = _load(path) if os.path.exists(path) or path in _LIVE else None
  if executable is None:
    executable, loaded = lowered.compile(), False
    stored = _write(path, _serialized(executable))
    _keep(path, executable)
  else:
    loaded = stored = True
  if record_pre_key is not None and stored:
    _write(_entry(folder, name, record_pre_key, ".pre"), os.path.basename(path).encode())
  return executable, loaded


def load_or_lower(lower: Callable[..., Any], args: tuple, name: str, mesh: jax.sharding.Mesh,
                  built_from: str) -> tuple[Any, str]:
  """(executable, served) for the program `lower(*args)` lowers, without calling `lower` (no
  tracing, no lowering) when this process's cache already holds it under its pre-key.

  `args`: the program's arguments (arrays or `jax.ShapeDtypeStruct`s with shardings; only
  their abstract values are read). `built_from`: everything else the program is built from
  that the source does not fix (the trainer passes its resolved config, all fields).
  `served`: 'compiled', 'loaded' (after lowering) or 'loaded before lowering'. A miss lowers
  and goes through `compile_or_load`, with its safety rules (programs calling back into
  Python and programs on fewer than all devices are compiled, never cached, so they never
  get a pre-key either); an unreadable entry behind a pre-key is a miss. With
  MSCALE_COMPILE_CACHE_PREKEY=0 in the environment it is `compile_or_load(lower(*args))`.
  """
  folder = _folder_for(mesh)
  key = (pre_key(args, mesh, built_from)
         if folder is not None and os.environ.get(PRE_KEY_SWITCH) != "0" else None)
  executable = None if key is None else _load_by_pre_key(folder, name, key)
  if executable is not None:
    return executable, "loaded before lowering"
  executable, loaded = compile_or_load(lower(*args), name, mesh, record_pre_key=key)
  return executable, "loaded" if loaded else "compiled"


class Loading:
  """`load_or_lower(lower, args, name, mesh, built_from)` running on a thread of its own, so
  that a restarted process loads (or compiles) its program while it does other work, e.g.
  restoring the checkpoint: `args` may be abstract (`jax.ShapeDtypeStruct`s with shardings).

  `result(real_args)` waits for it and returns (executable, served) if `real_args` have the
  abstract values (tree, shapes, dtypes, weak types, shardings) the load was started for;
  otherwise it warns and loads or lowers for `real_args` there and then. An exception the
  thread raised is raised by `result`, with its traceback, in the caller's thread.
  `seconds`: how long the load took once `result` returned (the thread's, plus the load again
  for other arguments).
  """

  def __init__(self, lower: Callable[..., Any], args: tuple, name: str,
               mesh: jax.sharding.Mesh, built_from: str):
    self._call = (lower, name, mesh, built_from)
    self._expected = abstract_inputs(args)
    self.seconds = None
    pool = futures.ThreadPoolExecutor(1, thread_name_prefix=f"load-{name}")
    self._future = pool.submit(self._load, lower, args, name, mesh, built_from)
    pool.shutdown(wait=False)   # the thread ends with the load; nothing else runs there

  def _load(self, *call):
    start = time.perf_counter()
    try:
      return load_or_lower(*call)
    finally:
      self.seconds = time.perf_counter() - start

  def result(self, args: tuple) -> tuple[Any, str]:
    executable, served = self._future.result()
    if abstract_inputs(args) == self._expected:
      return executable, served
    lower, name, mesh, built_from = self._call
    log.warning("compile cache: %s's arguments differ from those its load was started for; "
                "loading it again", name)
    start = time.perf_counter()
    try:
      return load_or_lower(lower, args, name, mesh, built_from)
    finally:
      self.seconds += time.perf_counter() - start


def pre_key(args: tuple, mesh: jax.sharding.Mesh, built_from: str) -> str:
  """The key of the program built from `built_from` for arguments like `args` on `mesh`,
  computed without tracing: see the module docstring for its ingredients."""
  settings = json.dumps(sorted((k, repr(v)) for k, v in jax.config.values.items()))
  text = "\n".join(["pre-key", built_from, abstract_inputs(args), source_digest(), settings])
  return cache_key(text, [d.id for d in mesh.devices.flat])


def abstract_inputs(args) -> str:
  """`args`' tree structure and, per leaf, its shape, dtype, weak type and sharding (with the
  ids of its mesh's devices in order: a sharding's text names only the mesh's shape)."""
  leaves, tree = jax.tree.flatten(args)
  parts = [str(tree)]
  for x in leaves:
    sharding = getattr(x, "sharding", None)
    mesh = getattr(sharding, "mesh", None)
    devices = [d.id for d in mesh.devices.flat] if isinstance(mesh, jax.sharding.Mesh) else None
    parts.append(repr((getattr(x, "shape", None), str(getattr(x, "dtype", type(x))),
                       bool(getattr(x, "weak_type", False)), repr(sharding), devices)))
  return "\n".join(parts)


@functools.cache
def source_digest() -> str:
  """A digest of every .py file under mscale_jax/ and pallas_kernels/ (name and bytes) and of
  the flax and optax versions: an edited checkout never loads another checkout's program."""
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  digest = hashlib.sha256()
  for package in ("mscale_jax", "pallas_kernels"):
    for folder, subfolders, files in os.walk(os.path.join(root, package)):
      subfolders.sort()
      for file in sorted(f for f in files if f.endswith(".py")):
        path = os.path.join(folder, file)
        digest.update(os.path.relpath(path, root).encode() + b"\0")
        with open(path, "rb") as f:
          digest.update(f.read() + b"\0")
  for dist in ("flax", "optax"):
    digest.update(f"{dist}=={importlib.metadata.version(dist)}\0".encode())
  return digest.hexdigest()


def _folder_for(mesh: jax.sharding.Mesh) -> str | None:
  """The cache folder for a program on `mesh`, or None where none is configured or the
  program is on fewer than all devices (a loaded executable is placed on all of them)."""
  return cache_folder() if mesh.size == jax.device_count() else None


def _entry(folder: str, name: str, key: str, suffix: str = ".pkl") -> str:
  return os.path.join(folder, f"{name}-p{jax.process_index()}-{key}{suffix}")


def _load(path: str):
  """The executable serialised at `path` (this process's own if it has one), or None (with a
  warning) if it cannot be loaded."""
  if path in _LIVE:
    executable = _LIVE[path]
    _keep(path, executable)
    return executable
  try:
    with open(path, "rb") as f:
      executable = serialize_executable.deserialize_and_load(*pickle.load(f))
  except Exception as e:   # noqa: BLE001 (a stale or torn entry is only a cache miss)
    log.warning("compile cache: could not load %s (%s: %s); compiling", path,
                type(e).__name__, e)
    return None
  _keep(path, executable)
  return executable


def _load_by_pre_key(folder: str, name: str, key: str):
  """The executable the pre-key `key` names, or None if it names none or it cannot be loaded."""
  index = _entry(folder, name, key, ".pre")
  try:
    with open(index) as f:
      entry = f.read().strip()
  except OSError:
    return None
  if os.path.basename(entry) != entry or not entry.endswith(".pkl"):
    log.warning("compile cache: %s names no entry (%r); lowering", index, entry[:80])
    return None
  return _load(os.path.join(folder, entry))


def _serialized(executable) -> bytes | None:
  try:
    return pickle.dumps(serialize_executable.serialize(executable))
  except pickle.PicklingError as e:
    log.warning("compile cache: could not serialise the executable (%s)", e)
    return None


def _write(path: str, data: bytes | None) -> bool:
  """Writes `data` to `path` whole or not at all (readers never see a torn entry); whether
  it did (not when `data` is None)."""
  if data is None:
    return False
  temp = None
  try:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with tempfile.NamedTemporaryFile("wb", dir=os.path.dirname(path), delete=False) as f:
      temp = f.name
      f.write(data)
    os.replace(temp, path)
    return True
  except OSError as e:
    log.warning("compile cache: could not write %s (%s)", path, e)
    if temp is not None and os.path.exists(temp):
      os.remove(temp)
    return False
