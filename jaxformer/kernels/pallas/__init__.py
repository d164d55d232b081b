"""The Pallas flash-attention kernels:

    forward     the forward kernel (the row log-sum-exp kept) and the tile pieces every
                kernel shares
    backward    the delta, dK/dV and dQ kernels
    entry       ``flash_attention``, the differentiable entry point (a custom_vjp whose
                rule is the backward kernels), and its pair flash_core_fwd / flash_core_bwd
    platform    which branch runs: the platform the program is lowered for
    tiling      per-platform block sizes and Triton's launch (reads the launch table)
    tune        the GPU launch table: read by tiling, written only by timing
    timing      the explicit tuning act: time candidate launches on a GPU, write the table
                (``jaxformer tune``, ``jaxformer bench``)

The model and the hand-derived gradients import these names from here:
``flash_attention`` (differentiable, its rule the backward kernels), ``flash_core_fwd`` /
``flash_core_bwd`` (the same pair, called by manual_grads) and ``FlashRes``."""

from jaxformer.kernels.pallas.entry import FlashRes, flash_attention, flash_core_bwd, flash_core_fwd  # noqa: F401
