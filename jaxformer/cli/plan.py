"""``jaxformer memory``: plan a pod ahead of time. Every mesh of ``--devices`` devices the model
takes, its train step compiled for the target without the devices (jaxformer/tools/aot/plan.py:
a TPU v5e slice of libtpu's topology, or deviceless H100s through JAX's CUDA plugin), a table of
XLA's memory per device and the bytes the collectives move per step, and the mesh proposed for
``jaxformer train --mesh``: the one that fits with the fewest collective bytes.

(cli/memory.py is another command: experiments/memory.py's.)
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import sys
import tempfile

import jax

from jaxformer.cli.args import UsageError, error_line, positive_int
from jaxformer.cli.flags import add_model_flags, model_overrides
from jaxformer.model.config import ATTENTION_IMPLS, PRESET_TRAINING, PRESETS, get_preset
from jaxformer.model.params import count_params, init_params
from jaxformer.tools.aot import plan as aot_plan
from jaxformer.tools.aot.steps import Variant, absent
from jaxformer.tools.aot.targets import TARGETS, missing, target_devices, tpu_topology
from jaxformer.training.settings import default_grads

GiB = 2**30
DEFAULT_SEQ_LEN = 2048  # a preset without a training recipe's: its max_seq_len, at most this
SHOWN = 6  # refused meshes named per reason

DESCRIPTION = """\
Plan a pod ahead of time: compile the train step for every mesh (data x fsdp x expert x tensor,
x context with --context) of --devices devices of --target that the model takes, without having the devices (XLA's own
compiler: libtpu for a TPU v5e slice, JAX's CUDA plugin for H100s), and print per mesh XLA's
memory per device, whether it fits the device's memory, the bytes its collectives move per step
(all-reduce, all-gather, reduce-scatter, all-to-all, collective-permute results per device) and
the compile time; then the mesh that fits with the fewest collective bytes, for `jaxformer train
--mesh`. The step is `jaxformer train`'s: its gradients (manual by default), float32 params,
bfloat16 products, AdamW; the layers scanned. The preset's own vocabulary is kept."""

EPILOG = """\
examples:
  jaxformer memory --preset llama3.2-1b --seq-len 8192 --devices 16 --target tpu-v5e
  PYTHONPATH=.venv/cuda-plugin jaxformer memory --preset mistral-7b --seq-len 4096 --devices 8 --target h100
  PYTHONPATH=.venv/cuda-plugin jaxformer memory --preset llama3.2-1b --d-model 8192 --n-layers 80 \\
      --n-heads 64 --d-ff 28672 --no-tie-embeddings --remat block --seq-len 4096 --devices 32 \\
      --target h100 --mesh fsdp=16
        a shape without a preset (Llama 3 70B's: the model flags change the preset's), one mesh
        (fsdp=16: data takes the other 2)
  jaxformer memory --preset llama3.2-1b --seq-len 8192 --devices 8 --target tpu-v5e --attention blockwise \
      --remat block --mesh fsdp=8 --mesh fsdp=4,context=2
        the sequence split over 2 chips (ring attention, each visit's keys a block at a time)

A TPU v5e slice has 1, 4, 8, 16, 32, 64, 128 or 256 chips; H100s any number. The H100
compiles need JAX's CUDA plugin importable (python -m jaxformer.tools.aot.plugin puts it in
.venv/cuda-plugin: run with PYTHONPATH=.venv/cuda-plugin). Exit code 1 when no mesh fits.
"""


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("memory", help="plan a pod: every mesh's memory and collectives, compiled "
                                             "ahead of time (see its --help)",
                              description=DESCRIPTION, epilog=EPILOG,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", choices=list(PRESETS), required=True, metavar="NAME",
                   help="the model (any preset of `jaxformer presets`; the model flags below change its shape)")
    p.add_argument("--devices", type=positive_int, required=True, metavar="N", help="devices in the pod")
    p.add_argument("--target", choices=list(TARGETS), default="tpu-v5e", help="the device (default tpu-v5e)")
    p.add_argument("--batch-size", type=positive_int, metavar="B",
                   help="the global batch, sequences per step (default: --devices, one a device)")
    p.add_argument("--seq-len", type=positive_int, metavar="T",
                   help="tokens per sequence (default: the preset's training recipe's, else its "
                        f"max_seq_len up to {DEFAULT_SEQ_LEN}; at most max_seq_len)")
    p.add_argument("--attention", choices=list(ATTENTION_IMPLS),
                   help="attention_impl (default: pallas, which both targets have; tensor parallelism "
                        "does not run it yet: --attention blockwise tries the tensor meshes)")
    p.add_argument("--grads", choices=("manual", "auto"),
                   help="gradient source (default: `jaxformer train`'s, manual where the model has it)")
    p.add_argument("--mesh", action="append", metavar="TEXT",
                   help="compile only this mesh, e.g. fsdp=8 or data=2,fsdp=4 (repeat for more; default: "
                        "every candidate)")
    p.add_argument("--context", action="store_true",
                   help="also the meshes with a context axis (the sequence split over devices, ring attention; "
                        "the model must run --attention full or blockwise)")
    add_model_flags(p)
    return p


def resolve(args: argparse.Namespace):
    """(config, target, batch_size, seq_len, attention, grads, dtype) of the command line;
    UsageError for what cannot be planned here."""
    overrides = model_overrides(args)
    attention = args.attention or overrides.pop("attention_impl", None)
    if args.attention and overrides.get("attention_impl", args.attention) != args.attention:
        raise UsageError("--attention and --attention-impl differ: give one")
    dtype = overrides.pop("compute_dtype", None) or "bfloat16"
    config = get_preset(args.preset, **overrides)  # ValueError naming a field
    target = TARGETS[args.target]
    problem = missing(target) or aot_plan.device_problem(target, args.devices)
    if problem:
        raise UsageError(problem)
    if attention is None:
        attention = "pallas" if absent(Variant("pallas", "manual", dtype), target.platform) is None else "blockwise"
    recipe = PRESET_TRAINING.get(args.preset, {}).get("seq_len", DEFAULT_SEQ_LEN)
    seq_len = args.seq_len or min(recipe, config.max_seq_len)
    if seq_len > config.max_seq_len:
        raise UsageError(f"--seq-len {seq_len} is longer than the model's max_seq_len {config.max_seq_len} "
                         f"(--max-seq-len raises it)")
    grads = args.grads or default_grads(args.preset, {"attention_impl": attention})
    batch_size = args.batch_size or args.devices
    return config, target, batch_size, seq_len, attention, grads, dtype


@contextlib.contextmanager
def native_stderr_held():
    """File descriptor 2 caught while libtpu starts: it prints its missing-metadata warnings
    (no TPU here) once a process, not through Python. An error still raises."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as caught:
        os.dup2(caught.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)


HBM_REFUSAL = re.compile(r"HLO temporaries \(([\d.]+[KMGT]?)\) exceeds available HBM \(([\d.]+[KMGT]?)\)")


def refusal_text(error: str) -> str:
    """The compiler's refusal, shortened for the table: libtpu's out-of-memory line as its
    temporaries against the HBM it gives a program (in its units: G for GiB, T for TiB)."""
    m = HBM_REFUSAL.search(error)
    return f"too big: temporaries alone {m.group(1)} of {m.group(2)}" if m else error


def cell(row: aot_plan.Row) -> list[str]:
    """A row's cells: mesh, GiB per device, fits, collective GiB per step, compile s."""
    gib = "" if row.memory is None else f"{row.memory.total / GiB:.2f}"
    moved = "" if row.collectives is None else f"{row.collective_total / GiB:.2f}"
    fits = "yes" if row.fits else ("no" if row.memory is not None else f"no: {refusal_text(row.error)}")
    return [row.mesh, gib, fits, moved, f"{row.seconds:.0f}"]


HEAD = ["mesh", "GiB per device", "fits", "collective GiB per step", "compile s"]


def line(cells: list[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def run(args: argparse.Namespace) -> int:
    config, target, batch_size, seq_len, attention, grads, dtype = resolve(args)
    checked = config.replace(attention_impl=attention, compute_dtype=dtype)
    meshes = None
    if args.mesh:
        meshes = [aot_plan.normal_mesh(text, args.devices) for text in args.mesh]  # ValueError: one line
    context = args.context or any("context=" in mesh for mesh in meshes or ())
    candidates = aot_plan.candidate_meshes(checked, args.devices, batch_size, seq_len, context)
    refused = aot_plan.refused_meshes(checked, args.devices, batch_size, seq_len, context)
    if args.mesh:
        for text, mesh in zip(args.mesh, meshes):
            if mesh not in candidates:
                raise UsageError(f"--mesh {text}: {dict(refused)[mesh]}")
    if not candidates:
        reasons = sorted({why for _, why in refused})
        raise UsageError(f"no mesh of {args.devices} devices takes the model: {'; '.join(reasons)}")
    params = count_params(jax.eval_shape(lambda: init_params(jax.random.PRNGKey(0), config)))
    where = tpu_topology(args.devices) if target.platform == "tpu" else f"{args.devices} deviceless"
    count = f"{params / 1e9:.2f}B" if params >= 1e9 else f"{params / 1e6:.2f}M" if params >= 1e6 else f"{params:,}"
    print(f"{args.preset} ({count} params, vocab {config.vocab_size}) on {args.devices} x "
          f"{target.label} ({where}), {target.hbm_bytes / GiB:.2f} GiB a device for a program: batch "
          f"{batch_size} x {seq_len}, {grads} gradients, {attention} attention, {dtype} products, "
          f"float32 params, AdamW", flush=True)
    by_reason: dict[str, list[str]] = {}
    for mesh, why in refused:
        by_reason.setdefault(why, []).append(mesh)
    for why, texts in by_reason.items():
        more = f" and {len(texts) - SHOWN} more" if len(texts) > SHOWN else ""
        print(f"not tried: {', '.join(texts[:SHOWN])}{more}: {why}", flush=True)
    if target.platform == "tpu":
        with native_stderr_held():
            target_devices(target, args.devices)  # libtpu starts here, once
    print("\n" + line(HEAD) + "\n" + line(["---", "---:", "---", "---:", "---:"]), flush=True)
    rows = aot_plan.plan(config, args.devices, target, batch_size, seq_len, attention, grads, dtype,
                         meshes=meshes, say=lambda row: print(line(cell(row)), flush=True), context=context)
    notes = [f"{row.mesh}: {row.error}" for row in rows if row.error and row.memory is not None]
    for note in notes:
        print(note)
    best = aot_plan.propose(rows)
    print()
    if not best:
        error_line(f"no mesh fits: every one needs more than the {target.hbm_bytes / GiB:.2f} GiB of a "
                   f"{target.label} or was refused (a larger pod, a smaller --batch-size or --seq-len, or "
                   f"--remat block / --loss-chunk N cut the memory)")
        return 1
    print(f"proposed: --mesh {best[0].mesh}")
    return 0
