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

``read_gguf(path, dtype, keep=True)`` (a LoRA run's frozen base, ``--base-quant keep``) holds
the block projections (attn_q/k/v/output, ffn_gate/up/down) in their own blocks instead,
as jaxformer/model/quantized.py's ``Quantized`` (Q8_0, Q4_0, Q4_1: KEPT), turned to our
(in, out) layout and unpermuted the same way (the permutation moves whole rows, blocks and
scales with them); the other tensors are read as above. A projection stored as another
quantized type is refused by name (int8 or float read it).
"""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np

from jaxformer.formats import hf_llama, hf_table
from jaxformer.formats.hf_files import HFFormatError
from jaxformer.model.config import ModelConfig
from jaxformer.model.quantized import Quantized

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
    """A gguf.GGUFReader of ``path``; one line naming the file when it is not GGUF. The
    reader of the file as it is now (its inode, size and modification time) is parsed once
    a process (``_parsed``): a command reads the weights, the tokenizer and the chat
    template each through it (1.4 s a parse for SmolLM2-135M's 49,152-token vocabulary)."""
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
        stat = path.stat()
        return _parsed(reader_class, str(path.resolve()), (stat.st_ino, stat.st_size, stat.st_mtime_ns))
    except Exception as e:  # noqa: BLE001 - the package's own errors: one line, the cause named
        raise HFFormatError(f"{path} is not a readable GGUF file ({type(e).__name__}: "
                            f"{str(e).splitlines()[0] if str(e) else ''})") from None


@functools.lru_cache(maxsize=2)
def _parsed(reader_class, path: str, version: tuple):
    """``reader_class(path)``, once a ``version`` of the file (``_reader``)."""
    del version  # the cache's key alone
    return reader_class(path)


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


def read_gguf(path, dtype=np.float32, keep: bool = False) -> tuple[dict, ModelConfig]:
    """(params in ``dtype``, ModelConfig) of the Llama GGUF file ``path``; one line naming
    the file and the key for anything this project cannot read. ``keep``: the block
    projections as Quantized (their GGUF blocks), dequantizing to ``dtype``."""
    reader = _reader(path)
    meta = _metadata(reader)
    names = {t.name for t in reader.tensors}
    hf = hf_config_of(meta, "output.weight" not in names, path)
    try:
        config = hf_llama.config_from_hf(hf)
    except HFFormatError as e:
        raise HFFormatError(f"{path}: {str(e).replace('config.json: ', '')}") from None
    tensors, kept = {}, {}
    for t in reader.tensors:
        if t.name in SKIPPED:
            continue
        name = _hf_name(t.name)
        if name is None:
            raise HFFormatError(f"{path}: tensor {t.name!r} is not one of a Llama's")
        heads = {"attn_q": config.n_heads, "attn_k": config.kv_heads}.get(t.name.split(".")[-2])
        leaf = _kept_leaf(t.name) if keep else None
        if leaf is not None and t.tensor_type.name not in FLOAT_TYPES:
            kept.setdefault(leaf, []).append((t.name, _blocks(t, heads, path)))
            continue
        w = _dequantized(t, path)
        tensors[name] = w if heads is None else unpermute(w, heads)
    if not kept:
        return hf_llama.params_from_hf(tensors, config, dtype, str(path)), config
    return _with_kept(tensors, kept, config, dtype, path), config


# GGUF tensor type -> Quantized kind, for the types a base keeps in their blocks
KEPT = {"Q8_0": "q8_0", "Q4_0": "q4_0", "Q4_1": "q4_1"}
FLOAT_TYPES = ("F32", "F16", "BF16", "F64")
# a block projection's GGUF name (after blk.{l}.) -> our stacked leaf
KEPT_LEAVES = {"attn_q": ("attn", "wq"), "attn_k": ("attn", "wk"), "attn_v": ("attn", "wv"),
               "attn_output": ("attn", "wo"), "ffn_gate": ("ffn", "w_gate"), "ffn_up": ("ffn", "w_up"),
               "ffn_down": ("ffn", "w_down")}


def _kept_leaf(name: str):
    """(group, weight) of a block projection's GGUF name, else None."""
    parts = name.split(".")
    return KEPT_LEAVES.get(parts[2]) if len(parts) == 4 and parts[0] == "blk" else None


def _blocks(tensor, heads, where) -> Quantized:
    """One GGUF projection (out, in) in its blocks, as a Quantized (in, out) (float16 scales);
    ``heads``: attn_q / attn_k's rows unpermuted (``unpermute``) over that many heads."""
    kind = KEPT.get(tensor.tensor_type.name)
    if kind is None:
        raise HFFormatError(f"{where}: tensor {tensor.name!r} has type {tensor.tensor_type.name}, which a base "
                            f"kept in its blocks cannot hold (only {', '.join(KEPT)}; --base-quant int8 or "
                            f"float reads it)")
    n_in = int(tensor.shape[0])  # GGUF's ne[0]: the inputs, along which the blocks run
    size = {"q8_0": 34, "q4_0": 18, "q4_1": 20}[kind]  # bytes per block of 32
    blocks = np.asarray(tensor.data).view(np.uint8).reshape(-1, n_in // 32, size)  # (out, nb, bytes)
    d = np.ascontiguousarray(blocks[..., :2]).view(np.float16)[..., 0]  # (out, nb)
    m = np.ascontiguousarray(blocks[..., 2:4]).view(np.float16)[..., 0] if kind == "q4_1" else None
    qs = np.ascontiguousarray(blocks[..., 4 if kind == "q4_1" else 2:])  # (out, nb, 32 or 16)
    codes = (qs.view(np.int8) if kind == "q8_0" else qs).reshape(len(blocks), -1)  # (out, in or in / 2)
    if heads is not None:  # the same rows of codes, scales and mins
        codes, d, m = (None if a is None else unpermute(a, heads) for a in (codes, d, m))
    return Quantized(codes.T, d.T, None if m is None else m.T, kind)


def _with_kept(tensors, kept, config, dtype, where) -> dict:
    """params_from_hf's params of the float ``tensors``, with the ``kept`` projections
    {(group, weight): [(GGUF name, Quantized) per layer]} stacked over the layers."""
    leaves = {f"blocks.{g}.{w}" for g, w in kept}
    table = [e for e in hf_llama.TENSORS if e.ours[0] not in leaves]
    raw = {k: v for k, v in tensors.items() if not k.endswith(hf_llama.BUFFERS)}
    if config.tie_embeddings:
        raw.pop(hf_llama.HEAD, None)
    for (group, weight), layers in kept.items():
        if len(layers) != config.n_layers or len({q.kind for _, q in layers}) > 1:
            first = next((n for n, q in layers if q.kind != layers[0][1].kind), layers[0][0])
            raise HFFormatError(f"{where}: tensor {first!r}: the {config.n_layers} layers' {weight} are not all "
                                f"one of {', '.join(KEPT)} of one type, as a base kept in its blocks needs "
                                f"(--base-quant int8 or float reads them)")
    params = hf_table.params_in(table, raw, config, dtype, str(where))
    for (group, weight), layers in kept.items():
        qs = [q for _, q in layers]
        stacked = Quantized(*(None if qs[0].mins is None and f == "mins" else np.stack([getattr(q, f) for q in qs])
                              for f in ("codes", "scales", "mins")), qs[0].kind, np.dtype(dtype).name)
        params["blocks"].setdefault(group, {})[weight] = stacked
    return params
