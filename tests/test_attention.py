"""manual_grads.attention against jax.vjp of jaxformer.model.attention, in float64."""

from functools import partial

import jax
import numpy as np
import pytest

from jaxformer.model.attention import attention
from manual_grads.attention import attention_bwd, attention_fwd, softmax_bwd
from manual_grads.check import assert_trees_close


def make(seed, B, T, D):
    rng = np.random.default_rng(seed)
    p = {}
    for name in "qkvo":
        p["w" + name] = rng.standard_normal((D, D)) / np.sqrt(D)
        p["b" + name] = 0.5 * rng.standard_normal(D)
    return p, rng.standard_normal((B, T, D)), rng.standard_normal((B, T, D))


def manual(p, x, dy, H, causal):
    y, res = attention_fwd(p, x, H, causal)
    return y, attention_bwd(res, dy)


@partial(jax.jit, static_argnums=(3, 4))
def reference(p, x, dy, H, causal):
    y, vjp = jax.vjp(lambda p, x: attention(p, x, H, causal), p, x)
    return y, vjp(dy)


def check(B, T, D, H, causal, jit, seed=0):
    p, x, dy = make(seed, B, T, D)
    y, (dp, dx) = (jax.jit(manual, static_argnums=(3, 4)) if jit else manual)(p, x, dy, H, causal)
    y_ref, (dp_ref, dx_ref) = reference(p, x, dy, H, causal)
    np.testing.assert_allclose(y, y_ref, rtol=1e-13, atol=1e-13)
    assert_trees_close((dp_ref, dx_ref), (dp, dx), rtol=1e-10)
    return dp


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
def test_attention_matches_autodiff(causal, jit):
    check(3, 5, 8, 2, causal, jit)


@pytest.mark.parametrize("B,T,D,H,causal", [
    (1, 1, 4, 1, True),  # T = 1, one head
    (1, 1, 4, 2, False),
    (2, 7, 6, 1, False),  # one head, odd T
    (3, 4, 6, 3, True),  # Dh = 2, odd B
    (1, 3, 4, 4, True),  # Dh = 1
])
def test_attention_shapes(B, T, D, H, causal):
    check(B, T, D, H, causal, jit=True, seed=1)


def test_attention_every_head_differs():
    """With distinct heads, the gradient of each head's columns of wq is its own:
    a backward that mixed up heads would fail the comparison above; here we check
    that no head's block of dwq is zero."""
    dp = check(2, 5, 8, 4, True, jit=True, seed=2)
    for h in range(4):
        assert np.linalg.norm(dp["wq"][:, 2 * h:2 * h + 2]) > 1e-3


def test_softmax_bwd_rows_sum_to_zero():
    """dS = P * (dP - rowsum(dP * P)) sums to zero along each row, as softmax's
    shift invariance demands; masked entries (P = 0) get exactly zero."""
    rng = np.random.default_rng(3)
    probs = np.exp(rng.standard_normal((2, 3, 4, 4))) * np.tril(np.ones((4, 4)))
    probs /= probs.sum(-1, keepdims=True)
    ds = np.asarray(softmax_bwd(probs, rng.standard_normal(probs.shape)))
    np.testing.assert_allclose(ds.sum(-1), 0.0, atol=1e-14)
    assert np.all(ds[..., np.triu_indices(4, 1)[0], np.triu_indices(4, 1)[1]] == 0.0)
