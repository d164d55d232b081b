"""OLMo 2 and Gemma (1, 2, 3) against transformers itself (float64, nothing downloaded): small
random ``Olmo2ForCausalLM`` (norms on the sublayers' outputs, QK-norm over the whole
projection, with and without attention_bias), ``GemmaForCausalLM`` ((1 + w) norms, the
embedding times sqrt(hidden_size), a head_dim apart), ``Gemma2ForCausalLM`` (four norms a
block, query_pre_attn_scalar, both softcaps, sliding and full layers alternating, a window of 4
shorter than the sequence) and ``Gemma3ForCausalLM`` (as Gemma 2 with per-head (1 + w) QK-norm,
the sliding layers' rotary base 10k beside the full layers' 1M scaled 8 times), saved, imported, and
shown equal in logits (1e-10 relative) and in gradients (jax.grad and manual vs torch autograd,
1e-10 per leaf); the export writes the same family and reloads with the same logits. Then what
is not implemented here, one line each, and the layer kinds read as the configuration classes do.

transformers computes its RMS norms and rotary tables in float32 whatever the model's dtype:
the reference runs them in float64, the same formulas with the module's own weight, eps and
theta (hf_compare.float64_model); Gemma's (1 + w) is its own formula. Its eager attention (which the
softcaps need) takes the softmax in float32 too: ``eager_float64`` is the same without. The embedding's sqrt(16) = 4 is
exact in any dtype (transformers casts it to the weights' dtype, as the model here does)."""

import importlib
import json

import jax
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

import hf_compare  # noqa: E402
from hf_compare import (D, F, H, L, S, V, assert_export_reloads, assert_forward_matches,  # noqa: E402
                        assert_grads_match_torch, random_folder)

from jaxformer.formats.hf import HFFormatError, read_hf, write_hf  # noqa: E402

jax.config.update("jax_enable_x64", True)
CLASSES = {"olmo2": ("Olmo2Config", "Olmo2ForCausalLM"), "gemma": ("GemmaConfig", "GemmaForCausalLM"),
           "gemma2": ("Gemma2Config", "Gemma2ForCausalLM"), "gemma3_text": ("Gemma3TextConfig", "Gemma3ForCausalLM")}
OFFSET = ("gemma", "gemma2", "gemma3_text")  # (1 + w) norms
_ROPE = {"rope_type": "default", "rope_theta": 5000.0}
_GLOBAL, _LOCAL = {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}, {"rope_type": "default", "rope_theta": 1e4}
W = 4  # Gemma 2 / 3's window, shorter than the batch's 11 positions
# name: (model_type, config overrides, what the import must make of it: (norm, norm_offset, qk_norm_scope,
# attn_scalar, sliding_window, rope_local_theta))
VARIANTS = {
    "olmo2-bias-gqa": ("olmo2", dict(num_key_value_heads=2, attention_bias=True), ("output", 0.0, "projection", 0.0, 0, 0.0)),
    "gemma-wide-mqa-tied": ("gemma", dict(num_key_value_heads=1, head_dim=6), ("pre", 1.0, "head", 0.0, 0, 0.0)),
    "gemma2-softcaps": ("gemma2", dict(num_key_value_heads=2, head_dim=8, query_pre_attn_scalar=10,
                                       attn_logit_softcapping=2.0, final_logit_softcapping=3.0, sliding_window=W,
                                       tie_word_embeddings=False), ("sandwich", 1.0, "head", 10.0, W, 0.0)),
    "gemma3-qknorm": ("gemma3_text", dict(num_key_value_heads=2, head_dim=6, query_pre_attn_scalar=6,
                                          sliding_window=W, layer_types=["sliding_attention", "full_attention"],
                                          rope_parameters={"full_attention": dict(_GLOBAL),
                                                           "sliding_attention": dict(_LOCAL)}),
                      ("sandwich", 1.0, "head", 0.0, W, 1e4)),
}


def hf_config(kind, **overrides):
    kw = dict(vocab_size=V, hidden_size=D, intermediate_size=F, num_attention_heads=H, num_hidden_layers=L,
              max_position_embeddings=S, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    if kind != "gemma3_text":
        kw["rope_parameters"] = dict(_ROPE)
    return getattr(transformers, CLASSES[kind][0])(**{**kw, **overrides})


def float64_model(kind, folder):
    """The family's transformers model from ``folder`` in float64 end to end (eager attention:
    the softcaps), its RMS norms and rotary tables in float64."""
    modeling = importlib.import_module(f"transformers.models.{kind.split('_')[0]}.modeling_{kind.split('_')[0]}")
    modeling.eager_attention_forward = eager_float64  # looked up at each call
    return hf_compare.float64_model(CLASSES[kind][1], folder, offset=kind in OFFSET, attn="eager")


def eager_float64(module, query, key, value, attention_mask, dropout=0.0, scaling=None, softcap=None, **kwargs):
    """transformers' eager attention (with Gemma 2's softcap) without its float32 softmax."""
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    scores = query @ key.transpose(2, 3) * scaling
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if attention_mask is not None:
        scores = scores + attention_mask[:, :, :, : key.shape[-2]]
    probs = torch.softmax(scores, dim=-1)
    return (probs @ value).transpose(1, 2).contiguous(), probs


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def saved(request, tmp_path_factory):
    kind, overrides, want = VARIANTS[request.param]
    folder = tmp_path_factory.mktemp(request.param)
    random_folder(folder, CLASSES[kind][1], hf_config(kind, **overrides), norm_center=0.0 if kind in OFFSET else 1.0)
    return kind, float64_model(kind, folder), folder, want


def test_import_matches_transformers_logits(saved):
    kind, model, folder, want = saved
    params, config = read_hf(folder, np.float64)
    assert (config.family, config.norm, config.norm_offset, config.qk_norm_scope, config.attn_scalar,
            config.sliding_window, config.rope_local_theta) == (kind, *want)
    assert config.windowed_layers == ((True, False) if config.sliding_window else (False, False))
    assert config.embed_scale == (kind in OFFSET) and config.qk_norm == (kind in ("olmo2", "gemma3_text"))
    assert_forward_matches(model, folder, params, config)


@pytest.mark.parametrize("source", ["jax.grad", "manual"])
def test_gradients_match_torch_autograd(saved, source):
    """The loss equals torch autograd's to 1e-12 and every gradient leaf to 1e-10."""
    _, model, folder, _ = saved
    assert_grads_match_torch(model, folder, source)


def test_export_writes_the_family_and_reloads(saved, tmp_path):
    kind, _, folder, _ = saved
    params, config = read_hf(folder, np.float64)
    assert_export_reloads(tmp_path, params, config, kind, CLASSES[kind][1], lambda out: float64_model(kind, out))


def test_export_refuses_what_the_family_lacks(saved, tmp_path):
    kind, _, folder, _ = saved
    _, config = read_hf(folder, np.float64)
    wrong = dict(mlp_bias=True) if kind != "olmo2" else dict(norm="sandwich")
    with pytest.raises(ValueError, match=f"needs ModelConfig.{next(iter(wrong))} = ") as e:
        write_hf(tmp_path / "x", {}, config.replace(**wrong))
    assert "\n" not in str(e.value) and not (tmp_path / "x").exists()


# ---------------------------------------------------------------- what is refused, one line each


def _write_config(tmp_path, kind, **overrides):
    hf = hf_config(kind, head_dim=4).to_dict()  # a valid config, then the values under test written over it
    (tmp_path / "config.json").write_text(json.dumps({**hf, **overrides}))
    return tmp_path


@pytest.mark.parametrize("kind, overrides, match", [
    ("gemma3_text", dict(rope_parameters={"full_attention": dict(_GLOBAL), "sliding_attention": {
        "rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}}),
     "rope_parameters sliding_attention: a scaled rotary on the sliding layers apart"),
    ("gemma2", dict(layer_types=["sliding_attention", "local"]), "layer_types must list 2 entries"),
    ("gemma2", dict(sliding_window=0), "sliding_window must be a positive integer or null, got 0"),
    ("gemma2", dict(query_pre_attn_scalar="x"), "query_pre_attn_scalar must be a positive number, got 'x'"),
    ("gemma2", dict(use_bidirectional_attention=True), "use_bidirectional_attention true is not supported"),
])
def test_unsupported_configs_are_one_line(tmp_path, kind, overrides, match):
    with pytest.raises(HFFormatError, match=match) as e:
        read_hf(_write_config(tmp_path, kind, **overrides), np.float64)
    assert "\n" not in str(e.value)


def test_layer_kinds_as_the_configuration_classes_read_them():
    """Gemma 2 with every layer full is full attention (its window unused); Gemma 3 without
    layer_types takes sliding_window_pattern (every 2nd layer full here; by default every 6th),
    and its older keys rope_theta, rope_scaling, rope_local_base_freq; a local base equal to an
    unscaled global one is no base apart; other families refuse rope_local_theta and rope_layers."""
    from jaxformer.formats.hf_olmo_gemma import config_from_hf, config_to_hf
    hf = hf_config("gemma2", head_dim=4, sliding_window=8, layer_types=["full_attention"] * L).to_dict()
    config = config_from_hf(hf)
    assert (config.norm, config.attn_scalar, config.logit_softcap, config.attn_softcap) == ("sandwich", 256.0, 30.0, 50.0)
    assert config.sliding_window == 0
    old = {k: v for k, v in hf_config("gemma3_text", head_dim=4).to_dict().items() if k not in ("layer_types",
                                                                                               "rope_parameters")}
    old.update(sliding_window_pattern=2, rope_theta=1e6, rope_scaling={"rope_type": "linear", "factor": 8.0},
               rope_local_base_freq=1e4)
    config = config_from_hf(old)
    assert (config.windowed_layers, config.rope_theta, config.rope_scaling, config.rope_factor,
            config.rope_local_theta) == ((True, False), 1e6, "linear", 8.0, 1e4)
    default = {k: v for k, v in old.items() if k != "sliding_window_pattern"}
    assert config_from_hf(default).windowed_layers == (True, True)
    same = config_from_hf({**old, "rope_scaling": None, "rope_local_base_freq": 1e6})
    assert same.rope_local_theta == 0.0 and config_to_hf(same)["rope_local_base_freq"] == 1e6
    for family, field in (("gemma2", "rope_local_theta"), ("gemma2", "rope_layers")):
        with pytest.raises(ValueError, match=f"a Hugging Face Gemma 2 needs ModelConfig.{field} = "):
            config_to_hf(config.replace(family=family, qk_norm=False, qk_norm_scope="head",
                                        rope_layers=(0, 1) if field == "rope_layers" else ()))
