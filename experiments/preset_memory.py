"""The memory check's figure for a preset at its own vocabulary: XLA's plan of the compiled train
step (jaxformer/training/memory_check.py, step_planner: what `jaxformer train` checks against the
free memory before the first step), compiled, never run, so no weights are built.

    python experiments/preset_memory.py NAME [BATCH] [SEQ_LEN] [GRADS]    # default 1 512 auto

GRADS defaults to auto, jax.grad's step (docs/models.md's column); `jaxformer train` plans the
manual step by default: GRADS manual gives its figure.

(`jaxformer train` itself takes the vocabulary from its tokenizer; this keeps the preset's.)
"""
import sys, time
import numpy as np
from jaxformer.model.config import PRESETS
from jaxformer.observe.words import format_bytes
from jaxformer.training.memory_check import step_planner
from jaxformer.training.settings import settings_for
from jaxformer.training.sharding import make_mesh
from jaxformer.training.step import StepSpec
name = sys.argv[1]
B, T = (int(sys.argv[2]), int(sys.argv[3])) if len(sys.argv) > 3 else (1, 512)
grads = sys.argv[4] if len(sys.argv) > 4 else "auto"
settings = settings_for(name, batch_size=B, seq_len=T, grads=grads)
config = PRESETS[name]
spec = StepSpec.of_run(settings, config, make_mesh())
batch = {"inputs": np.zeros((B, T), np.int32), "targets": np.zeros((B, T), np.int32)}
t0 = time.perf_counter()
plan = step_planner(spec, batch, {})(config)
print(f"{name} B={B} T={T} grads={grads} {settings.optimizer} {settings.dtype}: the step needs "
      f"{format_bytes(plan.total)} per device (arguments {format_bytes(plan.argument)}, temporaries "
      f"{format_bytes(plan.temp)}); compiled in {time.perf_counter() - t0:.0f} s")
