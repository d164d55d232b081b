"""Run settings as a TOML file: ``[model]`` (ModelConfig fields) and ``[train]``
(TrainSettings fields).

``read_config(path)`` returns the two tables, checked against the field names;
``write_config(path, settings, config)`` writes a run's fully resolved settings
(every run folder gets one, ``config.toml``), which ``jaxformer train --config``
reads back. Fields that are None are left out (for clipping, 0 stands for off),
vocab_size is a comment: it always comes from the tokenizer, and the corpus, data
and tokenizer files are written as absolute paths (``absolute_paths``), so the file
repeats the run from any folder.
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

from jaxformer.data.corpora import CORPUS_NAMES
from jaxformer.data.sources import HF_PREFIX
from jaxformer.data.tokenizers import TOKENIZER_KINDS
from jaxformer.model.config import ModelConfig
from jaxformer.training.fields import declared
from jaxformer.training.settings import TrainSettings, settings_for

CONFIG_FILE = "config.toml"
TABLES = ("model", "train")
# settings whose None means off (fields.setting's unset "off"): written, and given, as 0
OFF_IS_ZERO = tuple(f.name for f in declared(TrainSettings) if f.metadata["unset"] == "off")


def _train_fields() -> set[str]:
    """The [train] keys: TrainSettings' fields but ``model`` (the [model] table)."""
    return {f.name for f in dataclasses.fields(TrainSettings)} - {"model"}


def _model_fields() -> set[str]:
    return {f.name for f in dataclasses.fields(ModelConfig)} - {"vocab_size"}


def read_config(path) -> tuple[dict, dict]:
    """(model fields, train fields) of the TOML file ``path``; a ValueError names the
    file and any unknown table or key."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            doc = tomllib.load(f)
    except FileNotFoundError:
        raise ValueError(f"config file {path} does not exist") from None
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"config file {path} is not valid TOML: {e}") from None
    unknown = sorted(set(doc) - set(TABLES))
    if unknown:
        raise ValueError(f"config file {path}: unknown table or key(s) {', '.join(unknown)}; "
                         f"expected the tables [model] and [train]")
    for table, names in (("model", _model_fields()), ("train", _train_fields())):
        values = doc.get(table, {})
        if not isinstance(values, dict):
            raise ValueError(f"config file {path}: {table} must be a table ([{table}])")
        bad = sorted(set(values) - names)
        if bad:
            hint = " (vocab_size comes from the tokenizer)" if "vocab_size" in bad else ""
            raise ValueError(f"config file {path}: unknown key(s) in [{table}]: {', '.join(bad)}{hint}")
    return dict(doc.get("model", {})), dict(doc.get("train", {}))


def _value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
        return repr(value)
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, (tuple, list)):  # an array (ModelConfig.layer_types)
        return "[" + ", ".join(_value(v) for v in value) + "]"
    raise TypeError(f"cannot write {value!r} to TOML")


def _table(name: str, values: dict) -> list[str]:
    return [f"[{name}]"] + [f"{k} = {_value(v)}" for k, v in values.items() if v is not None] + [""]


PATH_FIELDS = ("corpus", "data", "tokenizer")  # settings that may name a file or folder


def _is_path(name: str, value) -> bool:
    """Whether the setting ``name``'s ``value`` names a file or folder (not a built-in
    corpus, a hf: dataset or a tokenizer kind)."""
    if not isinstance(value, str) or not value:
        return False
    if name == "corpus":
        return value not in CORPUS_NAMES and not value.startswith(HF_PREFIX)
    if name == "tokenizer":
        return value not in TOKENIZER_KINDS
    return True


def absolute_paths(train: dict) -> dict:
    """``train`` (TrainSettings fields) with the corpus, data and tokenizer paths made
    absolute, relative to the current folder; built-in names stay as they are."""
    return {k: os.path.abspath(v) if k in PATH_FIELDS and _is_path(k, v) else v for k, v in train.items()}


def same_path(name: str, a, b) -> bool:
    """Whether two values of the setting ``name`` name the same file or folder (one
    absolute, one relative to the current folder), or are equal."""
    if a == b:
        return True
    return _is_path(name, a) and _is_path(name, b) and os.path.abspath(a) == os.path.abspath(b)


def write_config(path, settings, config: ModelConfig) -> None:
    """``path``: the resolved ``config`` as [model] and ``settings`` as [train] (its
    paths absolute)."""
    model = config.to_dict()
    vocab = model.pop("vocab_size")
    train = absolute_paths({k: v for k, v in settings.to_dict().items() if k != "model"})
    for name in OFF_IS_ZERO:
        if train.get(name) is None:
            train[name] = 0.0
    lines = ["# Settings of this run: `jaxformer train --config config.toml --out DIR` repeats it.",
             "# Command-line flags override these values.", "",
             f"# vocab_size = {vocab} (from the tokenizer)"]
    lines += _table("model", model) + _table("train", train)
    Path(path).write_text("\n".join(lines))


def settings_from_file(path, preset: str | None = None, **flags):
    """TrainSettings from the file ``path``, then ``flags`` (None: unset) on top; the
    preset is ``preset``, else the file's, else loopos. ``flags["model"]``: ModelConfig
    overrides on top of the file's [model] table."""
    model, train = read_config(path)
    model.update(flags.pop("model", None) or {})
    preset = preset or train.pop("preset", None) or "loopos"
    train.pop("preset", None)
    train.update({k: v for k, v in flags.items() if v is not None})
    settings = settings_for(preset, **train, model=model)
    return off_is_zero(settings)


def off_is_zero(settings):
    """Clipping thresholds of 0 mean off (None)."""
    changes = {name: None for name in OFF_IS_ZERO if getattr(settings, name) == 0}
    return settings.replace(**changes) if changes else settings
