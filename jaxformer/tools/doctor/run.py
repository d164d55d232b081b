"""``jaxformer doctor``: check this install on the device JAX sees, in one report.

    jaxformer doctor              # under a minute on a 2-core CPU
    jaxformer doctor --quick      # tiny shapes, about 30 s

Four sections of checks (checks.py, kernel_checks.py), run on device 0 in turn, each a list of
checks that passed, failed or could not be run here (with the reason):

    kernels     the Pallas attention kernels, compiled for this device, and on a GPU
                cuDNN's fused attention, against full attention: float32 and bfloat16,
                forward and gradients (on a CPU the kernels run in interpret mode)
    gradients   manual_grads against jax.grad on a small GPT-2-shaped model, per leaf
    training    TRAIN_STEPS steps per attention implementation: loss finite and falling
    bench       a short tools/bench/run.py benchmark: ms/step, tokens/s, MFU

``run(settings)`` returns the report dict (doctor_report.py writes it as text and
JSON); the last line of the text is the verdict, ``doctor: N checks passed, M failed,
K not checked on <platform>``. The command line is ``jaxformer.cli.doctor``; it exits
with 0 only when no check failed.
"""

from __future__ import annotations

import platform as pyplatform
import sys
import time
from typing import Callable, NamedTuple

import jax
import jaxlib
import optax

import jaxformer
from jaxformer.tools.doctor.checks import (FAILED, NOT_CHECKED, PASSED, TRAIN_DROP, TRAIN_STEPS, Check,
                                           bench_checks, bench_settings, gpt2_shaped, gradient_checks,
                                           judged, shape_text, train_config, training_checks)
from jaxformer.tools.doctor.kernel_checks import kernel_checks, kernel_shape


class Settings(NamedTuple):
    quick: bool = False  # tiny shapes everywhere, one bench round
    seed: int = 0  # params, attention inputs and batches


def header() -> dict:
    """What runs here: the devices JAX sees, the platform, the versions."""
    devices = jax.devices()
    kinds = sorted({getattr(d, "device_kind", d.platform) for d in devices})
    return {"platform": jax.default_backend(), "device_kind": kinds[0] if len(kinds) == 1 else kinds,
            "device_count": len(devices),
            "runtime": getattr(devices[0].client, "platform_version", None),
            "jax": jax.__version__, "jaxlib": jaxlib.__version__, "optax": optax.__version__,
            "python": pyplatform.python_version(), "jaxformer": jaxformer.__version__}


def where(head: dict) -> str:
    """The platform as the verdict names it: "cpu", or "gpu (NVIDIA H100 80GB HBM3)"."""
    p, kind = head["platform"], head["device_kind"]
    return p if p == "cpu" else f"{p} ({kind if isinstance(kind, str) else ', '.join(kind)})"


def summary(checks: list[Check], head: dict) -> dict:
    count = {s: sum(c.status == s for c in checks) for s in (PASSED, FAILED, NOT_CHECKED)}
    verdict = (f"doctor: {count[PASSED]} checks passed, {count[FAILED]} failed, "
               f"{count[NOT_CHECKED]} not checked on {where(head)}")
    return {"passed": count[PASSED], "failed": count[FAILED], "not_checked": count[NOT_CHECKED],
            "platform": head["platform"], "verdict": verdict}


def section_titles(p: str, quick: bool, seed: int) -> dict:
    """The heading of each section, naming its shapes and its criteria."""
    config, B, T = gpt2_shaped(p, quick)
    _, tB, tT = train_config()
    b = bench_settings(p, quick, seed)
    return {
        "kernels": f"attention kernels vs full attention ({kernel_shape(p, quick).text()}; out, dq, dk, dv "
                   f"of one jax.vjp; rel = ||got - full|| / ||full||, full in float32, matmul precision highest; "
                   f"then the norms' kernels vs the XLA norms)",
        "gradients": f"manual gradients vs jax.grad (GPT-2-shaped {shape_text(config, B, T)}; float32, "
                     f"matmul precision highest; rel per parameter leaf)",
        "training": f"training ({TRAIN_STEPS} steps of the tiny preset, B{tB} T{tT}, adam lr 1e-2 on one batch; "
                    f"every loss finite, the last at least {TRAIN_DROP:.0%} below the first)",
        "bench": f"bench (B{b.batch_size} T{b.seq_len} L{b.config.n_layers} D{b.config.d_model}, "
                 f"{b.config.compute_dtype or 'float32'}; {b.rounds} x {b.steps} timed steps after "
                 f"{b.warmup} warm-up, AdamW; MFU as jaxformer bench)",
    }


def run(s: Settings, say: Callable[[str], None] = lambda line: print(line, file=sys.stderr, flush=True)) -> dict:
    """Every check on device 0; the report dict (doctor_report). ``say`` hears each
    section start and end (its counts). A check that raises fails with the error's line;
    the others still run."""
    t_start = time.perf_counter()
    head = header()
    p = head["platform"]
    titles = section_titles(p, s.quick, s.seed)
    bench_peak = {}

    def bench_section():
        checks, peak = bench_checks(bench_settings(p, s.quick, s.seed), lambda line: None)
        bench_peak.update(peak)
        return checks

    sections = {
        "kernels": lambda: kernel_checks(p, s.quick, s.seed),
        "gradients": lambda: gradient_checks(p, s.quick, s.seed),
        "training": lambda: training_checks(p, s.seed),
        "bench": bench_section,
    }
    checks, timed = [], []
    for group, fn in sections.items():
        say(f"doctor: {group} ...")
        t0 = time.perf_counter()
        done = judged(group, group, fn)
        timed.append({"group": group, "title": titles[group], "seconds": time.perf_counter() - t0})
        count = summary(done, head)
        say(f"doctor: {group}: {count['passed']} passed, {count['failed']} failed, {count['not_checked']} "
            f"not checked ({timed[-1]['seconds']:.1f} s)")
        checks += done
    if bench_peak:
        timed[-1]["peak"] = bench_peak
    return {
        "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "settings": s._asdict(),
        "header": head,
        "sections": timed,
        "checks": [c._asdict() for c in checks],
        "summary": summary(checks, head),
        "wall_s": time.perf_counter() - t_start,
    }
