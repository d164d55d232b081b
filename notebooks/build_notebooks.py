"""Write the notebooks of this folder from their sources in notebooks/src/, and execute them.

    python notebooks/build_notebooks.py --execute        # every notebook, with its outputs
    python notebooks/build_notebooks.py --execute 03     # only the notebooks whose name starts so
    python notebooks/build_notebooks.py                  # sources only: no new outputs

The committed notebooks carry their outputs; tests/test_notebooks.py executes each
again and fails when its text outputs differ from the committed ones, so after a
change to a source or to the code a notebook runs, rebuild with --execute. Without
--execute, a code cell whose source is unchanged keeps its committed outputs and the
others lose theirs (handy after editing markdown; the test says when to execute).

Sources: ``src/NAME.py`` becomes ``NAME.ipynb``, in the "percent" format that
jupytext and VS Code also read. A line ``# %%`` starts a code cell, ``# %% [markdown]``
a markdown cell (its lines lose their leading "# "), and either may end with tags,
``# %% tags=["nondeterministic"]``. Lines before the first ``# %%`` are the file's
own comment and are not part of the notebook.

Execution is made repeatable: a fresh kernel on the CPU (JAX_PLATFORMS=cpu), the
notebooks fix their own seeds, execution counts run 1, 2, ... over the code cells,
no timing metadata, consecutive stream outputs merged, figures as PNG at a fixed dpi
without the "Software" stamp. Outputs that may change from run to run (timings) go
in cells tagged "nondeterministic": they are saved but the test does not compare
them (its docstring gives the rules of the comparison).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import time
from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
SOURCES = HERE / "src"
CELL_TIMEOUT_S = 300  # one cell, on a loaded 2-core machine
NONDETERMINISTIC = "nondeterministic"  # the tag of cells whose outputs are not compared
KERNEL_ARGS = [  # figures: fixed dpi, no "Software" text chunk in the PNG
    "--InlineBackend.rc={'figure.dpi': 80}",
    "--InlineBackend.print_figure_kwargs={'bbox_inches': 'tight', 'metadata': {'Software': None}}",
]
MARKER = re.compile(r"^# %%(?P<md> \[markdown\])?(?:\s+tags=(?P<tags>\[.*\]))?\s*$")


def parse_cells(text: str, name: str = "source") -> list:
    """The cells of a percent-format source (see the module docstring)."""
    cells, kind, tags, lines = [], None, [], []

    def close():
        if kind is None:
            return
        body = "\n".join(lines).strip("\n")
        if kind == "markdown":
            body = "\n".join(re.sub(r"^# ?", "", line) for line in body.split("\n"))
        cell = new_markdown_cell(body) if kind == "markdown" else new_code_cell(body)
        if tags:
            cell.metadata["tags"] = tags
        cells.append(cell)

    for n, line in enumerate(text.split("\n"), 1):
        if line.startswith("# %%"):
            match = MARKER.match(line)
            if match is None:
                raise ValueError(f"{name}:{n}: bad cell marker {line!r}; use '# %%' or "
                                 "'# %% [markdown]', optionally followed by tags=[\"...\"]")
            close()
            kind = "markdown" if match["md"] else "code"
            tags, lines = json.loads(match["tags"]) if match["tags"] else [], []
        elif kind == "markdown" and line.strip() and not line.startswith("#"):
            raise ValueError(f"{name}:{n}: a markdown line must start with '#': {line!r}")
        else:
            lines.append(line)
    close()
    return cells


def source_notebook(path: Path):
    """The notebook of one source file, without outputs, with stable cell ids."""
    nb = new_notebook(cells=parse_cells(path.read_text(), path.name))
    prefix = path.stem.split("_")[0]
    for i, cell in enumerate(nb.cells):
        cell.id = f"{prefix}-{i:02d}"
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3",
                                 "language": "python"}
    nb.metadata["language_info"] = {"name": "python"}
    return nb


def sources(names=()) -> list[Path]:
    """The source files, all or those whose file name starts with one of ``names``."""
    paths = sorted(SOURCES.glob("[0-9]*.py"))
    return [p for p in paths if not names or any(p.stem.startswith(n) for n in names)]


def execute(nb, workdir=None, settings=None):
    """Run ``nb`` in a fresh kernel (in ``workdir``, default a temporary folder) and
    normalise what it saved; raises nbclient's CellExecutionError, naming the cell.
    ``settings``: JAX_ / XLA_ variables for the kernel (default none: JAX's own defaults)."""
    import nbclient

    env = {k: v for k, v in os.environ.items()  # no JAX or XLA settings of the caller's
           if not k.startswith(("JAX_", "XLA_")) and k != "MPLBACKEND"}
    env.update(settings or {})
    env.update(JAX_PLATFORMS="cpu", PYDEVD_DISABLE_FILE_VALIDATION="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")])))
    with tempfile.TemporaryDirectory() as tmp:
        client = nbclient.NotebookClient(
            nb, timeout=CELL_TIMEOUT_S, kernel_name="python3", record_timing=False,
            extra_arguments=KERNEL_ARGS, resources={"metadata": {"path": str(workdir or tmp)}})
        client.execute(env=env)
    return normalise(nb)


def normalise(nb):
    """Execution counts 1, 2, ... over code cells, streams merged, no run metadata."""
    count = 0
    for cell in nb.cells:
        cell.metadata.pop("execution", None)
        if cell.cell_type != "code":
            continue
        count += 1
        cell.execution_count = count
        merged = []
        for out in cell.outputs:
            if "execution_count" in out:
                out.execution_count = count
            if (out.output_type == "stream" and merged and merged[-1].output_type == "stream"
                    and merged[-1].name == out.name):
                merged[-1].text += out.text
            else:
                merged.append(out)
        cell.outputs = merged
    nb.metadata["language_info"] = {"name": "python"}
    return nb


def keep_outputs(nb, old) -> None:
    """Give each code cell of ``nb`` the outputs of the cell of ``old`` with its id and source."""
    before = {(c.id, c.source): c for c in old.cells if c.cell_type == "code"}
    for cell in nb.cells:
        if cell.cell_type == "code" and (cell.id, cell.source) in before:
            cell.outputs = before[cell.id, cell.source].outputs
            cell.execution_count = before[cell.id, cell.source].execution_count


def build(names=(), execute_cells: bool = False, out_dir: Path = HERE, log=None) -> list[Path]:
    """Write NAME.ipynb into ``out_dir`` for each source (executed with ``execute_cells``);
    ``log(path, seconds)`` is told each one written."""
    paths = []
    for src in sources(names):
        t0 = time.perf_counter()
        nb = source_notebook(src)
        path = Path(out_dir) / f"{src.stem}.ipynb"
        if execute_cells:
            nb = execute(nb)
        elif (HERE / path.name).exists():
            keep_outputs(nb, nbformat.read(HERE / path.name, as_version=4))
        nbformat.validate(nb)
        nbformat.write(nb, path)
        paths.append(path)
        if log:
            log(path, time.perf_counter() - t0)
    return paths


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", help="notebook name prefixes, e.g. 03 (default: all)")
    parser.add_argument("--execute", action="store_true",
                        help="run each notebook and save its outputs (what is committed)")
    args = parser.parse_args(argv)
    if not sources(args.names):
        parser.error(f"no source in {SOURCES} starts with {' or '.join(args.names)}")
    def log(path, seconds):
        done = f"executed in {seconds:.0f} s" if args.execute else "unchanged cells keep outputs"
        print(f"wrote {path.relative_to(ROOT)} ({done})", flush=True)

    build(args.names, args.execute, log=log)
    return 0


if __name__ == "__main__":
    sys.exit(main())
