"""Re-run the README's example commands and rewrite the output it shows for them.

README.md shows what its commands print between marker comments:

    <!-- readme-example: train -->
    Printed on <machine>, <date> (...):
    ```text
    <an excerpt of what the command printed>
    ```
    <!-- /readme-example -->

EXAMPLES names each command exactly as the README writes it and which of its
lines the excerpt keeps. This script runs them in order (each after the one
before, in a fresh folder, so `runs/loopos` means the same as in the README) and
rewrites each block with the excerpt, the machine and the date:

    python experiments/readme_examples.py            # the commands as written; rewrites README.md
    python experiments/readme_examples.py --quick    # quick variants (--steps 3 ...); prints only

tests/test_readme.py runs the quick variants and checks that the README's
excerpts still have the shape of today's output (numbers masked).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import io
import os
import platform
import re
import shlex
import sys
import tempfile
from pathlib import Path
from typing import NamedTuple, Sequence

import jax

from jaxformer.cli.main import main as jaxformer_main

README = Path(__file__).resolve().parents[1] / "README.md"
BLOCK = re.compile(r"(<!-- readme-example: (?P<name>[\w-]+) -->\n)(?P<body>.*?)(<!-- /readme-example -->)", re.S)


class Example(NamedTuple):
    command: str  # exactly as the README writes it
    quick: dict  # flag -> value, for the quick variant
    keep: tuple[str, ...]  # the excerpt keeps the lines that start, masked, as one of these does
    text: bool = False  # also keep what the command prints on stdout (sampled text), unchecked


EXAMPLES = {
    "train": Example(
        "jaxformer train --preset loopos --steps 300 --out runs/loopos", {"--steps": "3"},
        ("training ->", "corpus ", "tokens ", "compiled in", "model ", "trained ", "1 params",
         "run folder")),
    "generate": Example(
        'jaxformer generate --run runs/loopos --prompt "The " --max-new-tokens 120',
        {"--max-new-tokens": "8"}, ("sampling from", "1 x 1 tokens in"), text=True),
}


def mask(line: str) -> str:
    """The line's shape: every number becomes N, and '1 step' reads as '3 steps' does."""
    line = re.sub(r"\d[\d,]*(\.\d+)?(e[-+]?\d+)?", "N", line.rstrip())
    return re.sub(r"\bN ([a-z-]+?)s\b", r"N \1", line)


def argv_of(example: Example, quick: bool) -> list[str]:
    """The command's arguments (after `jaxformer`), with the quick variant's values."""
    argv = shlex.split(example.command)[1:]
    if quick:
        for flag, value in example.quick.items():
            argv[argv.index(flag) + 1] = value
    return argv


def excerpt(example: Example, printed: str, stdout: str) -> list[str]:
    """The lines of ``printed`` (stdout and stderr as they came) that the README shows."""
    text = set(stdout.splitlines()) if example.text else set()
    return [line.rstrip() for line in printed.splitlines()
            if line in text or mask(line).startswith(tuple(map(mask, example.keep)))]


class Tee(io.StringIO):
    """Collects what is written, and also what is written through ``also``."""

    def __init__(self, also: io.StringIO | None = None):
        super().__init__()
        self.also = also

    def write(self, s):
        if self.also is not None:
            self.also.write(s)
        return super().write(s)


def run_example(name: str, quick: bool = False) -> list[str]:
    """Run EXAMPLES[name] in the current folder; its excerpt. Raises when the command fails."""
    example = EXAMPLES[name]
    both = Tee()
    stdout = Tee(also=both)
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(both):
        code = jaxformer_main(argv_of(example, quick))
    if code != 0:
        raise RuntimeError(f"`{example.command}` exited with {code}:\n{both.getvalue()[-2000:]}")
    return excerpt(example, both.getvalue(), stdout.getvalue())


def run_all(quick: bool = False, names: Sequence[str] = tuple(EXAMPLES)) -> dict[str, list[str]]:
    """Every example's excerpt, run in order in a fresh temporary folder."""
    here = os.getcwd()
    with tempfile.TemporaryDirectory() as tmp:
        os.chdir(tmp)
        try:
            return {name: run_example(name, quick) for name in names}
        finally:
            os.chdir(here)


def readme_excerpts(text: str) -> dict[str, list[str]]:
    """{name: the lines of the ```text block} of each readme-example block."""
    out = {}
    for m in BLOCK.finditer(text):
        code = re.search(r"```text\n(.*?)```", m["body"], re.S)
        out[m["name"]] = code[1].splitlines() if code else []
    return out


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    return (f"{platform.system()} {cpu}, {os.cpu_count()} CPU cores, jax {jax.__version__} "
            f"on {jax.devices()[0].device_kind}")


def rewrite(text: str, excerpts: dict[str, list[str]], where: str) -> str:
    """``text`` with each named block's body replaced by its new excerpt."""
    def body(m):
        if m["name"] not in excerpts:
            return m[0]
        lines = "\n".join(excerpts[m["name"]])
        return (f"{m[1]}Printed on {where}\n(`python experiments/readme_examples.py` re-runs it "
                f"and rewrites this block):\n\n```text\n{lines}\n```\n{m[4]}")
    return BLOCK.sub(body, text)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="readme_examples", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="quick variants; print the excerpts, leave README.md")
    p.add_argument("--readme", type=Path, default=README, help=f"default {README}")
    args = p.parse_args(argv)
    text = args.readme.read_text()
    missing = sorted(set(EXAMPLES) - set(readme_excerpts(text)))
    if missing:
        p.error(f"{args.readme} has no readme-example block for {', '.join(missing)}")
    excerpts = run_all(quick=args.quick)
    if args.quick:
        for name, lines in excerpts.items():
            print(f"--- {name}: {EXAMPLES[name].command} (quick)", *lines, sep="\n")
        return 0
    where = f"{machine()}, {datetime.date.today().isoformat()}"
    args.readme.write_text(rewrite(text, excerpts, where))
    print(f"rewrote {', '.join(excerpts)} in {args.readme} ({where})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
