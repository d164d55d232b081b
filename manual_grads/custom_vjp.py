"""The manual backward passes registered as ``jax.custom_vjp`` rules.

Each function here is a drop-in replacement for the ``jaxformer.layers``
function of the same name and signature: same output, but JAX's ``grad`` runs the
hand-derived backward. Static arguments (eps, n_heads, causal, names, config)
are ``nondiff_argnums``; integer token ids and targets, and the loss mask, get
``None`` (zero) cotangents. Mixing is free: any of these layers can sit in a
model whose other layers JAX's ``grad`` differentiates itself.

``forward`` and ``loss_fn`` below are the whole model built from these layers,
so JAX's ``grad`` of ``loss_fn`` returns the manual gradients.
"""

from __future__ import annotations

import jax

from jaxformer.config import ModelConfig
from jaxformer.layers import upcast
from jaxformer.model import validate_batch, validate_tokens
from manual_grads import activations as _act
from manual_grads import attention as _attn
from manual_grads import block as _block
from manual_grads import embedding as _emb
from manual_grads import layer_norm as _ln
from manual_grads import linear as _lin
from manual_grads import losses as _loss
from manual_grads.model import embed_params


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
    return dx, dp["w"], dp["b"]


_linear = _register(_linear_fwd, _linear_bwd, nondiff_argnums=(3,))


def linear(x, w, b, compute_dtype=None):
    """x @ w + b, the product in ``compute_dtype`` (None: the inputs' dtype)."""
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
attention = _register(_attn.attention_fwd, _attn.attention_bwd, nondiff_argnums=(2, 3))
feed_forward = _register(_block.feed_forward_fwd, _block.feed_forward_bwd, nondiff_argnums=(2,))
block = _register(_block.block_fwd, _block.block_bwd, nondiff_argnums=(2,))

# embeddings: integer ids get None
token_embedding = _register(_emb.token_embed_fwd, _emb.token_embed_bwd)
_embed = _register(_emb.embed_fwd, _emb.embed_bwd, nondiff_argnums=(2,))


def embed(params, inputs, config: ModelConfig):
    """inputs int (B, T) -> tok_embed[inputs] + positions (B, T, D)."""
    return _embed(embed_params(params), inputs, config)


# the loss: targets and mask get None
_cross_entropy = _register(_loss.cross_entropy_fwd, _loss.cross_entropy_bwd)


def cross_entropy(logits, targets, mask=None):
    """Mean of -log softmax(logits)[target] over positions where mask is 1."""
    return _cross_entropy(logits, targets, mask)


# ----------------------------------------------------------------------------
# the model, as jaxformer.model builds it, from the layers above


def forward(params, inputs, config: ModelConfig):
    """inputs int (B, T) -> logits (B, T, V)."""
    validate_tokens("inputs", inputs, config)
    x = upcast(embed(params, inputs, config))  # (B, T, D), float32 or wider
    x, _ = jax.lax.scan(lambda x, p: (block(p, x, config), None), x, params["blocks"])
    if config.norm == "pre":
        x = layer_norm(params["ln_f"], x, config.ln_eps)
    return linear(x, params["head"]["w"], params["head"]["b"], config.compute_dtype)  # (B, T, V)


def loss_fn(params, batch, config: ModelConfig):
    """Mean next-token cross entropy; JAX's ``grad`` of it runs the manual backward."""
    validate_batch(batch, config)
    logits = forward(params, batch["inputs"], config)
    return cross_entropy(logits, batch["targets"], batch.get("mask"))
