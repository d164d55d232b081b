"""The softcap's backward (jaxformer/model/softcap.py).

    y = cap * tanh(x / cap)
    dx = dy * (1 - tanh^2(x / cap)) = dy * (1 - (y / cap)^2)

The backward reads t = y / cap = tanh(x / cap), from the capped output the forward made
(kept, or recomputed as the forward computes it): no cap is needed to undo it.
"""

from __future__ import annotations

from jaxformer.model.softcap import softcap


def softcap_fwd(x, cap):
    """x -> (y = cap * tanh(x / cap), t = y / cap = tanh(x / cap), what softcap_bwd reads)."""
    y = softcap(x, cap)
    return y, y / cap


def softcap_bwd(t, dy):
    """Undoes ``y = cap * tanh(x / cap)`` from t = tanh(x / cap): dx = dy * (1 - t^2), in dy's
    dtype where t is no wider."""
    return dy * (1 - t * t)
