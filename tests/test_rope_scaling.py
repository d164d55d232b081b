"""Rotary scaling (ModelConfig.rope_scaling: linear, llama3, yarn), in float64: the
frequencies and yarn's attention factor equal transformers' own ROPE_INIT_FUNCTIONS; the
manual backward of the scaled tables against jax.vjp; the model and the manual forward read
the same tables; the key/value cache decodes with them; the settings' errors; config.json's
``rope_scaling`` and ``rope_parameters`` in and out.

transformers computes its rotary frequencies in float32 (``dtype=torch.float`` inside
modeling_rope_utils.py, whatever the model's dtype). ``transformers_rope`` runs its own
functions with float32 read as float64 (the module's ``torch`` seen through ``Float64Torch``),
so the comparison is with transformers' formulas in float64; unpatched, they agree to
float32's round-off (test_float32_transformers_agrees_to_round_off)."""

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import Layer, assert_layer_matches_vjp, decode_one_at_a_time, make_batch, make_params

import jaxformer
from jaxformer.formats.hf_files import HFFormatError
from jaxformer.formats.hf_llama import config_from_hf, config_to_hf, rope_from_hf
from jaxformer.model.attention import attention_qkv
from jaxformer.model.config import ModelConfig
from jaxformer.model.rotary import SCALED_INV_FREQ, RopeSpec, apply_rope, attention_factor, rope_spec, rope_tables
from manual_grads.attention import heads_fwd
from manual_grads.rotary import rope_bwd, rope_fwd

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
rope_utils = pytest.importorskip("transformers.modeling_rope_utils")

jax.config.update("jax_enable_x64", True)


class Float64Torch(types.ModuleType):
    """torch with float (float32) read as float64: modeling_rope_utils' arithmetic in float64."""

    float = float32 = torch.float64

    def __getattr__(self, name):
        return getattr(torch, name)


def hf_rope_config(head_dim, rope_parameters, max_position_embeddings=131072):
    return transformers.LlamaConfig(hidden_size=2 * head_dim, num_attention_heads=2, head_dim=head_dim,
                                     max_position_embeddings=max_position_embeddings,
                                     rope_parameters=dict(rope_parameters))


def transformers_rope(hf_config, float64=True):
    """(inv_freq (Dh/2,), attention factor) by transformers' ROPE_INIT_FUNCTIONS for the
    config's rope_type, its arithmetic in float64 (float64=False: as shipped, float32)."""
    kind = hf_config.rope_parameters["rope_type"]
    saved = rope_utils.torch
    rope_utils.torch = Float64Torch("torch") if float64 else saved
    try:
        inv_freq, factor = rope_utils.ROPE_INIT_FUNCTIONS[kind](hf_config)
    finally:
        rope_utils.torch = saved
    return inv_freq.numpy(), float(factor)


LLAMA31 = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
           "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
# (head width, rope_parameters): the published Llama 3.1 / 3.2 and Qwen 2.5 (yarn) numbers, and
# small ones whose every frequency band (kept, blended, divided) holds several dims
CASES = {
    "linear": (16, {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}),
    "llama3.1": (128, LLAMA31),
    "llama3.2": (64, {**LLAMA31, "factor": 32.0}),
    "llama3-small": (16, {**LLAMA31, "rope_theta": 100.0, "factor": 4.0, "original_max_position_embeddings": 16}),
    "yarn-qwen": (128, {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0,
                        "original_max_position_embeddings": 32768}),
    "yarn-small": (16, {"rope_type": "yarn", "rope_theta": 100.0, "factor": 3.0, "beta_fast": 8.0,
                        "beta_slow": 0.5, "original_max_position_embeddings": 16}),
    "yarn-untruncated-af": (32, {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 5.0, "truncate": False,
                                 "attention_factor": 1.3, "original_max_position_embeddings": 64}),
    "yarn-mscale": (32, {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "mscale": 0.707,
                         "mscale_all_dim": 0.707 * 1.3, "original_max_position_embeddings": 64}),
}


def spec_of(head_dim, rope_parameters):
    """Our RopeSpec for the case, through config.json's reader (rope_from_hf)."""
    fields = rope_from_hf({"rope_parameters": rope_parameters, "max_position_embeddings": 131072})
    config = ModelConfig(d_model=2 * head_dim, n_heads=2, positions="rope", **fields)
    return rope_spec(config)


@pytest.mark.parametrize("case", sorted(CASES))
def test_frequencies_are_transformers(case):
    head_dim, rope_parameters = CASES[case]
    spec = spec_of(head_dim, rope_parameters)
    inv_freq, factor = transformers_rope(hf_rope_config(head_dim, rope_parameters))
    assert inv_freq.dtype == np.float64
    ours = SCALED_INV_FREQ[spec.scaling](spec, head_dim)
    np.testing.assert_allclose(ours, inv_freq, rtol=1e-15, atol=0)
    assert attention_factor(spec) == pytest.approx(factor, rel=1e-15, abs=0)
    plain = 1.0 / spec.theta ** (np.arange(0, head_dim, 2) / head_dim)
    assert not np.allclose(ours, plain)  # the rule did change some frequencies
    if spec.scaling == "yarn":
        assert factor != 1.0  # and the tables' scale
    # the tables: angle t * inv_freq twice, times the attention factor, to float64 round-off of t * inv_freq
    positions = np.array([0, 1, 7, 31, 1000, 131071])
    cos, sin = rope_tables(jnp.asarray(positions), head_dim, spec, jnp.float64)
    angle = np.outer(positions, np.concatenate([inv_freq, inv_freq]))
    np.testing.assert_allclose(cos, np.cos(angle) * factor, rtol=0, atol=1e-10)
    np.testing.assert_allclose(sin, np.sin(angle) * factor, rtol=0, atol=1e-10)


@pytest.mark.parametrize("case", sorted(CASES))
def test_float32_transformers_agrees_to_round_off(case):
    head_dim, rope_parameters = CASES[case]
    spec = spec_of(head_dim, rope_parameters)
    inv_freq, factor = transformers_rope(hf_rope_config(head_dim, rope_parameters), float64=False)
    assert inv_freq.dtype == np.float32
    np.testing.assert_allclose(SCALED_INV_FREQ[spec.scaling](spec, head_dim), inv_freq, rtol=1e-6)
    assert attention_factor(spec) == pytest.approx(factor, rel=1e-6)


def test_no_scaling_is_the_plain_rule_bit_for_bit():
    """rope_scaling 'none' builds the tables as before; a RopeSpec and a bare theta give the same bits."""
    for dtype in (jnp.float32, jnp.float64):
        a = rope_tables(jnp.arange(40), 16, 5000.0, dtype)
        b = rope_tables(jnp.arange(40), 16, RopeSpec(5000.0), dtype)
        for x, y in zip(a, b):
            np.testing.assert_array_equal(x, y)


def test_llama3_factor_one_and_linear_factor_one_change_nothing():
    plain = rope_tables(jnp.arange(64), 16, 100.0, jnp.float64)
    for spec in (RopeSpec(100.0, "llama3", 1.0, 16), RopeSpec(100.0, "linear", 1.0)):
        for x, y in zip(plain, rope_tables(jnp.arange(64), 16, spec, jnp.float64)):
            np.testing.assert_allclose(x, y, rtol=0, atol=1e-14)


# ---------------------------------------------------------------- the backward with scaled tables

ROPE = Layer(rope_fwd, rope_bwd, apply_rope, cotangents=lambda dx: (dx,))
SPECS = {"linear": RopeSpec(100.0, "linear", 4.0),
         "llama3": RopeSpec(100.0, "llama3", 4.0, 16),
         "yarn": RopeSpec(100.0, "yarn", 3.0, 16, beta_fast=8.0, beta_slow=0.5),
         "yarn-af": RopeSpec(100.0, "yarn", 3.0, 16, attention_factor=1.7, truncate=False)}


@pytest.mark.parametrize("name", sorted(SPECS))
def test_scaled_rope_backward_matches_autodiff(name):
    rng = np.random.default_rng(0)
    x, dy = rng.standard_normal((2, 3, 32, 16)), rng.standard_normal((2, 3, 32, 16))
    cos, sin = rope_tables(jnp.arange(5, 37), 16, SPECS[name], jnp.float64)
    assert_layer_matches_vjp(ROPE, (x,), dy, consts=(cos, sin))
    y, res = rope_fwd(x, cos, sin)  # the adjoint, without autodiff: <rope(x), g> = <x, rope_bwd(g)>
    np.testing.assert_allclose(np.vdot(y, dy), np.vdot(x, rope_bwd(res, dy)), rtol=1e-13)
    if name == "yarn-af":  # the attention factor scales each position's norm
        np.testing.assert_allclose(np.linalg.norm(y, axis=-1), 1.7 * np.linalg.norm(x, axis=-1), rtol=1e-13)


# ---------------------------------------------------------------- the model's forward, its cache

BASE = ModelConfig(vocab_size=29, d_model=32, n_heads=2, n_kv_heads=1, n_layers=2, d_ff=24, max_seq_len=32,
                   positions="rope", norm_type="rms", mlp="gated", activation="silu", rope_theta=100.0,
                   rope_factor=3.0, rope_original_max_len=8, rope_beta_fast=8.0, rope_beta_slow=0.5)


@pytest.mark.parametrize("scaling", ["linear", "llama3", "yarn"])
def test_model_and_manual_forward_read_the_same_tables(scaling):
    config = BASE.replace(rope_scaling=scaling, qk_norm=True)
    params = make_params(config, jnp.float64)
    x = jnp.asarray(np.random.default_rng(1).standard_normal((2, 20, 32)))
    p = jax.tree_util.tree_map(lambda a: a[0], params["blocks"]["attn"])
    ours = attention_qkv(p, x, config)
    (q, k, v), res = heads_fwd(p, x, config)
    for a, b in zip(ours, (q, k, v)):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(res.rotate.rope, rope_tables(jnp.arange(20), 16, rope_spec(config), jnp.float64)):
        np.testing.assert_array_equal(a, b)
    plain = attention_qkv(p, x, config.replace(rope_scaling="none"))
    assert not np.allclose(plain[0], ours[0])  # the scaling reached the model


@pytest.mark.parametrize("scaling", ["linear", "llama3", "yarn"])
def test_cache_decoder_uses_the_scaled_tables(scaling):
    """A prefill of 5 tokens then one token at a time to 30 gives the full forward's logits."""
    config = BASE.replace(rope_scaling=scaling)
    params = make_params(config, jnp.float64)
    inputs = make_batch(config, 2, 30, None)["inputs"]
    full = jaxformer.forward(params, inputs, config)
    np.testing.assert_allclose(decode_one_at_a_time(params, inputs, config, 5), full, rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------- settings


@pytest.mark.parametrize("changes, match", [
    (dict(rope_scaling="dynamic"), "ModelConfig.rope_scaling must be one of 'none', 'linear', 'llama3', 'yarn', "
                                   "got 'dynamic' \\('dynamic' is not implemented for training"),
    (dict(rope_scaling="linear", positions="learned"), "rope_scaling 'linear' needs positions 'rope'"),
    (dict(rope_scaling="llama3", rope_original_max_len=0), "rope_scaling 'llama3' needs rope_original_max_len"),
    (dict(rope_scaling="yarn", rope_original_max_len=0), "rope_scaling 'yarn' needs rope_original_max_len"),
    (dict(rope_scaling="llama3", rope_low_freq_factor=4.0), r"rope_high_freq_factor \(4.0\) must be greater"),
    (dict(rope_factor=0.5), "ModelConfig.rope_factor must be >= 1, got 0.5"),
    (dict(rope_original_max_len=-1), "ModelConfig.rope_original_max_len must be a non-negative integer"),
    (dict(rope_beta_fast=0), "ModelConfig.rope_beta_fast must be > 0"),
    (dict(rope_attention_factor=-1.0), "ModelConfig.rope_attention_factor must be >= 0"),
    (dict(rope_truncate=1), "ModelConfig.rope_truncate must be True or False"),
])
def test_bad_rope_settings_are_named(changes, match):
    with pytest.raises(ValueError, match=match) as e:
        BASE.replace(**changes)
    assert "\n" not in str(e.value)


# ---------------------------------------------------------------- config.json


LLAMA = dict(model_type="llama", vocab_size=64, hidden_size=32, num_attention_heads=2, num_hidden_layers=1,
             intermediate_size=24, max_position_embeddings=64)


def test_config_json_both_spellings():
    """transformers 4.x's rope_scaling (with "type" or "rope_type") and 5's rope_parameters read alike."""
    bare = {k: v for k, v in LLAMA31.items() if k not in ("rope_type", "rope_theta")}
    v4 = config_from_hf({**LLAMA, "rope_theta": 5e5, "rope_scaling": {"rope_type": "llama3", **bare}})
    v4_type = config_from_hf({**LLAMA, "rope_theta": 5e5, "rope_scaling": {"type": "llama3", **bare}})
    v5 = config_from_hf({**LLAMA, "rope_parameters": LLAMA31})
    assert v4 == v4_type == v5
    assert (v5.rope_scaling, v5.rope_theta, v5.rope_factor, v5.rope_low_freq_factor, v5.rope_high_freq_factor,
            v5.rope_original_max_len) == ("llama3", 5e5, 8.0, 1.0, 4.0, 8192)
    yarn = config_from_hf({**LLAMA, "max_position_embeddings": 128,
                           "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6,
                                               "original_max_position_embeddings": 32}})
    assert (yarn.rope_factor, yarn.rope_beta_fast, yarn.rope_beta_slow, yarn.rope_truncate,
            yarn.rope_attention_factor) == (4.0, 32.0, 1.0, True, 0.0)  # factor 128 / 32, transformers' defaults


@pytest.mark.parametrize("rope", [
    {"rope_type": "default", "rope_theta": 1234.0},
    {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
    LLAMA31,
    {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0, "original_max_position_embeddings": 32,
     "beta_fast": 16.0, "beta_slow": 2.0, "truncate": False, "attention_factor": 1.25},
])
def test_config_json_round_trip(rope):
    config = config_from_hf({**LLAMA, "rope_parameters": rope})
    hf = config_to_hf(config)
    assert hf["rope_parameters"] == {**rope, **({"truncate": True} if rope["rope_type"] == "yarn" and
                                                "truncate" not in rope else {})}
    assert hf["rope_theta"] == rope["rope_theta"]
    assert hf["rope_scaling"] == (None if rope["rope_type"] == "default"
                                  else {k: v for k, v in hf["rope_parameters"].items() if k != "rope_theta"})
    assert config_from_hf(hf) == config
    hf_config = transformers.LlamaConfig(**{k: v for k, v in hf.items() if k != "model_type"})
    assert hf_config.rope_parameters == hf["rope_parameters"]  # transformers 5 reads what it wrote


@pytest.mark.parametrize("rope, match", [
    ({"rope_type": "dynamic", "factor": 2.0}, "rope_scaling rope_type 'dynamic' is not supported "
                                              r"\(supported: default, linear, llama3, yarn\)"),
    ({"rope_type": "longrope", "factor": 2.0}, "rope_type 'longrope' is not supported"),
    ({"rope_type": "linear"}, "rope_scaling rope_type 'linear' needs 'factor'"),
    ({"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 16},
     "rope_type 'llama3' needs 'low_freq_factor'"),
    ({"rope_type": "linear", "factor": 2.0, "partial_rotary_factor": 0.5}, "partial_rotary_factor 0.5"),
    ("linear", "rope_scaling 'linear' is not a dict"),
])
def test_config_json_rope_refusals_are_one_line(rope, match):
    with pytest.raises(HFFormatError, match=match) as e:
        config_from_hf({**LLAMA, "rope_scaling": rope})
    assert "\n" not in str(e.value)
