"""What every Hugging Face model folder shares, whatever its architecture: config.json,
the weights (``model.safetensors``, a sharded ``model.safetensors.index.json`` or
``pytorch_model.bin``), a hub id to download, and the one error type.

    resolve_source(spec) -> Path               a local folder, or a hub id downloaded
    read_config_json(folder) -> dict           (a quantization_config refused by name)
    read_tensors(folder) -> {name: np.ndarray}
    with config_errors(): ...                  config.json's values read: what fails, one line

The architectures (hf_gpt2.py, hf_llama.py) map these to the params pytree; hf.py picks one
by config.json's ``model_type``.
"""

from __future__ import annotations

import json
import re
from contextlib import contextmanager
from pathlib import Path

import numpy as np

SAFETENSORS, TORCH_BIN, CONFIG_JSON = "model.safetensors", "pytorch_model.bin", "config.json"
SAFETENSORS_INDEX = "model.safetensors.index.json"  # {"weight_map": {tensor name: shard file}}


class HFFormatError(ValueError):
    """A folder that is not a model this project can read (the message names what)."""


def resolve_source(spec: str) -> Path:
    """A local folder ``spec``, a GGUF file (``.gguf``, read by gguf_file.py), or a Hugging
    Face hub id ("gpt2", "owner/name") downloaded with huggingface_hub (config.json, the
    weights, tokenizer.json, tokenizer_config.json). One clear error offline."""
    path = Path(spec)
    if path.exists():
        if not path.is_dir() and path.suffix.lower() != ".gguf":
            raise HFFormatError(f"{spec} is a file; --init-from takes a model folder, a .gguf file or a hub id")
        return path
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise HFFormatError(f"{spec} is not a folder; to download it from the Hugging Face hub "
                            f"install huggingface_hub (pip install 'jaxformer[hf]')") from None
    try:
        return Path(snapshot_download(spec, allow_patterns=[CONFIG_JSON, SAFETENSORS, "model-*.safetensors",
                                                            SAFETENSORS_INDEX, "tokenizer.json",
                                                            "tokenizer_config.json", "chat_template.jinja"]))
    except Exception as e:  # noqa: BLE001 - offline, unknown repo, ...: one line, the cause named
        raise HFFormatError(f"{spec} is not a folder and could not be downloaded from the Hugging "
                            f"Face hub ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from None


@contextmanager
def config_errors(unreadable: str = "", keys: dict | None = None):
    """Reading config.json's values (or building the ModelConfig of them) inside: a KeyError
    becomes the HFFormatError "config.json: 'key' is missing", a TypeError or ValueError
    "config.json: <unreadable> (<error>)" (without ``unreadable``: the error's own line); an
    HFFormatError passes unchanged. ``keys`` {ModelConfig field: config.json key}: a message
    names the file's key where ModelConfig's check names the field (file_keys)."""
    try:
        yield
    except HFFormatError:
        raise
    except KeyError as e:
        raise HFFormatError(f"config.json: {e.args[0]!r} is missing") from None
    except (TypeError, ValueError) as e:
        line = file_keys(str(e), keys or {})
        raise HFFormatError(f"config.json: {unreadable} ({line})" if unreadable else f"config.json: {line}") from None


def file_keys(message: str, keys: dict) -> str:
    """``message`` with each ModelConfig field it names ("ModelConfig.experts_per_token", or a
    bare snake_case field such as "n_experts") written as the config.json key ``keys`` maps it
    to; a field without a key there keeps its ModelConfig name."""
    return re.sub(r"\b(?:ModelConfig\.(\w+)|([a-z]+(?:_[a-z0-9]+)+))\b",
                  lambda m: keys.get(m.group(1) or m.group(2), m.group(0)), message)


def read_config_json(folder) -> dict:
    """config.json of ``folder`` as a dict; one line when there is none."""
    path = Path(folder) / CONFIG_JSON
    if not path.exists():
        raise HFFormatError(f"{folder} has no {CONFIG_JSON} (not a Hugging Face model folder)")
    try:
        hf = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise HFFormatError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(hf, dict):
        raise HFFormatError(f"{path} holds a JSON {type(hf).__name__}, not an object of settings")
    quant = hf.get("quantization_config")
    if quant:  # GPTQ, AWQ, FP8, bitsandbytes, ...: integer or 8-bit tensors with scales, not weights
        method = quant.get("quant_method", "unnamed") if isinstance(quant, dict) else "unnamed"
        raise HFFormatError(f"{path}: quantization_config quant_method {method!r}: quantized weights are not "
                            "read (float32, float16 or bfloat16 only); give the model's unquantized folder")
    return hf


def load_safetensors(path) -> dict[str, np.ndarray]:
    """{name: array} of one .safetensors file; bfloat16 tensors (numpy has no such dtype, and
    many Llama checkpoints are stored so) come back as float32, exactly. A dtype numpy has no
    type for (FP8, ...) is refused by name."""
    from safetensors import SafetensorError
    from safetensors.numpy import load_file
    with open(path, "rb") as f:
        header = _safetensors_header(path, f)
        for name, v in header.items():
            kind = v.get("dtype") if isinstance(v, dict) and name != "__metadata__" else "BF16"
            if kind not in DTYPES and kind != "BF16":  # FP8 (F8_E4M3, ...), F4, ...: quantized values
                raise HFFormatError(f"{path}: tensor {name!r} has dtype {kind}, which is not read "
                                    "(float32, float16 or bfloat16 weights only)")
        if not any(isinstance(v, dict) and v.get("dtype") == "BF16" for v in header.values()):
            try:
                return dict(load_file(str(path)))
            except SafetensorError as e:
                raise HFFormatError(f"{path} is not a readable safetensors file: {e}") from None
        start = f.tell()
        out = {}
        for name, v in header.items():
            if name == "__metadata__":
                continue
            try:
                begin, end = v["data_offsets"]
                f.seek(start + begin)
                raw = f.read(end - begin)
                if v["dtype"] == "BF16":  # the upper half of a float32
                    a = (np.frombuffer(raw, "<u2").astype(np.uint32) << 16).view(np.float32)
                else:
                    a = np.frombuffer(raw, DTYPES[v["dtype"]]).copy()
                out[name] = a.reshape(v["shape"])
            except (KeyError, TypeError, ValueError) as e:
                raise HFFormatError(f"{path}: tensor {name!r} cannot be read ({type(e).__name__}: "
                                    f"{e})") from None
        return out


def _safetensors_header(path, f) -> dict:
    """The JSON header of the safetensors file open as ``f`` (8 bytes of length, then
    the JSON); HFFormatError naming ``path`` when the file is not one."""
    size = Path(path).stat().st_size
    length = int.from_bytes(f.read(8), "little")
    if size < 8 or length > size - 8:
        raise HFFormatError(f"{path} is not a safetensors file (its header length {length:,} "
                            f"does not fit the file's {size:,} bytes)")
    try:
        header = json.loads(f.read(length))
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise HFFormatError(f"{path} is not a safetensors file (its header is not JSON)") from None
    if not isinstance(header, dict):
        raise HFFormatError(f"{path} is not a safetensors file (its header is not a JSON object)")
    return header


def _shards(path) -> list[str]:
    """The shard files a model.safetensors.index.json names in its ``weight_map``; one line
    naming the file (and the key) when it is not JSON or has no such map."""
    try:
        index = json.loads(Path(path).read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise HFFormatError(f"{path} is not valid JSON: {e}") from None
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise HFFormatError(f"{path}: weight_map (tensor name -> shard file) is missing or not an object")
    return sorted(set(weight_map.values()))


DTYPES = {"F64": "<f8", "F32": "<f4", "F16": "<f2", "I64": "<i8", "I32": "<i4", "I16": "<i2",
          "I8": "i1", "U8": "u1", "BOOL": "?"}


def read_tensors(folder) -> dict[str, np.ndarray]:
    """{name: array} of the folder's weights: model.safetensors, else the shards a
    model.safetensors.index.json names, else pytorch_model.bin (read with torch)."""
    folder = Path(folder)
    if (folder / SAFETENSORS).exists():
        return load_safetensors(folder / SAFETENSORS)
    if (folder / SAFETENSORS_INDEX).exists():
        shards = _shards(folder / SAFETENSORS_INDEX)
        tensors = {}
        for shard in shards:
            if not (folder / shard).exists():
                raise HFFormatError(f"{folder}: shard {shard!r} named in {SAFETENSORS_INDEX} is missing")
            tensors.update(load_safetensors(folder / shard))
        return tensors
    if (folder / TORCH_BIN).exists():
        try:
            import torch
        except ImportError:
            raise HFFormatError(f"{folder / TORCH_BIN} needs torch to read (pip install torch), "
                                f"or convert it to {SAFETENSORS}") from None
        try:
            state = torch.load(folder / TORCH_BIN, map_location="cpu", weights_only=True)
        except Exception as e:  # noqa: BLE001 - torch's unpickling, zip and EOF errors: one line, named
            raise HFFormatError(f"{folder / TORCH_BIN} cannot be read by torch.load ({type(e).__name__}: "
                                f"{str(e).splitlines()[0] if str(e) else ''})") from None
        if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
            raise HFFormatError(f"{folder / TORCH_BIN} does not hold a state dict of tensors")
        return {k: v.float().numpy() if v.dtype == torch.bfloat16 else v.numpy() for k, v in state.items()}
    raise HFFormatError(f"{folder} has neither {SAFETENSORS}, {SAFETENSORS_INDEX} nor {TORCH_BIN}")
