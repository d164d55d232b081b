"""Layers of two kinds: sliding-window and full attention (ModelConfig.layer_types).

The blocks run under ``lax.scan`` over params["blocks"] and the layer index l, and a
core's mask is static (AttentionSpec.window), so a layer's kind cannot be a Python branch
on l inside the scan. ``per_layer(config, l, fn)`` runs ``fn(layer_config(config, windowed))``
for layer l: with every layer alike (layer_types () or one kind) ``fn(config)`` itself, with
a Python int l the layer's own config, and with a traced l a ``lax.cond`` on the scanned
flag between the two kinds' configs (both traced, one run per layer). What fn returns must
have one structure for both kinds (the scans' outputs: activations, gradients, caches).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxformer.model.config import ModelConfig


def mixed(config: ModelConfig) -> bool:
    """Whether the layers mix sliding-window and full attention."""
    return len(set(config.windowed_layers)) > 1


def layer_config(config: ModelConfig, windowed: bool) -> ModelConfig:
    """The config of one layer of the kind ``windowed`` names: layer_types (), and the
    window kept (sliding) or 0 (full)."""
    return config.replace(layer_types=(), sliding_window=config.sliding_window if windowed else 0)


def per_layer(config: ModelConfig, l, fn):
    """fn(the config of layer l) (l a Python int or a traced int32 scalar; see the module's text)."""
    if not mixed(config):
        return fn(config)
    if isinstance(l, int):
        return fn(layer_config(config, config.windowed_layers[l]))
    windowed = jnp.asarray(config.windowed_layers)[l]
    return jax.lax.cond(windowed, lambda: fn(layer_config(config, True)), lambda: fn(layer_config(config, False)))
