"""Imports flow one way (tests/import_rules.py states the rules): the checker is first
shown to catch each kind of breach in small fake packages, then run on the real one."""

import collections
import pathlib
import textwrap

import pytest

from import_rules import HEAVY_OPTIONAL, Violation, check, find_modules, may_import

ROOT = pathlib.Path(__file__).resolve().parents[1]


def write_package(root, files):
    """Writes {relative path: source} under ``root``, with an empty __init__.py in every
    folder that has none; returns ``root``."""
    for rel, source in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(source))
        for folder in path.relative_to(root).parents[:-1]:
            (root / folder / "__init__.py").touch(exist_ok=True)
    return root


CLEAN = {
    "jaxformer/__init__.py": "from jaxformer.model.linear import linear\n__version__ = '0'\n",
    "jaxformer/__main__.py": "from jaxformer.cli.main import main\n",
    "jaxformer/model/linear.py": "import numpy as np\nfrom ._impl import _helper\n",
    "jaxformer/model/_impl.py": "def _helper():\n    return 1\n",
    "jaxformer/data/core.py": "from ..model import linear\nfrom jaxformer.model.linear import linear as lin\n",
    "jaxformer/observe/tb.py": """\
        from jaxformer.data import core
        def writer():
            import tensorboardX
            from torch import nn
            return tensorboardX, nn
        """,
    "jaxformer/training/step.py": "import manual_grads\nfrom jaxformer.observe import tb\nfrom jaxformer import linear\n",
    "jaxformer/inference/generate.py": "from jaxformer.checkpoints import store\n",
    "jaxformer/checkpoints/store.py": "import jaxformer.model.linear\nx = jaxformer.model.linear.__name__\n",
    "jaxformer/tools/memory.py": "from manual_grads.model import value_and_grad\nfrom jaxformer.training import step\n",
    "jaxformer/cli/main.py": "from jaxformer.tools import memory\nfrom jaxformer.inference import generate\nfrom . import flags\n",
    "jaxformer/cli/flags.py": "import argparse\n",
    "manual_grads/model.py": "from jaxformer.model import linear\nfrom manual_grads.linear import linear_bwd\n",
    "manual_grads/linear.py": "from jaxformer.model.linear import linear\n\ndef linear_bwd():\n    pass\n",
}


def violations(tmp_path, changes):
    """check() of the clean fake package with ``changes`` ({path: source}) written over it."""
    return check(write_package(tmp_path, {**CLEAN, **changes}))


def rules(found):
    return {(v.path, v.line, v.rule) for v in found}


def test_clean_fake_package_reports_nothing(tmp_path):
    assert check(write_package(tmp_path, CLEAN)) == []


def test_module_circle_is_reported_with_both_sites(tmp_path):
    found = violations(tmp_path, {
        "jaxformer/model/a.py": "import os\nfrom jaxformer.model import b\n",
        "jaxformer/model/b.py": "from jaxformer.model.a import f\n"})
    assert rules(found) == {("jaxformer/model/a.py", 2, "module circle")}
    assert "jaxformer.model.a -> jaxformer.model.b -> jaxformer.model.a" in found[0].what
    assert "jaxformer/model/a.py:2, jaxformer/model/b.py:1" in found[0].what


def test_room_circle_is_reported(tmp_path):
    found = violations(tmp_path, {
        "jaxformer/training/loop.py": "from jaxformer.inference import generate\n",
        "jaxformer/inference/sample.py": "from jaxformer.training.step import x\n"})
    circles = [v for v in found if v.rule == "room circle"]
    assert len(circles) == 1 and "jaxformer.inference -> jaxformer.training -> jaxformer.inference" in circles[0].what
    assert ("jaxformer/training/loop.py", 1, "direction") in rules(found)


@pytest.mark.parametrize("path,source,what", [
    ("jaxformer/model/bad.py", "from jaxformer.data import core\n", "jaxformer.model may not import jaxformer.data"),
    ("jaxformer/model/bad.py", "\n\nfrom ..observe import tb\n", "may not import jaxformer.observe"),
    ("jaxformer/checkpoints/bad.py", "import jaxformer.observe.tb\n", "may not import jaxformer.observe"),
    ("jaxformer/tools/bad.py", "from jaxformer.cli import flags\n", "nothing may import the cli"),
    ("jaxformer/training/bad.py", "from jaxformer import __main__\n", "may not import jaxformer.__main__"),
    ("jaxformer/observe/bad.py", "import manual_grads.linear\n", "may not import manual_grads"),
    ("manual_grads/bad.py", "from jaxformer.data.core import lin\n", "manual_grads may not import jaxformer.data"),
    ("manual_grads/bad.py", "from jaxformer import linear\n", "manual_grads may not import jaxformer ("),
    ("jaxformer/__init__.py", "from jaxformer.data import core\n", "jaxformer may not import jaxformer.data"),
    ("jaxformer/__main__.py", "from jaxformer.training import step\n", "may not import jaxformer.training"),
])
def test_wrong_direction_is_reported(tmp_path, path, source, what):
    found = violations(tmp_path, {path: source})
    direction = [v for v in found if v.rule == "direction"]
    assert len(direction) == 1, found
    assert direction[0].path == path and direction[0].line == source.count("\n") and what in direction[0].what
    assert {v.rule for v in found} <= {"direction", "room circle"}  # a backward import may close a circle


@pytest.mark.parametrize("source,line,what", [
    ("from jaxformer.model.linear import np, _scale\n", 1, "_scale taken from jaxformer.model.linear"),
    ("import os\nfrom ..model._impl import helper\n", 2, "_impl taken from jaxformer.model._impl"),
    ("from jaxformer.model import _impl\n", 1, "_impl taken from jaxformer.model"),
    ("from jaxformer.model import linear\ny = linear._scale\n", 2, "linear._scale read from jaxformer.model.linear"),
    ("import jaxformer.model.linear as L\n\ny = L._scale\n", 3, "L._scale read from"),
])
def test_private_name_across_rooms_is_reported(tmp_path, source, line, what):
    found = violations(tmp_path, {"jaxformer/data/bad.py": source})
    private = [v for v in found if v.rule == "private"]
    assert len(private) == 1 and private[0].line == line and what in private[0].what, found


def test_private_name_within_a_room_and_dunders_pass(tmp_path):
    assert violations(tmp_path, {
        "jaxformer/model/ok.py": "from jaxformer.model._impl import _helper\nfrom . import _impl\n",
        "jaxformer/data/ok.py": "import jaxformer.model.linear as L\nv = L.__name__\n"}) == []


def test_function_level_import_is_reported(tmp_path):
    found = violations(tmp_path, {"jaxformer/observe/bad.py": """\
        import jax
        def f():
            import numpy as np
            if np:
                from jaxformer.model import linear
        class Writer:
            def open(self):
                import json
                import matplotlib.pyplot as plt
        """})
    assert rules(found) == {("jaxformer/observe/bad.py", n, "function-level") for n in (3, 5, 8)}


def test_module_outside_every_room_is_reported(tmp_path):
    found = violations(tmp_path, {"jaxformer/extras/thing.py": "import os\n"})
    assert rules(found) == {(f"jaxformer/extras/{name}.py", 1, "room") for name in ("__init__", "thing")}


def test_rule_table():
    assert may_import("jaxformer.cli", "manual_grads") and may_import("jaxformer.cli", "jaxformer.data")
    assert may_import("jaxformer.training", "manual_grads") and may_import("jaxformer.tools", "manual_grads")
    assert not may_import("jaxformer.inference", "manual_grads")
    assert not may_import("jaxformer.observe", "jaxformer.checkpoints")  # same rank, other room
    assert not may_import("jaxformer.formats", "jaxformer.checkpoints")  # model files apart from train states
    assert not may_import("jaxformer.checkpoints", "jaxformer.formats")
    assert not may_import("jaxformer.model", "jaxformer")  # the public API re-exports the model
    assert {"torch", "matplotlib", "tensorboardX"} <= HEAVY_OPTIONAL
    assert str(Violation("a/b.py", 3, "private", "x")) == "a/b.py:3: [private] x"


def test_real_package_is_scanned():
    modules = find_modules(ROOT)
    assert {"jaxformer", "jaxformer.__main__", "jaxformer.model.linear", "jaxformer.cli.main",
            "manual_grads.model"} <= set(modules)


def test_real_package_imports_flow_one_way():
    found = check(ROOT)
    by_rule = collections.Counter(v.rule for v in found)
    summary = ", ".join(f"{rule} {n}" for rule, n in sorted(by_rule.items()))
    assert not found, f"{len(found)} import rule violation(s) ({summary}):\n" + "\n".join(map(str, found))
