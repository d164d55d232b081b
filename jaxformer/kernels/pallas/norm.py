"""Layer norm and RMS norm over the last axis as Pallas kernels: one pass over memory each way.

XLA compiles a norm's forward to four or five kernels on a GPU (the row scale's max, the
mean, the variance, then one kernel for each output), each reading the row again; its
backward to three or four (the row means of dxhat and dxhat xhat, dx, the columns' sums).
These kernels hold a block of rows in registers instead:

    forward   x (N, D) -> y (N, D), xhat (N, D), rstd (N, 1): x read once; where asked, x is
              the residual stream's sum x + (branch + bias), written beside the three
    backward  dy, xhat, rstd (and the skip connection's gradient) -> dx (N, D) and each
              program's column sums of dy xhat and dy (G, D): each input read once; where
              asked, dx's copy in the next products' dtype and its column sums too

The math is the model's, step for step (jaxformer/model/layer_norm.py ``row_scale`` and
``layer_norm_stats``, jaxformer/model/rms_norm.py ``rms_norm_stats``; the backward is
manual_grads/layer_norm.py's and rms_norm.py's); tests/test_norm_kernel.py proves each
kernel, in interpret mode, equal to them in float64 and float32. The row scale s (an exact
power of two, so that no square leaves the float range) is built from the bits of the row's
max: Triton has no frexp.

A row of D features is read as D / C chunks of C columns, C the largest power of two that
divides D (at most 256): Triton's tiles are powers of two, GPT-2's D = 768 is 3 x 256 and
SmolLM's 576 is 9 x 64. A forward program takes R rows (R x D at most ``TILE`` elements);
a backward program walks every G-th block of R rows, so its column sums are one (1, D) row a
program, not one a block.

Where they run: the manual step calls them on a GPU only (manual_grads/norms.py, through
``jax.lax.platform_dependent``); ``interpret=True`` runs them anywhere, for the proofs. Under
jax.shard_map their outputs vary over the mesh axes their row input does (shard_map's check of
varying axes asks it of a kernel). Nothing here is tuned on a GPU yet: R, G, the warps and
stages are untimed choices.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxformer.kernels.pallas.forward import stats_dtype

TILE = 4096  # a program's rows x features at most: a forward block of R rows holds R x D values
MAX_CHUNK = 256  # the widest column chunk C
# The backward's programs at most (G), each writing one row of column sums: enough threads in
# flight to keep a GPU's memory busy (1,024 programs of 4 warps: 131k threads, about half of an
# H100's 132 processors' room), while the (G, D) sums stay small beside the inputs (6 MiB at
# GPT-2's D 768 against 145 MiB read and written). Its loop prefetches the next block
# (BACKWARD_STAGES: Triton's software pipelining).
PROGRAMS = 1024
WARPS = 4
BACKWARD_STAGES = 2


def chunk(D: int) -> int:
    """C: the largest power of two dividing D, at most MAX_CHUNK."""
    return min(D & -D, MAX_CHUNK)


def rows_per_block(N: int, D: int) -> int:
    """R: the largest power of two with R x D <= TILE (at least 1) that divides N."""
    R = 1
    while R * 2 * D <= TILE and N % (R * 2) == 0:
        R *= 2
    return R


def row_scale(top, bad, dtype):
    """The model's row_scale from a row's max |x| ``top`` (R, 1) and whether the row holds a
    non-finite value ``bad`` (R, 1): s = 2^-max(e, 0), e frexp's exponent of top (top = m 2^e,
    m in [0.5, 1)); s = 1 for a bad row. Built from the bits: e = E - bias + 1 for the biased
    exponent E of a normal top (a subnormal or zero top has e <= 0, s = 1), and s's bits are
    (bias + 2 - max(e, 0)) << mantissa bits, times 1/4: exact down to frexp's largest exponent,
    bias + 1, where s = 2^-(bias + 1) is subnormal."""
    info = jnp.finfo(dtype)
    ints = jnp.int64 if info.bits == 64 else jnp.int32
    bias = -int(info.minexp) + 1  # 127 for float32, 1023 for float64
    E = jax.lax.shift_right_logical(jax.lax.bitcast_convert_type(top, ints), ints(info.nmant))
    e = jnp.where(bad, 0, jnp.maximum(E - (bias - 1), 0))
    bits = jax.lax.shift_left(bias + 2 - e, ints(info.nmant))
    return jax.lax.bitcast_convert_type(bits.astype(ints), dtype) * jnp.asarray(0.25, dtype)


def _forward_kernel(*refs, D: int, C: int, eps: float, rms: bool, offset: float, sd, has_scale: bool,
                    has_bias: bool, has_add: bool, has_add_bias: bool):
    x_ref, refs = refs[0], list(refs[1:])
    add_ref = refs.pop(0) if has_add else None
    scale_ref = refs.pop(0) if has_scale else None
    bias_ref = refs.pop(0) if has_bias else None
    add_bias_ref = refs.pop(0) if has_add_bias else None
    y_ref, xhat_ref, rstd_ref, *sum_ref = refs  # sum_ref: [s's block] with has_add
    cols = [slice(c, c + C) for c in range(0, D, C)]
    xs = [x_ref[:, c] for c in cols]  # (R, C) each: the row block, read once
    if has_add:  # the residual stream's sum, x + (branch + bias), rounded as the model rounds it
        branches = [add_ref[:, c] for c in cols]
        if has_add_bias:
            branches = [b + add_bias_ref[:, c] for b, c in zip(branches, cols)]
        xs = [x + b for x, b in zip(xs, branches)]
        for c, x in zip(cols, xs):
            sum_ref[0][:, c] = x
    xs = [x.astype(sd) for x in xs]
    top = functools.reduce(jnp.maximum, [jnp.max(jnp.abs(x), axis=1, keepdims=True) for x in xs])
    bad = functools.reduce(jnp.maximum, [jnp.max((~jnp.isfinite(x)).astype(sd), axis=1, keepdims=True)
                                         for x in xs]) > 0  # (R, 1): a non-finite value in the row
    s = row_scale(top, bad, sd)  # (R, 1)
    xs = [x * s for x in xs]  # xs = x * s
    if rms:
        ms = sum(jnp.sum(x * x, axis=1, keepdims=True) for x in xs) / D  # mean(xs * xs)
        r = jax.lax.rsqrt(ms + eps * s * s)
        xhats = [x * r for x in xs]  # xs * r
    else:
        mean = sum(jnp.sum(x, axis=1, keepdims=True) for x in xs) / D
        xcs = [x - mean for x in xs]  # xc = xs - mean(xs)
        var = sum(jnp.sum(xc * xc, axis=1, keepdims=True) for xc in xcs) / D  # mean(xc * xc)
        r = jax.lax.rsqrt(var + eps * s * s)
        xhats = [xc * r for xc in xcs]  # xc * r
    rstd_ref[...] = (s * r).astype(rstd_ref.dtype)
    for c, xhat in zip(cols, xhats):
        xhat_ref[:, c] = xhat.astype(xhat_ref.dtype)
        y = xhat
        if has_scale:  # y = xhat * scale (+ bias), or xhat * (offset + scale)
            scale = scale_ref[:, c].astype(sd)
            y = y * (offset + scale) if offset else y * scale
        if has_bias:
            y = y + bias_ref[:, c].astype(sd)
        y_ref[:, c] = y.astype(y_ref.dtype)


def norm_forward(x, scale, bias, *, eps: float, rms: bool, offset: float = 0.0, y_dtype=None, kept_dtype=None,
                 add=None, add_bias=None, interpret: bool = False):
    """x (..., D) -> (y (..., D) in ``y_dtype``, xhat (..., D) in ``kept_dtype``, rstd (..., 1)),
    both dtypes stats_dtype(x) unless given. ``scale`` (D,) or None (an RMS norm without one),
    ``bias`` (D,) or None; ``rms``: RMS norm (no mean, no bias), else layer norm; ``offset``:
    the scale applied as (offset + scale) (RMS norm). ``add`` (..., D), ``add_bias`` (D,) or
    None: the norm of s = x + (add + add_bias) instead, s returned fourth, in the dtype the
    model's sum has (x and add read once, s written once: no pass of its own over memory)."""
    *lead, D = x.shape
    N = x.size // D
    if add is not None:
        s_dtype = jnp.result_type(x, add, *([add_bias] if add_bias is not None else []))
        x, add = x.astype(s_dtype), add.astype(s_dtype)
        add_bias = None if add_bias is None else add_bias.astype(s_dtype)
    sd = stats_dtype(x.dtype)
    C, R = chunk(D), rows_per_block(N, D)
    y_dtype, kept_dtype = y_dtype or sd, kept_dtype or sd
    params = [p.reshape(1, D) for p in (scale, bias, add_bias) if p is not None]
    kernel = functools.partial(_forward_kernel, D=D, C=C, eps=float(eps), rms=rms, offset=float(offset), sd=sd,
                               has_scale=scale is not None, has_bias=bias is not None, has_add=add is not None,
                               has_add_bias=add_bias is not None)
    rows = pl.BlockSpec((R, D), lambda i: (i, 0))
    shape = functools.partial(jax.ShapeDtypeStruct, manual_axis_type=jax.typeof(x).mat)  # varying as x
    out_specs = [rows, rows, pl.BlockSpec((R, 1), lambda i: (i, 0))]
    out_shape = [shape((N, D), y_dtype), shape((N, D), kept_dtype), shape((N, 1), sd)]
    if add is not None:
        out_specs, out_shape = out_specs + [rows], out_shape + [shape((N, D), x.dtype)]
    y, xhat, rstd, *s = pl.pallas_call(
        kernel, grid=(N // R,), interpret=interpret, name="norm_forward",
        in_specs=[rows] * (2 if add is not None else 1) + [pl.BlockSpec((1, D), lambda i: (0, 0))] * len(params),
        out_specs=out_specs, out_shape=out_shape,
        compiler_params=None if interpret else plgpu.CompilerParams(num_warps=WARPS, num_stages=1),
    )(x.reshape(N, D), *([add.reshape(N, D)] if add is not None else []), *params)
    out = (y.reshape(x.shape), xhat.reshape(x.shape), rstd.reshape(*lead, 1))
    return out + (s[0].reshape(x.shape),) if add is not None else out


def _backward_kernel(*refs, D: int, C: int, R: int, steps: int, G: int, rms: bool, sd, has_scale: bool,
                     has_skip: bool, has_narrow: bool, has_sums: bool):
    dy_ref, xhat_ref, rstd_ref, refs = refs[0], refs[1], refs[2], list(refs[3:])
    scale_ref = refs.pop(0) if has_scale else None
    skip_ref = refs.pop(0) if has_skip else None
    dx_ref, dscale_ref, dbias_ref = refs[:3]
    narrow_ref = refs[3] if has_narrow else None
    dxsum_ref = refs[-1] if has_sums else None
    cols = [slice(c, c + C) for c in range(0, D, C)]
    scales = [scale_ref[:, c].astype(sd) for c in cols] if has_scale else [None] * len(cols)
    program = pl.program_id(0)

    def block(step, sums):
        rows = pl.ds((step * G + program) * R, R)  # this program's step-th block: every G-th
        dys = [dy_ref[rows, c].astype(sd) for c in cols]
        xhats = [xhat_ref[rows, c].astype(sd) for c in cols]
        rstd = rstd_ref[rows, :].astype(sd)  # (R, 1)
        dxhats = dys if not has_scale else [dy * w for dy, w in zip(dys, scales)]  # y = xhat * scale
        m2 = sum(jnp.sum(g * xh, axis=1, keepdims=True) for g, xh in zip(dxhats, xhats)) / D  # mean(dxhat xhat)
        if rms:  # dx = rstd (dxhat - xhat mean(dxhat xhat))
            dxs = [rstd * (g - xh * m2) for g, xh in zip(dxhats, xhats)]
        else:  # dx = rstd (dxhat - mean(dxhat) - xhat mean(dxhat xhat))
            m1 = sum(jnp.sum(g, axis=1, keepdims=True) for g in dxhats) / D
            dxs = [rstd * (g - m1 - xh * m2) for g, xh in zip(dxhats, xhats)]
        outs = []
        for c, dx in zip(cols, dxs):
            if has_skip:  # y = skip + norm(x): the skip connection's gradient adds
                dx = dx + skip_ref[rows, c].astype(sd)
            dx = dx.astype(dx_ref.dtype)
            dx_ref[rows, c] = dx
            if has_narrow:  # the copy the next products read, rounded from the dx written
                narrow_ref[rows, c] = dx.astype(narrow_ref.dtype)
            outs.append(dx.astype(sd))
        dscale = [a + jnp.sum(dy * xh, axis=0, keepdims=True) for a, dy, xh in zip(sums[0], dys, xhats)]
        dbias = [a + jnp.sum(dy, axis=0, keepdims=True) for a, dy in zip(sums[1], dys)]
        dxsum = [a + jnp.sum(dx, axis=0, keepdims=True) for a, dx in zip(sums[2], outs)] if has_sums else sums[2]
        return dscale, dbias, dxsum

    zeros = [jnp.zeros((1, C), sd) for _ in cols]
    dscale, dbias, dxsum = jax.lax.fori_loop(0, steps, block, (zeros, zeros, zeros if has_sums else []))
    for c, a, b in zip(cols, dscale, dbias):
        dscale_ref[:, c] = a
        dbias_ref[:, c] = b
    for c, a in zip(cols, dxsum):
        dxsum_ref[:, c] = a


def norm_backward(dy, xhat, rstd, scale, *, rms: bool, skip=None, narrow_dtype=None, dx_sums: bool = False,
                  interpret: bool = False):
    """The backward of ``norm_forward``: dy (..., D), xhat (..., D), rstd (..., 1), ``scale``
    (D,) as y = xhat * scale applied it (an RMS norm's offset added: offset + scale), or None ->
    dx (..., D) in stats_dtype (plus ``skip`` (..., D) where given), and each program's column
    sums of dy xhat and dy, (G, D) each in stats_dtype: summed over their first axis they are
    dscale and dbias. (Left to the caller: on a mesh each shard's programs add theirs.)
    For the products dx feeds next, in the same pass: ``narrow_dtype``, dx's copy in that dtype
    (dx rounded to it); ``dx_sums``, each program's column sums of dx (G, D), the bias gradient of
    the product whose output's gradient dx is. Returned after the three, in that order, where asked."""
    D = dy.shape[-1]
    N = dy.size // D
    sd = stats_dtype(jnp.result_type(dy.dtype, xhat.dtype, rstd.dtype))
    C, R = chunk(D), rows_per_block(N, D)
    blocks = N // R
    G = max(g for g in range(1, min(PROGRAMS, blocks) + 1) if blocks % g == 0)
    inputs = [dy.reshape(N, D), xhat.reshape(N, D), rstd.reshape(N, 1)]
    inputs += [scale.reshape(1, D)] if scale is not None else []
    inputs += [skip.reshape(N, D)] if skip is not None else []
    kernel = functools.partial(_backward_kernel, D=D, C=C, R=R, steps=blocks // G, G=G, rms=rms, sd=sd,
                               has_scale=scale is not None, has_skip=skip is not None,
                               has_narrow=narrow_dtype is not None, has_sums=dx_sums)
    whole = [pl.BlockSpec(a.shape, lambda i: (0, 0)) for a in inputs]
    shape = functools.partial(jax.ShapeDtypeStruct, manual_axis_type=jax.typeof(dy).mat)  # varying as dy
    rows, sums = pl.BlockSpec((N, D), lambda i: (0, 0)), pl.BlockSpec((1, D), lambda i: (i, 0))
    out_specs, out_shape = [rows, sums, sums], [shape((N, D), sd), shape((G, D), sd), shape((G, D), sd)]
    if narrow_dtype is not None:
        out_specs, out_shape = out_specs + [rows], out_shape + [shape((N, D), narrow_dtype)]
    if dx_sums:
        out_specs, out_shape = out_specs + [sums], out_shape + [shape((G, D), sd)]
    dx, dscale, dbias, *more = pl.pallas_call(
        kernel, grid=(G,), interpret=interpret, name="norm_backward", in_specs=whole, out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=None if interpret else plgpu.CompilerParams(num_warps=WARPS, num_stages=BACKWARD_STAGES),
    )(*inputs)
    if narrow_dtype is not None:
        more[0] = more[0].reshape(dy.shape)
    return (dx.reshape(dy.shape), dscale, dbias, *more)
