"""jaxformer.observe.jsonsafe: reports as strict JSON, written whole."""

import json
import math

import jax.numpy as jnp
import numpy as np
import pytest

from jaxformer.observe.jsonsafe import json_safe, write_json

REPORT = {"loss": np.float32(2.5), "steps": np.int64(3), "ok": np.bool_(True), 1: (1.0, math.nan),
          "grads": jnp.array([1.0, -math.inf]), "table": np.arange(4).reshape(2, 2), "name": "x"}


def test_json_safe_converts_numpy_jax_keys_and_non_finite_floats():
    safe = json_safe(REPORT)
    assert safe == {"loss": 2.5, "steps": 3, "ok": True, "1": [1.0, "nan"], "grads": [1.0, "-inf"],
                    "table": [[0, 1], [2, 3]], "name": "x"}
    assert [type(safe[k]) for k in ("loss", "steps", "ok")] == [float, int, bool]
    assert json_safe(REPORT, non_finite="null")["1"] == [1.0, None]
    assert float(safe["grads"][1]) == -math.inf  # the text reads back
    with pytest.raises(ValueError, match="non_finite must be one of text, null"):
        json_safe(1.0, non_finite="drop")


def test_write_json_is_strict_json_and_leaves_no_temporary_file(tmp_path):
    path = write_json(tmp_path / "sub" / "report.json", REPORT, indent=1)
    assert json.loads(path.read_text(), parse_constant=lambda c: pytest.fail(f"not strict JSON: {c}")) \
        == json_safe(REPORT)
    assert sorted(p.name for p in path.parent.iterdir()) == ["report.json"]
    write_json(path, {"again": 1})  # replaced whole
    assert json.loads(path.read_text()) == {"again": 1}
