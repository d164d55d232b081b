"""The data room: host-side text and tokens, numpy only (no jax).

Tokenizers (bytes, characters), corpora (files, folders, the bundled and stdlib
texts), the train/validation split and the ``Batcher`` whose batches are a pure
function of (seed, step), so a resumed run sees the batches an uninterrupted one would.

May import: numpy and ``jaxformer.model`` (to validate token ids).
"""

from jaxformer.data.core import (CORPUS_NAMES, DEFAULT_STDLIB_MAX_BYTES, TOKENIZER_KINDS, Batcher,
                                 ByteTokenizer, CharTokenizer, Tokenizer, describe_corpus,
                                 load_corpus, make_tokenizer, sequential_batches, split_train_val,
                                 stdlib_files, tokenizer_from_dict)
from jaxformer.model.validate import validate_ids

__all__ = ["CORPUS_NAMES", "DEFAULT_STDLIB_MAX_BYTES", "TOKENIZER_KINDS", "Batcher", "ByteTokenizer",
           "CharTokenizer", "Tokenizer", "describe_corpus", "load_corpus", "make_tokenizer",
           "sequential_batches", "split_train_val", "stdlib_files", "tokenizer_from_dict",
           "validate_ids"]
