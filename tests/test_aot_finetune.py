"""experiments/aot_finetune.py at a tiny size: a LoRA step (the frozen base an argument of the
program) and an MoE step (ragged_dot) compiled for a TPU v5e chip, in a subprocess (libtpu
loads there only)."""

import importlib.util
import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]

COMPILE = """
import importlib.util, json, sys
spec = importlib.util.spec_from_file_location("aot_finetune", sys.argv[1])
m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)
import optax
from jaxformer.model.config import get_preset
from jaxformer.model.lora import LoraConfig
opt = optax.adamw(1e-3)
rows = {
    "full": m.compile_row("full", "tpu-v5e", get_preset("llama-tiny"), "manual", opt, 2, 16),
    "lora": m.compile_row("lora", "tpu-v5e", get_preset("llama-tiny"), "manual", opt, 2, 16,
                          LoraConfig(rank=2, targets="q,v")),
    "moe": m.compile_row("moe", "tpu-v5e", get_preset("tiny-moe"), "manual", opt, 2, 16),
}
print(json.dumps({k: [r.stage, r.reason, r.memory.argument if r.memory else 0] for k, r in rows.items()}))
"""


def test_a_tiny_lora_and_moe_step_compile_for_a_tpu_v5e():
    if importlib.util.find_spec("libtpu") is None:
        pytest.skip("libtpu is not installed (pip install 'jaxformer[tpu]'): the TPU compile check needs it")
    env = dict(os.environ, TPU_SKIP_MDS_QUERY="1", ALLOW_MULTIPLE_LIBTPU_LOAD="1", JAX_PLATFORMS="cpu")
    done = subprocess.run([sys.executable, "-c", COMPILE, str(ROOT / "experiments" / "aot_finetune.py")],
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert all(stage == "compiled" for stage, _, _ in out.values()), out
    # LoRA's arguments: the frozen params once and the adapters' state, against the full
    # step's params and AdamW's two moments
    full, lora = out["full"][2], out["lora"][2]
    assert full / 3 < lora < full / 2, out
