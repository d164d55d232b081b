"""A LoRA step over a frozen base held quantized (jaxformer/model/quantized.py) against the same
step over a float32 base: XLA's memory plan of each, compiled and not run.

- SmolLM2-135M's shape on this machine's CPU (float32 products, batch 4 x 512, LoRA r8 on q, v).
- Llama-3-8B's shape (vocabulary 128256, d_model 4096, 32 layers, GQA 32/8 heads, d_ff 14336),
  ahead of time for one H100 80GB (JAX's CUDA plugin: ``python -m jaxformer.tools.aot.plugin``,
  then its folder on PYTHONPATH) and one TPU v5e chip (libtpu); bfloat16 products, batch 1 x 2048,
  LoRA r16 on every projection, remat "block".

The base's block projections are held as float32, int8 (per output column), or GGUF Q8_0 /
Q4_0 / Q4_1 blocks; the embeddings, norms and head stay float32. "arguments" holds the frozen
base, the adapters' AdamW state and the batch; "temporaries" is what the step allocates beside them.

    python experiments/quantized_memory.py                       # every row
    python experiments/quantized_memory.py --rows smollm2        # the CPU rows alone
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # the accelerators' plugins only compile here
os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import argparse  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from jax.sharding import SingleDeviceSharding  # noqa: E402

from jaxformer.model.config import ModelConfig  # noqa: E402
from jaxformer.model.lora import LoraConfig, init_adapters  # noqa: E402
from jaxformer.model.params import init_params  # noqa: E402
from jaxformer.model.quantized import BLOCK, PACKED, PROJECTIONS, Quantized  # noqa: E402
from jaxformer.tools.aot.targets import TARGETS, missing, target_devices  # noqa: E402
from jaxformer.training.adapters import lora_grad_source  # noqa: E402
from jaxformer.training.step import init_state, make_train_step  # noqa: E402

GiB, MiB = 2**30, 2**20
LLAMA = dict(norm="pre", norm_type="rms", positions="rope", mlp="gated", activation="silu", bias=False,
             head_bias=False, causal=True)
SMOLLM2 = ModelConfig(vocab_size=49152, d_model=576, n_heads=9, n_kv_heads=3, n_layers=30, d_ff=1536,
                      max_seq_len=8192, rope_theta=100000.0, tie_embeddings=True, **LLAMA)
LLAMA3_8B = ModelConfig(vocab_size=128256, d_model=4096, n_heads=32, n_kv_heads=8, n_layers=32, d_ff=14336,
                        max_seq_len=8192, rope_theta=500000.0, tie_embeddings=False, compute_dtype="bfloat16",
                        remat="block", **LLAMA)
KINDS = ("float32", "int8", "q8_0", "q4_1", "q4_0")


def held(params, kind):
    """Abstract params with the block projections (L, I, O) held as ``kind``."""
    if kind == "float32":
        return params
    blocks = {g: dict(v) for g, v in params["blocks"].items()}
    for group, names in PROJECTIONS:
        for n in names:
            w = blocks.get(group, {}).get(n)
            if w is None or len(w.shape) != 3:
                continue
            L, I, O = w.shape
            rows = I // 2 if kind in PACKED else I
            codes = jax.ShapeDtypeStruct((L, rows, O), jnp.uint8 if kind in PACKED else jnp.int8)
            if kind == "int8":
                scales = jax.ShapeDtypeStruct((L, 1, O), jnp.float32)
            else:
                scales = jax.ShapeDtypeStruct((L, I // BLOCK, O), jnp.float16)
            blocks[group][n] = Quantized(codes, scales, scales if kind == "q4_1" else None, kind, "float32")
    return {**params, "blocks": blocks}


def placed(tree, device):
    one = SingleDeviceSharding(device)
    return jax.tree_util.tree_map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=one), tree)


def compile_step(config, lora, kind, batch_size, seq_len, device):
    """The LoRA step (manual gradients, AdamW) over a base held as ``kind``, compiled for ``device``."""
    optimizer = optax.adamw(1e-4)
    params = jax.eval_shape(lambda: init_params(jax.random.PRNGKey(0), config, dtype=jnp.float32))
    adapters = jax.eval_shape(lambda p: init_adapters(jax.random.PRNGKey(1), p, lora), params)
    state = jax.eval_shape(lambda a: init_state(a, optimizer), adapters)
    batch = {k: jax.ShapeDtypeStruct((batch_size, seq_len), jnp.int32) for k in ("inputs", "targets")}
    step = make_train_step(lora_grad_source("manual", config, lora), optimizer,
                           frozen=placed(held(params, kind), device))
    return step.lower(placed(state, device), placed(batch, device)).compile(), held(params, kind)


def param_bytes(params) -> int:
    return sum(int(jnp.prod(jnp.array(s.shape))) * jnp.dtype(s.dtype).itemsize
               for s in jax.tree_util.tree_leaves(params))


def row(model, target_label, config, lora, kind, batch_size, seq_len, device, say):
    start = time.perf_counter()
    try:
        compiled, params = compile_step(config, lora, kind, batch_size, seq_len, device)
    except Exception as error:  # noqa: BLE001 - every row is reported
        said = str(error).strip().splitlines() or [""]
        say(f"{model} {target_label} {kind}: {type(error).__name__}: {said[0][:200]}")
        return [model, target_label, kind, "", "", "", "", f"{type(error).__name__}: {said[0][:120]}"]
    mem = getattr(compiled, "f", compiled).memory_analysis()  # a LoRA step's WithFrozen holds the program
    cells = [model, target_label, kind, f"{param_bytes(params) / MiB:,.0f}",
             f"{mem.argument_size_in_bytes / MiB:,.0f}", f"{mem.temp_size_in_bytes / MiB:,.0f}",
             f"{(mem.argument_size_in_bytes + mem.temp_size_in_bytes + mem.output_size_in_bytes - mem.alias_size_in_bytes) / MiB:,.0f}",
             f"compiled in {time.perf_counter() - start:.0f} s"]
    say(" | ".join(cells))
    return cells


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="quantized_memory.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="smollm2,h100,tpu-v5e", help="smollm2 (CPU), h100, tpu-v5e")
    parser.add_argument("--kinds", default=",".join(KINDS))
    args = parser.parse_args(argv)
    say = lambda line: print(line, flush=True)  # noqa: E731
    rows, kinds = args.rows.split(","), args.kinds.split(",")
    out = []
    with jax.enable_x64(False):
        if "smollm2" in rows:
            lora = LoraConfig(rank=8, alpha=16.0, targets="q,v")
            for kind in kinds:
                out.append(row("SmolLM2-135M", "CPU", SMOLLM2, lora, kind, 4, 512, jax.devices("cpu")[0], say))
        for name in (r for r in rows if r in TARGETS):
            reason = missing(TARGETS[name])
            if reason:
                say(f"{name}: skipped ({reason})")
                continue
            device = target_devices(TARGETS[name], 1)[0]
            lora = LoraConfig(rank=16, alpha=32.0, targets="all")
            for kind in kinds:
                out.append(row("Llama-3-8B shape", TARGETS[name].label, LLAMA3_8B, lora, kind, 1, 2048, device, say))
    print("\n| model | device | base held as | params MiB | arguments MiB | temporaries MiB | total MiB | |")
    print("|---|---|---|---:|---:|---:|---:|---|")
    for cells in out:
        print("| " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
