"""Hand-derived backward passes for the jaxformer model.

One module per layer kind, each pairing ``*_fwd(...) -> (y, res)`` with
``*_bwd(res, dy) -> (dparams, dx)`` (the ``jax.custom_vjp`` signature), and
``value_and_grad(params, batch, config) -> (loss, grads)`` composing them for the
whole model. ``custom_vjp`` registers the pairs with JAX, so JAX's ``grad`` can
run them; ``tap`` is the optional observer of every stage of the manual forward and
backward; ``check`` compares gradient trees and runs finite differences.
"""

from manual_grads import (activations, attention, block, check, custom_vjp, embedding,
                          layer_norm, linear, losses, model, tap)
from manual_grads.model import value_and_grad

__all__ = [
    "value_and_grad", "activations", "attention", "block", "check", "custom_vjp",
    "embedding", "layer_norm", "linear", "losses", "model", "tap",
]
