"""Suite-wide JAX settings.

- x64 is on: exactness is checked in float64; float32 tests ask for float32
  params explicitly (``init_params(key, config, dtype=jnp.float32)``).
- XLA's optimization passes are off, here and in the subprocesses the tests
  start (the environment carries it). Almost all of the suite's time is XLA
  compiling many tiny programs, and without those passes it compiles about 5x
  faster on CPU. Every comparison in the suite compiles both of its sides the
  same way; the benchmark scripts (experiments/) keep the optimizations on, and
  so do the notebooks, whose kernels start without the JAX_ and XLA_ settings.
- XLA's CPU fusion emitters are off (``--xla_cpu_use_fusion_emitters=false``: the
  elemental emitter XLA used before them), which halves the compile time of a
  model's gradient at the suite's sizes; again both sides of every comparison,
  and the subprocesses the tests start, compile the same way.
- Compiled programs are kept in JAX's persistent compilation cache, in a folder
  of this run shared by the xdist workers and by the `jaxformer` subprocesses the
  tests start (the environment carries it), and removed at the end: a
  subprocess that trains a config another one already compiled (a stopped run,
  its resume, the straight run it is compared with) loads the executable
  instead of compiling it again. A cached executable is the one XLA compiled.
"""

import os
import shutil
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# the suite's runs cache what they measure (the CPU peak) apart from the user's cache
os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="jaxformer-test-cache-")
RUN_ID = os.environ.get("PYTEST_XDIST_TESTRUNUID") or str(os.getpid())  # one per pytest run
JIT_CACHE = os.path.join(tempfile.gettempdir(), f"jaxformer-test-jit-{RUN_ID}")
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", JIT_CACHE)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.2")
os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "true")  # the subprocesses' too
if "xla_cpu_use_fusion_emitters" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_cpu_use_fusion_emitters=false").strip()

import jax  # noqa: E402

jax.config.update("jax_enable_x64", True)
jax.config.update("jax_disable_most_optimizations", True)


import pytest  # noqa: E402
from helpers import write_corpus  # noqa: E402


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A small word corpus on disk (helpers.write_corpus), written once per test module."""
    return write_corpus(tmp_path_factory.mktemp("corpus") / "text.txt")


def pytest_sessionfinish(session):
    if not hasattr(session.config, "workerinput"):  # the controller, after every worker
        shutil.rmtree(JIT_CACHE, ignore_errors=True)
