"""Any model shape from settings, flags or a TOML file; the gpt2 preset; a loop that
compiles its step once and names the first non-finite step it fetches."""

import jax
import jax.numpy as jnp
import pytest

from jaxformer.cli import main as cli
from jaxformer.cli import train as cli_train
from jaxformer.training import configfile
from jaxformer.model.config import PRESETS, SMALL_PRESETS, get_preset
from jaxformer.model.params import count_params, init_params
from jaxformer.training.settings import config_diff, settings_for
from jaxformer.observe.metrics import read_metrics
from jaxformer.training.loop import NonFiniteLossError, train
from jaxformer.training.step import grad_source
from helpers import tiny_settings


# ---------------------------------------------------------------- the gpt2 preset


def test_gpt2_preset_has_gpt2_small_shape():
    config = get_preset("gpt2", vocab_size=50257)
    assert (config.n_layers, config.d_model, config.n_heads, config.d_ff, config.max_seq_len) == \
        (12, 768, 12, 3072, 1024)
    assert (config.norm, config.activation, config.positions) == ("pre", "gelu_tanh", "learned")
    shapes = jax.eval_shape(lambda: init_params(jax.random.PRNGKey(0), config, dtype=jnp.float32))
    # GPT-2 small's published 124,439,808: the head is tied to tok_embed, with no bias
    assert config.tie_embeddings and not config.head_bias
    assert count_params(shapes) == 124_439_808
    assert "gpt2" in PRESETS and "gpt2" not in SMALL_PRESETS
    settings = settings_for("gpt2")
    assert (settings.optimizer, settings.lr, settings.schedule, settings.weight_decay, settings.clip_norm) \
        == ("adamw", 6e-4, "cosine", 0.1, 1.0)
    assert (settings.batch_size, settings.seq_len) == (8, 1024)
    settings.validate()


# ---------------------------------------------------------------- model overrides


def test_model_overrides_resolve_and_validate():
    settings = settings_for("tiny", model={"d_model": 32, "max_seq_len": 32}, seq_len=32)
    settings.validate()  # seq_len checked against the resolved max_seq_len
    config = settings.model_config(vocab_size=100)
    assert (config.d_model, config.max_seq_len, config.vocab_size, config.n_layers) == (32, 32, 100, 2)
    with pytest.raises(ValueError, match=r"exceeds the tiny model's max_seq_len 16"):
        settings_for("tiny", seq_len=32).validate()
    with pytest.raises(ValueError, match=r"ModelConfig.d_model \(16\) must be divisible by n_heads \(5\)"):
        settings_for("tiny", model={"n_heads": 5}).validate()
    with pytest.raises(ValueError, match="unknown ModelConfig field"):
        settings_for("tiny", model={"width": 5}).validate()


def test_old_checkpoint_config_fills_new_fields_from_defaults():
    config = get_preset("tiny", vocab_size=256)
    old = {k: v for k, v in config.to_dict().items()
           if k not in ("attention_impl", "attention_block", "loss_chunk", "remat", "compute_dtype")}
    assert config_diff(old, config) == []
    assert config_diff(old, config.replace(remat="block")) == \
        ["remat: 'none' (checkpoint) vs 'block' (requested)"]


def test_resume_compares_the_resolved_shape(corpus, tmp_path):
    settings = tiny_settings(corpus, steps=1, model={"d_ff": 40})
    train(settings, tmp_path, progress=False)
    with pytest.raises(ValueError, match=r"model config differs in d_ff: 40 \(checkpoint\) vs 24"):
        train(tiny_settings(corpus, steps=2), tmp_path, resume=True, progress=False)


# ---------------------------------------------------------------- TOML files


def _cli_settings(argv):
    return cli_train.train_settings(cli.build_parser().parse_args(["train", "--out", "unused", *argv]))


def test_config_file_round_trip_and_flags_override(tmp_path):
    settings = settings_for("tiny", model={"d_model": 32, "remat": "block", "causal": False},
                            lr=0.02, clip_norm=None, mesh="data=1", max_corpus_bytes=None)
    config = settings.model_config(vocab_size=256)
    path = tmp_path / "config.toml"
    configfile.write_config(path, settings, config)
    text = path.read_text()
    assert "compute_dtype" not in text and "causal = false" in text and 'mesh = "data=1"' in text
    again = _cli_settings(["--config", str(path)])
    assert again.model_config(vocab_size=256) == config
    assert again.replace(model={}) == settings.replace(model={})
    over = _cli_settings(["--config", str(path), "--lr", "0.5", "--n-layers", "3", "--compute-dtype", "bfloat16"])
    assert over.lr == 0.5 and over.model_config().n_layers == 3 and over.model["d_model"] == 32
    assert over.model_config().compute_dtype == "bfloat16"


@pytest.mark.parametrize("text, message", [
    ("[model]\nd_modle = 3\n", r"unknown key\(s\) in \[model\]: d_modle"),
    ("[model]\nvocab_size = 3\n", "vocab_size comes from the tokenizer"),
    ("[train]\nlearning_rate = 3\n", r"unknown key\(s\) in \[train\]: learning_rate"),
    ("[optim]\nlr = 3\n", "unknown table or key"),
    ("[model\n", "is not valid TOML"),
])
def test_bad_config_files(tmp_path, text, message):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(ValueError, match=message) as info:
        _cli_settings(["--config", str(path)])
    assert str(path) in str(info.value)


def test_cli_bad_shape_from_file_is_one_error_line(tmp_path, capsys):
    path = tmp_path / "shape.toml"
    path.write_text('[model]\nn_heads = 5\n[train]\npreset = "tiny"\n')
    assert cli.main(["train", "--config", str(path), "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == "error: ModelConfig.d_model (16) must be divisible by n_heads (5)"
    assert cli.main(["train", "--config", str(tmp_path / "missing.toml"), "--out", str(tmp_path)]) == 2
    assert "missing.toml does not exist" in capsys.readouterr().err
    assert cli.main(["train", "--preset", "tiny", "--n-heads", "5", "--out", str(tmp_path / "run")]) == 2
    assert capsys.readouterr().err.strip() == "error: ModelConfig.d_model (16) must be divisible by n_heads (5)"
    assert cli.main(["train", "--preset", "tiny", "--mesh", "data:2", "--out", str(tmp_path / "run")]) == 2
    assert "error: malformed mesh 'data:2'" in capsys.readouterr().err
    assert cli.main(["generate", "--run", str(tmp_path), "--prompt", "a", "--d-model", "8"]) == 2
    assert "--d-model cannot change it" in capsys.readouterr().err


# ---------------------------------------------------------------- the loop


def test_step_compiles_once_and_non_finite_step_is_exact(corpus, tmp_path):
    """Log, eval and checkpoint steps (which fetch) and plain steps (which don't) run
    one compiled step, also after a resume. A loss turning NaN between fetches is
    reported at the exact step where it first appeared."""
    traces = []
    auto = grad_source("auto", get_preset("tiny", vocab_size=256))

    def counted(params, batch, key=None):
        traces.append(1)  # runs only while jit traces the step
        return auto(params, batch, key)

    settings = tiny_settings(corpus, steps=4, log_every=3, eval_every=2, ckpt_every=3)
    train(settings, tmp_path / "run", progress=False, grad_fn=counted)
    train(settings.replace(steps=7), tmp_path / "run", resume=True, progress=False, grad_fn=counted)
    assert len(traces) == 1
    # every call logs its first step (its time is the compile) and its last
    assert [r["step"] for r in read_metrics(tmp_path / "run")] == [1, 2, 3, 4, 5, 6, 7]

    def nan_from_step_4(params, batch, key=None):  # sgd, lr 1, unit gradients: head bias is 1 - s before step s
        loss, grads = auto(params, batch)
        bias = params["head"]["b"][0]
        return jnp.where(bias < -2.5, jnp.nan, loss), jax.tree_util.tree_map(jnp.ones_like, grads)

    bad = tiny_settings(corpus, steps=9, log_every=8, eval_every=0, optimizer="sgd", lr=1.0)
    with pytest.raises(NonFiniteLossError, match="non-finite loss at step 4 "):
        train(bad, tmp_path / "nan", progress=False, grad_fn=nan_from_step_4)
    assert [r["step"] for r in read_metrics(tmp_path / "nan")] == [1]
