"""A pod planned ahead of time: every mesh of N devices a model allows, its train step compiled
for the target (aot/targets.py: a TPU v5e slice of libtpu's topology, or N deviceless H100s)
without the devices, and per mesh XLA's memory plan per device and the bytes its collectives
move per step; the meshes that fit, fewest collective bytes first.

- ``candidate_meshes(config, n_devices, batch_size, seq_len, context)``: every (data, fsdp,
  expert, tensor, context) factorization of n_devices the model takes, as the mesh text
  ``--mesh`` reads ("data=2,fsdp=2,tensor=2"), the context axis (the sequence split over it,
  ring attention: model/parallel/context.py) only with ``context``; ``refused_meshes`` the
  others, each with why (a tensor size ``check_tensor`` refuses, a context size
  ``check_context_model`` refuses, an expert size without experts or not dividing them, a batch
  that does not split over data x fsdp x expert).
- ``plan(config, n_devices, target, batch_size, seq_len, ...)``: a ``Row`` per candidate: the
  project's train step (training/step.py, the gradient source ``grads``, float32 params,
  ``dtype`` products, the optimizer given or AdamW) laid out by training/sharding.py on a mesh
  of the target's compile-only devices, compiled by XLA; its ``MemoryPlan`` (arguments +
  outputs - aliased + temporaries + code, bytes per device, as ``steps.fits`` judges it) and
  ``collective_bytes`` of the compiled program, or the compiler's refusal (``refusal``: libtpu
  refuses a program over the 15.75 GiB it gives one, a Pallas kernel over its scoped VMEM;
  XLA's GPU compiler refuses nothing, its plan says by how much a mesh does not fit).
- ``propose(rows)``: the rows that fit, by collective bytes, then memory.

The layers stay scanned on every target (``manual_grads.remat.GPU_UNROLL`` off while a step is
traced: a GPU's manual step otherwise unrolls them, and its compile time grows with depth), so
a compile takes about as long at 80 layers as at 16; an H100's figures are the scanned
program's, which keeps the stacked residuals a GPU's unrolled one does not.

Collective bytes are a proxy for the traffic between devices: per device and step, the result
bytes of every all-reduce, all-gather, reduce-scatter, all-to-all and collective-permute the
compiled program runs (``collective_bytes``: a loop's body counted once per trip, a
conditional's largest branch, an asynchronous collective once). An all-reduce's result is the
whole buffer reduced, an all-gather's the gathered buffer, a reduce-scatter's the device's
share: compare meshes of one model and batch with it, not link times.
"""

from __future__ import annotations

import contextlib
import math
import re
import time
from typing import NamedTuple

import jax
import optax

from jaxformer.model.config import ModelConfig
from jaxformer.model.moe_parallel import check_experts_divide
from jaxformer.model.parallel.context import check_context_model
from jaxformer.model.parallel.tensor import check_tensor
from jaxformer.tools.aot.launches import called, computations
from jaxformer.tools.aot.steps import Variant, build, oom_line
from jaxformer.tools.aot.targets import TARGETS, TPU_SLICES, Target, compiling_for, missing, target_devices
from jaxformer.training.memory_plan import MemoryPlan
from jaxformer.training.optim import make_optimizer
from jaxformer.training.sharding import AXES, mesh_shape
from manual_grads import remat

GiB = 2**30
COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")


# ---------------------------------------------------------------------------- meshes


def mesh_text(shape: tuple[int, ...]) -> str:
    """(data, fsdp, expert, tensor, context) -> the ``--mesh`` text: data and fsdp always, the
    others where above 1 ("data=2,fsdp=2,tensor=2")."""
    sizes = dict(zip(AXES, shape))
    return ",".join(f"{a}={sizes[a]}" for a in AXES if a in ("data", "fsdp") or sizes.get(a, 1) > 1)


def normal_mesh(text: str, n_devices: int) -> str:
    """Any ``--mesh`` text of ``n_devices`` devices ("fsdp=8") as ``mesh_text`` writes it
    ("data=1,fsdp=8"); ValueError (training/sharding.py's) for one that is not such a mesh."""
    shape = mesh_shape(text, n_devices)
    return mesh_text(shape + (1,) * (len(AXES) - len(shape)))


def factorizations(n: int, k: int) -> list[tuple[int, ...]]:
    """Every ordered k-tuple of positive integers whose product is n."""
    if k == 1:
        return [(n,)]
    return [(d, *rest) for d in range(1, n + 1) if n % d == 0 for rest in factorizations(n // d, k - 1)]


def why_not(config: ModelConfig, shape: tuple[int, ...], batch_size: int, seq_len: int | None = None) -> str | None:
    """Why the model cannot train on the (data, fsdp, expert, tensor, context) mesh ``shape`` at
    the global ``batch_size`` and ``seq_len`` (default max_seq_len) tokens (one line), or None."""
    data, fsdp, expert, tensor, context = shape
    for size, check in ((tensor, lambda: check_tensor(config, tensor)),
                        (context, lambda: check_context_model(config, context, seq_len or config.max_seq_len,
                                                              tensor))):
        if size > 1:
            try:
                check()
            except ValueError as error:
                return str(error)
    if expert > 1:
        if not config.n_experts:
            return "mesh axis expert: the model has no experts (n_experts 0) to split over it"
        try:
            check_experts_divide(config.n_experts, expert)
        except ValueError as error:
            return str(error)
    split = data * fsdp * expert
    if batch_size % split:
        return (f"the global batch {batch_size} does not divide over data x fsdp x expert = {split} "
                f"(the batch splits over every axis but tensor and context)")
    return None


def _ordered(shape: tuple[int, ...]) -> tuple[int, ...]:
    data, fsdp, expert, tensor, context = shape
    return context, tensor, expert, fsdp  # data-only first, then fsdp, expert, tensor, context growing


def mesh_choices(config: ModelConfig, n_devices: int, batch_size: int | None = None, seq_len: int | None = None,
                 context: bool = False) -> tuple[list[tuple[int, ...]], list[tuple[tuple[int, ...], str]]]:
    """([(data, fsdp, expert, tensor, context) the model takes], [(shape, why not) of the others])
    over ``n_devices`` devices, at the global ``batch_size`` (default: n_devices) and ``seq_len``
    tokens (default max_seq_len); a context axis larger than 1 only with ``context``."""
    if n_devices < 1:
        raise ValueError(f"the device count must be positive, got {n_devices}")
    batch_size = n_devices if batch_size is None else batch_size
    taken, refused = [], []
    shapes = [s for s in factorizations(n_devices, len(AXES)) if context or s[-1] == 1]
    for shape in sorted(shapes, key=_ordered):
        reason = why_not(config, shape, batch_size, seq_len)
        (taken.append(shape) if reason is None else refused.append((shape, reason)))
    return taken, refused


def candidate_meshes(config: ModelConfig, n_devices: int, batch_size: int | None = None, seq_len: int | None = None,
                     context: bool = False) -> list[str]:
    """The mesh texts of every (data, fsdp, expert, tensor, context) factorization of ``n_devices``
    the model takes at the global ``batch_size`` (default: n_devices) and ``seq_len`` tokens,
    data-only first; the context axis (the sequence split over devices) only with ``context``."""
    return [mesh_text(shape) for shape in mesh_choices(config, n_devices, batch_size, seq_len, context)[0]]


def refused_meshes(config: ModelConfig, n_devices: int, batch_size: int | None = None, seq_len: int | None = None,
                   context: bool = False) -> list[tuple[str, str]]:
    """[(mesh text, why not)] of the factorizations ``candidate_meshes`` leaves out."""
    return [(mesh_text(shape), reason)
            for shape, reason in mesh_choices(config, n_devices, batch_size, seq_len, context)[1]]


# ---------------------------------------------------------------------------- collectives

_SHAPE = re.compile(r"\b(pred|[a-z]+)(\d*)\[([\d,]*)\]")  # "bf16[16,1024]" -> bf, 16, "16,1024"
_CONSTANT = re.compile(r"%([\w.\-]+) = [su]\d+\[\][^=]* constant\((-?\d+)\)")


def shape_bytes(text: str) -> int:
    """The bytes of the shapes ``text`` names (a tuple's: each element's)."""
    total = 0
    for kind, bits, dims in _SHAPE.findall(text):
        width = 1 if kind == "pred" else max(1, int(bits or 8) // 8)
        total += width * math.prod(int(d) for d in dims.split(",") if d)
    return total


def _result_bytes(opcode: str, line: str) -> int:
    rhs = line.split(" = ", 1)[1]
    return shape_bytes(rhs[:rhs.index(f" {opcode}(") + 1])


def trip_count(line: str, condition: list[tuple[str, str]]) -> int:
    """A while loop's trips: its ``known_trip_count`` (XLA's GPU compiler writes it), else its
    condition's ``counter < N`` against a constant N (a TPU program's; JAX's loops count from 0
    by 1). ValueError when neither says."""
    m = re.search(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"(\d+)"', line)
    if m:
        return int(m.group(1))
    constants = {}
    for opcode, text in condition:
        c = _CONSTANT.search(text)
        if opcode == "constant" and c:
            constants[c.group(1)] = int(c.group(2))
    for opcode, text in condition:
        if opcode == "compare" and text.lstrip().startswith("ROOT ") and "direction=LT" in text:
            operands = re.findall(r"%([\w.\-]+)", text.split(" compare(", 1)[1].split(")", 1)[0])
            if len(operands) == 2 and operands[1] in constants:
                return constants[operands[1]]
    raise ValueError(f"a while loop whose trip count the program does not say: {line.strip()[:200]}")


def _async_half(lines: list[tuple[str, str]], name: str) -> bool:
    """Whether a computation is the done half or a continuation of a TPU asynchronous
    collective fusion: its collective is the one the start's computation holds (libtpu
    repeats it in every part of the fusion; the start's ends in custom-call AsyncCollectiveStart)."""
    return name.startswith("async_collective_fusion") or any(
        'custom_call_target="AsyncCollectiveDone"' in line for _, line in lines)


def _name(line: str) -> str:
    m = re.match(r"\s*(?:ROOT )?%?([\w.\-]+) = ", line)
    return m.group(1) if m else ""


def _scattered(lines: list[tuple[str, str]]) -> dict[str, tuple[str, int]]:
    """{all-reduce: ("reduce-scatter", the share's bytes)} for a computation whose ROOT is a
    dynamic-slice of an all-reduce of its own: libtpu's reduce-scatter (a fusion it names
    all-reduce-scatter), whose traffic is a reduce-scatter's."""
    reduced = {_name(line) for opcode, line in lines if opcode == "all-reduce"}
    for opcode, line in lines:
        if opcode == "dynamic-slice" and line.lstrip().startswith("ROOT "):
            operand = re.search(r" dynamic-slice\(\s*(?:[^%]*?)%([\w.\-]+)", line)
            if operand and operand.group(1) in reduced:
                return {operand.group(1): ("reduce-scatter", _result_bytes(opcode, line))}
    return {}


def collective_bytes(text: str) -> dict[str, int]:
    """{collective: result bytes per run} of a compiled program's HLO text (one device's
    program): all-reduce, all-gather, reduce-scatter, all-to-all, collective-permute. An
    asynchronous one is counted once, at its -done (whose result is the collective's; a -start's
    tuple holds its operands too) or, in a TPU asynchronous collective fusion, at the start's
    computation; libtpu's all-reduce-scatter fusion (an all-reduce, then the device's slice) as
    a reduce-scatter of that slice; a while loop's body once per trip (``trip_count``); a
    conditional's branch that moves the most; fusions, calls and async-start computations
    walked into."""
    comps, entry = computations(text)
    out = dict.fromkeys(COLLECTIVES, 0)

    def walk(name: str, times: int, into: dict[str, int], stack: tuple[str, ...]) -> None:
        if name not in comps or name in stack:
            return
        lines = comps[name]
        counted_here = not _async_half(lines, name)
        scattered = _scattered(lines)
        for opcode, line in lines:
            base = re.sub(r"-(start|done)$", "", opcode)
            if base in COLLECTIVES:
                if counted_here and not opcode.endswith("-start"):
                    kind, size = scattered.get(_name(line), (base, _result_bytes(opcode, line)))
                    into[kind] += times * size
            elif opcode == "while":
                body, = called(line, "body")
                condition = called(line, "condition")
                walk(body, times * trip_count(line, comps.get(condition[0], []) if condition else []),
                     into, stack + (name,))
            elif opcode == "conditional":
                branches = []
                for branch in called(line, "branch_computations", "true_computation", "false_computation"):
                    branches.append(dict.fromkeys(COLLECTIVES, 0))
                    walk(branch, times, branches[-1], stack + (name,))
                if branches:
                    most = max(branches, key=lambda b: sum(b.values()))
                    for kind, n in most.items():
                        into[kind] += n
            elif opcode == "call":
                for callee in called(line, "to_apply"):
                    walk(callee, times, into, stack + (name,))
            elif opcode in ("fusion", "async-start"):
                for callee in called(line, "calls"):
                    walk(callee, times, into, stack + (name,))

    walk(entry, 1, out, ())
    return out


# ---------------------------------------------------------------------------- the plan


class Row(NamedTuple):
    mesh: str  # "data=2,fsdp=2,tensor=2"
    shape: tuple[int, ...]  # (data, fsdp, expert, tensor, context)
    memory: MemoryPlan | None  # XLA's plan, bytes per device; None where it did not compile
    fits: bool  # compiled, and memory.total <= the target's hbm_bytes
    collectives: dict[str, int] | None  # collective_bytes of the compiled program; None: not read
    seconds: float  # lowering and compiling
    error: str = ""  # the compiler's refusal or the failure, one line

    @property
    def gib(self) -> float | None:
        return None if self.memory is None else self.memory.total / GiB

    @property
    def collective_total(self) -> int | None:
        return None if self.collectives is None else sum(self.collectives.values())


def default_optimizer() -> optax.GradientTransformation:
    """AdamW (make_optimizer's, a constant rate): its two float32 moments per param are what
    the memory plan holds; the rate's schedule changes nothing there."""
    return make_optimizer(name="adamw", lr=1e-4, weight_decay=0.1, clip_norm=1.0)


@contextlib.contextmanager
def scanned_layers():
    """The manual backward's layers scanned on every platform while a step is traced (a GPU's
    are otherwise unrolled: ``manual_grads.remat.GPU_UNROLL``)."""
    before, remat.GPU_UNROLL = remat.GPU_UNROLL, False
    try:
        yield
    finally:
        remat.GPU_UNROLL = before


def refusal(error: BaseException) -> str:
    """The compiler's refusal (or any failure) in one line: the out-of-memory line with its
    figures (``steps.oom_line``), a kernel's scoped-VMEM overflow as the kernel and its sizes,
    else the error's first line (with the next where the first only names the error)."""
    said = str(error)
    vmem = re.search(r"allocating on stack for %([\w.\-]+).*?Scoped allocation with size (\S+) and limit "
                     r"(\S+) exceeded", said, re.S)
    if vmem:
        return f"scoped VMEM: {vmem.group(1)} needs {vmem.group(2)}, the limit is {vmem.group(3)}"
    lines = [line.strip() for line in said.strip().splitlines() if line.strip()] or [""]
    if "RESOURCE_EXHAUSTED" in said or "Ran out of memory" in said:
        first = oom_line(said)
    else:
        first = f"{type(error).__name__}: {lines[0]}"
    if first.endswith(":") and len(lines) > 1:
        first = f"{first} {lines[1]}"
    return first[:300]


def compile_mesh(config: ModelConfig, shape: tuple[int, ...], target: Target, devices,
                 batch_size: int, seq_len: int, attention: str, grads: str, dtype: str,
                 optimizer: optax.GradientTransformation) -> Row:
    """One mesh's Row: the step built on ``devices`` (len = prod(shape)) and compiled."""
    start = time.perf_counter()
    text = mesh_text(shape)
    try:
        with jax.enable_x64(False), compiling_for(target), scanned_layers():
            # the axes `--mesh TEXT` makes: (data, fsdp), with expert, tensor and context where named
            axes = mesh_shape(text, len(devices))
            step, args = build(config, Variant(attention, grads, dtype, axes), batch_size, seq_len, optimizer,
                               devices=devices)
            compiled = step.lower(*args).compile()
    except Exception as error:  # noqa: BLE001 - every mesh is a row: a refusal is an answer
        return Row(text, shape, None, False, None, time.perf_counter() - start, refusal(error))
    seconds = time.perf_counter() - start
    memory = MemoryPlan.of(compiled)
    try:
        moved, note = collective_bytes(compiled.as_text()), ""
    except ValueError as error:
        moved, note = None, f"collectives not counted: {error}"
    fits = memory is not None and memory.total <= target.hbm_bytes
    return Row(text, shape, memory, fits, moved, seconds, note)


def device_problem(target: Target, n_devices: int) -> str | None:
    """Why ``target`` has no pod of ``n_devices`` devices (one line), or None: a TPU v5e slice
    has 1, 4, 8, ... 256 chips (targets.TPU_SLICES); H100s come in any number."""
    if n_devices < 1:
        return f"the device count must be positive, got {n_devices}"
    if target.platform == "tpu" and n_devices != 1 and n_devices not in TPU_SLICES:
        return (f"{target.name} has no slice of {n_devices} chips: a TPU v5e slice has 1, "
                f"{', '.join(map(str, TPU_SLICES))} chips")
    return None


def plan(config: ModelConfig, n_devices: int, target: str | Target, batch_size: int | None = None,
         seq_len: int | None = None, attention: str | None = None, grads: str = "manual",
         dtype: str = "bfloat16", optimizer: optax.GradientTransformation | None = None,
         meshes: list[str] | None = None, say=None, context: bool = False) -> list[Row]:
    """A Row per mesh of ``candidate_meshes`` (or of ``meshes``, a subset of them in any
    ``--mesh`` text, in that order; with ``context`` the meshes with a context axis too; a
    ``meshes`` entry may name one either way): the train step at ``batch_size`` (global; default n_devices) x ``seq_len`` (default
    max_seq_len) compiled for ``n_devices`` devices of ``target`` (a TARGETS name). ``attention``:
    the attention_impl (default: the config's); ``grads``: manual | auto; ``dtype``: the
    products' (params float32); ``optimizer``: default AdamW. ``say`` hears each row as it
    comes. RuntimeError when the target's compiler is not installed here, ValueError for a
    device count the target has no slice of, or a mesh that is not a candidate."""
    target = TARGETS[target] if isinstance(target, str) else target
    reason = missing(target)
    if reason:
        raise RuntimeError(reason)
    problem = device_problem(target, n_devices)
    if problem:
        raise ValueError(problem)
    batch_size = n_devices if batch_size is None else batch_size
    seq_len = seq_len or config.max_seq_len
    attention = attention or config.attention_impl
    checked = config.replace(attention_impl=attention, compute_dtype=dtype)  # the config the mesh must take
    named = None if meshes is None else [normal_mesh(m, n_devices) for m in meshes]
    context = context or any("context=" in m for m in named or ())  # mesh_text names context only above 1
    taken = {mesh_text(s): s for s in mesh_choices(checked, n_devices, batch_size, seq_len, context)[0]}
    todo = list(taken) if named is None else named
    unknown = [m for m in todo if m not in taken]
    if unknown:
        refused = dict(refused_meshes(checked, n_devices, batch_size, seq_len, context))
        raise ValueError(f"mesh {unknown[0]}: {refused.get(unknown[0], 'not a candidate of these devices')}")
    devices = target_devices(target, n_devices)
    rows = []
    for text in todo:
        row = compile_mesh(config, taken[text], target, devices, batch_size, seq_len, attention, grads, dtype,
                           optimizer or default_optimizer())
        rows.append(row)
        if say:
            say(row)
    return rows


def propose(rows: list[Row]) -> list[Row]:
    """The rows that fit, fewest collective bytes first (uncounted last), then least memory."""
    def key(row: Row):
        moved = row.collective_total
        return (moved is None, moved or 0, row.memory.total)
    return sorted((r for r in rows if r.fits), key=key)
