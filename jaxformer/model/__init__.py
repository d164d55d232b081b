"""The model room: the transformer as pure functions over a parameter pytree.

``config`` (ModelConfig and the presets), ``params`` (init and shape checks),
``precision`` (the compute-dtype policy), one module per layer kind (``linear``,
``activations``, ``layer_norm``, ``embedding``, ``attention``, ``blockwise``,
``block``, ``losses``, ``chunked_loss``), ``transformer`` (features,
forward, loss_fn), ``kv_cache`` (the same model over a key/value cache, for decoding) and
``validate`` (checks of ids, batches and params that name what is wrong).
Each module here has a mirror in ``manual_grads/`` holding its hand-derived backward.
The Pallas flash-attention kernels (forward, backward, tiling, tuning) live in the room
below, ``jaxformer.kernels``.

May import: jax, numpy, ``jaxformer.kernels`` and itself only. Everything else in
jaxformer imports it.
"""
