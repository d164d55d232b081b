"""Rotary positions by layer (ModelConfig.rope_local_theta, rope_layers): the sliding-window
layers rotate with their own base, unscaled (Gemma 3: local 10k beside a global 1M), and layers
with rope_layers 0 rotate nothing (SmolLM 3's NoPE layers). In float64: the model's features
equal the blocks run one by one, each with a config spelled here (not layer_kinds'); manual,
jax.grad and custom_vjp gradients agree with four layer kinds (unrolled, and a scan with a
lax.switch per layer); the cache decoder equals the forward; bad values are one line each;
the flags carry both fields."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import FORWARD, assert_sources_agree, decode_one_at_a_time, make_batch, make_params

from jaxformer.model.block import block
from jaxformer.model.config import ModelConfig
from jaxformer.model.embedding import embed
from jaxformer.model.layer_kinds import layer_kinds, mixed
from jaxformer.model.rms_norm import rms_norm
from jaxformer.model.rotary import RopeSpec, rope_spec
from jaxformer.model.transformer import features, forward

jax.config.update("jax_enable_x64", True)
SLIDE, FULL = "sliding_attention", "full_attention"
# four layers of four kinds: (sliding, rotary), (full, rotary), (sliding, none), (full, none)
BASE = ModelConfig(vocab_size=23, d_model=16, n_heads=4, n_kv_heads=2, n_layers=4, d_ff=24, max_seq_len=16,
                   norm_type="rms", positions="rope", mlp="gated", activation="silu", attention_block=4,
                   rope_theta=10000.0, rope_scaling="linear", rope_factor=2.0, sliding_window=3,
                   layer_types=(SLIDE, FULL, SLIDE, FULL), rope_local_theta=7.0, rope_layers=(1, 1, 0, 0))


def _own_config(config, l):
    """Layer l's config written out: its window or none, and its rotary positions: the local base
    unscaled (sliding), the global one scaled (full), or positions "learned" (none: a block reads
    no position table, so it rotates nothing)."""
    windowed = config.layer_types[l] == SLIDE
    own = config.replace(layer_types=(), rope_layers=(), rope_local_theta=0.0,
                         sliding_window=config.sliding_window if windowed else 0)
    if not config.rope_layers[l]:
        return own.replace(positions="learned", rope_scaling="none")
    return own.replace(rope_theta=config.rope_local_theta, rope_scaling="none") if windowed else own


def test_each_layer_rotates_as_its_kind():
    params = make_params(BASE, jnp.float64)
    inputs = make_batch(BASE, 2, 16, None)["inputs"]
    x = embed(params, inputs, BASE)
    for l in range(BASE.n_layers):
        x = block(jax.tree_util.tree_map(lambda a: a[l], params["blocks"]), x, _own_config(BASE, l))
    x = rms_norm(params["ln_f"], x, BASE.ln_eps)
    np.testing.assert_allclose(jax.jit(features, static_argnums=2)(params, inputs, BASE), x, rtol=1e-12, atol=1e-12)
    logits = FORWARD(params, inputs, BASE)
    for other in (dict(rope_local_theta=0.0), dict(rope_layers=())):  # each field changes the model
        assert np.max(np.abs(FORWARD(params, inputs, BASE.replace(**other)) - logits)) > 1e-5


def test_kinds_and_specs():
    assert layer_kinds(BASE) == ((True, True), (False, True), (True, False), (False, False)) and mixed(BASE)
    local = BASE.replace(layer_types=(), rope_layers=())
    assert rope_spec(local) == RopeSpec(7.0) and not mixed(local)  # every layer sliding: the local base
    assert rope_spec(local.replace(rope_layers=(0,) * 4)) is None
    assert rope_spec(local.replace(rope_local_theta=0.0)).scaling == "linear"
    with pytest.raises(ValueError, match=r"rope_layers \(1, 1, 0, 0\) .* different rotary positions"):
        rope_spec(BASE)


@pytest.mark.parametrize("remat", ["none", "block"])
def test_three_gradient_sources_agree(remat):
    """manual value_and_grad (unrolled, four kinds; remat "block": a scan with a lax.switch over
    three kinds), jax.grad and the custom_vjp model, float64, 1e-10 per leaf (every other option:
    test_modern_options.py)."""
    config = BASE if remat == "none" else BASE.replace(n_layers=3, layer_types=(SLIDE, FULL, SLIDE),
                                                       rope_layers=(1, 1, 0), remat="block")
    assert_sources_agree(config, 2, 13, "mostly_zero", None)


def test_cached_decoding_equals_the_forward():
    params = make_params(BASE, jnp.float64)
    inputs = make_batch(BASE, 2, 16, None)["inputs"]
    np.testing.assert_allclose(decode_one_at_a_time(params, inputs, BASE, 5), FORWARD(params, inputs, BASE),
                               rtol=1e-11, atol=1e-11)


def test_one_model_one_config():
    assert BASE.replace(rope_layers=(1, 1, 1, 1)).rope_layers == ()
    assert BASE.replace(rope_layers=[True, 1, np.int64(0), 0]).rope_layers == (1, 1, 0, 0)
    assert BASE.replace(rope_local_theta=10000.0, rope_scaling="none").rope_local_theta == 0.0
    assert BASE.replace(rope_local_theta=10000.0).rope_local_theta == 10000.0  # the global layers scale, it not


@pytest.mark.parametrize("changes, match", [
    (dict(rope_local_theta=-1.0), r"ModelConfig.rope_local_theta must be"),
    (dict(rope_local_theta=0.5), r"ModelConfig.rope_local_theta 0.5 .* needs a value above 1"),
    (dict(sliding_window=0, layer_types=()), r"rope_local_theta 7.0 .* needs .* a sliding-window layer"),
    (dict(layer_types=(FULL,) * 4), r"rope_local_theta 7.0 .* a sliding-window layer"),
    (dict(rope_layers=(1, 0)), r"ModelConfig.rope_layers has 2 entries, n_layers is 4"),
    (dict(rope_layers=(1, 2, 1, 1)), r"ModelConfig.rope_layers\[1\] must be one of 0, 1, got 2"),
    (dict(rope_local_theta=0.0, positions="learned", rope_scaling="none"), r"rope_layers \(1, 1, 0, 0\) .* "
                                                                          r"needs positions 'rope'"),
])
def test_bad_values_are_named(changes, match):
    with pytest.raises(ValueError, match=match) as e:
        BASE.replace(**changes)
    assert "\n" not in str(e.value)


def test_flags_and_config_file_carry_both_fields(tmp_path):
    """--rope-layers 1,0,1 and --rope-local-theta parse into the model, and a run's config.toml
    carries them back."""
    from jaxformer.cli import train as cli_train
    from jaxformer.cli.main import build_parser
    from jaxformer.training.configfile import write_config

    args = build_parser().parse_args(["train", "--out", "unused", "--preset", "llama-tiny", "--n-layers", "3",
                                      "--rope-layers", "1,0,1", "--sliding-window", "4", "--rope-local-theta", "100"])
    settings = cli_train.train_settings(args)
    config = settings.model_config(256)
    assert (config.rope_layers, config.rope_local_theta, config.sliding_window) == ((1, 0, 1), 100.0, 4)
    write_config(tmp_path / "config.toml", settings, config)
    assert "rope_layers = [1, 0, 1]" in (tmp_path / "config.toml").read_text()
    again = cli_train.train_settings(build_parser().parse_args(
        ["train", "--out", "unused", "--config", str(tmp_path / "config.toml")]))
    assert again.model_config(256) == config


# ------------------------------------------------ SmolLM 3 in and out, against transformers itself


def _smollm3_float64(folder):
    """transformers' SmolLM3ForCausalLM from ``folder`` in float64 end to end (SDPA attention),
    its RMS norms and rotary tables (float32 inside transformers) run in float64: the same
    formulas with the module's own weight, eps and theta."""
    from hf_compare import float64_model
    return float64_model("SmolLM3ForCausalLM", folder)


@pytest.fixture(scope="module")
def smollm3(tmp_path_factory):
    """A random SmolLM3 of two layers: the second without rotary positions (no_rope_layer_interval 2)
    and sliding (use_sliding_window: transformers slides the NoPE layers), a window of 4 over the
    batch's 11 positions, attention biases, an untied head, every leaf random."""
    pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("safetensors")
    from hf_compare import D, F, H, L, S, V, random_folder
    cfg = transformers.SmolLM3Config(vocab_size=V, hidden_size=D, intermediate_size=F, num_attention_heads=H,
                                     num_key_value_heads=2, num_hidden_layers=L, max_position_embeddings=S,
                                     rms_norm_eps=1e-5, rope_theta=5000.0, no_rope_layer_interval=2,
                                     use_sliding_window=True, sliding_window=4, attention_bias=True,
                                     tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    folder = random_folder(tmp_path_factory.mktemp("smollm3"), "SmolLM3ForCausalLM", cfg)
    return _smollm3_float64(folder), folder


def test_smollm3_imports_with_transformers_logits(smollm3):
    from hf_compare import assert_forward_matches

    from jaxformer.formats.hf import read_hf
    model, folder = smollm3
    params, config = read_hf(folder, np.float64)
    assert (config.family, config.rope_layers, config.sliding_window, config.layer_types) == (
        "smollm3", (1, 0), 4, (FULL, SLIDE))
    assert_forward_matches(model, folder, params, config)


@pytest.mark.parametrize("source", ["jax.grad", "manual"])
def test_smollm3_gradients_match_torch_autograd(smollm3, source):
    from hf_compare import assert_grads_match_torch
    assert_grads_match_torch(*smollm3, source)


def test_smollm3_exports_and_reloads(smollm3, tmp_path):
    """The export writes no_rope_layers and the window back, transformers reloads it with our
    logits, and a family without layers apart (Llama) refuses rope_layers in one line."""
    from hf_compare import assert_logits_equal, batch, torch_logits

    from jaxformer.formats.hf import read_hf, write_hf
    _, folder = smollm3
    params, config = read_hf(folder, np.float64)
    out, kind = write_hf(tmp_path / "out", params, config)
    assert kind == "smollm3"
    b = batch(2)
    ref = torch_logits(_smollm3_float64(out), b["inputs"])
    assert_logits_equal(np.asarray(forward(params, b["inputs"], config)), ref, rtol=1e-5)  # float32 file
    assert read_hf(out, np.float64)[1] == config
    with pytest.raises(ValueError, match=r"a Hugging Face Llama needs ModelConfig.rope_layers = \(\), this model "
                                         r"has \(1, 0\)") as e:
        write_hf(tmp_path / "llama", params, config.replace(family="llama", sliding_window=0, layer_types=()))
    assert "\n" not in str(e.value)
