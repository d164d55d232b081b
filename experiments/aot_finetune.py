"""Fine-tuning and mixture-of-experts steps compiled for devices this machine does not have
(jaxformer/tools/aot/): XLA's per-chip memory plan and FLOP count, nothing run.

- ``--part lora``: the gpt2 recipe (the gpt2 preset, GPT-2's 50257-token vocabulary, float32
  master params, bfloat16 products, batch 8 x 1024, its AdamW): a full fine-tune against LoRA
  (rank 8 on q, v; rank 8 on every projection), manual and jax.grad gradients, for one TPU v5e
  chip and (with JAX's CUDA plugin) one H100 80GB.
- ``--part moe``: the olmoe-1b-7b preset's train step (its fine-tuning AdamW, bfloat16
  products, batch B x 2048) for one TPU v5e chip, manual and jax.grad gradients; ``--moe-layers``
  shrinks the stack (all 64 experts of each layer stay on the one chip: no expert parallelism);
  ``--targets h100`` compiles it for an H100.

The H100 compiles need JAX's CUDA plugin importable (jax[cuda12], or its own folder on
PYTHONPATH, e.g. ``PYTHONPATH=$JAXFORMER_AOT_CUDA_PLUGIN``); without it those rows say so.

    python experiments/aot_finetune.py --part lora
    python experiments/aot_finetune.py --part moe --moe-layers 16,2 --batch-size 1
    python experiments/aot_finetune.py --part moe --moe-layers 1 --batch-size 4

Prints one line per compile and a markdown table (docs/finetune.md and docs/moe.md quote them).
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # the accelerators' plugins only compile here
os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")  # no cloud metadata server to ask
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import argparse  # noqa: E402
import time  # noqa: E402
from typing import NamedTuple  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import SingleDeviceSharding  # noqa: E402

from jaxformer.data.hf_tokenizers import GPT2_VOCAB_SIZE  # noqa: E402
from jaxformer.model.config import get_preset  # noqa: E402
from jaxformer.model.lora import LoraConfig, init_adapters  # noqa: E402
from jaxformer.model.params import init_params  # noqa: E402
from jaxformer.tools.aot.steps import oom_line  # noqa: E402
from jaxformer.tools.aot.targets import TARGETS, missing, target_devices  # noqa: E402
from jaxformer.training.adapters import lora_grad_source  # noqa: E402
from jaxformer.training.memory_plan import MemoryPlan  # noqa: E402
from jaxformer.training.optim import make_optimizer  # noqa: E402
from jaxformer.training.settings import settings_for  # noqa: E402
from jaxformer.training.step import grad_source, init_state, make_train_step  # noqa: E402

GiB = 2**30
GRAD_NAMES = {"manual": "manual", "auto": "jax.grad"}


class Row(NamedTuple):
    name: str
    target: str
    stage: str  # compiled | too big | failed | skipped
    seconds: float = 0.0
    memory: MemoryPlan | None = None
    flops: float | None = None
    reason: str = ""


def placed(tree, device):
    """``tree``'s ShapeDtypeStructs on one compile-only ``device``."""
    one = SingleDeviceSharding(device)
    return jax.tree_util.tree_map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=one), tree)


def step_and_args(config, grads, optimizer, batch_size, seq_len, device, lora=None):
    """(step, state, batch) on abstract inputs: the full step over every param, or (``lora``)
    the adapters' step with the float32 base an argument of the program (make_train_step's
    ``frozen``)."""
    params = jax.eval_shape(lambda: init_params(jax.random.PRNGKey(0), config, dtype=jnp.float32))
    batch = placed({k: jax.ShapeDtypeStruct((batch_size, seq_len), jnp.int32) for k in ("inputs", "targets")},
                   device)
    if lora is None:
        state = jax.eval_shape(lambda p: init_state(p, optimizer), params)
        return make_train_step(grad_source(grads, config), optimizer), placed(state, device), batch
    adapters = jax.eval_shape(lambda p: init_adapters(jax.random.PRNGKey(1), p, lora), params)
    state = jax.eval_shape(lambda a: init_state(a, optimizer), adapters)
    step = make_train_step(lora_grad_source(grads, config, lora), optimizer, frozen=placed(params, device))
    return step, placed(state, device), batch


def flops_of(compiled) -> float | None:
    inner = getattr(compiled, "f", compiled)  # a LoRA step's WithFrozen holds the compiled program
    try:
        cost = inner.cost_analysis()
    except Exception:  # noqa: BLE001 - a backend without a cost model
        return None
    cost = cost[0] if isinstance(cost, list) else cost
    return (cost or {}).get("flops")


def compile_row(name, target, config, grads, optimizer, batch_size, seq_len, lora=None) -> Row:
    """One step compiled for one device of ``target`` (a TARGETS name)."""
    reason = missing(TARGETS[target])
    if reason:
        return Row(name, target, "skipped", reason=reason)
    start = time.perf_counter()
    try:
        with jax.enable_x64(False):
            device = target_devices(TARGETS[target], 1)[0]
            step, state, batch = step_and_args(config, grads, optimizer, batch_size, seq_len, device, lora)
            compiled = step.lower(state, batch).compile()
    except Exception as error:  # noqa: BLE001 - every row is reported, a refusal with its one line
        said = str(error)
        if "RESOURCE_EXHAUSTED" in said or "Ran out of memory" in said:
            return Row(name, target, "too big", time.perf_counter() - start, reason=oom_line(said))
        first = (said.strip().splitlines() or [""])[0][:200]
        return Row(name, target, "failed", time.perf_counter() - start, reason=f"{type(error).__name__}: {first}")
    return Row(name, target, "compiled", time.perf_counter() - start, MemoryPlan.of(compiled), flops_of(compiled))


def describe(row: Row) -> str:
    head = f"{row.name} {row.target}: {row.stage} in {row.seconds:.0f}s"
    if row.memory:
        m = row.memory
        return (f"{head}: argument {m.argument / GiB:.2f} GiB, temp {m.temp / GiB:.2f}, total {m.total / GiB:.2f}, "
                f"{(row.flops or 0) / 1e12:.2f} TFLOPs")
    return f"{head}: {row.reason}"


def table(rows) -> str:
    out = ["| step | target | arguments GiB | temporaries GiB | total GiB | TFLOPs | compile s |",
           "|---|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        if r.memory:
            m = r.memory
            flops = f"{r.flops / 1e12:.2f}" if r.flops else "n/a"
            cells = [f"{m.argument / GiB:.2f}", f"{m.temp / GiB:.2f}", f"{m.total / GiB:.2f}", flops]
        else:
            cells = [f"{r.stage}: {r.reason}", "", "", ""]
        out.append("| " + " | ".join([r.name, TARGETS[r.target].label, *cells, f"{r.seconds:.0f}"]) + " |")
    return "\n".join(out)


def lora_rows(args, say) -> list[Row]:
    config = get_preset("gpt2", vocab_size=GPT2_VOCAB_SIZE, max_seq_len=max(1024, args.seq_len))
    config = config.replace(compute_dtype="bfloat16", attention_impl=args.attention)
    optimizer = make_optimizer(**settings_for("gpt2").optimizer_kwargs())
    kinds = [("full", None), ("LoRA r8 q,v", LoraConfig(rank=8, alpha=16.0, targets="q,v")),
             ("LoRA r8 all", LoraConfig(rank=8, alpha=16.0, targets="all"))]
    rows = []
    for target in args.targets.split(","):
        for label, lora in kinds:
            for grads in ("manual", "auto"):
                rows.append(compile_row(f"{label}, {GRAD_NAMES[grads]}", target, config, grads, optimizer,
                                        args.batch_size, args.seq_len, lora))
                say(describe(rows[-1]))
    return rows


def moe_rows(args, say) -> list[Row]:
    optimizer = make_optimizer(**settings_for("olmoe-1b-7b").optimizer_kwargs())
    rows = []
    for layers in (int(n) for n in args.moe_layers.split(",")):
        config = get_preset("olmoe-1b-7b").replace(n_layers=layers, compute_dtype="bfloat16",
                                                   attention_impl=args.attention)
        for target in args.targets.split(","):
            for grads in ("manual", "auto"):
                rows.append(compile_row(f"{layers} layers, {GRAD_NAMES[grads]}", target, config, grads,
                                        optimizer, args.batch_size, args.seq_len))
                say(describe(rows[-1]))
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="aot_finetune.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--part", choices=("lora", "moe"), default="lora")
    parser.add_argument("--targets", default=None, help="TARGETS names; default tpu-v5e,h100 (lora), tpu-v5e (moe)")
    parser.add_argument("--batch-size", type=int, default=None, help="default 8 (lora), 1 (moe)")
    parser.add_argument("--seq-len", type=int, default=None, help="default 1024 (lora), 2048 (moe)")
    parser.add_argument("--attention", default="full", help="the attention of every step")
    parser.add_argument("--moe-layers", default="16,2", help="the olmoe-1b-7b stack's depths to compile")
    args = parser.parse_args(argv)
    lora = args.part == "lora"
    args.targets = args.targets or ("tpu-v5e,h100" if lora else "tpu-v5e")
    args.batch_size = args.batch_size or (8 if lora else 1)
    args.seq_len = args.seq_len or (1024 if lora else 2048)
    start = time.perf_counter()
    say = lambda line: print(line, flush=True)  # noqa: E731
    say(f"{args.part}: batch {args.batch_size} x {args.seq_len}, bfloat16 products, {args.attention} attention")
    rows = (lora_rows if lora else moe_rows)(args, say)
    print("\n" + table(rows))
    print(f"\nwall time {time.perf_counter() - start:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
