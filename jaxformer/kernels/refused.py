"""A stand-in for a computation that the platform a program is lowered for cannot run.

    out = refused(shapes, ValueError, "cudnn runs only on a GPU; lowered for {platform}")

``out`` has the shapes and dtypes of ``shapes`` (a pytree of anything with ``.shape`` and
``.dtype``) and traces like any value, so every branch of ``jax.lax.platform_dependent``
can be traced while only the branch of the platform lowered for must be buildable. Lowering
it raises ``error_type(message)``, ``{platform}`` in the message naming the platforms
lowered for; running it eagerly raises the same, naming the process's backend. The Pallas
kernel uses it for block sizes a platform cannot tile (pallas_attention._guarded), cuDNN's
attention for every platform but cuda (attention.cudnn_core).
"""

from __future__ import annotations

import jax
import jax.extend
from jax.interpreters import mlir

from jaxformer.kernels.shards import varying_as


def refused(shapes, error_type: type[Exception], message: str):
    """A pytree like ``shapes`` whose lowering or eager run raises error_type(message). Under
    jax.shard_map each value varies over the mesh axes its shape's ``manual_axis_type`` names
    (jax.eval_shape's, inside the shard_map), so that it stands in for the real one in a
    ``platform_dependent`` whose branches must agree on that too."""
    flat, tree = jax.tree_util.tree_flatten(shapes)
    avals = tuple(jax.core.ShapedArray(s.shape, s.dtype) for s in flat)
    out = _refused_p.bind(error_type=error_type, message=message, avals=avals)
    return jax.tree_util.tree_unflatten(tree, [varying_as(x, s) for x, s in zip(out, flat)])


def _raise(error_type, message: str, platform: str):
    raise error_type(message.replace("{platform}", repr(platform)))


def _lowering(ctx, *args, error_type, message, avals):
    platforms = getattr(ctx.module_context, "platforms", None) or ("?",)
    _raise(error_type, message, ", ".join(platforms))


_refused_p = jax.extend.core.Primitive("refused")
_refused_p.multiple_results = True
_refused_p.def_abstract_eval(lambda *args, error_type, message, avals: avals)
_refused_p.def_impl(lambda *args, error_type, message, avals: _raise(error_type, message, jax.default_backend()))
mlir.register_lowering(_refused_p, _lowering)
