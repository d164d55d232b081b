"""Sliding-window attention (ModelConfig.sliding_window, layer_types; AttentionSpec.window): the
query at t reads the keys t - W < s <= t. In float64: every core (full, blockwise, the Pallas
kernels in interpret mode) equals a dense masked softmax written here, and its manual backward
equals jax.vjp of the full core; a window W >= T is no window, W = 1 reads the query's own key;
blockwise and the kernels walk only the key blocks the window reaches; cuDNN's
local_window_size means the same window; layers of two kinds (layer_types) run each its own
mask, forward and the cache decoder alike; bad values are named. The three gradient sources on
layers of two kinds: the sliding layer first in test_rope_layers.py (sliding, full, sliding,
full, with a local rotary base and NoPE layers), the full one first in the pairwise option
matrix (test_modern_options.py), with every core and every option."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import FORWARD, Layer, assert_layer_matches_vjp, decode_one_at_a_time, make_batch, make_params

from jaxformer.kernels.pallas import forward as pa
from jaxformer.kernels.pallas import tiling as pt
from jaxformer.model.attention import CORES, attention_spec
from jaxformer.model.blockwise import blockwise_attention_core, window_blocks
from jaxformer.model.config import ModelConfig
from jaxformer.model.cores import AttentionSpec, full, local_window
from jaxformer.model.layer_kinds import layer_config
from jaxformer.model.block import block
from jaxformer.model.embedding import embed
from jaxformer.model.rms_norm import rms_norm
from jaxformer.model.transformer import features
from manual_grads.attention import MANUAL_CORES

B, H, T, Dh = 2, 4, 13, 4  # T = 13 leaves the last block of 4 padded
SLIDE, FULL = "sliding_attention", "full_attention"


def qkv(seed, Hkv=H):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, H, T, Dh))
    k, v = (rng.standard_normal((B, Hkv, T, Dh)) for _ in range(2))
    return q, k, v, rng.standard_normal((B, H, T, Dh))


def dense_reference(q, k, v, window):
    """softmax(q k^T / sqrt(Dh)) v with the mask t - W < s <= t, in numpy, k and v repeated to q's heads."""
    G = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, G, axis=1), np.repeat(v, G, axis=1)
    s = q @ np.swapaxes(k, -1, -2) / np.sqrt(q.shape[-1])
    t, j = np.arange(T)[:, None], np.arange(T)[None, :]
    s = np.where((j <= t) & (j > t - window), s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    return (p / p.sum(-1, keepdims=True)) @ v


def spec(window, impl):
    return AttentionSpec(block=4, block_q=8 if impl == "pallas" else 0, block_k=4 if impl == "pallas" else 0,
                         window=window)


IMPLS = [("full", 2), ("blockwise", H), ("pallas", 2), ("pallas", 1)]


@pytest.mark.parametrize("window", [1, 3, 5, 9])
@pytest.mark.parametrize("impl, Hkv", IMPLS)
def test_every_core_equals_dense_mask(impl, Hkv, window):
    """Each core's output with the window equals the dense masked softmax written above."""
    q, k, v, _ = qkv(window + Hkv, Hkv)
    got = jax.jit(CORES[impl].fn, static_argnums=3)(q, k, v, spec(window, impl))
    np.testing.assert_allclose(got, dense_reference(q, k, v, window), rtol=1e-12, atol=1e-13)


@pytest.mark.parametrize("window", [2, 6])
@pytest.mark.parametrize("impl, Hkv", IMPLS)
def test_manual_core_backward_equals_autodiff(impl, Hkv, window):
    """manual core_fwd / core_bwd with the window against jax.vjp of the full core (a dense
    mask) with it, every leaf within 1e-10; the window changes every gradient (the test can fail)."""
    q, k, v, dout = qkv(10 * window + Hkv, Hkv)
    manual = MANUAL_CORES[impl]
    (_, grads), _ = assert_layer_matches_vjp(Layer(manual.fwd, manual.bwd, full), (q, k, v), dout,
                                             static=(spec(window, impl),))
    _, (_, grads0) = assert_layer_matches_vjp(Layer(manual.fwd, manual.bwd, full), (q, k, v), dout,
                                              static=(spec(0, impl),))
    assert all(np.max(np.abs(a - b)) > 1e-3 for a, b in zip(grads, grads0))


@pytest.mark.parametrize("impl, Hkv", IMPLS)
def test_window_as_long_as_the_sequence_is_no_window(impl, Hkv):
    q, k, v, _ = qkv(3, Hkv)
    f = jax.jit(CORES[impl].fn, static_argnums=3)
    for window in (T, T + 5):
        np.testing.assert_allclose(f(q, k, v, spec(window, impl)), f(q, k, v, spec(0, impl)), rtol=1e-13, atol=1e-14)


@pytest.mark.parametrize("impl, Hkv", IMPLS)
def test_window_of_one_reads_its_own_key(impl, Hkv):
    q, k, v, _ = qkv(4, Hkv)
    got = jax.jit(CORES[impl].fn, static_argnums=3)(q, k, v, spec(1, impl))
    np.testing.assert_allclose(got, np.repeat(v, H // Hkv, axis=1), rtol=1e-13, atol=1e-14)


def _scan_lengths(jaxpr):
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "scan":
            found.append(eqn.params["length"])
        for sub in eqn.params.values():
            sub = getattr(sub, "jaxpr", sub)  # a ClosedJaxpr's, or a Jaxpr
            if hasattr(sub, "eqns"):
                found += _scan_lengths(sub)
            elif isinstance(sub, tuple):  # cond's branches
                found += [n for b in sub if hasattr(getattr(b, "jaxpr", b), "eqns")
                          for n in _scan_lengths(getattr(b, "jaxpr", b))]
    return found


def test_blockwise_walks_only_the_windows_key_blocks():
    """T = 64 in blocks of 4 (16 query blocks): each one's key loop is ceil((W - 1) / 4) + 1
    blocks long with a window W (2 for W = 5, 3 for W = 6), all 16 without one or with W >= T."""
    x = jnp.zeros((1, 1, 64, 4))
    for window, inner in ((0, 16), (5, 2), (6, 3), (64, 16)):
        s = AttentionSpec(block=4, window=window)
        lengths = _scan_lengths(jax.make_jaxpr(lambda q: blockwise_attention_core(q, q, q, s))(x).jaxpr)
        assert sorted(lengths) == sorted([16, inner]), (window, lengths)
        assert window_blocks(s, 4, 16) == inner


def test_pallas_loops_start_and_stop_at_the_window():
    """The kernels' loop bounds: key blocks first_key_block(i) .. key_blocks_seen(i), query blocks
    first_query_block(j) .. query_blocks_seen(j), each the exact range of blocks holding a visible pair."""
    t = pt.tiling(40, 8, 8, 4, "cpu")  # Kq 8, Kk 4: Nq 5, Nk 10
    for window in (1, 3, 6, 13):
        q_pos, k_pos = np.arange(40)[:, None], np.arange(40)[None, :]
        seen = (k_pos <= q_pos) & (k_pos > q_pos - window)
        for i in map(jnp.int32, range(t.Nq)):
            js = np.nonzero(seen[i * 8:(i + 1) * 8].any(0))[0] // 4
            assert (int(pa.first_key_block(i, t, window)), int(pa.key_blocks_seen(i, t, True))) == (js.min(), js.max() + 1)
        for j in map(jnp.int32, range(t.Nk)):
            iq = np.nonzero(seen[:, j * 4:(j + 1) * 4].any(1))[0] // 8
            assert (int(pa.first_query_block(j, t, True)), int(pa.query_blocks_seen(j, t, window))) == \
                (iq.min(), iq.max() + 1)


@pytest.mark.parametrize("window", [1, 4])
def test_cudnn_local_window_size_means_the_same_window(window):
    """cuDNN's core passes local_window_size=local_window(W) with is_causal; JAX's own (XLA)
    implementation of the same call, runnable here, equals the full core with the window (to
    its float32 softmax's round-off), and not the one a key wider."""
    q, k, v, _ = qkv(6, 2)
    to_bthd = lambda a: jnp.swapaxes(jnp.asarray(a), 1, 2)  # noqa: E731
    got = jax.nn.dot_product_attention(to_bthd(q), to_bthd(k), to_bthd(v), is_causal=True,
                                       local_window_size=local_window(window), implementation="xla")
    got = jnp.swapaxes(got, 1, 2)
    np.testing.assert_allclose(got, full(q, k, v, AttentionSpec(window=window)), rtol=1e-5, atol=1e-6)
    assert np.max(np.abs(got - full(q, k, v, AttentionSpec(window=window + 1)))) > 1e-2


# ---------------------------------------------------------------------------- the model

BASE = ModelConfig(vocab_size=23, d_model=16, n_heads=4, n_kv_heads=2, n_layers=2, d_ff=24, max_seq_len=16,
                   norm_type="rms", positions="rope", mlp="gated", activation="silu", attention_block=4,
                   pallas_block_q=8, pallas_block_k=4, sliding_window=3)
MIXED = (SLIDE, FULL)


def test_layer_types_give_each_layer_its_own_mask():
    """A mixed model's features equal the blocks run one by one, each with its own layer's
    config, and the logits differ from the model with every layer sliding and with none."""
    config = BASE.replace(layer_types=MIXED)
    params = make_params(config, jnp.float64)
    inputs = make_batch(config, 2, 16, None)["inputs"]
    x = embed(params, inputs, config)
    for l, windowed in enumerate(config.windowed_layers):
        x = jax.jit(block, static_argnums=2)(jax.tree_util.tree_map(lambda a: a[l], params["blocks"]), x,
                                             layer_config(config, windowed))
    x = rms_norm(params["ln_f"], x, config.ln_eps)
    np.testing.assert_allclose(jax.jit(features, static_argnums=2)(params, inputs, config), x, rtol=1e-12, atol=1e-12)
    logits = FORWARD(params, inputs, config)
    for other in (BASE, BASE.replace(sliding_window=0)):
        assert np.max(np.abs(FORWARD(params, inputs, other) - logits)) > 1e-3


@pytest.mark.parametrize("layers", [(), MIXED])
def test_cached_decoding_equals_the_forward(layers):
    """The key/value-cache decoder, a prompt of 5 then one token at a time, equals the full
    forward with the window (a query at t reads at most W cached keys)."""
    config = BASE.replace(layer_types=layers)
    params = make_params(config, jnp.float64)
    inputs = make_batch(config, 2, 16, None)["inputs"]
    got = decode_one_at_a_time(params, inputs, config, 5)
    np.testing.assert_allclose(got, FORWARD(params, inputs, config), rtol=1e-11, atol=1e-11)
    assert np.max(np.abs(got - FORWARD(params, inputs, config.replace(sliding_window=0, layer_types=())))) > 1e-3


def test_every_layer_sliding_is_one_config():
    assert BASE.replace(layer_types=(SLIDE,) * 2) == BASE
    assert BASE.replace(layer_types=[FULL, SLIDE]).layer_types == (FULL, SLIDE)
    assert BASE.windowed_layers == (True,) * 2
    assert BASE.replace(sliding_window=0).windowed_layers == (False,) * 2


@pytest.mark.parametrize("changes, match", [
    (dict(sliding_window=-1), r"ModelConfig.sliding_window must be a non-negative integer, got -1"),
    (dict(sliding_window=2.5), r"ModelConfig.sliding_window must be"),
    (dict(causal=False), r"ModelConfig.sliding_window 3 needs causal True"),
    (dict(layer_types=(SLIDE, FULL, FULL)), r"ModelConfig.layer_types has 3 entries, n_layers is 2"),
    (dict(layer_types=(SLIDE, "local")), r"ModelConfig.layer_types\[1\] must be one of 'sliding_attention', "
                                                r"'full_attention', got 'local'"),
    (dict(layer_types="sliding_attention"), r"ModelConfig.layer_types must be a tuple of"),
    (dict(sliding_window=0, layer_types=MIXED), r"names 'sliding_attention' layers but sliding_window is 0"),
])
def test_bad_values_are_named(changes, match):
    with pytest.raises(ValueError, match=match):
        BASE.replace(**changes)


def test_refusals_of_mixed_config_and_bidirectional_window():
    with pytest.raises(ValueError, match="mixes sliding and full layers"):
        attention_spec(BASE.replace(layer_types=MIXED))
    with pytest.raises(ValueError, match="AttentionSpec.window 3 needs causal True"):
        AttentionSpec(causal=False, window=3)
    assert attention_spec(BASE).window == 3 and attention_spec(BASE.replace(sliding_window=0)).window == 0


def test_flags_and_config_file_carry_the_window(tmp_path):
    """--sliding-window and --layer-types a,b parse into the model; a run's config.toml (written
    as a run writes it) carries both back, layer_types as a TOML array."""
    from jaxformer.cli import train as cli_train
    from jaxformer.cli.main import build_parser
    from jaxformer.training.configfile import write_config

    args = build_parser().parse_args(["train", "--out", "unused", "--preset", "tiny", "--sliding-window", "5",
                                      "--layer-types", "full_attention,sliding_attention"])
    settings = cli_train.train_settings(args)
    config = settings.model_config(256)
    assert (config.sliding_window, config.layer_types) == (5, (FULL, SLIDE))
    write_config(tmp_path / "config.toml", settings, config)
    assert "layer_types = [\"full_attention\", \"sliding_attention\"]" in (tmp_path / "config.toml").read_text()
    again = cli_train.train_settings(build_parser().parse_args(
        ["train", "--out", "unused", "--config", str(tmp_path / "config.toml")]))
    assert again.model_config(256) == config


def test_checkpoint_meta_matches_its_windowed_config():
    """A checkpoint's config as JSON (layer_types a list) is no change on resume: config_diff finds
    nothing, and a different pattern is named."""
    import json

    from jaxformer.training.settings import config_diff
    config = BASE.replace(layer_types=MIXED)
    for c in (config, BASE.replace(sliding_window=0)):
        saved = json.loads(json.dumps(c.to_dict()))
        assert config_diff(saved, c) == []
    saved = json.loads(json.dumps(config.to_dict()))
    assert config_diff(saved, config.replace(layer_types=(FULL, SLIDE))) == [
        "layer_types: ('sliding_attention', 'full_attention') (checkpoint) vs ('full_attention', 'sliding_attention') "
        "(requested)"]
