"""The kernels room: hand-written device kernels and the machinery around them (tiling,
launch tuning), below the model room. The model names each kernel as an attention core
(jaxformer.model.attention); nothing here imports the model.

    pallas/         the flash-attention forward and backward kernels (Triton on a GPU,
                    Mosaic on a TPU, interpret mode elsewhere), their differentiable
                    entry, tiling, and GPU launch table (tuned only when asked)
    shards          a kernel on a mesh: run per shard of the batch (shard_map)
    refused         a value that raises a named error where a program is lowered for a
                    platform that cannot run it
"""
