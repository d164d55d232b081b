"""The sliding windows of Hugging Face's Llama-shaped families (hf_llama.py's FAMILIES), in and
out: ModelConfig.sliding_window and layer_types from config.json's keys, as transformers'
configuration classes read them, and back.

    Mistral   sliding_window (null: none) on every layer
    Qwen 2/3  sliding_window where use_sliding_window is true; layer_types as given, or
              "sliding_attention" from layer max_window_layers (default 28) on
"""

from __future__ import annotations

from jaxformer.formats.hf_files import HFFormatError
from jaxformer.formats.hf_table import read_count, read_flag
from jaxformer.model.checks import is_int
from jaxformer.model.config import LAYER_TYPES


def window_width(hf: dict):
    """config.json's sliding_window: None (null or absent), else a positive integer; one line otherwise."""
    window = hf.get("sliding_window")
    if window is not None and not (is_int(window) and window >= 1):
        raise HFFormatError(f"config.json: sliding_window must be a positive integer or null, got {window!r}")
    return window


def mistral_windows(hf: dict, n_layers: int) -> dict:
    """Mistral's: one sliding_window for every layer (null: none). MistralModel reads no
    layer_types (transformers warns and ignores them), so neither does this."""
    window = window_width(hf)
    return {} if window is None else {"sliding_window": int(window)}


def qwen_windows(hf: dict, n_layers: int) -> dict:
    """Qwen 2's and 3's, as their configuration classes: the window is sliding_window where
    use_sliding_window is true; layer_types as given, or sliding from layer max_window_layers
    (default 28) on; a sliding layer without a window attends to everything."""
    window = window_width(hf) if read_flag(hf, "use_sliding_window") else None
    types = hf.get("layer_types")
    if types is None:
        first = read_count("max_window_layers", hf.get("max_window_layers", 28), 0)
        types = ["sliding_attention" if window is not None and i >= first else "full_attention"
                 for i in range(n_layers)]
    if not (isinstance(types, list) and len(types) == n_layers and set(types) <= set(LAYER_TYPES)):
        raise HFFormatError(f"config.json: layer_types must list {n_layers} entries (num_hidden_layers), each "
                            f"{' or '.join(map(repr, LAYER_TYPES))}, got {types!r}")
    if window is None or "sliding_attention" not in types:
        return {}
    return {"sliding_window": int(window), "layer_types": tuple(types)}


def qwen_windows_out(c) -> dict:
    """Qwen's keys for c's window: use_sliding_window, sliding_window, max_window_layers (the first
    sliding layer), layer_types where there is a window."""
    if not c.sliding_window:
        return {"use_sliding_window": False, "sliding_window": None, "max_window_layers": c.n_layers}
    windowed = c.windowed_layers
    return {"use_sliding_window": True, "sliding_window": c.sliding_window, "max_window_layers": windowed.index(True),
            "layer_types": ["sliding_attention" if w else "full_attention" for w in windowed]}


def smollm3_layers(hf: dict, n_layers: int) -> dict:
    """SmolLM 3's, as its configuration class: rope_layers from no_rope_layers (1: rotary positions)
    as given, or 0 on every no_rope_layer_interval-th layer (default 4); the window sliding_window
    where use_sliding_window is true, on the layers layer_types names, or (without them) on the
    layers without rotary positions."""
    rope = hf.get("no_rope_layers")
    if rope is None:
        every = read_count("no_rope_layer_interval", hf.get("no_rope_layer_interval", 4))
        rope = [int((i + 1) % every != 0) for i in range(n_layers)]
    if not (isinstance(rope, list) and len(rope) == n_layers and all(r in (0, 1) for r in rope)):
        raise HFFormatError(f"config.json: no_rope_layers must list {n_layers} entries (num_hidden_layers), each "
                            f"0 or 1, got {rope!r}")
    window = window_width(hf) if read_flag(hf, "use_sliding_window") else None
    types = hf.get("layer_types")
    if types is None:
        types = ["sliding_attention" if window is not None and not r else "full_attention" for r in rope]
    if not (isinstance(types, list) and len(types) == n_layers and set(types) <= set(LAYER_TYPES)):
        raise HFFormatError(f"config.json: layer_types must list {n_layers} entries (num_hidden_layers), each "
                            f"{' or '.join(map(repr, LAYER_TYPES))}, got {types!r}")
    fields = {"rope_layers": tuple(int(r) for r in rope)}
    if window is not None and "sliding_attention" in types:
        fields.update(sliding_window=int(window), layer_types=tuple(types))
    return fields


def smollm3_out(c) -> dict:
    """SmolLM 3's keys for c's layers: no_rope_layers, and its window as use_sliding_window,
    sliding_window, layer_types."""
    kinds = {"layer_types": ["sliding_attention" if w else "full_attention" for w in c.windowed_layers]}
    if c.sliding_window:
        kinds.update(use_sliding_window=True, sliding_window=c.sliding_window)
    return {"no_rope_layers": [int(r) for r in c.roped_layers], "use_sliding_window": False, "sliding_window": None,
            **kinds, "pad_token_id": None}  # SmolLM3Config's default pad id 128004 lies outside a smaller vocabulary
