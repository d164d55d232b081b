"""Which contestants the benchmark runs on this device, and why the others do not.

A contestant is one training step of the same model: JAX with manual gradients over
each attention implementation that has a hand-derived backward (full, blockwise,
pallas), JAX with ``jax.grad`` (full, and cuDNN's fused attention), and PyTorch eager
and ``torch.compile`` with ``F.scaled_dot_product_attention``. ``select`` is pure (the
backend, the compute dtype and torch's state come in as arguments), so the choice can
be tested on any machine; ``torch_device`` reads torch's state.

    select(None, "cpu", None, torch_device="cpu")     # CPU defaults: pallas and cudnn left out
    select(("full", "pallas"), "gpu", "bfloat16", torch_device="cuda")
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from jaxformer.model.config import ATTENTION_IMPLS as ATTENTION_CHOICES
from manual_grads.attention import MANUAL_CORES

MANUAL_IMPLS = tuple(MANUAL_CORES)  # every attention: each core's pair in the hand-derived step
AUTO_IMPLS = ("full", "cudnn")  # attention jax.grad differentiates in the contest (the reference, cuDNN's)
TORCH_KINDS = ("torch_eager", "torch_compile")
LOW_PRECISION = ("bfloat16", "float16")  # what cuDNN's fused attention reads
TORCH_CPU_INSTALL = "pip install torch --index-url https://download.pytorch.org/whl/cpu"


class Spec(NamedTuple):
    name: str  # "manual_full", "auto_cudnn", "torch_eager", ...
    grads: str  # "manual" | "auto" | "torch"
    attention: str  # the attention_impl; "sdpa" for PyTorch


class Skip(NamedTuple):
    name: str
    reason: str  # one line: why it does not run here


def jax_name(grads: str, impl: str) -> str:
    return f"{grads}_{impl}"


ALL_NAMES = ([jax_name("manual", i) for i in MANUAL_IMPLS] + [jax_name("auto", i) for i in AUTO_IMPLS]
             + list(TORCH_KINDS))


def parse_attention(text: str) -> tuple[str, ...]:
    """``--attention full,blockwise,pallas,cudnn`` -> the impls, in the order given;
    ValueError naming an unknown or repeated one."""
    impls = tuple(part.strip() for part in text.split(",") if part.strip())
    if not impls:
        raise ValueError(f"--attention: expected a comma-separated list of "
                         f"{', '.join(ATTENTION_CHOICES)}, got {text!r}")
    for impl in impls:
        if impl not in ATTENTION_CHOICES:
            raise ValueError(f"--attention: unknown attention {impl!r}; choose from "
                             f"{', '.join(ATTENTION_CHOICES)}")
    if len(set(impls)) != len(impls):
        raise ValueError(f"--attention: {text!r} names an attention twice")
    return impls


def default_attention(backend: str) -> tuple[tuple[str, ...], list[Skip]]:
    """(the impls run when --attention is not given, the ones left out and why): all
    on a GPU; on a TPU all but cudnn (GPU only); on any other backend pallas (interpret
    mode: far too slow) and cudnn are left out."""
    if backend == "gpu":
        return ATTENTION_CHOICES, []
    cudnn = Skip("cudnn", f"left out on {backend}: cuDNN's fused attention runs only on a GPU")
    if backend == "tpu":
        return tuple(i for i in ATTENTION_CHOICES if i != "cudnn"), [cudnn]
    left_out = [Skip("pallas", f"left out on {backend} by default: Pallas runs in interpret mode "
                               f"there, far too slow (ask with --attention full,blockwise,pallas)"),
                cudnn]
    return tuple(i for i in ATTENTION_CHOICES if i not in ("pallas", "cudnn")), left_out


def impl_problem(impl: str, backend: str, compute_dtype: str | None) -> str | None:
    """Why attention ``impl`` cannot run here (None: it can)."""
    if impl == "cudnn":
        if backend != "gpu":
            return f"cuDNN's fused attention runs only on a GPU (backend {backend})"
        if compute_dtype not in LOW_PRECISION:
            return (f"cuDNN's fused attention reads bfloat16 or float16; compute dtype is "
                    f"{compute_dtype or 'the params float32'} (pass --compute-dtype bfloat16)")
    if impl == "pallas" and backend not in ("gpu", "tpu", "cpu"):
        return f"the Pallas kernels run on a GPU, a TPU (or interpret mode on CPU), not on {backend}"
    return None


def torch_device(backend: str) -> tuple[str | None, str | None]:
    """(the torch device matching JAX's backend, None) or (None, why PyTorch cannot run)."""
    try:
        import torch
    except ImportError:
        hint = TORCH_CPU_INSTALL if backend == "cpu" else "pip install torch (a CUDA build)"
        return None, f"PyTorch is not installed ({hint})"
    if backend == "gpu":
        if not torch.cuda.is_available():
            return None, (f"torch {torch.__version__} sees no CUDA GPU while JAX runs on one "
                          f"(install a CUDA build of torch)")
        return "cuda", None
    if backend != "cpu":
        return None, f"no PyTorch device matches JAX's backend {backend}"
    return "cpu", None


def select(attention: Sequence[str] | None, backend: str, compute_dtype: str | None, *,
           torch_device: str | None, torch_problem: str | None = None, with_torch: bool = True,
           with_torch_compile: bool = True, torch_compile_off: str = "--no-torch-compile"
           ) -> tuple[list[Spec], list[Skip]]:
    """(the contestants to run, in the order they take turns; the ones skipped, each with
    one line saying why). ``attention`` None takes default_attention(backend)."""
    if attention is None:
        attention, left_out = default_attention(backend)
    else:
        left_out = []
    left_out_names = {s.name for s in left_out}
    run, skipped = [], []
    for grads, impls in (("manual", MANUAL_IMPLS), ("auto", AUTO_IMPLS)):
        for impl in impls:
            name = jax_name(grads, impl)
            problem = impl_problem(impl, backend, compute_dtype)
            if impl in attention and problem is None:
                run.append(Spec(name, grads, impl))
            elif impl in attention or impl in left_out_names:
                reason = problem or next(s.reason for s in left_out if s.name == impl)
                skipped.append(Skip(name, reason))
            else:
                skipped.append(Skip(name, f"not asked for (--attention {','.join(attention)})"))
    for name in TORCH_KINDS:
        if not with_torch:
            skipped.append(Skip(name, "PyTorch contestants skipped (--no-torch)"))
        elif torch_device is None:
            skipped.append(Skip(name, torch_problem or "PyTorch cannot run here"))
        elif name == "torch_compile" and not with_torch_compile:
            skipped.append(Skip(name, f"left out ({torch_compile_off})"))
        else:
            run.append(Spec(name, "torch", "sdpa"))
    return run, skipped
