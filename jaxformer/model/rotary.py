"""Rotary position embeddings (RoPE), in the layout Hugging Face's Llama uses: feature i of
a head's first half pairs with feature i + Dh/2 of its second half, and the pair turns by
the angle t * theta^(-2i/Dh) at position t:

    rotate_half(x) = [-x2, x1]                  x = [x1, x2], halves of the head width Dh
    y = x * cos + rotate_half(x) * sin          cos, sin (T, Dh): each angle twice, [a, a]

No parameters: the tables are a function of the positions, Dh and ``theta``
(ModelConfig.rope_theta). Applied to q and k (B, H, T, Dh) after their projections (and
after QK-norm), so q_t . k_s depends on t - s alone.
"""

from __future__ import annotations

import jax.numpy as jnp

from jaxformer.model.precision import stats_dtype


def rope_base(config) -> float:
    """The rotary base a ModelConfig sets: rope_theta with positions "rope", else 0 (no
    rotary positions)."""
    return config.rope_theta if config.positions == "rope" else 0.0


def rope_tables(positions, head_dim, theta, dtype=jnp.float32):
    """positions int (T,) -> cos, sin (T, Dh) in stats_dtype(dtype): angle t * theta^(-2i/Dh)
    at features i and i + Dh/2 (i < Dh/2)."""
    dtype = stats_dtype(dtype)
    inv_freq = 1.0 / theta ** (jnp.arange(0, head_dim, 2, dtype=dtype) / head_dim)  # (Dh/2,)
    angle = positions.astype(dtype)[:, None] * inv_freq[None, :]  # (T, Dh/2)
    angle = jnp.concatenate([angle, angle], axis=-1)  # (T, Dh)
    return jnp.cos(angle), jnp.sin(angle)


def rotate_half(x):
    """(..., Dh) -> [-x2, x1], x1 and x2 the two halves of the last axis."""
    x1, x2 = jnp.split(x, 2, axis=-1)
    return jnp.concatenate([-x2, x1], axis=-1)


def apply_rope(x, cos, sin):
    """x (..., T, Dh), cos and sin (T, Dh) -> x rotated (..., T, Dh), in float32 or wider."""
    return x * cos + rotate_half(x) * sin
