"""`python -m jaxformer` without its dependencies: one line naming the missing package
and how to install, exit code 2, no traceback; `import jaxformer` says the same."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Imported at start-up (sitecustomize): every module named in $BLOCK (and below) fails
# to import, as if not installed.
BLOCKER = textwrap.dedent("""\
    import os, sys
    BLOCKED = set(os.environ["BLOCK"].split(","))
    class Block:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in BLOCKED:
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
    sys.meta_path.insert(0, Block())
    """)


def _run(tmp_path, blocked, *args):
    (tmp_path / "sitecustomize.py").write_text(BLOCKER)
    env = {**os.environ, "BLOCK": blocked, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env,
                          cwd=tmp_path, timeout=120)


@pytest.mark.parametrize("blocked", ["jax", "optax"])
def test_the_command_names_the_missing_package(tmp_path, blocked):
    result = _run(tmp_path, blocked, "-m", "jaxformer", "--help")
    assert result.returncode == 2, result.stderr
    assert result.stdout == ""
    [line] = result.stderr.splitlines()
    assert line.startswith("error: ") and f"needs the package {blocked!r}" in line, line
    assert "pip install -e ." in line


def test_the_script_entry_point_names_the_missing_package(tmp_path):
    # what the installed `jaxformer` script runs (pyproject: jaxformer.__main__:main)
    code = "import sys; sys.argv = ['jaxformer']; from jaxformer.__main__ import main; sys.exit(main())"
    result = _run(tmp_path, "tqdm", "-c", code)
    assert result.returncode == 2 and result.stderr.startswith("error: "), result.stderr
    assert "needs the package 'tqdm'" in result.stderr and "Traceback" not in result.stderr


def test_the_library_raises_a_clear_module_not_found_error(tmp_path):
    result = _run(tmp_path, "jax", "-c", "import jaxformer")
    assert result.returncode == 1
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("ModuleNotFoundError: jaxformer needs the package 'jax'"), last
    assert "pip install -e ." in last
