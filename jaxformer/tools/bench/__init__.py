"""`jaxformer bench`: step time, MFU and memory of the manual step against jax.grad and
PyTorch. ``run`` measures (interleaved rounds), ``contestants`` builds each step,
``select`` picks the attention kernel and shapes, ``sweep`` runs a grid, the ``report``
modules tell."""
