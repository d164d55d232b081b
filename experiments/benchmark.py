"""Benchmark one training step: manual vs automatic gradients over each attention
implementation vs the same model in PyTorch, on the device JAX sees.

    python experiments/benchmark.py --preset loopos
    python experiments/benchmark.py --preset gpt2 --compute-dtype bfloat16 --batch-size 16 --seq-len 1024
    python experiments/benchmark.py --shapes "d_model=64,128,256 seq_len=64,256" --out runs/sweep
    python experiments/benchmark.py --help

Writes report.json, report.md and bench.png (a sweep: bench_sweep.png) to --out
(default runs/bench); docs/benchmark.md explains them. The command line is
jaxformer/cli/bench.py (also `jaxformer bench`), the benchmark jaxformer/tools/bench/run.py.
"""

import sys

from jaxformer.cli.bench import main

if __name__ == "__main__":
    sys.exit(main(prog="benchmark.py"))
