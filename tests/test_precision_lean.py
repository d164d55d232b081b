"""bfloat16 products (ModelConfig.compute_dtype) in the memory options: blockwise
attention, the chunked head + cross entropy and block recompute, alone and together.

Gradients are judged as compare-grads judges them (helpers.assert_bfloat16_within_autodiff): each source
against a reference from the same float32 params without the compute dtype, the
manual error at most compare.MIXED_FACTOR times autodiff's (or than MIXED_FLOOR).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_bfloat16_within_autodiff, dot_generals, manual_vg

from jaxformer import init_params
from jaxformer.training import diagnose
from jaxformer.model.blockwise import blockwise_attention_core
from jaxformer.model.chunked_loss import chunked_head_loss
from jaxformer.model.config import ModelConfig
from jaxformer.model.cores import AttentionSpec
from jaxformer.model.kv_cache import forward_cached, init_cache
from jaxformer.model.transformer import forward
from manual_grads import attention as _attn
from manual_grads import custom_vjp as cv
from manual_grads import mlp as _mlp
from manual_grads.blockwise import blockwise_core_bwd, blockwise_core_fwd
from manual_grads.chunked_loss import chunked_head_loss_bwd, chunked_head_loss_fwd

# every width different; T = 10 is not a multiple of the attention block 4 or the chunk 8
BASE = ModelConfig(vocab_size=32, d_model=16, n_heads=2, n_layers=1, d_ff=24, max_seq_len=12)
B, T = 2, 10
BF16, F32 = jnp.dtype("bfloat16"), jnp.dtype("float32")
BLOCKWISE = {"attention_impl": "blockwise", "attention_block": 4}

# each option alone is in all_together (causal blockwise, the masked chunked loss, block
# recompute); bidirectional blockwise attention is the one case it leaves out
CASES = {
    "blockwise_bidirectional": (BASE.replace(causal=False, **BLOCKWISE), False),
    "all_together": (BASE.replace(n_layers=2, loss_chunk=8, remat="block", **BLOCKWISE), True),
}


def batch_for(config, masked, seed=0):
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, config.vocab_size, (B, T + 1))
    batch = {"inputs": jnp.asarray(ids[:, :-1], jnp.int32), "targets": jnp.asarray(ids[:, 1:], jnp.int32)}
    if masked:
        batch["mask"] = jnp.asarray(rng.random((B, T)) < 0.7, jnp.float32)
    return batch


@pytest.mark.parametrize("name", list(CASES))
def test_bfloat16_manual_error_is_within_autodiff_error(name):
    config, masked = CASES[name]
    params = init_params(jax.random.PRNGKey(0), config, jnp.float32)
    assert_bfloat16_within_autodiff(params, batch_for(config, masked), config)


def qkv(seed=0, shape=(B, 2, T, 8)):
    rng = np.random.default_rng(seed)
    return tuple(jnp.asarray(rng.standard_normal(shape), jnp.float32) for _ in range(4))


def assert_bf16_in_f32_out(fn, *args, at_least):
    dots = list(dot_generals(jax.make_jaxpr(fn)(*args).jaxpr))
    assert len(dots) >= at_least
    for eqn in dots:
        assert [v.aval.dtype for v in eqn.invars] == [BF16, BF16], eqn
        assert eqn.outvars[0].aval.dtype == F32, eqn


@pytest.mark.parametrize("causal", [True, False])
def test_blockwise_core_products_read_bfloat16_and_accumulate_float32(causal):
    q, k, v, dout = qkv()

    def forward(q, k, v):
        return blockwise_attention_core(q, k, v, AttentionSpec(causal, "bfloat16", block=4))

    def manual(q, k, v, dout):
        _, res = blockwise_core_fwd(q, k, v, AttentionSpec(causal, "bfloat16", block=4))
        return blockwise_core_bwd(res, dout)

    assert_bf16_in_f32_out(forward, q, k, v, at_least=2)  # q k^T, P v
    assert_bf16_in_f32_out(manual, q, k, v, dout, at_least=7)  # forward's 2, scores again, 4 in the pair
    out, lse = forward(q, k, v)
    assert out.dtype == lse.dtype == F32
    assert all(g.dtype == F32 for g in manual(q, k, v, dout))


def test_chunked_loss_products_read_bfloat16_and_accumulate_float32():
    rng = np.random.default_rng(1)
    head = {"w": jnp.asarray(rng.standard_normal((16, 32)), jnp.float32), "b": jnp.zeros(32, jnp.float32)}
    x = jnp.asarray(rng.standard_normal((B, T, 16)), jnp.float32)
    targets = jnp.asarray(rng.integers(0, 32, (B, T)), jnp.int32)

    def manual(head, x):
        loss, res = chunked_head_loss_fwd(head, x, targets, None, 8, "bfloat16")
        return loss, chunked_head_loss_bwd(res, jnp.ones((), jnp.float32))

    assert_bf16_in_f32_out(lambda h, x: chunked_head_loss(h, x, targets, None, 8, "bfloat16"), head, x,
                           at_least=1)
    assert_bf16_in_f32_out(manual, head, x, at_least=4)  # forward, recomputed logits, dx, dw
    loss, (dp, dx) = manual(head, x)
    assert loss.dtype == dx.dtype == dp["w"].dtype == F32


def test_without_compute_dtype_the_core_is_unchanged_by_float32():
    """compute_dtype None and "float32" on float32 inputs: the same bits, and no bfloat16."""
    q, k, v, dout = qkv(seed=2)

    def manual(q, k, v, dout, cd):
        out, res = blockwise_core_fwd(q, k, v, AttentionSpec(True, cd, block=4))
        return out, blockwise_core_bwd(res, dout)

    for a, b in zip(jax.tree_util.tree_leaves(manual(q, k, v, dout, None)),
                    jax.tree_util.tree_leaves(manual(q, k, v, dout, "float32"))):
        np.testing.assert_array_equal(a, b)
    assert "bf16" not in str(jax.make_jaxpr(lambda *a: manual(*a, None))(q, k, v, dout))


def test_cached_forward_follows_the_policy():
    """The sampler's cached forward runs its products in bfloat16 like model.forward,
    and its prefill logits match the uncached forward's to bfloat16 round-off."""
    config = BASE.replace(compute_dtype="bfloat16")
    params = init_params(jax.random.PRNGKey(0), config, jnp.float32)
    inputs = batch_for(config, False)["inputs"]
    cache = init_cache(config, B, jnp.float32)
    assert_bf16_in_f32_out(lambda p, i, c: forward_cached(p, i, c, 0, config), params, inputs, cache,
                           at_least=7)  # q, k, v, scores, values, out, ffn in and out, head
    logits, _ = forward_cached(params, inputs, cache, 0, config)
    ref = forward(params, inputs, config)
    exact = forward(params, inputs, BASE)
    assert logits.dtype == F32
    assert 0 < rel(logits, exact) < 0.05  # bfloat16 ran
    assert rel(logits, ref) <= 2 * rel(ref, exact)


def rel(got, ref):
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    return np.linalg.norm(got - ref) / np.linalg.norm(ref)


def test_diagnosis_runs_the_configured_layers_and_precision():
    """diagnose_batch follows attention_impl, loss_chunk and compute_dtype: its loss is
    the manual value_and_grad's, and it says what ran."""
    config, masked = CASES["all_together"]
    config = config.replace(compute_dtype="bfloat16")
    params = init_params(jax.random.PRNGKey(0), config, jnp.float32)
    batch = batch_for(config, masked)
    d = diagnose.diagnose_batch(params, batch, config)
    assert d.first is None
    assert d.settings == "blockwise attention (block 4), products in bfloat16, head + loss in chunks of 8"
    assert d.table().startswith(f"settings: {d.settings}\n")
    assert [s.name for s in d.stages][-1] == "head + loss"
    loss_m, _ = manual_vg(params, batch, config)
    assert d.loss == pytest.approx(float(loss_m), rel=1e-6)
    assert d.loss != float(manual_vg(params, batch, config.replace(compute_dtype=None))[0])  # bfloat16 ran


def f32_tree(tree):
    return jax.tree_util.tree_map(lambda a: jnp.asarray(a, jnp.float32), tree)


@pytest.mark.parametrize("layer", ["attention", "feed_forward", "blockwise_attention"])
def test_custom_vjp_layers_take_compute_dtype_as_a_static_argument(layer):
    """jax.grad through the custom_vjp layer with "bfloat16" runs the manual rule of
    the bfloat16 forward: the same cotangents as calling the pair directly."""
    params = f32_tree(init_params(jax.random.PRNGKey(0), BASE, jnp.float32)["blocks"])
    x = qkv(seed=3, shape=(B, T, 16))[0]
    attn = BASE.replace(compute_dtype="bfloat16")
    fwd, bwd, p, static = {
        "attention": (_attn.attention_fwd, _attn.attention_bwd, "attn", (attn,)),
        "feed_forward": (_mlp.feed_forward_fwd, _mlp.feed_forward_bwd, "ffn", ("gelu", "bfloat16")),
        "blockwise_attention": (_attn.attention_fwd, _attn.attention_bwd, "attn",
                                (attn.replace(attention_impl="blockwise", attention_block=4),)),
    }[layer]
    cv_layer = cv.feed_forward if layer == "feed_forward" else cv.attention
    p = jax.tree_util.tree_map(lambda a: a[0], params[p])
    y, vjp = jax.vjp(lambda p, x: cv_layer(p, x, *static), p, x)
    y_m, res = fwd(p, x, *static)
    np.testing.assert_array_equal(y, y_m)
    for a, b in zip(jax.tree_util.tree_leaves(vjp(y)), jax.tree_util.tree_leaves(bwd(res, y))):
        np.testing.assert_array_equal(a, b)
    assert "bf16" in str(jax.make_jaxpr(lambda p, x: cv_layer(p, x, *static))(p, x))


def test_custom_vjp_chunked_loss_takes_compute_dtype():
    rng = np.random.default_rng(4)
    head = {"w": jnp.asarray(rng.standard_normal((16, 32)), jnp.float32), "b": jnp.zeros(32, jnp.float32)}
    x = jnp.asarray(rng.standard_normal((B, T, 16)), jnp.float32)
    targets = jnp.asarray(rng.integers(0, 32, (B, T)), jnp.int32)
    mask = jnp.asarray(rng.random((B, T)) < 0.7, jnp.float32)
    grads = jax.grad(lambda h, x: cv.chunked_head_loss(h, x, targets, mask, 8, "bfloat16"), (0, 1))(head, x)
    _, res = chunked_head_loss_fwd(head, x, targets, mask, 8, "bfloat16")
    for a, b in zip(jax.tree_util.tree_leaves(grads),
                    jax.tree_util.tree_leaves(chunked_head_loss_bwd(res, jnp.ones((), jnp.float32)))):
        np.testing.assert_array_equal(a, b)
