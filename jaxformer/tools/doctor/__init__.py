"""`jaxformer doctor`: the kernels, gradients, training and speed on the device JAX sees.
``checks`` runs each check, ``run`` gathers them, ``report`` tells."""
