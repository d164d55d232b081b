"""Optimizers and learning-rate schedules, built from optax's own pieces.

    make_optimizer("adamw", lr=3e-3, schedule="cosine", warmup_steps=20, total_steps=300,
                   clip_norm=1.0, weight_decay=0.01)

is the chain

    clip(clip_value) -> clip_by_global_norm(clip_norm) -> [add_decayed_weights]
    -> scale_by_adam -> [add_decayed_weights, adamw] -> scale_by_learning_rate(schedule)

built of small parts (``clipping``, ``decayed_weights``, ``adam_moments``, ``direction``,
``make_schedule``, ``accumulate``), each checking its own arguments, and
wrapped in ``optax.inject_hyperparams`` (so the learning rate of the last update
sits in the optimizer state, see ``injected_lr``) and, with ``accum_steps > 1``,
in ``optax.MultiSteps`` (gradients of ``accum_steps`` calls are averaged into
one update). Steps in schedules count optimizer updates, not micro-batches.

``make_optimizer("muon", lr=3e-3, muon_lr=0.02, ...)`` is Muon for the hidden weight
matrices and AdamW for every other leaf (``muon_labels``): after the clipping,

    partition(muon:  scale_by_muon (Nesterov momentum, Newton-Schulz per layer)
                     -> scale_by_width -> [add_decayed_weights] -> scale_by_learning_rate(muon schedule),
              adamw: scale_by_adam -> [add_decayed_weights] -> scale_by_learning_rate(schedule))

(muon.py ``muon_groups``). Both rates follow the same schedule (warmup, decay, floor as a
fraction of the peak) and sit in the optimizer state as ``learning_rate`` and
``muon_learning_rate``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import optax

from jaxformer.model.checks import check_int, check_number
from jaxformer.training.muon import LAYER_MATRIX, muon_groups, muon_labels, scale_by_width  # noqa: F401

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


def _fraction(arg: str, value, high=1, high_open=True) -> float:
    """``value`` as a float in [0, high) (or [0, high]), each end's error naming ``arg``'s setting."""
    check_number(setting_name(arg), value, low=0.0)
    return check_number(setting_name(arg), value, high=high, high_open=high_open)


def make_schedule(lr: float, schedule: str = "constant", warmup_steps: int = 0,
                  total_steps: int | None = None, final_lr_fraction: float = 0.1) -> optax.Schedule:
    """Learning rate as a function of the update count.

    constant: lr, after a linear warmup (update i < warmup_steps uses lr * (i + 1) / warmup_steps).
    cosine:   linear warmup to lr, then cosine decay to final_lr_fraction * lr at total_steps.
    linear:   linear warmup to lr, then linear decay to final_lr_fraction * lr at total_steps.
    """
    lr = check_number("lr", lr, low=0)
    check_int(setting_name("warmup_steps"), warmup_steps, 0)
    check_number("final_lr_fraction", final_lr_fraction, low=0.0)
    check_number("final_lr_fraction", final_lr_fraction, high=1.0)
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}; choose one of {', '.join(SCHEDULES)}")
    # warmup: update i < warmup_steps uses lr * (i + 1) / warmup_steps
    warmup = optax.linear_schedule(lr / warmup_steps, lr, warmup_steps - 1) if warmup_steps else None
    if schedule == "constant":
        if warmup is None:
            return optax.constant_schedule(lr)
        return optax.join_schedules([warmup, optax.constant_schedule(lr)], [warmup_steps])
    if total_steps is None:
        raise ValueError(f"the {schedule} schedule needs total_steps")
    check_int("total_steps", total_steps, 1)
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


# ------------------------------------------------------------------ the chain's parts


def clipping(clip_value: float | None = None, clip_norm: float | None = None) -> list:
    """Clip every gradient entry to [-clip_value, clip_value], then rescale the gradient
    when its global norm exceeds clip_norm (None: that part is off)."""
    parts = []
    if clip_value is not None:
        parts.append(optax.clip(check_number(setting_name("clip_value"), clip_value, low=0, low_open=True)))
    if clip_norm is not None:
        parts.append(optax.clip_by_global_norm(
            check_number(setting_name("clip_norm"), clip_norm, low=0, low_open=True)))
    return parts


def decayed_weights(weight_decay: float = 0.0, rule: str = "nanogpt") -> list:
    """Weight decay on the leaves ``rule`` picks (decay_mask); [] for a decay of 0."""
    weight_decay = check_number(setting_name("weight_decay"), weight_decay, low=0.0)
    decay_mask({}, rule)  # the rule's name
    if not weight_decay:
        return []
    return [optax.add_decayed_weights(weight_decay, mask=functools.partial(decay_mask, rule=rule))]


def adam_moments(b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8) -> optax.GradientTransformation:
    """Adam's update direction (scale_by_adam), b1 and b2 in [0, 1), eps > 0."""
    return optax.scale_by_adam(b1=_fraction("b1", b1), b2=_fraction("b2", b2),
                               eps=check_number(setting_name("eps"), eps, low=0, low_open=True))


def direction(name: str, decay: list, momentum: float, adam: optax.GradientTransformation) -> list:
    """The update direction of sgd, momentum, adam or adamw, with weight decay where each
    applies it: added to the gradient (L2) before the direction, decoupled after it (adamw)."""
    if name == "sgd":
        return decay
    if name == "momentum":
        return [*decay, optax.trace(decay=float(momentum))]
    if name == "adam":
        return [*decay, adam]
    return [adam, *decay]


def floor_fraction(lr: float, min_lr: float | None, final_lr_fraction: float = 0.1) -> float:
    """The fraction of the peak a decaying schedule ends at: min_lr / lr, or
    final_lr_fraction when min_lr is None."""
    if min_lr is None:
        return final_lr_fraction
    min_lr = check_number(setting_name("min_lr"), min_lr, low=0.0)
    lr = check_number("lr", lr, low=0.0, low_open=True)
    if min_lr > lr:
        raise ValueError(f"min_lr ({min_lr}) must not exceed lr ({lr})")
    return min_lr / lr


def accumulate(optimizer: optax.GradientTransformation, accum_steps: int = 1) -> optax.GradientTransformation:
    """``optimizer`` applied to the mean gradient of every ``accum_steps`` calls (optax.MultiSteps)."""
    accum_steps = check_int(setting_name("accum_steps"), accum_steps, 1)
    if accum_steps == 1:
        return optimizer
    return optax.MultiSteps(optimizer, every_k_schedule=accum_steps).gradient_transformation()


# ------------------------------------------------------------------ the optimizer


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
    weight decay, schedule and gradient accumulation: the chain of the module docstring,
    of the parts above (clipping, decayed_weights, direction or muon_groups, accumulate).

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
    clip = clipping(clip_value, clip_norm)
    decay = decayed_weights(weight_decay, decay_rule)
    adam = adam_moments(b1, b2, eps)
    momentum = _fraction("momentum", momentum, high=1.0, high_open=False)
    muon_lr = check_number(setting_name("muon_lr"), muon_lr, low=0.0)
    muon_momentum = _fraction("muon_momentum", muon_momentum)
    floor = floor_fraction(lr, min_lr, final_lr_fraction)
    rates = {"learning_rate": make_schedule(lr, schedule, warmup_steps, total_steps, floor)}
    if name == "muon":
        groups = muon_groups(adam, decay, weight_decay, muon_momentum)
        rates["muon_learning_rate"] = make_schedule(muon_lr, schedule, warmup_steps, total_steps, floor)

        def with_lr(learning_rate, muon_learning_rate):
            return optax.chain(*clip, groups(learning_rate, muon_learning_rate))
    else:
        parts = direction(name, decay, momentum, adam)

        def with_lr(learning_rate):
            return optax.chain(*clip, *parts, optax.scale_by_learning_rate(learning_rate))

    return accumulate(optax.inject_hyperparams(with_lr)(**rates), accum_steps)


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
