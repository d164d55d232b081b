"""The softcap: x -> c tanh(x / c), smooth and bounded by c (Gemma 2's attention scores and final logits).

ModelConfig.attn_softcap caps the attention scores before the mask and the softmax (the
cores' ``capped_scores``; blockwise.py's ``capped_block_scores``); ModelConfig.logit_softcap caps
the head's logits before the cross entropy (transformer.py, chunked_loss.py). A cap of 0 is
off, and nothing is traced for it: every caller writes ``if cap:``.
"""

from __future__ import annotations

import jax.numpy as jnp


def softcap(x, cap):
    """cap * tanh(x / cap): about x where |x| << cap, never beyond +-cap. cap > 0 (a float
    or a 0-d array)."""
    return cap * jnp.tanh(x / cap)
