"""The presets shaped like public Hugging Face models, one per family the import reads
(config.PRESETS joins them): each is the ModelConfig that family's import
(formats/hf_llama.py, hf_olmo_gemma.py) reads from the model's published config.json
(tests/test_family_presets.py holds those config.json keys and checks the two are equal).
They are the fields of ``ModelConfig(**fields)``, kept here to keep config.py short; the
vocabulary is the model's own (training replaces it by the tokenizer's, --init-from by the
folder's). max_seq_len is the published context: train at a shorter --seq-len (the recipes
below take 2048, and the memory figures of docs/models.md 512).

Gemma 3 has no preset: its sliding layers take a rotary base of 10,000 and its full ones
1,000,000, and a rotary base per layer kind is not implemented.
"""

from __future__ import annotations

from typing import Any

# the fields every one of them has: the modern block (RMS norm, rotary positions, a gated MLP)
# without biases
_MODERN = dict(norm_type="rms", positions="rope", mlp="gated", bias=False, head_bias=False)
_GEMMA = dict(_MODERN, activation="gelu_tanh", embed_scale=True, norm_offset=1.0, ln_eps=1e-6,
              tie_embeddings=True)

FAMILY_PRESETS: dict[str, dict[str, Any]] = {
    # meta-llama/Llama-3.2-1B: 16 layers of width 2048, 32 query heads over 8 key/value heads, SwiGLU
    # of width 8192, Llama 3's rotary scaling (factor 32 over an 8192 context, base 500000), the head
    # tied; 1.24B params.
    "llama3.2-1b": dict(
        _MODERN, vocab_size=128256, d_model=2048, n_heads=32, n_kv_heads=8, n_layers=16, d_ff=8192,
        max_seq_len=131072, activation="silu", tie_embeddings=True, rope_theta=500000.0,
        rope_scaling="llama3", rope_factor=32.0, rope_original_max_len=8192, family="llama"),
    # mistralai/Mistral-7B-v0.1: 32 layers of width 4096, 32 over 8 heads, SwiGLU of width 14336, a
    # sliding window of 4096 keys on every layer, an untied head; 7.24B params.
    "mistral-7b": dict(
        _MODERN, vocab_size=32000, d_model=4096, n_heads=32, n_kv_heads=8, n_layers=32, d_ff=14336,
        max_seq_len=32768, activation="silu", sliding_window=4096, family="mistral"),
    # Qwen/Qwen2.5-0.5B: 24 layers of width 896, 14 over 2 heads, SwiGLU of width 4864, biases on
    # q, k and v only, rotary base 1e6, no window (use_sliding_window false), the head tied; 0.49B.
    "qwen2.5-0.5b": dict(
        _MODERN, vocab_size=151936, d_model=896, n_heads=14, n_kv_heads=2, n_layers=24, d_ff=4864,
        max_seq_len=32768, activation="silu", ln_eps=1e-6, tie_embeddings=True, rope_theta=1000000.0,
        bias=True, out_bias=False, mlp_bias=False, family="qwen2"),
    # Qwen/Qwen3-0.6B: 28 layers of width 1024, 16 over 8 heads of width 128 (not 1024 / 16), QK-norm
    # per head, SwiGLU of width 3072, rotary base 1e6, the head tied; 0.60B params.
    "qwen3-0.6b": dict(
        _MODERN, vocab_size=151936, d_model=1024, n_heads=16, n_kv_heads=8, head_dim=128, n_layers=28,
        d_ff=3072, max_seq_len=40960, activation="silu", ln_eps=1e-6, tie_embeddings=True,
        rope_theta=1000000.0, qk_norm=True, family="qwen3"),
    # allenai/OLMo-2-0425-1B: 16 layers of width 2048, 16 heads, SwiGLU of width 8192, the norm after
    # each sublayer, QK-norm over the whole q and k projections, rotary base 500000, an untied head;
    # 1.48B params.
    "olmo2-1b": dict(
        _MODERN, vocab_size=100352, d_model=2048, n_heads=16, n_layers=16, d_ff=8192, max_seq_len=4096,
        activation="silu", norm="output", ln_eps=1e-6, rope_theta=500000.0, qk_norm=True,
        qk_norm_scope="projection", family="olmo2"),
    # google/gemma-2b: 18 layers of width 2048, 8 query heads over 1 (multi-query) of width 256, GeGLU
    # (tanh) of width 16384, (1 + w) norm scales, embeddings times sqrt(2048), the head tied; 2.51B.
    "gemma-2b": dict(
        _GEMMA, vocab_size=256000, d_model=2048, n_heads=8, n_kv_heads=1, n_layers=18, d_ff=16384,
        max_seq_len=8192, family="gemma"),
    # google/gemma-2-2b: 26 layers of width 2304, 8 over 4 heads of width 256, GeGLU of width 9216,
    # four norms a block, layers 0, 2, 4, ... with a 4096-key window and the others global,
    # attention and final logits capped at 50 and 30, scores scaled by 256^-1/2; 2.61B params.
    "gemma2-2b": dict(
        _GEMMA, vocab_size=256000, d_model=2304, n_heads=8, n_kv_heads=4, head_dim=256, n_layers=26,
        d_ff=9216, max_seq_len=8192, norm="sandwich", attn_softcap=50.0, logit_softcap=30.0,
        sliding_window=4096, layer_types=("sliding_attention", "full_attention") * 13, family="gemma2"),
    # allenai/OLMoE-1B-7B-0924's config.json (transformers' OlmoeConfig defaults to its shape but
    # an expert width of 2048): "hidden_size": 2048, "intermediate_size": 1024 (each expert),
    # "num_hidden_layers": 16, "num_attention_heads": 16 (= num_key_value_heads), "num_experts": 64,
    # "num_experts_per_tok": 8, "norm_topk_prob": false (softmax over all 64, top 8, not
    # renormalised), "router_aux_loss_coef": 0.01, "rms_norm_eps": 1e-05, "rope_theta": 10000.0,
    # "vocab_size": 50304, "max_position_embeddings": 4096, "tie_word_embeddings": false; QK-norm
    # over the whole q and k projections as OLMo 2. 6.92B params, 1.28B active per token. Its
    # "output_router_logits": false leaves the load-balancing loss out of transformers' loss (the
    # import reads moe_aux_loss_coef 0); fine-tuning here turns it on at router_aux_loss_coef.
    "olmoe-1b-7b": dict(
        _MODERN, vocab_size=50304, d_model=2048, n_heads=16, n_layers=16, d_ff=1024, max_seq_len=4096,
        activation="silu", rope_theta=10000.0, qk_norm=True, qk_norm_scope="projection",
        n_experts=64, experts_per_token=8, router="softmax_topk",
        norm_topk_prob=False, moe_aux_loss_coef=0.01, family="olmoe"),
}

# Fine-tuning from the imported weights (train --init-from FOLDER --preset NAME): AdamW at a
# small peak rate, cosine to a tenth, short warmup, clip 1.0, no weight decay, 8 x 2048 tokens
# a step (raise accum_steps for larger batches; the memory figures of
# docs/models.md say which fit a device).
_FINE_TUNE = dict(optimizer="adamw", lr=2e-5, min_lr=2e-6, beta1=0.9, beta2=0.95, schedule="cosine",
                  warmup_steps=50, steps=1000, clip_norm=1.0, weight_decay=0.0, batch_size=8, seq_len=2048,
                  eval_every=100, eval_batches=8, log_every=10, ckpt_every=500)
FAMILY_TRAINING: dict[str, dict[str, Any]] = {name: dict(_FINE_TUNE) for name in FAMILY_PRESETS}
