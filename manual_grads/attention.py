"""Multi-head attention by hand: one forward / backward pair around whichever core.

Forward (jaxformer/model/attention.py's ``attention``):
    q, k, v = split_qkv(x @ [wq | wk | wv] + [bq | bk | bv])   q (B, H, T, Dh), k, v (B, Hkv, T, Dh)
    q, k = rope(qk_norm(q), qk_norm(k))                    only where those options are on (QK-norm
                                                           per head, or over merge_heads(q), merge_heads(k))
    q = q * sqrt(Dh / attn_scalar)                         with attn_scalar only
    k, v = repeat_kv(k, G), repeat_kv(v, G)                (B, H, T, Dh), G = H / Hkv: cores that
                                                           do not read grouped heads (``core_kv``)
    O = core(q, k, v, spec, key)                           (B, H, T, Dh)
    y = merge_heads(O) @ wo + bo                           (B, T, H Dh) @ (H Dh, D)
The backward undoes it bottom to top; a key/value head read by G query heads gets the sum
of their gradients (``sum_groups`` undoes ``repeat_kv``; a no-op for a grouped core, whose
backward already returns Hkv heads). Dh is config.d_head (head_dim, or D / H): every width
below is read from the weights' shapes. The b* leaves are there or not as the params have them
(ModelConfig.linear_biases: bq bk bv and bo apart).

Each core has its pair ``core_fwd(q, k, v, spec, key, segments=None) -> (O, res)``, ``core_bwd(res, dO) ->
(dq, dk, dv)``, named by attention_impl in ``MANUAL_CORES``:
    full       the probabilities P (B, H, T, T) kept (below)
    blockwise  FlashAttention-2's backward over blocks, keeping O and lse (blockwise.py)
    pallas     the Pallas kernels' pair (jaxformer.kernels.pallas flash_core_fwd / _bwd)
    cudnn      cuDNN's fused attention kernels' pair (jaxformer.kernels.cudnn cudnn_fwd / _bwd: the
               forward and backward kernels JAX's grad of the model's cudnn core launches)

The full core, per head (k and v repeated to the H query heads inside it, kept with Hkv):
    S = q k^T / sqrt(Dh)                                   (B, H, T, T), masked by spec (and by
                                                           segment ids: P = 0 across documents)
    S = c tanh(S / c)                                      only with spec.softcap c (before the mask)
    P = softmax(S)                                         (B, H, T, T)
    Pd = drop(P)                                           only with a dropout key
    O = Pd v
The dropout mask is not kept: the backward redraws it from the key (manual_grads/dropout.py).

Mixed precision: x, q, k, v are kept in the compute dtype (the matmul inputs the
forward used), the probabilities in float32; the backward's products run in the
compute dtype with float32 accumulation.
"""

from __future__ import annotations

import math
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

from jaxformer.kernels.cudnn import CudnnRes, cudnn_bwd, cudnn_fwd
from jaxformer.kernels.pallas import FlashRes, flash_core_bwd, flash_core_fwd
from jaxformer.model.attention import (CORES, Core, QKNorm, attention_spec, core_kv, merge_heads, merge_qkv,
                                       qk_norm_of, qkv_heads, qkv_weights, query_scale, split_heads,
                                       split_qkv, token_positions)
from jaxformer.model.linear import linear
from jaxformer.model.cores import AttentionSpec, attention_probs, capped_scores, cudnn_inputs, repeat_kv
from jaxformer.model.precision import cast, kept, matmul, upcast
from jaxformer.model.quantized import columns
from jaxformer.model.rotary import rope_spec, rope_tables
from manual_grads.blockwise import BlockwiseCoreRes, blockwise_core_bwd, blockwise_core_fwd
from manual_grads.dropout import DropoutRes, dropout_bwd, dropout_fwd
from manual_grads.linear import LinearRes, linear_bwd, linear_fwd, wide, widened
from manual_grads.lora import AdaptedRes, add_dx, adapted_bwd, adapted_fwd
from manual_grads.rms_norm import RMSNormRes, rms_norm_bwd, rms_norm_fwd
from manual_grads.rotary import RopeRes, rope_bwd, rope_fwd
from manual_grads.softcap import softcap_bwd


QKV = ("wq", "wk", "wv")  # the input projections' weights, in column order


class QKVRes(NamedTuple):
    x: jax.Array  # (B, T, D) the input of the q, k, v projections, in the compute dtype
    wq: jax.Array  # (D, H Dh)
    wk: jax.Array  # (D, Hkv * Dh)
    wv: jax.Array  # (D, Hkv * Dh)
    b: jax.Array | None = None  # ((H + 2 Hkv) Dh,) [bq | bk | bv], None without q, k, v biases
    lora: AdaptedRes | None = None  # the LoRA adapters' (manual_grads/lora.py); None: none


def qkv_fwd(p, x, n_heads, compute_dtype=None, n_kv_heads=0):
    """p = {wq, bq, wk, bk, wv, bv, lora?, ...}; x (B, T, D) -> (q (B, H, T, Dh), k, v (B, Hkv, T, Dh))."""
    w, b = qkv_weights(p)
    qkv = linear(x, w, b, compute_dtype, narrow=True)  # the model's qkv_heads: x @ [wq | wk | wv] + b ...
    qkv, lora_res = adapted_fwd(p, QKV, x, qkv, compute_dtype)  # ... + LoRA's terms
    q, k, v = split_qkv(kept(qkv, compute_dtype), n_heads, n_kv_heads)  # bfloat16 under a bfloat16 policy
    return (q, k, v), QKVRes(cast(x, compute_dtype), p["wq"], p["wk"], p["wv"], b, lora_res)


def qkv_bwd(res: QKVRes, dq, dk, dv):
    """dq (B, H, T, Dh), dk, dv (B, Hkv, T, Dh) -> ({wq, bq, wk, bk, wv, bv}, dx (B, T, D)).
    Undoes ``q, k, v = split_qkv(x @ [wq | wk | wv] + [bq | bk | bv])`` as one linear
    layer of width (H + 2 Hkv) Dh: one product for the three weight gradients over the B*T
    rows, one for dx; the gradients are then cut back into the three projections' leaves."""
    x, wq, wk, wv, b, lora_res = res
    w = columns([wq, wk, wv])  # (D, (H + 2 Hkv) Dh), as qkv_weights put them side by side
    dqkv = merge_qkv(dq, dk, dv)  # (B, T, (H + 2 Hkv) Dh)
    d, dx = linear_bwd(LinearRes(x, w, b), dqkv)  # dx (B, T, D)
    d_lora, dx_lora = adapted_bwd(lora_res, dqkv)  # qkv = qkv + LoRA's [delta_q | delta_k | delta_v]
    dx = add_dx(dx, dx_lora)
    cuts = [wq.shape[1], wq.shape[1] + wk.shape[1]]
    dw = jnp.split(d["w"], cuts, axis=1)  # (D, H Dh), (D, Hkv Dh), (D, Hkv Dh)
    dp = {"wq": dw[0], "wk": dw[1], "wv": dw[2], **d_lora}
    if b is not None:
        db = jnp.split(d["b"], cuts)
        dp.update(bq=db[0], bk=db[1], bv=db[2])
    return dp, dx


class RotateQKRes(NamedTuple):
    """What QK-norm and rotary positions keep; None where the option is off."""
    q_norm: RMSNormRes | None  # of q (B, H, T, Dh), or of merge_heads(q) (B, T, H Dh) with qk.whole
    k_norm: RMSNormRes | None  # of k (B, Hkv, T, Dh), or of merge_heads(k)
    rope: RopeRes | None  # the cos, sin tables (T, Dh)


def _qk_norm_fwd(p, x, eps, qk: QKNorm):
    """One of QK-norm's two norms: over each head's Dh, or (qk.whole) over merge_heads(x)."""
    if not qk.whole:
        return rms_norm_fwd(p, x, eps, qk.offset)
    y, res = rms_norm_fwd(p, merge_heads(x), eps, qk.offset, qk.axis)  # (B, T, H Dh)
    return split_heads(y, x.shape[1]), res


def _qk_norm_bwd(res: RMSNormRes, dy):
    """Undoes _qk_norm_fwd; a whole-projection norm's xhat is (B, T, H Dh)."""
    if res.xhat.ndim == dy.ndim:
        return rms_norm_bwd(res, dy)  # y = rms_norm(p, x, eps, offset)
    dp, dx = rms_norm_bwd(res, merge_heads(dy))  # y = split_heads(rms_norm(p, merge_heads(x)), H)
    return dp, split_heads(dx, dy.shape[1])


def rotate_qk_fwd(p, q, k, norm_eps, rope, qk: QKNorm = QKNorm(), positions=None):
    """q (B, H, T, Dh), k (B, Hkv, T, Dh) -> (q, k), res: the model's ``rotate_qk``: an RMS
    norm over each head's width (``qk``: or over all heads' features, the scale offset) where
    p has q_norm and k_norm, then rotary positions where ``rope`` (a RopeSpec or a base theta)
    is given: the model's own tables, at ``positions`` (T,) where given (else 0 .. T-1); the
    backward turns each token back by its own angle, whatever the order."""
    q_res = k_res = rope_res = None
    if "q_norm" in p:
        q, q_res = _qk_norm_fwd(p["q_norm"], q, norm_eps, qk)
        k, k_res = _qk_norm_fwd(p["k_norm"], k, norm_eps, qk)
    if rope:
        cos, sin = rope_tables(token_positions(q.shape[-2], 0, positions), q.shape[-1], rope, q.dtype)  # (T, Dh)
        q, rope_res = rope_fwd(q, cos, sin)
        k, _ = rope_fwd(k, cos, sin)
    return (q, k), RotateQKRes(q_res, k_res, rope_res)


def rotate_qk_bwd(res: RotateQKRes, dq, dk):
    """dq, dk -> ({q_norm, k_norm} gradients where QK-norm is on, dq, dk)."""
    dp = {}
    if res.rope is not None:  # q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        dq, dk = rope_bwd(res.rope, dq), rope_bwd(res.rope, dk)
    if res.q_norm is not None:  # q, k = norm(p["q_norm"], q, eps, offset), norm(p["k_norm"], k, eps, offset)
        dp["q_norm"], dq = _qk_norm_bwd(res.q_norm, dq)
        dp["k_norm"], dk = _qk_norm_bwd(res.k_norm, dk)
    return dp, dq, dk


class HeadsRes(NamedTuple):
    qkv: QKVRes  # the projections' input and weights
    rotate: RotateQKRes  # QK-norm's and rotary positions' (None fields where off)
    q_scale: jax.Array | None = None  # () the factor on q (config.attn_scalar); None: none


def heads_fwd(p, x, config, positions=None, qk: QKNorm | None = None):
    """The model's ``attention_qkv``: x (B, T, D) -> (q (B, H, T, Dh), k, v (B, Hkv, T, Dh)):
    the projections, then QK-norm and rotary positions (at ``positions`` (T,) where given)
    where config turns them on, then q scaled where config.attn_scalar is set; ``qk``: QK-norm's
    QKNorm where not qk_norm_of(config)."""
    cd = config.compute_dtype
    (q, k, v), qkv_res = qkv_fwd(p, x, config.n_heads, cd, config.kv_heads)
    qk = qk_norm_of(config) if qk is None else qk
    (q, k), rot_res = rotate_qk_fwd(p, upcast(q), upcast(k), config.ln_eps, rope_spec(config), qk, positions)
    if not config.attn_scalar:
        return (kept(q, cd), kept(k, cd), v), HeadsRes(qkv_res, rot_res)
    c = jnp.asarray(query_scale(config), q.dtype)
    return (kept(q * c, cd), kept(k, cd), v), HeadsRes(qkv_res, rot_res, c)


def heads_bwd(res: HeadsRes, dq, dk, dv):
    """dq (B, H, T, Dh), dk, dv (B, Hkv, T, Dh) -> (the projections' and norms' dp, dx (B, T, D))."""
    dq, dk = upcast(dq), upcast(dk)  # q, k = kept(q), kept(k): a bfloat16 cotangent read in float32
    if res.q_scale is not None:  # q = q * query_scale(config)
        dq = dq * res.q_scale
    d_rot, dq, dk = rotate_qk_bwd(res.rotate, dq, dk)  # q, k = rotate_qk(p, upcast(q), upcast(k))
    cd = res.qkv.x.dtype  # the compute dtype where one is set (the projections' input is kept in it)
    dq, dk, dv = (kept(d, cd) for d in (dq, dk, dv))  # q, k, v = split_qkv(kept(qkv)): bfloat16 cotangents
    dp, dx = qkv_bwd(res.qkv, dq, dk, dv)  # q, k, v = split_qkv(x @ [wq | wk | wv] + b)
    return {**dp, **d_rot}, dx


def sum_groups(dx, n_kv_heads):
    """Undoes ``x = repeat_kv(x, G)``: (B, Hkv * G, T, Dh) -> (B, Hkv, T, Dh), each key/value
    head the sum of the G query heads' gradients that read it (dx as it is with Hkv heads)."""
    B, H, T, Dh = dx.shape
    return dx if H == n_kv_heads else dx.reshape(B, n_kv_heads, H // n_kv_heads, T, Dh).sum(axis=2)


# ----------------------------------------------------------------------------
# the full core: P = softmax(q k^T / sqrt(Dh)) kept whole


class FullCoreRes(NamedTuple):
    q: jax.Array  # (B, H, T, Dh) in the compute dtype, as are k and v
    k: jax.Array  # (B, Hkv, T, Dh), before repeat_kv: the G query heads of a group share it
    v: jax.Array  # (B, Hkv, T, Dh)
    probs: jax.Array  # (B, H, T, T) softmax of the scores (float32 or wider); 0 where masked; undropped
    drop: DropoutRes | None  # the probabilities' dropout key and rate; None: no dropout
    spec: AttentionSpec  # static: the products' dtype


def full_core_fwd(q, k, v, spec: AttentionSpec, key=None, segments=None):
    """q (B, H, T, Dh), k, v (B, Hkv, T, Dh) -> (O (B, H, T, Dh), res): the model's ``full`` core
    (``segments`` (B, T): the documents; their mask lives on in P's zeros)."""
    cd, G = spec.compute_dtype, q.shape[1] // k.shape[1]
    probs = attention_probs(q, repeat_kv(k, G), spec, 0, segments)  # (B, H, T, T)
    dropped, drop_res = dropout_fwd(probs, spec.dropout, key)  # (B, H, T, T)
    out = matmul(dropped, repeat_kv(v, G), cd)  # (B, H, T, Dh)
    q, k, v = (cast(a, cd) for a in (q, k, v))  # what the products read
    return out, FullCoreRes(q, k, v, probs, drop_res, spec)


def softmax_bwd(probs, dprobs):
    """Undoes ``P = softmax(S)`` along the last axis: dS = P * (dP - rowsum(dP * P)).
    Masked scores have P = 0, so they get dS = 0; the max subtracted for
    stability cancels out of the softmax and gets no gradient."""
    return probs * (dprobs - jnp.sum(dprobs * probs, axis=-1, keepdims=True))


def full_core_bwd(res: FullCoreRes, dout):
    """dO (B, H, T, Dh) -> (dq (B, H, T, Dh), dk, dv (B, Hkv, T, Dh))."""
    q, k, v, probs, drop_res, spec = res
    cd, Dh, Hkv = spec.compute_dtype, q.shape[-1], k.shape[1]
    G = q.shape[1] // Hkv
    k, v = repeat_kv(k, G), repeat_kv(v, G)  # (B, H, T, Dh): what the products read
    # O = Pd @ v
    dropped = dropout_bwd(drop_res, probs)  # (B, H, T, T): Pd, the mask redrawn from the key
    dpd = matmul(dout, jnp.swapaxes(v, -1, -2), cd)  # (B, H, T, T)
    dv = matmul(jnp.swapaxes(dropped, -1, -2), dout, cd)  # (B, H, T, Dh)
    # Pd = drop(probs)
    dprobs = dropout_bwd(drop_res, dpd)  # (B, H, T, T)
    # probs = softmax(S), S = q k^T / sqrt(Dh): dS = softmax_bwd(probs, dprobs) / sqrt(Dh),
    # the 1 / sqrt(Dh) applied to the (B, H, T, Dh) products, not to the (B, H, T, T) dS
    dsm = softmax_bwd(probs, dprobs)  # (B, H, T, T): sqrt(Dh) * dS
    if spec.softcap:  # scores = softcap(scores, c), recomputed: capped_scores(q, k, spec)
        dsm = softcap_bwd(capped_scores(q, k, spec) / spec.softcap, dsm)
    dq = matmul(dsm, k, cd) / math.sqrt(Dh)  # (B, H, T, Dh)
    dk = matmul(jnp.swapaxes(dsm, -1, -2), q, cd) / math.sqrt(Dh)  # (B, H, T, Dh)
    # k, v = repeat_kv(k, G), repeat_kv(v, G)
    return dq, sum_groups(dk, Hkv), sum_groups(dv, Hkv)


def flash_fwd(q, k, v, spec: AttentionSpec, key=None, segments=None):
    """q (B, H, T, Dh), k, v (B, Hkv, T, Dh) -> (O, FlashRes): the model's ``flash`` core,
    the Pallas forward kernel keeping O, lse and the segment ids (no dropout)."""
    return flash_core_fwd(q, k, v, spec.causal, spec.block_q, spec.block_k, spec.compute_dtype, spec.window,
                          segments)


def cudnn_core_fwd(q, k, v, spec: AttentionSpec, key=None, segments=None):
    """q (B, H, T, Dh), k, v (B, Hkv, T, Dh) -> (O (B, H, T, Dh) in the products' dtype, CudnnRes):
    the model's ``cudnn`` core as cuDNN's forward kernel keeping its softmax statistics; the
    products' dtype, the documents' mask and the refusals as that core's (no dropout, no cap)."""
    dtype, mask = cudnn_inputs(q, spec, segments)
    return cudnn_fwd(q, k, v, spec.causal, spec.window, mask, dtype)


# ----------------------------------------------------------------------------
# the layer: projections around whichever core


class ManualCore(NamedTuple):
    fwd: Callable  # (q, k, v, spec, key=None, segments=None) -> (O (B, H, T, Dh), res)
    bwd: Callable  # (res, dO) -> (dq, dk, dv), k's and v's heads as fwd read them
    res: type  # fwd's residual type: how attention_bwd finds bwd


# Each of CORES' pair, by attention_impl.
MANUAL_CORES = {"full": ManualCore(full_core_fwd, full_core_bwd, FullCoreRes),
                "blockwise": ManualCore(blockwise_core_fwd, blockwise_core_bwd, BlockwiseCoreRes),
                "pallas": ManualCore(flash_fwd, flash_core_bwd, FlashRes),
                "cudnn": ManualCore(cudnn_core_fwd, cudnn_bwd, CudnnRes)}


class AttentionRes(NamedTuple):
    heads: HeadsRes  # x (B, T, D), wq, wk, wv; QK-norm's and rotary positions'
    core: FullCoreRes | BlockwiseCoreRes | FlashRes | CudnnRes  # the core's; only full's keeps the probabilities
    out: LinearRes  # the output projection's: x = merge_heads(O) (B, T, H Dh), w = wo (H Dh, D)
    lora_out: AdaptedRes | None = None  # the output projection's LoRA adapter's; None: none


def _proj(p, name):
    return {"w": p["w" + name], "b": p["b" + name]} if "b" + name in p else {"w": p["w" + name]}


def attention_fwd(p, x, config, key=None, segments=None, positions=None, core: Core | None = None,
                  manual: ManualCore | None = None, qk: QKNorm | None = None, out_bias: bool = True):
    """p = {wq, bq, wk, bk, wv, bv, wo, bo, q_norm?, k_norm?}; x (B, T, D) -> y (B, T, D),
    around the core config.attention_impl names.
    ``key`` (full, blockwise): the probabilities' dropout key; ``segments`` (B, T): the
    documents of a packed row (the core's residual keeps what its backward needs of them);
    ``positions`` (T,): the tokens' rotary positions (the model's ``attention``'s); ``core``
    and ``manual``: a core and its pair given in place of attention_impl's (context
    parallelism's ring, whose backward ``attention_bwd`` is then given too); ``qk``: QK-norm's
    QKNorm where not qk_norm_of(config) (tensor parallelism's, its statistics over the axis);
    ``out_bias`` False: y without the output projection's bias bo, which the caller adds (the
    block's norm after the residual add, norms.add_norm_fwd); the residual keeps bo for its gradient."""
    if manual is None:
        core, manual = CORES[config.attention_impl], MANUAL_CORES[config.attention_impl]
    (q, k, v), heads_res = heads_fwd(p, x, config, positions, qk)  # q (B, H, T, Dh), k, v (B, Hkv, T, Dh)
    o, core_res = manual.fwd(q, *core_kv(core, q, k, v), attention_spec(config), key, segments)  # (B, H, T, Dh)
    h = merge_heads(o)  # (B, T, H Dh)
    out = _proj(p, "o")
    y, out_res = linear_fwd(out if out_bias else {"w": out["w"]}, h, config.compute_dtype)  # (B, T, D)
    if not out_bias:  # y's bias added by the caller; the residual keeps it for db
        out_res = out_res._replace(b=out.get("b"))
    y, lora_res = adapted_fwd(p, ("wo",), h, y, config.compute_dtype)  # + LoRA's on wo
    return y, AttentionRes(heads_res, core_res, out_res, lora_res)


def attention_bwd(res: AttentionRes, dy, core_bwd: Callable | None = None, narrow_ok: bool = False):
    """dy (B, T, D) -> (dp with p's keys, dx (B, T, D)); ``core_bwd``: the backward of a core
    given to attention_fwd (else found by the residual's type in MANUAL_CORES); ``narrow_ok``:
    dx may stay in the products' 16-bit compute dtype (its consumer upcasts), else in dy's."""
    heads_res, core_res, out_res, lora_res = res
    core_bwd = core_bwd or next(c.bwd for c in MANUAL_CORES.values() if isinstance(core_res, c.res))
    H, Dh = core_res.q.shape[-3], core_res.q.shape[-1]  # every core keeps q as (..., H, T or K, Dh)
    Hkv = heads_res.qkv.wk.shape[1] // Dh
    # y = merge_heads(O) @ wo + bo
    d_out, do = linear_bwd(out_res, dy)  # do (B, T, H Dh)
    d_lora, do_lora = adapted_bwd(lora_res, wide(dy))  # y = y + s (drop(merge_heads(O)) A) B
    do = add_dx(do, do_lora)
    # O = core(q, k, v)
    dq, dk, dv = core_bwd(core_res, split_heads(do, H))  # dq (B, H, T, Dh); dk, dv with the core's heads
    # k, v = repeat_kv(k, G), repeat_kv(v, G) (cores that do not read grouped heads)
    dk, dv = sum_groups(dk, Hkv), sum_groups(dv, Hkv)  # (B, Hkv, T, Dh)
    # q, k, v = rotate_qk(split_qkv(x @ [wq | wk | wv] + [bq | bk | bv]))
    dp, dx = heads_bwd(heads_res, dq, dk, dv)  # dx (B, T, D)
    dx = dx if narrow_ok else widened(dx, dy)
    dp["wo"] = d_out["w"]
    if d_lora:  # the output projection's adapter beside the input projections'
        dp["lora"] = {**dp.get("lora", {}), **d_lora["lora"]}
    if "b" in d_out:
        dp["bo"] = d_out["b"]
    return dp, dx
