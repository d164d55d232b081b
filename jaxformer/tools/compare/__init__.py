"""Manual vs automatic gradients, leaf by leaf (`jaxformer compare-grads`): ``grads``
computes both, ``fd`` checks against finite differences, ``leaves`` names and orders the
leaves, ``report`` and ``plot`` tell."""
