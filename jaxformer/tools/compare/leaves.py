"""Naming and ordering the leaves of a gradient pytree, for the comparison and its reports:
dotted paths, the group a leaf is summarized in, the model's own order, and a sort key
of relative errors that ranks NaN worst."""

from __future__ import annotations

import math
import re

# Parameter names in the order the model uses them (DESIGN.md's tree): embeddings, blocks
# (ln1, attn, ln2, ffn), final norm, head. jax flattens dicts in sorted-key order instead.
MODEL_ORDER = ("tok_embed", "pos_embed", "blocks", "ln1", "attn", "ln2", "ffn", "ln_f", "head",
               "wq", "bq", "wk", "bk", "wv", "bv", "wo", "bo", "w_in", "b_in", "w_out", "b_out",
               "scale", "bias", "w", "b")


def dotted(keystr: str) -> str:
    """"['blocks']['attn']['wq']" -> "blocks.attn.wq"."""
    parts = re.findall(r"\['([^']*)'\]|\[(\d+)\]|\.(\w+)", keystr)
    return ".".join(next(p for p in groups if p) for groups in parts) or keystr


def block_of(path: str) -> str:
    """The group a leaf is summarized in: "blocks.attn.wq" -> "blocks.attn", "head.w" -> "head"."""
    parts = path.split(".")
    return ".".join(parts[:2]) if parts[0] == "blocks" and len(parts) > 2 else parts[0]


def model_order_key(path: str) -> tuple:
    """Sort key putting dotted leaf paths in model order; unknown names go last, by name."""
    rank = {name: i for i, name in enumerate(MODEL_ORDER)}
    return tuple((rank.get(part, len(rank)), part) for part in path.split("."))


def error_rank(rel) -> float:
    """Sort key of a relative error: NaN ranks above everything."""
    rel = float(rel)
    return math.inf if math.isnan(rel) else rel
