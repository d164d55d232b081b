"""Training-step benchmark: manual vs automatic gradients vs PyTorch (eager, compiled).

    jaxformer bench --preset loopos                       # or: python experiments/benchmark.py
    jaxformer bench --preset loopos --d-model 512 --n-layers 6 --d-ff 2048 \\
        --max-seq-len 256 --batch-size 8 --seq-len 256

Every contestant runs the same model (one set of initial weights, copied into
PyTorch), the same batch and AdamW with the same settings. After warm-up steps
(compilation included, timed apart), rounds run the contestants in turn
(A B C A B C ...) so machine drift hits all of them alike; each round times
``--steps`` steps between two ``block_until_ready``. Reported per contestant:
median ms/step and tokens/s with min-max over rounds, model FLOP/s and MFU
(jaxformer/flops.py), compile time; per JAX gradient function: XLA's memory
analysis and compile time, also at two depths (the blocks run under lax.scan,
so it should not grow with depth). Reports: report.json, report.md, bench.png.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxformer.observe import flops
from jaxformer.cli.main import _positive_int
from jaxformer.model.config import PRESETS, get_preset
from jaxformer.cli.flags import add_model_flags, model_overrides

JAX_KINDS = ("manual", "auto")
TORCH_KINDS = ("torch_eager", "torch_compile")
# AdamW as both frameworks run it: constant learning rate, decoupled weight decay on
# weight matrices and embeddings (optim.decay_mask), no clipping.
OPTIMIZER = dict(name="adamw", lr=1e-3, weight_decay=0.01, b1=0.9, b2=0.999, eps=1e-8)
# Where work on the manual step should get to, at the loopos shape (reported, never
# enforced); at larger shapes the goal is >= 1.2x PyTorch eager.
TARGETS = {"manual_over_auto_step_time": ("<=", 0.6),
           "manual_over_torch_eager_tokens_per_s": (">=", 1.0),
           "manual_over_torch_compile_tokens_per_s": (">=", 1.0)}

EPILOG = """\
examples:
  jaxformer bench --preset loopos                       (B16 T64, writes runs/bench)
  jaxformer bench --preset loopos --d-model 512 --n-layers 6 --d-ff 2048 --max-seq-len 256 \\
      --batch-size 8 --seq-len 256 --out runs/bench-mid
  jaxformer bench --quick --out /tmp/bench              (tiny shape, one round: a smoke test)
"""


class BenchUsageError(Exception):
    """Bad command-line input: reported as one ``error:`` line, exit code 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise BenchUsageError(f"{message} (see `{self.prog} --help`)")


def _depths(text):
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated layer counts, got {text!r}") from None
    if len(values) != 2 or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected two positive layer counts like 2,24, got {text!r}")
    return tuple(values)


def build_parser(prog: str = "jaxformer bench") -> argparse.ArgumentParser:
    p = _Parser(prog=prog, description="Benchmark one training step: manual vs automatic "
                "gradients, and the same model in PyTorch when it is installed.",
                epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", choices=list(PRESETS), help="model shape (default loopos; tiny with --quick)")
    p.add_argument("--batch-size", type=_positive_int, metavar="B", help="sequences per step (default 16)")
    p.add_argument("--seq-len", type=_positive_int, metavar="T",
                   help="tokens per sequence (default: the model's max_seq_len)")
    p.add_argument("--rounds", type=_positive_int, metavar="N", help="interleaved timed rounds (default 7)")
    p.add_argument("--steps", type=_positive_int, metavar="N", help="steps per contestant per round (default 5)")
    p.add_argument("--warmup", type=_positive_int, metavar="N", help="untimed steps after compiling (default 3)")
    p.add_argument("--depths", type=_depths, metavar="L1,L2",
                   help="n_layers of the compile-time-vs-depth check (default 2,24)")
    p.add_argument("--no-torch", action="store_true", help="skip the PyTorch contestants")
    p.add_argument("--no-torch-compile", action="store_true", help="skip torch.compile")
    p.add_argument("--torch-threads", type=_positive_int, metavar="N",
                   help="torch.set_num_threads(N) (default: torch's own, one per core); on a "
                        "machine busy with other work, 1 avoids OpenMP threads waiting on each other")
    p.add_argument("--seed", type=int, default=0, help="params and batch seed (default 0)")
    p.add_argument("--quick", action="store_true",
                   help="smoke test: tiny shape, one round of one step, no torch.compile")
    p.add_argument("--out", default="runs/bench", metavar="DIR",
                   help="folder for report.json, report.md, bench.png (default runs/bench)")
    add_model_flags(p)
    return p


class Settings(NamedTuple):
    config: object  # ModelConfig
    batch_size: int
    seq_len: int
    rounds: int
    steps: int
    warmup: int
    depths: tuple
    torch: bool
    torch_compile: bool
    cpu_matmul: int  # n of the n x n matmul that measures a CPU's peak
    torch_threads: int | None  # torch.set_num_threads, None: torch's default
    seed: int


def settings_from_args(args) -> Settings:
    """The benchmark's Settings; ValueError naming the field on a bad shape."""
    quick = args.quick
    preset = args.preset or ("tiny" if quick else "loopos")
    config = get_preset(preset, **model_overrides(args))
    seq_len = args.seq_len or (8 if quick else config.max_seq_len)
    if seq_len > config.max_seq_len:
        raise ValueError(f"seq_len {seq_len} exceeds max_seq_len {config.max_seq_len} "
                         f"(pass --max-seq-len {seq_len})")

    def pick(value, normal, quick_value):
        return value if value is not None else (quick_value if quick else normal)

    return Settings(
        config=config, batch_size=pick(args.batch_size, 16, 2), seq_len=seq_len,
        rounds=pick(args.rounds, 7, 1), steps=pick(args.steps, 5, 1), warmup=pick(args.warmup, 3, 1),
        depths=pick(args.depths, (2, 24), (1, 2)), torch=not args.no_torch,
        torch_compile=not (args.no_torch or args.no_torch_compile or quick),
        cpu_matmul=256 if quick else 2048, torch_threads=args.torch_threads, seed=args.seed)


# ----------------------------------------------------------------------------
# contestants: a step function that runs one training step to completion


class Contestant(NamedTuple):
    name: str
    run: Callable[[int], None] | None  # run(n): n training steps, blocking at the end
    compile_s: float | None  # JAX: lower + compile of the train step; torch: the first step
    error: str | None = None  # why it could not run (then run is None)


def make_batch(config, batch_size: int, seq_len: int, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, config.vocab_size, size=(batch_size, seq_len + 1), dtype=np.int32)
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}


def jax_contestant(kind: str, config, params, batch) -> Contestant:
    from jaxformer.training.optim import make_optimizer
    from jaxformer.training.step import grad_source, init_state, make_train_step

    optimizer = make_optimizer(**OPTIMIZER)
    step = make_train_step(grad_source(kind, config), optimizer)
    state = init_state(jax.tree.map(jnp.copy, params), optimizer)
    batch = jax.device_put(batch)
    t0 = time.perf_counter()
    compiled = step.lower(state, batch).compile()
    compile_s = time.perf_counter() - t0
    holder = [state]

    def run(n):
        state = holder[0]
        for _ in range(n):
            state, metrics = compiled(state, batch)
        jax.block_until_ready((state, metrics))
        holder[0] = state

    return Contestant(kind, run, compile_s)


def torch_contestant(name: str, config, params, batch) -> Contestant:
    import torch

    from jaxformer.tools.torch_ref import TorchTransformer, adamw, to_torch_batch

    model = TorchTransformer.from_jax(jax.device_get(params), config)
    opt = adamw(model, OPTIMIZER["lr"], OPTIMIZER["weight_decay"], OPTIMIZER["b1"],
                OPTIMIZER["b2"], OPTIMIZER["eps"])
    inputs, targets = to_torch_batch(batch)
    loss_fn = torch.compile(model.loss) if name == "torch_compile" else model.loss

    def run(n):
        for _ in range(n):
            opt.zero_grad(set_to_none=True)
            loss_fn(inputs, targets).backward()
            opt.step()

    t0 = time.perf_counter()
    try:
        run(1)  # torch.compile compiles here (forward and backward graphs)
    except Exception as e:  # no compiler toolchain, unsupported op, ...
        return Contestant(name, None, None, f"{type(e).__name__}: {' '.join(str(e).split())[:300]}")
    return Contestant(name, run, time.perf_counter() - t0)


def torch_version() -> str | None:
    try:
        import torch
    except ImportError:
        return None
    return torch.__version__


def make_contestants(s: Settings, params, batch) -> tuple[list[Contestant], list[str]]:
    """The contestants, and notes on the ones left out."""
    out = [jax_contestant(kind, s.config, params, batch) for kind in JAX_KINDS]
    notes = []
    if not s.torch:
        notes.append("PyTorch contestants skipped (--no-torch)")
    elif torch_version() is None:
        notes.append("PyTorch not installed (pip install 'jaxformer[bench]'): no PyTorch contestants")
    else:
        if s.torch_threads:
            import torch

            torch.set_num_threads(s.torch_threads)
        out.append(torch_contestant("torch_eager", s.config, params, batch))
        if s.torch_compile:
            out.append(torch_contestant("torch_compile", s.config, params, batch))
        else:
            notes.append("torch.compile skipped (--quick or --no-torch-compile)")
    return out, notes


def time_rounds(contestants: Sequence[Contestant], rounds: int, steps: int, warmup: int,
                probe: Callable[[], float] | None = None) -> tuple[dict, list]:
    """({name: [ms per step of each round]}, [probe() after each round]); rounds
    interleaved A B C A B C ..."""
    ready = [c for c in contestants if c.run is not None]
    for c in ready:
        c.run(warmup)
    samples, probes = {c.name: [] for c in ready}, []
    for _ in range(rounds):
        for c in ready:
            t0 = time.perf_counter()
            c.run(steps)
            samples[c.name].append(1e3 * (time.perf_counter() - t0) / steps)
        if probe is not None:
            probes.append(probe())
    return samples, probes


# ----------------------------------------------------------------------------
# XLA's view of each gradient function: memory and compile time


def _shapes(config, batch_size, seq_len, dtype=jnp.float32):
    from jaxformer.model.params import init_params

    params = jax.eval_shape(lambda: init_params(jax.random.PRNGKey(0), config, dtype=dtype))
    tokens = jax.ShapeDtypeStruct((batch_size, seq_len), jnp.int32)
    return params, {"inputs": tokens, "targets": tokens}


def compile_grad_fn(kind: str, config, batch_size: int, seq_len: int):
    """(seconds to trace, lower and compile the jitted gradient function, the compiled)."""
    from jaxformer.training.step import grad_source

    params, batch = _shapes(config, batch_size, seq_len)
    t0 = time.perf_counter()
    compiled = jax.jit(grad_source(kind, config)).lower(params, batch).compile()
    return time.perf_counter() - t0, compiled


def memory_stats(compiled) -> dict | None:
    """XLA's memory_analysis of a compiled function, in bytes (None if unavailable)."""
    try:
        m = compiled.memory_analysis()
    except Exception:  # not implemented on this backend
        return None
    if m is None:
        return None
    names = ("temp", "argument", "output", "alias", "generated_code")
    return {f"{n}_bytes": int(getattr(m, f"{n}_size_in_bytes", 0) or 0) for n in names}


def grad_fn_analysis(s: Settings) -> dict:
    """Per JAX gradient function: compile time and memory at the benchmark's shape, and
    compile time at each of s.depths layers."""
    out = {}
    for kind in JAX_KINDS:
        seconds, compiled = compile_grad_fn(kind, s.config, s.batch_size, s.seq_len)
        depth = {str(L): seconds if L == s.config.n_layers else  # the same program: not twice
                 compile_grad_fn(kind, s.config.replace(n_layers=L), s.batch_size, s.seq_len)[0]
                 for L in s.depths}
        out[kind] = {"compile_s": seconds, "memory": memory_stats(compiled),
                     "compile_s_by_depth": depth}
    return out


# ----------------------------------------------------------------------------
# the whole benchmark


def _summary(ms: list[float], tokens_per_step: int, flops_per_token: int, peak: float | None) -> dict:
    tok = [tokens_per_step / (m / 1e3) for m in ms]
    med_tok = tokens_per_step / (statistics.median(ms) / 1e3)
    achieved = med_tok * flops_per_token
    return {
        "ms_per_step": {"median": statistics.median(ms), "min": min(ms), "max": max(ms)},
        "tokens_per_s": {"median": med_tok, "min": min(tok), "max": max(tok)},
        "samples_ms": ms,
        "model_flops_per_s": achieved,
        "mfu": achieved / peak if peak else None,
    }


def _ratios(results: dict) -> dict:
    """Paired ratios: each round's step times of two contestants divided (they ran side by
    side, so machine drift cancels), then the median over rounds; also min and max."""
    def samples(name):
        r = results.get(name) or {}
        return r.get("samples_ms")

    def paired(num, den):  # median over rounds of samples[num][r] / samples[den][r]
        a, b = samples(num), samples(den)
        r = [x / y for x, y in zip(a, b)]
        return {"median": statistics.median(r), "min": min(r), "max": max(r)}

    out = {}
    if samples("manual") and samples("auto"):
        out["manual_over_auto_step_time"] = paired("manual", "auto")
    for name in TORCH_KINDS:
        if samples("manual") and samples(name):  # tokens/s ratio = inverse step-time ratio
            out[f"manual_over_{name}_tokens_per_s"] = paired(name, "manual")
    return out


def _targets(ratios: dict) -> dict:
    out = {}
    for key, (op, bound) in TARGETS.items():
        if key in ratios:
            value = ratios[key]["median"]
            out[key] = {"bound": f"{op} {bound}", "value": value,
                        "met": value <= bound if op == "<=" else value >= bound}
    return out


def machine() -> dict:
    dev = jax.devices()[0]
    info = {"platform": dev.platform, "device_kind": getattr(dev, "device_kind", ""),
            "device_count": jax.device_count(), "cpu_count": os.cpu_count(),
            "machine": platform.machine(), "python": platform.python_version(),
            "jax": jax.__version__, "torch": torch_version()}
    if info["torch"]:
        import torch

        info["torch_threads"] = torch.get_num_threads()
    return info


def run(s: Settings) -> dict:
    """Run the benchmark of ``s``; returns the report dict (see bench_report)."""
    from jaxformer.model.params import count_params, init_params

    load_before = os.getloadavg()
    config, B, T = s.config, s.batch_size, s.seq_len
    params = init_params(jax.random.PRNGKey(s.seed), config, dtype=jnp.float32)
    batch = make_batch(config, B, T, s.seed)
    per_token = flops.flops_per_token(config, T)
    dtype = flops.matmul_dtype(config, "float32")
    contestants, notes = make_contestants(s, params, batch)
    peak, peak_source = flops.device_peak(dtype=dtype, cpu_matmul=s.cpu_matmul)
    probe = None
    if jax.devices()[0].platform == "cpu":  # the CPU's peak is measured in every round too
        probe = lambda: flops.cpu_matmul_flops(s.cpu_matmul)
    samples, probes = time_rounds(contestants, s.rounds, s.steps, s.warmup, probe)
    if probes:
        peak = max([peak, *probes])
        peak_source = (f"measured: best float32 {s.cpu_matmul}x{s.cpu_matmul} matmul of "
                       f"{len(probes) + 1} measurements, one after each round")
    results = {}
    for c in contestants:
        entry = {"compile_s": c.compile_s, "error": c.error}
        if c.name in samples:
            entry.update(_summary(samples[c.name], B * T, per_token, peak))
        results[c.name] = entry
    analysis = grad_fn_analysis(s)
    ratios = _ratios(results)
    return {
        "command": " ".join(sys.argv),
        "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": {**machine(), "loadavg_before": load_before, "loadavg_after": os.getloadavg()},
        "shape": {"config": config.to_dict(), "batch_size": B, "seq_len": T, "tokens_per_step": B * T,
                  "params": count_params(params)},
        "settings": {"rounds": s.rounds, "steps_per_round": s.steps, "warmup_steps": s.warmup,
                     "optimizer": OPTIMIZER, "param_dtype": "float32", "matmul_dtype": dtype},
        "flops": flops.flops_breakdown(config, T),
        "peak": {"flops_per_s": peak, "source": peak_source, "dtype": dtype,
                 "cpu_samples": probes},
        "contestants": results,
        "grad_fns": analysis,
        "ratios": ratios,
        "targets": _targets(ratios),
        "notes": notes,
    }


def main(argv: Sequence[str] | None = None, prog: str = "jaxformer bench") -> int:
    """Parse ``argv``, run, write the reports; 0 on success, 2 (one ``error:`` line) on bad input."""
    from jaxformer.tools.bench_report import format_summary, write_reports

    try:
        args = build_parser(prog).parse_args(argv)
        s = settings_from_args(args)
    except SystemExit as e:  # --help
        return e.code if isinstance(e.code, int) else 0
    except (BenchUsageError, ValueError) as e:
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    print(f"benchmarking B{s.batch_size} T{s.seq_len} L{s.config.n_layers} D{s.config.d_model} "
          f"H{s.config.n_heads} F{s.config.d_ff} on {jax.devices()[0].platform} "
          f"(load {os.getloadavg()[0]:.2f}) ...", file=sys.stderr, flush=True)
    report = run(s)
    paths = write_reports(report, args.out)
    print(format_summary(report))
    print("reports: " + ", ".join(str(p) for p in paths.values()))
    return 0
