"""FlashAttention-2's forward as a Pallas kernel: softmax(q k^T / sqrt(Dh)) v without the
(T, T) matrix, the row log-sum-exp kept for the backward (pallas_backward.py).

Shape letters: B batch, H heads, T time, Dh head width; Kq, Kk the query and key block
sizes, Nq = ceil(T / Kq) and Nk = ceil(T / Kk) the numbers of blocks, Tq = Nq * Kq and
Tk = Nk * Kk the padded lengths, Dp the head width the kernels see (Dh; on a GPU the
next power of two, at least 16, as Triton's tiles need).

The kernel runs on a grid (B, H, Nq), one program per query block i. It keeps q_i
(Kq, Dp) and walks the key blocks j < upper(i) with an online softmax: the running row
max m, the row sum l of exp(s - m) and the unnormalised output acc, rescaled by
exp(m_old - m_new) as each block raises the max. With ``causal`` the loop stops at the
diagonal, so blocks above it are never loaded; padded keys (position >= T) and, if
causal, future keys are masked. It writes O_i = acc / l and lse_i = m + log(l).

Where it runs (``jax.default_backend()``): "gpu" compiled through Triton; "cpu" in
interpret mode (the same kernel, run as a jitted loop over the grid: slow, for proof);
anything else, a TPU among them, is refused with a ValueError naming the impl.

Precision (ModelConfig.compute_dtype, as precision.py's ``matmul``): q, k and v enter
the kernel in the compute dtype (None: their own), each product accumulates in
stats_dtype, and m, l, acc, O and lse stay in stats_dtype. Those dtypes, the scale and
every integer divisor are parameters of the kernel (Python floats, int32), so with
float64 inputs the whole kernel runs in float64.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxformer.model.precision import stats_dtype

# (block_q, block_k) when ModelConfig.pallas_block_q / pallas_block_k are 0. GPU: tiles
# small enough for the backward's float32 accumulators to stay in registers at Dh <= 128
# (untuned). CPU interpret mode pays per grid step and loop turn, so it takes big blocks.
DEFAULT_BLOCKS = {"gpu": (64, 64), "cpu": (128, 128)}
MIN_GPU_TILE = 16  # Triton's smallest matmul tile side
MASK = -0.7 * float(jnp.finfo(jnp.float32).max)  # a masked score: exp(MASK - m) is 0, never inf - inf


def backend() -> str:
    """The backend the kernels run on: "gpu" (compiled) or "cpu" (interpret mode).
    Anything else is refused by name."""
    name = jax.default_backend()
    if name == "tpu":
        raise ValueError(
            "attention_impl 'pallas' is a Triton (GPU) kernel and cannot run on a TPU: "
            "use attention_impl 'blockwise' (or 'full') there")
    if name not in DEFAULT_BLOCKS:
        raise ValueError(f"attention_impl 'pallas' runs on a GPU (or in interpret mode on CPU), "
                         f"not on backend {name!r}")
    return name


class Tiling(NamedTuple):
    """How a length-T, width-Dh attention is cut into tiles (all static Python ints)."""
    T: int  # the unpadded length
    Kq: int  # query block size
    Kk: int  # key block size
    Nq: int  # query blocks: ceil(T / Kq)
    Nk: int  # key blocks: ceil(T / Kk)
    Dh: int  # the head width
    Dp: int  # the head width the kernels see: Dh, or padded to Triton's tile


def _tile_side(name: str, block: int, T: int, gpu: bool) -> int:
    """The block size used for length T: ``block``, cut down to T (to the power of two
    covering T, at least 16, on a GPU) when T is shorter."""
    if not gpu:
        return min(block, T)
    if block < MIN_GPU_TILE or block & (block - 1):
        raise ValueError(f"ModelConfig.{name} must be a power of two >= {MIN_GPU_TILE} on a GPU "
                         f"(Triton's tiles), got {block}")
    return min(block, max(MIN_GPU_TILE, pl.next_power_of_2(T)))


def tiling(T: int, Dh: int, block_q: int = 0, block_k: int = 0, device: str | None = None) -> Tiling:
    """The tiles of a length-T attention; block_q / block_k of 0 take the device default.
    ``device`` ("gpu" or "cpu") defaults to the running backend."""
    device = device or backend()
    default_q, default_k = DEFAULT_BLOCKS[device]
    gpu = device == "gpu"
    Kq = _tile_side("pallas_block_q", block_q or default_q, T, gpu)
    Kk = _tile_side("pallas_block_k", block_k or default_k, T, gpu)
    Dp = max(MIN_GPU_TILE, pl.next_power_of_2(Dh)) if gpu else Dh
    return Tiling(T, Kq, Kk, -(-T // Kq), -(-T // Kk), Dh, Dp)


def pad(x, length: int, width: int):
    """(B, H, T, Dh, ...) -> (B, H, length, width, ...) zero-padded (the time axis at 2,
    the head width at 3, when x has one)."""
    widths = [(0, 0)] * x.ndim
    widths[2] = (0, length - x.shape[2])
    if x.ndim > 3:
        widths[3] = (0, width - x.shape[3])
    return jnp.pad(x, widths)


def launch(kernel, grid, in_specs, out_specs, out_shape, name: str):
    """pl.pallas_call on the running backend: Triton on a GPU, interpret mode on CPU."""
    gpu = backend() == "gpu"
    params = plgpu.CompilerParams(num_warps=4, num_stages=2) if gpu else None
    return pl.pallas_call(kernel, grid=grid, in_specs=in_specs, out_specs=out_specs,
                          out_shape=out_shape, interpret=not gpu, compiler_params=params,
                          name=name)


# ----------------------------------------------------------------------------
# the pieces every kernel shares: one tile of scores, and which key blocks a query block sees


def dot(a, b, acc_dtype, contract=(1, 0)):
    """a @ b of two 2-D tiles (``contract`` names the summed axis of each: (1, 0) is
    a @ b, (1, 1) a @ b^T, (0, 0) a^T @ b), accumulated in ``acc_dtype``."""
    dims = (((contract[0],), (contract[1],)), ((), ()))
    return jax.lax.dot_general(a, b, dims, preferred_element_type=acc_dtype)


def tile_scores(q, k, i, j, t: Tiling, causal: bool, acc_dtype):
    """q_i (Kq, Dp), k_j (Kk, Dp) -> s_ij (Kq, Kk) = q_i k_j^T / sqrt(Dh) in acc_dtype;
    MASK where the key is padding (position >= T) or, if causal, in the future."""
    s = dot(q, k, acc_dtype, (1, 1)) * (1.0 / math.sqrt(t.Dh))  # (Kq, Kk)
    q_pos = i * t.Kq + jnp.arange(t.Kq, dtype=jnp.int32)[:, None]  # (Kq, 1)
    k_pos = j * t.Kk + jnp.arange(t.Kk, dtype=jnp.int32)[None, :]  # (1, Kk)
    visible = k_pos < t.T
    if causal:
        visible = visible & (k_pos <= q_pos)  # (Kq, Kk)
    return jnp.where(visible, s, MASK)


def key_blocks_seen(i, t: Tiling, causal: bool):
    """How many key blocks query block i sees: all Nk, or when causal those up to the one
    holding its last query, ceil((i + 1) * Kq / Kk) (never past Nk)."""
    if not causal:
        return t.Nk
    upper = jax.lax.div((i + 1) * t.Kq + (t.Kk - 1), jnp.int32(t.Kk))
    return jnp.minimum(upper, jnp.int32(t.Nk))


def first_query_block(j, t: Tiling, causal: bool):
    """The first query block that sees key block j: 0, or when causal the one holding
    query position j * Kk, floor(j * Kk / Kq)."""
    if not causal:
        return 0
    return jax.lax.div(j * t.Kk, jnp.int32(t.Kq))


# ----------------------------------------------------------------------------
# the forward kernel


def _forward_kernel(q_ref, k_ref, v_ref, o_ref, lse_ref, *, t: Tiling, causal: bool, acc_dtype):
    """Program (b, h, i): q_ref (Kq, Dp) = q_i; k_ref, v_ref (Tk, Dp) of this head;
    o_ref (Kq, Dp) <- O_i; lse_ref (Kq,) <- lse_i."""
    i = pl.program_id(2)
    q = q_ref[...]  # (Kq, Dp)

    def key_block(j, carry):
        m, l, acc = carry  # (Kq,), (Kq,), (Kq, Dp)
        k = k_ref[pl.ds(j * t.Kk, t.Kk), :]  # (Kk, Dp)
        v = v_ref[pl.ds(j * t.Kk, t.Kk), :]
        s = tile_scores(q, k, i, j, t, causal, acc_dtype)  # (Kq, Kk)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))  # finite: key 0 is visible in block 0
        alpha = jnp.exp(m - m_new)  # rescales the old sums; 0 on the first block
        p = jnp.exp(s - m_new[:, None])  # (Kq, Kk): 0 where masked
        l = alpha * l + jnp.sum(p, axis=1)
        acc = alpha[:, None] * acc + dot(p.astype(v.dtype), v, acc_dtype)
        return m_new, l, acc

    init = (jnp.full((t.Kq,), -jnp.inf, acc_dtype), jnp.zeros((t.Kq,), acc_dtype),
            jnp.zeros((t.Kq, t.Dp), acc_dtype))
    m, l, acc = jax.lax.fori_loop(0, key_blocks_seen(i, t, causal), key_block, init)
    o_ref[...] = (acc / l[:, None]).astype(o_ref.dtype)  # O_i = softmax(S_i) v
    lse_ref[...] = m + jnp.log(l)  # lse_i = log rowsum(exp(S_i))


def query_spec(t: Tiling):
    """Query block i of head (b, h): (Kq, Dp) of a (B, H, Tq, Dp) array."""
    return pl.BlockSpec((None, None, t.Kq, t.Dp), lambda b, h, i: (b, h, i, 0))


def row_spec(t: Tiling):
    """Query block i of head (b, h): (Kq,) of a (B, H, Tq) array."""
    return pl.BlockSpec((None, None, t.Kq), lambda b, h, i: (b, h, i))


def head_spec(length: int, t: Tiling):
    """All of head (b, h): (length, Dp) of a (B, H, length, Dp) array, for any program."""
    return pl.BlockSpec((None, None, length, t.Dp), lambda b, h, n: (b, h, 0, 0))


def padded_inputs(q, k, v, t: Tiling, compute_dtype=None):
    """q, k, v (B, H, T, Dh) -> (B, H, Tq, Dp), (B, H, Tk, Dp) twice: zero-padded and in
    the products' dtype (compute_dtype, or q's own), as the kernels read them."""
    cd = jnp.dtype(compute_dtype or q.dtype)
    Tq, Tk = t.Nq * t.Kq, t.Nk * t.Kk
    return pad(q.astype(cd), Tq, t.Dp), pad(k.astype(cd), Tk, t.Dp), pad(v.astype(cd), Tk, t.Dp)


def flash_forward(q, k, v, causal: bool, t: Tiling, out_dtype):
    """The forward kernel on padded inputs: q (B, H, Tq, Dp), k, v (B, H, Tk, Dp) ->
    O (B, H, Tq, Dp) in ``out_dtype`` and lse (B, H, Tq) in stats_dtype(out_dtype)."""
    B, H = q.shape[:2]
    acc_dtype = stats_dtype(out_dtype)
    kernel = functools.partial(_forward_kernel, t=t, causal=causal, acc_dtype=acc_dtype)
    return launch(
        kernel, (B, H, t.Nq),
        in_specs=[query_spec(t), head_spec(k.shape[2], t), head_spec(v.shape[2], t)],
        out_specs=[query_spec(t), row_spec(t)],
        out_shape=[jax.ShapeDtypeStruct(q.shape, out_dtype),
                   jax.ShapeDtypeStruct(q.shape[:3], acc_dtype)],
        name="flash_attention_forward",
    )(q, k, v)


def pallas_attention_core(q, k, v, causal: bool, block_q: int = 0, block_k: int = 0,
                          compute_dtype=None):
    """q, k, v (B, H, T, Dh) -> (out (B, H, T, Dh) in q's dtype, lse (B, H, T) in stats_dtype):
    out = softmax(q k^T / sqrt(Dh)) v, future masked if causal, by the forward kernel,
    its products in ``compute_dtype``. The raw kernel: it has no derivative
    (pallas_backward.flash_attention has)."""
    T, Dh = q.shape[2:]
    t = tiling(T, Dh, block_q, block_k)
    out, lse = flash_forward(*padded_inputs(q, k, v, t, compute_dtype), causal, t, q.dtype)
    return out[:, :, :T, :Dh], lse[:, :, :T]
