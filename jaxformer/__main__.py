"""``python -m jaxformer`` and the ``jaxformer`` script: the ``jaxformer`` command.

A missing dependency ends in one line naming it and saying how to install, not a
traceback (jax is checked by the package's ``__init__``, the command's other
dependencies here)."""

import sys

try:
    from jaxformer.cli.main import main
except ModuleNotFoundError as e:
    if (e.name or "jaxformer").partition(".")[0] in ("jaxformer", "manual_grads"):
        raise
    print(f"error: the jaxformer command needs the package {e.name!r}, which {sys.executable} does "
          "not have; install the dependencies with `pip install -e .` in the jaxformer folder",
          file=sys.stderr)
    sys.exit(2)

if __name__ == "__main__":
    sys.exit(main())
