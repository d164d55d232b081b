"""The Pallas flash-attention kernels: ``forward`` (one kernel, the row log-sum-exp kept),
``backward`` (the delta, dK/dV and dQ kernels, and ``flash_attention``, the differentiable
entry point), ``tune`` (per-platform tiling and the GPU launch table).

The model and the hand-derived gradients import these names from here:
``flash_attention`` (differentiable, its rule the backward kernels), ``flash_core_fwd`` /
``flash_core_bwd`` (the same pair, called by manual_grads) and ``FlashRes``."""

from jaxformer.kernels.pallas.backward import (FlashRes, flash_attention, flash_core_bwd,  # noqa: F401
                                               flash_core_fwd)
