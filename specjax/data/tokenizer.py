"""Byte-level BPE tokenizer: training on the default corpus, and a thin wrapper over any HF tokenizer.

The default tokenizer is a byte-level BPE (GPT-2 style: any byte sequence round-trips, no unknown
token) trained with the Rust ``tokenizers`` library on the *train* splits of all three corpus
domains. Digits are pre-split into single characters (as in LLaMA), so numbers never merge into
multi-digit tokens: a tiny model then sees arithmetic one digit at a time, the same way for every
number, which matters for the math domain.

Special tokens come first in the vocabulary: ``<|endoftext|>`` (id 0) is the end-of-sequence token
and the document separator (the input pipeline also uses it as the beginning-of-document token);
``<|pad|>`` (id 1) fills padded positions (always masked out of the loss).

Training is deterministic (same corpus + settings -> byte-identical ``tokenizer.json``) and takes
3-15 s for the default corpus on 2 CPU cores (the Rust trainer; more when the cores are busy).

:func:`load_tokenizer` wraps any Hugging Face ``tokenizer.json`` the same way, so a pretrained
model's tokenizer plugs into the same pipeline.
"""
from __future__ import annotations

import os
from typing import Iterable, Iterator, Sequence

import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

from specjax.data.corpus import DOMAINS, load_corpus

__all__ = [
    "EOS_TOKEN",
    "PAD_TOKEN",
    "SPECIAL_TOKENS",
    "Tokenizer",
    "train_tokenizer",
    "load_tokenizer",
]

EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
SPECIAL_TOKENS = (EOS_TOKEN, PAD_TOKEN)
DEFAULT_VOCAB_SIZE = 2048

# Candidate end-of-sequence / padding spellings used by common HF tokenizers, most specific first.
_EOS_CANDIDATES = (EOS_TOKEN, "<|end_of_text|>", "</s>", "<eos>", "<|im_end|>", "[SEP]")
_PAD_CANDIDATES = (PAD_TOKEN, "<pad>", "[PAD]", "<|finetune_right_pad_id|>")


class Tokenizer:
    """Thin wrapper over a ``tokenizers.Tokenizer`` with explicit EOS and pad ids.

    ``encode`` never adds special tokens implicitly (a post-processor's BOS/EOS template in a
    foreign ``tokenizer.json`` is bypassed); the data pipeline adds separators itself.
    """

    def __init__(self, hf: tokenizers.Tokenizer, eos_token: str | None = None,
                 pad_token: str | None = None):
        self._hf = hf
        self.eos_token = eos_token or _find_token(hf, _EOS_CANDIDATES, "end-of-sequence")
        self.eos_id = _token_id(hf, self.eos_token)
        if pad_token is None:
            # Without a pad token, pad with EOS: padded positions are masked out of every loss.
            pad_token = next((t for t in _PAD_CANDIDATES if hf.token_to_id(t) is not None),
                             self.eos_token)
        self.pad_token = pad_token
        self.pad_id = _token_id(hf, pad_token)

    @property
    def hf(self) -> tokenizers.Tokenizer:
        """The underlying ``tokenizers.Tokenizer``."""
        return self._hf

    @property
    def vocab_size(self) -> int:
        """Number of ids, special tokens included (every id is < vocab_size)."""
        return self._hf.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, *, add_eos: bool = False) -> list[int]:
        """Token ids of ``text`` (optionally followed by EOS)."""
        if not isinstance(text, str):
            raise TypeError(f"encode expects str, got {type(text).__name__}")
        ids = self._hf.encode(text, add_special_tokens=False).ids
        return ids + [self.eos_id] if add_eos else ids

    def encode_batch(self, texts: Sequence[str], *, add_eos: bool = False) -> list[list[int]]:
        """``[encode(t) for t in texts]``, parallelised in Rust."""
        encs = self._hf.encode_batch(list(texts), add_special_tokens=False)
        return [e.ids + [self.eos_id] if add_eos else e.ids for e in encs]

    def decode(self, ids: Iterable[int], *, skip_special_tokens: bool = False) -> str:
        """Text of ``ids`` (a list or a 1-D integer array)."""
        return self._hf.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def save(self, path: str | os.PathLike) -> None:
        """Write ``tokenizer.json`` (deterministic bytes; parent directories are created)."""
        path = os.fspath(path)
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        tmp = f"{path}.tmp.{os.getpid()}"
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(self._hf.to_str(pretty=True))
        os.replace(tmp, path)  # Atomic: a crash never leaves a half-written tokenizer.json.

    def __repr__(self) -> str:
        return (f"Tokenizer(vocab_size={self.vocab_size}, eos={self.eos_token!r}:{self.eos_id}, "
                f"pad={self.pad_token!r}:{self.pad_id})")


def train_tokenizer(texts: Iterable[str] | None = None, *, vocab_size: int = DEFAULT_VOCAB_SIZE,
                    min_frequency: int = 2, save_path: str | os.PathLike | None = None,
                    max_docs: int | None = None) -> Tokenizer:
    """Train the byte-level BPE.

    Args:
      texts: training texts; default: the train splits of every corpus domain.
      vocab_size: total vocabulary including the 256 byte tokens and the special tokens
        (>= 258 + 1).
      min_frequency: a pair must occur this often to be merged.
      save_path: if given, write ``tokenizer.json`` there.
      max_docs: with ``texts=None``, use only the first ``max_docs`` documents per domain (tests).
    """
    n_base = len(pre_tokenizers.ByteLevel.alphabet()) + len(SPECIAL_TOKENS)
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size <= n_base:
        raise ValueError(f"vocab_size must be an int > {n_base} (bytes + special tokens), "
                         f"got {vocab_size!r}")
    if texts is None:
        texts = _default_training_texts(max_docs)
    hf = tokenizers.Tokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=list(SPECIAL_TOKENS),  # ids 0 and 1, in this order
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # all 256 bytes: no unknowns
        show_progress=False,
    )
    hf.train_from_iterator(_as_str_iter(texts), trainer=trainer)
    tok = Tokenizer(hf, eos_token=EOS_TOKEN, pad_token=PAD_TOKEN)
    if save_path is not None:
        tok.save(save_path)
    return tok


def load_tokenizer(path: str | os.PathLike, *, eos_token: str | None = None,
                   pad_token: str | None = None) -> Tokenizer:
    """Load any Hugging Face ``tokenizer.json`` (a file, or a directory containing one).

    EOS / pad tokens are found among common spellings unless given; with no pad token, EOS pads.
    """
    path = os.fspath(path)
    if os.path.isdir(path):
        path = os.path.join(path, "tokenizer.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"tokenizer file not found: {path}")
    try:
        hf = tokenizers.Tokenizer.from_file(path)
    except Exception as e:  # The Rust error says what is wrong, but not which file.
        raise ValueError(f"could not load tokenizer from {path}: {e}") from e
    return Tokenizer(hf, eos_token=eos_token, pad_token=pad_token)


def _default_training_texts(max_docs: int | None) -> Iterator[str]:
    for domain in DOMAINS:
        yield from load_corpus(domain, "train", max_docs=max_docs)


def _as_str_iter(texts: Iterable[str]) -> Iterator[str]:
    for t in texts:
        if not isinstance(t, str):
            raise TypeError(f"training texts must be str, got {type(t).__name__}")
        yield t


def _find_token(hf: tokenizers.Tokenizer, candidates: Sequence[str], what: str) -> str:
    for t in candidates:
        if hf.token_to_id(t) is not None:
            return t
    added = [t.content for t in hf.get_added_tokens_decoder().values()][:20]
    raise ValueError(f"no {what} token found among {list(candidates)}; pass it explicitly "
                     f"(added tokens: {added})")


def _token_id(hf: tokenizers.Tokenizer, token: str) -> int:
    tid = hf.token_to_id(token)
    if tid is None:
        raise ValueError(f"token {token!r} is not in the tokenizer's vocabulary")
    return tid


def tokenizer_config(tok: Tokenizer) -> dict:
    """JSON-able summary (for logs and manifests)."""
    return {"vocab_size": tok.vocab_size, "eos": tok.eos_token, "eos_id": tok.eos_id,
            "pad": tok.pad_token, "pad_id": tok.pad_id}
