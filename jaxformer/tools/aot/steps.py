"""Ahead of time: every train-step variant lowered and compiled for devices this machine
does not have.

A variant is an attention (full, blockwise, pallas, cudnn) x a gradient source (manual,
auto) x a compute dtype (float32, bfloat16) x a layout (one device, or a data x fsdp
mesh). Its step is the project's own (training/step.py: ``make_train_step`` of
``grad_source``, the state of ``init_state``; the mesh layout of training/sharding.py),
built on abstract inputs (``jax.eval_shape``, ``ShapeDtypeStruct``): no array of the
full size ever exists. Two checks, of different strength:

- ``lower_for(config, variant, "cuda" | "tpu")``: ``jax.export`` to StableHLO for that
  platform; a mesh variant on an ``AbstractMesh``, so no device is needed. It proves the
  step traces and every kernel lowers for the platform: the Pallas kernels become Triton
  custom calls for cuda and Mosaic ones for tpu (``kernels`` counts them), cuDNN's
  attention its fMHA calls; a block size the platform cannot take fails here, by name.
- ``compile_for(config, variant, target)``: XLA's own compiler for a device that is not
  here (aot_targets.py): a TPU v5e of libtpu's topology (jax[tpu]) and an H100 through
  JAX's CUDA plugin with a GPU target config: JAX 0.10.2 compiles for a GPU it does not
  have (``topologies.get_topology_desc("h100", "cuda", target_config=...)``, deviceless;
  jax[cuda12], no GPU opened). It proves XLA and the kernel compilers (Mosaic, Triton,
  cuDNN's) take the program, and reads XLA's memory plan (``memory_analysis``) and, for
  the GPU, the kernels the program launches per step (launches.py).
  Without the plugin, the GPU check is the cuda lowering above.

``largest_batch`` bisects the batch size over compile + memory_analysis against the
target's HBM. Variants a platform does not have are skipped with the reason
(``skip_reason``). Everything is traced with x64 off: the programs are the 32-bit ones
an accelerator runs (a TPU has no float64).
"""

from __future__ import annotations

import itertools
import math
import re
import time
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import AbstractMesh, SingleDeviceSharding

from jaxformer.model.config import ATTENTION_IMPLS, ModelConfig
from jaxformer.model.params import init_params
from jaxformer.tools.aot.launches import tally
from jaxformer.tools.aot.report import describe
from jaxformer.tools.aot.targets import (TARGETS, Target, abstract_device, compiling_for, cudnn_problem, missing,
                                         target_devices)
from jaxformer.training.sharding import AXES, make_mesh, mesh_shardings, state_shardings
from jaxformer.training.step import grad_source, init_state, make_train_step
from jaxformer.training.memory_plan import MemoryPlan as Memory  # XLA's plan, bytes per device

ATTENTIONS = ATTENTION_IMPLS
GRADS = ("manual", "auto")
DTYPES = ("float32", "bfloat16")  # the compute dtype; params stay float32
MESH = (2, 2)  # (data, fsdp) of the mesh variants: a v5e:2x2 topology's four chips
PLATFORMS = ("cuda", "tpu")

# custom-call targets of the kernels, as StableHLO calls them (@name)
KERNELS = {"triton": "__gpu$xla.gpu.triton", "mosaic": "tpu_custom_call", "cudnn": "__cudnn$fmha"}
CUDNN_CALLS = ("__cudnn$fmhaSoftmax", "__cudnn$fmhaSoftmaxBackward")
EXPORT_CHECKS = [jax.export.DisabledSafetyCheck.custom_call(name)
                 for name in (KERNELS["triton"], KERNELS["mosaic"], *CUDNN_CALLS)]


class Variant(NamedTuple):
    attention: str  # full | blockwise | pallas | cudnn
    grads: str  # manual | auto
    dtype: str  # compute dtype: float32 | bfloat16
    mesh: tuple[int, int] | None = None  # (data, fsdp); None: one device

    @property
    def name(self) -> str:
        layout = f"_mesh{self.mesh[0]}x{self.mesh[1]}" if self.mesh else ""
        return f"{self.grads}_{self.attention}_{'bf16' if self.dtype == 'bfloat16' else 'f32'}{layout}"

    @property
    def n_devices(self) -> int:
        return math.prod(self.mesh) if self.mesh else 1


def variants(attentions=ATTENTIONS, grads=GRADS, dtypes=DTYPES, meshes=(None, MESH)) -> list[Variant]:
    return [Variant(*v) for v in itertools.product(attentions, grads, dtypes, meshes)]


def absent(variant: Variant, platform: str) -> str | None:
    """Why ``variant`` does not exist on ``platform`` ("cuda" | "tpu"), or None."""
    if variant.attention != "cudnn":
        return None
    if platform != "cuda":
        return "cuDNN's fused attention runs only on a GPU"
    if variant.dtype == "float32":
        return "ModelConfig refuses cudnn with float32 products (cuDNN reads bfloat16 or float16)"
    return None


def skip_reason(variant: Variant, platform: str) -> str | None:
    """Why ``variant`` is not lowered for ``platform`` here: it does not exist there, or
    (cudnn) JAX cannot trace cuDNN's attention here (targets.cudnn_problem: its CUDA
    plugin or the cuDNN library is not installed)."""
    problem = absent(variant, platform)
    if problem is None and variant.attention == "cudnn" and platform == "cuda" and cudnn_problem():
        return f"cudnn needs cuDNN to trace: {cudnn_problem()}"
    return problem



class Outcome(NamedTuple):
    variant: Variant
    target: str  # "cuda" | "tpu" (lowered) or a TARGETS name (compiled)
    stage: str  # "lowered" | "compiled" | "too big" | "skipped" | "failed"
    seconds: float = 0.0
    kernels: int = 0  # Triton / Mosaic / cuDNN custom calls in the program
    memory: Memory | None = None
    reason: str = ""  # why skipped, too big or failed
    batch_size: int = 0
    launches: int = 0  # kernels the compiled GPU program launches per step (launches.py); 0 otherwise
    traffic: int = 0  # bytes those kernels read and write per step (launches.traffic)


def variant_config(config: ModelConfig, variant: Variant) -> ModelConfig:
    return config.replace(attention_impl=variant.attention, compute_dtype=variant.dtype)


def abstract_state(config: ModelConfig, optimizer: optax.GradientTransformation):
    """The TrainState's ShapeDtypeStructs (float32 params), without making it."""
    return jax.eval_shape(lambda: init_state(init_params(jax.random.PRNGKey(0), config, dtype=jnp.float32),
                                             optimizer))


def _placed(tree, shardings):
    """``tree``'s ShapeDtypeStructs laid out by ``shardings`` (a tree of the same shape)."""
    place = lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh)  # noqa: E731
    return jax.tree_util.tree_map(place, tree, shardings)


def build(config: ModelConfig, variant: Variant, batch_size: int, seq_len: int,
          optimizer: optax.GradientTransformation, devices=None, target: Target | None = None):
    """(step, (state, batch)): the variant's jitted train step and its abstract arguments.
    ``devices``: None (a mesh variant on an AbstractMesh, for export, naming ``target``'s
    device where given: ``targets.abstract_device``) or the target's compile-only devices
    (the arguments placed on them)."""
    config = variant_config(config, variant)
    state = abstract_state(config, optimizer)
    batch = {k: jax.ShapeDtypeStruct((batch_size, seq_len), jnp.int32) for k in ("inputs", "targets")}
    grad_fn = grad_source(variant.grads, config)
    if variant.mesh is None:
        if devices is not None:
            one = SingleDeviceSharding(devices[0])
            state, batch = (_placed(t, jax.tree_util.tree_map(lambda _: one, t)) for t in (state, batch))
        return make_train_step(grad_fn, optimizer), (state, batch)
    if devices is None:  # Auto axes, as a Mesh's (JAX 0.11's AbstractMesh defaults to Explicit)
        mesh = AbstractMesh(variant.mesh, AXES[:len(variant.mesh)], (jax.sharding.AxisType.Auto,) * len(variant.mesh),
                            abstract_device=abstract_device(target) if target else None)
    else:
        mesh = make_mesh(devices, variant.mesh)
    layout = state_shardings(state, mesh)
    _, split = mesh_shardings(mesh)
    state, batch = _placed(state, layout), _placed(batch, {k: split for k in batch})
    return make_train_step(grad_fn, optimizer, mesh=mesh, state_sharding=layout), (state, batch)


def kernel_count(text: str) -> int:
    """Triton, Mosaic and cuDNN custom calls in StableHLO text: the program's own kernels
    (a compiled TPU program has Mosaic calls of XLA's too)."""
    return sum(text.count(f"@{name}") for name in KERNELS.values())


def lower_for(config: ModelConfig, variant: Variant, platform: str, optimizer: optax.GradientTransformation,
              batch_size: int = 8, seq_len: int | None = None) -> Outcome:
    """The variant's step exported for ``platform`` ("cuda" | "tpu"): "lowered", or
    "skipped" with the reason; a variant that should lower and cannot raises."""
    reason = skip_reason(variant, platform)
    if reason:
        return Outcome(variant, platform, "skipped", reason=reason, batch_size=batch_size)
    start = time.perf_counter()
    # cuDNN's attention is partitioned by a custom rule (a Python callback) that needs real
    # devices and that jax.export cannot serialize: its mesh variant is lowered by jit on
    # the GPU target's compile-only devices instead
    by_jit = bool(variant.mesh) and variant.attention == "cudnn"
    devices = target_devices(TARGETS["h100"], variant.n_devices) if by_jit else None
    target = TARGETS["h100"] if platform == "cuda" else TARGETS["tpu-v5e"]
    with jax.enable_x64(False), compiling_for(target):
        step, args = build(config, variant, batch_size, seq_len or config.max_seq_len, optimizer, devices, target)
        if by_jit:
            text = step.lower(*args).as_text()
        else:
            exported = jax.export.export(step, platforms=[platform], disabled_checks=EXPORT_CHECKS)(*args)
            text = exported.mlir_module()
    return Outcome(variant, platform, "lowered", time.perf_counter() - start, kernel_count(text),
                   batch_size=batch_size)


def compile_for(config: ModelConfig, variant: Variant, target: str | Target,
                optimizer: optax.GradientTransformation, batch_size: int = 8,
                seq_len: int | None = None) -> Outcome:
    """The variant's step compiled by XLA for ``target`` (a TARGETS name): "compiled" with
    its Memory, "too big" where the compiler refuses it for want of memory, "skipped"
    (the variant does not exist there, or the compiler is not installed)."""
    target = TARGETS[target] if isinstance(target, str) else target
    reason = skip_reason(variant, target.platform) or missing(target)
    if reason:
        return Outcome(variant, target.name, "skipped", reason=reason, batch_size=batch_size)
    start = time.perf_counter()
    devices = target_devices(target, variant.n_devices)
    with jax.enable_x64(False), compiling_for(target):
        step, args = build(config, variant, batch_size, seq_len or config.max_seq_len, optimizer, devices=devices)
        lowered = step.lower(*args)
        try:
            compiled = lowered.compile()
        except Exception as error:  # noqa: BLE001 - the compiler's out-of-memory refusal is an answer
            said = str(error)
            if "RESOURCE_EXHAUSTED" not in said and "Ran out of memory" not in said:
                raise
            return Outcome(variant, target.name, "too big", time.perf_counter() - start,
                           reason=oom_line(said), batch_size=batch_size)
    count, moved = tally(compiled.as_text()) if target.platform == "cuda" else ({}, {})
    return Outcome(variant, target.name, "compiled", time.perf_counter() - start,
                   kernel_count(lowered.as_text()), Memory.of(compiled), batch_size=batch_size,
                   launches=sum(count.values()), traffic=sum(moved.values()))


def oom_line(message: str) -> str:
    """The first line of the compiler's out-of-memory error, with its own figures
    ("... HLO temporaries (18.16G) exceeds available HBM (15.75G).")."""
    return re.sub(r"^\s*RESOURCE_EXHAUSTED:\s*", "", message.strip().splitlines()[0])[:200]


def fits(outcome: Outcome, hbm_bytes: int) -> bool:
    return outcome.stage == "compiled" and outcome.memory.total <= hbm_bytes


def largest_batch(config: ModelConfig, variant: Variant, target: str, optimizer: optax.GradientTransformation,
                  seq_len: int | None = None, start: int = 8, multiple: int = 1, limit: int = 4096,
                  say=None) -> tuple[int, Outcome | None, list[Outcome]]:
    """The largest batch size (a multiple of ``multiple``, at most ``limit``) whose step
    compiles for ``target`` within its HBM: doubling from ``start`` until one does not
    fit, then bisecting. (batch, its Outcome, every Outcome tried); (0, None, ...) when
    not even ``multiple`` fits. ``say`` hears one line per compile."""
    hbm = TARGETS[target].hbm_bytes
    tried: dict[int, Outcome] = {}

    def ok(batch: int) -> bool:
        if batch not in tried:
            tried[batch] = compile_for(config, variant, target, optimizer, batch, seq_len)
            if say:
                say(describe(tried[batch]))
        return fits(tried[batch], hbm)

    good, batch = 0, max(multiple, start - start % multiple)
    while batch <= limit and ok(batch):
        good, batch = batch, batch * 2
    bad = batch if batch <= limit else None  # the smallest size known not to fit
    while bad is not None and bad - good > multiple:
        middle = (good + bad) // 2 // multiple * multiple
        if middle in (good, bad):
            break
        good, bad = (middle, bad) if ok(middle) else (good, middle)
    return good, tried.get(good), [tried[b] for b in sorted(tried)]


def run(config: ModelConfig, todo: list[Variant], targets: list[str], optimizer: optax.GradientTransformation,
        batch_size: int = 8, seq_len: int | None = None, say=None) -> list[Outcome]:
    """Every variant for every target: "cuda" / "tpu" lower, a TARGETS name compiles. A
    variant that fails is kept as a "failed" row with its error's first line."""
    out: list[Outcome] = []
    for target, variant in itertools.product(targets, todo):
        try:
            if target in PLATFORMS:
                o = lower_for(config, variant, target, optimizer, batch_size, seq_len)
            else:
                o = compile_for(config, variant, target, optimizer, batch_size, seq_len)
        except Exception as error:  # noqa: BLE001 - reported, not raised: the table shows every variant
            first = (str(error).strip().splitlines() or [""])[0][:300]
            o = Outcome(variant, target, "failed", reason=f"{type(error).__name__}: {first}",
                        batch_size=batch_size)
        out.append(o)
        if say:
            say(describe(o))
    return out
