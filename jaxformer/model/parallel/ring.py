"""Context parallelism: ring attention over the mesh's ``context`` axis (c devices), each device
holding T/c tokens of q, k and v (the cores' layout (B, H, T/c, Dh); k and v may have Hkv
heads, Hkv dividing H, read by G = H / Hkv query heads each, as the cores' ``repeat_kv`` says).

Device i keeps its queries and passes key/value chunks around the ring: at step s it holds
device j = (i - s) mod c's chunk (its k, v and, with packed documents, its segment ids),
visits it, and receives the next from its left neighbour (ppermute i -> i + 1 mod c).
A visit is one block of the online softmax (blockwise.py's ``online_softmax_step``): the
running row max m, the row sum l of exp(S - m) and the unnormalised acc = sum exp(S - m) v,
where for the queries at positions q_pos and the keys at k_pos

    S = q k_j^T / sqrt(Dh)                                     cores.attention_scores
    S = -inf where k_pos > q_pos (causal: spec.allowed on the GLOBAL positions each chunk holds)
              or where the two tokens' documents differ         (cores.segment_mask)
    m' = max(m, rowmax S);  l' = e^(m - m') l + rowsum e^(S - m');  acc' = e^(m - m') acc + e^(S - m') v_j

and after the c steps  O = acc / l,  lse = m + log l  (the row log-sum-exp, all the backward
needs: manual_grads/parallel/ring.py recomputes P = exp(S - lse) one visit at a time). The
statistics stay in stats_dtype (float32 or wider). Only k and v travel (Hkv heads: a grouped
model sends G times fewer bytes), c - 1 hops of each; no device ever holds all T keys.

Zig-zag layout (the default; Llama 3's context parallelism, ring-flash-attention's zigzag):
the sequence is cut into 2c equal pieces of n = T / 2c tokens, and device i holds pieces i and
2c - 1 - i (``to_zigzag`` / ``from_zigzag`` reorder a natural-order array, ``chunk_positions``
are a device's global positions). Under a causal mask every device then has the same work:
    own chunk (j = i):   the (T/c x T/c) block, causal inside it;
    earlier (j < i):     all its queries see key piece j wholly, piece 2c-1-j not at all:
                         a (T/c x n) block, nothing masked by causality;
    later (j > i):       only its second piece 2c-1-i sees the chunk, and wholly: (n x T/c).
``visited`` names those blocks; a visit computes just that block (``lax.switch`` on the kind,
the whole mask still applied inside, so the slices only drop pairs that are masked anyway).
The "contiguous" layout (device i holds tokens i T/c .. (i+1) T/c - 1) visits earlier chunks
whole and skips later ones: device c - 1 does c blocks, device 0 one. Without the causal mask
(``causal=False``) every visit is the whole block; the layout is then only a permutation.

The blockwise core's memory inside a visit (``block`` K > 0, ModelConfig.attention_block under
attention_impl "blockwise"): the visit's keys are folded K at a time (``over_key_blocks``, a
``lax.scan`` of online_softmax_step), so a device holds (B, H, rows, K) scores, never the
(T/c x T/c) block; the visits and the hops are unchanged. The scores' soft cap
(S -> softcap tanh(S / softcap), before the mask) and a sliding window (a query at t reads the
keys t - W < s <= t: spec.allowed on the global positions) are the cores' own rules, read per
pair as the causal one is (``ring_spec``); the visits ``visited`` names stay the causal ones,
a window only masking more inside them.

No query row is ever wholly masked: under either mask a token reads itself (its own
position, its own document); a visit may mask a row wholly (m stays -inf, l = 0, as in
blockwise.py), and a row with l = 0 at the end would give O = 0, not NaN.

The steps run as a ``lax.scan`` over steps 1 .. c - 1, step 0 (the own chunk: the one block
with a causal mask inside, and no hop before it) ahead of it. A Python loop would unroll c
visits, each with its switch, into the program; the scan's body is traced once, one ppermute
per travelling array, so the program does not grow with c and its lowered text shows the
ring's hops plainly. Each step receives its chunk, then visits it: c - 1 hops, none wasted. (A
kernel overlapping the next hop with this visit's products would send before visiting, and
send one hop more, or peel the last step; on the CPUs that prove it there is nothing to hide.)

``walk`` is that scan for any visit (its reverse pass, ``walk_back``, the backwards' ring:
dK, dV travelling with their chunk); ring_flash.py walks it with the Pallas kernels as visits.

``ring_attention`` runs inside ``jax.shard_map`` over the axis; ``ring_attention_on_mesh``
takes whole (B, H, T, Dh) arrays in natural order, reorders them, runs the shard_map (every
other mesh axis replicated) and restores the order. A sequence that 2c does not divide
(c for the contiguous layout) is refused in one line naming the axis, its size and T.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from jaxformer.model.blockwise import block_size, online_softmax_step
from jaxformer.model.cores import AttentionSpec, capped_scores, repeat_kv, segment_mask
from jaxformer.model.dropout import Piece, PieceKey, active
from jaxformer.model.parallel.regions import CONTEXT  # the mesh axis the sequence splits over
from jaxformer.model.precision import stats_dtype

ZIGZAG, CONTIGUOUS = "zigzag", "contiguous"
LAYOUTS = (ZIGZAG, CONTIGUOUS)
SELF, EARLIER, LATER = 0, 1, 2  # the kinds of a visit: the own chunk, an earlier device's, a later one's


# ----------------------------------------------------------------------------
# the layout: which tokens each device holds


def pieces(c: int, layout: str = ZIGZAG) -> int:
    """How many equal pieces the sequence is cut into for ``c`` devices: 2c (zig-zag) or c."""
    if layout not in LAYOUTS:
        raise ValueError(f"ring attention layout {layout!r}: use one of {LAYOUTS}")
    return 2 * c if layout == ZIGZAG else c


def check_context(T: int, c: int, axis_name: str = CONTEXT, layout: str = ZIGZAG) -> None:
    """A ValueError in one line unless ``c`` devices can hold T tokens in ``layout``."""
    p = pieces(c, layout)
    if T % p:
        what = f"2 x {axis_name} = {p} (the zig-zag layout's equal pieces)" if layout == ZIGZAG else axis_name
        raise ValueError(f"mesh axis {axis_name}={c} does not fit the sequence length {T}: {what} must divide "
                         "the sequence length")


def layout_order(T: int, c: int, layout: str = ZIGZAG) -> np.ndarray:
    """(T,) int: the natural position of each slot of the layout, device 0's T/c slots first.
    Zig-zag: pieces 0, 2c-1, 1, 2c-2, ..., c-1, c of n = T / 2c tokens; contiguous: arange(T)."""
    check_context(T, c, layout=layout)
    if layout == CONTIGUOUS:
        return np.arange(T)
    n = T // (2 * c)
    cut = np.arange(T).reshape(2 * c, n)
    return np.concatenate([np.concatenate([cut[i], cut[2 * c - 1 - i]]) for i in range(c)])


def to_layout(x, c: int, axis: int = 1, layout: str = ZIGZAG):
    """x with its ``axis`` (the T tokens) in natural order -> in the layout's order (a static gather)."""
    return jnp.take(x, layout_order(x.shape[axis], c, layout), axis=axis)


def from_layout(x, c: int, axis: int = 1, layout: str = ZIGZAG):
    """Undoes ``to_layout``: the layout's order -> natural order."""
    return jnp.take(x, np.argsort(layout_order(x.shape[axis], c, layout)), axis=axis)


def to_zigzag(x, c: int, axis: int = 1):
    """(B, T, ...) (or T at ``axis``) in natural order -> zig-zag order: device i's pieces i, 2c-1-i."""
    return to_layout(x, c, axis, ZIGZAG)


def from_zigzag(x, c: int, axis: int = 1):
    """Undoes ``to_zigzag``."""
    return from_layout(x, c, axis, ZIGZAG)


def chunk_positions(index, T: int, c: int, layout: str = ZIGZAG):
    """(T/c,) int: the global positions of the tokens device ``index`` (an int, or traced:
    axis_index) holds, in the order it holds them (``layout_order``'s slots of that device)."""
    p = pieces(c, layout)
    n = T // p
    first = index * n + jnp.arange(n)
    if layout == CONTIGUOUS:
        return first
    return jnp.concatenate([first, (p - 1 - index) * n + jnp.arange(n)])


def pair_kind(i, j):
    """The kind of device i's visit to device j's chunk (ints or traced): SELF, EARLIER (j < i), LATER."""
    return jnp.where(j == i, SELF, jnp.where(j < i, EARLIER, LATER))


def visited(kind: int, n_local: int, causal: bool, layout: str = ZIGZAG):
    """(query rows, key columns), static slices of a device's T/c tokens, that a visit of
    ``kind`` computes; None where it computes nothing (a later chunk, contiguous and causal).
    Every pair left out is masked (tests/test_ring_attention.py checks it pair by pair)."""
    every, half = slice(None), n_local // 2
    if not causal or kind == SELF:
        return every, every
    if layout == CONTIGUOUS:
        return (every, every) if kind == EARLIER else None
    return (every, slice(0, half)) if kind == EARLIER else (slice(half, None), every)


def part(x, where, axis: int):
    """x's slice ``where`` along ``axis`` (None stays None: no segment ids)."""
    if x is None:
        return None
    index = [slice(None)] * x.ndim
    index[axis] = where
    return x[tuple(index)]


# ----------------------------------------------------------------------------
# one visit: a block of the online softmax


def pair_mask(q_pos, k_pos, spec: AttentionSpec, q_seg=None, k_seg=None):
    """Whether each query may read each key: q_pos (Tq,), k_pos (Tk,) global positions,
    q_seg (B, Tq), k_seg (B, Tk) document ids or None -> a bool (Tq, Tk) or (B, 1, Tq, Tk)
    array, or None when every pair may (spec.allowed, then cores.segment_mask)."""
    mask = spec.allowed(q_pos[:, None], k_pos[None, :])
    if q_seg is None:
        return mask
    seg = segment_mask(q_seg, k_seg)
    return seg if mask is None else mask & seg


def pair_scores(q, k, q_pos, k_pos, spec: AttentionSpec, q_seg=None, k_seg=None):
    """q (B, H, Tq, Dh), k (B, H, Tk, Dh) -> S = q k^T / sqrt(Dh) (B, H, Tq, Tk) in stats_dtype,
    capped to softcap tanh(S / softcap) where spec.softcap is set (cores.capped_scores), then
    -inf where ``pair_mask`` masks the pair (spec.window included: the window reads the global
    positions, as the causal rule does)."""
    s = capped_scores(q, k, spec)
    mask = pair_mask(q_pos, k_pos, spec, q_seg, k_seg)
    return s if mask is None else jnp.where(mask, s, -jnp.inf)


def key_block_size(n: int, block: int) -> int:
    """The keys a visit of n columns folds at a time: all n (``block`` 0: the full core's one
    block of scores), or K = min(block, n) (the blockwise core's), which must divide n."""
    K = min(block, n) if block else n
    if n % K:
        raise ValueError(f"ring attention: attention_block {block} does not divide a visit's {n} keys")
    return K


def cut_keys(a, axis: int, K: int):
    """a with n keys along ``axis`` -> (n / K, ..., K, ...): the key blocks stacked first (None stays None)."""
    if a is None:
        return None
    n = a.shape[axis]
    return jnp.moveaxis(a.reshape(a.shape[:axis] + (n // K, K) + a.shape[axis + 1:]), axis, 0)


def join_keys(a, axis: int):
    """Undoes ``cut_keys``: (n / K, ..., K, ...) -> n keys along ``axis``."""
    a = jnp.moveaxis(a, 0, axis)
    return a.reshape(a.shape[:axis] + (a.shape[axis] * a.shape[axis + 1],) + a.shape[axis + 2:])


KEY_AXES = (2, 2, 0, 1)  # the key axis of a visit's (k, v (B, Hkv, n, Dh), positions (n,), ids (B, n))


def visit_keys(chunk, k_pos, col):
    """The columns ``col`` of a held chunk (k, v (B, Hkv, T/c, Dh), ids (B, T/c) or None) and of
    its positions k_pos (T/c,): a visit's keys, as ``over_key_blocks`` takes them."""
    k, v, k_seg = chunk
    return part(k, col, 2), part(v, col, 2), k_pos[col], part(k_seg, col, 1)


def over_key_blocks(fn, carry, keys, block: int):
    """fn(carry, keys) -> (carry, out) over a visit's keys = (k, v, positions, ids or None) whole
    (``block`` 0), or K = key_block_size(n, block) keys at a time in a ``lax.scan`` (the blockwise
    core's memory: scores (B, H, rows, K), never (rows, n)); ``out``: None, or per-key arrays
    (B, Hkv, K, Dh) put back in order along their key axis."""
    K = key_block_size(keys[2].shape[0], block)
    if K == keys[2].shape[0]:
        return fn(carry, keys)
    carry, out = jax.lax.scan(fn, carry, tuple(cut_keys(a, axis, K) for a, axis in zip(keys, KEY_AXES, strict=True)))
    return carry, jax.tree_util.tree_map(lambda o: join_keys(o, 2), out)


def visit_dropout(rate, key, T: int, block: int = 0):
    """The probabilities' dropout in the ring's visits: None without it (``dropout.active``), else
    drop(q_pos, k_pos) -> (rate, a PieceKey) whose mask is the piece of one device's mask at those
    global query and key positions, and at the rows and heads key's own piece names (a
    PieceKey's: the device's; a key's: all of them). One device's mask: the full core's (B, H, T,
    T), drawn from ``key``; with ``block`` K > 0 the blockwise core's, one (B, H, K', K') mask per
    block pair (K' = blockwise.block_size(T, K): dropout.Piece's ``block``)."""
    if not active(rate, key):
        return None
    base = key if isinstance(key, PieceKey) else PieceKey(key, Piece())
    pairs = block_size(T, block) if block else 0

    def drop(q_pos, k_pos):
        return rate, PieceKey(base.key, base.piece._replace(queries=(T, q_pos), keys=(T, k_pos), block=pairs))
    return drop


def visit(stats, q, q_pos, q_seg, chunk, k_pos, spec: AttentionSpec, where, block: int = 0, drop=None):
    """Fold the block ``where`` (visited's (rows, columns), or None: nothing) of the held
    chunk (k, v (B, Hkv, T/c, Dh), its segment ids or None) into stats = (m, l, acc); its keys
    whole (``block`` 0) or ``block`` at a time (``over_key_blocks``). ``drop``: visit_dropout's
    (the probabilities' dropout on the product alone, as online_softmax_step puts it), or None."""
    if where is None:
        return stats
    r, col = where
    G = q.shape[1] // chunk[0].shape[1]
    q_r, qp_r, qs_r = part(q, r, 2), q_pos[r], part(q_seg, r, 1)

    def fold(rows, keys):
        k_b, v_b, kp_b, ks_b = keys
        s = pair_scores(q_r, repeat_kv(k_b, G), qp_r, kp_b, spec, qs_r, ks_b)  # (B, H, rows, keys)
        return online_softmax_step(rows, s, repeat_kv(v_b, G), spec.compute_dtype,
                                   None if drop is None else drop(qp_r, kp_b)), None

    rows = tuple(part(a, r, 2) for a in stats)
    block_stats, _ = over_key_blocks(fold, rows, visit_keys(chunk, k_pos, col), block)  # its rows' (m, l, acc)
    if r == slice(None):
        return block_stats
    return tuple(a.at[:, :, r].set(b) for a, b in zip(stats, block_stats, strict=True))


def ring_permutation(c: int):
    """The ring's hop: device i sends to i + 1 (mod c)."""
    return [(i, (i + 1) % c) for i in range(c)]


def send(tree, axis_name: str = CONTEXT):
    """Every array of ``tree`` to the next device of the ring (one ppermute each)."""
    perm = ring_permutation(jax.lax.axis_size(axis_name))
    return jax.tree_util.tree_map(lambda a: jax.lax.ppermute(a, axis_name, perm), tree)


def holder(i, s, c: int):
    """Whose chunk device i holds at step s: (i - s) mod c."""
    return (i - s) % c


def switch_visit(kind, visit_kind, causal: bool, operand):
    """visit_kind(EARLIER or LATER, operand) chosen by the (traced) kind; without the causal mask
    both are the whole block, and one is traced."""
    if not causal:
        return visit_kind(EARLIER, operand)
    return jax.lax.switch(kind - EARLIER, [functools.partial(visit_kind, EARLIER),
                                           functools.partial(visit_kind, LATER)], operand)


def walk(visit_chunk, stats, held, causal: bool, axis_name: str = CONTEXT):
    """The ring's walk on device i: stats = visit_chunk(stats, held, j, kind) for its own chunk
    (j = i, kind SELF: step 0, no hop before it), then for steps s = 1 .. c - 1 the chunk of device
    j = (i - s) mod c, received from the left neighbour (``send``) and visited by its kind
    (EARLIER or LATER, ``switch_visit``). ``held``: the travelling arrays (k, v, the ids or None)."""
    c, i = jax.lax.axis_size(axis_name), jax.lax.axis_index(axis_name)
    stats = visit_chunk(stats, held, i, SELF)

    def step(carry, s):
        held, stats = carry
        held = send(held, axis_name)  # device i - 1's chunk of the step before: device j's
        j = holder(i, s, c)
        visit_kind = lambda kind, stats: visit_chunk(stats, held, j, kind)  # noqa: E731
        return (held, switch_visit(pair_kind(i, j), visit_kind, causal, stats)), None

    (_, stats), _ = jax.lax.scan(step, (held, stats), jnp.arange(1, c))
    return stats


def walk_back(visit_chunk_bwd, grads, held, causal: bool, axis_name: str = CONTEXT):
    """The walk's reverse pass (a backward's ring): grads = (dq, dK, dV) of device i's tokens,
    grads = visit_chunk_bwd(grads, held, j, kind) for each chunk j as ``walk`` visits it, dq
    staying home while dK, dV travel WITH their chunk: at step s device i receives (k_j, v_j,
    the ids, dK_j, dV_j) from device i - 1 and adds its queries' share. After step c - 1 device
    i holds chunk i + 1's gradients; one final hop brings every chunk's home: c - 1 hops of
    k, v (and the ids), c of dK, dV."""
    c, i = jax.lax.axis_size(axis_name), jax.lax.axis_index(axis_name)
    grads = visit_chunk_bwd(grads, held, i, SELF)  # step 0, the own chunk

    def step(carry, s):
        held, (dq, dk, dv) = carry
        # held = send(held): the chunk arrives with its gradients so far (device i - 1's share added)
        held, (dk, dv) = send((held, (dk, dv)), axis_name)
        j = holder(i, s, c)
        visit_kind = lambda kind, grads: visit_chunk_bwd(grads, held, j, kind)  # noqa: E731
        return (held, switch_visit(pair_kind(i, j), visit_kind, causal, (dq, dk, dv))), None

    (_, (dq, dk, dv)), _ = jax.lax.scan(step, (held, grads), jnp.arange(1, c))
    dk, dv = send((dk, dv), axis_name)  # the final hop: device i held chunk i + 1's gradients
    return dq, dk, dv


def ring_spec(causal: bool = True, compute_dtype=None, softcap: float = 0.0, window: int = 0,
              dropout: float = 0.0) -> AttentionSpec:
    """What the ring's visits read: the mask rule (causal, a sliding ``window`` of W keys), the
    products' dtype, the scores' ``softcap`` and the probabilities' ``dropout`` rate
    (AttentionSpec's fields of the same names)."""
    return AttentionSpec(causal=causal, compute_dtype=compute_dtype, softcap=softcap, window=window, dropout=dropout)


def ring_attention_fwd_stats(q, k, v, *, causal: bool = True, segments=None, axis_name: str = CONTEXT,
                             layout: str = ZIGZAG, compute_dtype=None, softcap: float = 0.0, window: int = 0,
                             block: int = 0, dropout: float = 0.0, key=None):
    """Inside shard_map over ``axis_name``: this device's q (B, H, T/c, Dh), k, v (B, Hkv, T/c,
    Dh) and segment ids (B, T/c) or None, in ``layout`` -> (O (B, H, T/c, Dh), lse (B, H, T/c)
    in stats_dtype), the attention of its queries over the whole sequence; the products' inputs
    in ``compute_dtype`` (ModelConfig.compute_dtype; None: q's own), as every core's. ``softcap``
    caps the scores, ``window`` W lets a query read its W latest keys alone (``ring_spec``);
    ``block`` K > 0 folds each visit's keys K at a time (the blockwise core), 0 all at once.
    ``dropout`` with a ``key`` (a PieceKey: the device's rows and heads) drops the probabilities
    as the full core (the blockwise core with ``block``) does on one device, each visit drawing
    its piece of those masks (``visit_dropout``; lse stays the undropped scores')."""
    spec = ring_spec(causal, compute_dtype, softcap, window, dropout)
    c, i = jax.lax.axis_size(axis_name), jax.lax.axis_index(axis_name)
    n_local = q.shape[2]
    T = n_local * c
    check_context(T, c, axis_name, layout)
    drop = visit_dropout(dropout, key, T, block)
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"ring attention: {k.shape[1]} key/value heads do not divide {q.shape[1]} query heads")
    positions = functools.partial(chunk_positions, T=T, c=c, layout=layout)
    q_pos, f = positions(i), stats_dtype(q.dtype)
    row = q[..., 0]  # (B, H, T/c): the *_like arrays stay device i's own (varying over the axis), as q is
    init = (jnp.full_like(row, -jnp.inf, dtype=f), jnp.zeros_like(row, dtype=f), jnp.zeros_like(q, dtype=f))

    def visit_chunk(stats, held, j, kind):
        return visit(stats, q, q_pos, segments, held, positions(j), spec, visited(kind, n_local, causal, layout), block,
                     drop)

    m, l, acc = walk(visit_chunk, init, (k, v, segments), causal, axis_name)
    safe = jnp.where(l > 0, l, 1.0)  # l = 0 only on a wholly masked row (none arises): O = 0 there
    return (acc / safe[..., None]).astype(q.dtype), m + jnp.log(l)


def ring_attention(q, k, v, *, causal: bool = True, segments=None, axis_name: str = CONTEXT,
                   layout: str = ZIGZAG, compute_dtype=None, softcap: float = 0.0, window: int = 0, block: int = 0,
                   dropout: float = 0.0, key=None):
    """Inside shard_map over ``axis_name``: ring_attention_fwd_stats' output alone,
    softmax(q k^T / sqrt(Dh)) v for this device's queries (B, H, T/c, Dh)."""
    return ring_attention_fwd_stats(q, k, v, causal=causal, segments=segments, axis_name=axis_name,
                                    layout=layout, compute_dtype=compute_dtype, softcap=softcap, window=window,
                                    block=block, dropout=dropout, key=key)[0]


# ----------------------------------------------------------------------------
# on a mesh, from natural order


def on_mesh(local, mesh, arrays, segments, axis_name: str = CONTEXT, layout: str = ZIGZAG, n_out: int = 1):
    """local(*arrays, segments) under shard_map over ``axis_name`` of ``mesh``: arrays (B, H, T, ...)
    and segments (B, T) or None in natural order, put into ``layout`` and split along T; the
    n_out outputs (B, H, T, ...) restored to natural order. Every other mesh axis replicated."""
    c = dict(mesh.shape)[axis_name]
    check_context(arrays[0].shape[2], c, axis_name, layout)
    tokens = PartitionSpec(None, None, axis_name)
    args = [to_layout(a, c, 2, layout) for a in arrays]
    specs = [tokens] * len(args)
    if segments is not None:
        args.append(to_layout(segments, c, 1, layout))
        specs.append(PartitionSpec(None, axis_name))
    body = local if segments is not None else (lambda *a: local(*a, None))
    out_specs = tokens if n_out == 1 else (tokens,) * n_out
    out = jax.shard_map(body, mesh=mesh, in_specs=tuple(specs), out_specs=out_specs)(*args)
    if n_out == 1:
        return from_layout(out, c, 2, layout)
    return tuple(from_layout(o, c, 2, layout) for o in out)


def ring_attention_on_mesh(q, k, v, mesh, causal: bool = True, segments=None, axis_name: str = CONTEXT,
                           layout: str = ZIGZAG, compute_dtype=None, softcap: float = 0.0, window: int = 0,
                           block: int = 0, dropout: float = 0.0, key=None):
    """q (B, H, T, Dh), k, v (B, Hkv, T, Dh), segments (B, T) or None, natural token order ->
    O (B, H, T, Dh) in natural order: ring_attention over the mesh's ``axis_name`` (``dropout``
    with ``key``: one device's full core's mask, each visit its piece)."""
    def local(q, k, v, segments):
        return ring_attention(q, k, v, causal=causal, segments=segments, axis_name=axis_name, layout=layout,
                              compute_dtype=compute_dtype, softcap=softcap, window=window, block=block,
                              dropout=dropout, key=key)
    return on_mesh(local, mesh, (q, k, v), segments, axis_name, layout)
