"""The forward model: config validation, every option builds and runs, shapes,
dtypes, the loss at init, and clear errors for bad input."""

import dataclasses
import itertools
import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxformer as jf
from jaxformer.model import layers
from jaxformer.model.config import (ACTIVATIONS, FIELD_RULES, NORMS, POSITIONS, PRESETS, SMALL_PRESETS,
                                    ModelConfig)
from jaxformer.model.params import check_params

TINY = dict(vocab_size=11, d_model=12, n_heads=3, n_layers=2, d_ff=20, max_seq_len=9)


def batch_for(config, B=3, T=7, seed=0):
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, config.vocab_size, size=(B, T + 1)).astype(np.int32)
    return {"inputs": jnp.asarray(ids[:, :-1]), "targets": jnp.asarray(ids[:, 1:])}


# ---------------------------------------------------------------------------- config


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("d_model", 10, "divisible by n_heads"),
        ("activation", "swish", "ModelConfig.activation"),
        ("norm", "middle", "ModelConfig.norm"),
        ("positions", "rotary", "ModelConfig.positions"),
        ("vocab_size", 0, "ModelConfig.vocab_size"),
        ("n_layers", -1, "ModelConfig.n_layers"),
        ("d_ff", 2.5, "ModelConfig.d_ff"),
        ("max_seq_len", True, "ModelConfig.max_seq_len"),
        ("ln_eps", 0.0, "ModelConfig.ln_eps"),
        ("causal", "yes", "ModelConfig.causal"),
    ],
)
def test_invalid_config_names_the_field(field, value, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig(**{**TINY, "n_heads": 4, "d_model": 12, field: value})


def test_every_field_has_one_rule_and_keeps_its_canonical_type():
    assert list(FIELD_RULES) == [f.name for f in dataclasses.fields(ModelConfig)]
    config = ModelConfig(**{**TINY, "d_model": np.int64(12), "ln_eps": 1, "causal": np.bool_(False)})
    assert (type(config.d_model), type(config.ln_eps), type(config.causal)) == (int, float, bool)
    assert config == ModelConfig(**{**TINY, "d_model": 12, "ln_eps": 1.0, "causal": False})
    with pytest.raises(ValueError, match=r"ModelConfig.loss_chunk must be a non-negative integer, "
                                         r"got -1 \(0: no chunking\)"):
        ModelConfig(loss_chunk=-1)
    with pytest.raises(ValueError, match=r"ModelConfig.dropout must be in \[0, 1\), got 1.0"):
        ModelConfig(dropout=1.0)


def test_config_is_hashable_and_round_trips():
    config = ModelConfig(**TINY)
    assert hash(config) == hash(ModelConfig(**TINY))
    assert ModelConfig.from_dict(config.to_dict()) == config
    with pytest.raises(ValueError, match="unknown ModelConfig field"):
        ModelConfig.from_dict({**config.to_dict(), "droput": 0.1})


def test_presets_match_the_original_systems():
    loopos = PRESETS["loopos"]
    assert (loopos.norm, loopos.activation, loopos.n_layers, loopos.d_model,
            loopos.n_heads, loopos.d_ff) == ("pre", "gelu", 3, 128, 8, 512)
    sunfish = PRESETS["sunfish"]
    assert (sunfish.norm, sunfish.activation, sunfish.positions) == ("post", "relu", "sinusoidal")
    assert PRESETS["cllm"].activation == "tanh"
    with pytest.raises(ValueError, match="unknown preset"):
        jf.get_preset("gpt5")


# ---------------------------------------------------------------------------- params


@pytest.mark.parametrize("norm, positions", list(itertools.product(NORMS, POSITIONS)))
def test_param_layout(norm, positions):
    config = ModelConfig(**TINY, norm=norm, positions=positions)
    V, D, F, L, S = 11, 12, 20, 2, 9
    params = jax.eval_shape(lambda: jf.init_params(jax.random.PRNGKey(0), config))  # the tree and shapes
    ln = {"scale": (L, D), "bias": (L, D)}
    expected = {
        "tok_embed": (V, D),
        "blocks": {
            "attn": {k: (L, D, D) if k.startswith("w") else (L, D)
                     for k in ("wq", "bq", "wk", "bk", "wv", "bv", "wo", "bo")},
            "ffn": {"w_in": (L, D, F), "b_in": (L, F), "w_out": (L, F, D), "b_out": (L, D)},
        },
        "head": {"w": (D, V), "b": (V,)},
    }
    if norm != "output":  # the norms on the sublayers' inputs (pre, sandwich) or sums (post)
        expected["blocks"].update(ln1=ln, ln2=ln)
    if norm in ("output", "sandwich"):  # the norms on the sublayers' outputs
        expected["blocks"].update(ln1_post=ln, ln2_post=ln)
    if positions == "learned":
        expected["pos_embed"] = (S, D)
    if norm != "post":
        expected["ln_f"] = {"scale": (D,), "bias": (D,)}
    shapes = jax.tree_util.tree_map(lambda x: x.shape, params)
    assert shapes == expected
    check_params(params, config)


def test_check_params_names_the_bad_leaf():
    config = ModelConfig(**TINY)
    params = jf.init_params(jax.random.PRNGKey(0), config)
    params["head"]["w"] = params["head"]["w"][:, :5]
    with pytest.raises(ValueError, match=r"\['head'\]\['w'\] has shape \(12, 5\)"):
        check_params(params, config)
    del params["head"]
    with pytest.raises(ValueError, match="missing"):
        check_params(params, config)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float64])
def test_everything_follows_the_params_dtype(dtype):
    config = ModelConfig(**TINY, positions="sinusoidal")
    params = jf.init_params(jax.random.PRNGKey(0), config, dtype=dtype)
    chex.assert_trees_all_equal_dtypes(params, jax.tree_util.tree_map(lambda x: jnp.zeros((), dtype), params))
    batch = batch_for(config)  # the dtypes as the forward and the loss trace them
    assert jax.eval_shape(lambda p, x: jf.forward(p, x, config), params, batch["inputs"]).dtype == dtype
    assert jax.eval_shape(lambda p, b: jf.loss_fn(p, b, config), params, batch).dtype == dtype


# ---------------------------------------------------------------------------- forward


# Every pair of option values, in 2 x len(ACTIVATIONS) models rather than all 32: each
# activation with a (norm, positions, causal) vector and its complement, the vectors
# cycling through four whose complements make up every combination of the three.
# The first four activations and the two position tables; the modern block's values
# (silu, relu2, rope) are in tests/test_modern_options.py's covering set.
ACTIVATIONS, POSITIONS = ACTIVATIONS[:4], POSITIONS[:2]
NORMS = NORMS[:2]  # pre, post: the layouts output and sandwich are in test_modern_options.py's
VECTORS = [(0, 0, 0), (0, 1, 1), (1, 0, 1), (1, 1, 0)]
OPTIONS = [(activation, NORMS[n], POSITIONS[p], (True, False)[c])
           for i, activation in enumerate(ACTIVATIONS)
           for n, p, c in (VECTORS[i % 4], tuple(1 - b for b in VECTORS[i % 4]))]


def test_options_cover_every_pair():
    values = (ACTIVATIONS, NORMS, POSITIONS, (True, False))
    for a, b in itertools.combinations(range(4), 2):
        assert {(o[a], o[b]) for o in OPTIONS} == set(itertools.product(values[a], values[b])), (a, b)


@pytest.mark.parametrize("activation, norm, positions, causal", OPTIONS)
def test_every_option_builds_and_runs(activation, norm, positions, causal):
    config = ModelConfig(**TINY, activation=activation, norm=norm, positions=positions, causal=causal)
    batch = batch_for(config)

    @jax.jit  # one program: init, forward and loss (compiling op by op takes seconds)
    def run(key, batch):
        params = jf.init_params(key, config, dtype=jnp.float64)
        return jf.forward(params, batch["inputs"], config), jf.loss_fn(params, batch, config)

    logits, loss = run(jax.random.PRNGKey(1), batch)
    chex.assert_shape(logits, (3, 7, 11))
    chex.assert_tree_all_finite(logits)
    assert loss.dtype == jnp.float64
    # Small init: the model's prediction is close to uniform.
    assert abs(float(loss) - math.log(config.vocab_size)) < 0.1


@pytest.mark.parametrize("name", sorted(SMALL_PRESETS))
def test_presets_build_and_start_near_uniform(name):
    config = PRESETS[name]
    params = jf.init_params(jax.random.PRNGKey(0), config)
    batch = batch_for(config, B=2, T=min(16, config.max_seq_len))
    loss = jax.jit(jf.loss_fn, static_argnums=2)(params, batch, config)
    assert abs(float(loss) - math.log(config.vocab_size)) < 0.15


def test_causal_model_does_not_see_the_future():
    config = ModelConfig(**TINY, causal=True)
    params = jf.init_params(jax.random.PRNGKey(2), config, dtype=jnp.float64)
    inputs = batch_for(config)["inputs"]
    changed = inputs.at[:, 4].set((inputs[:, 4] + 1) % config.vocab_size)
    a, b = jf.forward(params, inputs, config), jf.forward(params, changed, config)
    np.testing.assert_array_equal(a[:, :4], b[:, :4])
    assert not np.allclose(a[:, 4:], b[:, 4:])
    # Not causal: earlier positions see the change too.
    config = config.replace(causal=False)
    a, b = jf.forward(params, inputs, config), jf.forward(params, changed, config)
    assert not np.allclose(a[:, :4], b[:, :4])


def test_attention_heads_use_their_column_blocks():
    """Head h reads columns h*Dh:(h+1)*Dh of wq/wk/wv: compare with one head at a time."""
    rng = np.random.default_rng(0)
    B, T, D, H = 2, 5, 12, 3
    Dh = D // H
    p = {k: jnp.asarray(rng.normal(size=(D, D) if k[0] == "w" else (D,))) for k in
         ("wq", "bq", "wk", "bk", "wv", "bv", "wo", "bo")}
    x = jnp.asarray(rng.normal(size=(B, T, D)))
    out = layers.attention(p, x, ModelConfig(d_model=D, n_heads=H, causal=True))
    heads = []
    for h in range(H):
        cols = slice(h * Dh, (h + 1) * Dh)
        q, k, v = (x @ p[w][:, cols] + p[b][cols] for w, b in (("wq", "bq"), ("wk", "bk"), ("wv", "bv")))
        s = q @ np.swapaxes(k, -1, -2) / np.sqrt(Dh)
        s = np.where(np.tril(np.ones((T, T), bool)), s, -np.inf)
        prob = np.exp(s - s.max(-1, keepdims=True))
        heads.append((prob / prob.sum(-1, keepdims=True)) @ v)
    expected = np.concatenate(heads, axis=-1) @ p["wo"] + p["bo"]
    np.testing.assert_allclose(out, expected, rtol=1e-12, atol=1e-12)


def test_layer_norm_normalizes():
    x = jnp.asarray(np.random.default_rng(0).normal(3.0, 2.0, size=(4, 6, 10)))
    y = layers.layer_norm({"scale": jnp.ones(10), "bias": jnp.zeros(10)}, x, 1e-5)
    np.testing.assert_allclose(y.mean(-1), 0, atol=1e-12)
    np.testing.assert_allclose(y.var(-1), 1, rtol=1e-5)


def test_activations_match_jax_nn():
    x = jnp.linspace(-6, 6, 101)
    np.testing.assert_allclose(layers.gelu(x), jax.nn.gelu(x, approximate=False), rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(layers.gelu_tanh(x), jax.nn.gelu(x, approximate=True), rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(layers.relu(x), jax.nn.relu(x))


def test_sinusoidal_positions():
    table = layers.sinusoidal_positions(7, 6, jnp.float64)
    t, i = 5, 2  # feature 2i = 4 is sin, 2i + 1 = 5 is cos, both at frequency 10000^(-4/6)
    np.testing.assert_allclose(table[t, 2 * i], np.sin(t / 10000 ** (2 * i / 6)), rtol=1e-12)
    np.testing.assert_allclose(table[t, 2 * i + 1], np.cos(t / 10000 ** (2 * i / 6)), rtol=1e-12)
    assert layers.sinusoidal_positions(4, 5).shape == (4, 5)  # odd width


def test_cross_entropy_matches_log_softmax_and_mask():
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.normal(size=(2, 5, 7)) * 1e4)  # large: must stay finite
    targets = jnp.asarray(rng.integers(0, 7, size=(2, 5)))
    mask = jnp.asarray(rng.integers(0, 2, size=(2, 5)))
    nll = -np.take_along_axis(np.asarray(jax.nn.log_softmax(logits)), np.asarray(targets)[..., None], -1)[..., 0]
    np.testing.assert_allclose(jf.cross_entropy(logits, targets), nll.mean(), rtol=1e-12)
    np.testing.assert_allclose(jf.cross_entropy(logits, targets, mask),
                               (nll * mask).sum() / mask.sum(), rtol=1e-12)
    # an all-zero mask: exactly 0 (never an error or a NaN), eagerly and under jit
    assert float(jf.cross_entropy(logits, targets, jnp.zeros_like(mask))) == 0.0
    assert float(jax.jit(jf.cross_entropy)(logits, targets, jnp.zeros_like(mask))) == 0.0


@pytest.mark.parametrize("loss_chunk", [0, 4])
def test_all_zero_mask_is_a_loss_of_zero_on_every_path(loss_chunk):
    """No position counts: loss 0 and gradients exactly 0 (float64) from jaxformer.loss_fn
    eager and jitted, manual_grads.value_and_grad, jax.grad and the custom_vjp rules,
    with the head and loss at once or chunk by chunk (4 does not divide B * T = 21)."""
    import manual_grads
    from manual_grads import custom_vjp

    config = ModelConfig(**TINY, loss_chunk=loss_chunk)
    params = jf.init_params(jax.random.PRNGKey(0), config, dtype=jnp.float64)
    batch = {**batch_for(config), "mask": jnp.zeros((3, 7))}
    assert float(jf.loss_fn(params, batch, config)) == 0.0
    assert float(jax.jit(jf.loss_fn, static_argnums=2)(params, batch, config)) == 0.0
    sources = {
        "manual": manual_grads.value_and_grad(params, batch, config),
        "manual, jitted": jax.jit(manual_grads.value_and_grad, static_argnums=2)(params, batch, config),
        "jax.grad": jax.value_and_grad(jf.loss_fn)(params, batch, config),
        "custom_vjp": jax.value_and_grad(custom_vjp.loss_fn)(params, batch, config),
    }
    for name, (loss, grads) in sources.items():
        assert float(loss) == 0.0, name
        assert jax.tree_util.tree_structure(grads) == jax.tree_util.tree_structure(params), name
        for leaf in jax.tree_util.tree_leaves(grads):
            assert leaf.dtype == jnp.float64, name
            np.testing.assert_array_equal(leaf, 0.0, err_msg=name)


# ---------------------------------------------------------------------------- bad input


@pytest.fixture(scope="module")
def tiny():
    config = ModelConfig(**TINY)
    return config, jf.init_params(jax.random.PRNGKey(0), config)


@pytest.mark.parametrize(
    "inputs, message",
    [
        (np.full((2, 4), 11, np.int32), r"token id 11 at position \(0, 0\), outside \[0, vocab_size=11\)"),
        (np.array([[0, 1, -1]], np.int32), r"token id -1 at position \(0, 2\)"),
        (np.zeros((2, 4), np.float32), "integer dtype"),
        (np.zeros((4,), np.int32), r"shape \(B, T\)"),
        (np.zeros((1, 10), np.int32), "sequence length 10, longer than max_seq_len=9"),
        (np.zeros((1, 0), np.int32), "empty"),
        ([[1, 2]], "integer array"),
    ],
)
def test_forward_rejects_bad_inputs(tiny, inputs, message):
    config, params = tiny
    with pytest.raises(ValueError, match=message):
        jf.forward(params, inputs, config)


def test_loss_fn_rejects_bad_batches(tiny):
    config, params = tiny
    good = batch_for(config)
    with pytest.raises(ValueError, match="keys 'inputs' and 'targets'"):
        jf.loss_fn(params, {"inputs": good["inputs"]}, config)
    with pytest.raises(ValueError, match=r"batch\['targets'\] holds token id 99"):
        jf.loss_fn(params, {**good, "targets": good["targets"].at[1, 1].set(99)}, config)
    with pytest.raises(ValueError, match=r"batch\['mask'\] has shape \(3, 6\)"):
        jf.loss_fn(params, {**good, "mask": jnp.ones((3, 6))}, config)
    # Under jit the shape checks still run (values cannot be inspected there).
    with pytest.raises(ValueError, match="longer than max_seq_len"):
        jax.jit(jf.loss_fn, static_argnums=2)(
            params, {"inputs": jnp.zeros((1, 12), jnp.int32), "targets": jnp.zeros((1, 12), jnp.int32)}, config)
