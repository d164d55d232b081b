"""Block recompute (remat "block"): the forward keeps each block's input, nothing else.

    forward:  x_{l+1} = block_l(x_l), l = 0 .. L-1        keeps x_l (L, B, T, D)
    backward: _, res_l = block_fwd(p_l, x_l)              recomputes block l's residuals
              dp_l, dx_l = block_bwd(res_l, dx_{l+1})     then undoes it
Only one block's residuals are alive at a time, in the forward and in the backward.
"""

from __future__ import annotations

import jax

from jaxformer.model.config import ModelConfig
from manual_grads.block import block_bwd, block_fwd


def blocks_fwd(blocks, x, config: ModelConfig):
    """blocks: params["blocks"] (leading axis L); x (B, T, D) -> (y (B, T, D), residuals).
    remat "none": the residuals are each block's, stacked on L; "block": the inputs x_l (L, B, T, D)."""
    if config.remat == "block":
        step = lambda x, p: (block_fwd(p, x, config)[0], x)  # noqa: E731  keep the input only
    else:
        step = lambda x, p: block_fwd(p, x, config)  # noqa: E731
    return jax.lax.scan(step, x, blocks)


def blocks_bwd(blocks, res, dy, config: ModelConfig):
    """dy (B, T, D) -> (dblocks with params["blocks"]' stacked layout, dx (B, T, D)):
    a reverse scan; with remat "block" each step first recomputes its block's forward."""
    if config.remat == "block":
        def step(dx, xs):
            p, x = xs
            _, block_res = block_fwd(p, x, config)  # x_{l+1} = block_l(x_l), recomputed
            dp, dx = block_bwd(block_res, dx)
            return dx, dp
        dx, dblocks = jax.lax.scan(step, dy, (blocks, res), reverse=True)
    else:
        def step(dx, block_res):
            dp, dx = block_bwd(block_res, dx)  # x_{l+1} = block_l(x_l)
            return dx, dp
        dx, dblocks = jax.lax.scan(step, dy, res, reverse=True)
    return dblocks, dx
