"""The data room: host-side text and tokens, numpy only (no jax).

``tokenizers`` (bytes, characters; ``hf_tokenizers``: tokenizer.json files, a trained
byte-level BPE, GPT-2's), ``corpora`` (files, folders, the bundled and stdlib texts,
read whole for small runs), ``sources`` (the same and JSONL, Parquet and Hugging Face
datasets, streamed), ``prepare`` (a corpus tokenized once into token shards),
``shards`` (a prepared folder's meta.json and its shards, memory-mapped),
``prefetch`` (batches made ahead on a thread), ``baseline``
(the unigram loss a model must beat) and ``batching`` (the train/validation split and the ``Batcher`` whose
batches are a pure function of (seed, step), so a resumed run sees the batches an
uninterrupted one would). Shape letters as elsewhere: N tokens in a corpus, B batch,
T sequence length.

May import: numpy and ``jaxformer.model`` (to validate token ids).
"""

from jaxformer.data.baseline import unigram_loss
from jaxformer.data.batching import Batcher, sequential_batches, split_train_val
from jaxformer.data.hf_tokenizers import HFTokenizer
from jaxformer.data.prefetch import Prefetcher
from jaxformer.data.shards import ShardedTokens, check_sizes, open_split, read_meta, verify
from jaxformer.data.shards import fingerprint_of as shards_fingerprint
from jaxformer.data.corpora import (CORPUS_NAMES, DEFAULT_STDLIB_MAX_BYTES, describe_corpus,
                                    load_corpus, stdlib_files)
from jaxformer.data.tokenizers import (TOKENIZER_KINDS, ByteTokenizer, CharTokenizer, Tokenizer, check_encodable,
                                       load_tokenizer_file, make_tokenizer, tokenizer_from_dict)
from jaxformer.model.validate import validate_ids

__all__ = ["CORPUS_NAMES", "DEFAULT_STDLIB_MAX_BYTES", "TOKENIZER_KINDS", "Batcher", "ByteTokenizer",
           "CharTokenizer", "HFTokenizer", "Prefetcher", "check_encodable", "ShardedTokens", "check_sizes", "open_split",
           "read_meta", "shards_fingerprint", "verify", "load_tokenizer_file", "Tokenizer", "describe_corpus", "load_corpus", "make_tokenizer",
           "sequential_batches", "split_train_val", "stdlib_files", "tokenizer_from_dict",
           "unigram_loss", "validate_ids"]
