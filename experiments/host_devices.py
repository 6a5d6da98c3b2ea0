"""Simulated CPU devices for entry points, set before JAX initialises."""
import os


def simulate_cpu_devices(count: int = 8) -> None:
  """Makes the CPU backend expose `count` devices, unless XLA_FLAGS already chooses a count.

  Lets every mesh layout run on a laptop; the flag affects only the CPU backend, so on a GPU or
  TPU machine the accelerators are used as they are. Call before importing JAX.
  """
  flags = os.environ.get("XLA_FLAGS", "")
  if "xla_force_host_platform_device_count" not in flags:
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={count}".strip()
