"""Comparing two gradient pytrees leaf by leaf, and finite differences.

The one place in ``manual_grads/`` allowed to call JAX's autodiff: it is
comparison code, not a derivation.

Relative error of a leaf is a norm ratio, ``||got - ref|| / max(||ref||, floor)``,
where ``floor = floor_frac * global_norm(ref)``. The floor matters for leaves
whose true gradient is zero (the attention key bias, which softmax cancels):
their round-off is judged against the size of the whole gradient instead of
against zero.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

FLOOR_FRAC = 1e-4  # floor of the relative error's denominator, as a fraction of the global norm

# Relative error allowed for a leaf, by dtype of the gradients.
TOLERANCE = {"float64": 1e-10, "float32": 1e-4}


class LeafComparison(NamedTuple):
    path: str  # jax.tree_util.keystr of the leaf, e.g. "['blocks']['attn']['wq']"
    shape: tuple  # the leaf's shape
    max_abs: float  # max |got - ref|
    rel: float  # ||got - ref|| / max(||ref||, floor)
    cosine: float  # <got, ref> / (||got|| ||ref||); 1.0 when both are zero
    ref_norm: float  # ||ref||


def _flat(tree, name):
    leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
    return {jax.tree_util.keystr(p): leaf for p, leaf in leaves}, treedef


def compare_trees(reference, candidate, floor_frac: float = FLOOR_FRAC) -> list[LeafComparison]:
    """One LeafComparison per leaf of ``reference``; ValueError if the trees differ in
    structure (naming the missing or unexpected leaves) or a leaf in shape."""
    ref, _ = _flat(reference, "reference")
    got, _ = _flat(candidate, "candidate")
    missing, extra = sorted(set(ref) - set(got)), sorted(set(got) - set(ref))
    if missing or extra:
        raise ValueError(
            f"gradient trees differ: missing {missing or 'nothing'}, unexpected {extra or 'nothing'}"
        )
    ref = {k: np.asarray(v, dtype=np.float64) for k, v in ref.items()}
    got = {k: np.asarray(v, dtype=np.float64) for k, v in got.items()}
    global_norm = float(np.sqrt(sum(np.sum(r * r) for r in ref.values())))
    floor = max(floor_frac * global_norm, np.finfo(np.float64).tiny)
    rows = []
    for path, r in ref.items():
        g = got[path]
        if g.shape != r.shape:
            raise ValueError(f"gradient leaf {path} has shape {g.shape}, reference has {r.shape}")
        diff = g - r
        r_norm, g_norm = float(np.linalg.norm(r)), float(np.linalg.norm(g))
        if r_norm == 0.0 and g_norm == 0.0:
            cosine = 1.0
        else:
            cosine = float(np.sum(g * r) / max(r_norm * g_norm, np.finfo(np.float64).tiny))
        rows.append(LeafComparison(
            path=path,
            shape=tuple(r.shape),
            max_abs=float(np.max(np.abs(diff))) if diff.size else 0.0,
            rel=float(np.linalg.norm(diff)) / max(r_norm, floor),
            cosine=cosine,
            ref_norm=r_norm,
        ))
    return rows


def tolerance_for(dtype) -> float:
    name = jnp.dtype(dtype).name
    if name not in TOLERANCE:
        raise ValueError(f"no gradient tolerance is defined for dtype {name}; use float32 or float64")
    return TOLERANCE[name]


def assert_trees_close(reference, candidate, rtol: float | None = None,
                       floor_frac: float = FLOOR_FRAC) -> list[LeafComparison]:
    """Raise AssertionError naming every leaf whose relative error exceeds ``rtol``
    (default: the tolerance of the reference's dtype). Returns the comparisons."""
    if rtol is None:
        rtol = tolerance_for(jax.tree_util.tree_leaves(reference)[0].dtype)
    rows = compare_trees(reference, candidate, floor_frac)
    bad = [r for r in rows if not r.rel <= rtol]
    if bad:
        lines = "\n".join(
            f"  {r.path} {r.shape}: rel {r.rel:.3e}, max abs {r.max_abs:.3e}, cosine {r.cosine:.12f}"
            for r in bad
        )
        raise AssertionError(f"{len(bad)} leaf/leaves over relative tolerance {rtol:g}:\n{lines}")
    return rows


class DirectionCheck(NamedTuple):
    numeric: float  # (f(p + eps d) - f(p - eps d)) / (2 eps)
    analytic: float  # <grads, d>
    rel: float  # |numeric - analytic| / max(|numeric|, |analytic|, tiny)


def finite_difference_check(
    loss: Callable, params, grads, key, n_directions: int = 3, eps: float = 1e-5
) -> list[DirectionCheck]:
    """Central finite differences of ``loss(params)`` along random unit directions,
    against the directional derivative ``<grads, d>``. Run it in float64: in float32
    the difference quotient is dominated by round-off."""
    leaves, treedef = jax.tree_util.tree_flatten(params)
    out = []
    for k in jax.random.split(key, n_directions):
        ks = jax.random.split(k, len(leaves))
        d = [jax.random.normal(kk, leaf.shape, leaf.dtype) for kk, leaf in zip(ks, leaves)]
        norm = jnp.sqrt(sum(jnp.sum(x * x) for x in d))
        d = jax.tree_util.tree_unflatten(treedef, [x / norm for x in d])
        shifted = lambda s: jax.tree_util.tree_map(lambda p, dd: p + s * eps * dd, params, d)  # noqa: E731
        numeric = float((loss(shifted(1.0)) - loss(shifted(-1.0))) / (2 * eps))
        analytic = float(sum(jnp.sum(g * dd) for g, dd in zip(jax.tree_util.tree_leaves(grads),
                                                              jax.tree_util.tree_leaves(d))))
        rel = abs(numeric - analytic) / max(abs(numeric), abs(analytic), np.finfo(np.float64).tiny)
        out.append(DirectionCheck(numeric, analytic, rel))
    return out


def autodiff_value_and_grad(loss: Callable, params, *args):
    """``jax.value_and_grad(loss)(params, *args)``: the reference the manual gradients
    are compared with."""
    return jax.value_and_grad(loss)(params, *args)
