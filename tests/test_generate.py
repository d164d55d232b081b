"""Sampling: the cached sampler against the uncached reference and a plain loop, the
sliding rule past max_seq_len, top-k / top-p, options and prompt checks."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import FORWARD, one_line_error

from jaxformer import get_preset, init_params
from jaxformer.checkpoints import checkpoint
from jaxformer.cli.main import main
from jaxformer.data import CharTokenizer
from jaxformer.inference.generate import TIMING_KEYS, cache_config, generate, generate_many, sample_logits
from jaxformer.inference.text import sample_text
from jaxformer.training.optim import make_optimizer
from jaxformer.training.settings import TrainSettings
from jaxformer.training.step import init_state

CONFIG = get_preset("tiny", vocab_size=11)  # max_seq_len 16


@pytest.fixture(scope="module")
def params():
    return draw_params(CONFIG)


def draw_params(config):
    """Random params of init_params' layout drawn on the host (no compile): N(0, 1)
    weights, zero biases, unit norm scales, so greedy decoding varies its tokens."""
    shapes = jax.eval_shape(lambda: init_params(jax.random.PRNGKey(0), config))
    rng = np.random.default_rng(3)

    def draw(path, s):
        name = path[-1].key  # scale, bias, bq, b_in, b, wq, w_in, tok_embed, ...
        if name == "scale":
            return jnp.ones(s.shape, jnp.float32)
        if name.startswith("b"):
            return jnp.zeros(s.shape, jnp.float32)
        return jnp.asarray(rng.normal(0.0, 1.0, s.shape), jnp.float32)

    return jax.tree_util.tree_map_with_path(draw, shapes)


def _greedy_reference(params, prompt, n):
    """Token by token, the model on the last max_seq_len tokens."""
    ids = list(prompt)
    for _ in range(n):
        window = jnp.asarray(ids[-CONFIG.max_seq_len:], jnp.int32)[None]
        ids.append(int(jnp.argmax(FORWARD(params, window, CONFIG)[0, -1])))
    return ids


def test_greedy_matches_a_plain_loop_across_the_window_edge(params):
    prompt = np.array([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 1, 2, 3, 4], np.int32)
    n = 6  # runs past max_seq_len = 16, so the window slides
    out = generate(params, CONFIG, prompt, n, temperature=0.0, use_cache=False)
    assert out.dtype == np.int32 and out.shape == (len(prompt) + n,)
    assert list(out) == _greedy_reference(params, prompt, n)
    assert len(set(out[len(prompt):].tolist())) > 1


def test_long_prompt_keeps_the_whole_prompt(params):
    prompt = np.arange(40) % CONFIG.vocab_size  # longer than max_seq_len
    out = generate(params, CONFIG, prompt, 6, temperature=0.0, use_cache=False)
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
    (dict(temperature=-1.0), "temperature must be >= 0, got -1.0"),
    (dict(top_k=-2), "top_k must be a non-negative integer"),
    (dict(temperature=float("nan")), "temperature must be a finite number"),
    (dict(temperature=float("inf")), "temperature must be a finite number"),
    (dict(top_p=0.0), r"top_p must be in \(0, 1\], got 0.0"),
    (dict(top_p=1.5), r"top_p must be in \(0, 1\], got 1.5"),
    (dict(top_p=float("nan")), "top_p must be a finite number, got nan"),
    (dict(num_samples=0), "num_samples must be a positive integer"),
    (dict(max_new_tokens=-1), "max_new_tokens must be a non-negative integer"),
    (dict(prompt_ids=np.array([], np.int32)), "non-empty"),
    (dict(prompt_ids=np.array([1, 11])), r"prompt holds token id 11 at position 1, outside \[0, vocab_size=11\)"),
])
def test_bad_options(params, kwargs, message):
    args = dict(prompt_ids=np.array([1, 2]), max_new_tokens=3)
    args.update(kwargs)
    prompt, n = args.pop("prompt_ids"), args.pop("max_new_tokens")
    with pytest.raises(ValueError, match=message):
        generate_many(params, CONFIG, prompt, n, **args)


def test_sample_text_from_a_char_run(params, tmp_path, capsys):
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
    line = one_line_error(capsys, main(["generate", "--run", str(tmp_path), "--chat", "hi"]))
    assert line == ("error: --chat: this run's CharTokenizer has no chat template (a run over a model "
                    "from --init-from, or over chat data, has one); use --prompt")


def _greedy_sliding_reference(params, config, prompt, n):
    """The cache's documented rule, with the uncached model: the context is the last
    max_seq_len tokens; when a token would make it longer, it restarts as the last
    max_seq_len // 2 tokens. Each step pads the context to max_seq_len (one compile;
    causal, so the padding is unseen) and takes the argmax after its last token."""
    S = config.max_seq_len
    ids, context = list(prompt), list(prompt[-S:])
    for _ in range(n):
        window = jnp.asarray(context + [0] * (S - len(context)), jnp.int32)[None]
        token = int(jnp.argmax(FORWARD(params, window, config)[0, len(context) - 1]))
        ids.append(token)
        context.append(token)
        if len(context) > S:
            context = context[-(S // 2):]
    return ids


@pytest.mark.parametrize("prompt_len", [1, 5, 16])
def test_cached_greedy_equals_uncached_within_max_seq_len(params, prompt_len):
    prompt = (np.arange(prompt_len) * 7 + 3) % CONFIG.vocab_size
    n = max(CONFIG.max_seq_len - prompt_len, 1)
    cached = generate(params, CONFIG, prompt, n, temperature=0.0)
    plain = generate(params, CONFIG, prompt, n, temperature=0.0, use_cache=False)
    np.testing.assert_array_equal(cached, plain)
    assert n == 1 or len(set(cached[prompt_len:].tolist())) > 1


def test_cached_post_norm_sinusoidal_equals_uncached(params):
    config = CONFIG.replace(norm="post", positions="sinusoidal", activation="relu")
    p = {k: v for k, v in params.items() if k not in ("pos_embed", "ln_f")}
    prompt = np.array([2, 7, 1, 8], np.int32)
    cached = generate(p, config, prompt, 12, temperature=0.0)
    np.testing.assert_array_equal(cached, generate(p, config, prompt, 12, temperature=0.0,
                                                   use_cache=False))


@pytest.mark.parametrize("prompt_len", [3, 40])
def test_cached_window_slides_past_max_seq_len_by_the_documented_rule(params, prompt_len):
    prompt = (np.arange(prompt_len) * 5 + 1) % CONFIG.vocab_size
    n = 2 * CONFIG.max_seq_len + 3  # two refills
    out = generate(params, CONFIG, prompt, n, temperature=0.0)
    assert out.shape == (prompt_len + n,)
    assert list(out) == _greedy_sliding_reference(params, CONFIG, prompt, n)


def test_cached_sampling_seeded_top_p_and_samples(params):
    prompt = np.array([3, 1, 4], np.int32)
    kw = dict(temperature=1.0, seed=5)
    a = generate_many(params, CONFIG, prompt, 20, num_samples=3, **kw)
    assert a.shape == (3, 23) and a.dtype == np.int32
    np.testing.assert_array_equal(a, generate_many(params, CONFIG, prompt, 20, num_samples=3, **kw))
    assert len({tuple(row) for row in a}) == 3  # the samples differ
    np.testing.assert_array_equal(a[0], generate(params, CONFIG, prompt, 20, **kw))
    assert not np.array_equal(a[0], generate(params, CONFIG, prompt, 20, temperature=1.0, seed=6))
    np.testing.assert_array_equal(a, generate_many(params, CONFIG, prompt, 20, num_samples=3,
                                                   top_p=1.0, **kw))
    # a nucleus thinner than any token's probability keeps only the likeliest: greedy
    thin = generate(params, CONFIG, prompt, 20, top_p=1e-9, **kw)
    np.testing.assert_array_equal(thin, generate(params, CONFIG, prompt, 20, temperature=0.0))


def test_top_p():
    logits = jnp.log(jnp.array([0.05, 0.5, 0.15, 0.3]))
    def draws(top_p):
        return {int(sample_logits(jax.random.PRNGKey(i), logits, 1.0, 0, False, top_p))
                for i in range(60)}
    assert draws(0.5) == {1}  # 0.5 alone reaches 0.5
    assert draws(0.7) == {1, 3}  # 0.5 + 0.3 >= 0.7
    assert draws(0.9) == {1, 3, 2}
    assert draws(1.0) == {0, 1, 2, 3}


def test_cache_is_sized_to_prompt_and_output_and_timed():
    """max_seq_len 256: 5 + 20 tokens get a cache of 64 slots (learned positions read from
    the whole table), the same greedy tokens as the uncached reference over 256; past 256 the
    cache is the model's."""
    config = CONFIG.replace(max_seq_len=256)
    p = draw_params(config)
    prompt, timing, reference = np.array([1, 2, 3, 4, 5]), {}, {}
    out = generate_many(p, config, prompt, 20, temperature=0.0, timing=timing)
    np.testing.assert_array_equal(out, generate_many(p, config, prompt, 20, temperature=0.0,
                                                     use_cache=False, timing=reference))
    assert set(timing) == set(TIMING_KEYS) == set(reference)
    assert (timing["cache_len"], timing["prefill_tokens"], timing["decode_tokens"]) == (64, 5, 19)
    assert timing["compile_s"] > 0 and timing["prefill_s"] > 0 and timing["decode_s"] > 0
    assert timing["run_s"] == pytest.approx(timing["prefill_s"] + timing["decode_s"])
    assert timing["s_per_token"] == pytest.approx(timing["run_s"] / 20)
    assert (reference["cache_len"], reference["prefill_s"], reference["decode_tokens"]) == (None, None, 20)
    assert cache_config(config, 250).max_seq_len == 256 and cache_config(config, 65).max_seq_len == 128


def test_mesh_is_checked_before_anything_loads(tmp_path, capsys):
    """--mesh names the model's axes over devices there are; anything else is one line, before the
    run (here: none) is read."""
    line = one_line_error(capsys, main(["generate", "--run", str(tmp_path / "none"), "--prompt", "a",
                                        "--mesh", "data=2"]))
    assert line.startswith("error: --mesh: mesh 'data=2': sampling splits the model, not the batch")
    line = one_line_error(capsys, main(["generate", "--run", str(tmp_path / "none"), "--prompt", "a",
                                        "--mesh", "tensor=2"]))
    assert line == "error: --mesh: mesh 'tensor=2' needs 2 devices; 1 in use"
