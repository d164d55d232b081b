"""GPT-2 small's training step compiled for devices this machine does not have
(jaxformer/tools/aot/steps.py): the gpt2 preset with GPT-2's 50257-token vocabulary (--vocab-size)
and its recipe's AdamW, float32 master params, bfloat16 products, batch 8 x 1024.

- TPU v5e, one chip (libtpu's topology; jax[tpu]): manual and jax.grad gradients with
  full, blockwise and pallas attention, XLA's memory plan of each, and the largest batch
  that fits the chip's 16 GiB for the variant that needs the least.
- cuda: the same variants and cuDNN's lowered (the Pallas kernels as Triton calls); with
  JAX's CUDA plugin (jax[cuda12]) also compiled for an H100 80GB, deviceless, with its
  largest batch.

    python experiments/aot_memory.py                       # everything: many minutes
    python experiments/aot_memory.py --no-fit --no-gpu     # the TPU table only
    python experiments/aot_memory.py --vocab-size 256      # the byte tokenizer's vocabulary
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # the accelerators' plugins only compile here
os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")  # no cloud metadata server to ask
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import argparse  # noqa: E402
import time  # noqa: E402

from jaxformer.data.hf_tokenizers import GPT2_VOCAB_SIZE  # noqa: E402
from jaxformer.model.config import get_preset  # noqa: E402
from jaxformer.tools.aot import steps as aot  # noqa: E402
from jaxformer.tools.aot.report import describe, table  # noqa: E402
from jaxformer.tools.aot.targets import TARGETS, missing  # noqa: E402
from jaxformer.training.optim import make_optimizer  # noqa: E402
from jaxformer.training.settings import settings_for  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="aot_memory.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab-size", type=int, default=GPT2_VOCAB_SIZE,
                        help="default GPT-2's; 256 is the byte tokenizer `jaxformer train` uses by default")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--dtype", default="bfloat16", choices=aot.DTYPES, help="compute dtype")
    parser.add_argument("--fit-multiple", type=int, default=1, help="the largest batch, to a multiple of this")
    parser.add_argument("--no-fit", action="store_true", help="skip the largest-batch bisections")
    parser.add_argument("--no-gpu", action="store_true", help="skip the H100 compiles")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    config = get_preset("gpt2", vocab_size=args.vocab_size, max_seq_len=max(1024, args.seq_len))
    optimizer = make_optimizer(**settings_for("gpt2").optimizer_kwargs())
    todo = aot.variants(attentions=("full", "blockwise", "pallas"), dtypes=(args.dtype,), meshes=(None,))
    cudnn = aot.variants(attentions=("cudnn",), dtypes=(args.dtype,), meshes=(None,))  # its pair and jax.grad
    shape = dict(batch_size=args.batch_size, seq_len=args.seq_len)
    print(f"gpt2 (vocab {config.vocab_size}), {args.dtype} products, batch {args.batch_size} x {args.seq_len}",
          flush=True)

    say = lambda line: print(line, flush=True)  # noqa: E731
    lowered = aot.run(config, todo + cudnn, ["cuda", "tpu"], optimizer, say=say, **shape)
    targets = ["tpu-v5e"] + ([] if args.no_gpu else ["h100"])
    compiled = {}
    for target in targets:
        if missing(TARGETS[target]):
            print(f"{target}: {missing(TARGETS[target])}", flush=True)
            continue
        compiled[target] = aot.run(config, todo + (cudnn if target == "h100" else []), [target], optimizer,
                                   say=say, **shape)
    print("\n## lowered\n\n" + table(lowered))
    for target, outcomes in compiled.items():
        print(f"\n## compiled for {TARGETS[target].label}\n\n" + table(outcomes), flush=True)
    if not args.no_fit:
        for target, outcomes in compiled.items():
            fitting = [o for o in outcomes if o.stage == "compiled"]
            if not fitting:
                continue
            best = min(fitting, key=lambda o: o.memory.total)
            batch, outcome, tried = aot.largest_batch(
                config, best.variant, target, optimizer, seq_len=args.seq_len, start=args.batch_size,
                multiple=args.fit_multiple, say=say)
            print(f"\n## largest batch on one {TARGETS[target].label}: {best.variant.name}\n\n"
                  + table(tried) + f"\n\nlargest batch that fits: {batch} x {args.seq_len}"
                  + (f" ({describe(outcome)})" if outcome else ""), flush=True)
    print(f"\nwall time {time.perf_counter() - start:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
