"""The `jaxformer` commands as a new user meets them: Hugging Face folders that are not
what they claim, output paths that are files, a float64 run exported, and the lines
that say where a figure comes from. Bad input is one `error:` line and exit code 2."""

import json
import re

import jax
import numpy as np
import pytest
from tqdm import tqdm

import jaxformer
from jaxformer.cli.args import run_command
from jaxformer.cli.main import main
from jaxformer.formats.hf import write_hf
from jaxformer.observe import flops
from helpers import one_line_error

# a GPT-2 small enough to build by hand: config.json of the folders below
GPT2_CONFIG = {"model_type": "gpt2", "vocab_size": 256, "n_embd": 16, "n_head": 2, "n_layer": 1,
               "n_positions": 16}


def _folder(root, name, config, weights: bytes | None = None):
    folder = root / name
    folder.mkdir()
    (folder / "config.json").write_text(config if isinstance(config, str) else json.dumps(config))
    if weights is not None:
        (folder / "model.safetensors").write_bytes(weights)
    return folder


@pytest.mark.parametrize("name, config, weights, message", [
    ("truncated", '{"model_type": ', None, "config.json is not valid JSON"),
    ("a-list", "[1, 2]", None, "config.json holds a JSON list, not an object"),
    ("gpt2-no-width", {"model_type": "gpt2", "vocab_size": 256}, None, "config.json: 'n_embd' is missing"),
    ("llama-no-width", {"model_type": "llama", "vocab_size": 256}, None,
     "config.json: 'hidden_size' is missing"),
    ("llama-no-heads", {"model_type": "llama", "vocab_size": 256, "hidden_size": 16,
                        "num_attention_heads": 0}, None, "num_attention_heads must be a positive integer"),
    ("garbage-weights", GPT2_CONFIG, b"garbage\n", "model.safetensors is not a safetensors file"),
    ("bad-header", GPT2_CONFIG, (7).to_bytes(8, "little") + b"not-js!", "its header is not JSON"),
])
def test_a_broken_hugging_face_folder_is_one_error_line(name, config, weights, message, tmp_path,
                                                        corpus, capsys):
    folder = _folder(tmp_path, name, config, weights)
    code = main(["train", "--init-from", str(folder), "--corpus", corpus, "--steps", "1",
                 "--out", str(tmp_path / "run"), "--no-progress"])
    line = one_line_error(capsys, code)
    assert message in line and name in line, line
    assert not (tmp_path / "run").exists()


def test_compare_grads_init_from_a_broken_folder_is_one_error_line(tmp_path, capsys):
    folder = _folder(tmp_path, "gpt2-no-width", {"model_type": "gpt2", "vocab_size": 256})
    code = main(["compare-grads", "--init-from", str(folder), "--out", str(tmp_path / "cg")])
    assert "config.json: 'n_embd' is missing" in one_line_error(capsys, code)


@pytest.mark.parametrize("argv", [
    ["train", "--preset", "tiny", "--corpus", "{corpus}", "--steps", "1", "--out", "{file}"],
    ["train", "--preset", "tiny", "--corpus", "{corpus}", "--steps", "1", "--out", "{file}/run"],
    ["export", "--run", "{tmp}/run", "--hf", "{file}"],
    ["compare-grads", "--preset", "tiny", "--out", "{file}"],
    ["bench", "--quick", "--out", "{file}"],
])
def test_an_output_folder_that_is_a_file_is_refused_before_any_work(argv, tmp_path, corpus, capsys,
                                                                    monkeypatch):
    """Caught before the step is compiled (train) or the benchmark runs, not at the first
    write: nothing that does work may be reached."""
    import jaxformer.cli.bench as cli_bench
    import jaxformer.cli.train as cli_train

    def no_work(*a, **k):
        raise AssertionError("reached the work before the output path was checked")

    monkeypatch.setattr(cli_train, "train", no_work)
    monkeypatch.setattr(cli_bench.bench, "run", no_work)
    file = tmp_path / "taken.txt"
    file.write_text("a file")
    argv = [a.format(corpus=corpus, file=file, tmp=tmp_path) for a in argv]
    line = one_line_error(capsys, main(argv))
    assert "a file, not a folder" in line and str(file) in line, line
    assert file.read_text() == "a file"


def _train_small_gpt2(out, corpus, *extra):
    """A one-step run of a GPT-2-shaped model small enough to compile in seconds."""
    assert main(["train", "--preset", "gpt2", "--n-layers", "1", "--d-model", "16", "--n-heads", "2",
                 "--d-ff", "32", "--max-seq-len", "16", "--batch-size", "2", "--seq-len", "8",
                 "--steps", "1", "--eval-batches", "1", "--corpus", corpus, "--out", str(out),
                 "--no-progress", *extra]) == 0


def test_export_of_a_float64_run(tmp_path, corpus, capsys):
    """A `--dtype float64` run exports from a fresh process (jax_enable_x64 off), as it
    samples and is diagnosed: the file holds its params in float32. A tokenizer.json an
    earlier export left in the folder is not this byte model's and goes."""
    from jaxformer.formats.hf import read_hf
    from jaxformer.checkpoints.runs import load_run
    from jaxformer.training.step import state_template

    run, hf = tmp_path / "run", tmp_path / "hf"
    _train_small_gpt2(run, corpus, "--dtype", "float64")
    params, _, _, _ = load_run(run, state_template)
    hf.mkdir()
    (hf / "tokenizer.json").write_text("{}")
    jax.config.update("jax_enable_x64", False)  # what a new `jaxformer export` process starts with
    try:
        capsys.readouterr()
        code = main(["export", "--run", str(run), "--hf", str(hf)])
        captured = capsys.readouterr()
        assert code == 0, captured.err
    finally:
        jax.config.update("jax_enable_x64", True)
    assert "wrote" in captured.out and "(gpt2: config.json, model.safetensors)" in captured.out
    assert sorted(p.name for p in hf.iterdir()) == ["config.json", "model.safetensors"]
    back, config = read_hf(hf, np.float64)
    assert config.n_layers == 1 and config.d_model == 16
    np.testing.assert_allclose(back["tok_embed"], np.asarray(params["tok_embed"]), rtol=1e-7)


def test_export_carries_a_subword_tokenizer(tmp_path, corpus, capsys):
    """A run trained with a tokenizer.json exports it beside the weights, so the folder
    is whole: `train --init-from` and `compare-grads --init-from` read text with it."""
    from jaxformer.formats.hf import read_hf
    from jaxformer.data.hf_tokenizers import HFTokenizer, train_bpe
    from jaxformer.tools.compare.grads import batch_tokenizer

    text = open(corpus, encoding="utf-8").read()
    tokenizer_file = tmp_path / "tokenizer.json"
    tokenizer_file.write_text(train_bpe([text], 300).to_dict()["json"], encoding="utf-8")
    run, hf = tmp_path / "run", tmp_path / "hf"
    _train_small_gpt2(run, corpus, "--tokenizer", str(tokenizer_file))
    capsys.readouterr()
    assert main(["export", "--run", str(run), "--hf", str(hf)]) == 0
    assert "(gpt2: config.json, model.safetensors, tokenizer.json)" in capsys.readouterr().out
    exported = HFTokenizer.from_file(hf / "tokenizer.json")
    assert exported == HFTokenizer.from_file(tokenizer_file)
    assert json.loads((hf / "config.json").read_text())["vocab_size"] == exported.vocab_size == 300
    _, config = read_hf(hf)
    assert batch_tokenizer(config, hf) == exported


def test_a_cpu_peak_not_cached_is_not_called_cached(tmp_path, monkeypatch):
    """On a busy machine the peak is measured for this process alone; the line naming it
    must not claim it was measured once and cached."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(flops, "cpu_matmul_flops", lambda n, reps=10: 8e9)
    monkeypatch.setattr(flops, "machine_is_busy", lambda: True)
    flops.measure_cpu_peak.cache_clear()
    try:
        peak, source = flops.device_peak(jax.devices("cpu")[0], cpu_matmul=64)
        assert peak == 8e9
        assert "not cached" in source and "measured once" not in source, source
        flops.measure_cpu_peak.cache_clear()  # a new process on an idle machine caches it
        monkeypatch.setattr(flops, "machine_is_busy", lambda: False)
        peak, source = flops.device_peak(jax.devices("cpu")[0], cpu_matmul=64)
        assert peak == 8e9 and "measured once" in source and "cached in" in source, source
    finally:
        flops.measure_cpu_peak.cache_clear()


def test_train_help_lines_up_every_preset_recipe(capsys):
    assert main(["train", "--help"]) == 0
    text = capsys.readouterr().out
    recipes = text.split("preset recipes")[1].splitlines()[1:]
    columns = {line.index("optimizer=") for line in recipes if "optimizer=" in line}
    assert len(columns) == 1 and len([r for r in recipes if "optimizer=" in r]) >= 7, recipes


def test_finite_differences_line_counts_its_directions(capsys, tmp_path):
    code = main(["compare-grads", "--preset", "tiny", "--n-layers", "1", "--batch-size", "1",
                 "--seq-len", "4", "--repeats", "1", "--fd", "--fd-directions", "1",
                 "--out", str(tmp_path / "cg")])
    out = capsys.readouterr().out
    assert code == 0, out
    assert re.search(r"eps [0-9.e-]+, 1 direction per leaf", out), out
    assert "1 random unit direction per leaf" in (tmp_path / "cg" / "report.md").read_text()


@pytest.mark.parametrize("name", ["docs.jsonl", "docs.parquet", "folder"])
def test_train_corpus_refuses_record_files_and_names_prepare(name, tmp_path, capsys):
    """JSONL and Parquet hold their text in a field: read as bytes they would train on the
    file's syntax, so --corpus refuses them (alone or inside a folder) and names prepare."""
    target = tmp_path / name
    if name == "folder":
        target.mkdir()
        (target / "a.txt").write_text("plain text\n")
        (target / "b.jsonl").write_text('{"text": "a record"}\n')
    else:
        target.write_bytes(b'{"text": "a record"}\n' if name.endswith(".jsonl") else b"PAR1....PAR1")
    code = main(["train", "--preset", "tiny", "--corpus", str(target), "--steps", "1",
                 "--out", str(tmp_path / "run"), "--no-progress"])
    line = one_line_error(capsys, code)
    kind = "a Parquet file" if name.endswith(".parquet") else "a JSONL file"
    assert f"is {kind}" in line and "jaxformer prepare --corpus" in line and "--data DIR" in line, line


def test_init_from_a_short_model_takes_its_max_seq_len(tmp_path, corpus, capsys):
    """The default recipe's seq_len (loopos: 64) longer than the imported model's
    max_seq_len (16) becomes that max_seq_len, said on stderr; a --seq-len longer is refused
    naming the folder."""
    config = jaxformer.get_preset("llama-tiny", qk_norm=False)
    folder, _ = write_hf(tmp_path / "llama", jaxformer.init_params(jax.random.PRNGKey(0), config), config)
    code = main(["train", "--init-from", str(folder), "--corpus", corpus, "--steps", "1",
                 "--out", str(tmp_path / "run"), "--no-progress"])
    err = capsys.readouterr().err
    assert code == 0, err
    assert f"seq_len {config.max_seq_len}: the max_seq_len of the model from --init-from {folder}" in err
    code = main(["train", "--init-from", str(folder), "--corpus", corpus, "--steps", "1", "--seq-len", "32",
                 "--out", str(tmp_path / "run2"), "--no-progress"])
    line = one_line_error(capsys, code)
    assert f"--seq-len 32 exceeds the max_seq_len 16 of the model from --init-from {folder}" in line


@pytest.mark.parametrize("flag, value, message", [
    ("--beta2", "1.5", "beta2 (--beta2) must be < 1, got 1.5"),
    ("--beta1", "-0.5", "beta1 (--beta1) must be >= 0"),
    ("--adam-eps", "0", "adam_eps (--adam-eps) must be > 0"),
    ("--weight-decay", "-1", "weight_decay (--weight-decay) must be >= 0"),
    ("--momentum", "1.5", "momentum (--momentum) must be <= 1.0"),
])
def test_an_optimizer_setting_out_of_range_is_named_as_given(flag, value, message, tmp_path, corpus,
                                                            capsys):
    code = main(["train", "--preset", "tiny", "--corpus", corpus, "--steps", "1", flag, value,
                 "--out", str(tmp_path / "run"), "--no-progress"])
    assert message in one_line_error(capsys, code)


def test_init_from_a_vocabulary_not_the_tokenizer_is_refused_before_compiling(tmp_path, corpus, capsys,
                                                                             monkeypatch):
    """A byte-vocabulary model (256 tokens) with a char tokenizer: refused once the tokenizer
    is built, before the step is compiled or any state made."""
    import jaxformer.training.loop as loop

    def no_compile(*a, **k):
        raise AssertionError("compiled the step before the vocabulary was checked")

    monkeypatch.setattr(loop, "check_run_memory", no_compile)
    monkeypatch.setattr(loop, "init_fn", no_compile)
    config = jaxformer.get_preset("llama-tiny", qk_norm=False)
    folder, _ = write_hf(tmp_path / "llama", jaxformer.init_params(jax.random.PRNGKey(0), config), config)
    code = main(["train", "--init-from", str(folder), "--tokenizer", "char", "--corpus", corpus,
                 "--steps", "1", "--out", str(tmp_path / "run"), "--no-progress"])
    line = one_line_error(capsys, code)
    assert "the initial model's vocabulary has 256 tokens, the tokenizer's" in line, line


def test_a_run_config_repeats_it_from_another_folder_and_resumes_it(tmp_path, corpus, capsys, monkeypatch):
    """config.toml holds the corpus as an absolute path (a built-in corpus by its name):
    `train --config` repeats the run from any folder, and resumes the run it came from,
    whose checkpoint holds the corpus as it was given."""
    import shutil

    from jaxformer.training.configfile import read_config

    work = tmp_path / "work"
    work.mkdir()
    shutil.copy(corpus, work / "corpus.txt")
    monkeypatch.chdir(work)
    small = ["--preset", "tiny", "--batch-size", "2", "--seq-len", "8", "--eval-batches", "1", "--no-progress"]
    assert main(["train", "--corpus", "corpus.txt", "--steps", "1", "--out", "runs/t4", *small]) == 0
    _, train = read_config(work / "runs" / "t4" / "config.toml")
    assert train["corpus"] == str(work / "corpus.txt") and train["tokenizer"] == "byte"
    # resumed from its own config.toml: the checkpoint's relative corpus is the same file
    capsys.readouterr()
    code = main(["train", "--config", "runs/t4/config.toml", "--steps", "2", "--out", "runs/t4", "--resume",
                 "--no-progress"])
    assert code == 0, capsys.readouterr().err
    monkeypatch.chdir(tmp_path)
    code = main(["train", "--config", "work/runs/t4/config.toml", "--steps", "2", "--out", "work/runs/t4c",
                 "--no-progress"])
    assert code == 0, capsys.readouterr().err
    assert main(["train", "--corpus", "default", "--steps", "1", "--out", "builtin", *small,
                 "--max-corpus-bytes", "20000"]) == 0
    assert read_config(tmp_path / "builtin" / "config.toml")[1]["corpus"] == "default"


def test_an_error_during_a_progress_bar_starts_its_own_line(capsys):
    """A bar is drawn without a newline; the error (here a ValueError, as Ctrl-C's
    "interrupted" in test_stopping.py) closes it first, so the error line stands alone."""
    def work():
        bar = tqdm(total=10, desc="tokenizing")
        bar.update(3)
        raise ValueError("the corpus ran out")

    assert run_command(work) == 2
    err = capsys.readouterr().err
    assert err.splitlines()[-1] == "error: the corpus ran out", err
    assert "tokenizing" in err
