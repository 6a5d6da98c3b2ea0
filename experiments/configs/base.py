"""The shared starting point of every config file: `Config()`'s defaults as a ConfigDict.

Each config file calls `base_config()` and sets only what differs. Fields whose default is None
become typed placeholders, so absl can still set them: `--config.model.attention_window=32`.
"""
import dataclasses
import types
import typing

import ml_collections
from ml_collections import config_dict

from mscale_jax import config as config_lib


def base_config() -> ml_collections.ConfigDict:
  """`Config()` as a locked ConfigDict (a typo'd field in a config file raises)."""
  return _to_config_dict(config_lib.Config())


def _to_config_dict(node) -> ml_collections.ConfigDict:
  out = ml_collections.ConfigDict()
  for field in dataclasses.fields(node):
    value = getattr(node, field.name)
    if dataclasses.is_dataclass(value):
      value = _to_config_dict(value)
    elif value is None:
      value = config_dict.placeholder(_optional_type(field))
    out[field.name] = value
  out.lock()
  return out


def _optional_type(field: dataclasses.Field) -> type:
  """`int` for a field annotated `int | None` (or `Optional[int]`)."""
  if typing.get_origin(field.type) in (typing.Union, types.UnionType):
    args = [arg for arg in typing.get_args(field.type) if arg is not type(None)]
    if len(args) == 1:
      return args[0]
  raise TypeError(f"{field.name}: default None needs an 'X | None' annotation, got {field.type}")
