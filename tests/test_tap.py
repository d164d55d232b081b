"""The observer hook of the manual backward (manual_grads/tap.py): with a tap the blocks
run as a Python loop and every stage is shown, and the loss and gradients are those of
the scanned run without one; the model's block takes its pieces (BlockLayers)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxformer.model.block import BLOCK_LAYERS, block, compose_block
from jaxformer.model.config import PRESETS
from manual_grads.check import assert_trees_close
from manual_grads.model import value_and_grad
from helpers import make_params

CONFIG = PRESETS["tiny"]  # 2 layers
BLOCK_STAGES = {"pre": ["ln1", "attn", "attn residual", "ln2", "ffn", "ffn residual"],
                "post": ["attn", "attn residual", "ln1", "ffn", "ffn residual", "ln2"]}


class Log:
    """A tap that keeps the stage names it is shown and checks the shapes it gets."""

    def __init__(self):
        self.forward_stages, self.backward_stages = [], []

    def forward(self, stage, x, y, p=None):
        assert x is None or x.shape[:2] == (2, 7), stage
        self.forward_stages.append(stage)

    def backward(self, stage, dy, dp=None, dx=None):
        assert dp is not None or dx is not None, stage
        self.backward_stages.append(stage)


def _batch(config, seed=0):
    rng = np.random.default_rng(seed)
    ids = jnp.asarray(rng.integers(0, config.vocab_size, (2, 8)), jnp.int32)
    return {"inputs": ids[:, :-1], "targets": ids[:, 1:],
            "mask": jnp.asarray(rng.random((2, 7)) < 0.7, jnp.float64)}


@pytest.mark.parametrize("config", [
    CONFIG,
    CONFIG.replace(norm="post", remat="block", loss_chunk=5),
    CONFIG.replace(attention_impl="blockwise", attention_block=3, remat="block"),
], ids=["pre", "post-remat-chunked", "blockwise-remat"])
def test_a_tap_sees_every_stage_and_changes_no_value(config):
    params, batch = make_params(config, jnp.float64), _batch(config)
    log = Log()
    loss, grads = value_and_grad(params, batch, config, tap=log)
    loss_scan, grads_scan = jax.jit(value_and_grad, static_argnums=2)(params, batch, config)
    np.testing.assert_allclose(loss, loss_scan, rtol=1e-12)
    assert_trees_close(grads_scan, grads, rtol=1e-12)
    blocks = [f"blocks[{l}].{s}" for l in range(config.n_layers) for s in BLOCK_STAGES[config.norm]]
    ln_f = ["ln_f"] if config.norm == "pre" else []
    head = ["head + loss"] if config.loss_chunk else ["head", "loss"]
    assert log.forward_stages == ["embed", *blocks, *ln_f, *head]  # a recomputed block is not shown
    assert sorted(log.backward_stages) == sorted(log.forward_stages)
    assert log.backward_stages[0] == head[-1] and log.backward_stages[-1] == "embed"


def test_the_block_takes_its_pieces():
    """compose_block hands back what its attention returned beside its output, and a
    replaced piece is the one that runs."""
    p = jax.tree_util.tree_map(lambda a: a[0], make_params(CONFIG, jnp.float64)["blocks"])
    x = jnp.asarray(np.random.default_rng(1).standard_normal((2, 5, CONFIG.d_model)))
    y, aux = compose_block(p, x, CONFIG)
    assert aux is None
    np.testing.assert_array_equal(y, block(p, x, CONFIG))

    def attention_and_count(pa, h, config):
        out, _ = BLOCK_LAYERS.attention(pa, h, config)
        return out, h.shape

    layers = BLOCK_LAYERS._replace(attention=attention_and_count)
    y2, aux = compose_block(p, x, CONFIG, layers)
    assert aux == x.shape
    np.testing.assert_array_equal(y2, y)
    no_ffn = BLOCK_LAYERS._replace(feed_forward=lambda pf, h, config: jnp.zeros_like(h))
    assert not np.allclose(block(p, x, CONFIG, no_ffn), y)
