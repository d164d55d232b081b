"""Attention cores: out = softmax(q k^T / sqrt(Dh)) v, and the one description they share.

A core is ``core(q, k, v, spec, key=None, segments=None) -> out``: q (B, H, T, Dh), k and v (B, H, T, Dh)
or, for a core that reads grouped heads, (B, Hkv, T, Dh); out (B, H, T, Dh). It knows
nothing of projections, QK-norm or rotary positions (attention.py writes those once,
around whichever core). ``spec`` (an AttentionSpec) is everything else a core reads:
the mask rule, the products' dtype, the tiles, the probabilities' dropout rate, the
scores' softcap; ``key``
(full, blockwise) is the dropout key, None for no dropout; ``segments`` (B, T) int, or None,
the document each position belongs to (packed rows: a query reads only the keys of its own
document, on top of spec's rule; ``segment_mask``). Segments are batch data, not a static
spec field, so they travel beside the spec.

The cores: ``full`` (the (B, H, T, T) probabilities, here), ``blockwise`` (an online
softmax over key blocks, blockwise.py), ``flash`` (the same as Pallas kernels,
jaxformer/kernels/pallas) and ``cudnn`` (cuDNN's fused attention, here). attention.py's
``CORES`` names them by ModelConfig.attention_impl.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

from jaxformer.kernels.cudnn import OFF_GPU, not_lowered
from jaxformer.kernels.pallas import flash_attention
from jaxformer.kernels.refused import refused
from jaxformer.model.dropout import dropout
from jaxformer.model.precision import matmul, upcast
from jaxformer.model.softcap import softcap


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class AttentionSpec:
    """What a core reads besides q, k and v. Frozen and hashable: a jit static argument, and a
    static pytree node (no leaves), so a residual may carry it through scans and custom rules.

    A static masking rule (the sliding ``window``) is a field here and a line in ``allowed``;
    the per-batch one (segment ids) is an argument of every core, ``segment_mask``; a
    transform of the scores is a field here and a line where the cores make them (``softcap``:
    ``capped_scores`` here, ``capped_block_scores`` in blockwise.py; the manual backwards undo
    it beside the softmax's). docs/design.md, "Attention", walks through them."""

    causal: bool = True  # query t reads keys s <= t only
    compute_dtype: str | None = None  # the products' inputs (ModelConfig.compute_dtype); None: q's own
    block: int = 128  # blockwise: query and key block size
    block_q: int = 0  # flash: query block size (0: the device's)
    block_k: int = 0  # flash: key block size (0: the device's)
    dropout: float = 0.0  # the probabilities' dropout rate, with a key (full, blockwise)
    softcap: float = 0.0  # scores s -> softcap * tanh(s / softcap) before mask and softmax; 0: off (full, blockwise)
    window: int = 0  # W > 0 (causal only): the query at t reads keys t - W < s <= t, W keys; 0: all past keys

    def __post_init__(self):
        if self.window and not self.causal:
            raise ValueError(f"AttentionSpec.window {self.window} needs causal True (a window of past keys)")

    def allowed(self, q_pos, k_pos):
        """Whether the query at position q_pos may read the key at k_pos (int arrays that
        broadcast, e.g. (Tq, 1) and (1, Tk)): a bool array, or None when every pair may.
        With a window: k_pos > q_pos - window too (transformers' sliding_window_overlay)."""
        if not self.causal:
            return None
        if self.window:
            return (k_pos <= q_pos) & (k_pos > q_pos - self.window)
        return k_pos <= q_pos


def segment_mask(q_seg, k_seg):
    """Whether each query may read each key by their documents: q_seg (B, Tq), k_seg (B, Tk)
    int -> (B, 1, Tq, Tk) bool, True where the two ids are equal (the head axis broadcasts)."""
    return (q_seg[:, :, None] == k_seg[:, None, :])[:, None]


def with_segments(mask, segments, start=0, Tq=None):
    """``mask`` (spec.allowed's, or None) and, with ``segments`` (B, Tk), the segment_mask of
    queries start .. start + Tq - 1 against every key: a bool array, or None when both are None."""
    if segments is None:
        return mask
    Tq = segments.shape[1] - start if Tq is None else Tq
    seg = segment_mask(jax.lax.dynamic_slice_in_dim(segments, start, Tq, axis=1), segments)
    return seg if mask is None else mask & seg


def repeat_kv(x, groups):
    """(B, Hkv, T, Dh) -> (B, Hkv * G, T, Dh): head h of the result is head h // G of x."""
    return x if groups == 1 else jnp.repeat(x, groups, axis=1)


def attention_scores(q, k, compute_dtype=None):
    """q (B, H, Tq, Dh), k (B, H, Tk, Dh) -> q k^T / sqrt(Dh) (B, H, Tq, Tk): the product in
    ``compute_dtype``, the scores in float32 or wider."""
    return upcast(matmul(q, jnp.swapaxes(k, -1, -2), compute_dtype)) / math.sqrt(q.shape[-1])


def capped_scores(q, k, spec: AttentionSpec):
    """attention_scores(q, k) (B, H, Tq, Tk), then softcap * tanh(scores / softcap) where
    spec.softcap is set (unmasked: the caller masks)."""
    scores = attention_scores(q, k, spec.compute_dtype)  # (B, H, Tq, Tk)
    if spec.softcap:
        scores = softcap(scores, spec.softcap)
    return scores


def masked_softmax(scores, mask=None):
    """softmax over the last axis of scores (..., Tk) where mask (broadcast; None: all) is
    True: masked scores get the dtype's minimum, and the row max (no gradient) is subtracted."""
    if mask is not None:
        scores = jnp.where(mask, scores, jnp.finfo(scores.dtype).min)
    scores = scores - jax.lax.stop_gradient(jnp.max(scores, axis=-1, keepdims=True))
    e = jnp.exp(scores)
    return e / jnp.sum(e, axis=-1, keepdims=True)


def attention_probs(q, k, spec: AttentionSpec, start=0, segments=None):
    """q (B, H, Tq, Dh), k (B, H, Tk, Dh) -> softmax(q k^T / sqrt(Dh)) (B, H, Tq, Tk) (the
    scores capped first with spec.softcap), the pairs spec.allowed refuses masked; query i
    sits at position start + i, key s at s (a decoder's cache: start > 0). ``segments`` (B, Tk):
    keys of another document masked too. q k^T runs in spec.compute_dtype, the softmax in
    float32 or wider."""
    scores = capped_scores(q, k, spec)  # (B, H, Tq, Tk)
    q_pos = start + jnp.arange(q.shape[-2])[:, None]  # (Tq, 1)
    mask = spec.allowed(q_pos, jnp.arange(k.shape[-2])[None, :])  # (Tq, Tk) or None
    return masked_softmax(scores, with_segments(mask, segments, start, q.shape[-2]))


def full(q, k, v, spec: AttentionSpec, key=None, segments=None):
    """q (B, H, T, Dh), k, v (B, Hkv, T, Dh) -> drop(softmax(q k^T / sqrt(Dh))) v (B, H, T, Dh),
    the (B, H, T, T) probabilities formed whole, k and v repeated to the H query heads here
    (so that a residual keeps their Hkv heads); ``key``: the probabilities' dropout at spec.dropout;
    ``segments`` (B, T): each position's document (another document's keys masked)."""
    G = q.shape[1] // k.shape[1]
    probs = dropout(attention_probs(q, repeat_kv(k, G), spec, 0, segments), spec.dropout, key)  # (B, H, T, T)
    return matmul(probs, repeat_kv(v, G), spec.compute_dtype)


def check_uncapped(spec: AttentionSpec, impl: str) -> None:
    """ValueError where spec caps the scores for a fused kernel, which cannot take a softcap."""
    if spec.softcap:
        raise ValueError(f"AttentionSpec.softcap is not supported by attention_impl {impl!r} (the "
                         "fused kernel takes no softcap); use 'full' or 'blockwise'")


def flash(q, k, v, spec: AttentionSpec, key=None, segments=None):
    """q (B, H, T, Dh), k, v (B, Hkv, T, Dh) -> (B, H, T, Dh): the Pallas kernels
    (jaxformer.kernels.pallas.flash_attention, its backward the hand-written kernels), tiles
    spec.block_q x spec.block_k; ``segments`` (B, T): the kernels mask other documents' keys
    tile by tile. No dropout, no softcap (ModelConfig refuses them)."""
    check_uncapped(spec, "pallas")
    return flash_attention(q, k, v, spec.causal, spec.block_q, spec.block_k, spec.compute_dtype, spec.window,
                           segments)


# ----------------------------------------------------------------------------
# cuDNN's fused attention

CUDNN_DTYPES = ("bfloat16", "float16")


def check_cudnn(products_dtype) -> None:
    """Raise ValueError where cuDNN's fused attention cannot take the products: a dtype
    other than bfloat16 / float16. The device is not checked here: the program runs cuDNN
    where it is lowered for cuda (``cudnn_core``), so a CPU process may export it."""
    if jnp.dtype(products_dtype).name not in CUDNN_DTYPES:
        raise ValueError(f"attention_impl 'cudnn' needs bfloat16 or float16 products, not "
                         f"{jnp.dtype(products_dtype).name}: set compute_dtype='bfloat16'")


def cudnn(q, k, v, spec: AttentionSpec, key=None, segments=None):
    """q (B, H, T, Dh), k, v (B, Hkv, T, Dh) -> (B, H, T, Dh): jax.nn.dot_product_attention's
    cuDNN implementation (lowered for cuda only, bfloat16 or float16 products; JAX's grad
    only). ``segments`` (B, T) go in as its boolean ``mask`` (B, 1, T, T) (cuDNN adds it as a
    bias: a (B, T, T) array, unlike the other cores). No dropout, no softcap (ModelConfig
    refuses them)."""
    dtype, mask = cudnn_inputs(q, spec, segments)
    q, k, v = (jnp.swapaxes(a, 1, 2).astype(dtype) for a in (q, k, v))  # (B, T, H, Dh), cuDNN's layout
    return jnp.swapaxes(cudnn_core(q, k, v, spec.causal, spec.window, mask), 1, 2)  # (B, H, T, Dh)


def cudnn_inputs(q, spec: AttentionSpec, segments=None):
    """What the cudnn core reads besides q, k, v, after its refusals (a soft cap; products not in
    bfloat16 or float16): (the products' dtype, the documents' mask (B, 1, T, T) or None).
    The manual pair's forward (manual_grads.attention.cudnn_core_fwd) reads the same."""
    check_uncapped(spec, "cudnn")
    dtype = jnp.dtype(spec.compute_dtype or q.dtype)
    check_cudnn(dtype)
    return dtype, None if segments is None else segment_mask(segments, segments)


def local_window(window: int):
    """jax.nn.dot_product_attention's local_window_size for our window W: (W - 1, 0), its
    left side counting the keys before the query (W keys with the query's own); None: no window."""
    return (window - 1, 0) if window else None


def cudnn_core(q, k, v, causal, window: int = 0, mask=None):
    """q (B, T, H, Dh), k, v (B, T, Hkv, Dh) -> (B, T, H, Dh): cuDNN's attention where the
    program is lowered for cuda (``window``: AttentionSpec.window, as ``local_window``; ``mask``:
    (B, 1, T, T) bool or None, the pairs allowed besides causal and window);
    lowered for any other platform (or run off a GPU), a
    ValueError naming it. Both branches are traced, so a CPU process can export the cuda
    program; JAX's cuDNN wrapper asks the CUDA plugin for cuDNN's version while tracing,
    and a process without the plugin gets that error at the cuda lowering, not before."""
    def on_cuda(q, k, v):
        try:
            return jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=causal, implementation="cudnn",
                                                local_window_size=local_window(window))
        except (RuntimeError, NotImplementedError) as error:  # no CUDA plugin here; a shape cuDNN refuses
            return _refused(q, not_lowered(error))

    return jax.lax.platform_dependent(q, k, v, cuda=on_cuda, default=lambda q, k, v: _refused(q, OFF_GPU))


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _refused(like, message: str):
    """refused.refused of ``like``'s shape and dtype (ValueError), differentiable: its
    cotangent is another such stand-in, so jax.grad traces the cuda program's other branch."""
    return refused(like, ValueError, message)


_refused.defvjp(lambda like, message: (_refused(like, message), None),
                lambda message, _, g: (_refused(g, message),))
