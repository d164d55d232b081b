"""Rotary position embeddings (RoPE), Hugging Face Llama's rotate-half layout:

    y = x * cos + rotate_half(x) * sin,     rotate_half([x1, x2]) = [-x2, x1]

A rotation is linear in x, so its backward is its transpose: each pair (x1_i, x2_i)
turned by the angle a is turned back by -a. No parameters, and no gradient for the
tables: cos and sin are functions of integer positions and static numbers (Dh, theta).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxformer.model.rotary import apply_rope


class RopeRes(NamedTuple):
    cos: jax.Array  # (T, Dh) cos of each angle, twice: [cos a, cos a], float32 or wider
    sin: jax.Array  # (T, Dh) sin of each angle, twice: [sin a, sin a], float32 or wider


def rope_fwd(x, cos, sin):
    """x (..., T, Dh), cos and sin (T, Dh) -> y (..., T, Dh); the tables are all the backward keeps."""
    return apply_rope(x, cos, sin), RopeRes(cos, sin)


def rotate_half_t(g):
    """The transpose of rotate_half: rotate_half is [x1, x2] -> [-x2, x1], the matrix
    [[0, -I], [I, 0]]; its transpose [[0, I], [-I, 0]] sends [g1, g2] to [g2, -g1]."""
    g1, g2 = jnp.split(g, 2, axis=-1)  # (..., Dh/2) each
    return jnp.concatenate([g2, -g1], axis=-1)  # (..., Dh)


def rope_bwd(res: RopeRes, dy):
    """dy (..., T, Dh) -> dx (..., T, Dh).

    Undoes ``y = x * cos + rotate_half(x) * sin``: x reaches y once directly (times
    cos) and once through rotate_half (times sin), so
    dx = dy * cos + rotate_half^T(dy * sin), rotate_half^T([g1, g2]) = [g2, -g1].
    """
    cos, sin = res
    return dy * cos + rotate_half_t(dy * sin)
