"""The checkpoints room: orbax save, verify and restore of a train state, with
digests checked on every restore, damaged steps set aside, and run folders.

May import: ``jaxformer.data`` and ``jaxformer.model``.
"""
