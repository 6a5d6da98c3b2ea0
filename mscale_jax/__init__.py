"""mscale-jax: MegaScale (NSDI 2024) reproduced in JAX.

Importing the package imports nothing heavy: `mscale_jax.perf` is pure Python, and each module
imports JAX itself where it needs it.
"""
from mscale_jax.errors import ConfigError

__all__ = ["ConfigError"]
