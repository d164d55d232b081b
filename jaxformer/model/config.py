"""ModelConfig: the static description of a model, and the presets.

A ModelConfig is a frozen (hence hashable) dataclass, so it can be passed to
``jax.jit`` as a static argument. Invalid values raise ``ValueError`` at
construction, naming the field.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

ACTIVATIONS = ("gelu", "gelu_tanh", "relu", "tanh", "silu", "relu2")
NORMS = ("pre", "post")
NORM_TYPES = ("layer", "rms")
POSITIONS = ("learned", "sinusoidal", "rope")
MLPS = ("plain", "gated")
ATTENTION_IMPLS = ("full", "blockwise", "pallas", "cudnn")
REMATS = ("none", "block")
COMPUTE_DTYPES = ("float32", "bfloat16", "float16")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = 256  # byte-level tokenizer; training replaces it by the tokenizer's size
    d_model: int = 128  # residual stream width D
    n_heads: int = 8  # D must be divisible by n_heads; Dh = D // n_heads
    n_layers: int = 3  # L, the leading axis of every params["blocks"] leaf
    d_ff: int = 512  # hidden width F of the feed-forward layer (4 * D, as in GPT-2)
    max_seq_len: int = 64  # longest sequence T the position table covers
    activation: str = "gelu"  # feed-forward nonlinearity: gelu (erf) | gelu_tanh | relu | tanh
    norm: str = "pre"  # pre: x + f(LN(x)) and a final LN; post: LN(x + f(x))
    positions: str = "learned"  # learned table or fixed sinusoidal (sin even, cos odd)
    embed_scale: bool = False  # multiply token embeddings by sqrt(d_model), as the original Transformer
    causal: bool = True  # mask future positions (a decoder); False for a bidirectional encoder
    ln_eps: float = 1e-5  # added to the variance inside layer norm
    # --- memory: how the forward and the manual backward trade memory for compute
    attention_impl: str = "full"  # full: (B, H, T, T) probabilities; blockwise: online softmax over key blocks
    # (pallas: the same as one Pallas kernel, for the platform lowered for: Triton on a GPU, Mosaic on a TPU,
    # CPU interpret mode; cudnn: cuDNN's, GPU, autodiff only)
    attention_block: int = 128  # query and key block size of blockwise attention (any T works)
    pallas_block_q: int = 0  # pallas: query block size; 0 takes the device's (GPU autotuned, else 64; TPU 128; CPU 128)
    pallas_block_k: int = 0  # pallas: key block size; 0 takes the device's (GPU autotuned, else 64; TPU 128; CPU 128)
    loss_chunk: int = 0  # 0: head + cross entropy on all positions; N: N positions at a time
    remat: str = "none"  # none: each block keeps its residuals; block: keep the input, recompute
    # --- precision: None computes in the params' dtype; else matmul inputs are cast to it
    compute_dtype: str | None = None  # None | float32 | bfloat16 | float16 (params stay the master copy)
    # --- GPT-2 / nanoGPT options (docs/design.md, "Model options")
    tie_embeddings: bool = False  # logits = x @ tok_embed^T (+ head.b): no params["head"]["w"]
    bias: bool = True  # False: no linear biases (bq bk bv bo b_in b_out) and no layer-norm biases
    head_bias: bool = True  # False: no params["head"]["b"]
    dropout: float = 0.0  # rate on the embedding, attention probabilities and residual branches
    # --- the modern block (Llama family; docs/design.md, "The modern block")
    norm_type: str = "layer"  # layer: LayerNorm (scale, bias); rms: RMSNorm (scale only, no mean)
    norm_scale: bool = True  # False: RMS norms without a learnable scale (norm_type "rms" only)
    rope_theta: float = 10000.0  # positions "rope": the rotation's base (Llama 3: 500000)
    mlp: str = "plain"  # plain: act(x w_in) w_out; gated: (act(x w_gate) * (x w_up)) w_down (SwiGLU with silu)
    n_kv_heads: int = 0  # key/value heads (grouped-query attention; 1: multi-query); 0: n_heads
    qk_norm: bool = False  # an RMS norm over each head's q and k (own scales), before rotary positions

    def __post_init__(self):
        for name in ("vocab_size", "d_model", "n_heads", "n_layers", "d_ff", "max_seq_len"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"ModelConfig.{name} must be a positive integer, got {value!r}")
        if self.d_model % self.n_heads:
            raise ValueError(
                f"ModelConfig.d_model ({self.d_model}) must be divisible by "
                f"n_heads ({self.n_heads})"
            )
        if isinstance(self.n_kv_heads, bool) or not isinstance(self.n_kv_heads, int) or self.n_kv_heads < 0:
            raise ValueError(f"ModelConfig.n_kv_heads must be a non-negative integer (0: n_heads), "
                             f"got {self.n_kv_heads!r}")
        if self.n_heads % self.kv_heads:
            raise ValueError(f"ModelConfig.n_kv_heads ({self.n_kv_heads}) must divide "
                             f"n_heads ({self.n_heads}): each key/value head serves a whole group "
                             f"of query heads")
        for name, allowed in (
            ("activation", ACTIVATIONS),
            ("norm", NORMS),
            ("norm_type", NORM_TYPES),
            ("mlp", MLPS),
            ("positions", POSITIONS),
            ("attention_impl", ATTENTION_IMPLS),
            ("remat", REMATS),
        ):
            value = getattr(self, name)
            if value not in allowed:
                raise ValueError(
                    f"ModelConfig.{name} must be one of {', '.join(allowed)}; got {value!r}"
                )
        for name in ("causal", "embed_scale", "norm_scale", "qk_norm"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"ModelConfig.{name} must be True or False, got {getattr(self, name)!r}")
        if (isinstance(self.ln_eps, bool) or not isinstance(self.ln_eps, (int, float))
                or not math.isfinite(self.ln_eps) or not self.ln_eps > 0):
            raise ValueError(f"ModelConfig.ln_eps must be a positive finite number, got {self.ln_eps!r}")
        if not self.norm_scale and self.norm_type != "rms":
            raise ValueError("ModelConfig.norm_scale False (no learnable scale) needs norm_type 'rms', "
                             f"got norm_type {self.norm_type!r}")
        if (isinstance(self.rope_theta, bool) or not isinstance(self.rope_theta, (int, float))
                or not math.isfinite(self.rope_theta) or not self.rope_theta > 1):
            raise ValueError(f"ModelConfig.rope_theta must be a finite number > 1, got {self.rope_theta!r}")
        if self.positions == "rope" and self.d_head % 2:
            raise ValueError(f"ModelConfig.positions 'rope' needs an even head width: d_model "
                             f"({self.d_model}) / n_heads ({self.n_heads}) is {self.d_head}")
        if isinstance(self.attention_block, bool) or not isinstance(self.attention_block, int) \
                or self.attention_block <= 0:
            raise ValueError(
                f"ModelConfig.attention_block must be a positive integer, got {self.attention_block!r}")
        for name in ("pallas_block_q", "pallas_block_k"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"ModelConfig.{name} must be a non-negative integer "
                                 f"(0: the device's default), got {value!r}")
        if isinstance(self.loss_chunk, bool) or not isinstance(self.loss_chunk, int) or self.loss_chunk < 0:
            raise ValueError(
                f"ModelConfig.loss_chunk must be a non-negative integer (0: no chunking), "
                f"got {self.loss_chunk!r}")
        for name in ("tie_embeddings", "bias", "head_bias"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"ModelConfig.{name} must be True or False, got {getattr(self, name)!r}")
        if (isinstance(self.dropout, bool) or not isinstance(self.dropout, (int, float))
                or not 0.0 <= self.dropout < 1.0):
            raise ValueError(f"ModelConfig.dropout must be a number in [0, 1), got {self.dropout!r}")
        if self.dropout and self.attention_impl in ("pallas", "cudnn"):
            raise ValueError(f"ModelConfig.dropout > 0 is not supported with attention_impl "
                             f"{self.attention_impl!r} (the fused kernel has no dropout on the "
                             f"attention probabilities); use 'full' or 'blockwise'")
        if self.compute_dtype is not None and self.compute_dtype not in COMPUTE_DTYPES:
            raise ValueError(
                f"ModelConfig.compute_dtype must be None (the params' dtype) or one of "
                f"{', '.join(COMPUTE_DTYPES)}; got {self.compute_dtype!r}")
        if self.attention_impl == "cudnn" and self.compute_dtype == "float32":
            raise ValueError("ModelConfig.attention_impl 'cudnn' cannot run with compute_dtype "
                             "'float32': cuDNN's fused attention reads bfloat16 or float16; "
                             "set compute_dtype='bfloat16'")

    @property
    def d_head(self) -> int:
        return self.d_model // self.n_heads

    @property
    def kv_heads(self) -> int:
        """The key/value heads: n_kv_heads, or n_heads when it is 0."""
        return self.n_kv_heads or self.n_heads

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"unknown ModelConfig field(s): {', '.join(unknown)}")
        return cls(**d)

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)


# The three systems this project grew from, plus a tiny model for tests.
PRESETS: dict[str, ModelConfig] = {
    # loopos: a GPT-style pre-LN decoder with GELU, 3 layers of width 128.
    "loopos": ModelConfig(
        d_model=128, n_heads=8, n_layers=3, d_ff=512, max_seq_len=64,
        activation="gelu", norm="pre", positions="learned",
    ),
    # sunfish: the original Transformer's post-LN block, ReLU, sinusoidal positions and
    # token embeddings scaled by sqrt(d_model) (without it the unit-amplitude positions
    # drown the 0.02-scale rows and the model sits at the unigram loss); trained with Adam.
    "sunfish": ModelConfig(
        d_model=64, n_heads=4, n_layers=2, d_ff=256, max_seq_len=64,
        activation="relu", norm="post", positions="sinusoidal", embed_scale=True,
    ),
    # cllm: a small decoder whose feed-forward layer uses tanh.
    "cllm": ModelConfig(
        d_model=64, n_heads=4, n_layers=2, d_ff=256, max_seq_len=64,
        activation="tanh", norm="pre", positions="learned",
    ),
    # tiny: for tests; every dimension different so shape errors show.
    "tiny": ModelConfig(
        d_model=16, n_heads=2, n_layers=2, d_ff=24, max_seq_len=16,
        activation="gelu", norm="pre", positions="learned",
    ),
    # gpt2: GPT-2 small (124M params with its 50257-token vocabulary; the vocabulary
    # here is the tokenizer's): the head tied to tok_embed with no head bias, biases
    # elsewhere, GELU (tanh), layer-norm eps 1e-5.
    "gpt2": ModelConfig(
        d_model=768, n_heads=12, n_layers=12, d_ff=3072, max_seq_len=1024,
        activation="gelu_tanh", norm="pre", positions="learned",
        tie_embeddings=True, head_bias=False,
    ),
    # smollm: the modern (Llama-family) block at SmolLM-135M's published shape
    # (HuggingFaceTB/SmolLM-135M's config.json: 30 layers, width 576, 9 query heads over
    # 3 key/value heads, SwiGLU of width 1536, RMS norm eps 1e-5, rotary base 10000, the
    # head tied, no biases; 134.5M params with its 49152-token vocabulary).
    "smollm": ModelConfig(
        d_model=576, n_heads=9, n_kv_heads=3, n_layers=30, d_ff=1536, max_seq_len=2048,
        activation="silu", norm="pre", norm_type="rms", positions="rope", rope_theta=10000.0,
        mlp="gated", tie_embeddings=True, bias=False, head_bias=False,
    ),
    # llama-tiny: the modern block for tests: rotary positions, RMS norm, SwiGLU, two
    # query heads per key/value head, QK-norm, no biases, an untied head.
    "llama-tiny": ModelConfig(
        d_model=16, n_heads=4, n_kv_heads=2, n_layers=2, d_ff=24, max_seq_len=16,
        activation="silu", norm="pre", norm_type="rms", positions="rope", mlp="gated",
        qk_norm=True, bias=False, head_bias=False,
    ),
}

# The presets small enough for tests that build or train every preset in seconds.
SMALL_PRESETS: tuple[str, ...] = ("loopos", "sunfish", "cllm", "tiny", "llama-tiny")

# The training recipe each preset comes with (flags of `jaxformer train` override them).
PRESET_TRAINING: dict[str, dict[str, Any]] = {
    "loopos": dict(optimizer="adamw", lr=3e-3, schedule="cosine", warmup_steps=20,
                   clip_norm=1.0, weight_decay=0.01, batch_size=16, seq_len=64),
    "sunfish": dict(optimizer="adam", lr=3e-3, schedule="cosine", warmup_steps=20,
                    clip_norm=1.0, batch_size=16, seq_len=64),
    "cllm": dict(optimizer="adamw", lr=3e-3, schedule="cosine", warmup_steps=20,
                 clip_value=5.0, weight_decay=0.01, batch_size=16, seq_len=64),
    "tiny": dict(optimizer="adam", lr=1e-2, schedule="constant", batch_size=8, seq_len=16),
    "llama-tiny": dict(optimizer="adam", lr=1e-2, schedule="constant", batch_size=8, seq_len=16),
    # SmolLM-135M's shape trained as the modern small-LM recipes do: AdamW (beta2 0.95,
    # weight decay 0.1, clip 1.0), lr 3e-3 cosine to 3e-4, 8 x 2048 tokens a step.
    "smollm": dict(optimizer="adamw", lr=3e-3, min_lr=3e-4, beta1=0.9, beta2=0.95,
                   schedule="cosine", warmup_steps=200, steps=2000,
                   clip_norm=1.0, weight_decay=0.1, batch_size=8, seq_len=2048,
                   eval_every=200, eval_batches=8, log_every=10, ckpt_every=500),
    # GPT-2 small's recipe as nanoGPT's train_gpt2.py trains it (AdamW, beta2 0.95,
    # lr 6e-4 cosine down to 6e-5, weight decay 0.1, clip 1.0), sized for one GPU:
    # 8 x 1024 tokens per step (raise accum_steps for GPT-2's 0.5M-token batches).
    "gpt2": dict(optimizer="adamw", lr=6e-4, min_lr=6e-5, beta1=0.9, beta2=0.95,
                 schedule="cosine", warmup_steps=200, steps=2000,
                 clip_norm=1.0, weight_decay=0.1, batch_size=8, seq_len=1024,
                 eval_every=200, eval_batches=8, log_every=10, ckpt_every=500),
}


def get_preset(name: str, **overrides) -> ModelConfig:
    """The ModelConfig of a preset, with optional field overrides."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}")
    return PRESETS[name].replace(**overrides)
