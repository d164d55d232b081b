"""The Pallas flash-attention kernels: ``forward`` (one kernel, the row log-sum-exp kept),
``backward`` (the delta, dK/dV and dQ kernels, and ``flash_attention``, the differentiable
entry point), ``tune`` (per-platform tiling and the GPU launch table)."""
