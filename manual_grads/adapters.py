"""The adapters' gradient by hand: value_and_grad(adapters, batch, base, config, lora, key).

The manual backward of the model with the adapters attached (jaxformer/model/lora.py
``attach``), of which only the adapters' part is returned: under jit the frozen weights'
dW, the norms', biases' and embeddings' gradients are never used, so XLA never computes
them (docs/finetune.md measures the memory and FLOPs it saves).
"""

from __future__ import annotations

from jaxformer.model.lora import LoraConfig, adapter_grads, attach
from manual_grads.model import value_and_grad as model_value_and_grad


def value_and_grad(adapters, batch, base, config, lora: LoraConfig, key=None):
    """(loss, grads) with grads the tree of ``adapters``; jit with config and lora static."""
    loss, grads = model_value_and_grad(attach(base, adapters, lora, key), batch, config, key)
    return loss, adapter_grads(grads)
