"""One declaration per setting: a dataclass field whose metadata holds its help, its
command-line group and its range, from which the checks, the ``train`` flags and
their --help are derived (cli/flags.py ``add_setting_flags``).

    steps: int = setting(100, "total optimizer calls of the run", group="", minimum=1)

``group``: the --help section of its flag ("" the command's own; None: no flag);
``minimum``: an integer setting's least value (checked, and the flag's argparse type);
``choices``: a string setting's allowed values; ``metavar``: the flag's placeholder;
``unset``: what a None default means, for --help ("off", "--steps").
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing

from jaxformer.model.checks import check_int, check_number

KEYS = ("help", "group", "minimum", "choices", "metavar", "unset")


def setting(default, help: str, *, group: str | None = None, minimum: int | None = None,
            choices: tuple | None = None, metavar: str | None = None, unset: str | None = None,
            factory=None) -> dataclasses.Field:
    """A dataclass field described once: its default and the metadata above."""
    meta = dict(help=help, group=group, minimum=minimum, choices=choices, metavar=metavar, unset=unset)
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


@functools.cache
def type_hints(cls) -> dict:
    """``typing.get_type_hints(cls)``, resolved once per class: it evaluates every annotation,
    and a parser asks for each of several hundred fields."""
    return typing.get_type_hints(cls)


def value_type(cls, name: str) -> tuple[type, bool]:
    """(the type of field ``name`` of ``cls``, whether None is allowed): int | None -> (int, True)."""
    kind = type_hints(cls)[name]
    if typing.get_origin(kind) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(kind) if a is not type(None)]
        return args[0], True
    return kind, False


def declared(cls) -> list[dataclasses.Field]:
    """The fields of ``cls`` declared with ``setting``, in declaration order."""
    return [f for f in dataclasses.fields(cls) if "help" in f.metadata]


def default_text(f: dataclasses.Field) -> str:
    """The default of field ``f`` as --help shows it."""
    if f.default is None:
        return f.metadata["unset"] or "none"
    return str(f.default) if f.default != "" else '""'


def check_fields(obj) -> None:
    """Each declared field of the dataclass ``obj`` against its type and range: an integer
    setting >= its minimum, a number finite (None passes where the type allows it); a
    ValueError names the field. Choices are checked by their owners, which name them."""
    for f in declared(type(obj)):
        value = getattr(obj, f.name)
        kind, optional = value_type(type(obj), f.name)
        if value is None and optional:
            continue
        if kind is int and f.metadata["minimum"] is not None:
            check_int(f.name, value, f.metadata["minimum"])
        elif kind is float:
            check_number(f.name, value)
