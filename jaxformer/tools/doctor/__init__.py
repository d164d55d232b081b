"""`jaxformer doctor`: the kernels, gradients, training and speed on the device JAX sees.
``checks`` and ``kernel_checks`` run each check, ``run`` gathers them, ``report`` tells."""
