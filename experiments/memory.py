"""Memory of the lean manual backward (blockwise attention, chunked loss, block recompute)
against jax.value_and_grad of the plain model, and its step time against the full manual
backward; XLA's memory plan of each compiled gradient (jaxformer/tools/memory.py; the
command line is jaxformer/cli/memory.py).

    python experiments/memory.py                        # B 4, T 1024 and 2048, D 256, 4 heads, 2 layers
    python experiments/memory.py --attention-block 256 --loss-chunk 512 --no-timing

Prints, from one run:
    (a) temp(lean manual) / temp(autodiff) at T            target <= 1/4
    (b) temp at 2T / temp at T for each source             blockwise and lean: target <= 2.2
    (c) step time, lean manual / full manual at T          target <= 1.3 (interleaved rounds,
                                                           warm-up excluded, medians)
"""

import sys

from jaxformer.cli.memory import main

if __name__ == "__main__":
    sys.exit(main(prog="memory.py"))
