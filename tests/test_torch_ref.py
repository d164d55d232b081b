"""The PyTorch model of the benchmark computes jaxformer's loss and gradients (float64), for
the first model's options and the modern block's: its loss equals jaxformer's to 1e-12 and
every gradient leaf equals both jax.grad's and manual_grads' to 1e-10 (relative, per leaf)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")

from helpers import auto_vg, manual_vg
from jaxformer.model.config import ModelConfig
from jaxformer.model.params import init_params
from jaxformer.model.transformer import loss_fn
from jaxformer.tools.torch_ref import model as torch_ref
from jaxformer.tools.torch_ref.model import TorchTransformer, to_torch_batch

BASE = ModelConfig(vocab_size=11, d_model=12, n_heads=3, n_layers=2, d_ff=20, max_seq_len=9)
# llama-tiny's block at a smaller width: RMS norm, rotary positions, SwiGLU, 4 query heads
# over 2 key/value heads, QK-norm, no biases, an untied head
LLAMA = BASE.replace(d_model=16, n_heads=4, n_kv_heads=2, activation="silu", norm_type="rms",
                     positions="rope", mlp="gated", qk_norm=True, bias=False, head_bias=False)
CASES = {
    "pre-gelu-learned": BASE,
    "post-relu-sinusoidal-embed_scale-bidirectional": BASE.replace(
        norm="post", activation="relu", positions="sinusoidal", embed_scale=True, causal=False),
    "post-gelu_tanh-learned-tied-bias-free": BASE.replace(norm="post", activation="gelu_tanh",
                                                          tie_embeddings=True, bias=False),
    "rms-rope-swiglu-gqa-qknorm-untied": LLAMA,
    "mqa-tied": LLAMA.replace(n_kv_heads=1, tie_embeddings=True),
    "relu2-plain-rms-no-scale-bias": LLAMA.replace(mlp="plain", activation="relu2", norm_scale=False,
                                                   bias=True, head_bias=True),
    "post-rms-geglu-bias-bidirectional": LLAMA.replace(norm="post", activation="gelu", bias=True,
                                                       qk_norm=False, causal=False, rope_theta=500.0),
}


def perturbed_params(config, key):
    """float64 params with every leaf moved off its init (nonzero biases, scales not 1), so
    every leaf's gradient path is exercised."""
    params = init_params(key, config, dtype=jnp.float64)
    keys = jax.random.split(jax.random.fold_in(key, 1), max(len(jax.tree.leaves(params)), 1))
    return jax.tree.map(lambda x, k: x + 0.1 * jax.random.normal(k, x.shape, x.dtype), params,
                        jax.tree.unflatten(jax.tree.structure(params), list(keys)))


def make_batch(config, key):
    tokens = jax.random.randint(key, (3, 8), 0, config.vocab_size)
    return {"inputs": tokens, "targets": jnp.roll(tokens, -1, axis=1)}


def leaf_errors(reference, candidate) -> dict:
    """{leaf path: max |candidate - reference| / max |reference|}; the trees must have the same
    structure. A leaf whose gradient is zero in exact arithmetic (bk without QK-norm: softmax
    ignores a per-query constant) is measured against 1e-6 of the largest gradient instead."""
    reference = jax.device_get(reference)
    assert jax.tree.structure(candidate) == jax.tree.structure(reference)
    scale = max(float(np.max(np.abs(g))) for g in jax.tree.leaves(reference))
    got = dict(jax.tree_util.tree_flatten_with_path(candidate)[0])
    return {jax.tree_util.keystr(path): float(np.max(np.abs(got[path] - g))
                                              / max(np.max(np.abs(g)), 1e-6 * scale))
            for path, g in jax.tree_util.tree_flatten_with_path(reference)[0]}


def torch_loss_and_grads(params, batch, config):
    model = TorchTransformer.from_jax(jax.device_get(params), config)
    loss = model.loss(*to_torch_batch(batch))
    loss.backward()
    return loss.item(), model.grads_as_jax()


@pytest.mark.parametrize("name", list(CASES))
def test_torch_loss_and_grads_equal_jaxformer_float64(name):
    config = CASES[name]
    key_p, key_b = jax.random.split(jax.random.PRNGKey(3))
    params, batch = perturbed_params(config, key_p), make_batch(config, key_b)
    loss, grads = auto_vg(params, batch, config)
    m_loss, m_grads = manual_vg(params, batch, config)

    t_loss, t_grads = torch_loss_and_grads(params, batch, config)
    np.testing.assert_allclose(t_loss, float(loss), rtol=1e-12)
    np.testing.assert_allclose(t_loss, float(m_loss), rtol=1e-12)
    for source, reference in (("jax.grad", grads), ("manual", m_grads)):
        errors = leaf_errors(reference, t_grads)
        worst = max(errors, key=errors.get)
        assert errors[worst] <= 1e-10, (source, worst, errors[worst])


def test_dropout_acts_in_training_mode_only():
    config = CASES["rms-rope-swiglu-gqa-qknorm-untied"].replace(dropout=0.2)
    key_p, key_b = jax.random.split(jax.random.PRNGKey(4))
    params, batch = perturbed_params(config, key_p), make_batch(config, key_b)
    model = TorchTransformer.from_jax(jax.device_get(params), config)
    inputs, targets = to_torch_batch(batch)
    with torch.no_grad():
        trained = model.loss(inputs, targets).item()  # nn.Module starts in training mode
        evaluated = model.eval().loss(inputs, targets).item()
    no_key = float(loss_fn(params, batch, config))  # jaxformer without a key: no dropout
    np.testing.assert_allclose(evaluated, no_key, rtol=1e-12)
    assert trained != evaluated


def test_an_option_it_does_not_implement_is_refused_by_name(monkeypatch):
    monkeypatch.setitem(torch_ref.SUPPORTED, "activation", ("gelu",))
    with pytest.raises(ValueError, match=r"ModelConfig.activation 'silu'"):
        TorchTransformer(LLAMA)
    monkeypatch.delitem(torch_ref.SUPPORTED, "qk_norm")
    TorchTransformer(BASE)  # qk_norm at its default: nothing to implement
    with pytest.raises(ValueError, match=r"ModelConfig.qk_norm"):
        TorchTransformer(BASE.replace(qk_norm=True))
