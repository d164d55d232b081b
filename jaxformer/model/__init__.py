"""The model room: the transformer as pure functions over a parameter pytree.

``config`` (ModelConfig and the presets), ``params`` (init and shape checks),
``precision`` (the compute-dtype policy), one module per layer kind (``linear``,
``activations``, ``layer_norm``, ``embedding``, ``attention``, ``blockwise``,
``pallas_attention``, ``block``, ``losses``, ``chunked_loss``), ``transformer`` (features,
forward, loss_fn), ``kv_cache`` (the same model over a key/value cache, for decoding) and
``validate`` (checks of ids, batches and params that name what is wrong).
Each module here has a mirror in ``manual_grads/`` holding its hand-derived backward,
but for ``pallas_backward``: the Pallas flash-attention kernels' backward, here because
the model's forward wraps it as a jax.custom_vjp (a pallas_call has no transpose), and
``pallas_tune``: the kernels' GPU launch, chosen by timing and cached.

May import: jax, numpy and itself only. Everything else in jaxformer imports it.
"""
