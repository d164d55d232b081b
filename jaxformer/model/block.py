"""The feed-forward layer and the residual block, pre-LN and post-LN.

    pre:  x1 = x + attn(ln1(x));   y = x1 + ffn(ln2(x1))
    post: x1 = ln1(x + attn(x));   y = ln2(x1 + ffn(x1))"""

from __future__ import annotations

from jaxformer.model.activations import activation
from jaxformer.model.attention import attention, attention_options
from jaxformer.model.config import ModelConfig
from jaxformer.model.layer_norm import layer_norm
from jaxformer.model.linear import linear

def feed_forward(p, x, activation_name, compute_dtype=None):
    """p = {w_in (D, F), b_in (F,), w_out (F, D), b_out (D,)}; x (..., D) -> (..., D)."""
    h = linear(x, p["w_in"], p["b_in"], compute_dtype)
    return linear(activation(activation_name, h), p["w_out"], p["b_out"], compute_dtype)




def block(p, x, config: ModelConfig):
    """One transformer block. p is one layer's slice of params["blocks"]; x (B, T, D)."""
    eps, H, causal, act = config.ln_eps, config.n_heads, config.causal, config.activation
    cd = config.compute_dtype
    impl = attention_options(config)
    if config.norm == "pre":
        x = x + attention(p["attn"], layer_norm(p["ln1"], x, eps), H, causal, cd, **impl)
        x = x + feed_forward(p["ffn"], layer_norm(p["ln2"], x, eps), act, cd)
    else:
        x = layer_norm(p["ln1"], x + attention(p["attn"], x, H, causal, cd, **impl), eps)
        x = layer_norm(p["ln2"], x + feed_forward(p["ffn"], x, act, cd), eps)
    return x
