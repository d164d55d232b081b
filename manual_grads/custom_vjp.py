"""The manual backward passes registered as ``jax.custom_vjp`` rules.

Each function here is a drop-in replacement for the ``jaxformer.model.layers``
function of the same name and signature: same output, but JAX's ``grad`` runs the
hand-derived backward. Static arguments (eps, chunk, compute_dtype, names, config)
are ``nondiff_argnums``; integer token ids and targets, and the loss mask, get
``None`` (zero) cotangents. Mixing is free: any of these layers can sit in a
model whose other layers JAX's ``grad`` differentiates itself.

``features``, ``forward`` and ``loss_fn`` below are jaxformer.model.transformer's own
functions given these layers (``LAYERS``, a ``ModelLayers``): the model's sequence is
written once, there, and JAX's ``grad`` of ``loss_fn`` returns the manual gradients.
``block`` registers the whole block (manual_grads/block.py) as one rule.
"""

from __future__ import annotations

import jax

from jaxformer.model import transformer
from jaxformer.model.config import ModelConfig
from jaxformer.model.transformer import ModelLayers
from manual_grads import activations as _act
from manual_grads import attention as _attn
from manual_grads import block as _block
from manual_grads import chunked_loss as _chunked
from manual_grads import embedding as _emb
from manual_grads import layer_norm as _ln
from manual_grads import linear as _lin
from manual_grads import losses as _loss
from manual_grads import mlp as _mlp
from manual_grads import moe_parallel as _moe_parallel
from manual_grads import softcap as _cap
from manual_grads.embedding import embed_params


def _register(fwd, bwd, nondiff_argnums=()):
    """A custom_vjp function whose primal is fwd's output and whose rule is the
    pair: ``fwd(*args) -> (y, res)``, ``bwd(res, dy) -> one cotangent per
    differentiable argument``."""
    f = jax.custom_vjp(lambda *args: fwd(*args)[0], nondiff_argnums=nondiff_argnums)
    f.defvjp(fwd, lambda *args: bwd(*args[-2:]))  # args = (*nondiff, res, dy)
    return f


# linear(x, w, b): the argument order of jaxformer.layers.linear


def _linear_fwd(x, w, b, compute_dtype):
    return _lin.linear_fwd({"w": w, "b": b}, x, compute_dtype)


def _linear_bwd(res, dy):
    dp, dx = _lin.linear_bwd(res, dy)
    return _lin.widened(dx, dy), dp["w"], dp["b"]


def _linear_nb_fwd(x, w, compute_dtype):
    return _lin.linear_fwd({"w": w}, x, compute_dtype)


def _linear_nb_bwd(res, dy):
    dp, dx = _lin.linear_bwd(res, dy)
    return _lin.widened(dx, dy), dp["w"]


_linear = _register(_linear_fwd, _linear_bwd, nondiff_argnums=(3,))
_linear_no_bias = _register(_linear_nb_fwd, _linear_nb_bwd, nondiff_argnums=(2,))


def linear(x, w, b=None, compute_dtype=None):
    """x @ w + b (b None: no bias), the product in ``compute_dtype`` (None: the inputs' dtype)."""
    if b is None:
        return _linear_no_bias(x, w, compute_dtype)
    return _linear(x, w, b, compute_dtype)


# activations(x)
gelu = _register(_act.gelu_fwd, lambda res, dy: (_act.gelu_bwd(res, dy),))
gelu_tanh = _register(_act.gelu_tanh_fwd, lambda res, dy: (_act.gelu_tanh_bwd(res, dy),))
relu = _register(_act.relu_fwd, lambda res, dy: (_act.relu_bwd(res, dy),))
tanh = _register(_act.tanh_fwd, lambda res, dy: (_act.tanh_bwd(res, dy),))
ACTIVATION_FNS = {"gelu": gelu, "gelu_tanh": gelu_tanh, "relu": relu, "tanh": tanh}


def activation(name: str, x):
    return ACTIVATION_FNS[name](x)


# layers with parameters: (p, x, *static) -> y, cotangents (dp, dx)
layer_norm = _register(_ln.layer_norm_fwd, _ln.layer_norm_bwd, nondiff_argnums=(2,))
_block_rule = _register(lambda p, x, key, segments, config: _block.block_fwd(p, x, config, None, key, segments),
                        lambda res, dy: (*_block.block_bwd(res, dy), None, None), nondiff_argnums=(4,))


def block(p, x, config: ModelConfig, key=None, segments=None):
    """One block, the hand-derived block_bwd its rule; ``key``: the layer's dropout key;
    ``segments`` (B, T): the attention's document ids (no cotangent)."""
    return _block_rule(p, x, key, segments, config)
_attention = _register(lambda p, x, key, segments, config: _attn.attention_fwd(p, x, config, key, segments),
                       lambda res, dy: (*_attn.attention_bwd(res, dy), None, None), nondiff_argnums=(4,))
_feed_forward = _register(_mlp.feed_forward_fwd, _mlp.feed_forward_bwd, nondiff_argnums=(2, 3))


def attention(p, x, config: ModelConfig, key=None, segments=None):
    """p = {wq, bq, wk, bk, wv, bv, wo, bo, q_norm?, k_norm?}; x (B, T, D) -> (B, T, D), around
    the core config.attention_impl names (full, blockwise or pallas: those with a hand-derived
    backward); ``key``: the probabilities' dropout key; ``segments``: (B, T) document ids."""
    return _attention(p, x, key, segments, config)


def feed_forward(p, x, activation_name, compute_dtype=None):
    """p = {w_in, b_in, w_out, b_out} or gated {w_gate, w_up, w_down, b_*}; x (..., D) -> (..., D)."""
    return _feed_forward(p, x, activation_name, compute_dtype)


def _moe_bwd(res, dout):
    dy, dstats = dout  # the output is (y, MoeStats): the statistics' cotangents join the residual
    return _moe_parallel.moe_layer_bwd(res._replace(dstats=dstats), dy)


_moe_rule = _register(_moe_parallel.moe_layer_fwd, _moe_bwd, nondiff_argnums=(2,))


def moe(p, x, config: ModelConfig):
    """The mixture-of-experts layer p = {router, w_gate, w_up, w_down, shared?, shared_gate?}; x (..., D) ->
    (y (..., D), MoeStats), the hand-derived moe_bwd its rule (jaxformer.model.moe.moe; expert
    parallel on a trace mesh with an expert axis, jaxformer.model.moe_parallel.moe_layer)."""
    return _moe_rule(p, x, config)


# remat "block": the rule keeps (p, x, key) and recomputes the block's forward in its backward
def _remat_block_fwd(p, x, key, segments, config):
    y, _ = _block.block_fwd(p, x, config, None, key, segments)
    return y, (p, x, key, segments)


def _remat_block_bwd(config, res, dy):
    p, x, key, segments = res
    _, block_res = _block.block_fwd(p, x, config, None, key, segments)  # y = block(p, x), recomputed
    return (*_block.block_bwd(block_res, dy), None, None)


_remat_block = jax.custom_vjp(
    lambda p, x, key, segments, config: _block.block_fwd(p, x, config, None, key, segments)[0], nondiff_argnums=(4,))
_remat_block.defvjp(_remat_block_fwd, _remat_block_bwd)


def remat_block(p, x, config: ModelConfig, key=None, segments=None):
    """block keeping only (p, x, key, segments) for its backward, which recomputes the forward."""
    return _remat_block(p, x, key, segments, config)

# embeddings: integer ids get None
token_embedding = _register(_emb.token_embed_fwd, _emb.token_embed_bwd)
_embed = _register(lambda p, inputs, key, config: _emb.embed_fwd(p, inputs, config, key),
                   lambda res, dx: (*_emb.embed_bwd(res, dx), None), nondiff_argnums=(3,))


def embed(params, inputs, config: ModelConfig, key=None):
    """inputs int (B, T) -> tok_embed[inputs] + positions (B, T, D); ``key``: its dropout's."""
    return _embed(embed_params(params), inputs, key, config)


# the loss: targets and mask get None
_cross_entropy = _register(_loss.cross_entropy_fwd, _loss.cross_entropy_bwd)


def cross_entropy(logits, targets, mask=None):
    """Mean of -log softmax(logits)[target] over positions where mask is 1 (0, with a
    gradient of 0, when no position counts)."""
    return _cross_entropy(logits, targets, mask)


# the head and the loss, chunk by chunk: (head, x, targets, mask, chunk, compute_dtype, cap);
# targets and mask get None
def _chunked_head_loss_bwd(res, dloss):
    dp, dx = _chunked.chunked_head_loss_bwd(res, dloss)  # dp: {"w", "b"?}, the head's own keys
    return dp, dx, None, None


_chunked_head_loss = _register(_chunked.chunked_head_loss_fwd, _chunked_head_loss_bwd,
                               nondiff_argnums=(4, 5, 6))


def chunked_head_loss(head, x, targets, mask, chunk, compute_dtype=None, cap=0.0):
    """The mean cross entropy of x @ w + b (capped to c tanh(. / c) with ``cap`` c > 0), C =
    ``chunk`` positions at a time (0, with a gradient of 0, when the mask sums to 0)."""
    return _chunked_head_loss(head, x, targets, mask, chunk, compute_dtype, cap)


# softcap(x, cap): the logits' cap (logit_softcap); cap is static
softcap = _register(_cap.softcap_fwd, lambda t, dy: (_cap.softcap_bwd(t, dy),), nondiff_argnums=(1,))


# ----------------------------------------------------------------------------
# RMS norm, rotary positions, SiLU and ReLU^2: drop-ins for jaxformer.model.rms_norm.rms_norm,
# jaxformer.model.rotary.apply_rope and jaxformer.model.activations' silu and relu2

from manual_grads import rms_norm as _rms  # noqa: E402
from manual_grads import rotary as _rope  # noqa: E402

silu = _register(_act.silu_fwd, lambda res, dy: (_act.silu_bwd(res, dy),))
relu2 = _register(_act.relu2_fwd, lambda res, dy: (_act.relu2_bwd(res, dy),))
ACTIVATION_FNS.update(silu=silu, relu2=relu2)  # activation(name, x) knows them too

# rms_norm(p, x, eps, offset=0.0): p = {"scale": (D,)} or {}; dp has p's keys
_rms_norm = _register(_rms.rms_norm_fwd, _rms.rms_norm_bwd, nondiff_argnums=(2, 3))


def rms_norm(p, x, eps, offset=0.0):
    """x * rsqrt(mean(x^2) + eps) * scale (as (offset + scale) where offset is not 0)."""
    return _rms_norm(p, x, eps, offset)

# apply_rope(x, cos, sin): the tables get None (zero) cotangents; they are functions of
# integer positions, so nothing upstream of them has a gradient
apply_rope = _register(_rope.rope_fwd, lambda res, dy: (_rope.rope_bwd(res, dy), None, None))


# ----------------------------------------------------------------------------
# the model: jaxformer.model.transformer's one sequence, composed of the layers above

LAYERS = ModelLayers(embed, block, remat_block, layer_norm, linear, cross_entropy, chunked_head_loss,
                     rms_norm, softcap)


def features(params, inputs, config: ModelConfig, key=None, segments=None):
    """inputs int (B, T) -> the head's input (B, T, D); remat "block" uses remat_block."""
    return transformer.features(params, inputs, config, LAYERS, key, segments)


def forward(params, inputs, config: ModelConfig, key=None, segments=None):
    """inputs int (B, T) -> logits (B, T, V); ``segments`` (B, T): packed documents' ids."""
    return transformer.forward(params, inputs, config, LAYERS, key, segments)


def loss_fn(params, batch, config: ModelConfig, key=None):
    """Mean next-token cross entropy; JAX's ``grad`` of it runs the manual backward.
    loss_chunk > 0 runs the head and the loss chunk by chunk (chunked_head_loss).
    ``key``: dropout's PRNG key (None: no dropout). The tied head's product
    x @ tok_embed^T is the linear rule on the transposed table; JAX adds its
    gradient into tok_embed's."""
    return transformer.loss_fn(params, batch, config, LAYERS, key)
