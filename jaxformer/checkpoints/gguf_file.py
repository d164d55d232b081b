"""GGUF files (llama.cpp's single-file format) in: a Llama-architecture model's weights,
dequantized, as the params pytree and its ModelConfig, read with the ``gguf`` package
(llama.cpp's own reader; ``pip install 'jaxformer[gguf]'``).

    read_gguf(path, dtype) -> (params, ModelConfig)
    read_gguf_metadata(path) -> {key: value}     the key/value metadata, tensors aside

Every tensor type the package dequantizes is read (F32, F16, BF16, Q8_0, Q4_0, Q4_1, the
K-quants, ...): ``gguf.quants.dequantize`` gives float32, then ``dtype``. The names map to
Hugging Face Llama's (TENSORS below) and the metadata to its config.json keys (KEYS), so
hf_llama.py builds the ModelConfig and the params (its tables transpose GGUF's (out, in),
the same order as nn.Linear's, to our (in, out)).

llama.cpp's converter permutes the rows of attn_q and attn_k for its rotary layout (pairs
of adjacent features): per head of Dh rows, ``w.reshape(H, 2, Dh/2, in).swapaxes(1, 2)``,
H the query heads for q and the key/value heads for k. ``unpermute`` undoes it, giving the
rotate-half layout rotary.py computes.
"""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np

from jaxformer.checkpoints import hf_llama
from jaxformer.checkpoints.hf_files import HFFormatError
from jaxformer.model.config import ModelConfig

MAGIC = b"GGUF"
# GGUF tensor name -> Hugging Face Llama name ({l}: the block index)
TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": hf_llama.HEAD,
    "blk.{l}.attn_norm.weight": "model.layers.{l}.input_layernorm.weight",
    "blk.{l}.ffn_norm.weight": "model.layers.{l}.post_attention_layernorm.weight",
    "blk.{l}.attn_q.weight": "model.layers.{l}.self_attn.q_proj.weight",
    "blk.{l}.attn_k.weight": "model.layers.{l}.self_attn.k_proj.weight",
    "blk.{l}.attn_v.weight": "model.layers.{l}.self_attn.v_proj.weight",
    "blk.{l}.attn_output.weight": "model.layers.{l}.self_attn.o_proj.weight",
    "blk.{l}.ffn_gate.weight": "model.layers.{l}.mlp.gate_proj.weight",
    "blk.{l}.ffn_up.weight": "model.layers.{l}.mlp.up_proj.weight",
    "blk.{l}.ffn_down.weight": "model.layers.{l}.mlp.down_proj.weight",
}
SKIPPED = ("rope_freqs.weight",)  # llama3-style rotary scaling factors: refused by metadata first
# GGUF metadata key (after "llama.") -> config.json key; None: required
KEYS = {
    "embedding_length": ("hidden_size", None), "block_count": ("num_hidden_layers", None),
    "attention.head_count": ("num_attention_heads", None),
    "attention.head_count_kv": ("num_key_value_heads", 0),
    "feed_forward_length": ("intermediate_size", None),
    "context_length": ("max_position_embeddings", 2048),
    "rope.freq_base": ("rope_theta", 10000.0),
    "attention.layer_norm_rms_epsilon": ("rms_norm_eps", 1e-5),
}


@functools.cache
def _reader_class():
    """gguf.GGUFReader reading through a plain ndarray view of its np.memmap (the same bytes,
    still mapped): the reader slices the file once per metadata value, 100,000 times for a
    49,152-token vocabulary, and numpy's memmap subclass adds a Python call to each slice
    and each view (SmolLM2-135M's file: 2.1 s to parse, 0.7 s through the plain view)."""
    import gguf  # ImportError (not cached): _reader names the package to install

    class PlainReader(gguf.GGUFReader):
        @property
        def data(self):
            return self._plain

        @data.setter
        def data(self, memmap):  # GGUFReader.__init__: self.data = np.memmap(path, mode=mode)
            self._plain = memmap.view(np.ndarray)

    return PlainReader


def _reader(path):
    """A gguf.GGUFReader of ``path``; one line naming the file when it is not GGUF."""
    try:
        reader_class = _reader_class()
    except ImportError:
        raise HFFormatError(f"{path}: reading GGUF needs the gguf package "
                            f"(pip install 'jaxformer[gguf]')") from None
    path = Path(path)
    if not path.is_file():
        raise HFFormatError(f"{path}: no such GGUF file")
    with open(path, "rb") as f:
        if f.read(4) != MAGIC:
            raise HFFormatError(f"{path} is not a GGUF file (it does not start with {MAGIC!r})")
    try:
        return reader_class(str(path))
    except Exception as e:  # noqa: BLE001 - the package's own errors: one line, the cause named
        raise HFFormatError(f"{path} is not a readable GGUF file ({type(e).__name__}: "
                            f"{str(e).splitlines()[0] if str(e) else ''})") from None


def _metadata(reader) -> dict:
    out = {}
    for key, field in reader.fields.items():
        try:
            out[key] = field.contents()
        except Exception:  # noqa: BLE001 - a value the package cannot decode is not needed
            continue
    return out


def read_gguf_metadata(path) -> dict:
    """The GGUF file's key/value metadata {key: value} (tokens and merges as lists)."""
    return _metadata(_reader(path))


def hf_config_of(meta: dict, tied: bool, where) -> dict:
    """The Llama config.json a GGUF's metadata describes (``tied``: no output.weight)."""
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise HFFormatError(f"{where}: general.architecture {arch!r} is not supported (only 'llama')")
    if "llama.rope.scaling.type" in meta and meta["llama.rope.scaling.type"] not in ("none", ""):
        raise HFFormatError(f"{where}: llama.rope.scaling.type {meta['llama.rope.scaling.type']!r} "
                            f"is not supported (only plain rotary positions)")
    hf = {"model_type": "llama", "hidden_act": "silu", "tie_word_embeddings": tied}
    for key, (name, default) in KEYS.items():
        value = meta.get(f"llama.{key}", default)
        if value is None:
            raise HFFormatError(f"{where}: metadata llama.{key} is missing")
        hf[name] = value if isinstance(value, float) else int(value)
    vocab = meta.get("llama.vocab_size") or len(meta.get("tokenizer.ggml.tokens") or ())
    if not vocab:
        raise HFFormatError(f"{where}: neither llama.vocab_size nor tokenizer.ggml.tokens gives the vocabulary size")
    hf["vocab_size"] = int(vocab)
    return hf


def unpermute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's row permutation of attn_q / attn_k (out = n_heads * Dh rows):
    rows (h, i, pair) -> (h, pair, i), i < Dh/2."""
    rest = w.shape[1:]
    return w.reshape(n_heads, -1, 2, *rest).swapaxes(1, 2).reshape(w.shape)


def permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's permutation (convert_hf_to_gguf.py): the inverse of ``unpermute``."""
    rest = w.shape[1:]
    return w.reshape(n_heads, 2, -1, *rest).swapaxes(1, 2).reshape(w.shape)


def _dequantized(tensor, where) -> np.ndarray:
    """float32 (numpy order: (out, in) for a matrix) of one GGUF tensor."""
    import gguf
    kind = tensor.tensor_type
    try:
        if kind in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F64):
            return np.asarray(tensor.data, np.float32)
        return np.asarray(gguf.quants.dequantize(tensor.data, kind), np.float32)
    except NotImplementedError:
        raise HFFormatError(f"{where}: tensor {tensor.name!r} has type {kind.name}, which the gguf "
                            f"package cannot dequantize") from None


def _hf_name(name: str):
    parts = name.split(".")
    if parts[0] == "blk" and len(parts) > 2 and parts[1].isdigit():
        pattern = TENSORS.get(".".join(["blk", "{l}", *parts[2:]]))
        return None if pattern is None else pattern.format(l=int(parts[1]))
    return TENSORS.get(name)


def read_gguf(path, dtype=np.float32) -> tuple[dict, ModelConfig]:
    """(params in ``dtype``, ModelConfig) of the Llama GGUF file ``path``; one line naming
    the file and the key for anything this project cannot read."""
    reader = _reader(path)
    meta = _metadata(reader)
    names = {t.name for t in reader.tensors}
    hf = hf_config_of(meta, "output.weight" not in names, path)
    try:
        config = hf_llama.config_from_hf(hf)
    except HFFormatError as e:
        raise HFFormatError(f"{path}: {str(e).replace('config.json: ', '')}") from None
    tensors = {}
    for t in reader.tensors:
        if t.name in SKIPPED:
            continue
        name = _hf_name(t.name)
        if name is None:
            raise HFFormatError(f"{path}: tensor {t.name!r} is not one of a Llama's")
        w = _dequantized(t, path)
        if t.name.endswith("attn_q.weight"):
            w = unpermute(w, config.n_heads)
        elif t.name.endswith("attn_k.weight"):
            w = unpermute(w, config.kv_heads)
        tensors[name] = w
    return hf_llama.params_from_hf(tensors, config, dtype, str(path)), config
