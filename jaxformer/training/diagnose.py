"""Which layer made the first non-finite value.

``diagnose_batch(params, batch, config)`` runs one batch eagerly through the
hand-derived forward and backward of ``manual_grads``, one layer's slice at a time
(no autodiff), and records every stage's output range and every gradient:

    forward:  embed, blocks[l].ln1, blocks[l].attn, blocks[l].attn residual, ...,
              ln_f, head, loss
    backward: the same stages in reverse: loss dlogits, head dw, ..., blocks[0].ln1 dscale, ...

The first stage whose output (or gradient) holds a NaN or an infinity is named,
with the value range of its input, e.g.
``forward: blocks[1].attn output is non-finite; its input has min -2.1, max 2.3, abs max 2.3``.

The stages follow the config as training does: the attention it names (full or
blockwise, ``any_attention_fwd``), its compute_dtype for every product, and with
loss_chunk > 0 one "head + loss" stage that runs both chunk by chunk (no (B, T, V)
logits). remat changes no value, so it is left out. ``Diagnosis.settings`` states
what ran, and the table's first line repeats it.

``diagnose_failure`` (called by the training loop when a step's loss or gradient is
non-finite) replays the run from its newest healthy checkpoint to the step before
the failure and diagnoses the failing step's batch; ``diagnose_run`` (the
``jaxformer diagnose`` command) does the same for a checkpoint's next batch.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxformer.model.config import ModelConfig
from jaxformer.model.precision import upcast
from jaxformer.model.params import validate_params
from manual_grads.block import feed_forward_bwd, feed_forward_fwd
from manual_grads.blockwise import any_attention_bwd, any_attention_fwd
from manual_grads.chunked_loss import chunked_head_loss_bwd, chunked_head_loss_fwd
from manual_grads.embedding import embed_bwd, embed_fwd
from manual_grads.layer_norm import layer_norm_bwd, layer_norm_fwd
from manual_grads.linear import linear_bwd, linear_fwd
from manual_grads.losses import cross_entropy_bwd, cross_entropy_fwd
from manual_grads.model import embed_params


@dataclasses.dataclass(frozen=True)
class Range:
    """The value range of an array; NaNs and infinities are counted, not ranged."""

    min: float
    max: float
    absmax: float
    n_nan: int
    n_inf: int

    @property
    def finite(self) -> bool:
        return self.n_nan == 0 and self.n_inf == 0

    def __str__(self) -> str:
        text = f"min {self.min:.4g}, max {self.max:.4g}, abs max {self.absmax:.4g}"
        if not self.finite:
            text += f" ({self.n_nan} NaN, {self.n_inf} inf)"
        return text


def value_range(x) -> Range:
    a = np.asarray(x, dtype=np.float64)
    ok = a[np.isfinite(a)]
    lo, hi = (float(ok.min()), float(ok.max())) if ok.size else (math.nan, math.nan)
    return Range(lo, hi, max(abs(lo), abs(hi)) if ok.size else math.nan,
                 int(np.isnan(a).sum()), int(np.isinf(a).sum()))


def _norm(tree) -> float:
    return math.sqrt(sum(float(np.sum(np.square(np.asarray(g, np.float64))))
                         for g in jax.tree_util.tree_leaves(tree)))


@dataclasses.dataclass
class Stage:
    name: str  # e.g. "blocks[1].attn"
    inp: Range | None  # the forward input's range (None for token ids)
    out: Range  # the forward output's range
    grad_norm: float | None = None  # norm of this stage's parameter gradient (None: no params)


@dataclasses.dataclass
class Diagnosis:
    stages: list[Stage]  # forward order
    loss: float
    first: str | None  # the first non-finite value, e.g. "backward: blocks[0].ln1 dscale ..."
    settings: str = ""  # what ran, e.g. "blockwise attention (block 128), products in bfloat16, ..."

    def summary(self) -> str:
        if self.first is None:
            return ("every activation and gradient of the manual forward and backward of this "
                    "batch is finite")
        return f"first non-finite value: {self.first}"

    def table(self) -> str:
        head = f"{'stage':<26} {'in |max|':>10} {'out min':>10} {'out max':>10} {'out |max|':>10} {'grad norm':>10}"
        lines = [f"settings: {self.settings}", head, "-" * len(head)]
        for s in self.stages:
            grad = "-" if s.grad_norm is None else f"{s.grad_norm:.4g}"
            inp = "-" if s.inp is None else f"{s.inp.absmax:.4g}"
            bad = "" if s.out.finite else f"  <- {s.out.n_nan} NaN, {s.out.n_inf} inf"
            lines.append(f"{s.name:<26} {inp:>10} {s.out.min:>10.4g} {s.out.max:>10.4g} "
                         f"{s.out.absmax:>10.4g} {grad:>10}{bad}")
        lines.append(f"loss {self.loss:.6g}; {self.summary()}")
        return "\n".join(lines)


class _Recorder:
    def __init__(self):
        self.stages: dict[str, Stage] = {}
        self.first: str | None = None

    def forward(self, name, x, y, params=None):
        inp = None if x is None else value_range(x)
        out = value_range(y)
        self.stages[name] = Stage(name, inp, out)
        if self.first is None and not out.finite:
            bad = _non_finite_leaf(params)
            where = f"; its params{bad} hold non-finite values" if bad else ""
            self.first = (f"forward: {name} output is non-finite; its input has {inp}{where}"
                          if inp is not None else f"forward: {name} output is non-finite{where}")

    def backward(self, name, dy, grads=None, dx=None, dx_name="dx"):
        named = [(f"d{jax.tree_util.keystr(p)[2:-2]}", g)
                 for p, g in jax.tree_util.tree_flatten_with_path(grads or {})[0]]
        if dx is not None:
            named.append((dx_name, dx))
        if grads and name in self.stages:
            self.stages[name].grad_norm = _norm(grads)
        if self.first is not None:
            return
        for label, g in named:
            if not value_range(g).finite:
                self.first = f"backward: {name} {label} is non-finite; its input gradient has {value_range(dy)}"
                return


def _non_finite_leaf(params) -> str | None:
    if params is None:
        return None
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        if not np.all(np.isfinite(np.asarray(leaf))):
            return jax.tree_util.keystr(path)
    return None


def _layer(params, l):
    return jax.tree_util.tree_map(lambda a: a[l], params["blocks"])


def settings(config: ModelConfig) -> str:
    """The layer implementations and precision diagnose_batch runs for ``config``."""
    attn = {"blockwise": f"blockwise attention (block {config.attention_block})",
            "pallas": "pallas flash attention"}.get(config.attention_impl, "full attention")
    products = f"products in {config.compute_dtype or 'the params dtype'}"
    loss = (f"head + loss in chunks of {config.loss_chunk}" if config.loss_chunk
            else "head and loss over all positions")
    return f"{attn}, {products}, {loss}"


def _pre_block(rec, n, p, x, config):
    eps, act, cd = config.ln_eps, config.activation, config.compute_dtype
    h1, r_ln1 = layer_norm_fwd(p["ln1"], x, eps)
    rec.forward(f"{n}.ln1", x, h1, p["ln1"])
    a, r_attn = any_attention_fwd(p["attn"], h1, config)
    rec.forward(f"{n}.attn", h1, a, p["attn"])
    x1 = x + a
    rec.forward(f"{n}.attn residual", a, x1)
    h2, r_ln2 = layer_norm_fwd(p["ln2"], x1, eps)
    rec.forward(f"{n}.ln2", x1, h2, p["ln2"])
    f, r_ffn = feed_forward_fwd(p["ffn"], h2, act, cd)
    rec.forward(f"{n}.ffn", h2, f, p["ffn"])
    y = x1 + f
    rec.forward(f"{n}.ffn residual", f, y)

    def backward(dy):
        # y = x1 + ffn(ln2(x1))
        d_ffn, dh2 = feed_forward_bwd(r_ffn, dy)
        rec.backward(f"{n}.ffn", dy, d_ffn, dh2)
        d_ln2, dx1_branch = layer_norm_bwd(r_ln2, dh2)
        rec.backward(f"{n}.ln2", dh2, d_ln2, dx1_branch)
        dx1 = dy + dx1_branch
        rec.backward(f"{n}.ffn residual", dx1_branch, None, dx1)
        # x1 = x + attn(ln1(x))
        d_attn, dh1 = any_attention_bwd(r_attn, dx1)
        rec.backward(f"{n}.attn", dx1, d_attn, dh1)
        d_ln1, dx_branch = layer_norm_bwd(r_ln1, dh1)
        rec.backward(f"{n}.ln1", dh1, d_ln1, dx_branch)
        dx = dx1 + dx_branch
        rec.backward(f"{n}.attn residual", dx_branch, None, dx)
        return dx

    return y, backward


def _post_block(rec, n, p, x, config):
    eps, act, cd = config.ln_eps, config.activation, config.compute_dtype
    a, r_attn = any_attention_fwd(p["attn"], x, config)
    rec.forward(f"{n}.attn", x, a, p["attn"])
    s1 = x + a
    rec.forward(f"{n}.attn residual", a, s1)
    x1, r_ln1 = layer_norm_fwd(p["ln1"], s1, eps)
    rec.forward(f"{n}.ln1", s1, x1, p["ln1"])
    f, r_ffn = feed_forward_fwd(p["ffn"], x1, act, cd)
    rec.forward(f"{n}.ffn", x1, f, p["ffn"])
    s2 = x1 + f
    rec.forward(f"{n}.ffn residual", f, s2)
    y, r_ln2 = layer_norm_fwd(p["ln2"], s2, eps)
    rec.forward(f"{n}.ln2", s2, y, p["ln2"])

    def backward(dy):
        # y = ln2(x1 + ffn(x1))
        d_ln2, ds2 = layer_norm_bwd(r_ln2, dy)
        rec.backward(f"{n}.ln2", dy, d_ln2, ds2)
        d_ffn, dx1_branch = feed_forward_bwd(r_ffn, ds2)
        rec.backward(f"{n}.ffn", ds2, d_ffn, dx1_branch)
        dx1 = ds2 + dx1_branch
        rec.backward(f"{n}.ffn residual", dx1_branch, None, dx1)
        # x1 = ln1(x + attn(x))
        d_ln1, ds1 = layer_norm_bwd(r_ln1, dx1)
        rec.backward(f"{n}.ln1", dx1, d_ln1, ds1)
        d_attn, dx_branch = any_attention_bwd(r_attn, ds1)
        rec.backward(f"{n}.attn", ds1, d_attn, dx_branch)
        dx = ds1 + dx_branch
        rec.backward(f"{n}.attn residual", dx_branch, None, dx)
        return dx

    return y, backward


def diagnose_batch(params, batch, config: ModelConfig) -> Diagnosis:
    """Run ``batch`` eagerly through the manual forward and backward, layer by layer;
    see the module docstring. Never under jit: every stage's values are inspected."""
    from jaxformer.model.validate import validate_batch

    validate_batch(batch, config)
    validate_params(params, config)
    params = jax.tree_util.tree_map(jnp.asarray, params)
    inputs, targets = jnp.asarray(batch["inputs"]), jnp.asarray(batch["targets"])
    mask = batch.get("mask")
    mask = None if mask is None else jnp.asarray(mask)
    rec = _Recorder()

    # forward, keeping each stage's residuals
    emb = embed_params(params)
    x, embed_res = embed_fwd(emb, inputs, config)  # (B, T, D)
    x = upcast(x)  # the residual stream runs in float32 or wider, as in training
    rec.forward("embed", None, x, emb)
    block = _pre_block if config.norm == "pre" else _post_block
    backwards = []
    for l in range(config.n_layers):
        x, bwd = block(rec, f"blocks[{l}]", _layer(params, l), x, config)
        backwards.append(bwd)
    if config.norm == "pre":
        h, ln_f_res = layer_norm_fwd(params["ln_f"], x, config.ln_eps)
        rec.forward("ln_f", x, h, params["ln_f"])
        x = h
    loss, head_loss_bwd = _head_loss(rec, params["head"], x, targets, mask, config)

    # backward, in reverse
    dx = head_loss_bwd(jnp.ones((), loss.dtype))
    if config.norm == "pre":
        d_ln_f, dx_in = layer_norm_bwd(ln_f_res, dx)
        rec.backward("ln_f", dx, d_ln_f, dx_in)
        dx = dx_in
    for bwd in reversed(backwards):
        dx = bwd(dx)
    d_embed, _ = embed_bwd(embed_res, dx)
    rec.backward("embed", dx, d_embed)
    return Diagnosis(list(rec.stages.values()), float(loss), rec.first, settings(config))


def _head_loss(rec, head, x, targets, mask, config):
    """The head and the loss as stages "head", "loss", or one "head + loss" stage with
    loss_chunk > 0. Returns (loss, backward: dloss -> dx (B, T, D))."""
    cd = config.compute_dtype
    if config.loss_chunk:
        loss, res = chunked_head_loss_fwd(head, x, targets, mask, config.loss_chunk, cd)
        rec.forward("head + loss", x, loss, head)

        def chunked_backward(one):
            d_head, dx = chunked_head_loss_bwd(res, one)
            rec.backward("head + loss", one, d_head, dx)
            return dx

        return loss, chunked_backward
    logits, head_res = linear_fwd(head, x, cd)  # (B, T, V)
    rec.forward("head", x, logits, head)
    loss, loss_res = cross_entropy_fwd(logits, targets, mask)
    rec.forward("loss", logits, loss)

    def backward(one):
        dlogits, _, _ = cross_entropy_bwd(loss_res, one)
        rec.backward("loss", one, None, dlogits, dx_name="dlogits")
        d_head, dx = linear_bwd(head_res, dlogits)
        rec.backward("head", dlogits, d_head, dx)
        return dx

    return loss, backward


# ----------------------------------------------------------------------------
# after a failed step, and for a saved checkpoint


def diagnose_failure(run_dir, last_saved, config, settings, step_fn, batcher, step: int,
                     mesh_key, opt_items) -> str:
    """One sentence naming where step ``step``'s first non-finite value appeared.

    Replays the run from its newest healthy checkpoint (step ``last_saved``, or the
    initial state when None) with the same compiled ``step_fn`` to the state before
    ``step``, then diagnoses that step's batch (``batcher.batch`` is a pure function
    of the batch index). Never raises: a failed diagnosis says so."""
    from jaxformer.checkpoints import checkpoint
    from jaxformer.training.step import _init_fn

    try:
        state = _init_fn(config, settings.dtype, opt_items, *mesh_key)(settings.seed)
        if last_saved is not None:
            state = checkpoint.restore(run_dir, state, last_saved)
        index = int(jax.device_get(state.data_index))
        for _ in range(int(jax.device_get(state.step)), step - 1):
            state, _ = step_fn(state, batcher.batch(index))
            index += 1
        diagnosis = diagnose_batch(jax.device_get(state.params), batcher.batch(index), config)
    except Exception as e:  # noqa: BLE001 - the diagnosis must not hide the failure itself
        return f"(the layer-by-layer diagnosis failed: {type(e).__name__}: {e})"
    if diagnosis.first is None:
        return (f"The manual forward and backward of step {step}'s batch are finite (loss "
                f"{diagnosis.loss:.4g}): the non-finite value came from the gradient source or "
                "the optimizer update.")
    return f"Step {step}'s batch, layer by layer: {diagnosis.first}."


def diagnose_run(run_dir, step: int | None = None) -> str:
    """The per-stage table (forward ranges, gradient norms) and the first non-finite
    value for the next training batch of a run's checkpoint (default: the newest
    that verifies)."""
    from jaxformer import data
    from jaxformer.inference.generate import load_state
    from jaxformer.training.settings import TrainSettings
    from jaxformer.training.loop import _load_data

    state, config, tokenizer, meta = load_state(run_dir, step)
    settings = TrainSettings.from_dict(meta["settings"])
    _, train_ids, _, _ = _load_data(settings, tokenizer)
    batcher = data.Batcher(train_ids, settings.batch_size, settings.seq_len, settings.seed)
    index = int(jax.device_get(state.data_index))
    diagnosis = diagnose_batch(jax.device_get(state.params), batcher.batch(index), config)
    header = (f"{Path(run_dir)}: checkpoint step {meta['step']}, training batch {index} "
              f"({settings.batch_size} x {settings.seq_len} tokens), {config.n_layers} blocks")
    return f"{header}\n{diagnosis.table()}"
