"""ModelConfig: the static description of a model, and the presets.

A ModelConfig is a frozen (hence hashable) dataclass, so it can be passed to
``jax.jit`` as a static argument. Each field has one rule in ``FIELD_RULES`` (config_fields.py,
judged by jaxformer.model.checks) and the rules that tie fields together are the small
functions of ``CROSS_FIELD_RULES`` (config_rules.py): an invalid value raises ``ValueError`` at
construction, naming the field. A valid value is kept in its canonical type (a numpy
integer becomes an int, an int rate or epsilon a float).
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

from jaxformer.model.checks import check_keys
from jaxformer.model.config_fields import (  # noqa: F401 (their names, importable from here too)
    ACTIVATIONS, ATTENTION_IMPLS, BOOL, COMPUTE_DTYPES, FAMILIES, FIELD_RULES, FOLLOWS_BIAS, LAYER_TYPES, MLPS,
    NON_NEGATIVE, NORM_TYPES, NORMS, POSITIONS, POSITIVE, QK_NORM_SCOPES, REMATS, ROPE_SCALINGS, ROUTERS, Rule, judge)
from jaxformer.model.config_rules import CROSS_FIELD_RULES
from jaxformer.model.hf_presets import FAMILY_PRESETS, FAMILY_TRAINING

# The fields that choose how the model is computed, not what it computes: a model read
# from a checkpoint (--init-from) keeps every other field but vocab_size (model_fields_of_weights).
HOW_FIELDS = ("attention_impl", "attention_block", "pallas_block_q", "pallas_block_k", "loss_chunk",
              "remat", "sequence_parallel", "compute_dtype", "dropout")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = 256  # byte-level tokenizer; training replaces it by the tokenizer's size
    d_model: int = 128  # residual stream width D
    n_heads: int = 8  # query heads H; D must be divisible by n_heads; Dh = D // n_heads
    n_layers: int = 3  # L, the leading axis of every params["blocks"] leaf
    d_ff: int = 512  # hidden width F of the feed-forward layer (4 * D, as in GPT-2); gated: of gate and up
    max_seq_len: int = 64  # longest sequence T: the learned table's rows, the key/value cache's slots
    activation: str = "gelu"  # feed-forward nonlinearity (gated: the gate's): gelu (erf) | gelu_tanh |
    # relu | tanh | silu | relu2 (relu squared)
    norm: str = "pre"  # pre: x + f(norm(x)) and a final norm; post: norm(x + f(x)); output: x + norm(f(x))
    # and a final norm (OLMo 2); sandwich: x + norm(f(norm(x))) and a final norm (Gemma 2 / 3)
    positions: str = "learned"  # learned table | fixed sinusoidal (sin even, cos odd) | rope (q and k rotated)
    embed_scale: bool = False  # multiply token embeddings by sqrt(d_model), as the original Transformer
    causal: bool = True  # mask future positions (a decoder); False for a bidirectional encoder
    ln_eps: float = 1e-5  # every norm's epsilon: added to the variance (layer norm) or mean square (RMS norm, QK-norm)
    # --- memory: how the forward and the manual backward trade memory for compute
    attention_impl: str = "full"  # full: (B, H, T, T) probabilities; blockwise: online softmax over key blocks
    # (pallas: the same as one Pallas kernel, for the platform lowered for: Triton on a GPU, Mosaic on a TPU,
    # CPU interpret mode; cudnn: cuDNN's, GPU, with its pair in the hand-derived step and under autodiff)
    attention_block: int = 128  # query and key block size of blockwise attention (any T works)
    pallas_block_q: int = 0  # pallas: query block size; 0 takes the device's default (jaxformer/kernels/pallas/)
    pallas_block_k: int = 0  # pallas: key block size; 0 takes the device's default (jaxformer/kernels/pallas/)
    loss_chunk: int = 0  # 0: head + cross entropy on all positions; N: N positions at a time
    remat: str = "none"  # none: each block keeps its residuals; block: keep the input, recompute
    sequence_parallel: bool = False  # on a mesh's tensor axis: the activations between the sublayers split along T
    # --- precision: None computes in the params' dtype; else matmul inputs are cast to it
    compute_dtype: str | None = None  # None | float32 | bfloat16 | float16 (params stay the master copy)
    # --- GPT-2 / nanoGPT options (docs/design.md, "Model options")
    tie_embeddings: bool = False  # logits = x @ tok_embed^T (+ head.b): no params["head"]["w"]
    bias: bool = True  # False: no linear biases (bq bk bv bo, b_in b_out or b_gate b_up b_down) and no norm biases
    head_bias: bool = True  # False: no params["head"]["b"]
    dropout: float = 0.0  # rate on the embedding, attention probabilities and residual branches (training only)
    # --- the modern block (Llama family; docs/design.md, "The modern block")
    norm_type: str = "layer"  # layer: LayerNorm (scale, bias); rms: RMSNorm (scale only, no mean)
    norm_scale: bool = True  # False: RMS norms without a learnable scale (norm_type "rms" only)
    rope_theta: float = 10000.0  # positions "rope": the rotation's base (Llama 3: 500000)
    # rotary scaling (rotary.py; transformers' rope_type and its numbers): none | linear (every
    # frequency / rope_factor) | llama3 (Llama 3.1's: low frequencies / rope_factor, high ones kept,
    # a smooth blend between) | yarn (a ramp between interpolated and kept frequencies over the
    # dims, cos and sin scaled by the attention factor)
    rope_scaling: str = "none"
    rope_factor: float = 1.0  # linear, llama3, yarn: how many times the pretrained context is stretched
    rope_original_max_len: int = 0  # llama3, yarn: the pretrained context (original_max_position_embeddings)
    rope_low_freq_factor: float = 1.0  # llama3: wavelengths above original / this are divided by rope_factor
    rope_high_freq_factor: float = 4.0  # llama3: wavelengths below original / this are kept
    rope_beta_fast: float = 32.0  # yarn: rotations (over the original context) where the ramp keeps a dim
    rope_beta_slow: float = 1.0  # yarn: rotations where the ramp interpolates a dim fully
    rope_attention_factor: float = 0.0  # yarn: cos and sin times this; 0: 0.1 ln(rope_factor) + 1
    rope_truncate: bool = True  # yarn: the ramp's ends rounded to whole dims (floor, ceil)
    mlp: str = "plain"  # plain: act(x w_in) w_out; gated: (act(x w_gate) * (x w_up)) w_down (SwiGLU with silu)
    n_kv_heads: int = 0  # key/value heads (grouped-query attention; 1: multi-query); 0: n_heads
    qk_norm: bool = False  # an RMS norm over each head's q and k (own scales), before rotary positions
    # --- head width and biases apart (Qwen, Mistral, Gemma; docs/design.md, "The modern block")
    head_dim: int = 0  # each head's width Dh; 0: d_model // n_heads (wq (D, H Dh), wo (H Dh, D))
    qkv_bias: bool | None = None  # biases bq bk bv on the q, k, v projections; None: as bias
    out_bias: bool | None = None  # the attention output projection's bias bo; None: as bias
    mlp_bias: bool | None = None  # the feed-forward layer's b_* biases; None: as bias
    # --- softcaps, x -> c tanh(x / c) (Gemma 2; jaxformer/model/softcap.py); 0: off
    attn_softcap: float = 0.0  # c on the attention scores, before mask and softmax (full, blockwise)
    logit_softcap: float = 0.0  # c on the head's logits, before the cross entropy
    # --- norm scales and attention scale (OLMo 2, Gemma; docs/design.md, "Norm layouts and scales")
    norm_offset: float = 0.0  # every RMS norm multiplies by (norm_offset + w): 1.0 is Gemma's (1 + w), w from 0
    qk_norm_scope: str = "head"  # qk_norm over each head's Dh (Qwen 3, Gemma 3) | projection: over all
    # of q (H Dh) and of k (Hkv Dh) before the heads split (OLMo 2; q_norm (H Dh,), k_norm (Hkv Dh,))
    attn_scalar: float = 0.0  # scores times attn_scalar^(-1/2) (Gemma's query_pre_attn_scalar); 0: Dh
    # --- sliding-window attention (Mistral, Qwen 2, Gemma 2/3; docs/design.md, "Sliding-window attention")
    sliding_window: int = 0  # W > 0: the query at t reads the W keys t - W < s <= t (causal); 0: no window
    layer_types: tuple[str, ...] = ()  # per layer "sliding_attention" | "full_attention"; (): every layer
    # windowed when sliding_window > 0
    # --- mixture of experts (jaxformer/model/moe.py; docs/moe.md): the block's feed-forward is E gated experts
    n_experts: int = 0  # E; 0: the dense feed-forward layer
    experts_per_token: int = 2  # k, the experts each token is routed to
    expert_d_ff: int = 0  # each expert's hidden width; 0: d_ff
    router: str = "topk_softmax"  # topk_softmax (Mixtral): softmax over the top-k logits; softmax_topk
    # (Qwen3-MoE, OLMoE): the top k of the softmax over all E
    norm_topk_prob: bool = False  # softmax_topk: the k gates divided by their sum
    moe_aux_loss_coef: float = 0.0  # the load-balancing loss E sum_e f_e P_e times this joins the loss
    router_z_loss_coef: float = 0.0  # the router z-loss mean(logsumexp(logits)^2) times this joins the loss
    moe_every: int = 1  # every n-th block an MoE one; only 1 (every block) is implemented
    shared_expert_d_ff: int = 0  # > 0: a gated MLP of this width every token passes beside the routed
    # experts (Qwen2-MoE's shared expert; jaxformer/model/shared_expert.py); 0: none
    shared_expert_gate: bool = True  # the shared expert's output times sigmoid(x @ shared_gate) (Qwen2-MoE)
    # --- rotary positions by layer (Gemma 3, SmolLM 3; docs/design.md, "Rotary positions by layer")
    rope_local_theta: float = 0.0  # the sliding-window layers' rotary base, unscaled (Gemma 3's 10k beside
    # its global 1M); 0: those layers rotate as the others (rope_theta, rope_scaling)
    rope_layers: tuple[int, ...] = ()  # per layer 1 (rotary positions) | 0 (none: SmolLM 3's NoPE layers); (): all 1
    family: str = ""  # the Hugging Face model_type it was imported as, which export writes; "": by its options

    def __post_init__(self):
        for name, rule in FIELD_RULES.items():
            object.__setattr__(self, name, judge(f"ModelConfig.{name}", getattr(self, name), rule))
        for rule in CROSS_FIELD_RULES:
            rule(self)

    @property
    def d_head(self) -> int:
        """Each head's width Dh: head_dim, or d_model // n_heads when it is 0."""
        return self.head_dim or self.d_model // self.n_heads

    @property
    def windowed_layers(self) -> tuple[bool, ...]:
        """Per layer, whether its attention reads a sliding window of sliding_window keys."""
        if not self.sliding_window:
            return (False,) * self.n_layers
        return tuple(t == "sliding_attention" for t in self.layer_types or ("sliding_attention",) * self.n_layers)

    @property
    def roped_layers(self) -> tuple[bool, ...]:
        """Per layer, whether it rotates q and k (positions "rope" and its rope_layers entry 1)."""
        if self.positions != "rope":
            return (False,) * self.n_layers
        return tuple(bool(r) for r in self.rope_layers or (1,) * self.n_layers)

    @property
    def linear_biases(self) -> "LinearBiases":
        """Which linear layers have biases: qkv_bias, out_bias, mlp_bias, each following
        ``bias`` where it is None."""
        pick = lambda v: self.bias if v is None else v  # noqa: E731
        return LinearBiases(pick(self.qkv_bias), pick(self.out_bias), pick(self.mlp_bias))

    @property
    def expert_width(self) -> int:
        """Each expert's hidden width: expert_d_ff, or d_ff when it is 0."""
        return self.expert_d_ff or self.d_ff

    @property
    def kv_heads(self) -> int:
        """The key/value heads: n_kv_heads, or n_heads when it is 0."""
        return self.n_kv_heads or self.n_heads

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        check_keys("ModelConfig field(s)", d, cls)
        return cls(**d)

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)


class LinearBiases(NamedTuple):
    qkv: bool  # bq, bk, bv
    out: bool  # bo
    mlp: bool  # b_in, b_out or b_gate, b_up, b_down


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
    # tiny-moe: llama-tiny's block with a mixture of 4 gated experts, 2 per token (Mixtral's
    # router: softmax over the top-2 logits), the load-balancing and z losses on.
    "tiny-moe": ModelConfig(
        d_model=16, n_heads=4, n_kv_heads=2, n_layers=2, d_ff=24, max_seq_len=16,
        activation="silu", norm="pre", norm_type="rms", positions="rope", mlp="gated",
        bias=False, head_bias=False, n_experts=4, experts_per_token=2, expert_d_ff=12,
        moe_aux_loss_coef=0.01, router_z_loss_coef=0.001,
    ),
    # one per Hugging Face family, shaped like a public model of it (hf_presets.py)
    **{name: ModelConfig(**fields) for name, fields in FAMILY_PRESETS.items()},
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
    "tiny-moe": dict(optimizer="adam", lr=1e-2, schedule="constant", batch_size=8, seq_len=16),
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
    **FAMILY_TRAINING,  # fine-tuning the Hugging Face families' presets (hf_presets.py)
}


def get_preset(name: str, **overrides) -> ModelConfig:
    """The ModelConfig of a preset, with optional field overrides."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}")
    return PRESETS[name].replace(**overrides)


def model_fields_of_weights() -> tuple[str, ...]:
    """The ModelConfig fields that imported weights fix (their params' tree and shapes, the
    function they were trained to compute): every field but HOW_FIELDS and vocab_size (which
    training takes from the tokenizer)."""
    return tuple(f.name for f in dataclasses.fields(ModelConfig)
                 if f.name not in HOW_FIELDS and f.name != "vocab_size")
