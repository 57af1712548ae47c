"""Corpus size table (bytes, documents and default-BPE tokens per domain and split).

    python -m specjax.data.stats

Its own module because it needs both the corpus and the tokenizer, and the tokenizer's default
training texts come from the corpus (corpus -> tokenizer only, never back).
"""
from __future__ import annotations

import sys

from specjax.data.corpus import DOMAINS, SPLITS, corpus_fingerprint, load_corpus
from specjax.data.tokenizer import train_tokenizer


def stats_table() -> str:
    """The table, one row per (domain, split), as printed by ``python -m specjax.data.stats``."""
    tok = train_tokenizer()
    rows = ["domain   split    bytes       docs    tokens"]
    for domain in DOMAINS:
        for split in SPLITS:
            texts = load_corpus(domain, split)
            n_bytes = sum(len(t.encode()) for t in texts)
            n_tok = sum(len(ids) for ids in tok.encode_batch(texts))
            rows.append(f"{domain:<8} {split:<8} {n_bytes:<11,} {len(texts):<7,} {n_tok:,}")
    return "\n".join(rows)


if __name__ == "__main__":
    print(f"Python {sys.version.split()[0]}, fingerprint {corpus_fingerprint()}")
    print(stats_table())
