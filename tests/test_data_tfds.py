"""TFDS array_record dataset: deterministic build, content, clear errors, prepare_default_data."""
import hashlib
import json
import os
import shutil
import tempfile

import pytest
import tensorflow_datasets as tfds

from specjax.data import corpus
from specjax.data.tfds_builder import (DataError, build_corpus_dataset, open_data_source,
                                       prepare_default_data)

MAX_DOCS = 25


def _array_record_hashes(data_dir):
    out = {}
    for root, _, files in os.walk(data_dir):
        for name in files:
            if ".array_record" in name:
                path = os.path.join(root, name)
                with open(path, "rb") as f:
                    out[os.path.relpath(path, data_dir)] = hashlib.sha256(f.read()).hexdigest()
    return out


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    data_dir = str(tmp_path_factory.mktemp("tfds_a"))
    names = build_corpus_dataset(data_dir, max_docs=MAX_DOCS)
    return data_dir, names


def test_build_is_deterministic(built, tmp_path, monkeypatch):
    data_dir, names = built
    other = str(tmp_path / "tfds_b")
    # the build leaves nothing in the temporary directory (TFDS used to leave one empty
    # tmp*tfds directory per builder of a not-yet-prepared dataset)
    scratch = tmp_path / "tempdir"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    assert build_corpus_dataset(other, max_docs=MAX_DOCS) == names
    assert sorted(os.listdir(scratch)) == []
    a, b = _array_record_hashes(data_dir), _array_record_hashes(other)
    assert len(a) == 2 * len(corpus.DOMAINS)  # train + heldout per domain
    assert a == b


def test_content_matches_corpus_and_splits_are_disjoint(built):
    data_dir, names = built
    assert names == {d: f"specjax_corpus/{d}_first{MAX_DOCS}" for d in corpus.DOMAINS}
    for domain, name in names.items():
        texts = {}
        for split in corpus.SPLITS:
            src = open_data_source(name, data_dir, split)
            records = [src[i] for i in range(len(src))]
            docs = corpus.load_documents(domain, split, max_docs=MAX_DOCS)
            assert len(records) == len(docs) == MAX_DOCS
            assert sorted((r["key"].decode(), r["text"].decode()) for r in records) == sorted(docs)
            texts[split] = {r["text"] for r in records}
        assert not texts["train"] & texts["heldout"]


def test_builder_as_data_source_and_tfds_data_source(built):
    data_dir, names = built
    builder = tfds.builder(names["math"], data_dir=data_dir)
    sources = builder.as_data_source()
    assert set(sources) == {"train", "heldout"}
    assert len(tfds.data_source(names["math"], split="train", data_dir=data_dir)) == MAX_DOCS


def test_missing_data_dir_gives_clear_error(tmp_path):
    missing = str(tmp_path / "does_not_exist")
    with pytest.raises(DataError, match="does_not_exist"):
        open_data_source("specjax_corpus/math", missing, "train")
    empty = str(tmp_path / "empty")
    os.makedirs(empty)
    with pytest.raises(DataError, match="empty") as info:
        open_data_source("specjax_corpus/math", empty, "train")
    assert len(str(info.value)) < 1000  # A sentence, not a traceback dump.
    assert not os.listdir(empty)  # Opening never builds or downloads anything.


@pytest.mark.parametrize("damage", ["garbage", "truncate", "info"])
def test_corrupted_data_gives_clear_error(built, tmp_path, damage):
    data_dir, names = built
    copy = str(tmp_path / "copy")
    shutil.copytree(data_dir, copy)
    version_dir = os.path.join(copy, "specjax_corpus", f"math_first{MAX_DOCS}", "1.0.0")
    record_file = next(os.path.join(version_dir, f) for f in sorted(os.listdir(version_dir))
                       if f.startswith("specjax_corpus-train.array_record"))
    if damage == "garbage":
        data = bytearray(open(record_file, "rb").read())
        for i in range(64, len(data), 7):
            data[i] ^= 0x5A
        open(record_file, "wb").write(bytes(data))
    elif damage == "truncate":
        data = open(record_file, "rb").read()
        open(record_file, "wb").write(data[:300])
    else:
        open(os.path.join(version_dir, "dataset_info.json"), "w").write("{broken")
    with pytest.raises(DataError, match=str(tmp_path)) as info:
        open_data_source(names["math"], copy, "train")
    assert len(str(info.value)) < 1500


def test_missing_text_key(built):
    data_dir, names = built
    with pytest.raises(DataError, match="content"):
        open_data_source(names["code"], data_dir, "train", text_key="content")


def test_prepare_default_data_builds_once_and_reuses(tmp_path):
    data_dir = str(tmp_path / "data")
    first = prepare_default_data(data_dir, vocab_size=300, max_docs=10, verbose=False)
    assert first.built
    assert os.path.isfile(first.tokenizer_path)
    tok = first.load_tokenizer()
    assert tok.vocab_size == 300
    stamp = os.path.getmtime(first.tokenizer_path)
    second = prepare_default_data(data_dir, vocab_size=300, max_docs=10, verbose=False)
    assert not second.built and second.dataset_names == first.dataset_names
    assert os.path.getmtime(first.tokenizer_path) == stamp
    for name in first.dataset_names.values():
        assert len(open_data_source(name, data_dir, "heldout")) == 10
    # A different vocabulary size invalidates the cache; so does a damaged manifest.
    assert prepare_default_data(data_dir, vocab_size=320, max_docs=10, verbose=False).built
    with open(os.path.join(data_dir, "specjax_data.json"), "w") as f:
        f.write("garbage")
    assert prepare_default_data(data_dir, vocab_size=320, max_docs=10, verbose=False).built
    with open(os.path.join(data_dir, "specjax_data.json")) as f:
        assert json.load(f)["vocab_size"] == 320


def test_prepare_default_data_rebuilds_when_the_data_code_changes(tmp_path, monkeypatch):
    import specjax.data.tfds_builder as builder
    data_dir = str(tmp_path / "data")
    assert prepare_default_data(data_dir, vocab_size=300, max_docs=10, verbose=False).built
    assert not prepare_default_data(data_dir, vocab_size=300, max_docs=10, verbose=False).built
    # Same corpus and settings, but the code that builds the data changed.
    monkeypatch.setattr(builder, "source_hash", lambda sources: "edited-code")
    assert prepare_default_data(data_dir, vocab_size=300, max_docs=10, verbose=False).built
    with open(os.path.join(data_dir, "specjax_data.json")) as f:
        assert json.load(f)["code_version"] == "edited-code"
