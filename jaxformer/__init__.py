"""jaxformer: a transformer language model as pure JAX functions, with hand-derived
gradients (see ``manual_grads``) proven equal to ``jax.grad``."""

from jaxformer.model.config import PRESETS, ModelConfig, get_preset
from jaxformer.model.losses import cross_entropy
from jaxformer.model.transformer import forward, loss_fn
from jaxformer.model.params import count_params, init_params

__all__ = [
    "ModelConfig", "PRESETS", "get_preset", "init_params", "count_params",
    "forward", "loss_fn", "cross_entropy",
]
__version__ = "0.1.0"
