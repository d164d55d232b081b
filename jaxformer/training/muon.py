"""Muon (optax.contrib.scale_by_muon) for the hidden weight matrices of the stacked
blocks, AdamW for every other leaf: the groups ``make_optimizer("muon", ...)`` puts
after its clipping (optim.py)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import optax
from optax import contrib


# A stacked matrix (L, in, out): axis 0 is a batch axis, so Newton-Schulz orthogonalises
# each layer's (in, out) matrix on its own (optax vmaps over the batch axes).
LAYER_MATRIX = contrib.MuonDimensionNumbers(reduction_axis=1, output_axis=2)


def _is_norm(key) -> bool:
    return isinstance(key, str) and (key.startswith("ln") or key.endswith("norm"))


def muon_labels(params):
    """"muon" for the leaves Muon updates, "adamw" for the others. By rule, not by
    name: a leaf under "blocks" with 3 dims (the layer axis L, then a matrix: wq, w_in,
    w_gate, ...) that sits under no norm (keys "ln*", "*norm"). Embeddings, the head,
    norm scales and biases (under blocks: 2 dims, (L, D)) are AdamW's."""

    def label(path, leaf):
        keys = [getattr(entry, "key", None) for entry in path]
        matrix = keys[:1] == ["blocks"] and len(jnp.shape(leaf)) == 3
        return "muon" if matrix and not any(_is_norm(k) for k in keys) else "adamw"

    return jax.tree_util.tree_map_with_path(label, params)


def _layer_matrices(updates):
    """The dimension numbers of the Muon group's leaves (all stacked matrices); the
    leaves of the other group are optax's MaskedNode, which have no leaves to map."""
    return jax.tree_util.tree_map(lambda _: LAYER_MATRIX, updates)


def scale_by_width() -> optax.GradientTransformation:
    """Muon's width scaling (Keller Jordan's, optax's default): each stacked (L, in, out)
    update times sqrt(max(1, out / in)), so a wide output keeps its per-entry size."""

    def update(updates, state, params=None):
        del params
        scale = lambda u: u * math.sqrt(max(1.0, u.shape[-1] / u.shape[-2]))  # noqa: E731
        return jax.tree_util.tree_map(scale, updates), state

    return optax.GradientTransformation(optax.init_empty_state, update)


def muon_groups(adam: optax.GradientTransformation, decay: list, weight_decay: float,
                beta: float = 0.95):
    """``with_lr(learning_rate, muon_learning_rate)``: Muon for the hidden weight matrices,
    AdamW for the other leaves (muon_labels). Every decay rule decays the weight matrices,
    so Muon's leaves all get the decay. beta: Muon's Nesterov momentum."""
    muon_decay = [optax.add_decayed_weights(float(weight_decay))] if weight_decay else []

    def with_lr(learning_rate, muon_learning_rate):
        muon = optax.chain(
            contrib.scale_by_muon(beta=beta, nesterov=True, weight_dimension_numbers=_layer_matrices),
            scale_by_width(), *muon_decay, optax.scale_by_learning_rate(muon_learning_rate))
        adamw = optax.chain(adam, *decay, optax.scale_by_learning_rate(learning_rate))
        return optax.partition({"muon": muon, "adamw": adamw}, muon_labels)

    return with_lr
