"""The checkpoints room: orbax save, verify and restore of a train state, with
digests checked on every restore, damaged steps set aside, and run folders.

``checkpoint`` (save, restore, the steps of a run, the newest that verifies: the
room's main API), ``digests`` (file and array sha256), ``errors``, ``quiet`` (orbax's
log noise) and ``runs`` (a run folder read back with its config and tokenizer).
Other programs' files (Hugging Face, GGUF, PEFT) are ``jaxformer.formats``'s, a room of
the same rank: neither imports the other.

May import: ``jaxformer.data`` and ``jaxformer.model``.
"""
