"""manual_grads.attention against jax.vjp of jaxformer.model.attention, in float64."""

import jax.numpy as jnp
import numpy as np
import pytest
from helpers import Layer, assert_layer_matches_vjp, attention_params

from jaxformer.model.attention import attention, merge_qkv, split_qkv
from jaxformer.model.config import ModelConfig
from manual_grads.attention import attention_bwd, attention_fwd, softmax_bwd

ATTENTION = Layer(attention_fwd, attention_bwd, attention)


def check(B, T, D, H, causal, jit, seed=0):
    p, x, dy = attention_params(seed, B, T, D)
    (_, (dp, _)), _ = assert_layer_matches_vjp(ATTENTION, (p, x), dy, static=(ModelConfig(d_model=D, n_heads=H, causal=causal),),
                                                jit=jit)
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


def test_merge_qkv_undoes_split_qkv_bit_for_bit():
    """merge_qkv, the q/k/v backward's merge (grouped heads: concat_features, a select of padded
    parts rather than a concatenate), is split_qkv's inverse exactly, negative zeros included."""
    rng = np.random.default_rng(0)
    for H, Hkv in ((4, 4), (4, 2), (4, 1)):
        qkv = rng.standard_normal((2, 3, (H + 2 * Hkv) * 5))
        qkv[0, 0, ::7] = -0.0
        q, k, v = split_qkv(jnp.asarray(qkv), H, Hkv)
        merged = np.asarray(merge_qkv(q, k, v))
        assert merged.shape == qkv.shape and (merged == qkv).all(), (H, Hkv)
        assert (np.signbit(merged) == np.signbit(qkv)).all(), (H, Hkv)
