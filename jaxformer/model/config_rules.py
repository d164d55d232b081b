"""The rules that tie ModelConfig's fields together, each a small function that raises one
ValueError naming the fields (or, ``biases_follow_bias``, keeps one spelling of a config).
ModelConfig.__post_init__ runs them in order, after every field's own rule (config.py),
with the config as ``c``."""

from __future__ import annotations


def heads_divide_width(c) -> None:
    if not c.head_dim and c.d_model % c.n_heads:
        raise ValueError(f"ModelConfig.d_model ({c.d_model}) must be divisible by n_heads ({c.n_heads})")


def kv_heads_divide_heads(c) -> None:
    if c.n_heads % c.kv_heads:
        raise ValueError(f"ModelConfig.n_kv_heads ({c.n_kv_heads}) must divide n_heads ({c.n_heads}): "
                         "each key/value head serves a whole group of query heads")


def rope_needs_even_heads(c) -> None:
    if c.positions == "rope" and c.d_head % 2:
        width = f"head_dim is {c.head_dim}" if c.head_dim else \
            f"d_model ({c.d_model}) / n_heads ({c.n_heads}) is {c.d_head}"
        raise ValueError(f"ModelConfig.positions 'rope' needs an even head width: {width}")


def rope_scaling_needs_rope(c) -> None:
    if c.rope_scaling != "none" and c.positions != "rope":
        raise ValueError(f"ModelConfig.rope_scaling {c.rope_scaling!r} needs positions 'rope', "
                         f"got positions {c.positions!r}")
    if c.rope_scaling in ("llama3", "yarn") and not c.rope_original_max_len:
        raise ValueError(f"ModelConfig.rope_scaling {c.rope_scaling!r} needs rope_original_max_len "
                         "(the pretrained context length), got 0")
    if c.rope_scaling == "llama3" and c.rope_high_freq_factor <= c.rope_low_freq_factor:
        raise ValueError(f"ModelConfig.rope_high_freq_factor ({c.rope_high_freq_factor}) must be greater "
                         f"than rope_low_freq_factor ({c.rope_low_freq_factor}) with rope_scaling 'llama3'")


def unscaled_norm_is_rms(c) -> None:
    if not c.norm_scale and c.norm_type != "rms":
        raise ValueError("ModelConfig.norm_scale False (no learnable scale) needs norm_type 'rms', "
                         f"got norm_type {c.norm_type!r}")


def norm_options_fit(c) -> None:
    """norm_offset acts on RMS norms' learnable scales; qk_norm_scope on a QK-norm."""
    if c.norm_offset and (c.norm_type != "rms" or not c.norm_scale):
        raise ValueError(f"ModelConfig.norm_offset {c.norm_offset} needs norm_type 'rms' with norm_scale "
                         f"True (it offsets the RMS norms' scale), got norm_type {c.norm_type!r}, "
                         f"norm_scale {c.norm_scale}")
    if c.qk_norm_scope != "head" and not c.qk_norm:
        raise ValueError(f"ModelConfig.qk_norm_scope {c.qk_norm_scope!r} needs qk_norm True")


def fused_attention_has_no_dropout(c) -> None:
    if c.dropout and c.attention_impl in ("pallas", "cudnn"):
        raise ValueError(f"ModelConfig.dropout > 0 is not supported with attention_impl "
                         f"{c.attention_impl!r} (the fused kernel has no dropout on the "
                         f"attention probabilities); use 'full' or 'blockwise'")


def fused_attention_has_no_softcap(c) -> None:
    if c.attn_softcap and c.attention_impl in ("pallas", "cudnn"):
        raise ValueError(f"ModelConfig.attn_softcap > 0 is not supported with attention_impl "
                         f"{c.attention_impl!r} (the fused kernel takes no softcap); use 'full' or 'blockwise'")


def cudnn_reads_half_precision(c) -> None:
    if c.attention_impl == "cudnn" and c.compute_dtype == "float32":
        raise ValueError("ModelConfig.attention_impl 'cudnn' cannot run with compute_dtype "
                         "'float32': cuDNN's fused attention reads bfloat16 or float16; "
                         "set compute_dtype='bfloat16'")


def sliding_window_fits(c) -> None:
    """sliding_window needs a causal model; layer_types one entry per layer, and a window where
    it names a sliding layer; every layer sliding is spelled () (one model, one config)."""
    if c.sliding_window and not c.causal:
        raise ValueError(f"ModelConfig.sliding_window {c.sliding_window} needs causal True (a window of "
                         "past keys), got causal False")
    if c.layer_types and len(c.layer_types) != c.n_layers:
        raise ValueError(f"ModelConfig.layer_types has {len(c.layer_types)} entries, n_layers is "
                         f"{c.n_layers}: one per layer, or () for every layer alike")
    if "sliding_attention" in c.layer_types and not c.sliding_window:
        raise ValueError("ModelConfig.layer_types names 'sliding_attention' layers but sliding_window is 0: "
                         "set the window's width")
    if c.sliding_window and c.layer_types and set(c.layer_types) == {"sliding_attention"}:
        object.__setattr__(c, "layer_types", ())


def rope_by_layer_fits(c) -> None:
    """rope_local_theta: 0 or above 1, with rotary positions and a sliding-window layer to act on,
    0 where it is rope_theta unscaled; rope_layers one entry per layer, any 0 with rotary positions,
    every layer 1 spelled () (one model, one config)."""
    if c.rope_local_theta:
        if c.rope_local_theta <= 1 or c.positions != "rope" or True not in c.windowed_layers:
            raise ValueError(f"ModelConfig.rope_local_theta {c.rope_local_theta} (the sliding-window layers' rotary "
                             f"base) needs a value above 1, positions 'rope' and a sliding-window layer; got "
                             f"positions {c.positions!r}, sliding_window {c.sliding_window}, layer_types {c.layer_types}")
        if c.rope_local_theta == c.rope_theta and c.rope_scaling == "none":
            object.__setattr__(c, "rope_local_theta", 0.0)
    object.__setattr__(c, "rope_layers", tuple(int(r) for r in c.rope_layers))  # True, numpy ints: 0 or 1
    if c.rope_layers and len(c.rope_layers) != c.n_layers:
        raise ValueError(f"ModelConfig.rope_layers has {len(c.rope_layers)} entries, n_layers is {c.n_layers}: "
                         "one per layer, or () for every layer rotating")
    if 0 in c.rope_layers and c.positions != "rope":
        raise ValueError(f"ModelConfig.rope_layers {c.rope_layers} turns rotary positions off by layer: it needs "
                         f"positions 'rope', got {c.positions!r}")
    if c.rope_layers and set(c.rope_layers) == {1}:
        object.__setattr__(c, "rope_layers", ())


def biases_follow_bias(c) -> None:
    """qkv_bias, out_bias, mlp_bias: None where they equal bias, so one model has one config."""
    for name in ("qkv_bias", "out_bias", "mlp_bias"):
        if getattr(c, name) is not None and getattr(c, name) == c.bias:
            object.__setattr__(c, name, None)


def experts_fit(c) -> None:
    if not c.n_experts:
        return
    if c.experts_per_token > c.n_experts:
        raise ValueError(f"ModelConfig.experts_per_token ({c.experts_per_token}) must be at most "
                         f"n_experts ({c.n_experts})")
    if c.mlp != "gated":
        raise ValueError(f"ModelConfig.n_experts > 0 needs mlp 'gated' (the experts are gated MLPs), "
                         f"got mlp {c.mlp!r}")
    if c.linear_biases.mlp:
        raise ValueError("ModelConfig.n_experts > 0 needs no feed-forward biases (the experts have none): "
                         "set bias=False or mlp_bias=False")
    if c.moe_every != 1:
        raise ValueError(f"ModelConfig.moe_every {c.moe_every} is not implemented: the scanned blocks "
                         "share one layout, so every block is an MoE one (moe_every 1)")
    if c.norm_topk_prob and c.router != "softmax_topk":
        raise ValueError("ModelConfig.norm_topk_prob needs router 'softmax_topk' "
                         f"(router {c.router!r} already sums its gates to 1)")


def shared_expert_fits(c) -> None:
    if c.shared_expert_d_ff and not c.n_experts:
        raise ValueError(f"ModelConfig.shared_expert_d_ff {c.shared_expert_d_ff} needs n_experts > 0 "
                         "(the shared expert sits beside the routed ones)")
    if not c.shared_expert_gate and not c.shared_expert_d_ff:
        raise ValueError("ModelConfig.shared_expert_gate False needs shared_expert_d_ff > 0 "
                         "(it gates the shared expert)")


CROSS_FIELD_RULES = (heads_divide_width, biases_follow_bias, kv_heads_divide_heads, rope_needs_even_heads,
                     unscaled_norm_is_rms, fused_attention_has_no_dropout, cudnn_reads_half_precision,
                     rope_scaling_needs_rope, fused_attention_has_no_softcap, norm_options_fit,
                     sliding_window_fits, experts_fit, rope_by_layer_fits,
                     shared_expert_fits)
