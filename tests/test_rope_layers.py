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
from helpers import assert_sources_agree, decode_one_at_a_time, make_batch, make_params

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
    np.testing.assert_allclose(features(params, inputs, BASE), x, rtol=1e-12, atol=1e-12)
    logits = forward(params, inputs, BASE)
    for other in (dict(rope_local_theta=0.0), dict(rope_layers=())):  # each field changes the model
        assert np.max(np.abs(forward(params, inputs, BASE.replace(**other)) - logits)) > 1e-5


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
    np.testing.assert_allclose(decode_one_at_a_time(params, inputs, BASE, 5), forward(params, inputs, BASE),
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
