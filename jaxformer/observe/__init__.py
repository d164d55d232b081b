"""The observation room: metrics.jsonl and its plots, TensorBoard event files, the
terminal's progress report, FLOPs / MFU, and ``run_log``: all of them kept by a
training call as it goes.

May import: ``jaxformer.data`` and ``jaxformer.model``.
"""
