"""Suite-wide JAX settings.

- x64 is on: exactness is checked in float64; float32 tests ask for float32
  params explicitly (``init_params(key, config, dtype=jnp.float32)``).
- XLA's optimization passes are off. Almost all of the suite's time is XLA
  compiling many tiny programs, and without those passes it compiles about 5x
  faster on CPU. Every comparison in the suite compiles both of its sides the
  same way; the benchmark scripts (experiments/) keep the optimizations on.
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_enable_x64", True)
jax.config.update("jax_disable_most_optimizations", True)
