"""Tests run in float64 where exactness is checked: x64 is on for the whole suite,
and float32 tests ask for float32 params explicitly."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_enable_x64", True)
