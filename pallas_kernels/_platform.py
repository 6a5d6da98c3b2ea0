"""Where a Pallas kernel runs, and the JAX-version shims every kernel in this package shares.

  platform_of(*arrays)            'cpu' | 'gpu' | 'tpu', for concrete arrays and tracers alike
  resolve_interpret(name, interpret, platform)
                                  (backend, interpret): native Triton on GPU, native Mosaic on
                                  TPU, an interpreter on CPU; `interpret=` overrides; logged once
  varying_axes(x), out_struct(shape, dtype, like)
                                  the shard_map axes a value varies over, read and passed on to
                                  `pallas_call` outputs, whichever spelling this JAX uses

Kernel-specific rules (collective matmul is TPU-only, flash attention takes InterpretParams)
stay in the kernels, as checks on top of these.
"""
import inspect
import logging

import jax

from pallas_kernels.errors import ConfigError

# The kernels' logger: experiments set it to INFO beside the library's, so the choice shows.
_log = logging.getLogger("pallas_kernels")
_logged = set()    # (kernel name, backend) pairs already logged

_PLATFORM_ALIASES = {"cuda": "gpu", "rocm": "gpu"}
_DESCRIPTIONS = {"gpu": "native Triton (GPU)", "tpu": "native Mosaic (TPU)"}


def _normalise(platform) -> str:
  platform = str(platform).lower()
  return _PLATFORM_ALIASES.get(platform, platform)


def _mesh_platform():
  """Platform of the mesh being traced over (shard_map, jax.set_mesh), or None."""
  try:
    mesh = jax.sharding.get_abstract_mesh()
  except Exception:  # pylint: disable=broad-except  (no such API in this JAX)
    return None
  device = getattr(mesh, "abstract_device", None)     # JAX 0.10: AbstractDevice(platform=...)
  return getattr(device, "platform", None) or getattr(mesh, "platform", None)


def platform_of(*arrays) -> str:
  """'cpu' | 'gpu' | 'tpu': where these arrays live.

  A concrete array answers from its sharding. Tracers (and ShapeDtypeStructs) have none, so
  the mesh being traced over answers, else `jax.default_backend()`.
  """
  for x in arrays:
    try:
      devices = x.sharding.device_set
    except Exception:  # pylint: disable=broad-except  (tracers refuse to give a sharding)
      continue
    if devices:
      return _normalise(next(iter(devices)).platform)
  return _normalise(_mesh_platform() or jax.default_backend())


def resolve_interpret(kernel_name, interpret, platform, *, tpu_style=False):
  """(backend, interpret) for one call: backend 'gpu' | 'tpu' | 'interpret'.

  `interpret`: None picks the native backend of `platform`, or an interpreter on CPU; False
  demands a native backend (ConfigError on CPU); anything else (True, pltpu.InterpretParams)
  runs the interpreter with that value. The returned `interpret` is False for native backends.
  The CPU default is the generic interpreter (True), or with `tpu_style` the TPU interpreter
  (`pltpu.InterpretParams()`, which simulates DMAs and semaphores). The first call per
  (kernel, backend) is logged at INFO.
  """
  platform = _normalise(platform)
  if interpret is None or interpret is False:
    if platform in ("gpu", "tpu"):
      backend, interpret = platform, False
    elif interpret is False:
      raise ConfigError("interpret", False,
                        f"platform {platform!r} has no compiled Pallas backend; use "
                        "interpret=None or True")
    elif tpu_style:
      from jax.experimental.pallas import tpu as pltpu
      backend, interpret = "interpret", pltpu.InterpretParams()
    else:
      backend, interpret = "interpret", True
  else:
    backend = "interpret"
  if (kernel_name, backend) not in _logged:
    _logged.add((kernel_name, backend))
    what = _DESCRIPTIONS.get(backend) or (
        f"the {'TPU' if not isinstance(interpret, bool) else 'Pallas'} interpreter on "
        f"{platform}")
    _log.info("%s: Pallas backend %s, %s", kernel_name, backend, what)
  return backend, interpret


# -------------------------------------------------------------------------------------------
# Varying mesh axes. Inside `jax.shard_map(check_vma=True)` a pallas_call must be told which
# manual axes its outputs vary over. Checked on JAX 0.10.2: avals carry `manual_axis_type`
# (a ManualAxisType with `.varying`) and ShapeDtypeStruct takes `manual_axis_type=`. Earlier
# releases spelled both `vma` (a frozenset of axis names); that branch is written from their
# API, not run here. The spelling is found by introspection, so a release with neither gets
# a plain ShapeDtypeStruct (correct outside shard_map or with check_vma=False).

try:
  _STRUCT_PARAMS = frozenset(inspect.signature(jax.ShapeDtypeStruct).parameters)
except (TypeError, ValueError):  # no introspectable signature
  _STRUCT_PARAMS = frozenset()


def varying_axes(x) -> frozenset:
  """Manual mesh axes `x` varies over (empty outside shard_map or with check_vma=False)."""
  aval = jax.typeof(x)
  manual = getattr(aval, "manual_axis_type", None)
  if manual is not None:
    return frozenset(getattr(manual, "varying", None) or ())
  return frozenset(getattr(aval, "vma", None) or ())


def out_struct(shape, dtype, like):
  """A ShapeDtypeStruct for a pallas_call output that varies over the same axes as `like`."""
  manual = getattr(jax.typeof(like), "manual_axis_type", None)
  try:
    if "manual_axis_type" in _STRUCT_PARAMS and manual is not None:
      return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=manual)
    if "vma" in _STRUCT_PARAMS:
      return jax.ShapeDtypeStruct(shape, dtype, vma=varying_axes(like))
  except TypeError:  # the keyword exists but takes another type in this release
    pass
  return jax.ShapeDtypeStruct(shape, dtype)
