"""Grouped-query attention and QK-norm at the layer: manual_grads.attention's attention_fwd /
attention_bwd against jax.vjp of jaxformer.model.attention.attention, in float64, around
each core that runs on a CPU (full, blockwise, pallas in interpret mode), rotary positions on."""

import pytest
from helpers import Layer, assert_layer_matches_vjp

import jax
import numpy as np

from jaxformer.model.attention import CORES, attention
from jaxformer.model.config import ATTENTION_IMPLS, ModelConfig
from manual_grads.attention import MANUAL_CORES, attention_bwd, attention_fwd

ATTENTION = Layer(attention_fwd, attention_bwd, attention)
D, H, T = 16, 4, 11  # Dh = 4; T = 11 leaves the last block of 4 (blockwise) and 8 (pallas) padded


def modern_params(seed, Hkv, bias):
    """{wq, wk, wv, wo, q_norm, k_norm} (k and v with Hkv heads; b* with ``bias``), x and dy (2, T, D)."""
    rng = np.random.default_rng(seed)
    Dh = D // H
    widths = {"q": D, "k": Hkv * Dh, "v": Hkv * Dh, "o": D}
    p = {"w" + n: rng.standard_normal((D, w)) / np.sqrt(D) for n, w in widths.items()}
    if bias:
        p.update({"b" + n: 0.5 * rng.standard_normal(w) for n, w in widths.items()})
    p["q_norm"] = {"scale": 1.0 + 0.3 * rng.standard_normal(Dh)}
    p["k_norm"] = {"scale": 1.0 + 0.3 * rng.standard_normal(Dh)}
    return p, rng.standard_normal((2, T, D)), rng.standard_normal((2, T, D))


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
@pytest.mark.parametrize("Hkv", [2, 1], ids=["gqa", "mqa"])
@pytest.mark.parametrize("impl", ["full", "blockwise", "pallas"])
def test_gqa_qk_norm_rope_matches_autodiff(impl, Hkv, causal):
    config = ModelConfig(d_model=D, n_heads=H, n_kv_heads=Hkv, qk_norm=True, positions="rope",
                         norm_type="rms", causal=causal, attention_impl=impl, attention_block=4,
                         pallas_block_q=8, pallas_block_k=8, bias=impl != "pallas")
    p, x, dy = modern_params(Hkv + 2 * causal, Hkv, config.bias)
    (_, (dp, _)), _ = assert_layer_matches_vjp(ATTENTION, (p, x), dy, static=(config,), y_rtol=1e-12,
                                               y_atol=1e-12)
    assert dp["wk"].shape == (D, Hkv * D // H) and set(dp["q_norm"]) == {"scale"}


@pytest.mark.parametrize("impl", ["full", "blockwise"])
def test_qk_norm_alone_matches_autodiff(impl):
    """QK-norm without rotary positions or grouped heads (learned positions)."""
    config = ModelConfig(d_model=D, n_heads=H, qk_norm=True, attention_impl=impl, attention_block=4)
    p, x, dy = modern_params(7, H, True)
    assert_layer_matches_vjp(ATTENTION, (p, x), dy, static=(config,))


def test_core_tables_name_every_impl():
    """CORES and MANUAL_CORES (each core's pair) name every ModelConfig.attention_impl, in order."""
    assert tuple(CORES) == tuple(MANUAL_CORES) == ATTENTION_IMPLS


def test_manual_cudnn_is_refused_off_a_gpu():
    """cuDNN's pair traces on a CPU (its stand-ins) and refuses to run there, naming the backend;
    its backward too."""
    config = ModelConfig(d_model=D, n_heads=H, attention_impl="cudnn", compute_dtype="bfloat16")
    p, x, _ = modern_params(0, H, True)
    with pytest.raises(ValueError, match="attention_impl 'cudnn' runs only on a GPU.*'cpu'"):
        attention_fwd(p, x, config)
    with pytest.raises(ValueError, match="attention_impl 'cudnn' runs only on a GPU.*'cpu'"):
        jax.jit(lambda p, x: attention_bwd(attention_fwd(p, x, config)[1], x)).lower(p, x)
