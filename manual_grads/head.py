"""The head and the loss by hand: the pair of the model's last lines (jaxformer/model/transformer.py)

    logits = x @ head.w + head.b      (B, T, V); tie_embeddings: head.w = tok_embed^T
    logits = c tanh(logits / c)       with logit_softcap c only
    loss = cross_entropy(logits)      ()   (loss_chunk > 0: both, chunk by chunk, chunked_loss.py)

``head_loss_fwd`` / ``head_loss_bwd``: manual_grads/model.py composes them on one device (and on a
data or fsdp mesh); manual_grads/parallel/context.py on each device's tokens of a context axis.
"""

from __future__ import annotations

from typing import NamedTuple

import jax

from jaxformer.model.config import ModelConfig
from manual_grads.chunked_loss import ChunkedLossRes, chunked_head_loss_bwd, chunked_head_loss_fwd
from manual_grads.linear import LinearRes, linear_bwd, linear_fwd
from manual_grads.losses import CrossEntropyRes, cross_entropy_bwd, cross_entropy_fwd
from manual_grads.softcap import softcap_bwd, softcap_fwd
from manual_grads.tap import tap_backward, tap_forward


class HeadLossRes(NamedTuple):
    head: LinearRes  # x (B, T, D), w (D, V)
    loss: CrossEntropyRes  # probs (B, T, V), targets, weights (B, T)
    cap: jax.Array | None = None  # (B, T, V) tanh(logits / logit_softcap); None: no softcap


def head_loss_fwd(head, x, targets, mask, config: ModelConfig, tap=None):
    """x (B, T, D) -> (loss (), res): the head and the cross entropy, or with loss_chunk > 0
    both chunk by chunk (res a ChunkedLossRes; no (B, T, V) logits)."""
    cd = config.compute_dtype
    if config.loss_chunk:
        loss, res = chunked_head_loss_fwd(head, x, targets, mask, config.loss_chunk, cd, config.logit_softcap)
        tap_forward(tap, "head + loss", x, loss, head)
        return loss, res
    logits, head_res = linear_fwd(head, x, cd)  # (B, T, V)
    cap_res = None
    if config.logit_softcap:
        logits, cap_res = softcap_fwd(logits, config.logit_softcap)  # (B, T, V)
    tap_forward(tap, "head", x, logits, head)
    loss, loss_res = cross_entropy_fwd(logits, targets, mask)  # ()
    tap_forward(tap, "loss", logits, loss)
    return loss, HeadLossRes(head_res, loss_res, cap_res)


def head_loss_bwd(res, dloss, tap=None):
    """dloss () -> (dhead {"w", "b"?}, dx (B, T, D))."""
    if isinstance(res, ChunkedLossRes):
        d_head, dx = chunked_head_loss_bwd(res, dloss)  # loss = chunked_head_loss(head, x)
        tap_backward(tap, "head + loss", dloss, d_head, dx)
        return d_head, dx
    dlogits, _, _ = cross_entropy_bwd(res.loss, dloss)  # loss = cross_entropy(logits)
    tap_backward(tap, "loss", dloss, None, dlogits)
    d_capped = dlogits
    if res.cap is not None:  # logits = softcap(logits, config.logit_softcap)
        dlogits = softcap_bwd(res.cap, dlogits)
    d_head, dx = linear_bwd(res.head, dlogits, round_dx=False)  # logits = x @ head.w + head.b; dx, the
    # blocks' first cotangent, keeps one bfloat16 rounding (dlogits', before the product), not two
    tap_backward(tap, "head", d_capped, d_head, dx)
    return d_head, dx
