"""The chunked head + cross entropy (jaxformer/chunked_loss.py, manual_grads/chunked_loss.py)
against cross_entropy(linear(x, w, b)) and its jax.vjp, in float64."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import Layer, assert_layer_matches_vjp, layer_and_vjp, masks

from jaxformer.model.chunked_loss import chunked_head_loss
from jaxformer.model.linear import linear
from jaxformer.model.losses import cross_entropy
from manual_grads.chunked_loss import chunked_head_loss_bwd, chunked_head_loss_fwd

B, T, D, V = 2, 7, 6, 11
# the manual chunked pair against jax.vjp of the unchunked head + cross entropy
CHUNKED = Layer(chunked_head_loss_fwd, chunked_head_loss_bwd,
                lambda h, x, targets, mask, chunk: cross_entropy(linear(x, h["w"], h["b"]), targets, mask))
CHUNKED_AUTO = jax.jit(chunked_head_loss, static_argnums=4)


def make(seed):
    rng = np.random.default_rng(seed)
    head = {"w": rng.standard_normal((D, V)), "b": rng.standard_normal(V)}
    x = 2.0 * rng.standard_normal((B, T, D))
    return head, x, jnp.asarray(rng.integers(0, V, (B, T)), jnp.int32), float(rng.standard_normal())


# chunk 1, 3 (14 = 4 * 3 + 2: a padded tail), 7 (divides 14), 14 (all), 20 (more than all)
@pytest.mark.parametrize("chunk,mask_name", [
    (1, "none"), (3, "mostly_zero"), (7, "bool"), (14, "none"), (20, "mostly_zero"), (3, "int")])
def test_chunked_matches_full(chunk, mask_name):
    head, x, targets, dloss = make(0)
    mask = masks(1, B, T)[mask_name]
    _, (ref, _) = assert_layer_matches_vjp(CHUNKED, (head, x), dloss, consts=(targets, mask), static=(chunk,),
                                           y_rtol=1e-12, y_atol=1e-12)
    np.testing.assert_allclose(CHUNKED_AUTO(head, x, targets, mask, chunk), ref, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("jit", [False, True])
def test_all_zero_mask_gives_zero_loss_and_gradient(jit):
    """Eagerly and under jit alike: loss 0 and exactly zero cotangents (manual and
    jax.vjp), and the autodiff path's loss 0 too."""
    head, x, targets, dloss = make(2)
    zeros = np.zeros((B, T))
    (loss, (dp, dx)), (loss_ref, (dp_ref, dx_ref)) = layer_and_vjp(
        CHUNKED, (head, x), dloss, consts=(targets, zeros), static=(3,), jit=jit)
    assert float(loss) == 0.0 and float(loss_ref) == 0.0
    assert not np.any(dx) and not np.any(dp["w"]) and not np.any(dp["b"])
    assert not np.any(dx_ref) and not np.any(dp_ref["w"]) and not np.any(dp_ref["b"])
    assert float(chunked_head_loss(head, x, targets, zeros, 3)) == 0.0  # eager autodiff path


def test_residuals_never_hold_logits():
    """The residuals keep x (padded), targets, weights, lse and the head: nothing of size V
    per position."""
    head, x, targets, _ = make(3)
    _, res = chunked_head_loss_fwd(head, x, targets, None, 4)
    assert res.x.shape == (4, 4, D) and res.lse.shape == (4, 4)
    assert all(leaf.size < B * T * V for leaf in jax.tree_util.tree_leaves(res) if leaf is not res.w)
