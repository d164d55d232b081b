"""Multi-head attention, written once around whichever core: attention(p, x, config, key).

    q, k, v = split_qkv(x @ [wq | wk | wv] + [bq | bk | bv])   q (B, H, T, Dh), k, v (B, Hkv, T, Dh)
    q, k = rope(qk_norm(q), qk_norm(k))                    ``rotate_qk``, where those options are on
    q = q * sqrt(Dh / attn_scalar)                         with config.attn_scalar (Gemma) only
    out = core(q, k, v, spec, key)                         (B, H, T, Dh)
    y = merge_heads(out) @ wo + bo                         (B, T, H Dh) @ (H Dh, D)

Head h uses columns h*Dh:(h+1)*Dh of wq/wk/wv (Dh = config.d_head: D // H, or head_dim
where set, so wq is (D, H Dh) and wo (H Dh, D)); scores are scaled by 1/sqrt(Dh), or by
1/sqrt(attn_scalar) (Gemma's query_pre_attn_scalar) through q, as Gemma's own code scales its
queries: every core, the key/value cache and the kernels keep their 1/sqrt(Dh). The core is the one config.attention_impl names in ``CORES`` (cores.py: full,
flash, cudnn; blockwise.py: blockwise), or one passed in; ``spec`` is
``attention_spec(config)``, the one place a ModelConfig becomes what a core reads.

The modern block's options act on q and k between the projections and the core: QK-norm
(an RMS norm over each head's q and k, params q_norm and k_norm; with qk_norm_scope
"projection", OLMo 2's, over all of q's and of k's features at once), then rotary positions
(rotary.py). Grouped-query attention (n_kv_heads < n_heads) gives k and v Hkv = n_kv_heads
heads, wk and wv (D, Hkv * Dh); query head h reads key/value head h // G, G = H // Hkv
(Hugging Face's ``repeat_kv``). A core that reads grouped heads (full, flash, cudnn) gets the Hkv
heads as they are; the others get k and v repeated G times (``core_kv``)."""

from __future__ import annotations

import functools
import math
from typing import Callable, NamedTuple

import jax.numpy as jnp
import numpy as np

from jaxformer.model.blockwise import blockwise
from jaxformer.model.cores import AttentionSpec, cudnn, cudnn_core, flash, full, repeat_kv  # noqa: F401
from jaxformer.model.linear import linear
from jaxformer.model.lora import adapted
from jaxformer.model.precision import kept, upcast
from jaxformer.model.quantized import columns
from jaxformer.model.rms_norm import rms_norm
from jaxformer.model.rotary import apply_rope, rope_spec, rope_tables


class Core(NamedTuple):
    fn: Callable  # (q, k, v, spec, key=None, segments=None) -> out (B, H, T, Dh)
    grouped: bool  # reads k, v with their Hkv heads; False: k, v repeated to H heads first


# The cores by ModelConfig.attention_impl (config.ATTENTION_IMPLS, in the same order).
CORES = {"full": Core(full, True), "blockwise": Core(blockwise, False), "pallas": Core(flash, True),
         "cudnn": Core(cudnn, True)}


MIXED_LAYERS = ("ModelConfig.layer_types {types} mixes sliding and full layers: attention takes one "
                "layer's config (jaxformer.model.layer_kinds.per_layer)")


def attention_spec(config) -> AttentionSpec:
    """What a ModelConfig tells the cores: the mask rule (causal, the sliding window), the
    products' dtype, the tiles, the probabilities' dropout rate and the scores' softcap. A
    config whose layer_types mix sliding and full layers is refused (each layer's own config,
    layer_kinds.layer_config, says which it is)."""
    kinds = set(config.windowed_layers)
    if len(kinds) > 1:
        raise ValueError(MIXED_LAYERS.format(types=config.layer_types))
    return AttentionSpec(causal=config.causal, compute_dtype=config.compute_dtype,
                         block=config.attention_block, block_q=config.pallas_block_q,
                         block_k=config.pallas_block_k, dropout=config.dropout,
                         softcap=config.attn_softcap, window=config.sliding_window if True in kinds else 0)


def split_heads(x, n_heads):
    """(B, T, H Dh) -> (B, H, T, Dh): head h takes features h*Dh:(h+1)*Dh."""
    B, T, D = x.shape
    return x.reshape(B, T, n_heads, D // n_heads).transpose(0, 2, 1, 3)


def merge_heads(x):
    """(B, H, T, Dh) -> (B, T, H Dh), the inverse of split_heads."""
    B, H, T, Dh = x.shape
    return x.transpose(0, 2, 1, 3).reshape(B, T, H * Dh)


def qkv_weights(p):
    """The three input projections side by side: w = [wq | wk | wv] (D, (H + 2 Hkv) Dh), b
    ((H + 2 Hkv) Dh,) (None without q, k, v biases: ModelConfig.linear_biases.qkv False)."""
    b = jnp.concatenate([p["bq"], p["bk"], p["bv"]]) if "bq" in p else None
    return columns([p["wq"], p["wk"], p["wv"]]), b


def split_qkv(qkv, n_heads, n_kv_heads=0):
    """(B, T, (H + 2 Hkv) Dh) -> q (B, H, T, Dh), k, v (B, Hkv, T, Dh) (n_kv_heads 0: Hkv = H,
    in one transpose): columns [0, H Dh) are q, then k's and v's Hkv Dh each, and head h of
    each takes its features h*Dh:(h+1)*Dh."""
    B, T, W = qkv.shape
    Hkv = n_kv_heads or n_heads
    Dh = W // (n_heads + 2 * Hkv)
    if Hkv == n_heads:
        qkv = qkv.reshape(B, T, 3, n_heads, Dh).transpose(2, 0, 3, 1, 4)
        return qkv[0], qkv[1], qkv[2]  # (B, H, T, Dh) each
    q, k, v = jnp.split(qkv, [n_heads * Dh, (n_heads + Hkv) * Dh], axis=-1)
    return split_heads(q, n_heads), split_heads(k, Hkv), split_heads(v, Hkv)


def merge_qkv(q, k, v):
    """q (B, H, T, Dh), k, v (B, Hkv, T, Dh) -> (B, T, (H + 2 Hkv) Dh), the inverse of split_qkv."""
    B, H, T, Dh = q.shape
    if k.shape[1] != H:
        return concat_features([merge_heads(q), merge_heads(k), merge_heads(v)])
    return jnp.stack([q, k, v]).transpose(1, 3, 0, 2, 4).reshape(B, T, 3 * H * Dh)


def concat_features(parts):
    """``jnp.concatenate(parts, axis=-1)``, written as a select of the parts each padded to the
    whole width: a GPU's XLA fuses the parts' producers (the backward's rotary positions, the
    heads' transposes) into one kernel that writes the whole, where it compiled a concatenate as a
    copy kernel of its own, once for each product that reads it."""
    widths = [a.shape[-1] for a in parts]
    col = np.arange(sum(widths))  # a constant of the program, not a kernel
    out, start = None, 0
    for a, width in zip(parts, widths):
        padded = jnp.pad(a, [(0, 0)] * (a.ndim - 1) + [(start, sum(widths) - start - width)])
        out = padded if out is None else jnp.where(col >= start, padded, out)
        start += width
    return out


def qkv_heads(p, x, n_heads, compute_dtype=None, n_kv_heads=0):
    """x (B, T, D) -> q (B, H, T, Dh), k, v (B, Hkv, T, Dh): one product x @ [wq | wk | wv] + [bq | bk | bv]."""
    w, b = qkv_weights(p)
    qkv = adapted(p, ("wq", "wk", "wv"), x, linear(x, w, b, compute_dtype, narrow=True), compute_dtype)  # + LoRA's
    return split_qkv(kept(qkv, compute_dtype), n_heads, n_kv_heads)  # bfloat16 under a bfloat16 policy


class QKNorm(NamedTuple):
    """How QK-norm normalizes (ModelConfig.qk_norm_scope, norm_offset)."""
    whole: bool = False  # over all of q's (H Dh) and k's (Hkv Dh) features; False: each head's Dh
    offset: float = 0.0  # the scale applied as (offset + w)
    axis: str | None = None  # whole: the mesh axis the heads split over (tensor parallelism, inside
    # shard_map): each device's heads are its part of every token's features, the statistics over all


def qk_norm_of(config) -> QKNorm:
    return QKNorm(config.qk_norm_scope == "projection", config.norm_offset)


def whole_norm(norm, p, x, eps, offset):
    """``norm`` (an RMS norm) over all of x's heads' features: x (B, H, T, Dh) -> split_heads of
    norm(merge_heads(x)), the scale (H Dh,)."""
    return split_heads(norm(p, merge_heads(x), eps, offset), x.shape[1])


def query_scale(config) -> float:
    """The factor on q that makes the cores' 1/sqrt(Dh) scores Gemma's attn_scalar^(-1/2):
    sqrt(Dh / attn_scalar); 1 without attn_scalar."""
    return math.sqrt(config.d_head / config.attn_scalar) if config.attn_scalar else 1.0


def token_positions(T, start=0, positions=None):
    """(T,) int: each token's position, ``positions`` where given (any order: context
    parallelism's zig-zag chunks, parallel/context.py), else start + t (a decoder's cache:
    ``start`` an int or a traced scalar)."""
    return start + jnp.arange(T) if positions is None else positions


def rotate_qk(p, q, k, norm_eps, rope, start=0, qk: QKNorm = QKNorm(), positions=None):
    """QK-norm then rotary positions on q (B, H, T, Dh) and k (B, Hkv, T, Dh): an RMS norm
    over each head's width where p has q_norm (and k_norm) (``qk``: over all heads' features,
    the scale offset); ``rope`` (a RopeSpec or a base theta; None or 0: none) rotates position
    start + t, or positions[t] where ``positions`` (T,) int is given (it takes precedence).
    Neither option: q and k as they are."""
    if "q_norm" in p:
        norm = (lambda *a: whole_norm(functools.partial(rms_norm, axis_name=qk.axis), *a)) if qk.whole else rms_norm
        q, k = norm(p["q_norm"], q, norm_eps, qk.offset), norm(p["k_norm"], k, norm_eps, qk.offset)
    if rope:
        cos, sin = rope_tables(token_positions(q.shape[-2], start, positions), q.shape[-1], rope, q.dtype)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)  # (T, Dh) tables
    return q, k


def attention_qkv(p, x, config, start=0, positions=None, qk: QKNorm | None = None):
    """x (B, T, D) -> q (B, H, T, Dh), k, v (B, Hkv, T, Dh) as the core reads them: the
    projections, then QK-norm and rotary positions (``rotate_qk``) where config turns them
    on; ``start``: the position of x's first token (a decoder's cache); ``positions`` (T,)
    int, where given: each token's own (context parallelism's chunks), ``start`` unread;
    ``qk``: QK-norm's QKNorm where not qk_norm_of(config) (tensor parallelism's)."""
    q, k, v = qkv_heads(p, x, config.n_heads, config.compute_dtype, config.kv_heads)
    qk = qk_norm_of(config) if qk is None else qk
    q, k = rotate_qk(p, upcast(q), upcast(k), config.ln_eps, rope_spec(config), start, qk, positions)
    if config.attn_scalar:  # scores q k^T / sqrt(Dh) become q k^T / sqrt(attn_scalar)
        q = q * query_scale(config)
    return kept(q, config.compute_dtype), kept(k, config.compute_dtype), v  # as the core's products read them


def core_kv(core: Core, q, k, v):
    """k, v as ``core`` reads them: (B, Hkv, T, Dh) for a grouped core, else repeated to q's H heads."""
    if core.grouped:
        return k, v
    G = q.shape[1] // k.shape[1]
    return repeat_kv(k, G), repeat_kv(v, G)


def attention_out(p, out, compute_dtype=None):
    """The output projection: out (B, H, T, Dh) -> merge_heads(out) @ wo + bo (B, T, D), wo (H Dh, D);
    no bo where the config has no output bias."""
    h = merge_heads(out)  # (B, T, H Dh)
    return adapted(p, ("wo",), h, linear(h, p["wo"], p.get("bo"), compute_dtype), compute_dtype)


def segment_args(segments) -> tuple:
    """A core's trailing arguments for ``segments``: () for None, so a core without them runs."""
    return () if segments is None else (segments,)


def attention(p, x, config, key=None, core: Core | None = None, segments=None, positions=None,
              qk: QKNorm | None = None):
    """p = {wq, bq, wk, bk, wv, bv, wo, bo, q_norm?, k_norm?} (bq bk bv, bo present as
    config.linear_biases says);
    x (B, T, D) -> (B, T, D). ``core``: CORES[config.attention_impl] unless given; ``key``
    (full, blockwise): the probabilities' dropout at config.dropout; ``segments`` (B, T) int:
    each position's document in a packed row (another document's keys masked; None: one);
    ``positions`` (T,) int: x's tokens' rotary positions where they are not 0 .. T-1 (a
    context-parallel device's chunks, parallel/context.py); ``qk``: QK-norm's QKNorm where not
    qk_norm_of(config) (parallel/tensor.py's, its statistics over the tensor axis)."""
    core = core or CORES[config.attention_impl]
    q, k, v = attention_qkv(p, x, config, positions=positions, qk=qk)  # q (B, H, T, Dh), k, v (B, Hkv, T, Dh)
    out = core.fn(q, *core_kv(core, q, k, v), attention_spec(config), key, *segment_args(segments))  # (B, H, T, Dh)
    return attention_out(p, out, config.compute_dtype)
