"""Data: embedded corpus, BPE tokenizer, TFDS array_record dataset and the grain input pipeline.

Flow (see docs/DATA.md)::

    corpus.load_corpus ─► tokenizer.train_tokenizer ─► tfds_builder (array_record on disk)
        ─► pipeline.make_train_iterator / make_eval_batches ─► numpy batches [B, T]

``prepare_default_data(data_dir)`` runs the first three steps once and reuses them afterwards.

Names are imported lazily (PEP 562) so that ``from specjax.data import math_problems`` or the
corpus does not pull in tensorflow_datasets / grain.
"""
from __future__ import annotations

import importlib

_EXPORTS = {
    # corpus
    "DOMAINS": "corpus", "SPLITS": "corpus", "Document": "corpus", "load_corpus": "corpus",
    "load_documents": "corpus", "corpus_fingerprint": "corpus",
    # math problems (the generator itself is `specjax.data.math_problems.math_problems`: the
    # package attribute `math_problems` is the submodule, so it cannot also be the function)
    "MathProblem": "math_problems", "extract_answer": "math_problems",
    "check_answer": "math_problems",
    # tokenizer
    "Tokenizer": "tokenizer", "train_tokenizer": "tokenizer", "load_tokenizer": "tokenizer",
    "EOS_TOKEN": "tokenizer", "PAD_TOKEN": "tokenizer",
    # TFDS
    "DATASET_NAME": "tfds_builder", "DataError": "tfds_builder", "SpecjaxCorpus": "tfds_builder",
    "build_corpus_dataset": "tfds_builder", "corpus_dataset_name": "tfds_builder",
    "open_data_source": "tfds_builder", "PreparedData": "tfds_builder",
    "prepare_default_data": "tfds_builder",
    # input pipeline
    "DataIterator": "pipeline", "make_train_iterator": "pipeline",
    "make_eval_batches": "pipeline", "BATCH_KEYS": "pipeline",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'specjax.data' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"specjax.data.{module}"), name)
    globals()[name] = value  # Cache: later lookups skip __getattr__.
    return value


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS))
