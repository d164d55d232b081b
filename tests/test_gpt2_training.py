"""Training with the GPT-2 options: the optimizer flags (betas, eps, min-lr floor,
decay rule), nanoGPT's shakespeare_char recipe as a TOML file, and a bit-exact resume
of a run with dropout (its key stream lives in TrainState.rng)."""

import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import tiny_settings

from jaxformer.observe.metrics import read_metrics
from jaxformer.training.configfile import settings_from_file
from jaxformer.training.loop import train
from jaxformer.training.optim import decay_mask, make_optimizer, make_schedule

ROOT = Path(__file__).resolve().parents[1]


def test_min_lr_is_the_floor_of_the_decay():
    opt = make_optimizer("adamw", lr=1e-3, min_lr=1e-4, schedule="cosine", warmup_steps=2,
                         total_steps=10)
    assert opt is not None
    lr = make_schedule(1e-3, "cosine", 2, 10, final_lr_fraction=0.1)
    assert float(lr(10)) == pytest.approx(1e-4)
    with pytest.raises(ValueError, match="min_lr"):
        make_optimizer("adamw", lr=1e-3, min_lr=2e-3, schedule="cosine", total_steps=10)


def test_betas_and_eps_reach_adam():
    params = {"w": jnp.ones(3)}
    grads = {"w": jnp.array([1.0, -2.0, 0.5])}
    for b1, b2, eps in ((0.9, 0.95, 1e-8), (0.8, 0.99, 1e-6)):
        ours = make_optimizer("adam", lr=1.0, b1=b1, b2=b2, eps=eps)
        ref = optax.adam(1.0, b1=b1, b2=b2, eps=eps)
        s1, s2 = ours.init(params), ref.init(params)
        for _ in range(3):
            u1, s1 = ours.update(grads, s1, params)
            u2, s2 = ref.update(grads, s2, params)
            np.testing.assert_allclose(u1["w"], u2["w"], rtol=1e-6)
    with pytest.raises(ValueError, match="beta"):
        make_optimizer("adam", b2=1.0)


def test_decay_rules():
    params = {"tok_embed": jnp.ones((4, 2)), "blocks": {"attn": {"wq": jnp.ones((2, 2)),
              "bq": jnp.ones(2)}, "ln1": {"scale": jnp.ones(2)}}}
    flat = lambda m: {jax.tree_util.keystr(k): v for k, v in  # noqa: E731
                      jax.tree_util.tree_flatten_with_path(m)[0]}
    nano = flat(decay_mask(params))
    assert nano == {"['blocks']['attn']['bq']": False, "['blocks']['attn']['wq']": True,
                    "['blocks']['ln1']['scale']": False, "['tok_embed']": True}
    assert flat(decay_mask(params, "no-embed"))["['tok_embed']"] is False
    assert all(flat(decay_mask(params, "all")).values())
    with pytest.raises(ValueError, match="decay_rule"):
        make_optimizer("adamw", weight_decay=0.1, decay_rule="biases")


def test_shakespeare_char_recipe_loads():
    settings = settings_from_file(ROOT / "configs" / "shakespeare_char.toml")
    config = settings.model_config(vocab_size=65)
    assert (config.n_layers, config.n_heads, config.d_model, config.max_seq_len) == (4, 4, 128, 64)
    assert (config.tie_embeddings, config.bias, config.head_bias, config.dropout) == (True, False, False, 0.0)
    assert (settings.beta2, settings.lr, settings.min_lr, settings.steps) == (0.99, 1e-3, 1e-4, 2000)
    assert (settings.batch_size, settings.seq_len, settings.weight_decay) == (12, 64, 0.1)


def test_shakespeare_char_recipe_trains_from_the_command_line(corpus, tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    out = tmp_path / "run"
    result = subprocess.run(
        [sys.executable, "-m", "jaxformer", "train", "--config", str(ROOT / "configs" / "shakespeare_char.toml"),
         "--steps", "2", "--warmup-steps", "0", "--corpus", corpus, "--out", str(out), "--no-progress"],
        capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    text = (out / "config.toml").read_text()
    assert "tie_embeddings = true" in text and "beta2 = 0.99" in text and "min_lr = 0.0001" in text


@pytest.mark.parametrize("grads", ["auto", "manual"])
def test_resume_with_dropout_is_bit_exact(corpus, tmp_path, grads):
    model = {"dropout": 0.2}
    straight = train(tiny_settings(corpus, steps=6, grads=grads, model=model), tmp_path / "a",
                     progress=False)
    train(tiny_settings(corpus, steps=3, grads=grads, model=model), tmp_path / "b", progress=False)
    resumed = train(tiny_settings(corpus, steps=6, grads=grads, model=model), tmp_path / "b",
                    resume=True, progress=False)
    for a, b in zip(jax.tree_util.tree_leaves(straight.state.params), jax.tree_util.tree_leaves(resumed.state.params)):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(straight.state.rng, resumed.state.rng)
    losses = lambda d: [r["loss"] for r in read_metrics(d) if "loss" in r and r["step"] > 3]  # noqa: E731
    assert losses(tmp_path / "a") == losses(tmp_path / "b")
    # dropout really drew: the rng moved, unlike a run without dropout
    assert not np.array_equal(straight.state.rng, jax.random.PRNGKey(0))
