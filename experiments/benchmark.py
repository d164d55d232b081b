"""Benchmark one training step: manual vs automatic gradients vs the same model in PyTorch.

    python experiments/benchmark.py --preset loopos
    python experiments/benchmark.py --preset loopos --d-model 512 --n-layers 6 --d-ff 2048 \
        --max-seq-len 256 --batch-size 8 --seq-len 256 --out runs/bench-mid
    python experiments/benchmark.py --help

Writes report.json, report.md and bench.png to --out (default runs/bench). The
command line is jaxformer/cli/bench.py (also `jaxformer bench`), the benchmark
jaxformer/tools/bench.py.
"""

import sys

from jaxformer.cli.bench import main

if __name__ == "__main__":
    sys.exit(main(prog="benchmark.py"))
