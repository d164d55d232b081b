"""Qwen2-MoE's shared expert (ModelConfig.shared_expert_d_ff, shared_expert_gate;
jaxformer/model/shared_expert.py and its backward manual_grads/shared_expert.py): the layer is
moe(x) + sigmoid(x @ shared_gate) * gated_mlp(x), computed here from the plain MoE layer and the
dense gated MLP; its gradients from manual_grads, jax.grad and the custom_vjp drop-in agree in
float64 (1e-10 per leaf), in the layer and in whole models; transformers' Qwen2MoeSparseMoeBlock
gives the same output and gradients; the cached decoder, the params and the config's errors.

Random weights make ties between router logits measure-zero: every source differentiates the
same routing."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import (assert_bfloat16_within_autodiff, assert_sources_agree, decode_one_at_a_time, make_batch,
                     make_params)
from test_moe import assert_layer_is_hf_block, assert_layer_sources_agree

import jaxformer
from jaxformer.model.config import PRESETS
from jaxformer.model.mlp import gated_feed_forward
from jaxformer.model.moe import moe

jax.config.update("jax_enable_x64", True)
TINY = PRESETS["tiny-moe"].replace(shared_expert_d_ff=8)  # D 16, 4 experts of width 12, 2 per token
KEY = jax.random.PRNGKey(4)


def _layer_params(config, seed=0):
    p = make_params(config, jnp.float64, seed)["blocks"]["ffn"]
    p = jax.tree_util.tree_map(lambda a: a[0], p)
    scaled = {name: p[name] * 20.0 for name in ("router", "shared_gate") if name in p}  # gates far from uniform
    return {**p, **scaled}


@pytest.mark.parametrize("gated", [True, False])
def test_layer_is_the_routed_experts_plus_the_gated_shared_mlp(gated):
    config = TINY.replace(shared_expert_gate=gated)
    p = _layer_params(config)
    x = jax.random.normal(KEY, (2, 5, 16), jnp.float64)
    y, stats = moe(p, x, config)
    routed, routed_stats = moe(p, x, config.replace(shared_expert_d_ff=0, shared_expert_gate=True))
    h = gated_feed_forward(p["shared"], x, "silu")
    s = jax.nn.sigmoid(x @ p["shared_gate"]) if gated else 1.0
    np.testing.assert_allclose(y, routed + s * h, rtol=1e-13, atol=1e-13)
    jax.tree_util.tree_map(np.testing.assert_array_equal, stats, routed_stats)
    assert float(jnp.max(jnp.abs(s * h))) > 1e-3  # the shared expert adds something


@pytest.mark.parametrize("gated", [True, False])
def test_layer_backward_equals_autodiff_and_custom_vjp(gated):
    config = TINY.replace(shared_expert_gate=gated, router="softmax_topk", norm_topk_prob=True)
    manual = assert_layer_sources_agree(config, _layer_params(config), KEY)
    want = {"router", "w_gate", "w_up", "w_down", "shared"} | ({"shared_gate"} if gated else set())
    assert set(manual[0]) == want and set(manual[0]["shared"]) == {"w_gate", "w_up", "w_down"}


def test_scanned_model_gradients_from_three_sources_agree_in_float64():
    """Five layers (more than remat.UNROLL_MAX_LAYERS: the blocks' lax.scan), the shared expert
    gated, remat "block". The two-layer models are the pairwise option matrix's
    (test_modern_options.py): every pair of shared_expert_d_ff 8, shared_expert_gate {True, False},
    router, loss_chunk 5, dropout 0.2, norm "sandwich" and the other options is in a row it checks
    (the ungated shared expert with loss chunks, dropout and sandwich norms among them)."""
    config = TINY.replace(n_layers=5, router="softmax_topk", remat="block")
    assert_sources_agree(config, 2, 9, "mostly_zero", KEY)


def test_cached_decoder_equals_the_forward():
    params, batch = make_params(TINY, jnp.float64), make_batch(TINY, 2, 9, None)
    want = jaxformer.forward(params, batch["inputs"], TINY)
    np.testing.assert_allclose(decode_one_at_a_time(params, batch["inputs"], TINY, 4), want, rtol=1e-10, atol=1e-12)


def test_bfloat16_rule():
    params, batch = make_params(TINY, jnp.float32), make_batch(TINY, 2, 9, None)
    assert_bfloat16_within_autodiff(params, batch, TINY)


def test_params_and_the_other_draws():
    L, D, Fs = 2, 16, 8
    shapes = jax.eval_shape(lambda: jaxformer.init_params(jax.random.PRNGKey(0), TINY))["blocks"]["ffn"]
    assert {k: v.shape for k, v in shapes["shared"].items()} == {"w_gate": (L, D, Fs), "w_up": (L, D, Fs),
                                                                 "w_down": (L, Fs, D)}
    assert shapes["shared_gate"].shape == (L, D, 1)
    no_gate = TINY.replace(shared_expert_gate=False)
    ungated = jax.eval_shape(lambda: jaxformer.init_params(jax.random.PRNGKey(0), no_gate))
    assert "shared_gate" not in ungated["blocks"]["ffn"]
    a = jaxformer.init_params(jax.random.PRNGKey(0), PRESETS["tiny-moe"])
    b = jaxformer.init_params(jax.random.PRNGKey(0), TINY)
    for name in ("router", "w_gate", "w_up", "w_down"):
        np.testing.assert_array_equal(a["blocks"]["ffn"][name], b["blocks"]["ffn"][name])


def test_layer_is_transformers_qwen2_moe_block():
    """transformers' Qwen2MoeSparseMoeBlock (float64 module) with our weights: output and
    gradients within 1e-6 of each largest entry (its router softmax runs in float32)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock
    hf_config = transformers.Qwen2MoeConfig(hidden_size=16, num_experts_per_tok=2, hidden_act="silu", num_experts=4,
                                            moe_intermediate_size=12, shared_expert_intermediate_size=8,
                                            norm_topk_prob=False)
    hf = Qwen2MoeSparseMoeBlock(hf_config).double()
    config = TINY.replace(router="softmax_topk")
    p = _layer_params(config)
    t = lambda a: torch.tensor(np.asarray(a))  # noqa: E731
    with torch.no_grad():  # the shared expert's weights; the routed ones: assert_layer_is_hf_block
        for name in ("gate", "up", "down"):
            getattr(hf.shared_expert, f"{name}_proj").weight.copy_(t(p["shared"][f"w_{name}"].T))
        hf.shared_expert_gate.weight.copy_(t(p["shared_gate"].T))
    dp = assert_layer_is_hf_block(torch, hf, p, config, KEY)  # the output, x, the router and experts
    close = lambda a, b: np.max(np.abs(np.asarray(a) - b)) <= 1e-6 * np.max(np.abs(b))  # noqa: E731
    assert close(dp["shared_gate"], hf.shared_expert_gate.weight.grad.numpy().T)
    for name in ("gate", "up", "down"):
        assert close(dp["shared"][f"w_{name}"], getattr(hf.shared_expert, f"{name}_proj").weight.grad.numpy().T)


@pytest.mark.parametrize("changes, match", [
    (dict(n_experts=0), "shared_expert_d_ff 8 needs n_experts > 0"),
    (dict(shared_expert_d_ff=0, shared_expert_gate=False), "shared_expert_gate False needs shared_expert_d_ff > 0"),
    (dict(shared_expert_d_ff=-1), "ModelConfig.shared_expert_d_ff must be a non-negative integer"),
    (dict(shared_expert_gate="yes"), "ModelConfig.shared_expert_gate must be True or False"),
])
def test_bad_shared_expert_values_are_named(changes, match):
    with pytest.raises(ValueError, match=match):
        TINY.replace(**changes)
