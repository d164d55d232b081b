"""The observation room: metrics.jsonl and its plots, TensorBoard event files, the
terminal's progress report, FLOPs / MFU, ``run_log`` (all of them kept by a training
call as it goes), and the record and table of a layer-by-layer diagnosis (``diagnosis``).

May import: ``jaxformer.data`` and ``jaxformer.model``.
"""
