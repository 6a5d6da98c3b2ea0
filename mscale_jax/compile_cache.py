"""Each process's own cache of compiled executables, so that a restarted job does not recompile.

JAX's persistent compilation cache (`jax_compilation_cache_dir`) is written by process 0 only,
and on CPU its key hashes the process's own devices, so after a restart every other process
recompiles the train step while process 0 loads it: seconds on the critical path of every
restart, since the first step waits for the slowest process. Here every process serialises
its own executable (`jax.experimental.serialize_executable`) next to JAX's cache, keyed by
the lowered program and everything that makes an executable process-specific.

Used only where a compilation cache folder is configured (the driver configures one for its
workers); otherwise `compile_or_load` is `lowered.compile()`.
"""
import hashlib
import logging
import os
import pickle
import re
import tempfile

import jax
from jax.experimental import serialize_executable

log = logging.getLogger("mscale_jax")


def cache_folder() -> str | None:
  """WHERE/per-process under JAX's compilation cache folder, or None when none is configured."""
  root = jax.config.jax_compilation_cache_dir
  return os.path.join(root, "per-process") if root else None


# A call back into Python (io_callback, jax.debug.print, the Pallas TPU interpreter).
_HOST_CALLBACK = re.compile(r"custom_call @\w*python\w*callback")


def cache_key(program_text: str, device_order: list[int]) -> str:
  """A digest of the program (its lowered text), the devices it runs on in mesh order (the
  text names mesh positions, not devices: two meshes of one shape lower alike) and what ties
  its executable to this process and runtime."""
  import jaxlib
  devices = [(d.id, d.process_index, d.platform, d.device_kind) for d in jax.devices()]
  parts = [jax.__version__, jaxlib.__version__, str(jax.process_index()),
           str(jax.process_count()), repr(devices), repr(device_order),
           os.environ.get("XLA_FLAGS", ""), program_text]
  return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:40]


def compile_or_load(lowered, name: str, mesh: jax.sharding.Mesh):
  """(executable, loaded): `lowered` compiled, or loaded from this process's cache.

  `mesh`: the mesh the program is sharded over; its devices, in order, are part of the key. A
  loaded executable is placed on all of `jax.devices()`, so a program on fewer is always
  compiled, as is one that calls back into
  Python (serialising it crashes). `loaded` says whether the cache
  served it. A missing, stale or unreadable entry is compiled afresh and (re)written
  atomically; a cache that cannot be written only logs a warning.
  """
  folder = cache_folder()
  if folder is None or mesh.size != jax.device_count():
    return lowered.compile(), False
  text = lowered.as_text()
  if _HOST_CALLBACK.search(text):
    return lowered.compile(), False   # such executables cannot be serialised (JAX skips them too)
  key = cache_key(text, [d.id for d in mesh.devices.flat])
  path = os.path.join(folder, f"{name}-p{jax.process_index()}-{key}.pkl")
  if os.path.exists(path):
    try:
      with open(path, "rb") as f:
        return serialize_executable.deserialize_and_load(*pickle.load(f)), True
    except Exception as e:   # noqa: BLE001 (a stale or torn entry is only a cache miss)
      log.warning("compile cache: could not load %s (%s: %s); compiling", path,
                  type(e).__name__, e)
  executable = lowered.compile()
  _write(path, serialize_executable.serialize(executable))
  return executable, False


def _write(path: str, payload) -> None:
  """Writes `payload` to `path` whole or not at all (readers never see a torn entry)."""
  temp = None
  try:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with tempfile.NamedTemporaryFile("wb", dir=os.path.dirname(path), delete=False) as f:
      temp = f.name
      pickle.dump(payload, f)
    os.replace(temp, path)
  except (OSError, pickle.PicklingError) as e:
    log.warning("compile cache: could not write %s (%s)", path, e)
    if temp is not None and os.path.exists(temp):
      os.remove(temp)
