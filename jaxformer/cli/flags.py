"""Command-line flags derived from the settings' dataclasses, shared by all commands.

``add_setting_flags(parser, TrainSettings, titles)`` adds one flag per field declared
with ``training.fields.setting`` (``--steps``, ``--lr``, ...): its type, range, choices,
help and the default --help shows all come from the field, each defaulting to None so
an unset flag falls through to the preset's recipe, a config file or a checkpoint;
``setting_flags(cls)`` names their fields.

``add_model_flags(parser)`` adds ``--d-model``, ``--n-heads``, ... (one per field
of ModelConfig except ``vocab_size``, which comes from the tokenizer), each
defaulting to None so an unset flag falls through to the preset or config file;
``model_overrides(args)`` collects the ones given. Values are checked by
ModelConfig itself, so a bad shape gets the same named ValueError from a flag,
a file or the API.
"""

from __future__ import annotations

import argparse
import dataclasses
import typing

from jaxformer.cli.args import UsageError, nonneg_int, number, positive_int
from jaxformer.model import config as _config
from jaxformer.training.fields import declared, default_text, type_hints, value_type

# Allowed values of the string fields, for --help and for argparse's own check.
CHOICES = {
    "activation": _config.ACTIVATIONS,
    "norm": _config.NORMS,
    "norm_type": _config.NORM_TYPES,
    "mlp": _config.MLPS,
    "positions": _config.POSITIONS,
    "attention_impl": _config.ATTENTION_IMPLS,
    "remat": _config.REMATS,
    "compute_dtype": _config.COMPUTE_DTYPES,
}

# Fields no flag sets: the tokenizer decides the vocabulary.
NOT_FLAGS = ("vocab_size",)


def model_fields() -> list[dataclasses.Field]:
    """The ModelConfig fields that have a command-line flag, in declaration order."""
    return [f for f in dataclasses.fields(_config.ModelConfig) if f.name not in NOT_FLAGS]


def flag_name(field_name: str) -> str:
    return "--" + field_name.replace("_", "-")


def _field_type(field: dataclasses.Field):
    """The field's type, an optional one's (``bool | None``: unset follows another field) unwrapped."""
    hint = type_hints(_config.ModelConfig)[field.name]
    kinds = [k for k in typing.get_args(hint) if k is not type(None)]
    return kinds[0] if len(kinds) == 1 else hint


def add_model_flags(parser: argparse.ArgumentParser, title: str = "model shape "
                    "(overrides the preset; checked by ModelConfig)",
                    shown: tuple[str, ...] | None = None,
                    default_from: str = "the preset's") -> argparse._ArgumentGroup:
    """Add one flag per ModelConfig field (``dest`` = the field name, default None).
    With ``shown``, only those fields appear in --help; the others are still parsed
    (so a command can refuse them by name) but hidden. ``default_from`` names where an
    unset flag's value comes from, for --help."""
    group = parser.add_argument_group(title)
    for f in model_fields():
        kind = _field_type(f)
        default = f.default
        helptext = f"default: {default_from} ({default!r} in ModelConfig)"
        if shown is not None and f.name not in shown:
            helptext = argparse.SUPPRESS
        if kind is bool:
            group.add_argument(flag_name(f.name), dest=f.name, default=None,
                               action=argparse.BooleanOptionalAction, help=helptext)
        elif f.name in CHOICES:
            group.add_argument(flag_name(f.name), dest=f.name, default=None,
                               choices=list(CHOICES[f.name]), help=helptext)
        elif kind is int:
            group.add_argument(flag_name(f.name), dest=f.name, default=None, type=number(int),
                               metavar="N", help=helptext)
        elif kind is float:
            group.add_argument(flag_name(f.name), dest=f.name, default=None, type=number(float),
                               metavar="X", help=helptext)
        elif typing.get_origin(kind) is tuple:  # layer_types, rope_layers: comma-separated, e.g. a,b,a or 1,1,0
            entry = number(int) if typing.get_args(kind)[0] is int else str
            group.add_argument(flag_name(f.name), dest=f.name, default=None, metavar="A,B,...",
                               type=lambda text, entry=entry: tuple(entry(part.strip()) for part in text.split(",")
                                                                    if part.strip()),
                               help=helptext)
        else:
            group.add_argument(flag_name(f.name), dest=f.name, default=None, help=helptext)
    return group


# argparse type of an integer setting, by its least value
INT_TYPES = {1: positive_int, 0: nonneg_int}


def setting_flags(cls) -> tuple[str, ...]:
    """The fields of the settings dataclass ``cls`` that have a flag, in declaration order."""
    return tuple(f.name for f in declared(cls) if f.metadata["group"] is not None)


def add_setting_flags(parser: argparse.ArgumentParser, cls, titles: tuple[str, ...]) -> dict:
    """One flag per field of ``cls`` declared with a group (``dest`` = the field name, default
    None, --help from the field's help and default). ``titles``: the argument groups, in
    --help order ("": the parser itself). Returns {title: group}, for other flags to join."""
    groups = {title: parser if title == "" else parser.add_argument_group(title) for title in titles}
    for f in declared(cls):
        meta = f.metadata
        if meta["group"] is None:
            continue
        kind, _ = value_type(cls, f.name)
        options = dict(dest=f.name, default=None, metavar=meta["metavar"],
                       help=f"{meta['help']} (default: {default_text(f)})")
        if meta["choices"] is not None:
            options["choices"] = list(meta["choices"])
        elif kind is int:
            options["type"] = INT_TYPES.get(meta["minimum"], number(int))
        elif kind is float:
            options["type"] = number(float)
        groups[meta["group"]].add_argument(flag_name(f.name), **options)
    return groups


def model_overrides(args: argparse.Namespace) -> dict:
    """{field: value} for each model flag given on the command line."""
    return {f.name: getattr(args, f.name) for f in model_fields()
            if getattr(args, f.name, None) is not None}


def refuse_weight_changes(spec: str, given: dict, config) -> None:
    """UsageError naming each model flag in ``given`` that would change what the weights of
    ``--init-from spec`` (whose config is ``config``) compute; flags of HOW_FIELDS pass."""
    fields = config.to_dict()
    refused = [name for name in _config.model_fields_of_weights()
               if name in given and given[name] != fields[name]]
    if refused:
        raise UsageError(f"--init-from {spec}: the model comes from the folder; "
                         f"{', '.join(flag_name(n) for n in refused)} would change it (only "
                         f"{', '.join(flag_name(n) for n in _config.HOW_FIELDS)} may be given)")
