"""The notebooks in notebooks/ are up to date: each matches its source in notebooks/src/,
runs from a clean kernel without error, and prints what its committed outputs show.

The committed notebooks carry their outputs (``python notebooks/build_notebooks.py
--execute`` writes them). ``test_notebook_runs_and_matches_its_outputs`` executes each
again and compares, code cell by code cell, the text of the fresh outputs with the
committed ones, so a change to the code that alters a notebook's results fails here
until the notebooks are rebuilt. The rules of the comparison:

- compared: stream output (stdout, stderr), errors, and the text/* forms (text/plain,
  text/markdown, text/html) of results and displays; images are only required to exist
  where the committed notebook has them, not compared byte for byte;
- cells tagged "nondeterministic" (timings) are not compared;
- trailing spaces and memory addresses (" at 0x...") are ignored;
- a number in scientific notation below 1e-9 in magnitude, or zero so written, is
  float64 round-off whose digits depend on the processor: it compares as "~0" (the
  notebooks assert their own bounds on such values);
- 01's "exact: True" / "exact: False" (bit-for-bit equality of two float64
  gradients, which the notebook calls luck: XLA may sum in another order from one run
  to the next) compares as "exact: ~"; its "approximate" beside it must match;
- every other number must agree to its printed precision: integers exactly, a number
  with decimals or an exponent to within one unit of its last printed digit (so a value
  that rounds the other way on another processor is no change), and all the text
  around the numbers exactly.
"""

from __future__ import annotations

import copy
import re
import sys
import time
from pathlib import Path

import pytest
from xla_flags import suite_flags

nbformat = pytest.importorskip("nbformat")
pytest.importorskip("nbclient")

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK_DIR = ROOT / "notebooks"
sys.path.insert(0, str(NOTEBOOK_DIR))
try:
    import build_notebooks
finally:
    sys.path.remove(str(NOTEBOOK_DIR))

NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb"))
EXPECTED = {"01_backprop_by_hand", "02_training", "03_the_seed_story", "04_memory_and_recompute",
            "05_mixed_precision"}
NONDETERMINISTIC = build_notebooks.NONDETERMINISTIC
# The kernels compile as the suite does (tests/conftest.py: XLA's optimizations and CPU fusion
# emitters off; 01, 03, 04 and 05 then run in about half the time and print the same), while the
# committed outputs come from JAX's defaults (build_notebooks.py --execute). 02 keeps the
# defaults: its two 150-step float64 Adam runs (manual and jax.grad) agree to 6e-12 with them,
# and without XLA's optimizations they part (1e-3 by step 150), though one step's gradients still
# agree to 3e-17 and each run repeats bit for bit. Adam's update g / (|g| + eps) turns a rounding
# difference in a gradient component near eps = 1e-8 into one up to 1 / (4 eps) = 2.5e7 times
# larger: the parameters differ by 2e-15 after the first step, by 2e-10 after the second.
FAST_COMPILE = {"JAX_DISABLE_MOST_OPTIMIZATIONS": "true", "XLA_FLAGS": suite_flags()}
NEEDS_XLA_OPTIMIZATIONS = {"02_training"}
ROUNDOFF = re.compile(r"(?<![\w.])-?(?:\d(?:\.\d+)?e-0*(?:9|[1-9]\d+)|0(?:\.0+)?e[+-]0+)\b")
ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")
EXACT = re.compile(r"exact: (?:True |False)")
NUMBER = re.compile(r"(?<![\w.])-?\d+(?:,\d{3})*(?:\.\d+)?(?:e[+-]?\d+)?")


def rebuild_hint(path: Path) -> str:
    return (f"run `python notebooks/build_notebooks.py --execute {path.stem.split('_')[0]}` "
            "and commit the result")


def comparable_text(nb) -> dict[str, str]:
    """{cell id: text} of every compared code cell's outputs (see the module docstring)."""
    rows = {}
    for cell in nb.cells:
        if cell.cell_type != "code" or NONDETERMINISTIC in cell.metadata.get("tags", []):
            continue
        parts = []
        for out in cell.get("outputs", []):
            if out.output_type == "stream":
                parts.append(f"[{out.name}]\n{out.text}")
            elif out.output_type == "error":
                parts.append(f"[error] {out.ename}: {out.evalue}")
            else:
                parts += [f"[{mime}]\n{data}" for mime, data in sorted(out.get("data", {}).items())
                          if mime.startswith("text/")]
        text = "\n".join(line.rstrip() for line in "\n".join(parts).split("\n"))
        rows[cell.id] = ADDRESS.sub(" at 0x...", text)
    return rows


def same_number(committed: str, fresh: str) -> bool:
    """Equal to the committed number's printed precision (see the module docstring)."""
    if committed == fresh:
        return True
    mantissa, _, exponent = committed.lower().partition("e")
    if "." not in mantissa and not exponent:
        return False  # an integer: exactly
    decimals = len(mantissa.partition(".")[2])
    unit = 10.0 ** (int(exponent or 0) - decimals)
    value = lambda s: float(s.replace(",", ""))  # noqa: E731
    return abs(value(committed) - value(fresh)) <= unit * (1 + 1e-9)


def first_difference(committed: str, fresh: str) -> str | None:
    """None when the two texts agree, else the first differing line of each."""
    old, new = (EXACT.sub("exact: ~    ", ROUNDOFF.sub("~0", text)).split("\n")
                for text in (committed, fresh))
    for i in range(max(len(old), len(new))):
        a, b = (old[i] if i < len(old) else "<nothing>"), (new[i] if i < len(new) else "<nothing>")
        numbers_a, numbers_b = NUMBER.findall(a), NUMBER.findall(b)
        if (NUMBER.sub("#", a) != NUMBER.sub("#", b) or len(numbers_a) != len(numbers_b)
                or not all(map(same_number, numbers_a, numbers_b))):
            return f"line {i + 1}\n  committed: {a}\n  fresh:     {b}"
    return None


def differences(path: Path, committed, fresh) -> list[str]:
    """What differs between a committed notebook and a fresh execution of it, cell by cell."""
    old, new = comparable_text(committed), comparable_text(fresh)
    index = {cell.id: i for i, cell in enumerate(committed.cells)}
    found = []
    for cell_id, text in old.items():
        diff = first_difference(text, new.get(cell_id, "<cell missing>"))
        if diff:
            found.append(f"{path.name}, cell {index[cell_id]} (id {cell_id}), {diff}")
    def has_image(cell):
        return any("image/png" in o.get("data", {}) for o in cell.get("outputs", []))

    for cell, fresh_cell in zip(committed.cells, fresh.cells):
        if has_image(cell) and not has_image(fresh_cell):
            found.append(f"{path.name}, cell {index[cell.id]} (id {cell.id}): the committed "
                         "output has an image, the fresh one none")
    return found


# ---------------------------------------------------------------------------- fast checks


def test_every_source_has_its_notebook():
    assert {p.stem for p in NOTEBOOKS} == {p.stem for p in build_notebooks.sources()} == EXPECTED


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_matches_its_source_and_was_executed(path):
    committed = nbformat.read(path, as_version=4)
    fresh = build_notebooks.source_notebook(build_notebooks.SOURCES / f"{path.stem}.py")
    shape = lambda nb: [(c.id, c.cell_type, c.source, c.metadata.get("tags", []))  # noqa: E731
                        for c in nb.cells]
    differing = [i for i, (a, b) in enumerate(zip(shape(committed), shape(fresh))) if a != b]
    assert shape(committed) == shape(fresh), (
        f"{path.name} differs from notebooks/src/{path.stem}.py (first at cell "
        f"{differing[0] if differing else min(len(committed.cells), len(fresh.cells))}); "
        f"{rebuild_hint(path)}")
    code = [c for c in committed.cells if c.cell_type == "code"]
    assert [c.execution_count for c in code] == list(range(1, len(code) + 1)), (
        f"{path.name} is not executed; {rebuild_hint(path)}")
    assert not [o for c in code for o in c.outputs if o.output_type == "error"]
    assert any("image/png" in o.get("data", {}) for c in code for o in c.outputs), (
        f"{path.name} has no plot")
    try_this = committed.cells[-2]
    assert try_this.cell_type == "markdown" and "## Try this" in try_this.source, path.name
    assert committed.cells[-1].cell_type == "code", path.name


def test_sources_parse_cells_tags_and_markdown():
    cells = build_notebooks.parse_cells(
        "# a comment of the file\n\n# %% [markdown]\n# # Title\n#\n# text $x$\n\n"
        "# %%\nx = 1\n\n# %% tags=[\"nondeterministic\"]\nprint(x)\n")
    assert [(c.cell_type, c.source, c.metadata.get("tags")) for c in cells] == [
        ("markdown", "# Title\n\ntext $x$", None), ("code", "x = 1", None),
        ("code", "print(x)", ["nondeterministic"])]
    with pytest.raises(ValueError, match="src.py:1: bad cell marker"):
        build_notebooks.parse_cells("# %% [raw]\n", "src.py")
    with pytest.raises(ValueError, match="must start with '#'"):
        build_notebooks.parse_cells("# %% [markdown]\nnot a comment\n", "src.py")


def test_the_comparison_catches_an_edited_output_and_nothing_else():
    path = NOTEBOOK_DIR / "03_the_seed_story.ipynb"
    committed = nbformat.read(path, as_version=4)
    assert differences(path, committed, copy.deepcopy(committed)) == []
    edited = copy.deepcopy(committed)
    cell = next(c for c in edited.cells if "train, last 20 steps" in "".join(
        o.get("text", "") for o in c.get("outputs", [])))
    out = next(o for o in cell.outputs if o.get("name") == "stdout")
    number = re.search(r"\d\.\d{3}\n", out.text).group()
    out.text = out.text.replace(number, f"{float(number) + 0.002:.3f}\n", 1)
    (found,) = differences(path, committed, edited)
    assert found.startswith(f"{path.name}, cell {edited.cells.index(cell)} (id {cell.id}), line")
    assert first_difference("loss 2.431, 16 x 32", "loss 2.432, 16 x 32") is None  # last digit
    assert first_difference("loss 2.431", "loss 2.433")
    assert first_difference("blocks[1]", "blocks[2]")
    assert first_difference("err 3.1e-03", "err 3.2e-03") is None
    assert first_difference("err 3.1e-03", "err 3.4e-03")
    assert first_difference("max 2.2e-16 0.0e+00", "max 4.4e-16 1.1e-17") is None  # round-off
    assert first_difference("43,136 parameters", "43,137 parameters")
    # bit-for-bit equality is luck (summation order); the float64 agreement beside it is not
    assert first_difference("dw | exact: True  | approximate: True  | maxdiff: ~0",
                            "dw | exact: False | approximate: True  | maxdiff: ~0") is None
    assert first_difference("dw | exact: True  | approximate: True  | maxdiff: ~0",
                            "dw | exact: True  | approximate: False | maxdiff: ~0")


# ---------------------------------------------------------------------------- execution


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs_and_matches_its_outputs(path):
    committed = nbformat.read(path, as_version=4)
    fresh = copy.deepcopy(committed)
    for cell in fresh.cells:
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
    t0 = time.perf_counter()
    settings = None if path.stem in NEEDS_XLA_OPTIMIZATIONS else FAST_COMPILE
    build_notebooks.execute(fresh, settings=settings)  # raises CellExecutionError, naming the cell
    print(f"{path.name}: {time.perf_counter() - t0:.1f} s")
    found = differences(path, committed, fresh)
    assert not found, ("a fresh execution prints other results than the committed notebook:\n"
                       + "\n".join(found) + f"\n{rebuild_hint(path)}")
