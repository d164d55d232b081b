"""The inference room: sampling from a trained model over the key/value cache
(temperature, top-k, top-p, greedy), and text from a run folder.

May import: ``jaxformer.checkpoints``, ``jaxformer.observe``, ``jaxformer.data``
and ``jaxformer.model``.
"""
