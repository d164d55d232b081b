"""JAX's CUDA plugin in a folder of its own, for the H100 compiles on a machine without a GPU.

    python -m jaxformer.tools.aot.plugin [DIR]

installs ``jax-cuda12-plugin`` and ``jax-cuda12-pjrt`` at the installed jax's version (about
180 MB of wheels: no CUDA libraries, no GPU needed) and the cuDNN library
(``nvidia-cudnn-cu12``, about 700 MB: JAX reads its version while tracing cuDNN's attention,
and XLA builds cuDNN's attention kernels with it) into DIR, by default ``cuda-plugin`` in
this environment's prefix (``.venv/cuda-plugin``). Kept apart from the environment's
packages: installed beside jax, the plugin would print its driver warnings at every start of
jax on a GPU-less machine. The tests (tests/test_aot.py) and ``plugin_dir()`` find it there,
or wherever ``JAXFORMER_AOT_CUDA_PLUGIN`` names, and put it on the path of the compiling
subprocess alone.
"""

from __future__ import annotations

import os
import subprocess
import sys

import jax  # the plugin must match the installed jax exactly

ENV = "JAXFORMER_AOT_CUDA_PLUGIN"
PACKAGES = ("jax-cuda12-plugin", "jax-cuda12-pjrt")
CUDNN = "nvidia-cudnn-cu12>=9.8,<10"  # at least the version the plugin was built against
CUDNN_LIBRARY = os.path.join("lib", "libcudnn.so.9")  # inside the package's folder, nvidia/cudnn


def default_dir() -> str:
    return os.path.join(sys.prefix, "cuda-plugin")


def plugin_dir() -> str:
    """The folder the CUDA plugin is installed in apart: $JAXFORMER_AOT_CUDA_PLUGIN, else
    default_dir() ("" when neither holds the plugin)."""
    for folder in (os.environ.get(ENV, ""), default_dir()):
        if folder and os.path.isdir(os.path.join(folder, "jax_plugins")):
            return folder
    return os.environ.get(ENV, "")


def cudnn_apart_problem() -> str | None:
    """Why the plugin's folder cannot compile cuDNN's attention (one line), or None: the plugin
    and the cuDNN library are both there."""
    folder = plugin_dir()
    if not folder:
        return "JAX's CUDA plugin is not installed apart (python -m jaxformer.tools.aot.plugin)"
    if not os.path.isfile(os.path.join(folder, "nvidia", "cudnn", CUDNN_LIBRARY)):
        return f"the cuDNN library is not in {folder} (python -m jaxformer.tools.aot.plugin installs it)"
    return None


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) > 1 or (argv and argv[0].startswith("-")):
        print(__doc__.strip(), file=sys.stderr)
        return 2
    target = argv[0] if argv else default_dir()
    wheels = [f"{name}=={jax.__version__}" for name in PACKAGES] + [CUDNN]
    print(f"installing {', '.join(wheels)} into {target}")
    return subprocess.call([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps",
                            "--target", target, *wheels])


if __name__ == "__main__":
    raise SystemExit(main())
