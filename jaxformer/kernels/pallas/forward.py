"""FlashAttention-2's forward as a Pallas kernel: softmax(q k^T / sqrt(Dh)) v without the
(T, T) matrix, the row log-sum-exp kept for the backward (backward.py).

Shape letters: B batch, H query heads, Hkv key/value heads (H % Hkv == 0; G = H // Hkv
query heads share one, query head h reading key/value head h // G: grouped-query
attention, Llama's ``repeat_kv`` order; G = H is multi-query); T time, Dh head width;
Kq, Kk the query and key block sizes, Nq = ceil(T / Kq) and Nk = ceil(T / Kk) the
numbers of blocks, Tq = Nq * Kq and Tk = Nk * Kk the padded lengths, Dp the head width
the kernels see (Dh; on a GPU the next power of two, at least 16, as Triton's tiles need).

The kernel runs on a grid (B, H, Nq), one program per query block i. It keeps q_i
(Kq, Dp) and walks the key blocks j < upper(i) of its key/value head with an online
softmax: the running row max m, the row sum l of exp(s - m) and the unnormalised output
acc, rescaled by exp(m_old - m_new) as each block raises the max. With ``causal`` the
loop stops at the diagonal, so blocks above it are never loaded; with a sliding window W
it starts at the block of key i Kq - W + 1 (``first_key_block``), so older ones are not either; padded keys (position
>= T) and, if causal, future keys are masked, and with segment ids (packed documents) the keys
of another document: each program reads its query block's ids (Kq, 1) and each key block's
(1, Kk) beside q and k (``segment_inputs``). It writes O_i = acc / l and lse_i = m + log(l).
Row statistics are (Kq, 1) columns and row arrays (B, H, Tq, 1), the layout both Triton
and Mosaic (TPU) take.

Where it runs: the platform the program is lowered for (platform.py, ``on_platform``),
not the process's default backend: "cuda"/"rocm" launch it through Triton, "tpu" through
Mosaic, any other platform (CPU) in interpret mode. Every branch takes and returns
unpadded arrays, so each pads to its own tiles (tiling.py, ``plan``): block sizes, the
head-width padding and the GPU's tuned launch (read from tune.py's table) are per branch.

Precision (ModelConfig.compute_dtype, as precision.py's ``matmul``): q, k and v enter
the kernel in the compute dtype (None: their own), each product accumulates in
stats_dtype, and m, l, acc, O and lse stay in stats_dtype. Those dtypes, the scale and
every integer divisor are parameters of the kernel (Python floats, int32), so with
float64 inputs the whole kernel runs in float64 (interpret mode only: GPUs run it in
float32 at most, TPUs have no float64).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as plgpu

from jaxformer.kernels.pallas import tune as pallas_tune
from jaxformer.kernels.pallas.platform import on_platform
from jaxformer.kernels.shards import varying_as
from jaxformer.kernels.pallas.tiling import Launch, Tiling, plan


def stats_dtype(dtype):
    """float32, or the input's dtype when wider: jaxformer.model.precision.stats_dtype's rule
    (the kernels room sits below the model room and imports nothing from it)."""
    return jnp.promote_types(dtype, jnp.float32)


MASK = -0.7 * float(jnp.finfo(jnp.float32).max)  # a masked score: exp(MASK - m) is 0, never inf - inf


def pad(x, length: int, width: int | None = None):
    """(B, H, T, ...) -> (B, H, length, ...) zero-padded on the time axis, and the head
    width (axis 3) to ``width`` when given."""
    widths = [(0, 0)] * x.ndim
    widths[2] = (0, length - x.shape[2])
    if width is not None:
        widths[3] = (0, width - x.shape[3])
    return jnp.pad(x, widths)


def launch(kernel, grid, in_specs, out_specs, out_shape, name: str, how: Launch):
    """pl.pallas_call for ``how``: Triton on a GPU, Mosaic on a TPU (every grid axis
    parallel: each program writes its own output block), else interpret mode. Under
    jax.shard_map the outputs vary over the mesh axes the first input does (its manual
    axis type: a shard's rows, or a tensor-parallel device's heads), as shard_map's check
    of varying axes asks of a kernel's outputs."""
    params = None
    if how.device == "gpu":
        params = plgpu.CompilerParams(num_warps=how.num_warps, num_stages=how.num_stages)
    elif how.device == "tpu":
        params = pltpu.CompilerParams(dimension_semantics=("parallel",) * len(grid))

    def run(*args):
        mat = jax.typeof(args[0]).mat
        shapes = jax.tree_util.tree_map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, manual_axis_type=mat),
                                        out_shape)
        call = functools.partial(pl.pallas_call, grid=grid, out_shape=shapes, interpret=how.interpret,
                                 compiler_params=None if how.interpret is True else params, name=name)
        if how.interpret is True and mat.varying:
            return _interpret_varying(kernel, call, in_specs, out_specs, shapes, args)
        return call(kernel, in_specs=in_specs, out_specs=out_specs)(*args)
    return run


def _interpret_varying(kernel, call, in_specs, out_specs, shapes, args):
    """The interpreted kernel under shard_map with its check of varying axes: JAX's interpreter
    starts each output from a fresh buffer that varies over no mesh axis, so its loop's carry
    changes type. Each output starts instead from a zero input that varies as the outputs do,
    aliased to it (input_output_aliases); the kernel never reads those inputs (it writes every
    block of its outputs), so it computes the same."""
    many = isinstance(shapes, (list, tuple))
    outs = list(shapes) if many else [shapes]
    specs = list(out_specs) if many else [out_specs]
    inits = [varying_as(jnp.zeros(s.shape, s.dtype), s) for s in outs]
    n = len(args)

    def aliased(*refs):  # (inputs, the outputs' initial inputs, outputs): the kernel's own refs
        return kernel(*refs[:n], *refs[n + len(outs):])

    return call(aliased, in_specs=list(in_specs) + specs, out_specs=out_specs,
                input_output_aliases={n + i: i for i in range(len(outs))})(*args, *inits)


# ----------------------------------------------------------------------------
# the pieces every kernel shares: one tile of scores, and which key blocks a query block sees


def dot(a, b, acc_dtype, contract=(1, 0)):
    """a @ b of two 2-D tiles (``contract`` names the summed axis of each: (1, 0) is
    a @ b, (1, 1) a @ b^T, (0, 0) a^T @ b), accumulated in ``acc_dtype``."""
    dims = (((contract[0],), (contract[1],)), ((), ()))
    return jax.lax.dot_general(a, b, dims, preferred_element_type=acc_dtype)


def tile_scores(q, k, i, j, t: Tiling, causal: bool, acc_dtype, window: int = 0, seg=None):
    """q_i (Kq, Dp), k_j (Kk, Dp) -> s_ij (Kq, Kk) = q_i k_j^T / sqrt(Dh) in acc_dtype;
    MASK where the key is padding (position >= T) or, if causal, in the future, or with a
    sliding ``window`` W (causal) W or more positions back (key <= query - W), or with
    ``seg`` (the query ids (Kq, 1), the key ids (1, Kk)) of another document. A ``seg`` of
    four (``tile_ids``: the ids, then the query positions (Kq, 1) and the key positions (1, Kk))
    holds the tokens' global positions: the window reads those."""
    s = dot(q, k, acc_dtype, (1, 1)) * (1.0 / math.sqrt(t.Dh))  # (Kq, Kk)
    q_pos = i * t.Kq + jax.lax.broadcasted_iota(jnp.int32, (t.Kq, t.Kk), 0)  # (Kq, Kk)
    k_pos = j * t.Kk + jax.lax.broadcasted_iota(jnp.int32, (t.Kq, t.Kk), 1)
    visible = k_pos < t.T
    if causal:
        visible = visible & (k_pos <= q_pos)
    if seg is not None and len(seg) == 4:  # positioned_ids: the window on the global positions
        q_pos, k_pos = seg[2], seg[3]
    if window:
        visible = visible & (k_pos > q_pos - window)
    if seg is not None:
        visible = visible & (seg[0] == seg[1])
    return jnp.where(visible, s, MASK)


def tile_ids(ids, query, key):
    """The ids' refs of a kernel (``segment_inputs``' arrays: the queries' and the keys' ids, then
    with positions the queries' and the keys' positions) read for one tile: each query ref by
    ``query``, each key ref by ``key``, as ``tile_scores`` takes them; None without ids."""
    return tuple(query(r) if n % 2 == 0 else key(r) for n, r in enumerate(ids)) or None


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


def first_key_block(i, t: Tiling, window: int):
    """The first key block query block i sees: 0, or with a sliding window W the one holding
    key i * Kq - W + 1 (its first query's oldest key), floor((i Kq - W + 1) / Kk), never below 0.
    The blocks before it are never loaded: the work is O(T W)."""
    if not window:
        return 0
    return jax.lax.div(jnp.maximum(i * t.Kq - (window - 1), 0), jnp.int32(t.Kk))


def query_blocks_seen(j, t: Tiling, window: int):
    """One past the last query block that sees key block j: Nq, or with a sliding window W
    the one holding query (j + 1) Kk - 1 + W - 1 (its last key's newest reader), never past Nq."""
    if not window:
        return t.Nq
    last = (j + 1) * t.Kk + window - 2
    return jnp.minimum(jax.lax.div(last, jnp.int32(t.Kq)) + 1, jnp.int32(t.Nq))


def block_loop(lower, upper, body, init, interpreted: bool = False):
    """jax.lax.fori_loop(lower, upper, body, init): a program's walk over blocks. Interpreted,
    its bounds become traced values where they are constants (0, Nk: no causal mask, no window),
    so it is a while loop as the causal walks are, not a scan: JAX's interpreter evaluates the
    kernel's jaxpr (traced varying over no mesh axis) on inputs that vary under shard_map's
    check of varying axes, which refuses a scan whose carry changes type. The compiled kernels
    keep fori_loop's own choice."""
    if interpreted:
        zero = pl.program_id(0) * 0
        lower, upper = zero + lower, zero + upper
    return jax.lax.fori_loop(lower, upper, body, init)


# ----------------------------------------------------------------------------
# the forward kernel


def _forward_kernel(q_ref, k_ref, v_ref, *refs, t: Tiling, causal: bool, acc_dtype, window: int = 0,
                    interpreted: bool = False):
    """Program (b, h, i): q_ref (Kq, Dp) = q_i; k_ref, v_ref (Tk, Dp) of key/value head
    h // G; refs: the ids' (none, or the query ids (Kq, 1) and the key ids (1, Tk), then with
    positions the same of the positions: ``segment_inputs``), o_ref (Kq, Dp) <- O_i,
    lse_ref (Kq, 1) <- lse_i."""
    *ids, o_ref, lse_ref = refs
    i = pl.program_id(2)
    q = q_ref[...]  # (Kq, Dp)

    def key_block(j, carry):
        m, l, acc = carry  # (Kq, 1), (Kq, 1), (Kq, Dp)
        k = k_ref[pl.ds(j * t.Kk, t.Kk), :]  # (Kk, Dp)
        v = v_ref[pl.ds(j * t.Kk, t.Kk), :]
        seg = tile_ids(ids, lambda r: r[...], lambda r: r[:, pl.ds(j * t.Kk, t.Kk)])  # (Kq, 1), (1, Kk) each
        s = tile_scores(q, k, i, j, t, causal, acc_dtype, window, seg)  # (Kq, Kk)
        # finite: MASK at worst; a row whose keys in this block are all masked (a window's first
        # block) gets a sum of exp(0) that the first visible key's alpha = exp(MASK - m) zeroes
        m_new = jnp.maximum(m, jnp.max(s, axis=1, keepdims=True))
        alpha = jnp.exp(m - m_new)  # rescales the old sums; 0 on the first block
        p = jnp.exp(s - m_new)  # (Kq, Kk): 0 where masked
        l = alpha * l + jnp.sum(p, axis=1, keepdims=True)
        acc = alpha * acc + dot(p.astype(v.dtype), v, acc_dtype)
        return m_new, l, acc

    init = (jnp.full((t.Kq, 1), -jnp.inf, acc_dtype), jnp.zeros((t.Kq, 1), acc_dtype),
            jnp.zeros((t.Kq, t.Dp), acc_dtype))
    m, l, acc = block_loop(first_key_block(i, t, window), key_blocks_seen(i, t, causal), key_block, init, interpreted)
    o_ref[...] = (acc / l).astype(o_ref.dtype)  # O_i = softmax(S_i) v
    lse_ref[...] = m + jnp.log(l)  # lse_i = log rowsum(exp(S_i))


def query_spec(t: Tiling, width: int | None = None):
    """Query block i of head (b, h): (Kq, width) of a (B, H, Tq, width) array (width:
    Dp; 1 for the row arrays lse and D)."""
    width = t.Dp if width is None else width
    return pl.BlockSpec((None, None, t.Kq, width), lambda b, h, i: (b, h, i, 0))


def kv_head(h, group: int):
    """The key/value head query head h reads: h // G (h itself when G is 1)."""
    return h if group == 1 else jax.lax.div(h, jnp.int32(group))


def head_spec(length: int, width: int, group: int = 1):
    """All of head (b, h // group): (length, width) of a (B, H // group, length, width)
    array, for any program n; group G maps a query head to its key/value head."""
    return pl.BlockSpec((None, None, length, width), lambda b, h, n: (b, kv_head(h, group), 0, 0))


def positioned_ids(segments, positions, batch: int):
    """Each token's document id (segments (B, T), or None: one document) beside its global
    position (positions (T,)) -> (B, T, 2) int32: the ids the kernels take where a sliding window
    must read positions other than the tokens' places in the call (a ring visit's chunks,
    jaxformer/model/parallel/ring_flash.py). The kernels' block loops keep their window bounds on
    the local places, so a key's global distance behind a query must be at least its local one
    (so it is in a ring visit: its keys precede its queries, or are its own chunk's, in order)."""
    pos = jnp.broadcast_to(jnp.asarray(positions, jnp.int32), (batch, positions.shape[0]))
    ids = jnp.zeros_like(pos) if segments is None else segments.astype(jnp.int32)
    return jnp.stack([ids, pos], axis=-1)


def segment_inputs(segments, t: Tiling, key_segments=None):
    """segments (B, T) int -> the query ids (B, 1, Tq, 1) and the key ids (B, 1, 1, Tk), int32,
    padded with -1 (padded keys are masked anyway); () for None (no segment ids). The keys' ids
    are ``key_segments`` (B, T) where given: keys that are other tokens than the queries (a ring
    visit's, jaxformer/model/parallel/ring_flash.py), ``segments`` then the queries' alone.
    ``positioned_ids``' (B, T, 2) give four: the ids as above, then the positions alike."""
    if segments is None:
        return ()
    keys = segments if key_segments is None else key_segments
    if segments.ndim == 3:  # [id, position]: each column as a (B, T) array of its own
        return sum((segment_inputs(segments[..., n], t, keys[..., n]) for n in (0, 1)), ())
    qs, ks = (a.astype(jnp.int32)[:, None, :, None] for a in (segments, keys))  # (B, 1, T, 1)
    qs = jnp.pad(qs, ((0, 0), (0, 0), (0, t.Nq * t.Kq - qs.shape[2]), (0, 0)), constant_values=-1)
    ks = jnp.pad(ks, ((0, 0), (0, 0), (0, t.Nk * t.Kk - ks.shape[2]), (0, 0)), constant_values=-1)
    return qs, jnp.swapaxes(ks, 2, 3)


def query_segment_spec(t: Tiling):
    """Query block i's ids: (Kq, 1) of the (B, 1, Tq, 1) query ids, for program (b, h, i)."""
    return pl.BlockSpec((None, None, t.Kq, 1), lambda b, h, i: (b, 0, i, 0))


def whole_segment_spec(shape):
    """All of example b's ids: ``shape`` ((Tq, 1) or (1, Tk)) of a (B, 1, ...) array, any program."""
    return pl.BlockSpec((None, None) + tuple(shape), lambda b, h, n: (b, 0, 0, 0))


def padded_inputs(q, k, v, t: Tiling, compute_dtype=None):
    """q (B, H, T, Dh), k, v (B, Hkv, T, Dh) -> (B, H, Tq, Dp), (B, Hkv, Tk, Dp) twice:
    zero-padded and in the products' dtype (compute_dtype, or q's own)."""
    cd = jnp.dtype(compute_dtype or q.dtype)
    Tq, Tk = t.Nq * t.Kq, t.Nk * t.Kk
    return pad(q.astype(cd), Tq, t.Dp), pad(k.astype(cd), Tk, t.Dp), pad(v.astype(cd), Tk, t.Dp)


def flash_forward(q, k, v, causal: bool, t: Tiling, out_dtype, how: Launch, window: int = 0, segs=()):
    """The forward kernel on padded inputs: q (B, H, Tq, Dp), k, v (B, Hkv, Tk, Dp) ->
    O (B, H, Tq, Dp) in ``out_dtype`` and lse (B, H, Tq, 1) in stats_dtype(out_dtype).
    ``segs``: segment_inputs' (query ids, key ids[, query positions, key positions]), or ()."""
    B, H = q.shape[:2]
    acc_dtype = stats_dtype(out_dtype)
    whole_kv = head_spec(k.shape[2], t.Dp, H // k.shape[1])
    seg_specs = [query_segment_spec(t), whole_segment_spec((1, k.shape[2]))] * (len(segs) // 2)
    kernel = functools.partial(_forward_kernel, t=t, causal=causal, acc_dtype=acc_dtype, window=window,
                               interpreted=how.interpret is True)
    return launch(
        kernel, (B, H, t.Nq), in_specs=[query_spec(t), whole_kv, whole_kv] + seg_specs,
        out_specs=[query_spec(t), query_spec(t, 1)],
        out_shape=[jax.ShapeDtypeStruct(q.shape, out_dtype),
                   jax.ShapeDtypeStruct(q.shape[:3] + (1,), acc_dtype)],
        name="flash_attention_forward", how=how,
    )(q, k, v, *segs)


def check_heads(q, k, v) -> int:
    """G = H // Hkv for q (B, H, T, Dh), k, v (B, Hkv, T, Dh); ValueError naming the
    shapes when they do not fit."""
    if k.shape != v.shape or q.shape[:1] + q.shape[2:] != k.shape[:1] + k.shape[2:] \
            or k.shape[1] == 0 or q.shape[1] % k.shape[1]:
        raise ValueError(f"flash_attention needs q (B, H, T, Dh) and k, v (B, Hkv, T, Dh) with H a "
                         f"multiple of Hkv; got q {q.shape}, k {k.shape}, v {v.shape}")
    return q.shape[1] // k.shape[1]


def forward_on(device: str, q, k, v, segments=None, key_segments=None, *, causal: bool, block_q: int = 0,
               block_k: int = 0, compute_dtype=None, interpret=None, tuned=None, window: int = 0):
    """One platform's forward: q (B, H, T, Dh), k, v (B, Hkv, T, Dh) -> (out (B, H, T, Dh)
    in q's dtype, lse (B, H, T) in stats_dtype), padded to ``device``'s tiles inside
    (``plan``; interpret and tuned as there); ``segments`` (B, T): document ids, or None
    (``key_segments``: the keys' own, as ``segment_inputs`` takes them)."""
    T, Dh = q.shape[2:]
    G = check_heads(q, k, v)
    cd = jnp.dtype(compute_dtype or q.dtype)
    t, how = plan(device, pallas_tune.Shape(T, Dh, cd.name, causal, G), block_q, block_k, interpret, tuned)
    out, lse = flash_forward(*padded_inputs(q, k, v, t, cd), causal, t, q.dtype, how, window,
                             segment_inputs(segments, t, key_segments))
    return out[:, :, :T, :Dh], lse[:, :, :T, 0]


def pallas_attention_core(q, k, v, causal: bool, block_q: int = 0, block_k: int = 0,
                          compute_dtype=None, window: int = 0, segments=None, key_segments=None):
    """q (B, H, T, Dh), k, v (B, Hkv, T, Dh) -> (out (B, H, T, Dh) in q's dtype, lse
    (B, H, T) in stats_dtype): out = softmax(q k^T / sqrt(Dh)) v, query head h reading
    key/value head h // (H // Hkv), future masked if causal (and keys ``window`` or more
    back, a sliding window; another document's keys with ``segments`` (B, T)), by the forward
    kernel of the platform lowered for. The raw kernel: no derivative (entry.flash_attention has).
    ``key_segments`` (B, T): the keys' ids where they are not the queries' (``segment_inputs``)."""
    branch = functools.partial(forward_on, causal=causal, block_q=block_q, block_k=block_k,
                               compute_dtype=compute_dtype, window=window)
    return on_platform(branch, q, k, v, *segment_args(segments, key_segments))


def segment_args(segments, key_segments=None) -> list:
    """The ids a platform branch takes after its arrays: none, the queries' and keys' one
    array, or the queries' and then the keys'."""
    if segments is None:
        return []
    return [segments] if key_segments is None else [segments, key_segments]
