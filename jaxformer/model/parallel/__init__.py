"""The model split over devices: each collective a named region (regions.py), the
tensor-parallel block composed of them (tensor.py), the vocab-parallel head and loss (vocab.py),
ring attention over a context axis (ring.py) and the context-parallel blocks around it
(context.py). The hand-derived backward of each is manual_grads/parallel/."""
