"""Sampling: the jitted window loop against a plain loop, options and prompt checks."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxformer import checkpoint, forward, get_preset, init_params
from jaxformer.data import CharTokenizer
from jaxformer.generate import generate, sample_logits, sample_text
from jaxformer.optim import make_optimizer
from jaxformer.train import TrainSettings, init_state

CONFIG = get_preset("tiny", vocab_size=11)  # max_seq_len 16


@pytest.fixture(scope="module")
def params():
    """Random params of init_params' layout drawn on the host (no compile): N(0, 1)
    weights, zero biases, unit norm scales, so greedy decoding varies its tokens."""
    shapes = jax.eval_shape(lambda: init_params(jax.random.PRNGKey(0), CONFIG))
    rng = np.random.default_rng(3)

    def draw(path, s):
        name = path[-1].key  # scale, bias, bq, b_in, b, wq, w_in, tok_embed, ...
        if name == "scale":
            return jnp.ones(s.shape, jnp.float32)
        if name.startswith("b"):
            return jnp.zeros(s.shape, jnp.float32)
        return jnp.asarray(rng.normal(0.0, 1.0, s.shape), jnp.float32)

    return jax.tree_util.tree_map_with_path(draw, shapes)


_forward = jax.jit(forward, static_argnums=2)


def _greedy_reference(params, prompt, n):
    """Token by token, the model on the last max_seq_len tokens."""
    ids = list(prompt)
    for _ in range(n):
        window = jnp.asarray(ids[-CONFIG.max_seq_len:], jnp.int32)[None]
        ids.append(int(jnp.argmax(_forward(params, window, CONFIG)[0, -1])))
    return ids


def test_greedy_matches_a_plain_loop_across_the_window_edge(params):
    prompt = np.array([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 1, 2, 3, 4], np.int32)
    n = 6  # runs past max_seq_len = 16, so the window slides
    out = generate(params, CONFIG, prompt, n, temperature=0.0)
    assert out.dtype == np.int32 and out.shape == (len(prompt) + n,)
    assert list(out) == _greedy_reference(params, prompt, n)
    assert len(set(out[len(prompt):].tolist())) > 1


def test_long_prompt_keeps_the_whole_prompt(params):
    prompt = np.arange(40) % CONFIG.vocab_size  # longer than max_seq_len
    out = generate(params, CONFIG, prompt, 6, temperature=0.0)
    np.testing.assert_array_equal(out[:40], prompt)
    assert list(out[40:]) == _greedy_reference(params, prompt, 6)[40:]


def test_sampling_is_seeded_and_in_range(params):
    prompt = np.array([3, 1, 4], np.int32)
    a = generate(params, CONFIG, prompt, 12, temperature=1.0, seed=1)
    b = generate(params, CONFIG, prompt, 12, temperature=1.0, seed=1)
    c = generate(params, CONFIG, prompt, 12, temperature=1.0, seed=2)
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)
    assert a.min() >= 0 and a.max() < CONFIG.vocab_size


def test_top_k():
    logits = jnp.array([0.0, 5.0, 4.0, -1.0, 4.5])
    draws = {int(sample_logits(jax.random.PRNGKey(i), logits, 1.0, 2, False)) for i in range(40)}
    assert draws == {1, 4}
    assert int(sample_logits(jax.random.PRNGKey(0), logits, 1.0, 1, False)) == 1
    assert int(sample_logits(None, logits, 1.0, 0, True)) == 1


@pytest.mark.parametrize("kwargs, message", [
    (dict(temperature=-1.0), "temperature must be a finite number >= 0"),
    (dict(top_k=-2), "top_k must be a non-negative integer"),
    (dict(max_new_tokens=-1), "max_new_tokens must be a non-negative integer"),
    (dict(prompt_ids=np.array([], np.int32)), "non-empty"),
    (dict(prompt_ids=np.array([1, 11])), r"prompt holds token id 11 at position 1, outside \[0, vocab_size=11\)"),
])
def test_bad_options(params, kwargs, message):
    args = dict(prompt_ids=np.array([1, 2]), max_new_tokens=3)
    args.update(kwargs)
    prompt, n = args.pop("prompt_ids"), args.pop("max_new_tokens")
    with pytest.raises(ValueError, match=message):
        generate(params, CONFIG, prompt, n, **args)


def test_sample_text_from_a_char_run(params, tmp_path):
    """A run folder with a char tokenizer: text in, text out; unknown characters refused."""
    tokenizer = CharTokenizer("abcdefghij ")
    assert tokenizer.vocab_size == CONFIG.vocab_size
    settings = TrainSettings(preset="tiny", tokenizer="char", seq_len=16)
    optimizer = make_optimizer(**settings.optimizer_kwargs())
    meta = {"config": CONFIG.to_dict(), "tokenizer": tokenizer.to_dict(),
            "settings": settings.to_dict(), "param_dtype": "float32"}
    checkpoint.save(tmp_path, init_state(params, optimizer), meta)
    text = sample_text(tmp_path, "abc ", 12, temperature=0.0)
    assert text.startswith("abc ") and len(text) == 16
    assert set(text) <= set(tokenizer.chars)
    ids = tokenizer.encode("abc ")
    assert text == tokenizer.decode(generate(params, CONFIG, ids, 12, temperature=0.0))
    with pytest.raises(ValueError, match="unknown character 'z'"):
        sample_text(tmp_path, "abz", 5)
    with pytest.raises(ValueError, match="the prompt is empty"):
        sample_text(tmp_path, "", 5)
