"""The formats room: other programs' model files, read and written. Hugging Face folders:
``hf`` (read_hf / write_hf, read_chat: the one place that chooses the family by
config.json's ``model_type``), one mapping per family (``hf_gpt2``, ``hf_llama``,
``hf_olmo_gemma``, ``hf_moe``), each a table that ``hf_table`` reads both ways,
``hf_windows`` (the families' sliding-window layouts), ``hf_files`` (config.json,
safetensors / shards / pytorch_model.bin, hub ids, HFFormatError) and ``hf_chat_files``
(the tokenizer and chat files an export carries). GGUF files: ``gguf_file`` (the
tensors and metadata, quantized blocks kept or dequantized) and ``gguf_tokenizer``.
``peft`` (LoRA adapters as a PEFT folder, both ways) and ``run_source`` (the model or
chat data a run came from: its chat template, its base's name).

The orbax train-state checkpoints are ``jaxformer.checkpoints``'s, a room of the same
rank: neither imports the other.

May import: ``jaxformer.data`` and ``jaxformer.model``.
"""
