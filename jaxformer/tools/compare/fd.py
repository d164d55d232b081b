"""Finite differences against the manual gradient, for the gradient comparison (``--fd``).

In float64, the loss is differenced centrally along random unit directions inside each
leaf and over the whole tree (``manual_grads.check.finite_difference_check``); each
estimate is judged against the manual gradient's directional derivative with a relative
tolerance FD_TOLERANCE, whose denominator has a floor (``fd_floor``) so that a leaf whose
true gradient is zero, or a difference below float64 round-off, is not judged against zero.
"""

from __future__ import annotations

import functools
import math
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxformer.model.config import ModelConfig
from jaxformer.model.transformer import loss_fn
from jaxformer.tools.compare.leaves import dotted, error_rank
from manual_grads import check

FD_TOLERANCE = 1e-6  # relative error allowed between finite differences and the manual gradient
FD_EPS = 1e-5  # step of the central differences (float64), check.finite_difference_check's
FD_ROUNDOFF_ULPS = 8  # round-off of one float64 loss evaluation, in units of eps * |loss|
FD_DIRECTIONS = 3  # random directions per leaf
FD_MAX_HALVINGS = 4  # the step may shrink to eps / 16 to step off a kink of the loss


def _fd_rel(numeric: float, analytic: float, floor: float) -> float:
    """|numeric - analytic| / max(|numeric|, |analytic|, floor)."""
    return abs(numeric - analytic) / max(abs(numeric), abs(analytic), floor)


def fd_floor(eps: float, grad_floor: float, loss_abs: float) -> float:
    """The floor of the finite differences' relative error at step ``eps``: the larger of
    ``grad_floor`` and the round-off of the difference quotient divided by the tolerance,
    FD_ROUNDOFF_ULPS * eps_float64 * |loss| / eps / FD_TOLERANCE (below it, central
    differences at that step resolve nothing)."""
    roundoff = FD_ROUNDOFF_ULPS * np.finfo(np.float64).eps * loss_abs / eps
    return max(grad_floor, roundoff / FD_TOLERANCE, np.finfo(np.float64).tiny)


def fd_along(loss: Callable, params, grads, key, eps: float, grad_floor: float,
             loss_abs: float) -> dict:
    """Finite differences along one random unit direction (fixed by ``key``):
    ``check.finite_difference_check`` at steps eps, eps/2, eps/4, ... until two successive
    estimates agree to FD_TOLERANCE, so a step that straddles a kink of the loss (a ReLU
    pre-activation within eps of zero) is replaced by a smaller one. Only the numeric
    estimates choose the step, never the gradient under test."""
    (prev,) = check.finite_difference_check(loss, params, grads, key, 1, eps)
    used = eps
    for _ in range(FD_MAX_HALVINGS):
        (cur,) = check.finite_difference_check(loss, params, grads, key, 1, used / 2)
        agree = FD_TOLERANCE * max(abs(cur.numeric), fd_floor(used / 2, grad_floor, loss_abs))
        if abs(cur.numeric - prev.numeric) <= agree:
            break
        prev, used = cur, used / 2
    floor = fd_floor(used, grad_floor, loss_abs)
    rel = _fd_rel(prev.numeric, prev.analytic, floor)
    return dict(numeric=prev.numeric, analytic=prev.analytic, rel=rel, eps=used, floor=floor,
                passed=bool(rel <= FD_TOLERANCE))


def finite_difference_leaves(params64, grads64, batch, config: ModelConfig, key,
                             n_directions: int = FD_DIRECTIONS, eps: float = FD_EPS,
                             dropout_key=None) -> dict:
    """Float64 finite differences of the loss (``fd_along``) along ``n_directions`` random
    unit directions inside each leaf, and along directions over the whole tree, against
    the manual gradient; JSON-ready, worst direction per leaf.

    The relative error's denominator has a floor (``fd_floor``): at least FLOOR_FRAC *
    global gradient norm, as in check.compare_trees, so a leaf whose true gradient is zero
    (the attention key bias) is not judged against zero; at least what round-off lets
    central differences resolve.
    """
    loss64 = jax.jit(functools.partial(loss_fn, key=dropout_key), static_argnums=2)
    leaves_p, treedef = jax.tree_util.tree_flatten_with_path(params64)
    leaves_g = jax.tree_util.tree_leaves(grads64)
    global_norm = math.sqrt(sum(float(jnp.sum(g * g)) for g in leaves_g))
    loss_abs = abs(float(loss64(params64, batch, config)))
    grad_floor = check.FLOOR_FRAC * global_norm
    plain = [leaf for _, leaf in leaves_p]

    def with_leaf(i, x):
        return jax.tree_util.tree_unflatten(treedef, plain[:i] + [x] + plain[i + 1:])

    rows = []
    keys = jax.random.split(key, len(plain) + 1)
    for i, ((path, leaf), grad) in enumerate(zip(leaves_p, leaves_g)):
        loss_i = lambda x, i=i: loss64(with_leaf(i, x), batch, config)  # noqa: E731
        checks = [fd_along(loss_i, leaf, grad, k, eps, grad_floor, loss_abs)
                  for k in jax.random.split(keys[i], n_directions)]
        worst = max(checks, key=lambda d: error_rank(d["rel"]))
        rows.append(dict(path=dotted(jax.tree_util.keystr(path)), **worst))
    whole = [fd_along(lambda p: loss64(p, batch, config), params64, grads64, k, eps,
                      grad_floor, loss_abs) for k in jax.random.split(keys[-1], n_directions)]
    return dict(tolerance=FD_TOLERANCE, eps=eps, n_directions=n_directions,
                floor=fd_floor(eps, grad_floor, loss_abs), global_norm=global_norm,
                leaves=rows, whole_tree=whole,
                passed=all(r["passed"] for r in rows) and all(w["passed"] for w in whole))


def fd_check(manual_fn: Callable, params, grads, batch, config: ModelConfig, *, seed: int,
             n_directions: int = FD_DIRECTIONS, key=None) -> tuple[dict, list[str]]:
    """``finite_difference_leaves`` of the float64 loss (without compute_dtype) against
    ``manual_fn``'s gradient in float64, and one line per failing leaf or direction.
    ``grads`` is that gradient when it was already taken in float64 without compute_dtype,
    else None (then it is computed here). ``key``: the dropout key ``manual_fn`` was
    given (the loss is differenced with the same masks)."""
    if not jax.config.jax_enable_x64:
        raise RuntimeError("finite differences run in float64: enable jax_enable_x64 first")
    config = config.replace(compute_dtype=None)
    params64 = jax.tree_util.tree_map(lambda x: x.astype(jnp.float64), params)
    if grads is None:
        _, grads = jax.jit(manual_fn, static_argnums=2)(params64, batch, config)
    result = finite_difference_leaves(params64, grads, batch, config,
                                      jax.random.PRNGKey(seed + 1), n_directions,
                                      dropout_key=key)
    failures = [f"{r['path']}: finite differences {r['numeric']:.9e} vs manual "
                f"{r['analytic']:.9e}, rel {r['rel']:.2e} > {FD_TOLERANCE:.0e}"
                for r in result["leaves"] if not r["passed"]]
    failures += [f"whole tree, direction {i}: finite differences rel {w['rel']:.2e} > "
                 f"{FD_TOLERANCE:.0e}" for i, w in enumerate(result["whole_tree"]) if not w["passed"]]
    return result, failures
