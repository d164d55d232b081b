"""The blocks' forward and reverse scans, and block recompute (remat "block").

    remat "none":  x_{l+1}, res_l = block_fwd(p_l, x_l)      keeps res_l, stacked (L, ...)
                   dp_l, dx_l = block_bwd(res_l, dx_{l+1})  reverse scan over the stacked res_l
    remat "block": x_{l+1} = block_l(x_l)                   keeps x_l (L, B, T, D)
                   _, res_l = block_fwd(p_l, x_l)           recomputes block l's residuals
                   dp_l, dx_l = block_bwd(res_l, dx_{l+1})  then undoes it
With remat "block" only one block's residuals are alive at a time.

A block's residuals hold some of its params by reference (LayerNormRes.scale,
LinearRes.w, QKVRes.wq, ...). Stacked by the scan, each would be a copy of that
params leaf; so the forward scan stacks only the other leaves, and the reverse scan
puts each block's params back into its residuals from params["blocks"] (StackedRes).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

from jaxformer.config import ModelConfig
from manual_grads.block import block_bwd, block_fwd


@dataclasses.dataclass(frozen=True)
class StackedRes:
    """The blocks' residuals without the params they hold."""
    kept: list  # the residual leaves that are not params, stacked (L, ...)
    treedef: Any  # static: the tree structure of one block's residuals
    param_at: tuple  # static: per residual leaf, the index of the params leaf it is, or None


jax.tree_util.register_dataclass(StackedRes, data_fields=["kept"],
                                 meta_fields=["treedef", "param_at"])


def strip_params(res, p):
    """One block's residuals -> (the leaves that are not p's leaves, treedef, param_at)."""
    leaves, treedef = jax.tree_util.tree_flatten(res)
    index = {id(a): i for i, a in enumerate(jax.tree_util.tree_leaves(p))}
    param_at = tuple(index.get(id(a)) for a in leaves)
    return [a for a, i in zip(leaves, param_at) if i is None], treedef, param_at


def refill_params(kept, treedef, param_at, p):
    """The inverse of strip_params: one block's residuals, p's leaves put back."""
    p_leaves, kept = jax.tree_util.tree_leaves(p), iter(kept)
    leaves = [next(kept) if i is None else p_leaves[i] for i in param_at]
    return jax.tree_util.tree_unflatten(treedef, leaves)


def blocks_fwd(blocks, x, config: ModelConfig):
    """blocks: params["blocks"] (leading axis L); x (B, T, D) -> (y (B, T, D), residuals).
    remat "none": a StackedRes of the blocks' residuals; "block": the inputs x_l (L, B, T, D)."""
    if config.remat == "block":
        return jax.lax.scan(lambda x, p: (block_fwd(p, x, config)[0], x), x, blocks)
    layout = {}

    def step(x, p):
        y, res = block_fwd(p, x, config)
        kept, layout["treedef"], layout["param_at"] = strip_params(res, p)
        return y, kept

    y, kept = jax.lax.scan(step, x, blocks)
    return y, StackedRes(kept, layout["treedef"], layout["param_at"])


def blocks_bwd(blocks, res, dy, config: ModelConfig):
    """dy (B, T, D) -> (dblocks with params["blocks"]' stacked layout, dx (B, T, D)):
    a reverse scan over (params["blocks"], residuals); with remat "block" each step
    first recomputes its block's forward."""
    if config.remat == "block":
        def step(dx, xs):
            p, x = xs
            _, block_res = block_fwd(p, x, config)  # x_{l+1} = block_l(x_l), recomputed
            dp, dx = block_bwd(block_res, dx)
            return dx, dp
        dx, dblocks = jax.lax.scan(step, dy, (blocks, res), reverse=True)
    else:
        def step(dx, xs):
            p, kept = xs
            block_res = refill_params(kept, res.treedef, res.param_at, p)
            dp, dx = block_bwd(block_res, dx)  # x_{l+1} = block_l(x_l)
            return dx, dp
        dx, dblocks = jax.lax.scan(step, dy, (blocks, res.kept), reverse=True)
    return dblocks, dx
