"""The mixture-of-experts layer (jaxformer/model/moe.py) and its hand-derived backward
(manual_grads/moe.py): the dropless dispatch against a dense sum over every expert, the
auxiliary loss against transformers' ``load_balancing_loss_func``, float64 gradients of the
layer and of whole models from the three sources (manual == jax.grad == custom_vjp, 1e-10 per
leaf), the bfloat16 rule, the config's errors, and a tiny MoE trained with either source.

Top-k has a gradient only where the choice of experts is stable. Every weight here is drawn at
random, so two router logits of a token tie with probability zero (a measure-zero set): the
chosen experts are the same for every source and for each finite-difference probe, and the
gradients compared are those of one fixed routing.
"""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import (assert_bfloat16_within_autodiff, assert_sources_agree, decode_one_at_a_time, make_batch,
                     make_params)

import jaxformer

from jaxformer.model.config import PRESETS, ModelConfig, get_preset
from jaxformer.model.moe import MoeStats, moe, moe_aux_loss
from jaxformer.observe.metrics import read_metrics
from jaxformer.training.loop import train
from jaxformer.training.settings import settings_for
from manual_grads import check, custom_vjp
from manual_grads.moe import moe_bwd, moe_fwd


TINY = PRESETS["tiny-moe"]  # D 16, 4 experts of width 12, 2 per token, 2 layers
ROUTERS = [dict(router="topk_softmax"), dict(router="softmax_topk"),
           dict(router="softmax_topk", norm_topk_prob=True)]
KEY = jax.random.PRNGKey(3)


def _layer_params(config, seed=0, scale=1.0):
    """One layer's MoE params in float64 (router scaled up so the gates differ clearly)."""
    p = make_params(config, jnp.float64, seed)["blocks"]["ffn"]
    p = jax.tree_util.tree_map(lambda a: a[0], p)
    return {**p, "router": p["router"] * scale}


def _expert(p, e, x, act):
    return (act(x @ p["w_gate"][e]) * (x @ p["w_up"][e])) @ p["w_down"][e]


@pytest.mark.parametrize("router", ROUTERS, ids=lambda r: "-".join(map(str, r.values())))
def test_dispatch_equals_the_dense_sum_over_experts(router):
    """y_n = sum over the chosen experts e of gate_ne * expert_e(x_n), the routing computed
    here in numpy from the logits; stats: each expert's count / N, the mean probability."""
    config = TINY.replace(**router)
    p = _layer_params(config, scale=20.0)
    x = jax.random.normal(KEY, (3, 5, 16), jnp.float64)
    y, stats = moe(p, x, config)
    x2 = np.asarray(x).reshape(-1, 16)
    logits = x2 @ np.asarray(p["router"])
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    chosen = np.argsort(-logits, axis=-1)[:, :2]  # (N, 2)
    top_l, top_p = np.take_along_axis(logits, chosen, -1), np.take_along_axis(probs, chosen, -1)
    if router["router"] == "topk_softmax":
        gates = np.exp(top_l - top_l.max(-1, keepdims=True))
        gates /= gates.sum(-1, keepdims=True)
    else:
        gates = top_p / top_p.sum(-1, keepdims=True) if router.get("norm_topk_prob") else top_p
    outs = np.stack([np.asarray(_expert(p, e, x2, jax.nn.silu)) for e in range(4)], axis=1)  # (N, E, D)
    want = np.einsum("nk,nkd->nd", gates, np.take_along_axis(outs, chosen[..., None], 1))
    np.testing.assert_allclose(np.asarray(y).reshape(-1, 16), want, rtol=1e-12, atol=1e-14)
    counts = np.bincount(chosen.ravel(), minlength=4)
    np.testing.assert_allclose(stats.load, counts / 15, rtol=1e-14)
    np.testing.assert_allclose(stats.probs, probs.mean(0), rtol=1e-12)
    assert stats.load.sum() == pytest.approx(2.0)


def test_aux_loss_is_transformers_load_balancing_loss():
    """moe_aux_loss over two layers equals router_aux_loss_coef * load_balancing_loss_func(the
    layers' gate logits) of transformers' Mixtral (one loss over all layers' tokens)."""
    torch = pytest.importorskip("torch")
    mixtral = pytest.importorskip("transformers.models.mixtral.modeling_mixtral")
    config = TINY.replace(router_z_loss_coef=0.0, moe_aux_loss_coef=0.02)
    stats, logits = [], []
    for seed in (0, 1):
        p = _layer_params(config, seed, scale=30.0)
        x = jax.random.normal(jax.random.PRNGKey(seed), (2, 7, 16), jnp.float64)
        stats.append(moe(p, x, config)[1])
        logits.append(torch.tensor(np.asarray(x.reshape(-1, 16) @ p["router"])))
    stacked = jax.tree_util.tree_map(lambda *s: jnp.stack(s), *stats)
    got = float(moe_aux_loss(stacked, config))
    # transformers sums the counts and probabilities in float32 (routing_weights.float()): 1e-6
    assert got == pytest.approx(0.02 * float(mixtral.load_balancing_loss_func(tuple(logits), 4, 2)), rel=1e-6)
    # the same formula in float64 numpy: E * sum_e (share of the L N tokens' k choices) * (mean prob)
    flat = np.concatenate([t.numpy() for t in logits])  # (L N, E)
    probs = np.exp(flat - flat.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    counts = np.bincount(np.argsort(-flat, -1)[:, :2].ravel(), minlength=4)
    want = 0.02 * 4 * np.sum(counts / len(flat) * probs.mean(0))
    assert got == pytest.approx(want, rel=1e-12)
    z = np.mean([np.mean(np.asarray(torch.logsumexp(t, -1)) ** 2) for t in logits])
    with_z = config.replace(router_z_loss_coef=0.5)
    assert float(moe_aux_loss(stacked, with_z)) == pytest.approx(want + 0.5 * z, rel=1e-12)


@pytest.mark.parametrize("router", ROUTERS, ids=lambda r: "-".join(map(str, r.values())))
def test_layer_backward_equals_autodiff_and_custom_vjp(router):
    """The layer alone, with cotangents on y and on the statistics (probs, z): moe_bwd,
    jax.grad of jaxformer's moe and jax.grad of the custom_vjp drop-in agree to 1e-10."""
    config = TINY.replace(**router)
    manual = assert_layer_sources_agree(config, _layer_params(config, scale=20.0))
    assert set(manual[0]) == {"router", "w_gate", "w_up", "w_down"}


@functools.partial(jax.jit, static_argnums=2)  # one compile per config, not one per operation
def _layer_sources(p, x, config, dy, dstats):
    """(jax.grad of moe, jax.grad of custom_vjp.moe, moe_bwd) of sum(y dy) + the statistics'
    cotangent terms, each as (dp, dx)."""
    def objective(layer):
        def f(p, x):
            y, s = layer(p, x, config)
            return jnp.sum(y * dy) + jnp.sum(s.probs * dstats.probs) + s.z * dstats.z
        return f

    ref = jax.grad(objective(moe), argnums=(0, 1))(p, x)
    via_rule = jax.grad(objective(custom_vjp.moe), argnums=(0, 1))(p, x)
    (_, _), res = moe_fwd(p, x, config)
    return ref, via_rule, moe_bwd(res._replace(dstats=dstats), dy)


def assert_layer_sources_agree(config, p, key=KEY):
    """The layer p on random x (2, 6, D), with cotangents on y and on the statistics (probs, z):
    moe_bwd, jax.grad of jaxformer's moe and jax.grad of custom_vjp.moe agree to 1e-10 per leaf;
    returns moe_bwd's (dp, dx)."""
    x = jax.random.normal(key, (2, 6, config.d_model), jnp.float64)
    E = config.n_experts
    k1, k2, k3 = jax.random.split(jax.random.PRNGKey(9), 3)
    dy = jax.random.normal(k1, x.shape, jnp.float64)
    dstats = MoeStats(jnp.zeros(E), jax.random.normal(k2, (E,), jnp.float64), jax.random.normal(k3, ()))

    ref, via_rule, manual = _layer_sources(p, x, config, dy, dstats)
    check.assert_trees_close(ref, manual)
    check.assert_trees_close(ref, via_rule)
    return manual


MODELS = {  # beside the pairwise matrix's MoE rows (tests/test_modern_options.py)
    # more than remat.UNROLL_MAX_LAYERS layers: the blocks' lax.scan
    "scanned-softmax-topk-norm-post": TINY.replace(n_layers=5, router="softmax_topk", norm_topk_prob=True,
                                                   norm="post"),
    "k1-remat-chunked-dropout": TINY.replace(experts_per_token=1, remat="block", loss_chunk=5, dropout=0.2),
    "k4-attention-biases-tied": TINY.replace(experts_per_token=4, bias=True, mlp_bias=False,
                                             tie_embeddings=True, positions="learned", norm_type="layer"),
}


@pytest.mark.parametrize("name", list(MODELS))
def test_model_gradients_from_three_sources_agree_in_float64(name):
    assert_sources_agree(MODELS[name], 2, 9, "mostly_zero", KEY)


def test_cached_decoder_equals_the_forward():
    """Dropless routing treats each token alone: decoding one token at a time through the
    key/value cache gives the full forward's logits."""
    params, batch = make_params(TINY, jnp.float64), make_batch(TINY, 2, 9, None)
    want = jaxformer.forward(params, batch["inputs"], TINY)
    np.testing.assert_allclose(decode_one_at_a_time(params, batch["inputs"], TINY, 4), want, rtol=1e-10, atol=1e-12)


def test_bfloat16_rule():
    config = TINY
    params, batch = make_params(config, jnp.float32), make_batch(config, 2, 9, None)
    assert_bfloat16_within_autodiff(params, batch, config)


def test_params_layout():
    shapes = jax.eval_shape(lambda: make_params(TINY, jnp.float32))["blocks"]["ffn"]
    L, D, E, F = 2, 16, 4, 12
    assert {k: v.shape for k, v in shapes.items()} == {
        "router": (L, D, E), "w_gate": (L, E, D, F), "w_up": (L, E, D, F), "w_down": (L, E, F, D)}
    assert TINY.replace(expert_d_ff=0).expert_width == TINY.d_ff


@pytest.mark.parametrize("changes, match", [
    (dict(experts_per_token=5), r"experts_per_token \(5\) must be at most n_experts \(4\)"),
    (dict(mlp="plain"), "n_experts > 0 needs mlp 'gated'"),
    (dict(bias=True), "n_experts > 0 needs no feed-forward biases"),
    (dict(moe_every=2), "moe_every 2 is not implemented"),
    (dict(norm_topk_prob=True), "norm_topk_prob needs router 'softmax_topk'"),
    (dict(router="sinkhorn"), "ModelConfig.router must be one of 'topk_softmax', 'softmax_topk'"),
    (dict(n_experts=-1), "ModelConfig.n_experts must be a non-negative integer"),
    (dict(moe_aux_loss_coef=-0.1), "ModelConfig.moe_aux_loss_coef must be >= 0"),
])
def test_bad_moe_values_are_named(changes, match):
    with pytest.raises(ValueError, match=match):
        TINY.replace(**changes)


def test_dense_default_is_unchanged():
    assert ModelConfig().n_experts == 0
    assert "router" not in make_params(get_preset("llama-tiny"), jnp.float32)["blocks"]["ffn"]


def test_tiny_moe_trains_alike_with_either_gradient_source(corpus, tmp_path):
    """8 float64 steps of tiny-moe from one seed: the same losses from manual and automatic
    gradients, the loss falling, each expert's load in metrics.jsonl (summing to 1)."""
    runs = {}
    for grads in ("auto", "manual"):
        settings = settings_for("tiny-moe", corpus=corpus, steps=8, grads=grads, dtype="float64",
                                log_every=1, eval_every=4, eval_batches=1, ckpt_every=0)
        runs[grads] = read_metrics(train(settings, tmp_path / grads, progress=False).run_dir)
    for key in ("loss", "grad_norm", "moe/balance_loss", "moe/z_loss", "moe/load0", "val_loss"):
        np.testing.assert_allclose([r[key] for r in runs["manual"] if key in r],
                                   [r[key] for r in runs["auto"] if key in r], rtol=1e-10, err_msg=key)
    records = runs["manual"]
    assert records[-1]["loss"] < records[0]["loss"] - 0.5
    for r in records:
        assert sum(r[f"moe/load{e}"] for e in range(4)) == pytest.approx(1.0)
        assert math.isfinite(r["moe/balance_loss"]) and r["moe/balance_loss"] > 0


def test_hugging_face_export_of_experts_without_a_family_is_mixtral(tmp_path):
    """Mixtral's router and no QK-norm: exported as mixtral, read back as the same model (Mixtral's
    intermediate_size is the experts' width: d_ff becomes it), its aux and z-loss coefficients kept."""
    from jaxformer.formats.hf import read_hf, write_hf
    folder, kind = write_hf(tmp_path / "out", make_params(TINY, jnp.float32), TINY)
    assert kind == "mixtral"
    _, back = read_hf(folder)
    assert back == TINY.replace(family="mixtral", d_ff=TINY.expert_width, expert_d_ff=0)
    assert (back.moe_aux_loss_coef, back.router_z_loss_coef) == (TINY.moe_aux_loss_coef, TINY.router_z_loss_coef)
    with pytest.raises(ValueError, match="OLMoE needs ModelConfig.router = 'softmax_topk'"):
        write_hf(tmp_path / "o2", make_params(TINY, jnp.float32), TINY.replace(family="olmoe"))


HF_BLOCKS = {  # model_type: (transformers module, config class, block class, our router, config kwargs)
    "mixtral": ("mixtral", "MixtralConfig", "MixtralSparseMoeBlock", dict(router="topk_softmax"),
                dict(intermediate_size=12, num_local_experts=4)),
    "qwen3_moe": ("qwen3_moe", "Qwen3MoeConfig", "Qwen3MoeSparseMoeBlock",
                  dict(router="softmax_topk", norm_topk_prob=True),
                  dict(moe_intermediate_size=12, num_experts=4, norm_topk_prob=True)),
    "olmoe": ("olmoe", "OlmoeConfig", "OlmoeSparseMoeBlock", dict(router="softmax_topk"),
              dict(intermediate_size=12, num_experts=4, norm_topk_prob=False)),
}


@pytest.mark.parametrize("model_type", list(HF_BLOCKS))
def test_layer_is_transformers_sparse_moe_block(model_type):
    """Our layer and transformers' own MoE block of the family (float64 module, our weights:
    gate = router^T, gate_up_proj[e] = [w_gate[e] | w_up[e]]^T, down_proj[e] = w_down[e]^T): the
    output and the gradients of router, experts and input. transformers computes the router's
    softmax in float32 (softmax(..., dtype=torch.float)), which bounds the agreement: 1e-6 of
    each output's (each leaf's) largest entry."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    module, config_class, block_class, router, kwargs = HF_BLOCKS[model_type]
    hf_module = __import__(f"transformers.models.{module}.modeling_{module}", fromlist=[block_class])
    hf_config = getattr(transformers, config_class)(hidden_size=16, num_experts_per_tok=2, hidden_act="silu", **kwargs)
    hf = getattr(hf_module, block_class)(hf_config).double()
    config = TINY.replace(**router)
    p = _layer_params(config, scale=20.0)
    assert_layer_is_hf_block(torch, hf, p, config, KEY)


@functools.partial(jax.jit, static_argnums=2)
def _pair(p, x, config, dy):
    """moe_fwd's y and moe_bwd's (dp, dx) for the cotangent dy on y alone, in one program."""
    (y, _), res = moe_fwd(p, x, config)
    return y, moe_bwd(res, dy)


def assert_layer_is_hf_block(torch, hf, p, config, key):
    """Copies the routed layer's weights into transformers' MoE block ``hf`` (gate = router^T,
    gate_up_proj[e] = [w_gate[e] | w_up[e]]^T, down_proj[e] = w_down[e]^T), runs both on random x
    (2, 6, D) with a random cotangent, and checks the output and the gradients of x, the router and
    the experts within 1e-6 of each one's largest entry (transformers' router softmax runs in
    float32). Returns our dp, for the caller's other leaves."""
    t = lambda a: torch.tensor(np.asarray(a))  # noqa: E731
    with torch.no_grad():
        hf.gate.weight.copy_(t(p["router"].T))
        hf.experts.gate_up_proj.copy_(t(jnp.concatenate([p["w_gate"], p["w_up"]], axis=2).transpose(0, 2, 1)))
        hf.experts.down_proj.copy_(t(p["w_down"].transpose(0, 2, 1)))
    x = jax.random.normal(key, (2, 6, config.d_model), jnp.float64)
    dy = jax.random.normal(jax.random.PRNGKey(5), x.shape, jnp.float64)
    x_t = t(x).requires_grad_(True)
    y_t = hf(x_t)
    (y_t * t(dy)).sum().backward()
    y, (dp, dx) = _pair(p, x, config, dy)  # no statistics' cotangents: the block alone
    y_hf = y_t.detach().numpy()
    assert np.max(np.abs(np.asarray(y) - y_hf)) <= 1e-6 * np.max(np.abs(y_hf))
    gate_up = hf.experts.gate_up_proj.grad.numpy().transpose(0, 2, 1)  # (E, D, 2F)
    F = p["w_gate"].shape[-1]
    for name, ours, theirs in [("x", dx, x_t.grad), ("router", dp["router"], hf.gate.weight.grad.T),
                               ("w_gate", dp["w_gate"], gate_up[..., :F]), ("w_up", dp["w_up"], gate_up[..., F:]),
                               ("w_down", dp["w_down"], hf.experts.down_proj.grad.numpy().transpose(0, 2, 1))]:
        theirs = np.asarray(theirs)
        assert np.max(np.abs(ours - theirs)) <= 1e-6 * np.max(np.abs(theirs)), (type(hf).__name__, name)
    return dp
