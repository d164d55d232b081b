"""The inference room: sampling from a trained model over the key/value cache
(temperature, top-k, top-p, greedy: ``generate``), text from a run folder
(``text``), and streamed text and chat from an imported model (``stream``).

May import: ``jaxformer.checkpoints``, ``jaxformer.formats``, ``jaxformer.observe``,
``jaxformer.data``, ``jaxformer.model``, and ``jaxformer.training.step`` for the shape of
the train state a run's checkpoint holds (the optimizer state's layout is training's);
training never imports this room.
"""
