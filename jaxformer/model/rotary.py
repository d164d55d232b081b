"""Rotary position embeddings (RoPE), in the layout Hugging Face's Llama uses: feature i of
a head's first half pairs with feature i + Dh/2 of its second half, and the pair turns by
the angle t * theta^(-2i/Dh) at position t:

    rotate_half(x) = [-x2, x1]                  x = [x1, x2], halves of the head width Dh
    y = x * cos + rotate_half(x) * sin          cos, sin (T, Dh): each angle twice, [a, a]

No parameters: the tables are a function of the positions, Dh and a ``RopeSpec`` (the base
ModelConfig.rope_theta and the scaling rule, ``rope_spec``). Layers may differ (layer_kinds.py):
a layer without rotary positions (rope_layers 0, SmolLM 3's NoPE layers) has no spec, and the
sliding-window layers rotate unscaled with base rope_local_theta where it is set (Gemma 3). Applied to q and k (B, H, T, Dh)
after their projections (and after QK-norm), so q_t . k_s depends on t - s alone.

Scaling rules (ModelConfig.rope_scaling; transformers' ``rope_type``, the same formulas as
its modeling_rope_utils.py) change the frequencies inv_freq_i = theta^(-2i/Dh) alone:

    linear   inv_freq / factor (positions / factor)
    llama3   wavelength 2 pi / inv_freq above original / low_freq_factor: / factor; below
             original / high_freq_factor: kept; between: (1 - s) inv_freq / factor + s inv_freq,
             s = (original / wavelength - low_freq_factor) / (high - low_freq_factor)
    yarn     inv_freq / factor blended with inv_freq by a ramp over the dims between those
             turning beta_fast and beta_slow times over the original context; cos and sin
             times the attention factor (0.1 ln(factor) + 1 unless given)

The tables stay functions of the positions only, so the backward (manual_grads/rotary.py)
is the same transpose with the same tables.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax.numpy as jnp
import numpy as np

from jaxformer.model.precision import stats_dtype


class RopeSpec(NamedTuple):
    """What the tables need: the base and the scaling rule with its numbers (ModelConfig's
    rope_* fields, without the prefix)."""
    theta: float
    scaling: str = "none"
    factor: float = 1.0
    original_max_len: int = 0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float = 0.0  # yarn; 0: 0.1 ln(factor) + 1
    truncate: bool = True  # yarn


MIXED_ROPE = ("ModelConfig.rope_layers {rope} or rope_local_theta {local} with layer_types {types} gives its "
              "layers different rotary positions: the tables take one layer's config "
              "(jaxformer.model.layer_kinds.per_layer)")


def rope_spec(config) -> RopeSpec | None:
    """The rotary tables' spec of a ModelConfig whose layers rotate alike (one layer's config,
    layer_kinds.layer_config): None without rotary positions (positions not "rope", or its
    rope_layers all 0); RopeSpec(rope_local_theta), unscaled, where that is set (every layer
    then a sliding one); else rope_theta with the scaling rule. Layers that differ: ValueError."""
    roped, windowed = set(config.roped_layers), set(config.windowed_layers)
    if len(roped) > 1 or (config.rope_local_theta and len(windowed) > 1):
        raise ValueError(MIXED_ROPE.format(rope=config.rope_layers, local=config.rope_local_theta,
                                           types=config.layer_types))
    if True not in roped:
        return None
    if config.rope_local_theta:
        return RopeSpec(config.rope_local_theta)
    return RopeSpec(*(getattr(config, "rope_" + name) for name in RopeSpec._fields))


def rope_base(config) -> float:
    """The rotary base a ModelConfig's layers rotate with (rope_spec's theta), 0 without rotary positions."""
    spec = rope_spec(config)
    return spec.theta if spec else 0.0


def plain_inv_freq(spec: RopeSpec, head_dim: int):
    """float64 (Dh/2,): theta^(-2i/Dh)."""
    return 1.0 / spec.theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)


def linear_inv_freq(spec: RopeSpec, head_dim: int):
    return plain_inv_freq(spec, head_dim) / spec.factor


def llama3_inv_freq(spec: RopeSpec, head_dim: int):
    inv_freq = plain_inv_freq(spec, head_dim)
    wavelen = 2 * math.pi / inv_freq
    low, high = spec.low_freq_factor, spec.high_freq_factor
    smooth = (spec.original_max_len / wavelen - low) / (high - low)
    medium = (1 - smooth) * inv_freq / spec.factor + smooth * inv_freq
    kept = np.where(wavelen < spec.original_max_len / high, inv_freq, medium)
    return np.where(wavelen > spec.original_max_len / low, inv_freq / spec.factor, kept)


def yarn_ramp(spec: RopeSpec, head_dim: int):
    """float64 (Dh/2,): 0 for the dims kept (fast), 1 for those interpolated (slow), linear between."""
    def correction_dim(rotations):  # the dim that turns ``rotations`` times over the original context
        return head_dim * math.log(spec.original_max_len / (rotations * 2 * math.pi)) / (2 * math.log(spec.theta))

    low, high = correction_dim(spec.beta_fast), correction_dim(spec.beta_slow)
    if spec.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    return np.clip((np.arange(head_dim // 2, dtype=np.float64) - low) / (high - low), 0.0, 1.0)


def yarn_inv_freq(spec: RopeSpec, head_dim: int):
    pos_freqs = spec.theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    kept = 1 - yarn_ramp(spec, head_dim)  # each dim's share of the unscaled frequency
    return 1.0 / (spec.factor * pos_freqs) * (1 - kept) + 1.0 / pos_freqs * kept


SCALED_INV_FREQ = {"linear": linear_inv_freq, "llama3": llama3_inv_freq, "yarn": yarn_inv_freq}


def attention_factor(spec: RopeSpec) -> float:
    """The factor on cos and sin: yarn's (given, or 0.1 ln(factor) + 1; 1 for factor <= 1), else 1."""
    if spec.scaling != "yarn":
        return 1.0
    if spec.attention_factor:
        return spec.attention_factor
    return 1.0 if spec.factor <= 1 else 0.1 * math.log(spec.factor) + 1.0


def rope_tables(positions, head_dim, rope, dtype=jnp.float32):
    """positions int (T,) -> cos, sin (T, Dh) in stats_dtype(dtype): angle t * inv_freq_i at
    features i and i + Dh/2 (i < Dh/2). ``rope``: a RopeSpec, or a base theta (no scaling):
    inv_freq_i = theta^(-2i/Dh), or the scaling rule's (computed in float64, then cast)."""
    dtype = stats_dtype(dtype)
    spec = rope if isinstance(rope, RopeSpec) else RopeSpec(rope)
    if spec.scaling == "none":
        inv_freq = 1.0 / spec.theta ** (jnp.arange(0, head_dim, 2, dtype=dtype) / head_dim)  # (Dh/2,)
    else:
        inv_freq = jnp.asarray(SCALED_INV_FREQ[spec.scaling](spec, head_dim), dtype)  # (Dh/2,)
    angle = positions.astype(dtype)[:, None] * inv_freq[None, :]  # (T, Dh/2)
    angle = jnp.concatenate([angle, angle], axis=-1)  # (T, Dh)
    scale = attention_factor(spec)
    if scale == 1.0:
        return jnp.cos(angle), jnp.sin(angle)
    return jnp.cos(angle) * scale, jnp.sin(angle) * scale


def rotate_half(x):
    """(..., Dh) -> [-x2, x1], x1 and x2 the two halves of the last axis."""
    x1, x2 = jnp.split(x, 2, axis=-1)
    return jnp.concatenate([-x2, x1], axis=-1)


def apply_rope(x, cos, sin):
    """x (..., T, Dh), cos and sin (T, Dh) -> x rotated (..., T, Dh), in float32 or wider."""
    return x * cos + rotate_half(x) * sin
