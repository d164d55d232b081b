"""The feed-forward layer's (the MLP's) hand-derived backward, plain and gated: the pairs
of jaxformer/model/mlp.py's ``feed_forward`` and ``gated_feed_forward``.

    plain: h = x @ w_in + b_in;  a = act(h);  y = a @ w_out + b_out
    (under a bfloat16 compute dtype h is rounded to it, as autocast returns a product, and
    the activation reads it in float32: precision.kept; with a bias the activation's residual
    is the product x @ w_in, and the backward adds b_in to it again: FeedForwardRes.act_bias)
    gated: [gate | up] = x @ [w_gate | w_up] + [b_gate | b_up];  a = act(gate);  m = a * up;
           y = m @ w_down + b_down

Each backward runs its forward's lines bottom to top; the linear layers' and the
activations' own pairs (linear.py, activations.py) do the products and the pointwise
derivative. Without biases (ModelConfig.bias False) dp has no b_* leaves.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxformer.model.mlp import gate_up_weights
from jaxformer.model.precision import kept, upcast
from manual_grads.activations import activation_bwd, activation_fwd
from manual_grads.linear import LinearRes, linear_bwd, linear_fwd, wide, widened
from manual_grads.lora import AdaptedRes, add_dx, adapted_bwd, adapted_fwd


class FeedForwardRes(NamedTuple):
    inp: LinearRes  # x (..., D), w_in (D, F)
    act: NamedTuple  # (..., F): the activation's residual (manual_grads/activations.py)
    out: LinearRes  # act(h) (..., F), w_out (F, D)
    lora_in: AdaptedRes | None = None  # the LoRA adapters' of w_in; None: none
    lora_out: AdaptedRes | None = None  # of w_out
    act_bias: jax.Array | None = None  # b_in where ``act`` holds the product before its bias (the
    # product's own output, which memory holds anyway) and the backward adds it again: the forward
    # then writes act(h) alone, not h as well; None: ``act`` is the activation's residual as it is


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class Activation:
    """The activation's name (a ModelConfig.activation), carried by a residual as a static node."""
    name: str


class GatedFeedForwardRes(NamedTuple):
    inp: LinearRes  # x (..., D), w None: [w_gate | w_up] (D, 2F) is rebuilt from the two below
    gu: jax.Array  # (..., 2F) [gate | up], kept: bfloat16 under a bfloat16 policy, else as computed; one
    # buffer that the backward splits (two residuals would each be a copy of half of it)
    act: Activation  # static: the activation of the gate, which the backward recomputes
    out: LinearRes  # act(gate) * up (..., F), w_down (F, D)
    lora_in: AdaptedRes | None = None  # the LoRA adapters' of [w_gate | w_up]; None: none
    lora_out: AdaptedRes | None = None  # of w_down
    # the layer's own w_gate and w_up (D, F), kept by name (remat.ParamRef) where [w_gate | w_up]
    # would be a float32 copy of both, kept for every layer; the backward puts them side by side again
    w_gate: jax.Array | None = None
    w_up: jax.Array | None = None


def feed_forward_fwd(p, x, activation_name, compute_dtype=None):
    """p = {w_in (D, F), b_in (F,), w_out (F, D), b_out (D,)}; x (..., D) -> y (..., D).
    The products run in ``compute_dtype``, the activation in float32 or wider. A gated p
    (w_gate, w_up, w_down) runs gated_feed_forward_fwd."""
    if "w_gate" in p:
        return gated_feed_forward_fwd(p, x, activation_name, compute_dtype)
    b = p.get("b_in")
    xw, inp_res = linear_fwd({"w": p["w_in"]}, x, compute_dtype, narrow=True)  # (..., F) kept(x @ w_in)
    inp_res = inp_res._replace(b=b)  # h = linear(x, w_in, b_in, narrow=True): the bias added below
    h = xw if b is None else xw + b
    h, lora_in = adapted_fwd(p, ("w_in",), x, h, compute_dtype)  # + LoRA's
    a, act_res = activation_fwd(activation_name, upcast(kept(h, compute_dtype)), compute_dtype)  # (..., F)
    y, out_res = linear_fwd(_lin(p, "out"), a, compute_dtype)  # (..., D)
    y, lora_out = adapted_fwd(p, ("w_out",), a, y, compute_dtype)  # + LoRA's
    if b is not None and lora_in is None and act_res._fields == ("x",):  # a residual of h itself (not tanh's y)
        return y, FeedForwardRes(inp_res, type(act_res)(xw), out_res, lora_in, lora_out, act_bias=b)
    return y, FeedForwardRes(inp_res, act_res, out_res, lora_in, lora_out)


def feed_forward_bwd(res, dy, narrow_ok: bool = False):
    """dy (..., D) -> (dp with p's keys, dx (..., D)); ``narrow_ok``: dx may stay in the
    products' 16-bit compute dtype (its consumer upcasts it), else it is in dy's (``widened``)."""
    if isinstance(res, GatedFeedForwardRes):
        return gated_feed_forward_bwd(res, dy, narrow_ok)
    d_out, da = linear_bwd(res.out, dy)  # y = a @ w_out + b_out
    dl_out, da_lora = adapted_bwd(res.lora_out, wide(dy))  # y = y + s (drop(a) A) B
    act = res.act
    if res.act_bias is not None:  # h = xw + b_in, with xw kept: h as the forward rounded it, again
        act = type(act)(kept(upcast(act.x) + res.act_bias, act.x.dtype))
    dh = activation_bwd(act, add_dx(da, da_lora))  # a = act(upcast(kept(h)))
    dh = kept(dh, res.inp.x.dtype)  # h = kept(h): a bfloat16 value's cotangent is bfloat16
    d_in, dx = linear_bwd(res.inp, dh)  # h = x @ w_in + b_in
    dl_in, dx_lora = adapted_bwd(res.lora_in, dh)  # h = h + s (drop(x) A) B
    dx = add_dx(dx, dx_lora) if narrow_ok else widened(add_dx(dx, dx_lora), dy)
    dp = {"w_in": d_in["w"], "w_out": d_out["w"], **_lora_grads(dl_in, dl_out)}
    if "b" in d_in:  # the layer has biases (ModelConfig.bias)
        dp["b_in"] = d_in["b"]
    if "b" in d_out:  # (absent from a tensor-parallel slice: its b_out is added after the reduction)
        dp["b_out"] = d_out["b"]
    return dp, dx


def gated_feed_forward_fwd(p, x, activation_name, compute_dtype=None):
    """p = {w_gate, w_up (D, F), w_down (F, D), b_gate, b_up (F,), b_down (D,)}; x (..., D) ->
    y = (act(x @ w_gate + b_gate) * (x @ w_up + b_up)) @ w_down + b_down (..., D)."""
    w, b = gate_up_weights(p)  # (D, 2F), (2F,) or None
    gu, inp_res = linear_fwd({"w": w} if b is None else {"w": w, "b": b}, x, compute_dtype, narrow=True)  # (..., 2F)
    gu, lora_in = adapted_fwd(p, ("w_gate", "w_up"), x, gu, compute_dtype)  # + LoRA's
    gu = kept(gu, compute_dtype)  # bfloat16 under a bfloat16 policy
    gate, up = jnp.split(gu, 2, axis=-1)  # (..., F) each
    a, _ = activation_fwd(activation_name, upcast(gate))  # (..., F)
    m = a * upcast(up)
    y, out_res = linear_fwd(_lin(p, "down"), m, compute_dtype)  # (..., D)
    y, lora_out = adapted_fwd(p, ("w_down",), m, y, compute_dtype)  # + LoRA's
    return y, GatedFeedForwardRes(inp_res._replace(w=None), gu, Activation(activation_name), out_res, lora_in,
                                  lora_out, p["w_gate"], p["w_up"])


def gated_feed_forward_bwd(res: GatedFeedForwardRes, dy, narrow_ok: bool = False):
    """dy (..., D) -> ({w_gate, w_up, w_down, b_gate?, b_up?, b_down?}, dx (..., D));
    ``narrow_ok`` as feed_forward_bwd's."""
    d_out, dm = linear_bwd(res.out, dy)  # y = m @ w_down + b_down, m = a * up
    dl_out, dm_lora = adapted_bwd(res.lora_out, wide(dy))  # y = y + s (drop(m) A) B
    dm = upcast(add_dx(dm, dm_lora))  # (a bfloat16 product cotangent under a bfloat16 policy)
    gate_up = upcast(res.gu).reshape(res.gu.shape[:-1] + (2, -1))  # (..., 2, F): the two halves of gu
    gate, up = gate_up[..., 0, :], gate_up[..., 1, :]  # gate, up = split(kept(gu))
    a, act_res = activation_fwd(res.act.name, gate)  # act(upcast(gate)), recomputed with its residual
    da, dup = dm * up, dm * a  # m = a * upcast(up)
    dgate = activation_bwd(act_res, da)  # a = act(upcast(gate))
    # gate, up = split(kept(gu)): dgu = [dgate | dup] (..., 2F), written as a select over the two
    # halves rather than a concatenate, which a GPU's XLA compiles as a copy of its own (one for
    # each of the two products that read dgu); the select writes dgu where dgate and dup are computed
    first = jax.lax.broadcasted_iota(jnp.int32, gate_up.shape[-2:], 0) == 0  # (2, F): the gate's half
    dgu = jnp.where(first, dgate[..., None, :], dup[..., None, :]).reshape(res.gu.shape)
    dgu = kept(dgu, res.inp.x.dtype)  # gu = kept(gu): a bfloat16 value's cotangent is bfloat16
    w, _ = gate_up_weights({"w_gate": res.w_gate, "w_up": res.w_up})  # (D, 2F)
    d_in, dx = linear_bwd(res.inp._replace(w=w), dgu)  # gu = x @ [w_gate | w_up] + [b_gate | b_up]
    dl_in, dx_lora = adapted_bwd(res.lora_in, dgu)  # gu = gu + LoRA's [delta_gate | delta_up]
    dx = add_dx(dx, dx_lora) if narrow_ok else widened(add_dx(dx, dx_lora), dy)
    dw_gate, dw_up = jnp.split(d_in["w"], 2, axis=1)  # w = [w_gate | w_up] (gate_up_weights), (D, F) each
    dp = {"w_gate": dw_gate, "w_up": dw_up, "w_down": d_out["w"], **_lora_grads(dl_in, dl_out)}
    if "b" in d_in:  # the layer has biases (ModelConfig.bias)
        dp["b_gate"], dp["b_up"] = jnp.split(d_in["b"], 2)  # b = [b_gate | b_up]
    if "b" in d_out:  # (absent from a tensor-parallel slice: its b_down is added after the reduction)
        dp["b_down"] = d_out["b"]
    return dp, dx


def _lin(p, name):
    """The feed-forward's w_<name>, b_<name> as a linear layer's {"w", "b"?}."""
    return {"w": p["w_" + name], "b": p["b_" + name]} if "b_" + name in p else {"w": p["w_" + name]}


def _lora_grads(d_in, d_out):
    """The two projections' adapter gradients as one {"lora": ...} entry ({} without adapters)."""
    merged = {**d_in.get("lora", {}), **d_out.get("lora", {})}
    return {"lora": merged} if merged else {}
