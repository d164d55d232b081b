"""Gradient sources: functions ``(params, batch, key=None) -> (loss, grads)`` that the
training step calls (``key``: the step's dropout key, ignored by a model without dropout).
``grad_source("auto", config)`` wraps ``jax.value_and_grad(loss_fn)``,
``grad_source("manual", config)`` the hand-derived ``manual_grads.value_and_grad``; a mixture of
experts' sources return (loss, grads, metrics) (``moe_grad_source``). ``check_grad_fn``
refuses a function the step cannot call."""

from __future__ import annotations

import inspect
from typing import Any, Callable

import jax

import manual_grads
from jaxformer.model.config import ModelConfig
from jaxformer.model.moe import moe_metrics
from jaxformer.model.transformer import loss_and_stats, loss_fn
from jaxformer.training.settings import GRAD_SOURCES

GradFn = Callable[..., tuple[jax.Array, Any]]  # (params, batch, key=None) -> (loss, grads)


def grad_source(kind: str, config: ModelConfig) -> GradFn:
    """The gradient source ``(params, batch, key=None) -> (loss, grads)`` named ``kind``:
    "auto" (``jax.value_and_grad`` of the loss) or "manual" (``manual_grads``). The
    training step hands it a key split off TrainState.rng (dropout uses it; key None:
    no dropout)."""
    if config.n_experts and kind in GRAD_SOURCES:
        return moe_grad_source(kind, config)
    if kind == "auto":
        value_and_grad = jax.value_and_grad(loss_fn)
        return lambda params, batch, key=None: value_and_grad(params, batch, config, key=key)
    if kind == "manual":
        return lambda params, batch, key=None: manual_grads.value_and_grad(params, batch, config, key=key)
    raise ValueError(f"unknown gradient source {kind!r}; choose one of {', '.join(GRAD_SOURCES)}")


def moe_grad_source(kind: str, config: ModelConfig) -> GradFn:
    """An MoE model's gradient source: (loss, grads, moe_metrics) (the router's load in the metrics)."""
    if kind == "auto":
        value_and_grad = jax.value_and_grad(loss_and_stats, has_aux=True)

        def auto(params, batch, key=None):
            (loss, stats), grads = value_and_grad(params, batch, config, key=key)
            return loss, grads, moe_metrics(stats, config)
        return auto

    def manual(params, batch, key=None):
        loss, grads, stats = manual_grads.value_and_grad(params, batch, config, key=key, with_stats=True)
        return loss, grads, moe_metrics(stats, config)
    return manual


def check_grad_fn(grad_fn: GradFn) -> None:
    """ValueError unless ``grad_fn`` can be called as ``(params, batch, key)``."""
    if not callable(grad_fn):
        raise ValueError(f"grad_fn must be a function (params, batch, key=None) -> (loss, grads), "
                         f"got {type(grad_fn).__name__}")
    try:
        signature = inspect.signature(grad_fn)
    except (TypeError, ValueError):  # no signature to read (a builtin): the call will tell
        return
    try:
        signature.bind(None, None, None)
    except TypeError:
        raise ValueError(f"grad_fn {getattr(grad_fn, '__name__', grad_fn)}{signature} must take "
                         "(params, batch, key=None): the step passes this step's dropout key") from None
