"""Suite-wide JAX settings.

- x64 is on: exactness is checked in float64; float32 tests ask for float32
  params explicitly (``init_params(key, config, dtype=jnp.float32)``).
- XLA's optimization passes are off. Almost all of the suite's time is XLA
  compiling many tiny programs, and without those passes it compiles about 5x
  faster on CPU. Every comparison in the suite compiles both of its sides the
  same way; the benchmark scripts (experiments/) keep the optimizations on.
"""

import os
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# the suite's runs cache what they measure (the CPU peak) apart from the user's cache
os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="jaxformer-test-cache-")

import jax  # noqa: E402

jax.config.update("jax_enable_x64", True)
jax.config.update("jax_disable_most_optimizations", True)


import pytest  # noqa: E402
from helpers import write_corpus  # noqa: E402


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A small word corpus on disk (helpers.write_corpus), written once per test module."""
    return write_corpus(tmp_path_factory.mktemp("corpus") / "text.txt")
