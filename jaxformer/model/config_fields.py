"""Each ModelConfig field's own rule (``FIELD_RULES``), judged by jaxformer.model.checks, and
the names its choice fields take. ModelConfig.__post_init__ (config.py) judges every field
by its rule, then runs the rules that tie fields together (config_rules.py)."""

from __future__ import annotations

from typing import Any, NamedTuple

from jaxformer.model.checks import check_bool, check_choice, check_choices, check_int, check_number

ACTIVATIONS = ("gelu", "gelu_tanh", "relu", "tanh", "silu", "relu2")
NORMS = ("pre", "post", "output", "sandwich")  # block layouts (block.py)
QK_NORM_SCOPES = ("head", "projection")
NORM_TYPES = ("layer", "rms")
POSITIONS = ("learned", "sinusoidal", "rope")
LAYER_TYPES = ("sliding_attention", "full_attention")  # transformers' names
ROPE_SCALINGS = ("none", "linear", "llama3", "yarn")  # transformers' rope_type names ("none": its "default")
MLPS = ("plain", "gated")
ATTENTION_IMPLS = ("full", "blockwise", "pallas", "cudnn")
REMATS = ("none", "block")
COMPUTE_DTYPES = ("float32", "bfloat16", "float16")
ROUTERS = ("topk_softmax", "softmax_topk")  # MoE gates: softmax of the top-k logits | top-k of the softmax
FAMILIES = ("", "gpt2", "llama", "mistral", "qwen2", "qwen3", "olmo2", "gemma", "gemma2", "gemma3_text",
            "smollm3", "mixtral", "qwen3_moe", "olmoe", "qwen2_moe")  # Hugging Face model_types (formats/hf.py)


class Rule(NamedTuple):
    """A field's rule, judged by jaxformer.model.checks: kind "int" (an integer >= low), "number"
    (a finite number in the range low..high, each end open or closed), "choice", "bool" or
    "bool or None"."""

    kind: str  # ("choices": a tuple, each entry one of choices)
    low: Any = None
    high: Any = None
    low_open: bool = False
    high_open: bool = False
    choices: tuple = ()
    note: str = ""  # what a special value means, added to the error ("0: n_heads")


POSITIVE, NON_NEGATIVE, BOOL = Rule("int", 1), Rule("int", 0), Rule("bool")
FOLLOWS_BIAS = Rule("bool or None", note="None: as bias")


def judge(name: str, value, rule: Rule):
    """value in its canonical type (int, float, bool) if ``rule`` holds, else ValueError naming ``name``."""
    if rule.kind == "int":
        return check_int(name, value, rule.low, note=rule.note)
    if rule.kind == "number":
        return check_number(name, value, rule.low, rule.high, rule.low_open, rule.high_open, note=rule.note)
    if rule.kind == "choice":
        return check_choice(name, value, rule.choices, note=rule.note)
    if rule.kind == "choices":
        return check_choices(name, value, rule.choices, note=rule.note)
    if rule.kind == "bool or None":
        return None if value is None else check_bool(name, value, note=rule.note)
    return check_bool(name, value, note=rule.note)


# Every field's rule, in the order of the fields (a test checks that each field has one).
FIELD_RULES: dict[str, Rule] = {
    "vocab_size": POSITIVE, "d_model": POSITIVE, "n_heads": POSITIVE, "n_layers": POSITIVE,
    "d_ff": POSITIVE, "max_seq_len": POSITIVE,
    "activation": Rule("choice", choices=ACTIVATIONS),
    "norm": Rule("choice", choices=NORMS),
    "positions": Rule("choice", choices=POSITIONS),
    "embed_scale": BOOL, "causal": BOOL,
    "ln_eps": Rule("number", low=0, low_open=True),
    "attention_impl": Rule("choice", choices=ATTENTION_IMPLS),
    "attention_block": POSITIVE,
    "pallas_block_q": NON_NEGATIVE._replace(note="0: the device's default"),
    "pallas_block_k": NON_NEGATIVE._replace(note="0: the device's default"),
    "loss_chunk": NON_NEGATIVE._replace(note="0: no chunking"),
    "remat": Rule("choice", choices=REMATS),
    "sequence_parallel": BOOL._replace(note="a tensor axis only"),
    "compute_dtype": Rule("choice", choices=(None, *COMPUTE_DTYPES), note="None: the params' dtype"),
    "tie_embeddings": BOOL, "bias": BOOL, "head_bias": BOOL,
    "dropout": Rule("number", low=0, high=1, high_open=True),
    "norm_type": Rule("choice", choices=NORM_TYPES),
    "norm_scale": BOOL,
    "rope_theta": Rule("number", low=1, low_open=True),
    "rope_scaling": Rule("choice", choices=ROPE_SCALINGS, note="'dynamic' is not implemented for "
                         "training: its frequencies change with the sequence's length"),
    "rope_factor": Rule("number", low=1),
    "rope_original_max_len": NON_NEGATIVE._replace(note="0: unset; llama3 and yarn need it"),
    "rope_low_freq_factor": Rule("number", low=0, low_open=True),
    "rope_high_freq_factor": Rule("number", low=0, low_open=True),
    "rope_beta_fast": Rule("number", low=0, low_open=True),
    "rope_beta_slow": Rule("number", low=0, low_open=True),
    "rope_attention_factor": Rule("number", low=0, note="0: yarn's 0.1 ln(rope_factor) + 1"),
    "rope_truncate": BOOL,
    "mlp": Rule("choice", choices=MLPS),
    "n_kv_heads": NON_NEGATIVE._replace(note="0: n_heads"),
    "qk_norm": BOOL,
    "head_dim": NON_NEGATIVE._replace(note="0: d_model // n_heads"),
    "qkv_bias": FOLLOWS_BIAS,
    "out_bias": FOLLOWS_BIAS,
    "mlp_bias": FOLLOWS_BIAS,
    "attn_softcap": Rule("number", low=0, note="0: off"), "logit_softcap": Rule("number", low=0, note="0: off"),
    "norm_offset": Rule("number", low=0, note="0: the scale w itself; 1: Gemma's (1 + w)"),
    "qk_norm_scope": Rule("choice", choices=QK_NORM_SCOPES),
    "attn_scalar": Rule("number", low=0, note="0: the head width"),
    "sliding_window": NON_NEGATIVE._replace(note="0: no window"),
    "layer_types": Rule("choices", choices=LAYER_TYPES, note="(): every layer as sliding_window says"),
    "n_experts": NON_NEGATIVE._replace(note="0: dense"),
    "experts_per_token": POSITIVE,
    "expert_d_ff": NON_NEGATIVE._replace(note="0: d_ff"),
    "router": Rule("choice", choices=ROUTERS),
    "norm_topk_prob": BOOL,
    "moe_aux_loss_coef": Rule("number", low=0), "router_z_loss_coef": Rule("number", low=0),
    "moe_every": POSITIVE,
    "shared_expert_d_ff": NON_NEGATIVE._replace(note="0: no shared expert"),
    "shared_expert_gate": BOOL,
    "rope_local_theta": Rule("number", low=0, note="0: as rope_theta and rope_scaling"),
    "rope_layers": Rule("choices", choices=(0, 1), note="(): every layer rotates"),
    "family": Rule("choice", choices=FAMILIES, note="'': export picks by the options"),
}
