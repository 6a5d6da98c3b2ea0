"""The one error type for bad configuration or input, shared by the kernels and mscale_jax.

It lives here, at the bottom layer, so the kernels stand alone; `mscale_jax.errors` re-exports
it, so `except ConfigError` catches a kernel's complaint and the library's alike.
"""


class ConfigError(ValueError):
  """A configuration field or an input has a value that cannot work.

  The message names the field, the value and what would be valid, so a user can fix the
  command line without reading code. Raised before anything compiles.
  """

  def __init__(self, field: str, value, valid: str):
    self.field = field
    self.value = value
    self.valid = valid
    super().__init__(f"{field}={value!r} is invalid: {valid}")
