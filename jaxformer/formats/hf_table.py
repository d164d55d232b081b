"""A Hugging Face format as tables read in both directions: each tensor once as (HF name,
our leaves, shape, transform), each config.json key once as (HF key, ModelConfig field,
default, value maps). hf_gpt2.py and hf_llama.py declare their tables; these functions
read a state dict into our params, write params as a state dict, and the same for the
config.

A ``Tensor`` whose HF name holds ``{l}`` is one tensor per layer, stacked on our axis 0
(``blocks`` leaves); several of our leaves are concatenated along the HF tensor's last
axis (GPT-2's c_attn: [wq | wk | wv]); ``transpose`` swaps the last two axes (nn.Linear's
(out, in) against our ``x @ w``'s (in, out)).
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import numpy as np

from jaxformer.formats.hf_files import HFFormatError
from jaxformer.model.checks import check_int
from jaxformer.model.config import FIELD_RULES, ModelConfig, judge


def _always(config: ModelConfig) -> bool:
    return True


class Tensor(NamedTuple):
    hf: str  # the HF name; "{l}": one per layer
    ours: tuple[str, ...]  # our leaves' dotted paths ("blocks.attn.wq")
    shape: Callable[[ModelConfig], tuple]  # the shape of one HF tensor
    transpose: bool = False  # our leaf is the HF tensor's ^T (last two axes)
    when: Callable[[ModelConfig], bool] = _always  # whether the config has it


REQUIRED = object()  # a config.json key without a default


class Key(NamedTuple):
    hf: str  # the config.json key
    ours: str  # the ModelConfig field
    default: Any = REQUIRED  # the value when config.json has no such key
    to_ours: Callable = lambda v: v  # noqa: E731
    to_hf: Callable = lambda v: v  # noqa: E731


def _names(entry: Tensor, config: ModelConfig) -> list[str]:
    if "{l}" in entry.hf:
        return [entry.hf.format(l=l) for l in range(config.n_layers)]
    return [entry.hf]


def _set(tree: dict, path: str, value) -> None:
    *parents, leaf = path.split(".")
    for key in parents:
        tree = tree.setdefault(key, {})
    tree[leaf] = value


def _get(tree: dict, path: str):
    for key in path.split("."):
        tree = tree[key]
    return np.asarray(tree)


def float_weight(a, name: str, where: str):
    """``a``, the stored tensor ``name``, when it holds floating-point values; HFFormatError
    naming ``where``, the tensor and its dtype otherwise (an integer tensor is a quantized
    or foreign weight: converting it would read its integers as weights)."""
    kind = np.asarray(a).dtype
    if kind.kind != "f":
        raise HFFormatError(f"{where}: tensor {name!r} is stored as {kind}, not as floating-point weights "
                            "(quantized or integer tensors are not read)")
    return a


def params_in(table, raw: dict, config: ModelConfig, dtype, where: str) -> dict:
    """Our params pytree of ``config`` from the state dict ``raw`` {HF name: array}, in
    ``dtype``; HFFormatError (naming ``where``) for a tensor missing, misshapen, not of a
    floating-point dtype, or left over."""
    raw = dict(raw)

    def get(name, shape):
        if name not in raw:
            raise HFFormatError(f"{where}: tensor {name!r} is missing")
        a = np.asarray(float_weight(raw.pop(name), name, where), dtype)
        if a.shape != tuple(shape):
            raise HFFormatError(f"{where}: tensor {name!r} has shape {a.shape}, config.json needs {tuple(shape)}")
        return a

    params = {}
    for entry in table:
        if not entry.when(config):
            continue
        names = _names(entry, config)
        arrays = [get(name, entry.shape(config)) for name in names]
        a = np.stack(arrays) if "{l}" in entry.hf else arrays[0]
        if entry.transpose:
            a = np.ascontiguousarray(np.swapaxes(a, -1, -2))
        for path, part in zip(entry.ours, np.split(a, len(entry.ours), axis=-1)):
            _set(params, path, part if len(entry.ours) == 1 else np.ascontiguousarray(part))
    if raw:
        raise HFFormatError(f"{where}: unexpected tensor(s) {', '.join(sorted(raw)[:5])}")
    return params


def params_out(table, params: dict, config: ModelConfig) -> dict:
    """The state dict {HF name: float32 array} of ``params`` (the inverse of ``params_in``)."""
    out = {}
    for entry in table:
        if not entry.when(config):
            continue
        parts = [_get(params, path) for path in entry.ours]
        a = np.concatenate(parts, axis=-1) if len(parts) > 1 else parts[0]
        if entry.transpose:
            a = np.swapaxes(a, -1, -2)
        names = _names(entry, config)
        arrays = list(a) if "{l}" in entry.hf else [a]
        for name, array in zip(names, arrays):
            out[name] = np.ascontiguousarray(np.asarray(array, np.float32))
    return out


def fields_in(keys, hf: dict) -> dict:
    """{ModelConfig field: value} of the config.json dict ``hf``; KeyError for a required
    key it lacks; HFFormatError naming the key for a value its field's rule refuses (a
    string width, a null epsilon): judged as it is in config.json, or after ``to_ours``
    for a choice (an activation's name). A null where the default is None stays None."""
    fields = {}
    for key in keys:
        value = hf[key.hf] if key.default is REQUIRED else hf.get(key.hf, key.default)
        if value is None and key.default is None:
            fields[key.ours] = None
            continue
        rule = FIELD_RULES[key.ours]
        try:
            if rule.kind != "choice":
                judge(f"config.json: {key.hf}", value, rule._replace(note=""))
            fields[key.ours] = key.to_ours(value)
            if rule.kind == "choice":
                judge(f"config.json: {key.hf}", fields[key.ours], rule._replace(note=""))
        except (TypeError, ValueError, KeyError) as e:
            message = str(e) if isinstance(e, ValueError) else f"config.json: {key.hf} {value!r} cannot be read"
            raise HFFormatError(message) from None
    return fields


def read_flag(hf: dict, key: str, default: bool = False) -> bool:
    """config.json's true / false ``key`` (null or absent: ``default``); HFFormatError naming it otherwise."""
    value = hf.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise HFFormatError(f"config.json: {key} must be true or false, got {value!r}")
    return value


def read_count(key: str, value, minimum: int = 1) -> int:
    """config.json's ``key`` (its ``value``) as an int >= ``minimum``; HFFormatError naming it otherwise."""
    try:
        return check_int(f"config.json: {key}", value, minimum)
    except ValueError as e:
        raise HFFormatError(str(e)) from None


def keys_out(keys, config: ModelConfig) -> dict:
    """{config.json key: value} of ``config`` (the inverse of ``fields_in``)."""
    return {key.hf: key.to_hf(getattr(config, key.ours)) for key in keys}


def check_fixed(fixed: dict, config: ModelConfig, model: str) -> None:
    """ValueError naming the first ModelConfig field whose value differs from ``fixed``'s
    (the options the format ``model`` always has, which config.json does not record)."""
    for name, want in fixed.items():
        if getattr(config, name) != want:
            raise ValueError(f"a Hugging Face {model} needs ModelConfig.{name} = {want!r}, "
                             f"this model has {getattr(config, name)!r}")
