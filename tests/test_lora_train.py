"""LoRA runs (train with lora_rank > 0): both gradient sources give the same losses; the state,
the optimizer state and the checkpoints hold the adapters alone; a few manual-gradient steps
lower the held-out loss; a resumed run equals an uninterrupted one and refuses another frozen
model; the flags and the errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import one_line_error, tiny_settings

import jaxformer
from jaxformer.checkpoints.runs import load_state
from jaxformer.checkpoints.checkpoint import CheckpointError
from jaxformer.inference.text import sample_text
from jaxformer.model import lora
from jaxformer.training.adapters import frozen_base, model_params
from jaxformer.training.loop import train
from jaxformer.training.settings import TrainSettings
from jaxformer.training.step import state_template

pytestmark = pytest.mark.xdist_group("test_lora_train")  # one worker: its module fixture (runs) runs once

LORA = dict(lora_rank=4, lora_alpha=8.0, lora_targets="q,v,o,in", lora_dropout=0.1, steps=6,
            batch_size=4, seq_len=16, lr=0.02, eval_every=3, ckpt_every=3)


@pytest.fixture(scope="module")
def runs(corpus, tmp_path_factory):
    """The same LoRA run with manual and jax.grad gradients."""
    out = {}
    for grads in ("manual", "auto"):
        folder = tmp_path_factory.mktemp(grads)
        out[grads] = train(tiny_settings(corpus, grads=grads, **LORA), folder, progress=False), folder
    return out


def test_manual_and_autodiff_give_the_same_losses(runs):
    losses = {g: np.array([r["loss"] for r in res.records]) for g, (res, _) in runs.items()}
    np.testing.assert_allclose(losses["manual"], losses["auto"], rtol=1e-5)
    assert len(losses["manual"]) == 6


def test_a_few_manual_steps_lower_the_held_out_loss(runs):
    val = [r["val_loss"] for r in runs["manual"][0].records if "val_loss" in r]
    assert len(val) == 2 and val[1] < val[0] - 1e-3, val


def test_state_and_checkpoints_hold_the_adapters_alone(runs, corpus):
    res, folder = runs["manual"]
    shapes = {jax.tree_util.keystr(k): v.shape for k, v in jax.tree_util.tree_flatten_with_path(res.state.params)[0]}
    L, D, F, r = 2, 16, 24, 4
    assert shapes == {"['blocks']['attn']['wq']['a']": (L, D, r), "['blocks']['attn']['wq']['b']": (L, r, D),
                      "['blocks']['attn']['wv']['a']": (L, D, r), "['blocks']['attn']['wv']['b']": (L, r, D),
                      "['blocks']['attn']['wo']['a']": (L, D, r), "['blocks']['attn']['wo']['b']": (L, r, D),
                      "['blocks']['ffn']['w_in']['a']": (L, D, r), "['blocks']['ffn']['w_in']['b']": (L, r, F)}
    n_adapter = sum(int(np.prod(s)) for s in shapes.values())
    n_opt = sum(x.size for x in jax.tree_util.tree_leaves(res.state.opt_state) if getattr(x, "ndim", 0) >= 1)
    assert n_opt == 2 * n_adapter  # Adam's two moments, over the adapters only
    state, config, _, meta = load_state(folder, state_template, 6)
    assert jax.tree_util.tree_structure(state.params) == jax.tree_util.tree_structure(res.state.params)
    assert len(meta["settings"]["lora_base_digest"]) == 64
    full = jax.eval_shape(lambda: jaxformer.init_params(jax.random.PRNGKey(0), config))
    assert n_adapter < 0.2 * sum(x.size for x in jax.tree_util.tree_leaves(full))
    text = sample_text(folder, "the", 5, temperature=0.0)  # generate --run: adapters merged into the base
    assert text.startswith("the") and len(text) > 3
    settings = TrainSettings.from_dict(meta["settings"])
    attached = lora.attach(frozen_base(settings, config), state.params, settings.lora())
    ids = jnp.arange(10)[None] % config.vocab_size
    np.testing.assert_allclose(jaxformer.forward(model_params(state.params, config, meta), ids, config),
                               jaxformer.forward(attached, ids, config), rtol=1e-5, atol=1e-6)


def test_resume_equals_uninterrupted_and_refuses_another_base(runs, corpus, tmp_path):
    folder = tmp_path / "half"
    train(tiny_settings(corpus, grads="manual", **{**LORA, "steps": 3}), folder, progress=False)
    again = train(tiny_settings(corpus, grads="manual", **LORA), folder, resume=True, progress=False)
    whole = [r["loss"] for r in runs["manual"][0].records]
    np.testing.assert_allclose([r["loss"] for r in again.records], whole[3:], rtol=1e-6)
    other = jaxformer.init_params(jax.random.PRNGKey(9), again.config)
    with pytest.raises(CheckpointError, match="the frozen model .the seed init. is not the one the adapters"):
        train(tiny_settings(corpus, grads="manual", **{**LORA, "steps": 8}), folder, resume=True,
              progress=False, init_params=other)


def test_lora_flags_and_errors(corpus, tmp_path, capsys):
    from jaxformer.cli.main import main
    code = main(["train", "--preset", "tiny", "--corpus", str(corpus), "--lora-rank", "2",
                 "--lora-targets", "q,x", "--out", str(tmp_path / "bad")])
    assert "lora_targets must name projections" in one_line_error(capsys, code)
    code = main(["train", "--preset", "tiny", "--corpus", str(corpus), "--lora-rank", "2",
                 "--lora-targets", "gate", "--steps", "1", "--out", str(tmp_path / "plain"), "--no-progress"])
    assert "lora_targets gate name no projection of this model" in one_line_error(capsys, code)
    assert main(["train", "--help"]) == 0
    assert "--lora-rank R" in capsys.readouterr().out
