"""The benchmark's contestants: one training step of the same model, the same batch and
AdamW with the same settings, in JAX with manual gradients, in JAX with ``jax.grad``, and
in PyTorch (eager and ``torch.compile``, when torch is installed); and the interleaved
rounds that time them."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxformer.training.optim import make_optimizer
from jaxformer.training.step import grad_source, init_state, make_train_step

JAX_KINDS = ("manual", "auto")
TORCH_KINDS = ("torch_eager", "torch_compile")
# AdamW as both frameworks run it: constant learning rate, decoupled weight decay on
# weight matrices and embeddings (optim.decay_mask), no clipping.
OPTIMIZER = dict(name="adamw", lr=1e-3, weight_decay=0.01, b1=0.9, b2=0.999, eps=1e-8)


class Contestant(NamedTuple):
    name: str
    run: Callable[[int], None] | None  # run(n): n training steps, blocking at the end
    compile_s: float | None  # JAX: lower + compile of the train step; torch: the first step
    error: str | None = None  # why it could not run (then run is None)


def make_batch(config, batch_size: int, seq_len: int, seed: int) -> dict:
    """Random token ids: {"inputs", "targets"} int32 (B, T), the targets shifted by one."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, config.vocab_size, size=(batch_size, seq_len + 1), dtype=np.int32)
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}


def jax_contestant(kind: str, config, params, batch) -> Contestant:
    """The jitted training step of ``grad_source(kind)`` ("manual" or "auto"), compiled here."""
    optimizer = make_optimizer(**OPTIMIZER)
    step = make_train_step(grad_source(kind, config), optimizer)
    state = init_state(jax.tree.map(jnp.copy, params), optimizer)
    batch = jax.device_put(batch)
    t0 = time.perf_counter()
    compiled = step.lower(state, batch).compile()
    compile_s = time.perf_counter() - t0
    holder = [state]

    def run(n):
        state = holder[0]
        for _ in range(n):
            state, metrics = compiled(state, batch)
        jax.block_until_ready((state, metrics))
        holder[0] = state

    return Contestant(kind, run, compile_s)


def torch_contestant(name: str, config, params, batch) -> Contestant:
    """The PyTorch model (``torch_ref``) with the same weights; "torch_compile" compiles its
    loss. A first step runs here; when it fails the contestant carries the error."""
    import torch

    from jaxformer.tools.torch_ref import TorchTransformer, adamw, to_torch_batch  # imports torch

    model = TorchTransformer.from_jax(jax.device_get(params), config)
    opt = adamw(model, OPTIMIZER["lr"], OPTIMIZER["weight_decay"], OPTIMIZER["b1"],
                OPTIMIZER["b2"], OPTIMIZER["eps"])
    inputs, targets = to_torch_batch(batch)
    loss_fn = torch.compile(model.loss) if name == "torch_compile" else model.loss

    def run(n):
        for _ in range(n):
            opt.zero_grad(set_to_none=True)
            loss_fn(inputs, targets).backward()
            opt.step()

    t0 = time.perf_counter()
    try:
        run(1)  # torch.compile compiles here (forward and backward graphs)
    except Exception as e:  # no compiler toolchain, unsupported op, ...
        return Contestant(name, None, None, f"{type(e).__name__}: {' '.join(str(e).split())[:300]}")
    return Contestant(name, run, time.perf_counter() - t0)


def torch_version() -> str | None:
    """torch.__version__, None when torch is not installed."""
    try:
        import torch
    except ImportError:
        return None
    return torch.__version__


def make_contestants(config, params, batch, *, with_torch: bool = True,
                     with_torch_compile: bool = True,
                     torch_threads: int | None = None) -> tuple[list[Contestant], list[str]]:
    """The contestants, and notes on the ones left out."""
    out = [jax_contestant(kind, config, params, batch) for kind in JAX_KINDS]
    notes = []
    if not with_torch:
        notes.append("PyTorch contestants skipped (--no-torch)")
    elif torch_version() is None:
        notes.append("PyTorch not installed (pip install 'jaxformer[bench]'): no PyTorch contestants")
    else:
        if torch_threads:
            import torch

            torch.set_num_threads(torch_threads)
        out.append(torch_contestant("torch_eager", config, params, batch))
        if with_torch_compile:
            out.append(torch_contestant("torch_compile", config, params, batch))
        else:
            notes.append("torch.compile skipped (--quick or --no-torch-compile)")
    return out, notes


def time_rounds(contestants: Sequence[Contestant], rounds: int, steps: int, warmup: int,
                probe: Callable[[], float] | None = None) -> tuple[dict, list]:
    """({name: [ms per step of each round]}, [probe() after each round]); rounds
    interleaved A B C A B C ..."""
    ready = [c for c in contestants if c.run is not None]
    for c in ready:
        c.run(warmup)
    samples, probes = {c.name: [] for c in ready}, []
    for _ in range(rounds):
        for c in ready:
            t0 = time.perf_counter()
            c.run(steps)
            samples[c.name].append(1e3 * (time.perf_counter() - t0) / steps)
        if probe is not None:
            probes.append(probe())
    return samples, probes
