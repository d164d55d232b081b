"""XLA's legacy CPU emitter flag, where the installed XLA still has it (tests/conftest.py says
why the suite compiles with it). XLA aborts a process whose XLA_FLAGS name a flag it does not
know ("Unknown flag in XLA_FLAGS": jaxlib 0.10 has ``--xla_cpu_use_fusion_emitters``, 0.11 no
longer), so the suite asks once, in a throwaway process, and the answer travels in the
environment to its xdist workers and to the subprocesses the tests start. Imports no jax: the
flags must be set before the process's first computation."""

import os
import subprocess
import sys

LEGACY_EMITTER = "--xla_cpu_use_fusion_emitters=false"
ANSWER = "JAXFORMER_TEST_LEGACY_EMITTER"  # "1" or "0", set by the first pytest process


def legacy_emitter_flag() -> str:
    """LEGACY_EMITTER where this XLA accepts it, else "" (asked once per run: ANSWER)."""
    if ANSWER not in os.environ:
        env = dict(os.environ, XLA_FLAGS=LEGACY_EMITTER, JAX_PLATFORMS="cpu")
        probe = subprocess.run([sys.executable, "-c", "import jax.numpy as jnp; jnp.zeros(1).block_until_ready()"],
                               env=env, capture_output=True, timeout=120)
        os.environ[ANSWER] = "1" if probe.returncode == 0 else "0"
    return LEGACY_EMITTER if os.environ[ANSWER] == "1" else ""
