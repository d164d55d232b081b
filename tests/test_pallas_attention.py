"""attention_impl "pallas": the flash-attention kernels (jaxformer/model/pallas_attention.py,
pallas_backward.py) run in interpret mode on CPU and equal the full layer in float64,
forward and gradients, to 1e-10; the whole model's manual and autodiff gradients with
them equal the full model's; bfloat16 stays within autodiff's error; the impls that
cannot run here (pallas on a TPU, cudnn off a GPU or in the manual source) are refused
by name. Shapes are tiny (interpret mode compiles slowly): T <= 37, D = 16, Dh = 8."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import attention_params as make
from helpers import dot_generals, leaf_rels, make_batch, make_params

import jaxformer
import manual_grads
from jaxformer.model import pallas_attention as pa
from jaxformer.model import pallas_backward as pb
from jaxformer.model.attention import attention, attention_probs, blockwise_attention, pallas_attention
from jaxformer.model.config import ModelConfig
from jaxformer.model.precision import matmul
from jaxformer.tools import compare
from manual_grads import custom_vjp as cv
from manual_grads.check import assert_trees_close
from manual_grads.pallas_attention import pallas_attention_bwd, pallas_attention_fwd

D, H, T = 16, 2, 37  # Dh = 8; T = 37 is a multiple of neither block below
BLOCKS = (16, 8)  # (block_q, block_k): 3 query blocks, 5 key blocks, both last ones padded


def full_core(q, k, v, causal):
    return matmul(attention_probs(q, k, causal), v)


def qkv_do(seed, T, B=2, Dh=8):
    rng = np.random.default_rng(seed)
    return tuple(jnp.asarray(rng.standard_normal((B, H, T, Dh))) for _ in range(4))


@functools.partial(jax.jit, static_argnums=(4, 5))
def manual_core(q, k, v, do, causal, blocks):
    out, res = pb.flash_core_fwd(q, k, v, causal, *blocks)
    return out, res, pb.flash_core_bwd(res, do)


@functools.partial(jax.jit, static_argnums=4)
def full_core_vjp(q, k, v, do, causal):
    out, vjp = jax.vjp(lambda q, k, v: full_core(q, k, v, causal), q, k, v)
    return out, vjp(do)


# ---------------------------------------------------------------------------- the core


@pytest.mark.parametrize("T,causal", [(T, True), (T, False), (1, True)])
def test_core_equals_full_attention(T, causal):
    """Forward, lse and the three backward kernels against the full core and jax.vjp of it."""
    q, k, v, do = qkv_do(0, T)
    out, res, grads = manual_core(q, k, v, do, causal, BLOCKS)
    out_ref, grads_ref = full_core_vjp(q, k, v, do, causal)
    np.testing.assert_allclose(out, out_ref, rtol=1e-13, atol=1e-13)
    s = q @ jnp.swapaxes(k, -1, -2) / np.sqrt(8)
    if causal:
        s = jnp.where(jnp.tril(jnp.ones((T, T), bool)), s, -jnp.inf)
    lse = res.lse.reshape(res.lse.shape[:2] + (-1,))[..., :T]
    np.testing.assert_allclose(lse, jax.nn.logsumexp(s, axis=-1), rtol=1e-13, atol=1e-13)
    assert_trees_close(grads_ref, grads, rtol=1e-10)
    assert isinstance(res, pb.CausalFlashRes) == causal
    assert out.dtype == lse.dtype == jnp.float64


def test_residuals_never_hold_the_probabilities():
    """What the backward keeps: padded q, k, v, O and lse, nothing (T, T); the block sizes
    and T are read back from the shapes."""
    q, k, v, _ = qkv_do(0, T)
    _, res = jax.eval_shape(lambda q, k, v: pb.flash_core_fwd(q, k, v, True, *BLOCKS), q, k, v)
    assert res.q.shape == (2, H, 3, 16, 8) and res.k.shape == res.v.shape == (2, H, 5, 8, 8)
    assert res.out.shape == (2, H, 3, 16, 8) and res.lse.shape == (2, H, 3, 16)
    assert pb.res_tiling(res) == pa.Tiling(T, 16, 8, 3, 5, 8, 8)


def test_gpu_tiling_in_interpret_mode(monkeypatch):
    """The GPU's tiles (powers of two, at least 16; the head width padded from 8 to 16)
    give the same numbers, run in interpret mode."""
    t = pa.tiling(T, 8, 16, 32, device="gpu")
    assert t == pa.Tiling(T, 16, 32, 3, 2, 8, 16)
    assert pa.tiling(5, 8, 0, 0, device="gpu")[1:3] == (16, 16)  # short T: one 16-tile
    monkeypatch.setattr(pb, "tiling", functools.partial(pa.tiling, device="gpu"))
    q, k, v, do = qkv_do(1, T)
    out, res, grads = manual_core(q, k, v, do, True, (16, 32))
    assert res.q.shape[-1] == 16
    out_ref, grads_ref = full_core_vjp(q, k, v, do, True)
    np.testing.assert_allclose(out, out_ref, rtol=1e-13, atol=1e-13)
    assert_trees_close(grads_ref, grads, rtol=1e-10)


def test_block_sizes_default_per_device():
    assert pa.tiling(200, 64, 0, 0, device="gpu")[1:3] == pa.DEFAULT_BLOCKS["gpu"] == (64, 64)
    assert pa.tiling(200, 64, 0, 0, device="cpu")[1:3] == pa.DEFAULT_BLOCKS["cpu"] == (128, 128)
    assert pa.tiling(200, 64, 32, 0, device="cpu")[1:3] == (32, 128)


@pytest.mark.parametrize("block", [12, 24, 8])
def test_gpu_tiles_must_be_powers_of_two(block):
    with pytest.raises(ValueError, match="ModelConfig.pallas_block_q must be a power of two >= 16"):
        pa.tiling(T, 8, block, 64, device="gpu")


# ---------------------------------------------------------------------------- the layer


@functools.partial(jax.jit, static_argnums=3)
def layer_vjp(p, x, dy, layer):
    y, vjp = jax.vjp(lambda p, x: layer(p, x, H, True), p, x)
    return y, vjp(dy)


def test_custom_vjp_drop_in_equals_the_full_layer():
    """manual_grads.custom_vjp.pallas_attention: JAX's grad through it runs the manual
    backward; output and gradients equal the full layer's."""
    p, x, dy = make(2, 2, T, D)
    y_ref, grads_ref = layer_vjp(p, x, dy, attention)
    y, grads = layer_vjp(p, x, dy, functools.partial(cv.pallas_attention, block_q=BLOCKS[0],
                                                     block_k=BLOCKS[1]))
    np.testing.assert_allclose(y, y_ref, rtol=1e-13, atol=1e-13)
    assert_trees_close(grads_ref, grads, rtol=1e-10)


# ---------------------------------------------------------------------------- the model

MODEL = ModelConfig(vocab_size=24, d_model=D, n_heads=H, n_layers=2, d_ff=24, max_seq_len=40,
                    attention_impl="pallas", pallas_block_q=BLOCKS[0], pallas_block_k=BLOCKS[1])
auto_vg = jax.jit(jax.value_and_grad(jaxformer.loss_fn), static_argnums=2)
manual_vg = jax.jit(manual_grads.value_and_grad, static_argnums=2)


@pytest.mark.parametrize("options,sources", [
    (dict(norm="pre"), (manual_vg, auto_vg)),
    (dict(norm="post", causal=False, remat="block", loss_chunk=16), (manual_vg,)),
], ids=["pre", "post-bidirectional-remat-chunked"])
def test_model_gradients_equal_the_full_model(options, sources):
    """manual_grads.value_and_grad with impl "pallas" (and, pre-norm, jax.grad(loss_fn),
    through the model's custom_vjp), under a loss mask, equals jax.grad of the same model
    with full attention; post-norm, bidirectional, beside block recompute and the chunked loss."""
    config = MODEL.replace(**options)
    params = make_params(config, jnp.float64)
    batch = make_batch(config, 2, T, "mostly_zero")
    plain = config.replace(attention_impl="full", remat="none", loss_chunk=0)
    loss_ref, grads_ref = auto_vg(params, batch, plain)
    for vg in sources:
        loss, grads = vg(params, batch, config)
        assert float(loss) == pytest.approx(float(loss_ref), rel=1e-12)
        assert_trees_close(grads_ref, grads)


def f32(tree):
    return jax.tree_util.tree_map(lambda a: jnp.asarray(a, jnp.float32), tree)


@functools.partial(jax.jit, static_argnums=(3, 4))
def layer_vjp_in(p, x, dy, layer, compute_dtype):
    y, vjp = jax.vjp(lambda p, x: layer(p, x, H, True, compute_dtype=compute_dtype), p, x)
    return y, vjp(dy)


@jax.jit
def pallas_manual_bf16(p, x, dy):
    y, res = pallas_attention_fwd(p, x, H, True, 8, 8, "bfloat16")
    return y, pallas_attention_bwd(res, dy)


def kernel_dots(jaxpr):
    """The dot_generals inside the pallas_calls of a jaxpr."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            yield from dot_generals(eqn.params["jaxpr"])
        for param in eqn.params.values():
            for sub in param if isinstance(param, (tuple, list)) else (param,):
                if hasattr(sub, "eqns") and eqn.primitive.name != "pallas_call":
                    yield from kernel_dots(getattr(sub, "jaxpr", sub))


def test_bfloat16_manual_error_is_within_autodiff_error():
    """compute_dtype bfloat16, judged as compare-grads judges it: against the float32
    reference (the full layer, no compute dtype), each gradient leaf of the pallas layer's
    manual backward is at most compare.MIXED_FACTOR times as far as JAX's grad of the
    same online softmax (the blockwise layer) is. (The key bias's true gradient is 0, so
    its error is round-off measured against the floor; the full layer's autodiff, whose
    dS rows sum to 0 more exactly, puts it up to 2 times closer.)"""
    p, x, dy = f32(make(4, 2, 21, D))
    _, ref = layer_vjp_in(p, x, dy, attention, None)
    y_a, grads_a = layer_vjp_in(p, x, dy, functools.partial(blockwise_attention, block=8), "bfloat16")
    y_m, grads_m = pallas_manual_bf16(p, x, dy)
    assert {g.dtype for g in jax.tree_util.tree_leaves(grads_m)} == {jnp.dtype("float32")}
    err_m, err_a = leaf_rels(ref, grads_m), leaf_rels(ref, grads_a)
    for path in err_a:
        assert compare.mixed_precision_passed(err_m[path], err_a[path]), (path, err_m[path], err_a[path])
    assert 1e-4 < err_m["[1]"] < 0.1  # dx: bfloat16 ran
    np.testing.assert_allclose(y_m, y_a, rtol=0.05, atol=0.05)


@pytest.mark.parametrize("source", ["manual", "auto"])
def test_kernels_follow_the_configured_compute_dtype(source):
    """Both gradient sources hand config.compute_dtype to the kernels: every product in
    the forward and backward kernels reads bfloat16 and accumulates in float32."""
    config = MODEL.replace(n_layers=1, compute_dtype="bfloat16")
    params = make_params(config, jnp.float32)
    batch = make_batch(config, 2, 21, None)
    vg = manual_grads.value_and_grad if source == "manual" else jax.value_and_grad(jaxformer.loss_fn)
    dots = list(kernel_dots(jax.make_jaxpr(vg, static_argnums=2)(params, batch, config).jaxpr))
    assert len(dots) == 9  # forward: q k^T, P v; dK/dV: q k^T, dO v^T, P^T dO, dS^T q; dQ: q k^T, dO v^T, dS k
    for eqn in dots:
        assert [a.aval.dtype for a in eqn.invars] == [jnp.bfloat16] * 2, eqn
        assert eqn.outvars[0].aval.dtype == jnp.float32, eqn


# ---------------------------------------------------------------------------- refusals


@pytest.mark.parametrize("backend,message", [
    ("tpu", "attention_impl 'pallas' is a Triton \\(GPU\\) kernel and cannot run on a TPU"),
    ("metal", "not on backend 'metal'"),
])
def test_pallas_is_refused_where_it_cannot_run(monkeypatch, backend, message):
    monkeypatch.setattr(jax, "default_backend", lambda: backend)
    p, x, _ = make(0, 1, 4, D)
    with pytest.raises(ValueError, match=message):
        pallas_attention(p, x, H, True)


def test_cudnn_is_refused_by_name(monkeypatch):
    config = MODEL.replace(attention_impl="cudnn", compute_dtype="bfloat16")
    params = make_params(config, jnp.float32)
    batch = make_batch(config, 1, 4, None)
    with pytest.raises(ValueError, match="attention_impl 'cudnn' runs only on a GPU.*'cpu'"):
        jaxformer.loss_fn(params, batch, config)
    with pytest.raises(ValueError, match="attention_impl 'cudnn' has no hand-derived backward"):
        manual_grads.value_and_grad(params, batch, config)
    with pytest.raises(ValueError, match="ModelConfig.attention_impl 'cudnn' cannot run with compute_dtype"):
        config.replace(compute_dtype="float32")
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    with pytest.raises(ValueError, match="attention_impl 'cudnn' needs bfloat16 or float16 products, "
                                         "not float32"):
        jaxformer.loss_fn(params, batch, config.replace(compute_dtype=None))


@pytest.mark.parametrize("field", ["pallas_block_q", "pallas_block_k"])
@pytest.mark.parametrize("value", [-1, 2.0, True, "8"])
def test_block_fields_are_checked_by_name(field, value):
    with pytest.raises(ValueError, match=f"ModelConfig.{field} must be a non-negative integer"):
        MODEL.replace(**{field: value})
