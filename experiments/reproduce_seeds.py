"""Reproduce the stages of the original systems, with manual and with automatic gradients.

The systems this project grew from learned in three stages, each backpropagating
further into the model:

    stage 1  only the embeddings (tok_embed, pos_embed) and the output projection
             (head) learn; every other parameter only decays (the first working backprop)
    stage 2  the feed-forward layers (blocks.ffn) learn too (the second)
    stage 3  everything learns: full backpropagation through attention, layer norm
             and residuals (the last)

Each stage runs on a preset (default loopos) and the embedded corpus, once with the
hand-derived gradients (manual_grads) and once with jax.grad, through the very same
jitted step (step.make_train_step over step.grad_source). What learns is decided by
optax alone:

    optax.chain(
        optax.multi_transform({"learn": chain(clip(5), [scale_by_adam]),
                               "frozen": set_to_zero()}, labels),   # labels: stage_labels
        add_decayed_weights(0.01),        # every leaf (--decay matrices: optax.masked)
        scale_by_learning_rate(0.001))

so a frozen leaf becomes exactly p * (1 - lr * wd) each step, and a learning leaf
takes the optimizer's step plus the same decay. The gradient itself is always the
whole model's exact one (the embeddings' gradient flows through the frozen blocks);
the stages differ only in which parts of it are applied.

The original recipe is SGD with learning rate 0.001, every gradient entry clipped to
[-5, 5] and weight decay 0.01; Adam runs with the same learning rate, clip and decay
(decoupled, as for SGD, so "decay" means the same in both).

    python experiments/reproduce_seeds.py                     # the default run: 12 runs, ~10 CPU minutes
    python experiments/reproduce_seeds.py --steps 50 --optimizers adam --stages 1,3

Writes results.json, results.md and curves.png to --out (default runs/reproduce_seeds).
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import sys
import time
from pathlib import Path
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxformer import data
from jaxformer.model.config import PRESETS, get_preset
from jaxformer.model.params import init_params
from jaxformer.observe.jsonsafe import write_json
from jaxformer.observe.words import plural
from jaxformer.training.optim import decay_mask
from jaxformer.training.step import grad_source, init_state, make_eval_step, make_train_step

STAGES = {
    1: "embedding + output",
    2: "+ feed-forward",
    3: "full backprop",
}
# Top-level keys (and block sub-layers) that learn in each stage; everything else only decays.
LEARNS = {
    1: {"tok_embed", "pos_embed", "head"},
    2: {"tok_embed", "pos_embed", "head", "blocks.ffn"},
    3: None,  # everything
}
OPTIMIZERS = ("sgd", "adam")
GRADS = ("manual", "auto")

# The original training recipe.
LR = 1e-3
CLIP = 5.0
WEIGHT_DECAY = 0.01

# Default length. With Adam at lr 0.001 (loopos, B 16, T 64, seed 0) full backprop pulls
# ahead only after about 150 steps: its final validation loss is 0.08 nats below the partial
# stages at 200 steps, 0.15 at 250, 0.2 at 300. 250 steps keep the 12 runs to about 10 CPU
# minutes (12.5 for 300 steps, measured: 26 min wall on 2 cores shared at load average 8).
DEFAULT_STEPS = 250
DEFAULT_BATCH = 16
DEFAULT_SEQ = 64
TAIL = 10  # the final train loss is the mean over the last TAIL steps (one batch is noisy)

# The originals' published figures (their data and tokenization differed from ours).
PUBLISHED = [
    dict(stage=2, system="second (feed-forward backprop)", layers=3, d_model=128,
         loss_start=4.952, loss_end=4.051, epochs=10, tokens_per_s=1700),
    dict(stage=1, system="first (embedding and output only)", layers=3, d_model=128,
         loss_start=3.915, loss_end=1.690, epochs=30, tokens_per_s=1300),
]


# ----------------------------------------------------------------------------
# what learns


def _learns(path: str, stage: int) -> bool:
    allowed = LEARNS[stage]
    if allowed is None:
        return True
    parts = path.split(".")
    return parts[0] in allowed or ".".join(parts[:2]) in allowed


def stage_labels(params, stage: int):
    """The label tree of ``params`` for ``stage``: "learn" or "frozen" at every leaf."""
    if stage not in STAGES:
        raise ValueError(f"unknown stage {stage!r}; choose one of {', '.join(map(str, STAGES))}")

    def label(path, _):
        dotted = ".".join(str(getattr(k, "key", k)) for k in path)
        return "learn" if _learns(dotted, stage) else "frozen"

    return jax.tree_util.tree_map_with_path(label, params)


def make_stage_optimizer(name: str, stage: int, params, *, lr: float = LR, clip: float = CLIP,
                         weight_decay: float = WEIGHT_DECAY,
                         decay: str = "all") -> optax.GradientTransformation:
    """The optimizer of ``stage``: ``name`` (sgd | adam) on the learning leaves, nothing on
    the frozen ones, then weight decay (on every leaf, or with decay="matrices" only on
    optim.decay_mask's weight matrices and embeddings) and the learning rate."""
    if name not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {name!r}; choose one of {', '.join(OPTIMIZERS)}")
    direction = optax.scale_by_adam() if name == "adam" else optax.identity()
    learn = optax.chain(optax.clip(clip), direction)
    decayed = optax.add_decayed_weights(weight_decay)
    if decay == "matrices":
        decayed = optax.masked(decayed, decay_mask)
    elif decay != "all":
        raise ValueError(f"decay must be 'all' or 'matrices', got {decay!r}")
    return optax.chain(
        optax.multi_transform({"learn": learn, "frozen": optax.set_to_zero()},
                              stage_labels(params, stage)),
        decayed,
        # injected, so the training step can read and report the rate (training.optim.injected_lr)
        optax.inject_hyperparams(optax.scale_by_learning_rate)(learning_rate=lr),
    )


# ----------------------------------------------------------------------------
# one run


def _load():
    """(tokenizer, train ids, val ids) of the embedded corpus, byte-tokenized, 10% held out."""
    tokenizer = data.ByteTokenizer()
    ids = tokenizer.encode(data.load_corpus("default"))
    train_ids, val_ids = data.split_train_val(ids, 0.1)
    return tokenizer, train_ids, val_ids


def initial_params(config, seed: int, dtype) -> dict:
    """init_params(PRNGKey(seed), config, dtype) as host (numpy) arrays; jitted: one
    compilation instead of one per eager op."""
    params = jax.jit(init_params, static_argnums=(1, 2))(jax.random.PRNGKey(seed), config,
                                                          jnp.dtype(dtype))
    return jax.device_get(params)


def run_one(config, *, stage: int, optimizer: str, grads: str, steps: int, batch_size: int,
            seq_len: int, seed: int = 0, dtype=jnp.float32, eval_every: int = 0,
            decay: str = "all", train_ids=None, val_ids=None, eval_fn=None,
            init=None) -> dict:
    """Train one (stage, optimizer, gradient source) from ``seed``; returns its record.
    To share between runs: ``eval_fn``, a step.make_eval_step(config), and ``init``, the
    initial params as host arrays (each run gets its own device copy: steps donate them)."""
    if train_ids is None:
        _, train_ids, val_ids = _load()
    batcher = data.Batcher(train_ids, batch_size, seq_len, seed)
    val_batches = [{k: jnp.asarray(v) for k, v in b.items()}
                   for b in data.sequential_batches(val_ids, batch_size, seq_len)]
    if init is None:
        init = initial_params(config, seed, dtype)
    params = jax.tree_util.tree_map(jnp.asarray, init)
    tx = make_stage_optimizer(optimizer, stage, params, decay=decay)
    state = init_state(params, tx, seed)
    step_fn = make_train_step(grad_source(grads, config), tx)
    eval_fn = eval_fn or make_eval_step(config)

    def evaluate(p) -> float:
        return float(np.mean([float(eval_fn(p, b)) for b in val_batches]))

    losses, val_curve = [], [(0, evaluate(state.params))]
    first_bad, compile_s, run_s = None, 0.0, 0.0
    for i in range(steps):
        t0 = time.perf_counter()
        state, metrics = step_fn(state, batcher.batch(i))
        loss, gnorm = float(metrics["loss"]), float(metrics["grad_norm"])
        dt = time.perf_counter() - t0
        if i == 0:
            compile_s = dt  # the first call traces and compiles
        else:
            run_s += dt
        losses.append(loss)
        if not (math.isfinite(loss) and math.isfinite(gnorm)):
            first_bad = i + 1
            break
        if eval_every and (i + 1) % eval_every == 0 and i + 1 < steps:
            val_curve.append((i + 1, evaluate(state.params)))
    done = len(losses)
    params_finite = all(np.isfinite(x).all() for x in jax.tree_util.tree_leaves(
        jax.device_get(state.params)))
    if first_bad is None and params_finite:
        val_curve.append((done, evaluate(state.params)))
    tokens = batch_size * seq_len
    return dict(
        stage=stage, stage_name=STAGES[stage], optimizer=optimizer, grads=grads,
        steps=done, losses=losses, val=val_curve,
        train_first=losses[0], train_final=float(np.mean(losses[-TAIL:])),
        val_first=val_curve[0][1], val_final=val_curve[-1][1] if len(val_curve) > 1 else math.nan,
        epochs=done * tokens / len(train_ids),
        tokens_per_s=tokens * (done - 1) / run_s if done > 1 and run_s > 0 else math.nan,
        compile_s=compile_s,
        non_finite=None if first_bad is None and params_finite
        else (f"loss at step {first_bad}" if first_bad else "params"),
    )


# ----------------------------------------------------------------------------
# report


def agreement(runs: list[dict]) -> dict:
    """max |loss_manual - loss_auto| over the steps, per (stage, optimizer)."""
    out = {}
    for r in runs:
        if r["grads"] != "manual":
            continue
        twin = next((a for a in runs if a["grads"] == "auto" and a["stage"] == r["stage"]
                     and a["optimizer"] == r["optimizer"]), None)
        if twin is None:
            continue
        n = min(len(r["losses"]), len(twin["losses"]))
        diff = np.abs(np.array(r["losses"][:n]) - np.array(twin["losses"][:n]))
        out[f"{r['stage']}/{r['optimizer']}"] = float(np.max(diff)) if n else math.nan
    return out


def verdict(runs: list[dict]) -> list[dict]:
    """Per (optimizer, grads): does full backprop end clearly below the partial stages?
    "Clearly": its final validation loss is at least ``margin`` nats below each."""
    margin = 0.1
    out = []
    for opt in OPTIMIZERS:
        for g in GRADS:
            by_stage = {r["stage"]: r["val_final"] for r in runs
                        if r["optimizer"] == opt and r["grads"] == g}
            if 3 not in by_stage or len(by_stage) < 2:
                continue
            gaps = {s: v - by_stage[3] for s, v in by_stage.items() if s != 3}
            out.append(dict(optimizer=opt, grads=g, margin=margin, gaps=gaps,
                            full_backprop_lowest=all(d >= margin for d in gaps.values())))
    return out


def _f(x, digits=3) -> str:
    return "n/a" if x is None or not math.isfinite(x) else f"{x:.{digits}f}"


def format_markdown(report: dict) -> str:
    o = report["options"]
    decayed = "every leaf" if o["decay"] == "all" else "weight matrices and embeddings"
    lines = [
        "# Reproducing the original systems' stages",
        "",
        f"Preset `{o['preset']}` ({report['n_params']:,} parameters), embedded corpus "
        f"({report['train_tokens']:,} training / {report['val_tokens']:,} validation bytes, "
        f"byte tokens: a uniform guess costs ln 256 = 5.545 nats). {plural(o['steps'], 'step')} of "
        f"batch {o['batch_size']} x {o['seq_len']} tokens ({report['epochs']:.2f} epochs), "
        f"learning rate {LR}, gradient entries clipped to [-{CLIP:g}, {CLIP:g}], weight decay "
        f"{WEIGHT_DECAY} on {decayed}, seed {o['seed']}, {o['dtype']}.",
        "",
        f"The default length ({DEFAULT_STEPS} steps) is chosen to keep the whole sweep short "
        f"on 2 CPU cores while letting full backprop pull clearly ahead with Adam, which it "
        f"does only after about 150 steps; `--steps` runs longer. This run took "
        f"{report['wall_s']:.0f} s for {plural(len(report['runs']), 'run')}, compilation included "
        f"(machine and load below).",
        "",
        "Losses in nats per token. Train: first step, and the mean of the last "
        f"{plural(TAIL, 'step')}. Validation: before training and at the end.",
        "",
        "| stage | optimizer | grads | train first | train final | val first | val final "
        "| tokens/s | compile s | non-finite |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in report["runs"]:
        lines.append(
            f"| {r['stage']} {r['stage_name']} | {r['optimizer']} | {r['grads']} "
            f"| {_f(r['train_first'])} | {_f(r['train_final'])} | {_f(r['val_first'])} "
            f"| {_f(r['val_final'])} | {_f(r['tokens_per_s'], 0)} | {_f(r['compile_s'], 1)} "
            f"| {r['non_finite'] or 'none'} |")
    lines += ["", "## Manual against automatic gradients", "",
              "Same seed, same batches, same jitted step: max |loss difference| over all steps.", "",
              "| stage / optimizer | max abs difference |", "|---|---:|"]
    for k, v in report["agreement"].items():
        lines.append(f"| {k} | {v:.2e} |")
    lines += ["", "## Does full backprop reach a clearly lower loss?", ""]
    for v in report["verdict"]:
        gaps = ", ".join(f"stage {s}: {d:+.3f}" for s, d in sorted(v["gaps"].items()))
        lines.append(f"- {v['optimizer']} / {v['grads']}: "
                     f"{'yes' if v['full_backprop_lowest'] else 'NO'} (final validation loss of "
                     f"stage 3 below {gaps}; 'clearly' means by at least {v['margin']} nats)")
    lines += [
        "", "## The originals' published figures, for context", "",
        "Their data, tokenization, hardware and code differed from ours, so the numbers are "
        "not comparable with the table above; only the model's shape is the same (3 layers, "
        "d_model 128).",
        "",
        "| system | stage | layers | d_model | loss | epochs | tokens/s |",
        "|---|---:|---:|---:|---|---:|---:|",
    ]
    for p in PUBLISHED:
        lines.append(f"| {p['system']} | {p['stage']} | {p['layers']} | {p['d_model']} "
                     f"| {p['loss_start']:.3f} to {p['loss_end']:.3f} | {p['epochs']} "
                     f"| about {p['tokens_per_s']:,} |")
    lines += ["", f"Machine: {report['machine']}. tokens/s excludes the first (compiling) step. "
              "Every stage here computes the whole gradient and masks only its application, so "
              "tokens/s does not depend on the stage; differences between rows come from the "
              "gradient source and the machine's load.", ""]
    return "\n".join(lines)


def _smooth(y, k: int):
    """Running mean over the last k values (fewer at the start)."""
    c = np.cumsum(np.insert(np.asarray(y, float), 0, 0.0))
    i = np.arange(1, len(y) + 1)
    return (c[i] - c[np.maximum(i - k, 0)]) / np.minimum(i, k)


def plot(report: dict, path) -> None:
    """One PNG, a column per optimizer. Top: train loss of every run against step, and
    validation points. Bottom: the second half, train loss smoothed over 10 steps, where
    the stages separate. Colour = stage, solid / circles = manual, dashed / crosses = auto."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    opts = [o for o in OPTIMIZERS if any(r["optimizer"] == o for r in report["runs"])]
    fig = Figure(figsize=(6 * len(opts), 8), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(2, len(opts), squeeze=False)
    colors = {1: "tab:blue", 2: "tab:orange", 3: "tab:green"}
    for col, opt in enumerate(opts):
        top, zoom = axes[0, col], axes[1, col]
        runs = [r for r in report["runs"] if r["optimizer"] == opt]
        n = max(len(r["losses"]) for r in runs)
        for r in runs:
            c, manual = colors[r["stage"]], r["grads"] == "manual"
            ls, marker = ("-", "o") if manual else ("--", "x")
            steps = np.arange(1, len(r["losses"]) + 1)
            label = f"{r['stage']} {r['stage_name']}, {r['grads']}"
            top.plot(steps, r["losses"], color=c, ls=ls, lw=1, alpha=0.8, label=label)
            zoom.plot(steps, _smooth(r["losses"], TAIL), color=c, ls=ls, lw=1.2, label=label)
            for ax in (top, zoom):
                if r["val"]:
                    ax.plot(*zip(*r["val"]), marker, color=c, ms=5, ls="none")
        zoom.set_xlim(n // 2, n + 1)
        late = [v for r in runs for v in _smooth(r["losses"], TAIL)[n // 2:]]
        late += [v for r in runs for s, v in r["val"] if s >= n // 2]
        late = [v for v in late if math.isfinite(v)]
        if late:
            pad = 0.05 * (max(late) - min(late) or 1.0)
            zoom.set_ylim(min(late) - pad, max(late) + pad)
        top.set_title(f"{opt}, lr {LR}, clip {CLIP:g}, wd {WEIGHT_DECAY}: train loss "
                      f"(lines), validation (markers)", fontsize=9)
        zoom.set_title(f"{opt}, second half; train loss smoothed over {TAIL} steps", fontsize=9)
        for ax in (top, zoom):
            ax.set_xlabel("step")
            ax.set_ylabel("cross entropy (nats / token)")
            ax.grid(alpha=0.3)
        top.legend(fontsize=7)
    fig.savefig(path, dpi=100)


def write_outputs(report: dict, out) -> dict:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    paths = dict(json=out / "results.json", markdown=out / "results.md", png=out / "curves.png")
    write_json(paths["json"], report, indent=1)
    paths["markdown"].write_text(format_markdown(report))
    plot(report, paths["png"])
    return paths


# ----------------------------------------------------------------------------
# command line


def _choices(text: str, allowed, convert=str) -> list:
    items = [convert(x.strip()) for x in text.split(",") if x.strip()]
    bad = [x for x in items if x not in allowed]
    if bad or not items:
        raise argparse.ArgumentTypeError(
            f"{text!r}: choose from {', '.join(map(str, allowed))} (comma separated)")
    return list(dict.fromkeys(items))


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="reproduce_seeds", description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=DEFAULT_STEPS,
                   help=f"optimizer steps per run (default {DEFAULT_STEPS}: a few minutes in all "
                        "on 2 CPU cores)")
    p.add_argument("--batch-size", type=int, default=DEFAULT_BATCH, help=f"default {DEFAULT_BATCH}")
    p.add_argument("--seq-len", type=int, default=DEFAULT_SEQ,
                   help=f"default {DEFAULT_SEQ}, cut to the preset's max_seq_len")
    p.add_argument("--optimizers", type=lambda s: _choices(s, OPTIMIZERS), default=list(OPTIMIZERS),
                   help="comma separated: sgd,adam (default both)")
    p.add_argument("--stages", type=lambda s: _choices(s, tuple(STAGES), int), default=list(STAGES),
                   help="comma separated: 1,2,3 (default all)")
    p.add_argument("--grads", type=lambda s: _choices(s, GRADS), default=list(GRADS),
                   help="comma separated: manual,auto (default both)")
    p.add_argument("--preset", choices=sorted(PRESETS), default="loopos", help="default loopos")
    p.add_argument("--decay", choices=("all", "matrices"), default="all",
                   help="weight decay on every leaf (default, the original recipe) or only on "
                        "weight matrices and embeddings (optax.masked with optim.decay_mask)")
    p.add_argument("--dtype", choices=("float32", "float64"), default="float32")
    p.add_argument("--eval-every", type=int, default=None,
                   help="validation every N steps (default steps // 10), and before and after")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="runs/reproduce_seeds",
                   help="folder for results.json, results.md, curves.png (default runs/reproduce_seeds)")
    args = p.parse_args(argv)
    for name in ("steps", "batch_size", "seq_len"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.eval_every is None:
        args.eval_every = max(1, args.steps // 10)
    args.seq_len = min(args.seq_len, PRESETS[args.preset].max_seq_len)
    return args


def plan_line(args: argparse.Namespace, n_runs: int) -> str:
    """What the sweep will do: runs = optimizers x stages x gradient sources, and their length."""
    return (f"{plural(n_runs, 'run')} = {plural(len(args.optimizers), 'optimizer')} "
            f"({', '.join(args.optimizers)}) x {plural(len(args.stages), 'stage')} "
            f"({', '.join(map(str, args.stages))}) x {plural(len(args.grads), 'gradient source')} "
            f"({', '.join(args.grads)}), {plural(args.steps, 'step')} each of batch "
            f"{args.batch_size} x {args.seq_len} on preset {args.preset}; one line per finished run")


def main(argv: Sequence[str] | None = None) -> int:
    """Run every requested (stage, optimizer, gradient source); 0 on success, 1 when a run
    went non-finite."""
    args = parse_args(argv)
    if args.dtype == "float64":
        jax.config.update("jax_enable_x64", True)
    dtype = jnp.dtype(args.dtype)
    tokenizer, train_ids, val_ids = _load()
    config = get_preset(args.preset, vocab_size=tokenizer.vocab_size)
    eval_fn = make_eval_step(config)
    init = initial_params(config, args.seed, dtype)
    runs = []
    load_at_start = os.getloadavg()[0] if hasattr(os, "getloadavg") else math.nan
    plan = [(opt, stage, g) for opt in args.optimizers for stage in args.stages for g in args.grads]
    print(plan_line(args, len(plan)), flush=True)
    t_start = time.perf_counter()
    for i, (opt, stage, g) in enumerate(plan):
        r = run_one(config, stage=stage, optimizer=opt, grads=g, steps=args.steps,
                    batch_size=args.batch_size, seq_len=args.seq_len, seed=args.seed,
                    dtype=dtype, eval_every=args.eval_every, decay=args.decay,
                    train_ids=train_ids, val_ids=val_ids, eval_fn=eval_fn, init=init)
        print(f"run {i + 1}/{len(plan)}: stage {stage} {STAGES[stage]:<18} {opt:<4} {g:<6} train "
              f"{r['train_first']:.3f} -> {r['train_final']:.3f}  val {r['val_first']:.3f} "
              f"-> {_f(r['val_final'])}  {_f(r['tokens_per_s'], 0)} tok/s  "
              f"{time.perf_counter() - t_start:.0f} s elapsed"
              f"{'  NON-FINITE ' + r['non_finite'] if r['non_finite'] else ''}", flush=True)
        runs.append(r)
    n_params = sum(x.size for x in jax.tree_util.tree_leaves(init))
    report = dict(
        options=vars(args), config=config.to_dict(), n_params=int(n_params),
        train_tokens=int(len(train_ids)), val_tokens=int(len(val_ids)),
        epochs=args.steps * args.batch_size * args.seq_len / len(train_ids),
        machine=f"{platform.machine()}, {os.cpu_count()} CPU cores visible, "
                f"jax {jax.__version__} on {jax.devices()[0].platform}, load average "
                f"{load_at_start:.1f} at the start",
        wall_s=time.perf_counter() - t_start, runs=runs, agreement=agreement(runs),
        verdict=verdict(runs), published=PUBLISHED)
    paths = write_outputs(report, args.out)
    for v in report["verdict"]:
        print(f"full backprop clearly lowest ({v['optimizer']}, {v['grads']}): "
              f"{'yes' if v['full_backprop_lowest'] else 'no'}")
    print(f"wall {report['wall_s']:.0f} s; wrote " + ", ".join(str(p) for p in paths.values()))
    return 1 if any(r["non_finite"] for r in runs) else 0


if __name__ == "__main__":
    sys.exit(main())
