"""Softcaps, x -> c tanh(x / c) (Gemma 2): ModelConfig.attn_softcap on the attention scores and
ModelConfig.logit_softcap on the head's logits. In float64: the full and blockwise cores with a
cap, manual core_fwd / core_bwd against jax.vjp per leaf; the attention layer; the head and the
cross entropy, chunked and not, manual against jax.vjp; the formula against torch; the cache
decoder; the refusals; no trace of a cap at the defaults. The pairwise option matrix
(test_modern_options.py) holds both fields against every other option."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import (FORWARD, LOSS, Layer, assert_bfloat16_within_autodiff, assert_layer_matches_vjp, decode_one_at_a_time, equations,
                     layer_and_vjp, make_batch, make_params, masks)

import jaxformer

from jaxformer.model.attention import CORES, attention
from jaxformer.model.chunked_loss import chunked_head_loss
from jaxformer.model.config import ModelConfig
from jaxformer.model.cores import AttentionSpec, attention_probs
from jaxformer.model.linear import linear
from jaxformer.model.losses import cross_entropy
from jaxformer.model.softcap import softcap
from jaxformer.model.transformer import loss_fn
from manual_grads.attention import MANUAL_CORES, attention_bwd, attention_fwd
from manual_grads.head import head_loss_bwd, head_loss_fwd
from manual_grads.softcap import softcap_bwd, softcap_fwd

B, H, T, Dh = 2, 4, 11, 4  # T = 11 leaves the last block of 4 padded (blockwise)
CAP = 1.5  # the scores below reach about +-6: well into tanh's bend


def qkv(seed, Hkv):
    rng = np.random.default_rng(seed)
    q = 2.0 * rng.standard_normal((B, H, T, Dh))
    k, v = (2.0 * rng.standard_normal((B, Hkv, T, Dh)) for _ in range(2))
    return q, k, v, rng.standard_normal((B, H, T, Dh))


def core_layer(impl):
    manual = MANUAL_CORES[impl]
    return Layer(manual.fwd, manual.bwd, CORES[impl].fn)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
@pytest.mark.parametrize("impl, Hkv", [("full", 2), ("full", H), ("blockwise", H)])
def test_capped_core_matches_autodiff(impl, Hkv, causal):
    """Manual core_fwd / core_bwd with spec.softcap against jax.vjp of the core, every leaf
    within 1e-10; the cap changes both the output and the gradients (the test can fail)."""
    q, k, v, dout = qkv(Hkv + 3 * causal, Hkv)
    spec = AttentionSpec(causal=causal, block=4, softcap=CAP)
    (out, grads), _ = assert_layer_matches_vjp(core_layer(impl), (q, k, v), dout, static=(spec,))
    (out0, grads0), _ = layer_and_vjp(core_layer(impl), (q, k, v), dout, static=(AttentionSpec(causal, block=4),))
    assert np.max(np.abs(out - out0)) > 0.1
    assert all(np.max(np.abs(a - b)) > 0.1 for a, b in zip(grads, grads0))


def test_capped_probabilities_equal_torch():
    """softmax(c tanh(q k^T / sqrt(Dh) / c)), causal: the full core's probabilities against
    torch's tanh and softmax in float64, and the blockwise core's output against them."""
    torch = pytest.importorskip("torch")
    q, k, v, _ = qkv(0, H)
    spec = AttentionSpec(causal=True, block=4, softcap=CAP)
    tq, tk, tv = (torch.tensor(a) for a in (q, k, v))
    s = CAP * torch.tanh(tq @ tk.transpose(-1, -2) / Dh ** 0.5 / CAP)
    s = s.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
    probs = torch.softmax(s, dim=-1)
    np.testing.assert_allclose(attention_probs(q, k, spec), probs.numpy(), rtol=1e-13, atol=1e-15)
    np.testing.assert_allclose(CORES["blockwise"].fn(q, k, v, spec), (probs @ tv).numpy(), rtol=1e-12, atol=1e-13)


@pytest.mark.parametrize("impl", ["full", "blockwise"])
def test_capped_attention_layer_matches_autodiff(impl):
    """The whole layer (projections, QK-norm, rotary, grouped heads) with attn_softcap: the config
    reaches the core through attention_spec."""
    config = ModelConfig(d_model=16, n_heads=H, n_kv_heads=2, qk_norm=True, positions="rope", norm_type="rms",
                         attention_impl=impl, attention_block=4, attn_softcap=0.5)
    rng = np.random.default_rng(5)
    widths = {"q": 16, "k": 8, "v": 8, "o": 16}
    p = {"w" + n: rng.standard_normal((16, w)) for n, w in widths.items()}
    p.update({"b" + n: rng.standard_normal(w) for n, w in widths.items()})
    p["q_norm"], p["k_norm"] = ({"scale": 1.0 + 0.3 * rng.standard_normal(Dh)} for _ in range(2))
    x, dy = rng.standard_normal((2, T, 16)), rng.standard_normal((2, T, 16))
    (y, _), _ = assert_layer_matches_vjp(Layer(attention_fwd, attention_bwd, attention), (p, x), dy,
                                         static=(config,), y_rtol=1e-12, y_atol=1e-12)
    assert np.max(np.abs(y - attention(p, x, config.replace(attn_softcap=0.0)))) > 0.1


# ---------------------------------------------------------------------------- the logits' cap

D, V = 6, 11


def head_inputs(seed):
    rng = np.random.default_rng(seed)
    head = {"w": rng.standard_normal((D, V)), "b": rng.standard_normal(V)}
    return head, 2.0 * rng.standard_normal((B, T, D)), jnp.asarray(rng.integers(0, V, (B, T)), jnp.int32)


def capped_loss(head, x, targets, mask, config):
    """The unchunked reference: cross_entropy(softcap(x @ w + b)), by jax.vjp."""
    return cross_entropy(softcap(linear(x, head["w"], head["b"]), config.logit_softcap), targets, mask)


HEAD_LOSS = Layer(head_loss_fwd, head_loss_bwd, capped_loss)


@pytest.mark.parametrize("chunk, mask_name", [(0, "none"), (0, "mostly_zero"), (3, "none"), (5, "bool"),
                                              (22, "mostly_zero")])
def test_capped_head_loss_matches_autodiff(chunk, mask_name):
    """manual_grads.head's head_loss_fwd / head_loss_bwd with logit_softcap (chunked: the
    residual keeps lse, never the logits) against jax.vjp of the unchunked capped loss; the
    model's own chunked loss with the cap gives the same value and jax.vjp."""
    head, x, targets = head_inputs(chunk + len(mask_name))
    mask = masks(2, B, T)[mask_name]
    config = ModelConfig(loss_chunk=chunk, logit_softcap=CAP)
    (loss, grads), (ref, grads_ref) = assert_layer_matches_vjp(
        HEAD_LOSS, (head, x), 0.7, consts=(targets, mask), static=(config,), y_rtol=1e-12, y_atol=1e-12)
    uncapped = cross_entropy(linear(x, head["w"], head["b"]), targets, mask)
    assert abs(float(loss) - float(uncapped)) > 0.1
    if chunk:
        chunked = Layer(head_loss_fwd, head_loss_bwd, lambda h, x, t, m, c: chunked_head_loss(h, x, t, m, chunk,
                                                                                               None, CAP))
        assert_layer_matches_vjp(chunked, (head, x), 0.7, consts=(targets, mask), static=(config,),
                                 y_rtol=1e-12, y_atol=1e-12)


def test_softcap_pair():
    """softcap_fwd / softcap_bwd: 1 - tanh^2, from the kept tanh."""
    x = np.linspace(-8.0, 8.0, 33)
    y, t = softcap_fwd(x, 2.0)
    np.testing.assert_allclose(y, 2.0 * np.tanh(x / 2.0), rtol=1e-15)
    np.testing.assert_allclose(softcap_bwd(t, np.ones_like(x)), 1.0 / np.cosh(x / 2.0) ** 2, rtol=1e-12, atol=1e-15)
    assert np.all(np.abs(y) < 2.0)


# ---------------------------------------------------------------------------- the model


BASE = ModelConfig(vocab_size=29, d_model=16, n_heads=4, n_layers=2, d_ff=24, max_seq_len=16, attention_block=4,
                   attn_softcap=0.05, logit_softcap=0.3)


@pytest.mark.parametrize("impl, chunk", [("full", 0), ("blockwise", 5)])
def test_caps_change_the_models_loss(impl, chunk):
    """Both caps on, the loss moves by more than 1e-3 from the uncapped model's: the caps bend
    these scores and logits. That the three gradient sources (manual value_and_grad, jax.grad,
    the custom_vjp model) agree with the caps on, 1e-10 per leaf, is the pairwise option matrix's
    (test_modern_options.py, whose BASE is this one without the caps, with the caps' values here):
    every pair of attention_impl {full, blockwise}, loss_chunk {0, 5}, attn_softcap 0.05 and
    logit_softcap 0.3 is in some row that it checks."""
    config = BASE.replace(attention_impl=impl, loss_chunk=chunk)
    params, batch = make_params(config, jnp.float64), make_batch(config, 2, 13, "mostly_zero")
    loss = LOSS(params, batch, config)
    uncapped = LOSS(params, batch, config.replace(attn_softcap=0.0, logit_softcap=0.0))
    assert abs(float(loss) - float(uncapped)) > 1e-3


@pytest.mark.parametrize("impl, chunk", [("full", 0), ("blockwise", 8)])
def test_bfloat16_rule_holds_with_caps(impl, chunk):
    """Under compute_dtype bfloat16 the manual gradients, caps on, are as close to float32's as autodiff's."""
    config = BASE.replace(attention_impl=impl, loss_chunk=chunk)
    ids = np.random.default_rng(0).integers(0, config.vocab_size, (2, 11))
    batch = {"inputs": jnp.asarray(ids[:, :-1], jnp.int32), "targets": jnp.asarray(ids[:, 1:], jnp.int32)}
    params = jaxformer.init_params(jax.random.PRNGKey(0), config, jnp.float32)
    assert_bfloat16_within_autodiff(params, batch, config)


def test_cache_decoder_caps_as_forward():
    """The key/value cache decoder: the prompt and then one token at a time give forward's
    capped logits."""
    config = BASE.replace(positions="rope", attn_softcap=0.5, logit_softcap=2.0)
    params = make_params(config, jnp.float64)
    params = jax.tree_util.tree_map(lambda a: 5 * a, params)  # scores and logits past the caps' bend
    ids = jnp.asarray(np.random.default_rng(0).integers(0, 29, (2, 9)), jnp.int32)
    full = FORWARD(params, ids, config)
    assert np.max(np.abs(full)) < 2.0 and np.max(np.abs(full - FORWARD(params, ids, BASE.replace(
        positions="rope", attn_softcap=0.0, logit_softcap=0.0)))) > 0.1
    np.testing.assert_allclose(decode_one_at_a_time(params, ids, config, 5), full, rtol=1e-12, atol=1e-13)


def test_no_cap_traces_no_tanh():
    """At the defaults nothing of a cap is traced (relu: no other tanh); with either cap, its tanh is."""
    config = BASE.replace(activation="relu", attn_softcap=0.0, logit_softcap=0.0)
    params = jax.eval_shape(lambda: jaxformer.init_params(jax.random.PRNGKey(0), config))
    batch = {"inputs": jnp.zeros((2, 8), jnp.int32), "targets": jnp.zeros((2, 8), jnp.int32)}

    def tanhs(c):
        jaxpr = jax.make_jaxpr(jax.grad(loss_fn), static_argnums=2)(params, batch, c)
        return sum(e.primitive.name == "tanh" for e in equations(jaxpr.jaxpr))

    assert tanhs(config) == 0
    assert tanhs(config.replace(attn_softcap=30.0)) > 0 and tanhs(config.replace(logit_softcap=30.0)) > 0


# ---------------------------------------------------------------------------- refusals


@pytest.mark.parametrize("changes, match", [
    (dict(attn_softcap=-1.0), r"ModelConfig.attn_softcap must be >= 0"),
    (dict(logit_softcap=float("inf")), r"ModelConfig.logit_softcap must be a finite number"),
    (dict(logit_softcap="30"), r"ModelConfig.logit_softcap must be a finite number"),
    (dict(attn_softcap=50.0, attention_impl="pallas"), r"ModelConfig.attn_softcap > 0 is not supported with "
                                                       r"attention_impl 'pallas'"),
    (dict(attn_softcap=50.0, attention_impl="cudnn", compute_dtype="bfloat16"),
     r"ModelConfig.attn_softcap > 0 is not supported with attention_impl 'cudnn'"),
])
def test_bad_softcaps_are_named(changes, match):
    with pytest.raises(ValueError, match=match):
        ModelConfig(**changes)


def test_fused_cores_refuse_a_capped_spec():
    q, k, v, _ = qkv(0, H)
    with pytest.raises(ValueError, match="AttentionSpec.softcap is not supported by attention_impl 'pallas'"):
        CORES["pallas"].fn(q, k, v, AttentionSpec(softcap=CAP))


@pytest.mark.parametrize("field", ["attn_softcap", "logit_softcap"])
def test_hugging_face_export_refuses_a_cap(field):
    """GPT-2 and the Llama families have no softcap: export names the field, never drops it."""
    from jaxformer.formats import hf_gpt2, hf_llama
    llama = ModelConfig(norm_type="rms", positions="rope", mlp="gated", head_bias=False)
    for module, config in ((hf_gpt2, ModelConfig(head_bias=False)), (hf_llama, llama)):
        with pytest.raises(ValueError, match=f"ModelConfig.{field} = 0.0"):
            module.config_to_hf(config.replace(**{field: 30.0}))


def test_defaults_are_off_and_a_logit_cap_keeps_the_pallas_kernel():
    assert ModelConfig().attn_softcap == ModelConfig().logit_softcap == 0.0
    assert ModelConfig(attention_impl="pallas", logit_softcap=30).logit_softcap == 30.0
