"""The main job: hand-derived gradients against ``jax.grad``, preset by preset.

For each preset, on one batch of the embedded corpus, both gradient sources run
jitted (config static):

    manual     manual_grads.value_and_grad(params, batch, config)
    autodiff   jax.value_and_grad(jaxformer.loss_fn)(params, batch, config)

and every parameter leaf is compared with ``manual_grads.check.compare_trees``
against the tolerance of the dtype (``check.tolerance_for``). With ``fd`` the
manual gradient is also checked in float64 against central finite differences of
the loss along random directions inside each leaf and over the whole tree
(``compare_fd``).

With ``config.compute_dtype`` set below the params' dtype (``--compute-dtype
bfloat16``), the two sources cannot agree to float32 round-off: each is judged
against a reference from the same params without the compute dtype (autodiff,
params' dtype throughout), and a leaf passes when the manual gradient is at most
MIXED_FACTOR times further from it than the autodiff gradient
(``mixed_precision_passed``).

The result is a ``PresetReport`` per preset, read by ``compare_report`` (terminal
table, report.json, report.md) and ``compare_plot`` (rel_errors.png). The command
line is ``jaxformer.cli.compare_grads`` (``jaxformer compare-grads``,
``experiments/compare_grads.py``).

A gradient source is any ``(params, batch, config) -> (loss, grads)`` with
config static under jit; ``run_comparison`` and ``compare_preset`` take one as
``manual_fn``, so a deliberately broken source can show that the job fails.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import statistics
import time
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

import manual_grads
from jaxformer.data import Batcher, ByteTokenizer, load_corpus
from jaxformer.data.hf_tokenizers import GPT2_VOCAB_SIZE, gpt2_candidates, gpt2_tokenizer
from jaxformer.data.tokenizers import load_tokenizer_file
from jaxformer.formats.hf import gguf_has_tokenizer, read_chat, read_hf, resolve_source
from jaxformer.model.config import PRESETS, ModelConfig
from jaxformer.model.params import count_params, init_params
from jaxformer.model.transformer import loss_fn
from jaxformer.tools.compare.fd import FD_DIRECTIONS, fd_check
from jaxformer.tools.compare.leaves import block_of, dotted, error_rank, model_order_key
from manual_grads import check

DEFAULT_PRESETS = ("loopos", "sunfish", "cllm")  # the three systems the project grew from
# Mixed precision: a leaf passes when err(manual) <= MIXED_FACTOR * max(err(autodiff), MIXED_FLOOR),
# both errors relative to the reference without compute_dtype. Measured in bfloat16 (batch
# 4 x 32, seed 0), the worst leaf's err(manual) / max(err(autodiff), floor) is 1.05 on loopos,
# 1.04 on sunfish, 1.07 on cllm, 1.15 on tiny: both sources make one bfloat16 rounding per
# product input. 2 leaves room for that spread and still fails a backward that makes twice
# the error it needs to (a dropped cast, a product left in bfloat16 output).
MIXED_FACTOR = 2.0
MIXED_FLOOR = 2.0 ** -11  # a quarter of bfloat16's unit round-off (2^-9), ~4.9e-4


GradFn = Callable[[Any, dict, ModelConfig], tuple]  # (params, batch, config) -> (loss, grads)


# ----------------------------------------------------------------------------
# gradient sources and inputs


def manual_value_and_grad() -> GradFn:
    """``manual_grads.value_and_grad``."""
    return manual_grads.value_and_grad


def autodiff_value_and_grad(params, batch, config: ModelConfig, key=None):
    """The reference: ``jax.value_and_grad(loss_fn)`` (``key``: dropout's, as loss_fn's)."""
    return check.autodiff_value_and_grad(functools.partial(loss_fn, key=key), params, batch, config)


def dropout_key(config: ModelConfig, seed: int):
    """The dropout key both sources get when ``config.dropout`` > 0 (None otherwise): the
    same masks for both, drawn from the seed; the manual backward redraws them from it."""
    return jax.random.fold_in(jax.random.PRNGKey(seed), 1) if config.dropout else None


def batch_tokenizer(config: ModelConfig, folder: str | os.PathLike | None = None):
    """The tokenizer the comparison's batch is read with: a model folder's own
    tokenizer.json (a GGUF file's, from its metadata), else GPT-2's for a 50257-token
    vocabulary when it is on the machine, else bytes (ids below 256, valid in any vocabulary of at least 256 tokens)."""
    own = os.path.join(folder, "tokenizer.json") if folder is not None else None
    if folder is not None and gguf_has_tokenizer(folder):
        tokenizer, source = read_chat(folder).tokenizer, f"{folder}'s tokenizer"
    elif own is not None and os.path.isfile(own):
        tokenizer, source = load_tokenizer_file(own), own
    elif config.vocab_size == GPT2_VOCAB_SIZE and any(map(os.path.isfile, gpt2_candidates())):
        tokenizer, source = gpt2_tokenizer(), "GPT-2's tokenizer"
    else:
        tokenizer, source = ByteTokenizer(), "the byte tokenizer"
    if tokenizer.vocab_size > config.vocab_size:
        raise ValueError(f"{source} has {tokenizer.vocab_size} tokens, more than the config's "
                         f"vocab_size {config.vocab_size}: its ids would index past tok_embed")
    return tokenizer


def make_batch(config: ModelConfig, batch_size: int, seq_len: int, seed: int,
               tokenizer=None) -> dict:
    """Batch 0 of the embedded corpus read with ``tokenizer`` (default
    ``batch_tokenizer(config)``): {"inputs", "targets"} int32 (B, T)."""
    tokenizer = tokenizer or batch_tokenizer(config)
    ids = tokenizer.encode(load_corpus("default"))
    batch = Batcher(ids, batch_size, seq_len, seed).batch(0)
    return {k: jnp.asarray(v) for k, v in batch.items()}


# ----------------------------------------------------------------------------
# timing


@dataclasses.dataclass
class Timing:
    compile_s: float  # trace + lower + XLA compile of the jitted function
    step_s: float  # median wall time of one call, after a warm-up call
    steps_s: list  # every timed call

    def to_dict(self):
        return dataclasses.asdict(self)


def compile_fn(fn: GradFn, params, batch, config: ModelConfig):
    """Jit ``fn`` with config static and compile it for these inputs; returns the
    compiled function of (params, batch) and the seconds spent tracing and compiling
    (near zero when this process already compiled the same function for the same shapes:
    jax's in-memory cache answers)."""
    t0 = time.perf_counter()
    compiled = jax.jit(fn, static_argnums=2).lower(params, batch, config).compile()
    return compiled, time.perf_counter() - t0


def time_calls(fns: Sequence[Callable], args: tuple, repeats: int) -> list[list[float]]:
    """Wall time of ``repeats`` calls of each function, each waited on with
    block_until_ready. The calls alternate (f, g, f, g, ...) so that a change in the
    machine's load hits every function alike, and the ratio of medians stays fair."""
    times = [[] for _ in fns]
    for _ in range(max(repeats, 1)):
        for fn, ts in zip(fns, times):
            t0 = time.perf_counter()
            jax.block_until_ready(fn(*args))
            ts.append(time.perf_counter() - t0)
    return times


# ----------------------------------------------------------------------------
# one preset


@dataclasses.dataclass
class PresetReport:
    preset: str
    config: dict
    n_params: int
    dtype: str
    tolerance: float  # relative tolerance per leaf, check.tolerance_for(dtype)
    batch_size: int
    seq_len: int
    loss: dict  # manual, auto, rel, passed (mixed precision: also ref, manual_ref_rel, auto_ref_rel)
    leaves: list  # one dict per leaf, model order: path, shape, max_abs, rel, cosine, passed
    #               (mixed precision: also manual_ref_rel, auto_ref_rel)
    blocks: list  # one dict per group: block, n_leaves, worst_leaf, worst_rel, passed
    timings: dict  # manual, auto (Timing dicts), ratio_step, ratio_compile (manual / auto)
    fd: dict | None  # compare_fd.finite_difference_leaves(...) or None
    failures: list  # one line per failing leaf / check, naming it
    passed: bool
    mixed: dict | None = None  # compute_dtype, factor, floor when judged by mixed_precision_passed

    def to_dict(self):
        return dataclasses.asdict(self)


def reference_config(config: ModelConfig) -> ModelConfig:
    """The reference a mixed-precision run is judged against: ``config`` without its compute
    dtype, cuDNN's attention (16-bit products only) as the full core's same math."""
    same_math = {"attention_impl": "full"} if config.attention_impl == "cudnn" else {}
    return config.replace(compute_dtype=None, **same_math)


def is_mixed(config: ModelConfig, dtype: str) -> bool:
    """True when config.compute_dtype makes the products coarser than the params' dtype."""
    return config.compute_dtype is not None and config.compute_dtype != dtype


def mixed_precision_passed(manual_ref_rel: float, auto_ref_rel: float) -> bool:
    """The mixed-precision criterion of a leaf (or the loss): the manual gradient's error
    against the reference is at most MIXED_FACTOR times autodiff's, or than MIXED_FLOOR."""
    return bool(manual_ref_rel <= MIXED_FACTOR * max(auto_ref_rel, MIXED_FLOOR))


def _loss_check(loss_m: float, loss_a: float, tol: float, loss_ref: float | None) -> dict:
    loss_rel = abs(loss_m - loss_a) / max(abs(loss_a), np.finfo(np.float64).tiny)
    out = dict(manual=loss_m, auto=loss_a, rel=loss_rel, passed=bool(loss_rel <= tol))
    if loss_ref is not None:
        denom = max(abs(loss_ref), np.finfo(np.float64).tiny)
        out.update(ref=loss_ref, manual_ref_rel=abs(loss_m - loss_ref) / denom,
                   auto_ref_rel=abs(loss_a - loss_ref) / denom)
        out["passed"] = mixed_precision_passed(out["manual_ref_rel"], out["auto_ref_rel"])
    return out


def _leaf_rows(grads_a, grads_m, grads_ref, tol: float, failures: list) -> list:
    """One dict per leaf in model order: manual vs autodiff, and (grads_ref given) each
    against the reference, judged by mixed_precision_passed instead of ``tol``."""
    try:
        comparisons = check.compare_trees(grads_a, grads_m)
    except ValueError as err:  # a missing or misshapen leaf
        failures.append(str(err))
        return []
    rows = {c.path: dict(path=dotted(c.path), shape=list(c.shape), max_abs=c.max_abs, rel=c.rel,
                         cosine=c.cosine, ref_norm=c.ref_norm, passed=bool(c.rel <= tol))
            for c in comparisons}
    if grads_ref is not None:
        manual_ref = {c.path: c.rel for c in check.compare_trees(grads_ref, grads_m)}
        auto_ref = {c.path: c.rel for c in check.compare_trees(grads_ref, grads_a)}
        for path, r in rows.items():
            r.update(manual_ref_rel=manual_ref[path], auto_ref_rel=auto_ref[path],
                     passed=mixed_precision_passed(manual_ref[path], auto_ref[path]))
    leaves = sorted(rows.values(), key=lambda r: model_order_key(r["path"]))
    for r in leaves:
        if r["passed"]:
            continue
        if grads_ref is not None:
            failures.append(f"{r['path']} {tuple(r['shape'])}: error vs reference {r['manual_ref_rel']:.2e}"
                            f" > {MIXED_FACTOR:g} x max(autodiff's {r['auto_ref_rel']:.2e}, "
                            f"{MIXED_FLOOR:.1e})")
        else:
            failures.append(f"{r['path']} {tuple(r['shape'])}: rel {r['rel']:.2e} > tolerance "
                            f"{tol:.0e} (max abs {r['max_abs']:.2e}, cosine {r['cosine']:.9f})")
    return leaves


def _block_rows(leaves: list) -> list:
    blocks = {}
    for r in leaves:
        b = blocks.setdefault(block_of(r["path"]), dict(block=block_of(r["path"]), n_leaves=0,
                                                        worst_leaf=r["path"], worst_rel=-1.0,
                                                        passed=True))
        b["n_leaves"] += 1
        b["passed"] &= r["passed"]
        if error_rank(r["rel"]) > error_rank(b["worst_rel"]):
            b["worst_leaf"], b["worst_rel"] = r["path"], r["rel"]
    return list(blocks.values())


def judge(loss_m, grads_m, loss_a, grads_a, tol: float, loss_ref: float | None = None,
          grads_ref=None) -> tuple[dict, list, list]:
    """(loss, leaves, failures): the manual loss and gradients against autodiff's, each leaf
    within ``tol``; with a reference (``loss_ref``, ``grads_ref``: mixed precision) by
    mixed_precision_passed instead. ``failures`` has one line per failing leaf or loss."""
    failures = []
    loss = _loss_check(float(loss_m), float(loss_a), tol, loss_ref)
    if not loss["passed"]:
        failures.append(f"loss: manual {loss['manual']:.9e} vs autodiff {loss['auto']:.9e}, "
                        f"rel {loss['rel']:.2e} > tolerance {tol:.0e}" if loss_ref is None else
                        f"loss: error vs reference {loss['manual_ref_rel']:.2e} > "
                        f"{MIXED_FACTOR:g} x autodiff's {loss['auto_ref_rel']:.2e}")
    leaves = _leaf_rows(grads_a, grads_m, grads_ref, tol, failures)
    return loss, leaves, failures


def run_comparison(config: ModelConfig, params, batch, *, name: str = "", repeats: int = 5,
                   fd: bool = False, fd_directions: int = FD_DIRECTIONS, seed: int = 0,
                   manual_fn: GradFn | None = None, auto_fn: GradFn | None = None) -> PresetReport:
    """Compare ``manual_fn`` (default: manual_grads.value_and_grad) with ``auto_fn``
    (default: jax.value_and_grad(loss_fn)) on ``params`` and ``batch``, both jitted.
    With mixed precision (``is_mixed``) both are also compared with ``auto_fn`` run
    without the compute dtype, the reference of ``mixed_precision_passed``."""
    manual_fn = manual_fn or manual_value_and_grad()
    auto_fn = auto_fn or autodiff_value_and_grad
    key = dropout_key(config, seed)
    if key is not None:  # both sources drop the same units (a source then takes key=)
        manual_fn, auto_fn = (functools.partial(f, key=key) for f in (manual_fn, auto_fn))
    dtype = jnp.dtype(jax.tree_util.tree_leaves(params)[0].dtype).name
    tol = check.tolerance_for(dtype)
    mixed = is_mixed(config, dtype)

    manual_c, compile_m = compile_fn(manual_fn, params, batch, config)
    auto_c, compile_a = compile_fn(auto_fn, params, batch, config)
    loss_m, grads_m = jax.block_until_ready(manual_c(params, batch))  # also the warm-up calls
    loss_a, grads_a = jax.block_until_ready(auto_c(params, batch))
    steps_m, steps_a = time_calls([manual_c, auto_c], (params, batch), repeats)
    t_manual = Timing(compile_m, statistics.median(steps_m), steps_m)
    t_auto = Timing(compile_a, statistics.median(steps_a), steps_a)
    loss_ref = grads_ref = None
    if mixed:
        loss_ref, grads_ref = jax.jit(auto_fn, static_argnums=2)(
            params, batch, reference_config(config))
        loss_ref = float(loss_ref)

    loss, leaves, failures = judge(loss_m, grads_m, loss_a, grads_a, tol, loss_ref, grads_ref)
    fd_result = None
    if fd:
        exact = dtype == "float64" and not mixed  # grads_m is then the float64 gradient
        fd_result, fd_failures = fd_check(manual_fn, params, grads_m if exact else None, batch,
                                          config, seed=seed, n_directions=fd_directions, key=key)
        failures += fd_failures
    timings = dict(manual=t_manual.to_dict(), auto=t_auto.to_dict(),
                   ratio_step=t_manual.step_s / t_auto.step_s,
                   ratio_compile=t_manual.compile_s / max(t_auto.compile_s, 1e-9))
    return PresetReport(
        preset=name, config=config.to_dict(), n_params=count_params(params), dtype=dtype,
        tolerance=tol, batch_size=int(batch["inputs"].shape[0]),
        seq_len=int(batch["inputs"].shape[1]), loss=loss, leaves=leaves,
        blocks=_block_rows(leaves), timings=timings, fd=fd_result, failures=failures,
        passed=not failures,
        mixed=dict(compute_dtype=config.compute_dtype, factor=MIXED_FACTOR, floor=MIXED_FLOOR)
        if mixed else None)


def compare_preset(name: str, *, dtype: str = "float32", batch_size: int = 4, seq_len: int = 32,
                   seed: int = 0, repeats: int = 5, fd: bool = False,
                   fd_directions: int = FD_DIRECTIONS, manual_fn: GradFn | None = None,
                   overrides: dict | None = None) -> PresetReport:
    """Build the preset's params (seed) and a corpus batch, then ``run_comparison``.
    ``overrides`` replace ModelConfig fields of the preset (ValueError naming a bad one).
    The sequence length is cut to the config's max_seq_len when longer."""
    config = PRESETS[name].replace(**(overrides or {}))
    params = init_params(jax.random.PRNGKey(seed), config, dtype)
    got = jnp.dtype(jax.tree_util.tree_leaves(params)[0].dtype).name
    if got != dtype:
        raise RuntimeError(f"asked for {dtype} params, got {got}: float64 needs jax_enable_x64")
    batch = make_batch(config, batch_size, min(seq_len, config.max_seq_len), seed)
    return run_comparison(config, params, batch, name=name, repeats=repeats, fd=fd,
                          fd_directions=fd_directions, seed=seed, manual_fn=manual_fn)


def compare_imported(spec: str, *, dtype: str = "float32", batch_size: int = 4, seq_len: int = 32,
                     seed: int = 0, repeats: int = 5, fd: bool = False,
                     fd_directions: int = FD_DIRECTIONS, manual_fn: GradFn | None = None,
                     overrides: dict | None = None,
                     check: Callable[[ModelConfig], None] | None = None) -> PresetReport:
    """``compare_preset`` on the Hugging Face GPT-2 or Llama ``spec`` (a folder or a hub id): its
    real weights, its config with ``overrides``; ``check(config)`` first (the command line refuses
    there an override that would change what the weights compute)."""
    folder = resolve_source(spec)
    params, config = read_hf(folder, jnp.dtype(dtype))
    if check is not None:
        check(config)
    config = config.replace(**(overrides or {}))
    params = jax.tree_util.tree_map(jnp.asarray, params)
    batch = make_batch(config, batch_size, min(seq_len, config.max_seq_len), seed,
                       batch_tokenizer(config, folder))
    return run_comparison(config, params, batch, name=f"hf:{spec}", repeats=repeats, fd=fd,
                          fd_directions=fd_directions, seed=seed, manual_fn=manual_fn)
