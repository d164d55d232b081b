"""Manual vs automatic gradients, leaf by leaf (`jaxformer compare-grads`): ``grads``
computes both, ``fd`` checks against finite differences, ``leaves`` names and orders the
leaves, ``report`` and ``plot`` tell; ``hf_random`` builds the random Hugging Face models
that the comparisons with transformers load."""
