"""LoRA adapters (jaxformer/model/lora.py, manual_grads/lora.py): in float64 the adapters'
gradient by hand (manual_grads.adapters.value_and_grad), jax.grad of the adapted model and
jax.grad of the custom_vjp model agree to 1e-10 per leaf, in models where every value of every
option of the float64 matrix (test_modern_options.FIELDS) meets every value of each LoRA option
(targets, rank, dropout), and those with each other; then what an adapter means (a fresh one changes nothing, merged weights give
the same logits), what the adapters-only gradient saves (XLA's FLOPs and memory), the errors."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import make_batch, make_params
from test_modern_options import BASE, FIELDS, SHAPES, allowed

import jaxformer
import manual_grads
from jaxformer.model import lora
from manual_grads import adapters as manual_adapters
from jaxformer.training.adapters import lora_loss_fn
from manual_grads import check, custom_vjp

LORA_FIELDS = {
    "lora_targets": ("k,o,down", "all"),  # "all": q k v o and the MLP's (plain: in, out; gated: gate,
    # up, down); "k,o,down": k alone among q, k, v (zeros in q's and v's columns), down only where gated
    "lora_rank": (1, 3),
    "lora_dropout": (0.0, 0.25),
}
ALL_FIELDS = {**FIELDS, **LORA_FIELDS}
KEY = jax.random.PRNGKey(11)


def _wanted(a, b) -> bool:
    """The pairs of fields the rows cover: a LoRA option with any option (model options
    with each other are test_modern_options' matrix)."""
    return a in LORA_FIELDS or b in LORA_FIELDS


def _rows():
    """Eight models, in pairs: each pair shares its model options (FIELDS' first value wherever
    it names none) and holds complementary LoRA options, so each of its model values meets both
    values of each LoRA option; each model value off FIELDS' first is in one pair at least, the
    first in the others; the eight LoRA triples (targets, rank, dropout) appear once each, so the
    LoRA options meet each other too (test_rows_cover_every_pair_with_lora checks every pair)."""
    pairs = [  # norm "pre" (FIELDS' first) in the first pair
        dict(positions="sinusoidal", mlp="gated", bias=False, n_experts=4, shared_expert_d_ff=8,
             shared_expert_gate=False, dropout=0.2, activation="silu", qkv_bias=True, loss_chunk=5,
             head_bias=False),
        dict(norm="post", causal=False, bias=False, mlp_bias=True, norm_type="rms", norm_offset=1.0,
             attention_impl="blockwise", attn_softcap=0.05, head_dim=6, out_bias=True, router="softmax_topk",
             embed_scale=True, attention_block=5),
        dict(norm="output", positions="rope", rope_scaling="llama3", rope_layers=(0, 1), norm_type="rms",
             norm_scale=False, attention_impl="pallas", activation="relu2", n_kv_heads=2, attn_scalar=10.0,
             tie_embeddings=True),
        dict(norm="sandwich", positions="rope", rope_scaling="yarn", sliding_window=3,
             layer_types=("full_attention", "sliding_attention"), rope_local_theta=7.0, qk_norm=True,
             qk_norm_scope="projection", n_kv_heads=1, logit_softcap=0.3, remat="block"),
    ]
    triples = list(itertools.product(*LORA_FIELDS.values()))  # triples[7 - i]: triples[i]'s complement
    first = {name: values[0] for name, values in FIELDS.items()}
    return [{**first, **model, **dict(zip(LORA_FIELDS, triples[k]))}
            for i, model in enumerate(pairs) for k in (i, 7 - i)]


# one compile per row: eight, the fewest that let norm's four values meet both values of a
# LoRA option; the model options spread over the four pairs (a model holding many of them
# compiles superlinearly longer)
ROWS = _rows()


def _case(row):
    model = {k: v for k, v in row.items() if k not in LORA_FIELDS}
    lc = lora.LoraConfig(rank=row["lora_rank"], alpha=2.5, dropout=row["lora_dropout"],
                         targets=row["lora_targets"])
    return BASE.replace(**model), lc


def test_rows_cover_every_pair_with_lora():
    assert len(ROWS) == 8  # norm's four values meet each of two LoRA values: 8 at least
    for a, b in itertools.combinations(ALL_FIELDS, 2):
        if not _wanted(a, b):
            continue
        seen = {(row[a], row[b]) for row in ROWS}
        wanted = {(va, vb) for va in ALL_FIELDS[a] for vb in ALL_FIELDS[b] if allowed((a, va), (b, vb))}
        assert seen == wanted, (a, b)


def random_adapters(params, lc, seed=3):
    """Adapters with A as init_adapters draws it and B random too (a zero B hides dA)."""
    ad = lora.init_adapters(jax.random.PRNGKey(seed), params, lc)
    rng = np.random.default_rng(seed)
    return jax.tree_util.tree_map(lambda a: a + 0.2 * jnp.asarray(rng.standard_normal(a.shape), a.dtype), ad)


def _three(adapters, batch, base, config, lc, key):
    return (jax.value_and_grad(lora_loss_fn)(adapters, batch, base, config, lc, key),
            manual_adapters.value_and_grad(adapters, batch, base, config, lc, key),
            jax.value_and_grad(lora_loss_fn)(adapters, batch, base, config, lc, key, custom_vjp.loss_fn))


THREE = jax.jit(_three, static_argnums=(3, 4))


@pytest.mark.parametrize("case", range(len(ROWS)),
                         ids=[f"{r['lora_targets']}-r{r['lora_rank']}-d{r['lora_dropout']}-{r['mlp']}-"
                              f"{r['attention_impl']}-{r['norm']}" for r in ROWS])
def test_lora_manual_equals_autodiff_float64(case):
    config, lc = _case(ROWS[case])
    B, T, mask = SHAPES[case % len(SHAPES)]
    base, batch = make_params(config, jnp.float64), make_batch(config, B, T, mask)
    adapters = random_adapters(base, lc)
    (loss_ref, ref), *others = THREE(adapters, batch, base, config, lc, KEY)
    for name, (loss, grads) in zip(("manual", "custom_vjp"), others):
        np.testing.assert_allclose(loss, loss_ref, rtol=1e-12, atol=1e-12, err_msg=name)
        assert jax.tree_util.tree_structure(grads) == jax.tree_util.tree_structure(adapters), name
        check.assert_trees_close(ref, grads)  # 1e-10 per leaf
    assert all(float(jnp.abs(g).max()) > 0 for g in jax.tree_util.tree_leaves(ref))


# ---------------------------------------------------------------------------- meaning

CONFIG = BASE.replace(mlp="gated", norm_type="rms", positions="rope", bias=False)


def test_fresh_adapters_change_nothing_and_merge_equals_attached():
    base = make_params(CONFIG, jnp.float64)
    batch = make_batch(CONFIG, 2, 7, None)
    lc = lora.LoraConfig(rank=2, alpha=3.0, targets="all")
    fresh = lora.init_adapters(jax.random.PRNGKey(0), base, lc)
    plain = jaxformer.forward(base, batch["inputs"], CONFIG)
    np.testing.assert_array_equal(jaxformer.forward(lora.attach(base, fresh, lc), batch["inputs"], CONFIG), plain)
    a = fresh["blocks"]["attn"]["wq"]["a"]
    assert a.shape == (2, 16, 2) and float(jnp.abs(a).max()) <= 1 / 4  # U(-1/sqrt(D), 1/sqrt(D))
    trained = random_adapters(base, lc)
    attached = jaxformer.forward(lora.attach(base, trained, lc), batch["inputs"], CONFIG)
    merged = jaxformer.forward(lora.merge(base, trained, lc), batch["inputs"], CONFIG)
    assert float(jnp.abs(attached - plain).max()) > 1e-3
    np.testing.assert_allclose(merged, attached, rtol=1e-12, atol=1e-12)


def test_adapter_term_is_scaled_low_rank_product():
    """One projection by hand: x W + (alpha / r) (x A) B, with the model's own attention."""
    config = CONFIG.replace(n_layers=1)
    base = make_params(config, jnp.float64)
    lc = lora.LoraConfig(rank=2, alpha=5.0, targets="v")
    ad = random_adapters(base, lc)
    x = jnp.asarray(np.random.default_rng(0).standard_normal((1, 3, 16)))
    p = jax.tree_util.tree_map(lambda a: a[0], lora.attach(base, ad, lc)["blocks"]["attn"])
    got = jaxformer.model.attention.qkv_heads(p, x, 4)[2]  # v (1, 4, 3, 4)
    ab = ad["blocks"]["attn"]["wv"]
    want = x @ p["wv"] + 2.5 * (x @ ab["a"][0]) @ ab["b"][0]
    np.testing.assert_allclose(jaxformer.model.attention.merge_heads(got), want, rtol=1e-12)


def test_adapters_only_gradient_skips_the_frozen_weights_work():
    """XLA's own accounting: the adapters' gradient needs fewer FLOPs (no dW products) and
    less memory than the full manual gradient of the same model (scanned layers)."""
    config = CONFIG.replace(n_layers=6, d_model=64, d_ff=128, vocab_size=256, max_seq_len=32)
    base = jaxformer.init_params(jax.random.PRNGKey(0), config)
    lc = lora.LoraConfig(rank=4, targets="q,v")
    ad = lora.init_adapters(jax.random.PRNGKey(1), base, lc)
    batch = make_batch(config, 4, 32, None)
    full = jax.jit(manual_grads.value_and_grad, static_argnums=2).lower(base, batch, config).compile()
    only = jax.jit(manual_adapters.value_and_grad, static_argnums=(3, 4)).lower(ad, batch, base, config, lc).compile()
    flops = [c.cost_analysis() for c in (full, only)]
    flops = [(f[0] if isinstance(f, list) else f)["flops"] for f in flops]
    mem = [c.memory_analysis() for c in (full, only)]
    assert flops[1] < 0.8 * flops[0], flops
    assert mem[1].temp_size_in_bytes < mem[0].temp_size_in_bytes, mem
    assert mem[1].output_size_in_bytes < 0.1 * mem[0].output_size_in_bytes, mem


# ---------------------------------------------------------------------------- errors


@pytest.mark.parametrize("changes, match", [
    (dict(rank=0), "lora_rank must be a positive integer, got 0"),
    (dict(alpha=-1.0), "lora_alpha must be a positive number, got -1.0"),
    (dict(dropout=1.0), r"lora_dropout must be in \[0, 1\), got 1.0"),
    (dict(targets="q,x"), "lora_targets must name projections among q, k, v, o"),
    (dict(targets=""), "lora_targets must name projections"),
])
def test_bad_lora_values_are_named(changes, match):
    with pytest.raises(ValueError, match=match):
        lora.LoraConfig(**changes)


def test_targets_the_model_lacks_are_refused():
    base = make_params(BASE, jnp.float64)  # a plain MLP: no gate
    with pytest.raises(ValueError, match="lora_targets gate name no projection of this model"):
        lora.init_adapters(jax.random.PRNGKey(0), base, lora.LoraConfig(targets="gate"))
