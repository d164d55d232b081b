"""The README's examples still work and still show what the commands print.

The Python example runs as written; every shell command parses (each `jaxformer`
command with the real parser, each script's options with its own parser, each pip
extra exists); the commands whose output the README shows run in their quick
variants (experiments/readme_examples.py) and the excerpts shown have the shape of
today's output, numbers masked.
"""

import contextlib
import importlib.util
import io
import re
import shlex
import sys
from pathlib import Path

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib
from jaxformer.cli.main import build_parser

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"


def _load_examples():
    spec = importlib.util.spec_from_file_location("readme_examples", ROOT / "experiments" / "readme_examples.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


rx = _load_examples()


def _shell_commands(text: str) -> list[list[str]]:
    """Every command of the README's ```bash blocks, split at `&&`, as argv lists."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        for line in block.splitlines():
            for part in line.split("&&"):
                argv = shlex.split(part, comments=True)
                if argv:
                    commands.append(argv)
    return commands


def test_readme_python_examples_run():
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    assert blocks, "the README has no Python example"
    for block in blocks:
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            exec(compile(block, str(README), "exec"), {})
        assert out.getvalue().strip(), "a README example printed nothing"


def test_readme_shell_commands_parse():
    commands = _shell_commands(README.read_text())
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    seen = set()
    for argv in commands:
        if argv[0] == "jaxformer":
            args, extra = build_parser().parse_known_args(argv[1:])
            assert not extra, f"{shlex.join(argv)}: unknown {extra}"
            seen.add(args.command)
        elif argv[0].startswith("python") and argv[1].startswith("experiments/"):
            script = ROOT / argv[1]
            assert script.is_file(), f"{shlex.join(argv)}: no {script}"
            spec = importlib.util.spec_from_file_location(script.stem, script)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            # the script's own parser, or that of the command it runs (compare_grads.py)
            parse = getattr(module, "parse_args", None) or sys.modules[module.main.__module__].parse_args
            parse(argv[2:])
            seen.add(argv[1])
        elif argv[:2] == ["pip", "install"]:
            for name in re.findall(r"\[([\w,-]+)\]", " ".join(argv)):
                assert set(name.split(",")) <= set(extras), f"{shlex.join(argv)}: no such extra"
    assert {"train", "generate", "experiments/compare_grads.py"} <= seen, seen


def test_every_example_is_a_readme_command_with_an_output_block():
    text = README.read_text()
    commands = {shlex.join(argv) for argv in _shell_commands(text)}
    blocks = rx.readme_excerpts(text)
    for name, example in rx.EXAMPLES.items():
        assert shlex.join(shlex.split(example.command)) in commands, f"{name}: not in a bash block"
        assert blocks.get(name), f"README.md has no filled readme-example block for {name}"
        assert all(flag in example.command for flag in example.quick), name
    marked = re.search(r"Printed on (.+?), (\d{4}-\d\d-\d\d)\s", text)
    assert marked, "the excerpts name no machine and date"


def test_mask_gives_numbers_and_plurals_one_shape():
    assert rx.mask("trained 1 step, 3,072 tokens in 1.36 s: over 2 steps") == \
        rx.mask("trained 300 steps, 307,200 tokens in 61.42 s: over 1 step")
    assert rx.mask("loss 5.5604 -> 2.2e-05") == "loss N -> N"
    assert rx.mask("sampling from a") != rx.mask("sampled from a")


def test_excerpts_keep_what_the_example_names():
    printed = "training -> x\nsettings y\n  5%|#  | 3/60 [00:01]\rtrained 3 steps\nThe text\n"
    train = rx.excerpt(rx.EXAMPLES["train"], printed, stdout="")
    assert train == ["training -> x", "trained 3 steps"]
    generate = rx.excerpt(rx.EXAMPLES["generate"], "sampling from r\nThe text\n1 x 8 tokens in 1 s\n",
                          stdout="The text\n")
    assert generate == ["sampling from r", "The text", "1 x 8 tokens in 1 s"]


@pytest.mark.slow
def test_readme_excerpts_have_the_shape_of_todays_output(monkeypatch, tmp_path):
    """The quick variants run, and each line the README shows (the sampled text aside)
    matches, numbers masked, the same line of today's output."""
    monkeypatch.chdir(tmp_path)
    shown = rx.readme_excerpts(README.read_text())
    printed = rx.run_all(quick=True)
    for name, example in rx.EXAMPLES.items():
        keep = tuple(map(rx.mask, example.keep))
        want = [rx.mask(line) for line in shown[name] if rx.mask(line).startswith(keep)]
        got = [rx.mask(line) for line in printed[name] if rx.mask(line).startswith(keep)]
        assert got == want, f"{name}: README.md shows another output; run python experiments/readme_examples.py"
    assert any(line.startswith("The ") for line in printed["generate"])  # the sample, after its prompt


def test_readme_first_screen_stays_short():
    """Install, train, sample first; the long tables live in docs/."""
    lines = README.read_text().splitlines()
    assert len(lines) <= 300, f"README.md has {len(lines)} lines; move detail to docs/"
    headings = [line for line in lines if line.startswith("## ")]
    assert headings[0] == "## Install, train, sample", headings
