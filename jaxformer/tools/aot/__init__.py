"""Ahead-of-time compiles: every train step lowered and compiled for a device that need not
be here (a TPU topology through libtpu, an H100 through JAX's CUDA plugin). ``targets``
names the devices, ``steps`` compiles, ``launches`` counts a compiled GPU program's kernels
per step, ``report`` tells."""
