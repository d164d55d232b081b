"""The PyTorch model of the benchmark computes jaxformer's loss and gradients (float64)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")

from jaxformer.model.config import ModelConfig
from jaxformer.model.transformer import loss_fn
from jaxformer.model.params import init_params
from jaxformer.tools.torch_ref import TorchTransformer, to_torch_batch

BASE = ModelConfig(vocab_size=11, d_model=12, n_heads=3, n_layers=2, d_ff=20, max_seq_len=9)
CASES = {
    "pre-gelu-learned": {},
    "post-relu-sinusoidal-bidirectional": dict(norm="post", activation="relu",
                                               positions="sinusoidal", causal=False),
    "post-gelu_tanh-learned": dict(norm="post", activation="gelu_tanh"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_torch_loss_and_grads_equal_jaxformer_float64(name):
    config = BASE.replace(**CASES[name])
    key_p, key_b = jax.random.split(jax.random.PRNGKey(3))
    params = init_params(key_p, config, dtype=jnp.float64)
    # nonzero biases and scales, so every leaf's gradient path is exercised
    params = jax.tree.map(lambda x, k: x + 0.1 * jax.random.normal(k, x.shape, x.dtype), params,
                          jax.tree.unflatten(jax.tree.structure(params),
                                             list(jax.random.split(key_b, len(jax.tree.leaves(params))))))
    tokens = jax.random.randint(key_b, (3, 8), 0, config.vocab_size)
    batch = {"inputs": tokens, "targets": jnp.roll(tokens, -1, axis=1)}
    loss, grads = jax.value_and_grad(loss_fn)(params, batch, config)

    model = TorchTransformer.from_jax(jax.device_get(params), config)
    t_loss = model.loss(*to_torch_batch(batch))
    t_loss.backward()
    np.testing.assert_allclose(t_loss.item(), float(loss), rtol=1e-12)
    t_grads = model.grads_as_jax()
    assert jax.tree.structure(t_grads) == jax.tree.structure(jax.device_get(grads))
    # relative per leaf; bk's gradient is zero in exact arithmetic (softmax ignores a
    # per-query constant): its error is measured against 1e-6 of the largest gradient
    scale = max(float(jnp.max(jnp.abs(g))) for g in jax.tree.leaves(grads))
    for path, g in jax.tree_util.tree_flatten_with_path(grads)[0]:
        t_g = t_grads
        for k in path:
            t_g = t_g[k.key]
        g = np.asarray(g)
        rel = np.max(np.abs(t_g - g)) / max(np.max(np.abs(g)), 1e-6 * scale)
        assert rel <= 1e-10, (jax.tree_util.keystr(path), rel)
