"""The observation room: metrics.jsonl and its plots, TensorBoard event files, the
terminal's progress report, and FLOPs / MFU.

May import: ``jaxformer.data`` and ``jaxformer.model``.
"""
