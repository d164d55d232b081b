"""Packed documents (segment ids, batch["segments"]): a query reads only the keys of its own
document. In float64: every core (full, blockwise, the Pallas kernels in interpret mode) equals
a dense masked softmax written here, with and without a causal mask and a sliding window; each
manual core backward equals jax.vjp of the full core; the three gradient sources agree on
segmented batches for every impl and a few model options; and the logits of each document of a
packed row equal the logits of the document run alone (rotary positions: exactly, as scores
read only t - s; learned positions: the row's first document)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import FORWARD, LOSS, THREE_SOURCES, Layer, assert_layer_matches_vjp, make_batch, make_params

from manual_grads import check
from jaxformer.model.attention import CORES
from jaxformer.model.config import ModelConfig
from jaxformer.model.cores import AttentionSpec, full, segment_mask
from jaxformer.model.transformer import forward
from jaxformer.tools.aot.targets import TARGETS, compiling_for
from manual_grads.attention import MANUAL_CORES

B, H, T, Dh = 2, 4, 13, 4  # T = 13 leaves the last block of 4 padded
LENGTHS = ((5, 8), (3, 1, 6, 3))  # the documents of each row


def row_segments(lengths=LENGTHS):
    """(B, T) int32 document ids: row b holds documents of lengths[b], numbered from 0."""
    return jnp.asarray(np.stack([np.repeat(np.arange(len(ls)), ls) for ls in lengths]), jnp.int32)


def qkv(seed, Hkv=H):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, H, T, Dh))
    k, v = (rng.standard_normal((B, Hkv, T, Dh)) for _ in range(2))
    return q, k, v, rng.standard_normal((B, H, T, Dh))


def dense_reference(q, k, v, segments, causal, window):
    """softmax(q k^T / sqrt(Dh)) v in numpy, keys of another document (and the future, and
    past the window) masked; k and v repeated to q's heads."""
    G = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, G, axis=1), np.repeat(v, G, axis=1)
    s = q @ np.swapaxes(k, -1, -2) / np.sqrt(q.shape[-1])
    t, j = np.arange(T)[:, None], np.arange(T)[None, :]
    seg = np.asarray(segments)
    allowed = (seg[:, None, :, None] == seg[:, None, None, :]) & ((j <= t) | (not causal))
    if window:
        allowed = allowed & (j > t - window)
    s = np.where(allowed, s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    return (p / p.sum(-1, keepdims=True)) @ v


def spec(impl, causal=True, window=0):
    pallas = impl == "pallas"
    return AttentionSpec(causal=causal, block=4, block_q=8 if pallas else 0, block_k=4 if pallas else 0,
                         window=window)


IMPLS = [("full", 2), ("blockwise", H), ("pallas", 2), ("pallas", 1)]
MASKS = [(True, 0), (False, 0), (True, 3)]


@pytest.mark.parametrize("causal, window", MASKS)
@pytest.mark.parametrize("impl, Hkv", IMPLS)
def test_every_core_equals_dense_mask(impl, Hkv, causal, window):
    """Each core's output with segment ids equals the dense masked softmax written above, and
    differs from its output without them (the test can fail)."""
    q, k, v, _ = qkv(Hkv + window, Hkv)
    f = jax.jit(CORES[impl].fn, static_argnums=3)
    got = f(q, k, v, spec(impl, causal, window), None, row_segments())
    np.testing.assert_allclose(got, dense_reference(q, k, v, row_segments(), causal, window), rtol=1e-12, atol=1e-13)
    assert np.max(np.abs(got - f(q, k, v, spec(impl, causal, window)))) > 1e-2


@pytest.mark.parametrize("causal, window", MASKS)
@pytest.mark.parametrize("impl, Hkv", IMPLS)
def test_manual_core_backward_equals_autodiff(impl, Hkv, causal, window):
    """manual core_fwd / core_bwd with segment ids against jax.vjp of the full core (a dense
    mask) with them, every leaf within 1e-10."""
    q, k, v, dout = qkv(10 + Hkv + window, Hkv)
    manual = MANUAL_CORES[impl]
    layer = Layer(lambda q, k, v, seg, s: manual.fwd(q, k, v, s, None, seg), manual.bwd,
                  lambda q, k, v, seg, s: full(q, k, v, s, None, seg))
    assert_layer_matches_vjp(layer, (q, k, v), dout, consts=(row_segments(),), static=(spec(impl, causal, window),))


def test_pallas_jax_grad_runs_the_segmented_backward_kernels():
    """jax.grad of the differentiable kernel (its rule the backward kernels) equals jax.grad of
    the full core, both with segment ids."""
    q, k, v, dout = qkv(7, 2)
    seg = row_segments()
    loss = lambda core, s: lambda q, k, v: jnp.vdot(core(q, k, v, s, None, seg), dout)  # noqa: E731
    got = jax.jit(jax.grad(loss(CORES["pallas"].fn, spec("pallas")), argnums=(0, 1, 2)))(q, k, v)
    ref = jax.jit(jax.grad(loss(full, spec("full")), argnums=(0, 1, 2)))(q, k, v)
    check.assert_trees_close(ref, got)


def test_cudnn_mask_means_the_same_documents():
    """The cudnn core hands the segment ids to jax.nn.dot_product_attention as its boolean
    ``mask``; JAX's own (XLA) implementation of that call with the same mask equals the full
    core with the segment ids (cuDNN itself runs only on a GPU). In float32: JAX's softmax
    there runs in float32 whatever the inputs."""
    q, k, v = (jnp.asarray(a, jnp.float32) for a in qkv(5)[:3])
    seg = row_segments()
    t = lambda a: jnp.swapaxes(a, 1, 2)  # noqa: E731  (B, T, H, Dh), the layout the call takes
    got = jax.nn.dot_product_attention(t(q), t(k), t(v), mask=segment_mask(seg, seg), is_causal=True,
                                       implementation="xla")
    ref = full(q, k, v, spec("full"), None, seg)
    np.testing.assert_allclose(t(got), ref, rtol=1e-5, atol=1e-6)
    assert np.max(np.abs(ref - full(q, k, v, spec("full")))) > 1e-2


CONFIG = dict(vocab_size=37, d_model=16, n_heads=4, n_layers=2, d_ff=24, max_seq_len=16)
MODERN = dict(norm_type="rms", positions="rope", mlp="gated", activation="silu", n_kv_heads=2)
MODEL_OPTIONS = {
    "modern, remat block, loss chunks": {**MODERN, "remat": "block", "loss_chunk": 5},
    "post, dropout": {"norm": "post", "dropout": 0.1},
}


def model_config(impl, **options):
    blocks = dict(attention_block=4) if impl == "blockwise" else dict(pallas_block_q=8, pallas_block_k=4) \
        if impl == "pallas" else {}
    return ModelConfig(**CONFIG, attention_impl=impl, **blocks, **options)


@pytest.mark.parametrize("impl, options", [(impl, options) for impl in ("full", "blockwise", "pallas")
                                            for options in MODEL_OPTIONS  # the Pallas core takes no dropout
                                            if not (impl == "pallas" and "dropout" in MODEL_OPTIONS[options])])
def test_three_sources_agree_on_packed_rows(impl, options):
    """manual == jax.grad == custom_vjp per leaf (float64, 1e-10) with batch["segments"], and
    the segments change the loss (they reach every source)."""
    config = model_config(impl, **MODEL_OPTIONS[options])
    key = jax.random.PRNGKey(3) if config.dropout else None
    params, batch = make_params(config, jnp.float64), make_batch(config, B, T, "mostly_zero")
    packed = {**batch, "segments": row_segments()}
    (loss_ref, ref), *others = THREE_SOURCES(params, packed, config, key)
    for name, (loss, grads) in zip(("manual", "custom_vjp"), others):
        np.testing.assert_allclose(loss, loss_ref, rtol=1e-12, atol=1e-12, err_msg=name)
        check.assert_trees_close(ref, grads)
    # the loss without the segments: jax.grad's value is loss_fn's, so the forward alone gives it
    assert abs(float(LOSS(params, batch, config, key=key)) - float(loss_ref)) > 1e-6


@pytest.mark.parametrize("impl", ["full", "blockwise", "pallas"])
def test_each_document_of_a_packed_row_equals_it_alone(impl):
    """Rotary positions: the logits of each document within a packed row equal the logits of
    the document run on its own (scores read only t - s, so positions running on across the
    row change nothing); without the segment ids they do not."""
    config = model_config(impl, **MODERN)
    params = make_params(config, jnp.float64)
    inputs = make_batch(config, B, T, None)["inputs"]
    packed = FORWARD(params, inputs, config, segments=row_segments())
    unsegmented = FORWARD(params, inputs, config)
    for b, lengths in enumerate(LENGTHS):
        start = 0
        for n in lengths:
            alone = FORWARD(params, inputs[b:b + 1, start:start + n], config)[0]
            np.testing.assert_allclose(packed[b, start:start + n], alone, rtol=1e-10, atol=1e-12)
            if start:
                assert np.max(np.abs(unsegmented[b, start:start + n] - alone)) > 1e-4
            start += n


def test_learned_positions_keep_the_first_document():
    """Learned positions run on across a row: its first document equals the document alone."""
    config = model_config("full")
    params = make_params(config, jnp.float64)
    inputs = make_batch(config, B, T, None)["inputs"]
    packed = FORWARD(params, inputs, config, segments=row_segments())
    np.testing.assert_allclose(packed[0, :5], FORWARD(params, inputs[:1, :5], config)[0], rtol=1e-10, atol=1e-12)


def test_bad_segments_are_named():
    config = model_config("full")
    params = make_params(config, jnp.float64)
    inputs = make_batch(config, B, T, None)["inputs"]
    with pytest.raises(ValueError, match="segments"):
        forward(params, inputs, config, segments=jnp.zeros((B, T - 1), jnp.int32))
    with pytest.raises(ValueError, match="segments"):
        forward(params, inputs, config, segments=jnp.zeros((B, T)))


@pytest.mark.parametrize("platform, call", [("cuda", "@__gpu$xla.gpu.triton"), ("tpu", "@tpu_custom_call")])
def test_segmented_kernels_lower_for_gpu_and_tpu(platform, call):
    """jax.value_and_grad through the kernel with segment ids, exported from this CPU process:
    the four kernels (forward, delta, dK/dV, dQ) lower as Triton / Mosaic calls."""
    checks = [jax.export.DisabledSafetyCheck.custom_call(c) for c in ("__gpu$xla.gpu.triton", "tpu_custom_call")]
    loss = lambda q, k, v, s: CORES["pallas"].fn(q, k, v, AttentionSpec(), None, s).sum()  # noqa: E731
    q, k = jax.ShapeDtypeStruct((1, 4, 40, 8), jnp.float32), jax.ShapeDtypeStruct((1, 2, 40, 8), jnp.float32)
    f = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
    with compiling_for(TARGETS["h100" if platform == "cuda" else "tpu-v5e"]):
        text = jax.export.export(f, platforms=[platform], disabled_checks=checks)(
            q, k, k, jax.ShapeDtypeStruct((1, 40), jnp.int32)).mlir_module()
    assert text.count(call) == 4
