#!/usr/bin/env bash
# The checks to run first on a GPU machine, in one go: the machine and versions, `jaxformer doctor`
# (every check; its JSON report too), then the GPU contest of docs/benchmark.md
# (`jaxformer bench --preset gpt2 --compute-dtype bfloat16 --batch-size 16 --seq-len 1024`).
#
#   bash experiments/gpu_checks.sh [OUT_DIR]      (default runs/gpu)
#
# Each step has its own time limit (DOCTOR_S, BENCH_S seconds) so that one slow step leaves the
# others their turn; the logs, doctor.json and the bench's folder (report.md, report.json,
# bench.png) go to OUT_DIR: seven files.
# It installs nothing from the network: the project goes in with `pip install --no-deps -e .`
# (its dependencies must already be there, as on a CUDA image with JAX, PyTorch, optax, chex, orbax).
set -uo pipefail
out=${1:-runs/gpu}
mkdir -p "$out"
py=${PYTHON:-python3}
export PYTHONUNBUFFERED=1

{
  date -u
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv || true
  "$py" -c "import jax, jaxlib, sys; print('python', sys.version.split()[0], 'jax', jax.__version__, 'jaxlib', jaxlib.__version__); print(jax.devices(), [d.device_kind for d in jax.devices()])"
  "$py" -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())" || true
  nproc; uptime
} 2>&1 | tee "$out/machine.txt"

"$py" -m pip install -q --no-deps --no-build-isolation -e . >/tmp/jaxformer-install.log 2>&1 \
  || { echo "pip install -e . failed (/tmp/jaxformer-install.log); running from the source tree"; export PYTHONPATH=$PWD; }

echo "== jaxformer doctor"
timeout "${DOCTOR_S:-240}" "$py" -m jaxformer doctor --out "$out/doctor.json" 2>&1 | tee "$out/doctor.log"
echo "doctor exit ${PIPESTATUS[0]}"

echo "== jaxformer bench (gpt2, bfloat16, B16 T1024)"
timeout "${BENCH_S:-300}" "$py" -m jaxformer bench --preset gpt2 --compute-dtype bfloat16 \
  --batch-size 16 --seq-len 1024 --out "$out/bench" 2>&1 | tee "$out/bench.log"
echo "bench exit ${PIPESTATUS[0]}"
uptime
