"""The blocks over the layers, and block recompute (remat "block").

    forward:  x_{l+1}, res_l = block_fwd(p_l, x_l), l = 0 .. L-1    lax.scan; keeps res_l
    backward: dp_l, dx_l = block_bwd(res_l, dx_{l+1})               reverse scan
With remat "block" the forward keeps each block's input x_l (L, B, T, D), nothing else:
    backward: _, res_l = block_fwd(p_l, x_l)              recomputes block l's residuals
              dp_l, dx_l = block_bwd(res_l, dx_{l+1})     then undoes it
Only one block's residuals are alive at a time, in the forward and in the backward.

With a ``tap`` (tap.py), with at most UNROLL_MAX_LAYERS layers and no recompute, or when the
caller asks (``unroll=True``: model.py does for a program lowered for a GPU), the layers run
as a Python loop (the tap inspects values eagerly; a shallow model runs faster unrolled),
the kept values are a list with one entry per layer and the parameter gradients are
stacked at the end; layer l's stages are named under "blocks[l]." for the tap; a
recomputed forward is not shown to the tap again.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxformer.model.config import ModelConfig
from jaxformer.model.dropout import layer_key
from jaxformer.model.layer_kinds import mixed, per_layer
from jaxformer.model.moe import ffn_output
from manual_grads.block import block_bwd, block_fwd
from manual_grads.tap import within


# Up to this many layers the blocks run as a Python loop (unrolled) rather than a
# lax.scan: at small shapes a scan's stacked residual and gradient buffers (zero-filled,
# then written and read a layer at a time) cost about as much as the blocks' elementwise
# work; unrolled, each layer's residuals are plain arrays and only the L parameter
# gradients are stacked at the end. Deeper models keep the scan: compile time grows with
# unrolled depth and the gain is gone once the products dominate (docs/design.md,
# "Speed of the manual backward"). Recompute always scans: unrolled, the recomputed
# forward is the same expression as the original one, XLA merges the two, and the
# residuals are kept after all (the memory saving measured 1.0x, tests/test_memory.py);
# inside the backward scan's body the recompute cannot be merged away.
# On a GPU every depth runs unrolled (model.py, ``unroll_on_gpu``; GPU_UNROLL False keeps the
# scan there too, for measuring): there the scan's copies of the stacked residuals and
# gradients cost 8 ms of a 42 ms GPT-2 step (docs/benchmark.md).
UNROLL_MAX_LAYERS = 4
GPU_UNROLL = True


def unrolled(config: ModelConfig) -> bool:
    """Whether the blocks run as a Python loop at any platform: n_layers <= UNROLL_MAX_LAYERS,
    or layers of two attention kinds (layer_kinds.py: their residuals differ), with remat "none"."""
    return (config.n_layers <= UNROLL_MAX_LAYERS or mixed(config)) and config.remat == "none"


def keeps_inputs(config: ModelConfig) -> bool:
    """Whether a sharded scan over the blocks (parallel/tensor.py's, parallel/context.py's) keeps
    each layer's input alone, its backward running the layer again: with remat "block", and with
    layers of several kinds, whose residuals have a structure of their own that lax.switch
    (layer_kinds.per_layer) cannot return (one device runs such layers as a Python loop instead:
    ``unrolled``)."""
    return config.remat == "block" or mixed(config)


def python_loop(config: ModelConfig, tap=None, unroll: bool = False) -> bool:
    """Whether blocks_fwd / blocks_bwd run the layers as a Python loop: under a ``tap``, for
    a shallow model (``unrolled``), and where the caller asks (``unroll``) with remat "none"
    (a recompute always scans, see above)."""
    return tap is not None or unrolled(config) or (unroll and config.remat == "none")


def _layer(blocks, l):
    """Layer l's slice of params["blocks"]."""
    return jax.tree_util.tree_map(lambda a: a[l], blocks)


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class ParamRef:
    """In a layer's kept residuals, the place of one of the layer's own params (a linear's w
    and b): ``path`` into its slice of params["blocks"]. The params are the step's inputs,
    alive for all of it anyway; kept as values they would be copies of their own, stacked
    by a scan or, unrolled, sliced out of params["blocks"] for the backward's barrier (GPT-2
    on an H100: 198 kernels a step). The backward reads them from params["blocks"] again,
    the same slice, so a weight's bfloat16 cast is the forward's too."""
    path: tuple


def _named(res, p):
    """res with each leaf that is one of the layer params ``p`` themselves replaced by its ParamRef."""
    where = {id(a): path for path, a in jax.tree_util.tree_flatten_with_path(p)[0]}
    return jax.tree_util.tree_map(lambda a: ParamRef(where[id(a)]) if id(a) in where else a, res)


def _filled(res, p):
    """res with each ParamRef replaced by that param of the layer's ``p``: _named undone."""
    values = dict(jax.tree_util.tree_flatten_with_path(p)[0])
    return jax.tree_util.tree_map(lambda a: values[a.path] if isinstance(a, ParamRef) else a, res,
                                  is_leaf=lambda a: isinstance(a, ParamRef))


def _key(key, l):
    """Layer l's dropout key (dropout.layer_key), or None."""
    return None if key is None else layer_key(key, l)


def blocks_fwd(blocks, x, config: ModelConfig, tap=None, key=None, segments=None, unroll=False):
    """blocks: params["blocks"] (leading axis L); x (B, T, D) -> (y (B, T, D), kept).
    remat "none": kept are each block's residuals, stacked on L; "block": the inputs x_l (L, B, T, D)
    (unrolled or with a tap: a list of L per-layer residuals or inputs (B, T, D)).
    ``key``: the step's dropout key (None: no dropout); layer l draws from layer_key(key, l).
    With n_experts y is (y, the MoeStats stacked on L). ``segments`` (B, T): every attention's
    document ids (None: one document a row). ``unroll``: a Python loop at any depth (remat
    "none" only)."""

    def step(x, p, l, tap=None):
        def run(c):  # layer l's config (layer_kinds.per_layer); a scan keeps only x with mixed kinds
            out, res = block_fwd(p, x, c, tap, _key(key, l), segments)  # x_{l+1} = block_l(x_l)
            y, stats = ffn_output(out, config)
            return y, ((x if config.remat == "block" else _named(res, p)), stats)
        return per_layer(config, l, run)

    if not python_loop(config, tap, unroll):
        x, (kept, stats) = jax.lax.scan(lambda x, xs: step(x, *xs), x, (blocks, jnp.arange(config.n_layers)))
    else:
        kept, stats = [], []
        for l in range(config.n_layers):
            x, (k, s) = step(x, _layer(blocks, l), l, within(tap, f"blocks[{l}].") if tap else None)
            kept.append(k)
            stats.append(s)
        stats = jax.tree_util.tree_map(lambda *s: jnp.stack(s), *stats) if config.n_experts else None
    return ((x, stats) if config.n_experts else x), kept


def blocks_bwd(blocks, kept, dy, config: ModelConfig, tap=None, key=None, segments=None, unroll=False):
    """dy (B, T, D) -> (dblocks with params["blocks"]' stacked layout, dx (B, T, D)):
    a reverse scan; with remat "block" each step first recomputes its block's forward
    (with the same dropout ``key``, hence the same masks). With n_experts dy is (dy, the
    stacked MoeStats' cotangents). ``unroll``: as blocks_fwd's (the two must agree).

    Unrolled, each layer's backward reads its kept values through an optimization barrier:
    the forward and the backward are then one program, and without it XLA merges what a
    backward recomputes from its residuals (gelu_tanh's tanh, a norm's normalized x) with
    the forward's own expression and keeps that too, in float32, for every layer (GPT-2
    on an H100: 12 x 192 MiB more temporaries). The backward keeps to its residuals."""
    dy, dstats = ffn_output(dy, config)

    def step(dx, p, k, ds, l, tap=None):
        def run(c, k=k):  # layer l's config (layer_kinds.per_layer)
            if config.remat == "block":
                _, k = block_fwd(p, k, c, None, _key(key, l), segments)  # x_{l+1} = block_l(x_l), recomputed
            else:
                k = _filled(k, p)  # the params the forward kept by name
            dp, dx_l = block_bwd(k, dx if ds is None else (dx, ds), tap)  # x_{l+1} = block_l(x_l)
            return dx_l, dp
        return per_layer(config, l, run)

    if not python_loop(config, tap, unroll):
        dx, dblocks = jax.lax.scan(lambda dx, xs: step(dx, *xs), dy,
                                   (blocks, kept, dstats, jnp.arange(config.n_layers)), reverse=True)
        return dblocks, dx
    dps = [None] * config.n_layers
    dx = dy
    for l in reversed(range(config.n_layers)):
        ds = None if dstats is None else _layer(dstats, l)
        k = kept[l] if tap else jax.lax.optimization_barrier(kept[l])  # only its residuals, see above
        dx, dps[l] = step(dx, _layer(blocks, l), k, ds, l, within(tap, f"blocks[{l}].") if tap else None)
    return jax.tree_util.tree_map(lambda *g: jnp.stack(g), *dps), dx
