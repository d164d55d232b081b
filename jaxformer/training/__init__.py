"""The training room: settings, optimizers and schedules (optax), the jitted train
and eval steps for either gradient source, sharding over a data x fsdp mesh and
multi-process setup, the loop with its data and resume rules, and the
layer-by-layer diagnosis of a non-finite step.

``loop`` (train) builds on ``run_data`` (corpus, tokenizer, batches), ``resume``
(what a resumed run may change, the checks, the checkpoint meta), ``step`` (the
state, gradient sources, the jitted steps), ``settings``, ``optim``, ``sharding``,
``distributed``, ``configfile`` and ``diagnose``.

May import: ``manual_grads``, ``jaxformer.checkpoints``, ``jaxformer.formats``,
``jaxformer.observe``, ``jaxformer.data`` and ``jaxformer.model``.
"""
