"""The modern block's options (RMS norm with and without a scale, rotary positions, the gated
MLP, SiLU and ReLU^2, grouped- and multi-query attention, QK-norm) against every older option
(the head bias and the embedding scale among them), in float64: manual_grads.value_and_grad,
jax.grad of the configured model and jax.grad of the custom_vjp model agree to 1e-10 per leaf
(dropout with one key), over a pairwise covering set that ``covering_rows`` builds greedily:
every pair of values of any two fields below appears in some model, except the pairs the
config refuses (dropout with the Pallas kernel, no norm scale with layer norm, rotary scaling
without rotary positions, a norm offset without RMS scales, QK-norm's scope without QK-norm,
rotary options by layer without rotary positions, a local rotary base without a sliding
layer); test_rows_cover_every_pair checks it. Then the params each option makes, the bfloat16
rule, the errors, what grouped-query attention means and what it saves in the key/value cache."""

import collections
import itertools
import random

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_bfloat16_within_autodiff, assert_sources_agree, make_batch, make_params

import jaxformer
from jaxformer.model.config import PRESETS, ModelConfig
from jaxformer.model.kv_cache import init_cache

MIXED = ("full_attention", "sliding_attention")
FIELDS = {
    # the modern block's
    "norm_type": ("layer", "rms"),
    "norm_scale": (True, False),
    "positions": ("learned", "sinusoidal", "rope"),
    "mlp": ("plain", "gated"),
    "activation": ("gelu", "silu", "relu2"),
    "n_kv_heads": (0, 2, 1),  # of 4 query heads: as many, groups of two, one (multi-query)
    "qk_norm": (False, True),
    "rope_scaling": ("none", "llama3", "yarn"),  # rotary scaling with BASE's rope_* numbers (linear,
    # every frequency divided alike: test_rope_scaling.py)
    "head_dim": (0, 6),  # 0: D / H = 4; 6: wider heads, wq (D, 24), wo (24, D)
    # None: as bias; True (with bias False, the one bias value that makes it differ): that layer's
    # biases alone, e.g. Qwen 2.5's q, k, v biases without bo or the MLP's
    "qkv_bias": (None, True),
    "out_bias": (None, True),
    "mlp_bias": (None, True),
    "attn_softcap": (0.0, 0.05),  # c tanh(s / c) on the scores (here about 0.04, up to 0.2: in the bend)
    "logit_softcap": (0.0, 0.3),  # and on the logits (here about 0.25, up to 0.7)
    "norm_offset": (0.0, 1.0),  # RMS scales as (1 + w) (Gemma)
    "qk_norm_scope": ("head", "projection"),  # QK-norm over all of q and of k (OLMo 2)
    "attn_scalar": (0.0, 10.0),  # scores / sqrt(10) rather than / sqrt(Dh) (Gemma's query_pre_attn_scalar)
    "sliding_window": (0, 3),  # each query reads its 3 newest keys (causal only)
    "layer_types": ((), ("full_attention", "sliding_attention")),  # (): every layer as sliding_window says
    "rope_local_theta": (0.0, 7.0),  # the sliding layers rotate with base 7, unscaled (Gemma 3's local base)
    "rope_layers": ((), (0, 1)),  # the first layer without rotary positions (SmolLM 3's NoPE layers)
    # the older ones
    "attention_impl": ("full", "blockwise", "pallas"),
    "loss_chunk": (0, 5),
    "remat": ("none", "block"),
    "norm": ("pre", "post", "output", "sandwich"),  # output: OLMo 2's; sandwich: Gemma 2 / 3's
    "causal": (True, False),
    "tie_embeddings": (False, True),
    "head_bias": (True, False),
    "embed_scale": (False, True),  # token rows times sqrt(D) (Gemma's)
    "bias": (True, False),
    "dropout": (0.0, 0.2),
    # mixture of experts (BASE's aux and z-loss coefficients make both losses count); top-k over
    # random weights has ties of measure zero, so the chosen experts are the same for every source
    "n_experts": (0, 4),
    "router": ("topk_softmax", "softmax_topk"),
    "shared_expert_d_ff": (0, 8),  # Qwen2-MoE's shared expert beside the routed ones
    "shared_expert_gate": (True, False),  # its sigmoid gate (False: the shared expert ungated)
    # blockwise attention's key/query blocks: 5 leaves T = 13 and 7 a ragged last block
    "attention_block": (4, 5),
}
REFUSED = {(("attention_impl", "pallas"), ("dropout", 0.2)), (("attention_impl", "pallas"), ("attn_softcap", 0.05)),
           (("norm_scale", False), ("norm_type", "layer")),
           (("norm_offset", 1.0), ("norm_type", "layer")), (("norm_offset", 1.0), ("norm_scale", False)),
           (("qk_norm", False), ("qk_norm_scope", "projection")),
           (("causal", False), ("sliding_window", 3)), (("causal", False), ("layer_types", MIXED)),
           (("layer_types", MIXED), ("sliding_window", 0)),
           # the experts are gated MLPs without biases (attention biases with mlp_bias False are
           # allowed, but a pair cannot say so: bias True is left to test_moe.py)
           (("mlp", "plain"), ("n_experts", 4)), (("bias", True), ("n_experts", 4)),
           (("mlp_bias", True), ("n_experts", 4)),
           # the shared expert needs the experts; ungated needs the shared expert
           *(_p for shared in (("shared_expert_d_ff", 8), ("shared_expert_gate", False))
             for _p in ((("n_experts", 0), shared), (("mlp", "plain"), shared), (("bias", True), shared),
                        (("mlp_bias", True), shared))),
           (("shared_expert_d_ff", 0), ("shared_expert_gate", False)),
           (("rope_local_theta", 7.0), ("sliding_window", 0)), (("causal", False), ("rope_local_theta", 7.0)),
           *((("positions", p), (name, v)) for p in ("learned", "sinusoidal")
             for name, v in (("rope_local_theta", 7.0), ("rope_layers", (0, 1)))),
           *((("positions", p), ("rope_scaling", s)) for p in ("learned", "sinusoidal")
             for s in ("llama3", "yarn"))}
# a bias field equal to bias is the config with None there (ModelConfig keeps one of them):
# the pair is the row with None, already covered
SAME_AS_NONE = {(("bias", True), (name, True)) for name in ("qkv_bias", "out_bias", "mlp_bias")}
EXCLUDED = REFUSED | SAME_AS_NONE  # one set: covering_rows asks of about a million pairs
BASE = ModelConfig(vocab_size=29, d_model=16, n_heads=4, n_layers=2, d_ff=24, max_seq_len=16,
                   attention_block=4, pallas_block_q=8, pallas_block_k=8,
                   rope_factor=3.0, rope_original_max_len=4, rope_beta_fast=8.0, rope_beta_slow=0.5,
                   moe_aux_loss_coef=0.1, router_z_loss_coef=0.01)
SHAPES = [(2, 13, "mostly_zero"), (2, 7, None), (3, 5, "bool")]
KEY = jax.random.PRNGKey(7)


# the values whose models compile longest (alone each adds 1-2.5 s to a 3 s program, together
# superlinearly: blockwise attention with dropout 9.5 s): of equal gains the fill takes a lighter
# value, and of candidate rows covering as many pairs the one with fewer of these
HEAVY = {("attention_impl", "blockwise"), ("attention_impl", "pallas"), ("dropout", 0.2), ("remat", "block"),
         ("n_experts", 4), ("layer_types", MIXED), ("rope_layers", (0, 1))}


def _pair(a, b):
    return (a, b) if a <= b else (b, a)  # sorted((a, b)), as a tuple


def allowed(a, b) -> bool:
    return _pair(a, b) not in EXCLUDED


def covering_rows(fields=None, wanted=lambda a, b: True, tries: int = 30, seed: int = 0):
    """Rows (field -> value) in which every allowed pair of two ``fields``' values appears
    (those of the field pairs ``wanted`` names; default FIELDS, every pair), built greedily:
    each row starts from a pair still missing of the two fields that miss the most, fills the
    other fields one by one (in a shuffled order) with the allowed value that covers the most
    missing pairs, and is the best of ``tries`` such candidates (seeded: the same rows every run)."""
    fields = FIELDS if fields is None else fields
    missing = {_pair((a, va), (b, vb)) for a, b in itertools.combinations(fields, 2) if wanted(a, b)
               for va in fields[a] for vb in fields[b] if allowed((a, va), (b, vb))}
    rng = random.Random(seed)
    rows = []
    while missing:
        count = collections.Counter((x[0], y[0]) for x, y in missing)
        pair = max(sorted(count), key=count.get)
        starts = sorted((p for p in missing if (p[0][0], p[1][0]) == pair), key=repr)
        candidates = [_fill(fields, dict(rng.choice(starts)), missing, rng) for _ in range(tries)]
        best = max((row for row in candidates if row),
                   key=lambda row: (_covers(row, missing), -sum(item in HEAVY for item in row.items())))
        missing -= {_pair(x, y) for x, y in itertools.combinations(best.items(), 2)}
        rows.append(best)
    return rows


def _covers(row, missing) -> int:
    return sum(_pair(x, y) in missing for x, y in itertools.combinations(row.items(), 2))


def _fill(fields, row, missing, rng):
    """``row`` completed field by field, or None where some field has no allowed value left."""
    names = [name for name in fields if name not in row]
    rng.shuffle(names)
    for name in names:
        options = [v for v in fields[name] if all(allowed((name, v), item) for item in row.items())]
        if not options:
            return None
        gain = {v: sum(_pair((name, v), item) in missing for item in row.items()) for v in options}
        best = [v for v in options if gain[v] == max(gain.values())]
        row[name] = rng.choice([v for v in best if (name, v) not in HEAVY] or best)
    return row


ROWS = covering_rows(seed=2)  # seed 2: 20 rows (seeds 0-11: 20-24), 46 heavy values (seed 1 before: 58)
CASES = [(BASE.replace(**row), *SHAPES[i % len(SHAPES)]) for i, row in enumerate(ROWS)]


def test_rows_cover_every_pair():
    assert len(ROWS) <= 20  # a covering set, not the product
    for a, b in itertools.combinations(FIELDS, 2):
        seen = {(row[a], row[b]) for row in ROWS}
        wanted = {(va, vb) for va in FIELDS[a] for vb in FIELDS[b] if allowed((a, va), (b, vb))}
        assert seen == wanted, (a, b)



def _case_id(config):
    return (f"{config.norm_type}{'' if config.norm_scale else '-noscale'}-{config.positions}-{config.mlp}-"
            f"{config.activation}-kv{config.kv_heads}{'-qkn' if config.qk_norm else ''}-"
            f"{config.attention_impl}{'' if config.attention_block == 4 else config.attention_block}-"
            f"chunk{config.loss_chunk}-{config.remat}-{config.norm}-"
            f"{'causal' if config.causal else 'bidir'}{'-tied' if config.tie_embeddings else ''}"
            f"{'' if config.head_bias else '-nohb'}{'-escale' if config.embed_scale else ''}"
            f"{'' if config.bias else '-nobias'}-drop{config.dropout}"
            f"{'' if config.rope_scaling == 'none' else '-' + config.rope_scaling}"
            f"{f'-w{config.sliding_window}' if config.sliding_window else ''}{'-mixed' if config.layer_types else ''}"
            f"{f'-moe{config.n_experts}-{config.router}' if config.n_experts else ''}"
            f"{f'-shared{config.shared_expert_d_ff}' if config.shared_expert_d_ff else ''}"
            f"{'' if config.shared_expert_gate else '-ungated'}"
            f"{'-localrope' if config.rope_local_theta else ''}{'-nope' if config.rope_layers else ''}")


@pytest.mark.parametrize("case", range(len(CASES)), ids=[_case_id(c) for c, *_ in CASES])
def test_modern_options_manual_equals_autodiff_float64(case):
    config, B, T, mask = CASES[case]
    params, batch, loss_ref = assert_sources_agree(config, B, T, mask, KEY)


# ---------------------------------------------------------------------------- the params


def _leaves(config):
    shapes = jax.eval_shape(lambda: jaxformer.init_params(jax.random.PRNGKey(0), config))
    return {jax.tree_util.keystr(k): v.shape for k, v in jax.tree_util.tree_flatten_with_path(shapes)[0]}


def test_params_of_each_modern_option():
    plain = _leaves(BASE)
    L, D, F, Dh = 2, 16, 24, 4
    rms = _leaves(BASE.replace(norm_type="rms"))
    assert set(plain) - set(rms) == {"['blocks']['ln1']['bias']", "['blocks']['ln2']['bias']", "['ln_f']['bias']"}
    noscale = _leaves(BASE.replace(norm_type="rms", norm_scale=False))
    assert not any("ln" in k for k in noscale)
    assert "['pos_embed']" in plain and "['pos_embed']" not in _leaves(BASE.replace(positions="rope"))
    gated = _leaves(BASE.replace(mlp="gated"))
    assert {k: v for k, v in gated.items() if "ffn" in k} == {
        "['blocks']['ffn']['w_gate']": (L, D, F), "['blocks']['ffn']['w_up']": (L, D, F),
        "['blocks']['ffn']['w_down']": (L, F, D), "['blocks']['ffn']['b_gate']": (L, F),
        "['blocks']['ffn']['b_up']": (L, F), "['blocks']['ffn']['b_down']": (L, D)}
    gqa = _leaves(BASE.replace(n_kv_heads=2))
    assert gqa["['blocks']['attn']['wk']"] == gqa["['blocks']['attn']['wv']"] == (L, D, 2 * Dh)
    assert gqa["['blocks']['attn']['bk']"] == (L, 2 * Dh) and gqa["['blocks']['attn']['wq']"] == (L, D, D)
    qkn = _leaves(BASE.replace(qk_norm=True))
    assert set(qkn) - set(plain) == {"['blocks']['attn']['q_norm']['scale']", "['blocks']['attn']['k_norm']['scale']"}
    assert qkn["['blocks']['attn']['q_norm']['scale']"] == (L, Dh)


def test_old_draws_do_not_move():
    """A modern option leaves the leaves it shares with the plain model drawn as before."""
    a = jaxformer.init_params(jax.random.PRNGKey(0), BASE)
    b = jaxformer.init_params(jax.random.PRNGKey(0), BASE.replace(mlp="gated", norm_type="rms", qk_norm=True))
    for path in (("blocks", "attn", "wq"), ("blocks", "attn", "wo"), ("tok_embed",), ("head", "w")):
        np.testing.assert_array_equal(_get(a, path), _get(b, path))
    np.testing.assert_array_equal(a["blocks"]["ffn"]["w_out"], b["blocks"]["ffn"]["w_down"])


def _get(tree, path):
    for key in path:
        tree = tree[key]
    return tree


def test_smollm_preset_has_smollm_135m_shape():
    c = PRESETS["smollm"]
    assert (c.d_model, c.n_heads, c.kv_heads, c.n_layers, c.d_ff, c.d_head) == (576, 9, 3, 30, 1536, 64)
    assert (c.norm_type, c.positions, c.mlp, c.activation, c.tie_embeddings, c.bias) == (
        "rms", "rope", "gated", "silu", True, False)
    shapes = jax.eval_shape(lambda: jaxformer.init_params(jax.random.PRNGKey(0), c.replace(vocab_size=49152)))
    assert sum(x.size for x in jax.tree_util.tree_leaves(shapes)) == 134_515_008  # SmolLM-135M


# ---------------------------------------------------------------------------- errors


@pytest.mark.parametrize("changes, match", [
    (dict(n_heads=4, n_kv_heads=3), r"n_kv_heads \(3\) must divide n_heads \(4\)"),
    (dict(n_heads=4, n_kv_heads=8), r"n_kv_heads \(8\) must divide n_heads \(4\)"),
    (dict(n_kv_heads=-1), "ModelConfig.n_kv_heads must be a non-negative integer"),
    (dict(norm_scale=False), "norm_scale False .* needs norm_type 'rms'"),
    (dict(norm_type="batch"), "ModelConfig.norm_type must be one of 'layer', 'rms', got 'batch'"),
    (dict(mlp="moe"), "ModelConfig.mlp must be one of 'plain', 'gated', got 'moe'"),
    (dict(rope_theta=0.5), "ModelConfig.rope_theta must be > 1, got 0.5"),
    (dict(d_model=12, n_heads=4, positions="rope"), "positions 'rope' needs an even head width"),
    (dict(qk_norm="yes"), "ModelConfig.qk_norm must be True or False"),
])
def test_bad_modern_values_are_named(changes, match):
    with pytest.raises(ValueError, match=match):
        BASE.replace(**changes)


# ---------------------------------------------------------------------------- meaning


def test_grouped_query_attention_is_attention_with_repeated_key_value_heads():
    """A GQA model equals the multi-head model whose wk, wv repeat each key/value head's
    columns for the query heads that share it (Hugging Face's repeat_kv)."""
    gqa = BASE.replace(n_kv_heads=2, positions="rope", qk_norm=True)
    params = make_params(gqa, jnp.float64)
    mha_params = jax.tree_util.tree_map(lambda x: x, params)
    for name in ("wk", "wv", "bk", "bv"):
        w = params["blocks"]["attn"][name]  # (L, D, Hkv Dh) or (L, Hkv Dh)
        heads = w.reshape(*w.shape[:-1], 2, 4)  # (..., Hkv, Dh)
        mha_params["blocks"]["attn"][name] = jnp.repeat(heads, 2, axis=-2).reshape(*w.shape[:-1], 16)
    inputs = make_batch(gqa, 2, 9, None)["inputs"]
    np.testing.assert_allclose(jaxformer.forward(params, inputs, gqa),
                               jaxformer.forward(mha_params, inputs, gqa.replace(n_kv_heads=0)),
                               rtol=1e-13, atol=1e-13)


def test_rope_model_depends_on_relative_positions_only():
    """With rotary positions and no other position term, a bidirectional model's output at a
    token does not change when the whole sequence is moved along by the key/value cache's
    offset: the attention scores see only t - s."""
    from jaxformer.model.kv_cache import forward_cached
    config = BASE.replace(positions="rope", causal=False, n_layers=1, max_seq_len=16)
    params = make_params(config, jnp.float64)
    inputs = make_batch(config, 1, 5, None)["inputs"]
    direct = jaxformer.forward(params, inputs, config.replace(causal=True))
    shifted, _ = forward_cached(params, inputs, init_cache(config, 1, jnp.float64), 0, config)
    np.testing.assert_allclose(shifted, direct, rtol=1e-12, atol=1e-12)


def test_cache_holds_key_value_heads_only():
    """The key/value cache keeps Hkv heads: multi-query attention keeps 1 / H of the keys."""
    smollm = PRESETS["smollm"]
    full = init_cache(smollm.replace(n_kv_heads=0, n_layers=1, max_seq_len=64), 1, jnp.float32)
    gqa = init_cache(smollm.replace(n_layers=1, max_seq_len=64), 1, jnp.float32)
    assert full["k"].shape == (1, 1, 9, 64, 64) and gqa["k"].shape == (1, 1, 3, 64, 64)
    assert full["k"].nbytes == 3 * gqa["k"].nbytes


@pytest.mark.parametrize("option", [
    dict(norm_type="rms", positions="rope", mlp="gated", activation="silu", n_kv_heads=1, qk_norm=True,
         bias=False, head_bias=False),
    dict(norm_type="rms", norm_scale=False, positions="rope", mlp="gated", activation="relu2", n_kv_heads=2,
         attention_impl="blockwise", attention_block=4, loss_chunk=8, remat="block", dropout=0.1),
])
def test_bfloat16_rule_holds_with_the_modern_block(option):
    config = BASE.replace(vocab_size=32, n_heads=4, max_seq_len=12, **option)
    rng = np.random.default_rng(0)
    ids = rng.integers(0, config.vocab_size, (2, 11))
    batch = {"inputs": jnp.asarray(ids[:, :-1], jnp.int32), "targets": jnp.asarray(ids[:, 1:], jnp.int32)}
    params = jaxformer.init_params(jax.random.PRNGKey(0), config, jnp.float32)
    assert_bfloat16_within_autodiff(params, batch, config, key=KEY if config.dropout else None)
