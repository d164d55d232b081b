"""Layers of several kinds: sliding-window or full attention (ModelConfig.layer_types), each
with or without rotary positions (rope_layers); a sliding layer rotates with its own base where
rope_local_theta is set.

The blocks run under ``lax.scan`` over params["blocks"] and the layer index l, and a
core's mask and the rotary tables are static (AttentionSpec.window, rotary.rope_spec), so a
layer's kind cannot be a Python branch on l inside the scan. ``per_layer(config, l, fn)`` runs
``fn(layer_config(config, *kind))`` for layer l: with every layer alike ``fn(config)`` itself,
with a Python int l the layer's own config, and with a traced l a ``lax.switch`` on the layer's
kind index between the kinds' configs (all traced, one run per layer; ``lax.cond`` for two).
What fn returns must have one structure for every kind (the scans' outputs: activations,
gradients, caches).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxformer.model.config import ModelConfig


class LayerKind(NamedTuple):
    windowed: bool  # its attention reads a sliding window (ModelConfig.sliding_window)
    roped: bool = True  # it rotates q and k (positions "rope", its rope_layers entry 1)


def layer_kinds(config: ModelConfig) -> tuple[LayerKind, ...]:
    """Each layer's kind."""
    return tuple(LayerKind(w, r) for w, r in zip(config.windowed_layers, config.roped_layers))


def mixed(config: ModelConfig) -> bool:
    """Whether the layers are of more than one kind."""
    return len(set(layer_kinds(config))) > 1


def layer_config(config: ModelConfig, windowed: bool, roped: bool = True) -> ModelConfig:
    """The config of one layer of the kind (``windowed``, ``roped``) names: layer_types (), the
    window kept (sliding) or 0 (full), rope_local_theta kept on a sliding layer, rope_layers ()
    (rotating) or all 0."""
    return config.replace(layer_types=(), sliding_window=config.sliding_window if windowed else 0,
                          rope_local_theta=config.rope_local_theta if windowed else 0.0,
                          rope_layers=() if roped or config.positions != "rope" else (0,) * config.n_layers)


def per_layer(config: ModelConfig, l, fn):
    """fn(the config of layer l) (l a Python int or a traced int32 scalar; see the module's text)."""
    kinds = layer_kinds(config)
    distinct = sorted(set(kinds))
    if len(distinct) == 1:
        return fn(config)
    if isinstance(l, int):
        return fn(layer_config(config, *kinds[l]))
    index = jnp.asarray([distinct.index(k) for k in kinds], jnp.int32)[l]
    return jax.lax.switch(index, [lambda k=k: fn(layer_config(config, *k)) for k in distinct])
