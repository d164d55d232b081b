#!/usr/bin/env bash
# The checks to run first on a GPU machine, in one call of at most 8 minutes on one H100 or
# H200: the machine and versions, `jaxformer doctor` (every check; its JSON report too), the
# GPU contest of docs/benchmark.md at GPT-2 small's shape and at SmolLM-135M's, one more row
# at GPT-2's real vocabulary, and 60 training steps at each shape (their tokens/s).
#
#   bash experiments/gpu_checks.sh [OUT_DIR]      (default runs/gpu)
#
# Steps, in order (the contest first, so that a short call still measures it), each with its own
# time limit in seconds (environment variable = default):
#
#   machine        MACHINE_S=45         nvidia-smi, Python, JAX and its devices, PyTorch, cores, load
#   compare_cudnn  COMPARE_S=60         experiments/compare_grads.py, gpt2 and smollm at 1 layer, B2
#                                       T128, attention_impl cudnn, bf16: the hand-derived step with
#                                       cuDNN's kernels against jax.grad, both against float32 full attention
#   bench_gpt2     BENCH_GPT2_S=120     gpt2 bf16 B16 T1024, --attention pallas,cudnn (the manual step
#                                       with each, jax.grad with cuDNN's), PyTorch eager and
#                                       torch.compile (the contest of docs/benchmark.md)
#   train_gpt2     TRAIN_GPT2_S=70      jaxformer train, gpt2 bf16 B16 T1024, TRAIN_ATTENTION=cudnn,
#                                       TRAIN_STEPS=60 steps
#   bench_smollm   BENCH_SMOLLM_S=150   smollm bf16 B8 T2048, --attention pallas,cudnn, PyTorch
#   profile_gpt2   PROFILE_S=110        experiments/step_profile.py at the gpt2 shape: where the
#                                       manual + cudnn step's and torch.compile's time goes
#   bench_vocab    BENCH_VOCAB_S=80     the gpt2 shape with --vocab-size 50304 (GPT-2's 50257 tokens
#                                       padded to 64), pallas and cudnn against PyTorch
#   doctor         DOCTOR_S=75          jaxformer doctor --out OUT_DIR/doctor.json
#   train_smollm   TRAIN_SMOLLM_S=100   jaxformer train, smollm bf16 B8 T2048, TRAIN_ATTENTION, 60 steps
#   profile_norms  PROFILE_NORMS_S=60   the manual + cudnn step profiled again with its norms as XLA's
#                                       fusions (--norms xla): against profile_gpt2's, what the norms'
#                                       Pallas kernels (manual_grads/norms.py) buy
#
# and all of them under one deadline, TOTAL_S=470: a step gets the smaller of its own limit
# and the time left (less 10 s for the kill below), and is skipped when fewer than MIN_S=20
# seconds are left. A step past its limit gets SIGTERM, then SIGKILL 5 s later, and the next
# one starts. So the call ends within 8 minutes (480 s) even when a step hangs, and a slow
# step costs the later ones their time, never the whole run.
#
# The benches' time goes to compiling (a GPU's manual step unrolls its layers: SmolLM's 30
# compile for longer), so they time few steps: BENCH_ROUNDS=3 interleaved rounds of
# BENCH_STEPS=5 after BENCH_WARMUP=2 at GPT-2's shape, SMOLLM_ROUNDS=2 rounds of
# SMOLLM_STEPS=3 after 1 at SmolLM's (the contest's defaults: 7, 5, 3), and they leave out
# the compile-time-vs-depth check (GPT2_DEPTHS=2,12 puts it back at GPT-2's shape). Each
# training run logs every 10 steps, validates once at the end on one batch and writes one
# checkpoint, at the end; its summary line gives the steady-state tokens/s. The order lets
# each training run use the Pallas launch its bench tuned (the launch table in
# ~/.cache/jaxformer).
#
# OUT_DIR gets steps.txt (each step's exit code and seconds; 124 or 137: it hit its limit),
# one log per step, doctor.json, the benches' folders (report.md, report.json, bench.png)
# and the training runs' folders (metrics.jsonl, config.toml, loss.png, the checkpoint).
# It installs nothing: the source tree goes on PYTHONPATH, and the project's dependencies
# must already be there (a CUDA image with JAX, optax, chex, orbax; PyTorch for its
# contestants, which the bench leaves out, saying so, where it is missing).
#
# DOCTOR_EXTRA, BENCH_EXTRA, TRAIN_EXTRA and PROFILE_EXTRA are appended to every doctor, bench,
# train and profile command (a flag given twice takes its last value): a dry run of every step on a CPU is
#
#   TOTAL_S=1200 DOCTOR_EXTRA=--quick TRAIN_STEPS=2 \
#     BENCH_EXTRA="--batch-size 2 --seq-len 64 --n-layers 1 --no-torch-compile" \
#     TRAIN_EXTRA="--batch-size 2 --seq-len 64 --n-layers 1" \
#     PROFILE_EXTRA="--batch-size 2 --seq-len 64 --n-layers 1" PROFILE_CONTESTANTS=manual_full bash experiments/gpu_checks.sh /tmp/gpu-dry
set -uo pipefail
out=${1:-runs/gpu}
mkdir -p "$out"
py=${PYTHON:-python3}
export PY=$py PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
TOTAL_S=${TOTAL_S:-470}
MIN_S=${MIN_S:-20}
steps=${TRAIN_STEPS:-60}
rounds=(--rounds "${BENCH_ROUNDS:-3}" --steps "${BENCH_STEPS:-5}" --warmup "${BENCH_WARMUP:-2}")
smollm_rounds=(--rounds "${SMOLLM_ROUNDS:-2}" --steps "${SMOLLM_STEPS:-3}" --warmup 1)
gpt2=(--preset gpt2 --compute-dtype bfloat16 --batch-size 16 --seq-len 1024)
smollm=(--preset smollm --compute-dtype bfloat16 --batch-size 8 --seq-len 2048)
train=(--attention-impl "${TRAIN_ATTENTION:-cudnn}" --steps "$steps" --corpus default --eval-batches 1 --ckpt-every 0
       --keep-checkpoints 1 --log-every 10 --no-progress)
read -ra doctor_extra <<< "${DOCTOR_EXTRA:-}"
read -ra bench_extra <<< "${BENCH_EXTRA:-}"
read -ra train_extra <<< "${TRAIN_EXTRA:-}"
read -ra profile_extra <<< "${PROFILE_EXTRA:-}"
: > "$out/steps.txt"

step() {  # step NAME LIMIT_S command...: run it under its limit, its output in OUT_DIR/NAME.log
  local name=$1 limit=$2 t0=$SECONDS rc
  shift 2
  local left=$((TOTAL_S - SECONDS - 10))
  if ((left < MIN_S)); then
    echo "$name: skipped, $((TOTAL_S - SECONDS)) s left of TOTAL_S=$TOTAL_S" | tee -a "$out/steps.txt"
    return
  fi
  ((limit > left)) && limit=$left
  echo "== $name (limit $limit s, at $SECONDS s): $*"
  timeout -k 5 "$limit" "$@" 2>&1 | tee "$out/$name.log"
  rc=${PIPESTATUS[0]}
  echo "$name: exit $rc in $((SECONDS - t0)) s (limit $limit s)" | tee -a "$out/steps.txt"
}

machine() {
  date -u
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv || true
  "$PY" -c "import jax, jaxlib, sys; print('python', sys.version.split()[0], 'jax', jax.__version__,
'jaxlib', jaxlib.__version__); print(jax.devices(), [d.device_kind for d in jax.devices()])"
  "$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())" || true
  nproc; uptime; df -h . | tail -1
}
export -f machine
step machine "${MACHINE_S:-45}" bash -c machine

step compare_cudnn "${COMPARE_S:-60}" "$py" experiments/compare_grads.py --preset gpt2 smollm --n-layers 1 \
  --attention-impl cudnn --compute-dtype bfloat16 --batch-size 2 --seq-len 128 --repeats 1 --out "$out/compare_cudnn"

step bench_gpt2 "${BENCH_GPT2_S:-120}" "$py" -m jaxformer bench "${gpt2[@]}" --attention pallas,cudnn \
  "${rounds[@]}" --depths "${GPT2_DEPTHS:-none}" --out "$out/bench_gpt2" ${bench_extra[@]+"${bench_extra[@]}"}

rm -rf "$out/train_gpt2" "$out/train_smollm"  # this script's own runs of a previous call
step train_gpt2 "${TRAIN_GPT2_S:-70}" "$py" -m jaxformer train "${gpt2[@]}" "${train[@]}" \
  --out "$out/train_gpt2" ${train_extra[@]+"${train_extra[@]}"}

step bench_smollm "${BENCH_SMOLLM_S:-150}" "$py" -m jaxformer bench "${smollm[@]}" --attention pallas,cudnn \
  "${smollm_rounds[@]}" --depths none --out "$out/bench_smollm" ${bench_extra[@]+"${bench_extra[@]}"}

step profile_gpt2 "${PROFILE_S:-110}" "$py" experiments/step_profile.py "${gpt2[@]}" \
  --contestants "${PROFILE_CONTESTANTS:-manual_cudnn,torch_compile}" --steps 5 --top 30 \
  ${profile_extra[@]+"${profile_extra[@]}"}

step bench_vocab "${BENCH_VOCAB_S:-80}" "$py" -m jaxformer bench "${gpt2[@]}" --vocab-size 50304 \
  --attention pallas,cudnn "${rounds[@]}" --depths none --out "$out/bench_vocab" \
  ${bench_extra[@]+"${bench_extra[@]}"}

step doctor "${DOCTOR_S:-75}" "$py" -m jaxformer doctor --out "$out/doctor.json" \
  ${doctor_extra[@]+"${doctor_extra[@]}"}

step train_smollm "${TRAIN_SMOLLM_S:-100}" "$py" -m jaxformer train "${smollm[@]}" "${train[@]}" \
  --out "$out/train_smollm" ${train_extra[@]+"${train_extra[@]}"}

step profile_norms "${PROFILE_NORMS_S:-60}" "$py" experiments/step_profile.py "${gpt2[@]}" \
  --contestants manual_cudnn --norms xla --steps 5 --top 30 ${profile_extra[@]+"${profile_extra[@]}"}

echo "== done in $SECONDS s"
cat "$out/steps.txt"
uptime
