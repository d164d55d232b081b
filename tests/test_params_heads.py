"""The head width apart from d_model / n_heads (``head_dim``) and the linear layers' biases
apart (``qkv_bias``, ``out_bias``, ``mlp_bias``): the params each makes, the config's rules,
that the defaults leave every model as it was, the key/value cache and the FLOPs count.
Their gradients (manual == jax.grad == custom_vjp) are in test_modern_options.py's matrix."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import make_batch, make_params

import jaxformer
from jaxformer.model.config import PRESETS, ModelConfig
from jaxformer.model.kv_cache import forward_cached, init_cache
from jaxformer.model.params import expected_shapes
from jaxformer.observe.flops import matmul_params

BASE = ModelConfig(vocab_size=29, d_model=16, n_heads=4, n_layers=2, d_ff=24, max_seq_len=16)
L, D, F = 2, 16, 24


def _attn(config):
    return {k.split("'")[-2]: v for k, v in expected_shapes(config).items() if "attn" in k}


def test_head_dim_sets_the_projection_widths():
    c = BASE.replace(head_dim=6, n_kv_heads=2, qk_norm=True, norm_type="rms", positions="rope")
    assert c.d_head == 6 and BASE.d_head == 4
    assert _attn(c) == {"wq": (L, D, 24), "wk": (L, D, 12), "wv": (L, D, 12), "wo": (L, 24, D),
                        "bq": (L, 24), "bk": (L, 12), "bv": (L, 12), "bo": (L, D),
                        "scale": (L, 6)}  # q_norm's and k_norm's, over Dh
    assert init_cache(c, 3, jnp.float32)["k"].shape == (L, 3, 2, 16, 6)


def test_head_dim_frees_d_model_from_n_heads():
    c = BASE.replace(d_model=10, n_heads=4, head_dim=8, positions="rope")  # 10 is not 4 * anything even
    assert _attn(c)["wq"] == (L, 10, 32) and _attn(c)["wo"] == (L, 32, 10)
    with pytest.raises(ValueError, match=r"d_model \(10\) must be divisible by n_heads \(4\)"):
        c.replace(head_dim=0)
    with pytest.raises(ValueError, match="positions 'rope' needs an even head width: head_dim is 5"):
        c.replace(head_dim=5)
    with pytest.raises(ValueError, match="ModelConfig.head_dim must be a non-negative integer"):
        c.replace(head_dim=-1)


@pytest.mark.parametrize("fields, present", [
    (dict(bias=False, qkv_bias=True), {"bq", "bk", "bv"}),  # Qwen 2.5
    (dict(bias=False, out_bias=True), {"bo"}),
    (dict(bias=True, out_bias=False), {"bq", "bk", "bv", "b_in", "b_out"}),
    (dict(bias=True, mlp_bias=False, mlp="gated"), {"bq", "bk", "bv", "bo"}),
    (dict(bias=False, mlp_bias=True, mlp="gated"), {"b_gate", "b_up", "b_down"}),
])
def test_bias_fields_keep_or_drop_each_layers_biases(fields, present):
    shapes = expected_shapes(BASE.replace(**fields))
    leaves = {k: k.split("'")[-2] for k in shapes}
    got = {leaf for k, leaf in leaves.items() if leaf.startswith("b") and "ln" not in k and "head" not in k}
    assert got == present
    norm_bias = any("ln1']['bias" in k for k in shapes)
    assert norm_bias == fields["bias"]  # the norms' biases follow bias alone


def test_bias_fields_default_to_bias_and_keep_one_config_per_model():
    assert BASE.linear_biases == (True, True, True)
    assert BASE.replace(bias=False).linear_biases == (False, False, False)
    assert BASE.replace(qkv_bias=True) == BASE  # equal to bias: the same model, the same config
    assert BASE.replace(bias=False, qkv_bias=True).replace(bias=True) == BASE
    assert ModelConfig.from_dict(BASE.replace(bias=False, qkv_bias=True).to_dict()).linear_biases == (
        True, False, False)
    with pytest.raises(ValueError, match="ModelConfig.out_bias must be True or False, got 1 .None: as bias"):
        BASE.replace(out_bias=1)


@pytest.mark.parametrize("name", ["tiny", "llama-tiny", "smollm", "gpt2"])
def test_defaults_leave_every_model_as_it_was(name):
    """head_dim 0 and the bias fields at None draw the very params they drew before."""
    config = PRESETS[name].replace(n_layers=1, vocab_size=64, max_seq_len=16)
    explicit = config.replace(head_dim=config.d_model // config.n_heads, qkv_bias=config.bias,
                              out_bias=config.bias, mlp_bias=config.bias)
    a = jaxformer.init_params(jax.random.PRNGKey(3), config)
    b = jaxformer.init_params(jax.random.PRNGKey(3), explicit)
    assert jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b)
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
        np.testing.assert_array_equal(x, y)


def test_cache_decodes_as_the_model_with_wide_heads_and_qkv_biases():
    jax.config.update("jax_enable_x64", True)
    c = BASE.replace(head_dim=6, n_kv_heads=2, positions="rope", qk_norm=True, norm_type="rms",
                     bias=False, qkv_bias=True)
    params = make_params(c, jnp.float64)
    inputs = make_batch(c, 2, 9, None)["inputs"]
    whole = jaxformer.forward(params, inputs, c)
    cache = init_cache(c, 2, jnp.float64)
    first, cache = forward_cached(params, inputs[:, :5], cache, 0, c)
    rest, _ = forward_cached(params, inputs[:, 5:], cache, 5, c)
    np.testing.assert_allclose(jnp.concatenate([first, rest], axis=1), whole, rtol=1e-12, atol=1e-12)


def test_flops_count_the_wide_heads():
    for c in (BASE, BASE.replace(head_dim=6, n_kv_heads=2), BASE.replace(head_dim=10, mlp="gated")):
        shapes = expected_shapes(c.replace(bias=False, head_bias=False))
        weights = [k for k in shapes if k.split("'")[-2] in ("wq", "wk", "wv", "wo", "w_in", "w_out",
                                                             "w_gate", "w_up", "w_down", "w")]
        assert matmul_params(c) == sum(int(np.prod(shapes[k])) for k in weights)
