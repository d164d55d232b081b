"""The GPT-2 options (tie_embeddings, bias, head_bias, dropout) with every memory and
shape option, in float64: manual_grads.value_and_grad, jax.grad of the configured model
and jax.grad of the custom_vjp model agree to 1e-10 per leaf, dropout with the same key.
Every pair of one of these options' values with a value of another of them or of a memory
option (attention_impl, attention_block, loss_chunk, remat, norm, causal, positions) is in
test_modern_options' pairwise matrix; here are the pairs it does not hold, these options
with the activations it leaves out (gelu_tanh, relu, tanh): test_lean_model's rows of
those activations, each with a bit vector of the four options and its complement
(test_cases_cover_every_pair checks both parts). The params tree each option leaves out,
the bfloat16 rule with each option, and dropout's keys."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import LOSS, LEAN_CASES, LEAN_FIELDS, assert_bfloat16_within_autodiff, assert_sources_agree
from test_modern_options import FIELDS as MODERN_FIELDS

import jaxformer
from jaxformer.model.config import PRESETS, ModelConfig

NEW = {"tie_embeddings": (False, True), "bias": (True, False), "head_bias": (True, False),
       "dropout": (0.0, 0.2)}
# one 4-bit vector per lean row; with its complement, any two new fields take all four
# value pairs, and each new field takes both values beside every value of an old field
VECTORS = [(0, 0, 0, 0), (0, 1, 1, 0), (1, 0, 1, 0), (1, 1, 0, 0),
           (0, 0, 1, 1), (0, 1, 0, 1), (1, 0, 0, 1), (1, 1, 1, 1)]
KEY = jax.random.PRNGKey(7)


def new_row(bits):
    return {name: NEW[name][b] for name, b in zip(NEW, bits)}


CASES = []
for (config, B, T, mask), v in list(zip(LEAN_CASES, VECTORS))[::2]:
    if config.activation in MODERN_FIELDS["activation"]:
        continue  # gelu: test_modern_options' rows
    for bits in (v, tuple(1 - b for b in v)):
        CASES.append((config.replace(**new_row(bits)), B, T, mask))


def test_cases_cover_every_pair():
    fields = {**LEAN_FIELDS, **NEW}
    for name, values in fields.items():  # the matrix's pairs: these values are among its fields'
        if name != "activation":
            assert set(values) <= set(MODERN_FIELDS[name]), name
    configs = [c for c, *_ in CASES]
    left = [a for a in LEAN_FIELDS["activation"] if a not in MODERN_FIELDS["activation"]]
    assert left == ["gelu_tanh", "relu", "tanh"]
    for name in NEW:  # and the activations the matrix leaves out, here
        seen = {(c.activation, getattr(c, name)) for c in configs}
        assert seen == set(itertools.product(left, NEW[name])), name
    for a, b in itertools.combinations(NEW, 2):  # (also in the matrix)
        seen = {(getattr(c, a), getattr(c, b)) for c in configs}
        assert seen == set(itertools.product(NEW[a], NEW[b])), (a, b)


@pytest.mark.parametrize("case", range(len(CASES)), ids=[
    f"tie{int(c.tie_embeddings)}-bias{int(c.bias)}-hb{int(c.head_bias)}-drop{c.dropout}-"
    f"{c.attention_impl}-chunk{c.loss_chunk}-{c.remat}-{c.norm}" for c, *_ in CASES])
def test_options_manual_equals_autodiff_float64(case):
    config, B, T, mask = CASES[case]
    params, batch, loss_ref = assert_sources_agree(config, B, T, mask, KEY)
    if config.dropout:  # the key matters: a different key draws other masks
        other = LOSS(params, batch, config, key=jax.random.PRNGKey(8))
        assert float(other) != float(loss_ref)
        assert float(LOSS(params, batch, config)) != float(loss_ref)


def test_params_layout_of_each_option():
    tiny = PRESETS["tiny"]
    keys = lambda p: {jax.tree_util.keystr(k) for k, _ in  # noqa: E731
                      jax.tree_util.tree_flatten_with_path(p)[0]}
    shapes = lambda c: jax.eval_shape(lambda: jaxformer.init_params(jax.random.PRNGKey(0), c))  # noqa: E731
    full = keys(shapes(tiny))
    tied = keys(shapes(tiny.replace(tie_embeddings=True)))
    assert full - tied == {"['head']['w']"}
    nohb = keys(shapes(tiny.replace(head_bias=False)))
    assert full - nohb == {"['head']['b']"}
    both = shapes(tiny.replace(tie_embeddings=True, head_bias=False))
    assert "head" not in both
    nob = keys(shapes(tiny.replace(bias=False)))
    assert full - nob == {f"['blocks']['attn']['{b}']" for b in ("bq", "bk", "bv", "bo")} | {
        "['blocks']['ffn']['b_in']", "['blocks']['ffn']['b_out']", "['blocks']['ln1']['bias']",
        "['blocks']['ln2']['bias']", "['ln_f']['bias']"}
    # the other leaves are drawn as before: options do not move the seed's values
    a = jaxformer.init_params(jax.random.PRNGKey(0), tiny)
    b = jaxformer.init_params(jax.random.PRNGKey(0), tiny.replace(bias=False, tie_embeddings=True))
    np.testing.assert_array_equal(a["blocks"]["attn"]["wq"], b["blocks"]["attn"]["wq"])


def test_gpt2_preset_is_gpt2():
    c = PRESETS["gpt2"]
    assert (c.tie_embeddings, c.head_bias, c.bias, c.activation) == (True, False, True, "gelu_tanh")
    n = sum(x.size for x in jax.tree_util.tree_leaves(
        jax.eval_shape(lambda: jaxformer.init_params(jax.random.PRNGKey(0), c.replace(vocab_size=50257)))))
    assert n == 124_439_808  # GPT-2 small with its 50257-token vocabulary


def test_bad_option_values_are_named():
    for field, value in (("dropout", 1.0), ("dropout", -0.1), ("bias", 1), ("tie_embeddings", "yes")):
        with pytest.raises(ValueError, match=f"ModelConfig.{field}"):
            ModelConfig(**{field: value})
    with pytest.raises(ValueError, match="dropout.*pallas"):
        ModelConfig(dropout=0.1, attention_impl="pallas")


def test_dropout_key_none_is_no_dropout_and_rate_is_honoured():
    config = PRESETS["tiny"].replace(dropout=0.5)
    params = jaxformer.init_params(jax.random.PRNGKey(0), config)
    inputs = jnp.zeros((4, 16), jnp.int32)
    plain = jaxformer.forward(params, inputs, config.replace(dropout=0.0))
    np.testing.assert_array_equal(jaxformer.forward(params, inputs, config), plain)
    from jaxformer.model.dropout import keep_mask
    kept = float(jnp.mean(keep_mask(KEY, 0.5, (100_000,))))
    assert abs(kept - 0.5) < 0.01


@pytest.mark.parametrize("x64", [True, False])
def test_a_device_s_piece_of_a_mask_is_the_whole_mask_s_piece(x64):
    """dropout.PieceKey: a mask drawn on a piece of the rows, heads, tokens or features (as a
    device of a tensor axis draws it) is that piece of the whole array's mask, bit for bit, for the stream's
    (B, T, D) and the probabilities' (B, H, Tq, Tk); _mul_wide's 64-bit products are exact."""
    from jaxformer.model.dropout import Piece, PieceKey, _mul_wide, keep_mask
    with jax.enable_x64(x64):
        for key in (KEY, jax.random.key(3)):  # a raw uint32 key and a typed one
            whole = keep_mask(key, 0.4, (4, 6, 8, 8))
            piece = keep_mask(PieceKey(key, Piece(rows=(4, 2), heads=(6, 3))), 0.4, (2, 3, 8, 8))
            np.testing.assert_array_equal(piece, whole[2:4, 3:6])
            whole = keep_mask(key, 0.4, (4, 10, 5))
            piece = keep_mask(PieceKey(key, Piece(rows=(4, 1), heads=(6, 3), tokens=(10, 5))), 0.4, (1, 5, 5))
            np.testing.assert_array_equal(piece, whole[1:2, 5:10])
            # a context axis' tokens, their indices one by one (zig-zag), beside a block of the rows
            piece = keep_mask(PieceKey(key, Piece(rows=(4, 2), tokens=(10, jnp.array([0, 1, 8, 9])))), 0.4, (2, 4, 5))
            np.testing.assert_array_equal(piece, whole[2:4, [0, 1, 8, 9]])
            # a row-parallel LoRA adapter's input: its block of the features
            piece = keep_mask(PieceKey(key, Piece(rows=(4, 2), features=(5, 3))), 0.4, (2, 10, 2))
            np.testing.assert_array_equal(piece, whole[2:4, :, 3:5])
            assert 0.1 < float(jnp.mean(whole)) < 0.9
    a = np.random.default_rng(0).integers(0, 2**32, 64, dtype=np.uint64)
    for b in (3, 2**31 + 5, 2**40 + 12_345, 2**63 - 1):  # a whole array past 2^32 elements: n's high word
        high, low = _mul_wide(jnp.asarray(a.astype(np.uint32)), b)
        assert [(int(h) << 32) | int(w) for h, w in zip(np.asarray(high), np.asarray(low))] == \
            [int(x) * b % 2**64 for x in a]
    with pytest.raises(ValueError, match=r"masks \(B, T, D\) or \(B, H, Tq, Tk\) arrays, not \(3, 4\)"):
        keep_mask(PieceKey(KEY, Piece()), 0.4, (3, 4))


BASE16 = ModelConfig(vocab_size=32, d_model=16, n_heads=2, n_layers=2, d_ff=24, max_seq_len=12)


@pytest.mark.parametrize("option", [dict(tie_embeddings=True, head_bias=False), dict(bias=False, head_bias=False),
                                    dict(dropout=0.1),
                                    dict(dropout=0.1, attention_impl="blockwise", attention_block=4,
                                         loss_chunk=8, remat="block", tie_embeddings=True)])
def test_bfloat16_rule_holds_with_each_option(option):
    config = BASE16.replace(**option)
    rng = np.random.default_rng(0)
    ids = rng.integers(0, config.vocab_size, (2, 11))
    batch = {"inputs": jnp.asarray(ids[:, :-1], jnp.int32), "targets": jnp.asarray(ids[:, 1:], jnp.int32)}
    params = jaxformer.init_params(jax.random.PRNGKey(0), config, jnp.float32)
    assert_bfloat16_within_autodiff(params, batch, config, key=KEY if config.dropout else None)
