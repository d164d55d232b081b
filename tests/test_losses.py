"""manual_grads.losses against jax.vjp of jaxformer.model.cross_entropy, in float64."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import Layer, assert_layer_matches_vjp, masks

from jaxformer.model.losses import cross_entropy
from manual_grads.losses import cross_entropy_bwd, cross_entropy_fwd

# targets and mask are not differentiated: cross_entropy_bwd gives None for them
CROSS_ENTROPY = Layer(cross_entropy_fwd, cross_entropy_bwd, cross_entropy, cotangents=lambda out: out[:1])


def make(seed, B, T, V, scale=3.0):
    rng = np.random.default_rng(seed)
    logits = scale * rng.standard_normal((B, T, V))
    targets = jnp.asarray(rng.integers(0, V, (B, T)), jnp.int32)
    return logits, targets, float(rng.standard_normal())


def manual(logits, targets, mask, dloss):
    loss, res = cross_entropy_fwd(logits, targets, mask)
    return loss, cross_entropy_bwd(res, dloss)


def check(logits, targets, mask, dloss, jit):
    (loss, (dlogits, d_targets, d_mask)), _ = assert_layer_matches_vjp(
        CROSS_ENTROPY, (logits,), dloss, consts=(targets, mask), jit=jit, y_rtol=1e-12, y_atol=1e-12)
    assert d_targets is None and d_mask is None
    return loss, dlogits


@pytest.mark.parametrize("mask,jit", [
    ("none", False), ("none", True), ("mostly_zero", False), ("mostly_zero", True),
    ("bool", True), ("int", True),
])
def test_cross_entropy_matches_autodiff(mask, jit):
    logits, targets, dloss = make(0, 3, 5, 7)
    check(logits, targets, masks(1, 3, 5)[mask], dloss, jit)


@pytest.mark.parametrize("B,T,V,mask", [(1, 1, 2, None), (2, 3, 1, "mostly_zero"), (5, 9, 11, "mostly_zero")])
def test_cross_entropy_shapes(B, T, V, mask):
    logits, targets, dloss = make(2, B, T, V)
    check(logits, targets, masks(3, B, T)[mask] if mask else None, dloss, jit=True)


@pytest.mark.parametrize("jit", [False, True])
def test_all_zero_mask_gives_zero_loss_and_gradient(jit):
    """One meaning eagerly and under jit: no position counts, so the loss is 0 and its
    gradient exactly 0 (the masked sum over max(count, 1)), never an error or a NaN."""
    logits, targets, _ = make(4, 2, 3, 5)
    loss, dlogits = check(logits, targets, np.zeros((2, 3)), 1.0, jit=jit)
    assert float(loss) == 0.0
    np.testing.assert_array_equal(dlogits, 0.0)
    assert float(cross_entropy(logits, targets, np.zeros((2, 3), bool))) == 0.0


def test_fractional_mask_is_normalised_by_its_true_sum():
    """Weights of 0.25 everywhere are the plain mean (no max(sum, 1) shrinking the loss),
    and the manual backward agrees with autodiff."""
    logits, targets, dloss = make(8, 2, 3, 5)
    quarter = np.full((2, 3), 0.25)
    loss, _ = check(logits, targets, quarter, dloss, jit=False)
    np.testing.assert_allclose(loss, cross_entropy(logits, targets), rtol=1e-14)
    # a sum below 1: one position weighted 0.5 is that position's loss, not half of it
    half = np.zeros((2, 3))
    half[1, 2] = 0.5
    loss, _ = check(logits, targets, half, dloss, jit=False)
    np.testing.assert_allclose(loss, cross_entropy(logits[1, 2], targets[1, 2]), rtol=1e-14)


@pytest.mark.parametrize("mask", ["none", "mostly_zero"])
def test_stable_for_huge_logits(mask):
    """Logits of magnitude 1e4: the loss and its gradient stay finite and equal
    autodiff's, and each row of the fused gradient sums to zero."""
    logits, targets, _ = make(5, 2, 4, 6, scale=1e4)
    loss, dlogits = check(logits, targets, masks(6, 2, 4)[mask], 1.0, jit=False)
    assert np.isfinite(float(loss)) and float(loss) >= 0.0
    assert np.all(np.isfinite(dlogits))
    np.testing.assert_allclose(np.asarray(dlogits).sum(-1), 0.0, atol=1e-15)


def test_fused_gradient_is_softmax_minus_onehot():
    logits, targets, _ = make(7, 1, 2, 3)
    _, (dlogits, _, _) = manual(logits, targets, None, 1.0)
    expected = (jax.nn.softmax(logits) - jax.nn.one_hot(targets, 3, dtype=jnp.float64)) / 2
    np.testing.assert_allclose(dlogits, expected, rtol=1e-14, atol=1e-16)
