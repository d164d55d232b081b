"""Checks of a setting's type and range, each raising one ValueError that names the setting.

Every room validates its settings with these (ModelConfig, TrainSettings, the optimizer,
sampling, data preparation), so a value is judged by one rule everywhere: a bool is never
a number, an integer is a Python or numpy integer, and a number must be finite.

    check_int("n_layers", 0)            ValueError: n_layers must be a positive integer, got 0
    check_number("dropout", 1.0, low=0, high=1, high_open=True)
                                        ValueError: dropout must be in [0, 1), got 1.0
    check_choice("norm", "sandwich", ("pre", "post"))
                                        ValueError: norm must be one of 'pre', 'post', got 'sandwich'
    check_bool("causal", "yes")         ValueError: causal must be True or False, got 'yes'
    check_int("top_k", -1, 0, note="0: no limit")
                                        ValueError: top_k must be a non-negative integer, got -1 (0: no limit)
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np


def is_int(value) -> bool:
    """An integer that is not a bool: Python's int or a numpy integer."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def is_number(value) -> bool:
    """An int or float (Python's or numpy's) that is not a bool."""
    return is_int(value) or isinstance(value, (float, np.floating))


def int_words(minimum: int) -> str:
    """How an integer >= minimum is named in an error: "a positive integer" for 1."""
    return {1: "a positive integer", 0: "a non-negative integer"}.get(minimum, f"an integer >= {minimum}")


def refuse(name: str, words: str, value, note: str = ""):
    """The one error: "<name> must be <words>, got <value>", then " (<note>)" when given
    (what a special value means: "0: no limit")."""
    raise ValueError(f"{name} must be {words}, got {value!r}" + (f" ({note})" if note else ""))


def check_int(name: str, value, minimum: int = 1, *, note: str = "") -> int:
    """value as an int; ValueError naming ``name`` unless it is an integer >= minimum."""
    if not is_int(value) or value < minimum:
        refuse(name, int_words(minimum), value, note)
    return int(value)


def interval(low, high, low_open: bool, high_open: bool) -> str:
    """The range's text: "[0, 1)", "> 0", "<= 1"."""
    if low is not None and high is not None:
        return f"{'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"
    if low is not None:
        return f"{'>' if low_open else '>='} {low}"
    return f"{'<' if high_open else '<='} {high}"


def in_range(value, low=None, high=None, low_open: bool = False, high_open: bool = False) -> bool:
    """Whether value lies between low and high (None: unbounded), each end open or closed."""
    above = low is None or (value > low if low_open else value >= low)
    below = high is None or (value < high if high_open else value <= high)
    return above and below


def check_number(name: str, value, low=None, high=None, low_open: bool = False,
                 high_open: bool = False, *, note: str = "") -> float:
    """value as a float; ValueError naming ``name`` unless it is a finite number in the
    range (None ends are unbounded)."""
    if not is_number(value) or not math.isfinite(value):
        refuse(name, "a finite number", value, note)
    if not in_range(value, low, high, low_open, high_open):
        word = "in " if low is not None and high is not None else ""  # "in [0, 1)", "> 0"
        refuse(name, word + interval(low, high, low_open, high_open), value, note)
    return float(value)


def check_choice(name: str, value, choices, *, note: str = ""):
    """value; ValueError naming ``name`` and the choices unless value is one of them."""
    if value not in tuple(choices):
        refuse(name, "one of " + ", ".join(repr(c) for c in choices), value, note)
    return value


def check_choices(name: str, value, choices, *, note: str = "") -> tuple:
    """value as a tuple (a list is taken); ValueError naming ``name`` (and the entry) unless
    each entry is one of ``choices``."""
    if not isinstance(value, (tuple, list)):
        refuse(name, "a tuple of " + ", ".join(repr(c) for c in choices), value, note)
    return tuple(check_choice(f"{name}[{i}]", v, choices, note=note) for i, v in enumerate(value))


def check_bool(name: str, value, *, note: str = "") -> bool:
    """value as a bool; ValueError naming ``name`` unless it is True or False (Python's or numpy's)."""
    if not isinstance(value, (bool, np.bool_)):
        refuse(name, "True or False", value, note)
    return bool(value)


def check_keys(what: str, d, cls, name_known: bool = False) -> None:
    """ValueError naming every key of ``d`` that is no field of the dataclass ``cls``
    ("unknown {what}: a, b"), and the known fields too where ``name_known``."""
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(d) - names)
    if unknown:
        known = f"; known: {', '.join(sorted(names))}" if name_known else ""
        raise ValueError(f"unknown {what}: {', '.join(unknown)}{known}")
