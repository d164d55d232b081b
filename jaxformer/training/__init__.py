"""The training room: settings, optimizers and schedules (optax), the jitted train
and eval steps for either gradient source, sharding over a data x fsdp mesh and
multi-process setup, the loop with its resume rules, and the layer-by-layer
diagnosis of a non-finite step.

May import: ``manual_grads``, ``jaxformer.checkpoints``, ``jaxformer.observe``,
``jaxformer.data`` and ``jaxformer.model``.
"""
