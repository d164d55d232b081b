"""The tools room: what a developer runs to check and measure the model.
``compare`` (manual vs automatic gradients, leaf by leaf, and finite differences)
and its report, ``bench`` (step time, MFU and memory against jax.grad and PyTorch)
and its report, ``memory`` (what each backward keeps), and ``torch_ref`` (an
independent PyTorch model; imports torch, so only the benchmark and tests load it).

May import: ``jaxformer.training``, ``jaxformer.inference`` and every room below them,
and ``manual_grads``.
"""
