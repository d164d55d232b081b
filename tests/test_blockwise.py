"""Blockwise attention (jaxformer/blockwise.py, manual_grads/blockwise.py) against the full
attention, in float64: forward, the FlashAttention-2 backward against jax.vjp of the full
layer, and the skipping of causal blocks above the diagonal."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import Layer, assert_layer_matches_vjp, attention_params, layer_and_vjp, vjp_of_forward

from jaxformer.model.attention import attention
from jaxformer.model.blockwise import blockwise_attention_core
from jaxformer.model.config import ModelConfig
from jaxformer.model.cores import AttentionSpec, attention_probs
from manual_grads.attention import attention_bwd, attention_fwd
from manual_grads.blockwise import BlockwiseCoreRes, blockwise_core_bwd, blockwise_core_fwd
from manual_grads.check import assert_trees_close, compare_trees

D, H = 8, 2
# the manual layer around the blockwise core against jax.vjp of the full layer
BLOCKWISE = Layer(lambda p, x, config: attention_fwd(p, x, blockwise(config)), attention_bwd, attention)


def blockwise(config):
    return config.replace(attention_impl="blockwise")


def layer(causal, block):
    """The full layer's config (H heads of width D / H); blockwise(it) runs in blocks of ``block``."""
    return ModelConfig(d_model=D, n_heads=H, causal=causal, attention_block=block)


# (B, T, block, causal): T = 1, T < block, T a multiple of the block, T not a multiple
@pytest.mark.parametrize("B,T,block,causal", [
    (1, 1, 4, True), (2, 3, 5, False), (2, 8, 4, True), (3, 13, 4, True), (2, 13, 5, False),
])
def test_blockwise_layer_matches_full(B, T, block, causal):
    p, x, dy = attention_params(0, B, T, D)
    config = layer(causal, block)
    _, (y_ref, _) = assert_layer_matches_vjp(BLOCKWISE, (p, x), dy, static=(config,))
    np.testing.assert_allclose(attention(p, x, blockwise(config)), y_ref, rtol=1e-13, atol=1e-13)


def test_float32_within_tolerance():
    """Float32 blockwise against the float64 full layer on the same (float32-rounded)
    inputs: each leaf within the float32 tolerance (1e-4), or no worse than twice the full
    layer's own float32 error. (The key bias's true gradient is 0, softmax being shift
    invariant: in float32 both layers give round-off near the comparison's floor.)"""
    p, x, dy = (jax.tree_util.tree_map(lambda a: jnp.asarray(a, jnp.float32), t)
                for t in attention_params(1, 2, 13, D))
    (y, grads), (_, grads_full32) = layer_and_vjp(BLOCKWISE, (p, x), dy, static=(layer(True, 4),))
    to64 = lambda t: jax.tree_util.tree_map(lambda a: jnp.asarray(a, jnp.float64), t)  # noqa: E731
    y_ref, grads_ref = vjp_of_forward(BLOCKWISE, (to64(p), to64(x)), to64(dy), static=(layer(True, 4),))
    assert y.dtype == jnp.float32 and all(g.dtype == jnp.float32 for g in jax.tree_util.tree_leaves(grads))
    np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-5)
    full32 = {r.path: r.rel for r in compare_trees(grads_ref, grads_full32)}
    for r in compare_trees(grads_ref, grads):
        assert r.rel <= max(1e-4, 2 * full32[r.path]), (r, full32[r.path])


def _qkv(seed, T):
    rng = np.random.default_rng(seed)
    return [jnp.asarray(rng.standard_normal((2, 2, T, 3))) for _ in range(3)]


def test_residuals_keep_lse_not_probabilities():
    """The core keeps q, k, v, O in blocks and the row log-sum-exp; no (T, T) array."""
    q, k, v = _qkv(2, 13)
    out, res = blockwise_core_fwd(q, k, v, AttentionSpec(causal=True, block=4))
    assert res.spec.causal and res.key is None
    assert res.q.shape == (4, 2, 2, 4, 3) and res.lse.shape == (4, 2, 2, 4)
    scores = (q @ jnp.swapaxes(k, -1, -2)) / np.sqrt(3) + jnp.log(jnp.tril(jnp.ones((13, 13))))
    lse_ref = jax.nn.logsumexp(scores, axis=-1)  # (2, 2, 13)
    np.testing.assert_allclose(res.lse.transpose(1, 2, 0, 3).reshape(2, 2, 16)[..., :13], lse_ref,
                               rtol=1e-13, atol=1e-13)
    _, res = blockwise_core_fwd(q, k, v, AttentionSpec(causal=False, block=4))
    assert type(res) is BlockwiseCoreRes and not res.spec.causal


def test_causal_blocks_above_the_diagonal_are_skipped():
    """NaN in the last key block: were any block above the diagonal computed (even
    masked, 0 * NaN = NaN), the earlier query blocks' outputs, and their dq, would be NaN."""
    q, k, v = _qkv(3, 12)
    k, v = k.at[:, :, 8:].set(jnp.nan), v.at[:, :, 8:].set(jnp.nan)
    spec = AttentionSpec(causal=True, block=4)
    out, res = jax.jit(blockwise_core_fwd, static_argnums=3)(q, k, v, spec)
    assert np.all(np.isfinite(out[:, :, :8])) and np.all(np.isnan(out[:, :, 8:]))
    dq, dk, dv = jax.jit(blockwise_core_bwd)(res, jnp.ones_like(out).at[:, :, 8:].set(0.0))
    assert np.all(np.isfinite(dq[:, :, :8]))  # dq_i for i < 2 reads no pair (i, 2)
    ref = attention_probs(q[:, :, :8], k[:, :, :8], spec) @ v[:, :, :8]
    np.testing.assert_allclose(out[:, :, :8], ref, rtol=1e-13, atol=1e-13)
    out_auto, _ = blockwise_attention_core(q, k, v, spec)
    assert np.all(np.isfinite(out_auto[:, :, :8]))


def test_custom_vjp_blockwise_attention_runs_the_manual_rule():
    from manual_grads import custom_vjp

    p, x, dy = attention_params(4, 2, 13, D)

    @jax.jit
    def grads(p, x, dy):
        _, vjp = jax.vjp(lambda p, x: custom_vjp.attention(p, x, blockwise(layer(True, 4))), p, x)
        return vjp(dy)

    _, grads_ref = vjp_of_forward(BLOCKWISE, (p, x), dy, static=(layer(True, 4),))
    assert_trees_close(grads_ref, grads(p, x, dy), rtol=1e-10)
