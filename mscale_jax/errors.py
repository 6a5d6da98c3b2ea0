"""The library's errors. `ConfigError` is the kernels' own (`pallas_kernels.errors`): one class
for bad configuration or input, whichever layer finds it."""
from pallas_kernels.errors import ConfigError

__all__ = ["ConfigError", "NonFiniteError"]


class NonFiniteError(RuntimeError):
  """Training met a non-finite loss or gradient norm and `train.on_nonfinite` says stop."""

  def __init__(self, step: int, detail: str):
    self.step, self.detail = step, detail
    super().__init__(f"non-finite loss or gradient norm at step {step} ({detail}); no update "
                     f"was applied and no checkpoint holds it. train.on_nonfinite='skip_step' "
                     f"or 'rollback' would go on")
