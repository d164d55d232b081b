"""The benchmark's contestants: one training step of the same model, the same batch and
AdamW with the same settings, in JAX with manual gradients or ``jax.grad`` over an
attention implementation, and in PyTorch (eager and ``torch.compile``, with
``F.scaled_dot_product_attention``) on the device JAX runs on; and the interleaved
rounds that time them. Which contestants run is ``bench_select``'s choice; one that
fails to build, compile or run is kept with its error (one line), never a traceback."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxformer.tools.bench.select import Spec
from jaxformer.training.memory_plan import MemoryPlan
from jaxformer.training.optim import make_optimizer
from jaxformer.training.step import grad_source, init_state, make_train_step

# AdamW as both frameworks run it: constant learning rate, decoupled weight decay on
# weight matrices and embeddings (optim.decay_mask), no clipping.
OPTIMIZER = dict(name="adamw", lr=1e-3, weight_decay=0.01, b1=0.9, b2=0.999, eps=1e-8)


class Contestant(NamedTuple):
    spec: Spec
    run: Callable[[int], None] | None  # run(n): n training steps, blocking at the end
    compile_s: float | None  # JAX: lower + compile of the train step; torch: the first step
    error: str | None = None  # why it could not run (then run is None)
    memory: dict | None = None  # JAX: XLA's memory_analysis of the compiled train step

    @property
    def name(self) -> str:
        return self.spec.name


def error_line(e: BaseException) -> str:
    """An exception as one short line: its type and the start of its message."""
    return f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"


def memory_stats(compiled) -> dict | None:
    """XLA's memory_analysis of a compiled function, in bytes (None if unavailable)."""
    plan = MemoryPlan.of(compiled)
    return None if plan is None else plan.as_dict()


def jax_contestant(spec: Spec, config, params, batch) -> Contestant:
    """The jitted training step of ``grad_source(spec.grads)`` with attention
    ``spec.attention``, compiled here (a failure is kept as the contestant's error)."""
    config = config.replace(attention_impl=spec.attention)
    optimizer = make_optimizer(**OPTIMIZER)
    step = make_train_step(grad_source(spec.grads, config), optimizer)
    state = init_state(jax.tree.map(jnp.copy, params), optimizer)
    batch = jax.device_put(batch)
    t0 = time.perf_counter()
    try:
        compiled = step.lower(state, batch).compile()
    except Exception as e:  # a kernel this device cannot build, an unsupported shape, ...
        return Contestant(spec, None, None, error_line(e))
    compile_s = time.perf_counter() - t0
    holder = [state]

    def run(n):
        state = holder[0]
        for _ in range(n):
            state, metrics = compiled(state, batch)
        jax.block_until_ready((state, metrics))
        holder[0] = state

    return Contestant(spec, run, compile_s, memory=memory_stats(compiled))


def torch_contestant(spec: Spec, config, params, batch, device: str = "cpu") -> Contestant:
    """The PyTorch model (``torch_ref``) with the same weights on ``device``, under
    autocast to config.compute_dtype; "torch_compile" compiles its loss. A first step
    runs here; when it fails the contestant carries the error."""
    import torch

    from jaxformer.tools.torch_ref.model import TorchTransformer, adamw, autocast, to_torch_batch  # imports torch

    try:
        model = TorchTransformer.from_jax(jax.device_get(params), config, device)
        opt = adamw(model, OPTIMIZER["lr"], OPTIMIZER["weight_decay"], OPTIMIZER["b1"],
                    OPTIMIZER["b2"], OPTIMIZER["eps"])
        inputs, targets = to_torch_batch(batch, device)
    except Exception as e:  # out of memory, ...
        return Contestant(spec, None, None, error_line(e))
    loss_fn = torch.compile(model.loss) if spec.name == "torch_compile" else model.loss
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    def run(n):
        for _ in range(n):
            opt.zero_grad(set_to_none=True)
            with autocast(device, config.compute_dtype):
                loss = loss_fn(inputs, targets)
            loss.backward()
            opt.step()
        sync()

    t0 = time.perf_counter()
    try:
        run(1)  # torch.compile compiles here (forward and backward graphs)
    except Exception as e:  # no compiler toolchain, unsupported op, out of memory, ...
        return Contestant(spec, None, None, error_line(e))
    return Contestant(spec, run, time.perf_counter() - t0)


def torch_version() -> str | None:
    """torch.__version__, None when torch is not installed."""
    try:
        import torch
    except ImportError:
        return None
    return torch.__version__


def make_contestants(specs: Sequence[Spec], config, params, batch, *, torch_device: str | None = None,
                     torch_threads: int | None = None,
                     say: Callable[[str], None] = lambda line: None) -> list[Contestant]:
    """A Contestant per spec, built (and compiled) in turn; ``say`` hears one line per
    contestant that fails to build."""
    out = []
    for spec in specs:
        if spec.grads == "torch":
            import torch

            if torch_threads:
                torch.set_num_threads(torch_threads)
            if torch_device == "cuda":  # float32 matmuls in TF32, as XLA runs them on the GPU
                torch.set_float32_matmul_precision("high")
            c = torch_contestant(spec, config, params, batch, torch_device or "cpu")
        else:
            c = jax_contestant(spec, config, params, batch)
        if c.error:
            say(f"{spec.name}: skipped, it failed to build: {c.error}")
        out.append(c)
    return out


def time_rounds(contestants: Sequence[Contestant], rounds: int, steps: int, warmup: int,
                probe: Callable[[], float] | None = None,
                say: Callable[[str], None] = lambda line: None) -> tuple[dict, list, dict]:
    """({name: [ms per step of each round]}, [probe() after each round], {name: error of
    a contestant that failed while running}); rounds interleaved A B C A B C ...; one that
    fails (out of memory, ...) leaves the rounds, ``say`` hears why in one line."""
    ready = [c for c in contestants if c.run is not None]
    failed = {}

    def attempt(c, n):
        try:
            c.run(n)
            return True
        except Exception as e:
            failed[c.name] = error_line(e)
            say(f"{c.name}: skipped, it failed while running: {failed[c.name]}")
            return False

    ready = [c for c in ready if attempt(c, warmup)]
    samples, probes = {c.name: [] for c in ready}, []
    for _ in range(rounds):
        for c in list(ready):
            t0 = time.perf_counter()
            if not attempt(c, steps):
                ready.remove(c)
                del samples[c.name]
                continue
            samples[c.name].append(1e3 * (time.perf_counter() - t0) / steps)
        if probe is not None:
            probes.append(probe())
    return samples, probes, failed
