"""cuDNN's fused attention as a forward and backward pair, for the hand-derived gradient source.

The model's ``cudnn`` core (jaxformer/model/cores.py) calls ``jax.nn.dot_product_attention``
with ``implementation="cudnn"``; JAX's grad then runs cuDNN's backward kernel through the
``jax.custom_vjp`` inside it. ``cudnn_fwd`` / ``cudnn_bwd`` are that custom_vjp's two rules
called apart, as the Pallas pair (kernels/pallas/entry.py) is, so that the manual step runs
cuDNN's forward kernel (keeping O and the softmax statistics) and, in its own backward,
cuDNN's backward kernel (FlashAttention-2's dQ, dK, dV from q, k, v, O, dO and the statistics),
everything around them by hand:

    O, res = cudnn_fwd(q, k, v, causal, window, mask)       # cuDNN's forward, training mode
    dq, dk, dv = cudnn_bwd(res, dO)                          # cuDNN's backward

The arguments are those ``jax.nn.dot_product_attention`` hands the custom_vjp (``cudnn_args``:
the mask type from ``causal``, the window as cuDNN's sliding_window_length, a boolean mask as
an additive bias, the BTNH layout, cuDNN's version), so both gradient sources launch the same
two kernels with the same settings (tests/test_cudnn_pair.py compares them in the program
lowered for cuda). The pair reaches into ``jax._src.cudnn.fused_attention_stablehlo`` (JAX
exports the forward alone): a JAX whose custom_vjp no longer has the rules this reads is
refused in one line at trace time.

Where it runs: the platform the program is lowered for, as ``cores.cudnn_core``: cuda runs
cuDNN; every other platform gets ``refused`` stand-ins that raise when lowered or run, so a
CPU process can still trace and export the cuda program.
"""

from __future__ import annotations

import functools
import inspect
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax._src.cudnn import fused_attention_stablehlo as fa  # the custom_vjp whose rules the pair calls

from jaxformer.kernels.refused import refused

LAYOUT = fa._normalize_layout("BTNH")  # cuDNN's (batch, time, heads, head width), as the model's cudnn core passes

OFF_GPU = ("attention_impl 'cudnn' runs only on a GPU (cuDNN's fused attention); the program "
           "is lowered for {platform}: use 'pallas', 'blockwise' or 'full'")


def not_lowered(error: Exception) -> str:
    """The one line of a cuda lowering that cannot trace cuDNN's attention here: no CUDA plugin
    (RuntimeError: JAX reads cuDNN's version from it), a shape cuDNN refuses, a JAX without the rules."""
    hint = (" (JAX reads cuDNN's version from its CUDA plugin while tracing: pip install "
            "'jaxformer[cuda]')") if isinstance(error, RuntimeError) else ""
    return f"attention_impl 'cudnn' cannot be lowered for cuda here: {error}{hint}"


class CudnnRes(NamedTuple):
    """What cuDNN's backward reads, arrays alone (a layer scan stacks residuals): the
    custom_vjp forward rule's own residual and, as empty arrays' shapes, what the pair was
    asked. CausalCudnnRes (the same fields) undoes the causal forward."""
    q: jax.Array  # (H, 0, Dh) empty, in q's dtype as given: attention_bwd reads H and Dh, the cotangents the dtype
    saved: tuple  # the forward rule's residual (q, k, v in (B, T, ., Dh), the bias, O, the statistics, ...);
    #               (q, k, v) alone where cuDNN could not be traced here
    window: jax.Array  # (window, 0) int32, empty: the sliding window's width (0: none)


class CausalCudnnRes(CudnnRes):
    pass


# what newer JAXes' cuDNN attention takes besides, as jax.nn.dot_product_attention passes it
# when unused (JAX 0.12's score modifier, flex attention's: none)
UNUSED_NEWER = {"score_mod_args": (), "score_mod": None}


def _custom_vjp():
    """JAX's cuDNN attention custom_vjp, with the rules and the signature the pair reads."""
    vjp = getattr(fa, "_dot_product_attention", None)
    if vjp is None or not all(hasattr(vjp, a) for a in ("fwd", "bwd", "fun", "nondiff_argnums")):
        raise NotImplementedError(f"this JAX ({jax.__version__}) has no cuDNN attention custom_vjp whose rules "
                                  "the hand-derived source can call: use --grads auto with attention_impl 'cudnn'")
    return vjp


def _ordered(values: dict, static: bool) -> tuple:
    """The custom_vjp's array arguments (``static`` False) or its static ones, in the order of
    its signature, from ``values`` by parameter name (and UNUSED_NEWER): the signature differs
    between JAX versions (0.12 added the score modifier's two). The static ones come last in
    every version, so the forward rule takes (*arrays, *static), the backward rule (*static,
    residual, cotangent)."""
    vjp = _custom_vjp()
    names = list(inspect.signature(vjp.fun).parameters)
    first = len(names) - len(vjp.nondiff_argnums)  # the first static argument's place
    names = names[first:] if static else names[:first]
    unknown = [n for n in names if n not in values and n not in UNUSED_NEWER]
    if unknown or tuple(vjp.nondiff_argnums) != tuple(range(first, first + len(vjp.nondiff_argnums))):
        what = ", ".join(unknown) if unknown else "static arguments among its arrays"
        raise NotImplementedError(f"this JAX's ({jax.__version__}) cuDNN attention takes {what}, which the "
                                  "hand-derived source does not pass: use --grads auto with attention_impl 'cudnn'")
    return tuple(values[n] if n in values else UNUSED_NEWER[n] for n in names)


def rule_args(values: dict) -> tuple[tuple, tuple]:
    """(the arrays, the static arguments) of JAX's cuDNN attention custom_vjp from ``values`` by
    parameter name, each in the order of the installed JAX's signature (``_ordered``)."""
    return _ordered(values, static=False), _ordered(values, static=True)


def exports_dbias(bias, q) -> bool:
    """Whether JAX's cuDNN attention has its backward kernel compute the gradient of ``bias``,
    the additive bias a boolean mask becomes (the model's documents): JAX 0.10 asks
    ``should_export_dbias`` (yes for every shape); later JAXes compute it only for a bias or a
    mask that can carry a gradient, never for a boolean mask's."""
    ask = getattr(fa, "should_export_dbias", None)
    return ask is not None and ask(bias.shape, q.shape, LAYOUT)


def cudnn_static(q, causal: bool, window: int, bias) -> dict:
    """The custom_vjp's static arguments by name for q (B, T, H, Dh) and the bias (or None), as
    ``jax.nn.dot_product_attention(..., implementation="cudnn")`` passes them: scale
    1/sqrt(Dh), seed 42, no dropout, (has bias, exports the bias's gradient), the mask type
    (causal or none), the BTNH layout, the window (None: none), cuDNN's version, no residual
    returned. Raises RuntimeError where JAX cannot read cuDNN's version (no CUDA plugin)."""
    has_bias = bias is not None
    return dict(scale=1.0 / float(q.shape[-1]) ** 0.5, seed=42, dropout_rate=0.0,
                variadic_args=(has_bias, has_bias and exports_dbias(bias, q)),
                mask_type=fa.MaskType.CAUSAL if causal else fa.MaskType.NO_MASK, layout=LAYOUT.value,
                sliding_window_length=window or None, cudnn_version=fa.check_cudnn_version(), return_residual=False)


def cudnn_args(q, k, v, causal: bool, window: int = 0, mask=None) -> dict:
    """q (B, T, H, Dh), k, v (B, T, Hkv, Dh) in a 16-bit dtype, mask (B, 1, T, T) bool or None
    -> every argument the cuDNN custom_vjp takes, by parameter name (rule_args orders them), as
    ``jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=causal, implementation="cudnn",
    local_window_size=(window - 1, 0))`` hands them: the mask an additive bias (0 or a large
    negative number), no sequence lengths, offsets or page tables (empty placeholders)."""
    bias = fa.combine_bias_and_mask(None, mask, q.dtype)
    fa.check_layout(q, k, v, bias, None, None, None, None, None, None, LAYOUT)
    unused = jnp.zeros(0, dtype=q.dtype)
    return dict(query=q, key=k, value=v, bias=unused if bias is None else bias, q_seqlen=unused, kv_seqlen=unused,
                q_offsets=unused, kv_offsets=unused, page_table_k=unused, page_table_v=unused,
                **cudnn_static(q, causal, window, bias))


def cudnn_fwd(q, k, v, causal: bool, window: int = 0, mask=None, compute_dtype=None):
    """q (B, H, T, Dh), k, v (B, Hkv, T, Dh) -> (O (B, H, T, Dh) in the products' dtype,
    CudnnRes): cuDNN's forward kernel in training mode (it keeps the softmax statistics), where
    the program is lowered for cuda, on q, k, v in ``compute_dtype`` (bfloat16 or float16; None:
    their own); ``window`` W > 0 (causal): each query reads its W newest keys; ``mask``
    (B, 1, T, T) bool: the pairs allowed besides."""
    cd = jnp.dtype(compute_dtype or q.dtype)
    btnh = tuple(jnp.swapaxes(a, 1, 2).astype(cd) for a in (q, k, v))  # (B, T, H, Dh): cuDNN's layout
    out_shape = jax.ShapeDtypeStruct(btnh[0].shape, btnh[0].dtype)
    res = functools.partial(CausalCudnnRes if causal else CudnnRes, jnp.zeros((q.shape[1], 0, q.shape[3]), q.dtype),
                            window=jnp.zeros((window, 0), jnp.int32))
    try:
        arrays, static = rule_args(cudnn_args(*btnh, causal, window, mask))
        fwd = _custom_vjp().fwd
    except (RuntimeError, NotImplementedError) as error:  # no CUDA plugin here; a JAX without the rules
        message = not_lowered(error)
        out = jax.lax.platform_dependent(q, cuda=lambda q: refused(out_shape, ValueError, message),
                                         default=lambda q: refused(out_shape, ValueError, OFF_GPU))
        return jnp.swapaxes(out, 1, 2), res(btnh)  # (q, k, v) alone: the backward refuses too

    def on_cuda(*arrays):
        out, saved = fwd(*arrays, *static)
        return out, tuple(saved)

    shapes = jax.eval_shape(on_cuda, *arrays)
    out, saved = jax.lax.platform_dependent(*arrays, cuda=on_cuda,
                                            default=lambda *a: refused(shapes, ValueError, OFF_GPU))
    return jnp.swapaxes(out, 1, 2), res(saved)


def cudnn_bwd(res: CudnnRes, dout):
    """dO (B, H, T, Dh) -> (dq (B, H, T, Dh), dk, dv (B, Hkv, T, Dh)) in the dtype q had:
    cuDNN's backward kernel on the forward's residual, where the program is lowered for cuda."""
    saved, dtype = res.saved, res.q.dtype
    shapes = tuple(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in saved[:3])  # dq, dk, dv as q, k, v (B, T, ., Dh)
    if len(saved) == 3:  # the forward could not trace cuDNN: refused again, in the cotangents' place
        grads = refused(shapes, ValueError, OFF_GPU)
    else:
        static = _ordered(cudnn_static(saved[0], isinstance(res, CausalCudnnRes), res.window.shape[-2],
                                       saved[3] if saved[3].size else None), static=True)
        do = jnp.swapaxes(dout, 1, 2).astype(saved[0].dtype)  # (B, T, H, Dh)

        def on_cuda(saved, do):  # dq, dk, dv; the bias's gradient and the rest dropped
            return tuple(_custom_vjp().bwd(*static, saved, do)[:3])

        grads = jax.lax.platform_dependent(saved, do, cuda=on_cuda,
                                           default=lambda saved, do: refused(shapes, ValueError, OFF_GPU))
    return tuple(jnp.swapaxes(g, 1, 2).astype(dtype) for g in grads)
