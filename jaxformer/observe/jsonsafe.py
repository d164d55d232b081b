"""Reports as strict JSON: ``json_safe(x)`` and ``write_json(path, obj)``.

JSON has no NaN or infinity and no numpy or JAX types. ``json_safe`` turns dict keys
into strings, tuples into lists, numpy and JAX scalars and arrays into Python numbers
and (nested) lists, and each non-finite float into its text ("nan", "inf", "-inf":
float() reads it back) or, with ``non_finite="null"``, into null (a report whose
reader shows a missing value as "-"). ``write_json`` writes the result whole or not at
all (a temporary file renamed), so a report is never read half-written.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import jax
import numpy as np

from jaxformer.data.shards import write_atomic

NON_FINITE = ("text", "null")  # how json_safe writes NaN and infinities


def json_safe(x, non_finite: str = "text"):
    """x with every part JSON can hold as it is, the rest converted (see the module docstring)."""
    if non_finite not in NON_FINITE:
        raise ValueError(f"non_finite must be one of {', '.join(NON_FINITE)}, got {non_finite!r}")
    if isinstance(x, dict):
        return {str(k): json_safe(v, non_finite) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [json_safe(v, non_finite) for v in x]
    if isinstance(x, (np.ndarray, np.generic, jax.Array)):
        return json_safe(np.asarray(x).tolist(), non_finite)
    if isinstance(x, float) and not math.isfinite(x):
        return str(x) if non_finite == "text" else None
    return x


def write_json(path: str | os.PathLike, obj, *, indent: int = 2, non_finite: str = "text") -> Path:
    """json_safe(obj) as JSON at ``path`` (its folder made, the file replaced whole); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(json_safe(obj, non_finite), indent=indent, allow_nan=False) + "\n"
    write_atomic(path, text.encode("utf-8"))
    return path
