"""Which kernel a program runs: the platform it is lowered for, not the process's backend.

``on_platform(branch, *args)`` calls ``branch(device, *args)`` through
``jax.lax.platform_dependent``: "cuda" / "rocm" take the "gpu" branch (Triton), "tpu" the
"tpu" branch (Mosaic), any other platform (CPU) the "cpu" branch (interpret mode: the
same kernel as a jitted loop over the grid, slow, for proof). So a CPU process exporting
for "cuda" (``jax.export(..., platforms=["cuda"])``) or compiling for a TPU topology emits
the compiled kernel. Every branch is traced; a branch whose device cannot take the block
sizes (tiling.TilingError) becomes a stand-in whose lowering raises the error, so only
the platform lowered for refuses. On a mesh the call runs per shard of the batch
(kernels/shards.py).
"""

from __future__ import annotations

import functools

import jax

from jaxformer.kernels.pallas.tiling import TilingError
from jaxformer.kernels.refused import refused
from jaxformer.kernels.shards import per_example_shards


def on_platform(branch, *args):
    """branch(device, *args) for the platform the program is lowered for: "gpu" on cuda
    and rocm (Triton), "tpu" (Mosaic), "cpu" on any other (interpret mode). Each branch
    returns the same shapes (unpadded arrays). Lowering for one platform keeps only its
    branch; a multi-platform export with the kernel fails (JAX lowers every kept branch
    for every platform, and a compiled pallas_call has no CPU lowering)."""
    gpu, tpu, cpu = (functools.partial(_guarded, branch, d) for d in ("gpu", "tpu", "cpu"))

    def switch(*args):
        return jax.lax.platform_dependent(*args, cuda=gpu, rocm=gpu, tpu=tpu, default=cpu)

    return per_example_shards(switch, *args)


def _guarded(branch, device: str, *args):
    """branch(device, *args); where the device cannot take the block sizes (TilingError),
    a stand-in of the CPU branch's shapes whose lowering raises the error: every branch is
    traced, but only the platform lowered for may refuse (pallas_block_q 8 runs on CPU and
    TPU, and fails a lowering for cuda)."""
    try:
        return branch(device, *args)
    except TilingError as error:
        return refused(jax.eval_shape(functools.partial(branch, "cpu"), *args), TilingError, str(error))
