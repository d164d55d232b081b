"""The main job: hand-derived gradients against jax.grad for the presets, with reports.

    python experiments/compare_grads.py                        # loopos, sunfish, cllm, float32
    python experiments/compare_grads.py --dtype float64 --fd   # plus finite differences
    python experiments/compare_grads.py --compute-dtype bfloat16   # bfloat16 products, vs a float32 reference
    python experiments/compare_grads.py --help

Writes report.json, report.md and rel_errors.png to --out (default runs/compare_grads);
exits 1, naming the leaf, when any gradient is over tolerance. The command line is
jaxformer/cli/compare_grads.py (also `jaxformer compare-grads`), the comparison
jaxformer/tools/compare/grads.py and compare_fd.py, the reports compare_report.py and
compare_plot.py.
"""

import sys

from jaxformer.cli.compare_grads import main

if __name__ == "__main__":
    sys.exit(main(prog="compare_grads.py"))
