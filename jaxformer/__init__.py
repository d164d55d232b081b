"""jaxformer: a transformer language model as pure JAX functions, with hand-derived
gradients (see ``manual_grads``) proven equal to ``jax.grad``."""

import os
import sys

try:
    from jaxformer.model.config import PRESETS, ModelConfig, get_preset
    from jaxformer.model.losses import cross_entropy
    from jaxformer.model.transformer import forward, loss_fn
    from jaxformer.model.params import count_params, init_params
except ModuleNotFoundError as e:  # a dependency (jax) is not installed: say how to install it
    if (e.name or "jaxformer").partition(".")[0] in ("jaxformer", "manual_grads"):
        raise
    hint = (f"jaxformer needs the package {e.name!r}, which {sys.executable} does not have; "
            "install the dependencies with `pip install -e .` in the jaxformer folder")
    if sys.argv[:1] == ["-m"] or os.path.basename(sys.argv[0]) == "jaxformer":
        print(f"error: {hint}", file=sys.stderr)  # the command: one line, not a traceback
        raise SystemExit(2) from None
    raise ModuleNotFoundError(hint, name=e.name) from None

__all__ = [
    "ModelConfig", "PRESETS", "get_preset", "init_params", "count_params",
    "forward", "loss_fn", "cross_entropy",
]
__version__ = "0.1.0"
