"""A LoRA run's frozen base held quantized (jaxformer/model/quantized.py): GGUF blocks kept as
stored (Q8_0, Q4_0, Q4_1: formats/gguf_file.py read_gguf(keep=True)) or int8 per output
column, dequantized inside each product. In float64 the dequantized values are exact, so the
kept run's loss and adapter gradients equal the run over the same weights as float to
rounding, and the hand-derived gradients equal jax.grad's on the quantized path."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxformer.formats.gguf_file import read_gguf
from jaxformer.formats.hf_files import HFFormatError
from jaxformer.model.lora import LoraConfig, init_adapters, merge
from jaxformer.model.quantized import (Quantized, dequantize, dequantize_params, held_as, quantize_base,
                                       quantize_int8)
from jaxformer.training.adapters import lora_grad_source
from test_gguf import TINY, tiny_hf_tensors, write_tiny

gguf = pytest.importorskip("gguf")
LORA = LoraConfig(rank=2, alpha=4.0, targets=("all",))


def _adapters(base):
    """Adapters on every projection, B drawn too (fresh B is zero: A's gradient would be)."""
    ads = init_adapters(jax.random.PRNGKey(3), base, LORA, jnp.float64)
    keys = iter(jax.random.split(jax.random.PRNGKey(4), 16))
    return jax.tree_util.tree_map_with_path(
        lambda p, a: 0.3 * jax.random.normal(next(keys), a.shape, a.dtype) if "'b'" in jax.tree_util.keystr(p)
        else a, ads)


def _batch():
    rng = np.random.default_rng(5)
    return {"inputs": jnp.asarray(rng.integers(0, TINY.vocab_size, (2, 12)), jnp.int32),
            "targets": jnp.asarray(rng.integers(0, TINY.vocab_size, (2, 12)), jnp.int32)}


GRADS = {kind: jax.jit(lora_grad_source(kind, TINY, LORA)) for kind in ("manual", "auto")}  # compiled once a tree


def _grads(kind, base, adapters, batch):
    return GRADS[kind](adapters, batch, None, base)


def _max_diff(a, b):
    return max(jax.tree_util.tree_leaves(jax.tree_util.tree_map(
        lambda x, y: float(jnp.max(jnp.abs(x - y))), a, b)))


@pytest.fixture(scope="module", autouse=True)
def x64():
    with jax.enable_x64(True):  # as the suite runs (conftest.py); restored after
        yield


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1", "int8"])
def test_lora_over_quantized_base_equals_float_base(tmp_path, qtype):
    """Kept blocks (or int8) against the same weights dequantized to float64: loss and adapter
    gradients to rounding, by hand and by jax.grad; by hand == jax.grad on the quantized path."""
    if qtype == "int8":
        floats, _ = read_gguf(write_tiny(tmp_path / "t.gguf", tiny_hf_tensors()), np.float64)
        base = quantize_base(floats)
    else:
        path = write_tiny(tmp_path / f"t-{qtype}.gguf", tiny_hf_tensors(), qtype)
        base, _ = read_gguf(path, np.float64, keep=True)
        np.testing.assert_array_equal(  # the kept blocks dequantize as the gguf package does
            np.asarray(dequantize_params(base)["blocks"]["ffn"]["w_down"]),
            np.asarray(read_gguf(path, np.float64)[0]["blocks"]["ffn"]["w_down"]))
    q = base["blocks"]["attn"]["wq"]
    assert isinstance(q, Quantized) and q.codes.dtype in (np.int8, np.uint8) and held_as(base) == qtype.lower()
    floats = dequantize_params(base)
    adapters, batch = _adapters(floats), _batch()
    loss_q, g_q = _grads("manual", base, adapters, batch)
    loss_qa, g_qa = _grads("auto", base, adapters, batch)
    loss_f, g_f = _grads("manual", floats, adapters, batch)
    assert abs(float(loss_q) - float(loss_qa)) <= 1e-12 and _max_diff(g_q, g_qa) <= 1e-10
    assert abs(float(loss_q) - float(loss_f)) <= 1e-12 and _max_diff(g_q, g_f) <= 1e-10
    assert jax.tree_util.tree_structure(g_q) == jax.tree_util.tree_structure(adapters)
    assert _max_diff(g_q, jax.tree_util.tree_map(jnp.zeros_like, g_q)) > 1e-3  # the gradients are not zero
    merged = merge(base, adapters, LORA)  # a merged model is float: the dequantized base + s A B
    assert _max_diff(merged, merge(floats, adapters, LORA)) == 0.0


def test_int8_is_absmax_per_output_column():
    w = np.random.default_rng(0).standard_normal((2, 64, 8))
    w[:, :, 3] = 0.0  # a zero column: scale 0, codes 0
    q = quantize_int8(w)
    assert q.codes.dtype == np.int8 and q.scales.shape == (2, 1, 8) and q.shape == w.shape
    np.testing.assert_allclose(q.scales[..., 0, :], np.abs(w).max(axis=-2) / 127)
    assert np.abs(dequantize(q) - w).max() <= q.scales.max() / 2 + 1e-15
    assert np.all(dequantize(q)[:, :, 3] == 0) and np.abs(q.codes).max() == 127


def test_unsupported_type_refused_by_tensor_and_type(tmp_path):
    """A projection in a type the base cannot keep (here Q5_0) is one line naming the tensor
    and the type; read as float it loads."""
    path = write_tiny(tmp_path / "q5.gguf", tiny_hf_tensors(), "Q5_0")
    with pytest.raises(HFFormatError, match=r"tensor 'blk\.0\.attn_q\.weight' has type Q5_0") as e:
        read_gguf(path, np.float32, keep=True)
    assert "\n" not in str(e.value)
    read_gguf(path, np.float32)


def test_train_keeps_the_gguf_blocks_and_resumes_them(tmp_path, capsys):
    """`train --init-from F.gguf --lora-rank R --base-quant keep` says what the base is held as,
    records base_quant, and a resume reads the same blocks (the base's digest matches)."""
    from jaxformer.checkpoints import checkpoint
    from jaxformer.cli.main import main
    from test_gguf import tiny_tokenizer_meta
    path = write_tiny(tmp_path / "t.gguf", tiny_hf_tensors(), "Q4_1", add_meta=tiny_tokenizer_meta)
    corpus = tmp_path / "c.txt"
    corpus.write_text("the cat sat on the mat. the dog ran to the park!\n" * 40)
    run = tmp_path / "run"
    common = ["--seq-len", "16", "--batch-size", "2", "--no-progress", "--dtype", "float64"]
    assert main(["train", "--init-from", str(path), "--corpus", str(corpus), "--out", str(run), "--steps", "2",
                 "--lora-rank", "2", "--base-quant", "keep", *common]) == 0
    assert "projections held as q4_1" in capsys.readouterr().err
    assert checkpoint.newest_meta(run)["settings"]["base_quant"] == "keep"
    assert main(["train", "--out", str(run), "--resume", "--steps", "3", "--no-progress"]) == 0
    assert checkpoint.newest_meta(run)["step"] == 3
