"""The XLA flags the suite compiles its CPU programs with, those of them the installed XLA
knows (tests/conftest.py says why each). XLA aborts a process whose XLA_FLAGS name a flag it
does not know ("Unknown flag in XLA_FLAGS": jaxlib 0.10 has ``--xla_cpu_use_fusion_emitters``,
0.11 no longer), so the suite asks once, each flag in a throwaway process, and the answer
travels in the environment to its xdist workers and to the subprocesses the tests start.
Imports no jax: the flags must be set before the process's first computation."""

import os
import subprocess
import sys

LEGACY_EMITTER = "--xla_cpu_use_fusion_emitters=false"
SERIAL_CODEGEN = "--xla_cpu_parallel_codegen_split_count=1"
FLAGS = (LEGACY_EMITTER, SERIAL_CODEGEN)
ANSWER = "JAXFORMER_TEST_XLA_FLAGS"  # the flags this XLA took, set by the first pytest process


def known(flag: str) -> bool:
    """Whether a process with XLA_FLAGS=flag computes (XLA aborts at a flag it does not know)."""
    env = dict(os.environ, XLA_FLAGS=flag, JAX_PLATFORMS="cpu")
    probe = subprocess.run([sys.executable, "-c", "import jax.numpy as jnp; jnp.zeros(1).block_until_ready()"],
                           env=env, capture_output=True, timeout=120)
    return probe.returncode == 0


def suite_flags() -> str:
    """FLAGS this XLA accepts, space separated (asked once per run: ANSWER)."""
    if ANSWER not in os.environ:
        os.environ[ANSWER] = " ".join(flag for flag in FLAGS if known(flag))
    return os.environ[ANSWER]


def legacy_emitter_flag() -> str:
    """LEGACY_EMITTER where this XLA accepts it, else ""."""
    return LEGACY_EMITTER if LEGACY_EMITTER in suite_flags().split() else ""
