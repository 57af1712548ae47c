"""Byte-level BPE tokenizer: deterministic training, lossless round trip, special tokens, loading."""
import numpy as np
import pytest
import tokenizers
from tokenizers import models, pre_tokenizers

from specjax.data import corpus
from specjax.data.tokenizer import (EOS_TOKEN, PAD_TOKEN, Tokenizer, load_tokenizer,
                                    train_tokenizer)

SAMPLES = [
    "",
    "Question: Mia has 23 marbles. She gets 14 more.\nAnswer: 23 + 14 = 37\n#### 37",
    "def f(x):\n    return x ** 2  # comment\n\n\tclass A:  pass\r\n",
    "ünïcödé, 日本語, emoji 🙂, combining e\u0301, NUL \x00 and bell \x07",
    "   leading and trailing spaces   ",
    "<|pad|> looks special but is text",
]


@pytest.fixture(scope="module")
def tok():
    return train_tokenizer(vocab_size=512, max_docs=150)


def test_round_trip(tok):
    for text in SAMPLES + corpus.load_corpus("code", "heldout", max_docs=20) \
            + corpus.load_corpus("prose", "heldout", max_docs=20):
        assert tok.decode(tok.encode(text)) == text
    ids = tok.encode(SAMPLES[1], add_eos=True)
    assert ids[-1] == tok.eos_id
    assert tok.decode(np.asarray(ids)) == SAMPLES[1] + EOS_TOKEN
    assert tok.decode(ids, skip_special_tokens=True) == SAMPLES[1]
    assert tok.encode_batch(SAMPLES, add_eos=True) == [tok.encode(s, add_eos=True) for s in SAMPLES]


def test_special_tokens_and_vocab(tok):
    assert tok.vocab_size == 512
    assert (tok.eos_id, tok.pad_id) == (0, 1)
    assert tok.eos_token == EOS_TOKEN and tok.pad_token == PAD_TOKEN
    ids = tok.encode(corpus.load_corpus("math", max_docs=50)[0])
    assert all(0 <= i < tok.vocab_size for i in ids)
    assert tok.decode([tok.eos_id]) == EOS_TOKEN


def test_digits_are_single_tokens(tok):
    pieces = [tok.hf.id_to_token(i) for i in tok.encode("12345 + 678 = 13023")]
    assert all(not (any(c.isdigit() for c in p) and len(p) > 1) for p in pieces), pieces


def test_training_is_deterministic_and_save_load_round_trips(tmp_path, tok):
    path = tmp_path / "a" / "tokenizer.json"
    again = train_tokenizer(vocab_size=512, max_docs=150, save_path=path)
    assert again.hf.to_str() == tok.hf.to_str()
    first = path.read_bytes()
    again.save(path)
    assert path.read_bytes() == first  # Saving is byte-deterministic.
    loaded = load_tokenizer(path)
    assert (loaded.eos_id, loaded.pad_id, loaded.vocab_size) == (0, 1, 512)
    assert load_tokenizer(tmp_path / "a").vocab_size == 512  # A directory works too.
    for text in SAMPLES:
        assert loaded.encode(text) == tok.encode(text)


def test_train_on_given_texts_and_bad_vocab():
    small = train_tokenizer(["aaaa bbbb aaaa"] * 50, vocab_size=300)
    assert small.decode(small.encode("aaaa bbbb")) == "aaaa bbbb"
    with pytest.raises(ValueError, match="vocab_size"):
        train_tokenizer(["x"], vocab_size=100)
    with pytest.raises(TypeError):
        train_tokenizer([b"bytes"], vocab_size=300)


def test_load_foreign_tokenizer_json(tmp_path):
    # A non-specjax tokenizer.json (WordLevel, "</s>" as EOS, no pad token): EOS pads.
    vocab = {"[UNK]": 0, "</s>": 1, "hello": 2, "world": 3}
    hf = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    hf.pre_tokenizer = pre_tokenizers.Whitespace()
    hf.add_special_tokens(["</s>"])
    hf.save(str(tmp_path / "tokenizer.json"))
    tok = load_tokenizer(tmp_path / "tokenizer.json")
    assert (tok.eos_id, tok.pad_id, tok.eos_token) == (1, 1, "</s>")
    assert tok.encode("hello world", add_eos=True) == [2, 3, 1]

    # No recognisable EOS: a clear error, unless named explicitly.
    hf2 = tokenizers.Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    hf2.save(str(tmp_path / "noeos.json"))
    with pytest.raises(ValueError, match="end-of-sequence"):
        load_tokenizer(tmp_path / "noeos.json")
    assert load_tokenizer(tmp_path / "noeos.json", eos_token="a").eos_id == 1


def test_load_errors_name_the_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope"):
        load_tokenizer(tmp_path / "nope.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="bad.json"):
        load_tokenizer(bad)


def test_wrapper_rejects_non_str(tok):
    assert isinstance(tok, Tokenizer)
    with pytest.raises(TypeError):
        tok.encode(b"bytes")
