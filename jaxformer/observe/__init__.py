"""The observation room: metrics.jsonl and its plots, TensorBoard event files, the
terminal's progress report, FLOPs / MFU, and the record and table of a
layer-by-layer diagnosis (``diagnosis``).

May import: ``jaxformer.data`` and ``jaxformer.model``.
"""
