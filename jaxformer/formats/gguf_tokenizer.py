"""A GGUF file's tokenizer, rebuilt from its metadata as a ``tokenizers`` tokenizer (the
project's HFTokenizer), with the chat template and the special ids the file records.

    gguf_tokenizer(meta, where) -> HFTokenizer
    gguf_chat(meta) -> {"chat_template", "bos_token", "eos_token", "stop_ids"}

Only ``tokenizer.ggml.model`` "gpt2" (byte-level BPE: GPT-2, SmolLM, Llama 3, Qwen, ...) is
read: ``tokenizer.ggml.tokens`` (the vocabulary, ids in order), ``tokenizer.ggml.merges``
("a b" per merge, in rank order), ``tokenizer.ggml.token_type`` (3: control tokens, kept whole
as special tokens, so "<|im_start|>" in a chat template is one id). The pre-tokenizer is
byte-level with GPT-2's split; ``tokenizer.ggml.pre`` "smollm" first splits every digit
apart, as SmolLM's own tokenizer.json does.
"""

from __future__ import annotations

from jaxformer.data.hf_tokenizers import HFTokenizer
from jaxformer.formats.hf_files import HFFormatError

CONTROL = 3  # llama.cpp's token type of a control token
DIGITS_APART = ("smollm",)  # tokenizer.ggml.pre values whose digits are split one by one
END_OF_TURN = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>", "<|endoftext|>")


def _field(meta: dict, key: str, where):
    if key not in meta:
        raise HFFormatError(f"{where}: metadata {key} is missing (no tokenizer in the file)")
    return meta[key]


def gguf_tokenizer(meta: dict, where) -> HFTokenizer:
    """The byte-level BPE the metadata ``meta`` of the GGUF file ``where`` describes."""
    import tokenizers
    from tokenizers import AddedToken, decoders, models, pre_tokenizers

    kind = _field(meta, "tokenizer.ggml.model", where)
    if kind != "gpt2":
        raise HFFormatError(f"{where}: tokenizer.ggml.model {kind!r} is not supported (only 'gpt2', "
                            f"byte-level BPE)")
    tokens = list(_field(meta, "tokenizer.ggml.tokens", where))
    merges = [tuple(m.split(" ", 1)) for m in _field(meta, "tokenizer.ggml.merges", where)]
    vocab = {token: i for i, token in enumerate(tokens)}
    try:
        tok = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=merges))
    except Exception as e:  # noqa: BLE001 - the library's own error type
        raise HFFormatError(f"{where}: tokenizer.ggml.merges do not fit tokenizer.ggml.tokens "
                            f"({str(e).splitlines()[0]})") from None
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if meta.get("tokenizer.ggml.pre") in DIGITS_APART:
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    else:
        tok.pre_tokenizer = byte_level
    tok.decoder = decoders.ByteLevel()
    types = list(meta.get("tokenizer.ggml.token_type") or ())
    special = [AddedToken(t, special=True, normalized=False)
               for t, kind in zip(tokens, types) if kind == CONTROL]
    tok.add_special_tokens(special)
    return HFTokenizer(tok, f"{getattr(where, 'name', where)}:tokenizer")


def gguf_chat(meta: dict, tokenizer: HFTokenizer) -> dict:
    """The chat settings the metadata records: its template (None when it has none), the bos
    and eos token texts the template may name, and the ids generation stops at (the eos id
    and the end-of-turn tokens of the vocabulary)."""
    tokens = meta.get("tokenizer.ggml.tokens") or ()

    def text(key):
        i = meta.get(key)
        return tokens[int(i)] if i is not None and 0 <= int(i) < len(tokens) else ""

    stops = {int(meta["tokenizer.ggml.eos_token_id"])} if "tokenizer.ggml.eos_token_id" in meta else set()
    stops |= {i for i in map(tokenizer.tokenizer.token_to_id, END_OF_TURN) if i is not None}
    return {"chat_template": meta.get("tokenizer.chat_template"),
            "bos_token": text("tokenizer.ggml.bos_token_id"),
            "eos_token": text("tokenizer.ggml.eos_token_id"), "stop_ids": sorted(stops)}
