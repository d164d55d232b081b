"""Suite-wide JAX settings.

- x64 is on: exactness is checked in float64; float32 tests ask for float32
  params explicitly (``init_params(key, config, dtype=jnp.float32)``).
- XLA's optimization passes are off, here and in the subprocesses the tests
  start (the environment carries it). Almost all of the suite's time is XLA
  compiling many tiny programs, and without those passes it compiles about 5x
  faster on CPU. Every comparison in the suite compiles both of its sides the
  same way; the benchmark scripts (experiments/) keep the optimizations on, and
  so does notebook 02 (tests/test_notebooks.py says why; the others compile as the suite does).
- XLA's CPU fusion emitters are off (``--xla_cpu_use_fusion_emitters=false``: the
  elemental emitter XLA used before them), which halves the compile time of a
  model's gradient at the suite's sizes; again both sides of every comparison,
  and the subprocesses the tests start, compile the same way. Only where the installed
  XLA has the flag (xla_flags.py: jaxlib 0.11 aborts at its name).
- XLA's CPU code generation runs as one LLVM module (``--xla_cpu_parallel_codegen_split_count=1``),
  not split into up to 32 parts compiled on a thread pool: with a worker on each of the
  machine's cores the threads had no core to run on, and each part paid its own setup. The
  same modules on 2 cores (test_model_options, test_segments, test_moe, test_train,
  test_softcap, test_guarantees, test_stopping, test_hf_llama; ``pytest -n 2``): 191 s and 375 CPU-s
  against 228 s and 446; test_modern_options with test_lora 164 s against 183 (2026-11-30). It
  changes how XLA compiles, not what: the notebooks print the same.
- JAX's in-memory caches are cleared after each test module (``jax.clear_caches``): every
  compiled CPU program holds memory mappings of its code for as long as a cache keeps it,
  and a worker that runs several hundred tests accumulates tens of thousands of them
  (about 250 a second under test_modern_options, measured with /proc/PID/maps). Past the
  kernel's vm.max_map_count (65530) XLA's next compile cannot map its code and the worker
  dies of a segmentation fault, in whichever test happens to compile then.
- JAX's persistent compilation cache holds the run's compiled programs, in a folder of
  this run (made by pytest's first process, inherited by its xdist workers and by the
  subprocesses the tests start; removed at the end): a `jaxformer` subprocess that trains
  a config another process compiled, and a worker compiling again what it released at a
  module's end (init_params of a preset, the helpers' jitted comparisons, each small eager
  operation), load the executable instead. A cached executable is the one XLA compiled.
  Two suite runs of four once crashed inside the cache (reading and writing an
  executable), before the caches were cleared after each module; runs without the cache
  then crashed the same way in other places, until the clearing. Reading an executable
  maps its code: most likely the mappings' limit above.
- A module whose tests all read one expensive result (an 8-device subprocess:
  ``helpers.once_per_run``; a module fixture that trains or loads a model) is one
  ``xdist_group`` (``pytestmark``), and pyproject's ``--dist loadgroup`` sends its tests to one
  worker. Spread over both, the second worker either waited on the first's lock, its core
  idle, for as long as the subprocess ran, or ran the module fixture again. (pytest 8: the dev
  extra pins it below 9, where loadgroup's grouping has no effect.)
"""

import os
import shutil
import tempfile

from xla_flags import suite_flags

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# the suite's runs cache what they measure (the CPU peak) apart from the user's cache: a
# folder for each of pytest's processes, removed at its end
CACHE_HOME = os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="jaxformer-test-cache-")
# the run's compilation cache: made by the first process, inherited by the workers
JIT_CACHE = os.environ.get("JAXFORMER_TEST_JIT_CACHE") or tempfile.mkdtemp(prefix="jaxformer-test-jit-")
os.environ["JAXFORMER_TEST_JIT_CACHE"] = os.environ["JAX_COMPILATION_CACHE_DIR"] = JIT_CACHE
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "true")  # the subprocesses' too
for flag in suite_flags().split():  # those this XLA has; a flag the caller's XLA_FLAGS set keeps its value
    if flag.split("=")[0] not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + flag).strip()

import jax  # noqa: E402

jax.config.update("jax_enable_x64", True)
jax.config.update("jax_disable_most_optimizations", True)


import pytest  # noqa: E402
from helpers import write_corpus  # noqa: E402


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A small word corpus on disk (helpers.write_corpus), written once per test module."""
    return write_corpus(tmp_path_factory.mktemp("corpus") / "text.txt")


@pytest.fixture(autouse=True, scope="module")
def release_compiled_programs():
    """After each test module, drop JAX's caches of traced and compiled programs, so that a
    worker's compiled code (and its memory mappings) does not grow with the whole suite."""
    yield
    jax.clear_caches()


def pytest_sessionfinish(session):
    shutil.rmtree(CACHE_HOME, ignore_errors=True)  # each process's own
    if not hasattr(session.config, "workerinput"):  # the controller, after every worker
        shutil.rmtree(JIT_CACHE, ignore_errors=True)
