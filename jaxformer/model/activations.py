"""The feed-forward activations: GELU (exact and tanh), ReLU, tanh, SiLU and ReLU^2.

With ModelConfig.mlp "gated" the activation is the gate's: silu gives SwiGLU, gelu GeGLU."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

def gelu(x):
    """GELU, exact: x * Phi(x) = 0.5 * x * (1 + erf(x / sqrt(2)))."""
    return 0.5 * x * (1.0 + jax.lax.erf(x / math.sqrt(2.0)))


GELU_TANH_C = math.sqrt(2.0 / math.pi)
GELU_TANH_A = 0.044715  # the cubic coefficient of the tanh approximation


def gelu_tanh(x):
    """GELU, tanh approximation: 0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 x^3)))."""
    return 0.5 * x * (1.0 + jnp.tanh(GELU_TANH_C * (x + GELU_TANH_A * x**3)))


def relu(x):
    return jnp.maximum(x, 0)


def tanh(x):
    return jnp.tanh(x)


def silu(x):
    """SiLU (swish): x * sigmoid(x), the gate of Llama's SwiGLU."""
    return x * jax.nn.sigmoid(x)


def relu2(x):
    """ReLU squared: max(x, 0)^2 (nanochat's and the nanoGPT speedrun's MLP)."""
    return jnp.square(jnp.maximum(x, 0))


ACTIVATION_FNS = {"gelu": gelu, "gelu_tanh": gelu_tanh, "relu": relu, "tanh": tanh,
                  "silu": silu, "relu2": relu2}


def activation(name: str, x):
    return ACTIVATION_FNS[name](x)
