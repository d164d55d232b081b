"""The block's norm, layer norm or RMS norm as config.norm_type says, forward and backward;
on a GPU through the Pallas kernels of jaxformer/kernels/pallas/norm.py.

XLA compiles a norm to several kernels on a GPU, each reading the row again (the kernels'
module says which). The kernels read each row once each way, and the backward adds the skip
connection's gradient in the same pass (``skip``). They come with the attention's kernels:
where config.attention_impl is "pallas" or "cudnn" (a program with custom calls already:
``jax.export`` asks for them to be allowed, a multi-platform export cannot hold them), the
forward takes them and marks its residual (``KERNELS``), and the backward of a marked residual
takes them too; with "full" or "blockwise" the step holds no custom call, as before. Which runs
then is the platform the program is lowered for (``jax.lax.platform_dependent``): "cuda" and
"rocm" the kernels, any other the XLA code of layer_norm.py and rms_norm.py, so a CPU or TPU
program is as it was. Both give the same values to rounding (tests/test_norm_kernel.py proves
the kernels equal to that code in interpret mode, float64 and float32). Only inputs with
float32 statistics take the kernels (Triton has no fast float64). On a mesh a kernel runs per
shard of the batch (kernels/shards.py). Where the backward's dx is a product's output cotangent
(``feeds``), the kernel also writes what that product reads of it (a ``linear.Cotangent``); where
the forward's input is a residual sum (``add_norm_fwd``), the kernel writes the sum too.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxformer.kernels.pallas.norm import norm_backward, norm_forward
from jaxformer.kernels.shards import per_example_shards
from jaxformer.model.config import ModelConfig
from jaxformer.model.precision import kept, kept_dtype, stats_dtype
from manual_grads.layer_norm import column_sums, layer_norm_bwd, layer_norm_fwd, layer_norm_res
from manual_grads.linear import Cotangent
from manual_grads.rms_norm import RMSNormRes, rms_norm_bwd, rms_norm_fwd, rms_norm_res

GPU_KERNELS = True  # False: the XLA code on a GPU too (experiments/step_profile.py and gpu_launches.py --norms xla)
KERNEL_ATTENTION = ("pallas", "cudnn")  # the attention_impl values whose steps take the norms' kernels


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class GpuKernels:
    """A norm residual's mark (a static node): its forward chose the kernels for a GPU, and so
    does its backward."""


KERNELS = GpuKernels()


def _kernels(config: ModelConfig, dtype) -> bool:
    """Whether a norm of ``dtype`` inputs takes the kernels on a GPU: the attention runs a
    kernel, and the statistics are float32."""
    return GPU_KERNELS and config.attention_impl in KERNEL_ATTENTION and stats_dtype(dtype) == jnp.float32


def _on_gpu(kernel_branch, xla_branch, *args, after=lambda *outs: outs):
    """after(*kernel_branch(*args)) where the program is lowered for "cuda" or "rocm" (the
    kernel per shard of the batch on a mesh, ``after`` on the whole), else xla_branch(*args)."""
    def gpu(*args):
        return after(*per_example_shards(kernel_branch, *args))
    return jax.lax.platform_dependent(*args, cuda=gpu, rocm=gpu, default=xla_branch)


def _xla_norm_fwd(p, x, config: ModelConfig):
    if config.norm_type == "rms":
        y, res = rms_norm_fwd(p, x, config.ln_eps, config.norm_offset)
    else:
        y, res = layer_norm_fwd(p, x, config.ln_eps)
    return y, res._replace(xhat=kept(res.xhat, config.compute_dtype))  # bfloat16 under its policy


def residual_sum(x, branch, bias=None):
    """The residual stream's sum where a sublayer's output projection leaves its bias to the
    norm after it (``add_norm_fwd``): x + (branch + bias), as x + linear(...) rounds it."""
    return x + (branch if bias is None else branch + bias)


def norm_fwd(p, x, config: ModelConfig, products_only: bool = False):
    """The norm config.norm_type names (the model's ``pick_norm``): x (..., D) -> y, res; the
    normalized x kept as ``precision.kept`` says (bfloat16 under a bfloat16 compute dtype:
    the backward reads it in float32). ``products_only``: only products read y, each cast to
    the compute dtype, so y is written in it where ``precision.kept`` keeps that (the cast done
    once, in the norm's pass; the products' input cotangents come back in it too)."""
    y, res, _ = _norm_fwd(p, x, config, products_only)
    return y, res


def add_norm_fwd(p, x, branch, bias, config: ModelConfig, products_only: bool = False):
    """s = residual_sum(x, branch, bias) and norm_fwd's (y, res) of it: (y, res, s). Where the
    norm runs as a kernel, the kernel reads x and the branch and writes s in its own pass (XLA
    wrote s in a kernel of its own, which the norm then read again); else XLA's code of the two."""
    return _norm_fwd(p, x, config, products_only, branch, bias)


def _norm_fwd(p, x, config: ModelConfig, products_only: bool, branch=None, bias=None):
    """(y, res, s): norm_fwd's of s = residual_sum(x, branch, bias); without a branch s is x. The
    rows (x, branch) go to the kernel per shard of a mesh; bias (D,) is closed over."""
    rows = (x,) if branch is None else (x, branch)
    dtype = jnp.result_type(*rows, *(() if bias is None else (bias,)))  # s's
    narrow = kept_dtype(stats_dtype(dtype), config.compute_dtype)  # the compute dtype if 16-bit
    y_dtype = narrow if products_only else None

    def xla(x, *branch):
        s = residual_sum(x, *branch, bias) if branch else x
        y, res = _xla_norm_fwd(p, s, config)
        return (y if y_dtype is None else y.astype(y_dtype)), res, s

    if not _kernels(config, dtype):
        return xla(*rows)
    rms = config.norm_type == "rms"
    offset = config.norm_offset if rms else 0.0

    def kernel(x, *branch):  # (y, xhat, rstd), and s where there is a branch
        return norm_forward(x, p.get("scale"), p.get("bias"), eps=config.ln_eps, rms=rms, offset=offset,
                            y_dtype=y_dtype, kept_dtype=narrow, add=branch[0] if branch else None, add_bias=bias)

    def xla_arrays(x, *branch):
        y, res, s = xla(x, *branch)
        return (y, res.xhat, res.rstd) + ((s,) if branch else ())

    y, xhat, rstd, *s = _on_gpu(kernel, xla_arrays, *rows)
    res = rms_norm_res(p, xhat, rstd, offset) if rms else layer_norm_res(p, xhat, rstd)
    return y, res._replace(kernels=KERNELS), (s[0] if s else x)  # the backward takes the kernels too


def _xla_norm_bwd(res, dy, skip=None):
    dp, dx = (rms_norm_bwd if isinstance(res, RMSNormRes) else layer_norm_bwd)(res, dy)
    return dp, (dx if skip is None else dx + skip)


def _xla_cotangent(dx, feeds):
    """The Cotangent ``feeds`` asks of dx, in XLA's code."""
    narrow, bias = feeds
    return Cotangent(dx, None if narrow is None else dx.astype(narrow), column_sums(dx)[0] if bias else None)


def cotangent_feeds(compute_dtype, bias: bool, dtype=jnp.float32):
    """The ``feeds`` of a norm backward whose dx (of ``dtype``) is the output cotangent of a product
    (a sublayer's output projection, ``bias`` whether it has one; its products run in
    ``compute_dtype``): (that dtype where it is narrower than dtype's statistics, else None; bias)."""
    narrow = kept_dtype(stats_dtype(dtype), compute_dtype)
    return (None if narrow == stats_dtype(dtype) else narrow), bias


def norm_bwd(res, dy, skip=None, feeds=None):
    """Undoes whichever norm made ``res``: dy (..., D) -> (dp, dx); ``skip`` (..., D): the
    gradient of a skip connection around the norm's sublayer, added to dx (y = skip + ...).
    ``feeds`` (``cotangent_feeds``): dx is the output cotangent of the product that reads it next,
    returned as a Cotangent with what that product reads, made in the same pass (the kernels'):
    its copy in the product's compute dtype, the column sums for its bias."""
    rms = isinstance(res, RMSNormRes)
    if res.kernels is None:  # the forward ran XLA's code
        dp, dx = _xla_norm_bwd(res, dy, skip)
        return dp, (dx if feeds is None else _xla_cotangent(dx, feeds))
    offset = res.offset if rms else None
    scale = res.scale if offset is None else offset + res.scale.astype(offset.dtype)  # y = xhat (offset + scale)
    has_skip = skip is not None
    narrow, bias = feeds or (None, False)

    def kernel(dy, xhat, rstd, *skip):
        return norm_backward(dy, xhat, rstd, scale, rms=rms, skip=skip[0] if has_skip else None,
                             narrow_dtype=narrow, dx_sums=bias)

    def xla(dy, xhat, rstd, *skip):
        dp, dx = _xla_norm_bwd(res._replace(xhat=xhat, rstd=rstd), dy, skip[0] if has_skip else None)
        zeros = jnp.zeros(dx.shape[-1:], dx.dtype)  # the kernel branch's sums, of a norm without them too
        cot = _xla_cotangent(dx, (narrow, bias))
        more = ([cot.narrow] if narrow is not None else []) + ([cot.sums.astype(dx.dtype)] if bias else [])
        return dx, dp.get("scale", zeros).astype(dx.dtype), dp.get("bias", zeros).astype(dx.dtype), *more

    def sums(dx, dscale, dbias, *more):  # each program's column sums, on a mesh each shard's: (D,) each
        narrow_copy = more[:1] if narrow is not None else ()
        dscale, dbias, *dx_sums = column_sums(dscale, dbias, *more[len(narrow_copy):])  # one reduction
        return (dx, dscale, dbias, *narrow_copy, *dx_sums)

    dx, dscale, dbias, *more = _on_gpu(kernel, xla, dy, res.xhat, res.rstd, *([skip] if has_skip else []),
                                       after=sums)
    if feeds is not None:
        dx = Cotangent(dx, more[0] if narrow is not None else None, more[-1] if bias else None)
    if res.scale is None:
        return {}, dx
    dp = {"scale": dscale.astype(res.scale.dtype)}
    if not rms and res.has_bias is not None:
        dp["bias"] = dbias.astype(res.scale.dtype)
    return dp, dx
