"""Optimizers and learning-rate schedules, built from optax's own pieces.

    make_optimizer("adamw", lr=3e-3, schedule="cosine", warmup_steps=20, total_steps=300,
                   clip_norm=1.0, weight_decay=0.01)

is the chain

    clip(clip_value) -> clip_by_global_norm(clip_norm) -> [add_decayed_weights]
    -> scale_by_adam -> [add_decayed_weights, adamw] -> scale_by_learning_rate(schedule)

wrapped in ``optax.inject_hyperparams`` (so the learning rate of the last update
sits in the optimizer state, see ``injected_lr``) and, with ``accum_steps > 1``,
in ``optax.MultiSteps`` (gradients of ``accum_steps`` calls are averaged into
one update). Steps in schedules count optimizer updates, not micro-batches.

``make_optimizer("muon", lr=3e-3, muon_lr=0.02, ...)`` is Muon for the hidden weight
matrices and AdamW for every other leaf (``muon_labels``): after the clipping,

    partition(muon:  scale_by_muon (Nesterov momentum, Newton-Schulz per layer)
                     -> scale_by_width -> [add_decayed_weights] -> scale_by_learning_rate(muon schedule),
              adamw: scale_by_adam -> [add_decayed_weights] -> scale_by_learning_rate(schedule))

Both rates follow the same schedule (warmup, decay, floor as a fraction of the peak)
and sit in the optimizer state as ``learning_rate`` and ``muon_learning_rate``.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import optax
from optax import contrib

OPTIMIZERS = ("sgd", "momentum", "adam", "adamw", "muon")
# which leaves weight decay applies to (decay_mask): "nanogpt" weight matrices and
# embeddings, not biases or norm scales (nanoGPT's configure_optimizers, the default);
# "no-embed" weight matrices only; "all" every leaf
DECAY_RULES = ("nanogpt", "no-embed", "all")
SCHEDULES = ("constant", "cosine", "linear")
# make_optimizer's arguments that a run's settings (TrainSettings, config.toml) and
# `jaxformer train` flags name otherwise; the rest share their names (setting_name)
RENAMED = {"b1": "beta1", "b2": "beta2", "eps": "adam_eps"}


def setting_name(arg: str) -> str:
    """make_optimizer's ``arg`` as a user gives it, setting and flag: 'beta2 (--beta2)'."""
    name = RENAMED.get(arg, arg)
    return f"{name} (--{name.replace('_', '-')})"


def _check_number(name, value, *, minimum=0.0, strict=False, maximum=None):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    if (strict and not value > minimum) or value < minimum:
        raise ValueError(f"{name} must be {'>' if strict else '>='} {minimum}, got {value!r}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{name} must be <= {maximum}, got {value!r}")


def _check_int(name, value, minimum):
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")


def make_schedule(lr: float, schedule: str = "constant", warmup_steps: int = 0,
                  total_steps: int | None = None, final_lr_fraction: float = 0.1) -> optax.Schedule:
    """Learning rate as a function of the update count.

    constant: lr, after a linear warmup (update i < warmup_steps uses lr * (i + 1) / warmup_steps).
    cosine:   linear warmup to lr, then cosine decay to final_lr_fraction * lr at total_steps.
    linear:   linear warmup to lr, then linear decay to final_lr_fraction * lr at total_steps.
    """
    _check_number("lr", lr)
    _check_int(setting_name("warmup_steps"), warmup_steps, 0)
    _check_number("final_lr_fraction", final_lr_fraction, maximum=1.0)
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}; choose one of {', '.join(SCHEDULES)}")
    lr = float(lr)
    # warmup: update i < warmup_steps uses lr * (i + 1) / warmup_steps
    warmup = optax.linear_schedule(lr / warmup_steps, lr, warmup_steps - 1) if warmup_steps else None
    if schedule == "constant":
        if warmup is None:
            return optax.constant_schedule(lr)
        return optax.join_schedules([warmup, optax.constant_schedule(lr)], [warmup_steps])
    if total_steps is None:
        raise ValueError(f"the {schedule} schedule needs total_steps")
    _check_int("total_steps", total_steps, 1)
    if total_steps <= warmup_steps:
        raise ValueError(
            f"the {schedule} schedule needs total_steps ({total_steps}) > warmup_steps ({warmup_steps}); "
            f"lower --warmup-steps, raise --steps or use --schedule constant"
        )
    end = lr * final_lr_fraction
    decay_steps = total_steps - warmup_steps
    if schedule == "cosine":
        decay = optax.cosine_decay_schedule(lr, decay_steps, alpha=final_lr_fraction)
    else:
        decay = optax.linear_schedule(lr, end, decay_steps)
    if warmup is None:
        return decay
    return optax.join_schedules([warmup, decay], [warmup_steps])


def decay_mask(params, rule: str = "nanogpt"):
    """True for the leaves weight decay applies to. rule "nanogpt": weight matrices and
    embeddings (dict keys starting with "w" or ending in "embed"), not biases or norm
    scales; "no-embed": weight matrices only; "all": every leaf. Leaves outside dicts
    fall back to "has at least 2 dims"."""
    if rule not in DECAY_RULES:
        raise ValueError(f"unknown decay_rule {rule!r}; choose one of {', '.join(DECAY_RULES)}")

    def is_decayed(path, leaf):
        if rule == "all":
            return True
        last = path[-1] if path else None
        key = getattr(last, "key", None)
        if isinstance(key, str):
            return key.startswith("w") or (rule == "nanogpt" and key.endswith("embed"))
        return jnp.ndim(leaf) >= 2

    return jax.tree_util.tree_map_with_path(is_decayed, params)


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


def make_optimizer(
    name: str = "adam",
    lr: float = 1e-3,
    schedule: str = "constant",
    warmup_steps: int = 0,
    total_steps: int | None = None,
    clip_value: float | None = None,
    clip_norm: float | None = None,
    weight_decay: float = 0.0,
    momentum: float = 0.9,
    accum_steps: int = 1,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    final_lr_fraction: float = 0.1,
    min_lr: float | None = None,
    decay_rule: str = "nanogpt",
    muon_lr: float = 0.02,
    muon_momentum: float = 0.95,
) -> optax.GradientTransformation:
    """The optimizer ``name`` (sgd | momentum | adam | adamw | muon) with its clipping,
    weight decay, schedule and gradient accumulation. See the module docstring.

    clip_value: clip every gradient entry to [-clip_value, clip_value] (None: off).
    clip_norm: rescale the gradient when its global norm exceeds clip_norm (None: off).
    weight_decay: decoupled (AdamW) for adamw; added to the gradient (L2) otherwise.
    accum_steps: average the gradients of this many calls into one update.
    b1, b2, eps: Adam's; min_lr: the floor a decaying schedule ends at (None:
    final_lr_fraction * lr); decay_rule: which leaves weight decay applies to (decay_mask).
    muon_lr, muon_momentum: for "muon", the peak rate of the matrices (``lr`` is AdamW's,
    for the rest; both follow ``schedule``, the floor is the same fraction of each peak)
    and Muon's Nesterov momentum. Weight decay is decoupled in both groups; every
    decay_rule decays the weight matrices, so it applies to all of Muon's leaves.
    """
    if name not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {name!r}; choose one of {', '.join(OPTIMIZERS)}")
    for label, value in (("clip_value", clip_value), ("clip_norm", clip_norm)):
        if value is not None:
            _check_number(setting_name(label), value, strict=True)
    _check_number(setting_name("weight_decay"), weight_decay)
    _check_number(setting_name("momentum"), momentum, maximum=1.0)
    _check_int(setting_name("accum_steps"), accum_steps, 1)
    for label, value in (("b1", b1), ("b2", b2), ("muon_momentum", muon_momentum)):
        _check_number(setting_name(label), value)
        if value >= 1.0:
            raise ValueError(f"{setting_name(label)} must be < 1, got {value!r}")
    _check_number(setting_name("eps"), eps, strict=True)
    _check_number(setting_name("muon_lr"), muon_lr)
    decay_mask({}, decay_rule)  # the rule's name
    if min_lr is not None:
        _check_number(setting_name("min_lr"), min_lr)
        _check_number("lr", lr, strict=True)
        if min_lr > lr:
            raise ValueError(f"min_lr ({min_lr}) must not exceed lr ({lr})")
        final_lr_fraction = min_lr / lr
    lr_schedule = make_schedule(lr, schedule, warmup_steps, total_steps, final_lr_fraction)
    mask = functools.partial(decay_mask, rule=decay_rule)
    decay = [optax.add_decayed_weights(float(weight_decay), mask=mask)] if weight_decay else []

    parts = []
    if clip_value is not None:
        parts.append(optax.clip(float(clip_value)))
    if clip_norm is not None:
        parts.append(optax.clip_by_global_norm(float(clip_norm)))
    if name in ("sgd", "momentum", "adam"):
        parts += decay  # L2: added to the gradient
    if name == "momentum":
        parts.append(optax.trace(decay=float(momentum)))
    elif name in ("adam", "adamw"):
        parts.append(optax.scale_by_adam(b1=b1, b2=b2, eps=eps))
    if name == "adamw":
        parts += decay  # decoupled

    if name == "muon":
        # every decay rule decays weight matrices: all of Muon's leaves
        muon_decay = [optax.add_decayed_weights(float(weight_decay))] if weight_decay else []

        def with_lr(learning_rate, muon_learning_rate):
            muon = optax.chain(
                contrib.scale_by_muon(beta=float(muon_momentum), nesterov=True,
                                      weight_dimension_numbers=_layer_matrices),
                scale_by_width(), *muon_decay, optax.scale_by_learning_rate(muon_learning_rate))
            adamw = optax.chain(optax.scale_by_adam(b1=b1, b2=b2, eps=eps), *decay,
                                optax.scale_by_learning_rate(learning_rate))
            return optax.chain(*parts, optax.partition({"muon": muon, "adamw": adamw}, muon_labels))

        muon_schedule = make_schedule(muon_lr, schedule, warmup_steps, total_steps, final_lr_fraction)
        optimizer = optax.inject_hyperparams(with_lr)(
            learning_rate=lr_schedule, muon_learning_rate=muon_schedule)
    else:
        def with_lr(learning_rate):
            return optax.chain(*parts, optax.scale_by_learning_rate(learning_rate))

        optimizer = optax.inject_hyperparams(with_lr)(learning_rate=lr_schedule)
    if accum_steps > 1:
        optimizer = optax.MultiSteps(optimizer, every_k_schedule=accum_steps).gradient_transformation()
    return optimizer


def _hyperparam(opt_state, name: str):
    """The hyperparameter ``name`` of the first ``inject_hyperparams`` state inside
    ``opt_state`` that holds it, wherever the state nests it (chain, MultiSteps,
    partition, masked); None when none does."""

    def find(node):
        hyper = getattr(node, "hyperparams", None)
        if isinstance(hyper, dict) and name in hyper:
            return hyper[name]
        if isinstance(node, dict):  # partition / multi_transform: one state per label
            node = tuple(node.values())
        if isinstance(node, (tuple, list)):  # chains and NamedTuple states (MultiSteps, ...)
            for child in node:
                found = find(child)
                if found is not None:
                    return found
        return None

    return find(opt_state)


def injected_lr(opt_state):
    """The learning rate of the last update (the first one's before any) when the
    optimizer state holds one (an ``optax.inject_hyperparams`` state with a
    ``learning_rate``, as every ``make_optimizer`` builds; for "muon": AdamW's), float32;
    None for any other optax state (``optax.adamw(1e-3)``: its rate is a constant
    closed over, not state)."""
    found = _hyperparam(opt_state, "learning_rate")
    return None if found is None else jnp.asarray(found, jnp.float32)


def current_lr(opt_state):
    """``injected_lr``, required: ValueError for a state without a ``learning_rate``
    hyperparameter (an optimizer not built by ``make_optimizer`` or
    ``optax.inject_hyperparams``)."""
    found = injected_lr(opt_state)
    if found is None:
        raise ValueError("the optimizer state holds no learning_rate hyperparameter; build the "
                         "optimizer with make_optimizer (optax.inject_hyperparams) to read its rate")
    return found


def current_muon_lr(opt_state):
    """Muon's learning rate of the last update (as ``injected_lr``), or None for an
    optimizer state without one (every optimizer but "muon")."""
    found = _hyperparam(opt_state, "muon_learning_rate")
    return None if found is None else jnp.asarray(found, jnp.float32)
