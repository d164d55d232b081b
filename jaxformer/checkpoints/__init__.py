"""The checkpoints room: orbax save, verify and restore of a train state, with
digests checked on every restore, damaged steps set aside, and run folders.

``checkpoint`` (save, restore, the steps of a run, the newest that verifies: the
room's main API), ``digests`` (file and array sha256), ``errors``, ``quiet`` (orbax's
log noise) and ``runs`` (a run folder read back with its config and tokenizer).
Hugging Face model folders in and out: ``hf`` (read_hf / write_hf, the one place that
chooses GPT-2 or Llama), ``hf_gpt2`` and ``hf_llama`` (the mappings), ``hf_files``
(config.json, the weight files, hub ids, HFFormatError).

May import: ``jaxformer.data`` and ``jaxformer.model``.
"""
