"""A frozen weight kept quantized (``Quantized``), dequantized inside each product.

A LoRA run's base need not be float: its projections may stay in a GGUF file's own blocks
or in int8, and every product that reads one dequantizes it on the way in (``dense``, called by
``linear`` and by the manual backward's dx). Each kind, for a weight w (..., I, O) in our
``x @ w`` layout (I inputs, O outputs; GGUF blocks run along the inputs):

    int8:  w[i, o] = codes[i, o] * scales[0, o]                   absmax / 127 per output column
    q8_0:  w[i, o] = codes[i, o] * scales[i // 32, o]             int8 codes, a float16 scale per 32
    q4_0:  w[i, o] = (c[i, o] - 8) * scales[i // 32, o]           4-bit codes c, two to a byte
    q4_1:  w[i, o] = c[i, o] * scales[i // 32, o] + mins[i // 32, o]

The 4-bit kinds keep GGUF's packing: codes (..., I / 2, O) uint8, where byte j < 16 of block b
holds input 32 b + j in its low nibble and input 32 b + 16 + j in its high nibble. A Quantized
is a pytree (codes, scales[, mins] its leaves; kind and the float dtype it dequantizes to,
static), so it scans over the stacked layer axis, crosses jit as an argument and shards like
any params leaf; ``shape`` is the float weight's. Float weights never meet this module:
``dense`` and ``columns`` return them as they are, so a float model's program does not change.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

BLOCK = 32  # GGUF's Q8_0 / Q4_0 / Q4_1 block: 32 inputs share a scale (and a min)
KINDS = ("int8", "q8_0", "q4_0", "q4_1")
PACKED = ("q4_0", "q4_1")  # two 4-bit codes to a byte
# the block projections a base may hold quantized: (layer group, weight) of params["blocks"]
PROJECTIONS = (("attn", ("wq", "wk", "wv", "wo")),
               ("ffn", ("w_in", "w_out", "w_gate", "w_up", "w_down")))


@jax.tree_util.register_pytree_with_keys_class
@dataclasses.dataclass(frozen=True, eq=False)
class Quantized:
    """A weight (..., I, O) held as codes and scales (the table above)."""

    codes: jax.Array  # (..., I, O) int8; (..., I / 2, O) uint8 for q4_0, q4_1
    scales: jax.Array  # (..., I / 32, O) float16 (GGUF); (..., 1, O) in ``dtype`` (int8)
    mins: jax.Array | None = None  # (..., I / 32, O) float16, q4_1 only
    kind: str = "int8"  # one of KINDS
    dtype_name: str = "float32"  # the dtype of the dequantized weight (the run's)

    def tree_flatten_with_keys(self):
        names = ("codes", "scales") + (("mins",) if self.mins is not None else ())
        return ([(jax.tree_util.GetAttrKey(n), getattr(self, n)) for n in names],
                (self.kind, self.dtype_name, self.mins is not None))

    @classmethod
    def tree_unflatten(cls, aux, children):
        kind, dtype_name, has_mins = aux
        codes, scales, *rest = children
        return cls(codes, scales, rest[0] if has_mins else None, kind, dtype_name)

    @property
    def dtype(self):
        return jnp.dtype(self.dtype_name)

    @property
    def shape(self) -> tuple:
        *lead, rows, out = self.codes.shape
        return (*lead, rows * (2 if self.kind in PACKED else 1), out)

    @property
    def ndim(self) -> int:
        return len(self.codes.shape)

    @property
    def nbytes(self) -> int:
        return sum(int(np.prod(a.shape)) * jnp.dtype(a.dtype).itemsize for a in jax.tree_util.tree_leaves(self))

    def astype(self, dtype) -> "Quantized":
        """The same codes, dequantizing to ``dtype``."""
        return dataclasses.replace(self, dtype_name=jnp.dtype(dtype).name)

    def __repr__(self):
        return f"Quantized({self.kind}, shape={self.shape}, dtype={self.dtype_name})"


def is_quantized(x) -> bool:
    return isinstance(x, Quantized)


def dequantize(q: Quantized):
    """The float weight (..., I, O) in q.dtype (works on numpy and jax arrays, under jit or not)."""
    xp = jnp if isinstance(q.codes, jax.Array) or isinstance(q.scales, jax.Array) else np
    dt = q.dtype
    *lead, rows, out = q.codes.shape
    if q.kind == "int8":
        return q.codes.astype(dt) * q.scales.astype(dt)  # (..., I, O) * (..., 1, O)
    nb = q.scales.shape[-2]  # blocks of BLOCK inputs
    if q.kind == "q8_0":
        c = q.codes.reshape(*lead, nb, BLOCK, out).astype(dt)  # (..., nb, 32, O)
    else:
        c = q.codes.reshape(*lead, nb, BLOCK // 2, out)  # (..., nb, 16, O) bytes
        c = xp.concatenate([c & 0x0F, c >> 4], axis=-2).astype(dt)  # inputs j, then 16 + j
        if q.kind == "q4_0":
            c = c - 8
    w = c * q.scales[..., :, None, :].astype(dt)
    if q.kind == "q4_1":
        w = w + q.mins[..., :, None, :].astype(dt)
    return w.reshape(*lead, nb * BLOCK, out)


def dense(w):
    """The float weight a product reads: ``w`` itself, or a Quantized one dequantized."""
    return dequantize(w) if isinstance(w, Quantized) else w


def columns(ws):
    """[w_1 | w_2 | ...] side by side along the outputs (qkv_weights, gate_up_weights): a
    plain concatenation of float weights; Quantized ones of one kind stay quantized (their
    codes and scales side by side); a mix is dequantized first."""
    if not any(isinstance(w, Quantized) for w in ws):
        return jnp.concatenate(ws, axis=1)
    first = ws[0]
    if all(isinstance(w, Quantized) and w.kind == first.kind and w.dtype == first.dtype for w in ws):
        mins = None if first.mins is None else jnp.concatenate([w.mins for w in ws], axis=-1)
        return Quantized(jnp.concatenate([w.codes for w in ws], axis=-1),
                         jnp.concatenate([w.scales for w in ws], axis=-1), mins, first.kind, first.dtype_name)
    return jnp.concatenate([dense(w) for w in ws], axis=-1)


def quantize_int8(w, dtype=None) -> Quantized:
    """A float weight (..., I, O) as int8: per output column, scale = max |w| / 127 and
    codes = round(w / scale) in [-127, 127] (a zero column: scale 0, codes 0). On the host."""
    w = np.asarray(w)
    dtype = np.dtype(dtype or w.dtype)
    scales = (np.abs(w).max(axis=-2, keepdims=True) / 127).astype(dtype)  # (..., 1, O)
    codes = np.rint(w / np.where(scales == 0, 1, scales)).clip(-127, 127).astype(np.int8)
    return Quantized(codes, scales, None, "int8", dtype.name)


def quantize_base(params, dtype=None) -> dict:
    """``params`` with each block projection (PROJECTIONS; stacked (L, I, O)) held as int8
    (``quantize_int8``); every other leaf, and an MoE layer's experts, as they are."""
    blocks = dict(params["blocks"])
    for group, names in PROJECTIONS:
        if group not in blocks:
            continue
        g = dict(blocks[group])
        for n in names:
            if n in g and not isinstance(g[n], Quantized) and np.ndim(g[n]) == 3:
                g[n] = quantize_int8(jax.device_get(g[n]), dtype)
        blocks[group] = g
    return {**params, "blocks": blocks}


def dequantize_params(params):
    """``params`` with every Quantized leaf made float (a merged or exported model)."""
    return jax.tree_util.tree_map(dense, params, is_leaf=is_quantized)


def as_dtype(params, dtype):
    """``params`` on the device in ``dtype``: float leaves cast, Quantized ones keeping their
    codes and scales, dequantizing to ``dtype``."""
    def one(a):
        if isinstance(a, Quantized):
            return jax.tree_util.tree_map(jnp.asarray, a.astype(dtype))
        return jnp.asarray(a, dtype)
    return jax.tree_util.tree_map(one, params, is_leaf=is_quantized)


def held_as(params) -> str:
    """What a base's block projections are held as: "float", or the kinds ("q8_0", "int8", ...)."""
    kinds = sorted({q.kind for q in jax.tree_util.tree_leaves(params, is_leaf=is_quantized)
                    if isinstance(q, Quantized)})
    return ", ".join(kinds) or "float"
