"""Full fine-tune against LoRA: one AdamW train step's XLA memory and FLOPs, and its time.

    python experiments/lora_memory.py                          # SmolLM2-135M's shape, B 1, T 256
    python experiments/lora_memory.py --layers 4 --seq-len 64  # a quicker look

For each of full (every parameter) and LoRA (rank 8 on q, v; and on every projection), with
manual and jax.grad gradients: the compiled step's memory_analysis (arguments: params,
optimizer state and batch; temporaries; outputs) and cost_analysis FLOPs, and the median
wall time of a few steps. Random weights of the preset's shape (the numbers do not depend
on the values). Prints a markdown table (docs/finetune.md quotes one).
"""

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxformer.model.config import PRESETS
from jaxformer.model.lora import LoraConfig, init_adapters
from jaxformer.model.params import init_params
from jaxformer.training.adapters import lora_grad_source
from jaxformer.training.step import grad_source, init_state, make_train_step

MB = 2 ** 20


def measure(name, grad_fn, params, batch, steps, frozen=None):
    opt = optax.adamw(1e-4)
    step = make_train_step(grad_fn, opt, donate=False, frozen=frozen)
    state = init_state(params, opt)
    compiled = step.lower(state, batch).compile()
    mem, cost = compiled.memory_analysis(), compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    times = []
    for _ in range(steps + 1):
        t0 = time.perf_counter()
        state, metrics = compiled(state, batch)
        jax.block_until_ready(metrics["loss"])
        times.append(time.perf_counter() - t0)
    return (f"| {name} | {mem.argument_size_in_bytes / MB:,.0f} | {mem.temp_size_in_bytes / MB:,.0f} | "
            f"{mem.output_size_in_bytes / MB:,.0f} | {cost['flops'] / 1e9:,.1f} | "
            f"{np.median(times[1:]):.2f} |")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="smollm")
    p.add_argument("--vocab-size", type=int, default=49152)
    p.add_argument("--layers", type=int, default=0, help="0: the preset's")
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--steps", type=int, default=3)
    args = p.parse_args()
    config = PRESETS[args.preset].replace(vocab_size=args.vocab_size, max_seq_len=max(args.seq_len, 16),
                                          **({"n_layers": args.layers} if args.layers else {}))
    params = init_params(jax.random.PRNGKey(0), config)
    rng = np.random.default_rng(0)
    ids = jnp.asarray(rng.integers(0, config.vocab_size, (args.batch_size, args.seq_len + 1)), jnp.int32)
    batch = {"inputs": ids[:, :-1], "targets": ids[:, 1:]}
    print(f"{args.preset} shape, {config.n_layers} layers, batch {args.batch_size} x {args.seq_len}, "
          f"{jax.devices()[0].platform}, AdamW")
    print("| step | arguments MiB | temporaries MiB | outputs MiB | GFLOPs | s / step |")
    print("|---|---:|---:|---:|---:|---:|")
    for kind in ("manual", "auto"):
        print(measure(f"full, {kind}", grad_source(kind, config), params, batch, args.steps), flush=True)
    for targets in ("q,v", "all"):
        lora = LoraConfig(rank=8, alpha=16.0, targets=targets)
        adapters = init_adapters(jax.random.PRNGKey(1), params, lora)
        for kind in ("manual", "auto"):
            print(measure(f"LoRA r8 {targets}, {kind}", lora_grad_source(kind, config, lora),
                          adapters, batch, args.steps, frozen=params), flush=True)


if __name__ == "__main__":
    main()
