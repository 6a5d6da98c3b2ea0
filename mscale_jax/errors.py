"""The one error type for bad configuration or input."""


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


class NonFiniteError(RuntimeError):
  """Training met a non-finite loss or gradient norm and `train.on_nonfinite` says stop."""

  def __init__(self, step: int, detail: str):
    self.step = step
    super().__init__(f"non-finite loss or gradient norm at step {step} ({detail}); no update "
                     f"was applied and no checkpoint holds it. train.on_nonfinite='skip_step' "
                     f"or 'rollback' would go on")
