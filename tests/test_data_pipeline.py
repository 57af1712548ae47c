"""grain input pipeline: packing invariants, coverage, host sharding, checkpointable state, eval."""
import collections
import json
import os

import numpy as np
import pytest
import tensorflow_datasets as tfds

from specjax.data import corpus
from specjax.data.pipeline import BATCH_KEYS, make_eval_batches, make_train_iterator
from specjax.data.tfds_builder import DataError, build_corpus_dataset, open_data_source
from specjax.data.tokenizer import train_tokenizer

MAX_DOCS = 30
DOMAINS = tuple(f"{d}_first{MAX_DOCS}" for d in corpus.DOMAINS)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    data_dir = str(tmp_path_factory.mktemp("pipeline_data"))
    build_corpus_dataset(data_dir, max_docs=MAX_DOCS)
    tok = train_tokenizer(vocab_size=512, max_docs=150)
    return data_dir, tok


def _expected_pieces(tok, domain, split, seq_len):
    """Multiset of (inputs, targets) pieces the pipeline must produce for one pass."""
    pieces = collections.Counter()
    for text in corpus.load_corpus(domain, split, max_docs=MAX_DOCS):
        ids = [tok.eos_id, *tok.encode(text), tok.eos_id]
        inputs, targets = ids[:-1], ids[1:]
        for i in range(0, len(inputs), seq_len):
            pieces[(tuple(inputs[i:i + seq_len]), tuple(targets[i:i + seq_len]))] += 1
    return pieces


def _segments(batch, pad_id):
    """Check the packing invariants of every row; return its pieces as (inputs, targets)."""
    out = []
    for b in range(batch["inputs"].shape[0]):
        seg, pos = batch["segment_ids"][b], batch["positions"][b]
        inp, tgt, mask = batch["inputs"][b], batch["targets"][b], batch["loss_mask"][b]
        np.testing.assert_array_equal(mask, (seg > 0).astype(np.float32))
        n_seg = int(seg.max())
        used = int((seg > 0).sum())
        assert (seg[:used] > 0).all() and (seg[used:] == 0).all(), "padding only at the end"
        assert (inp[used:] == pad_id).all() and (tgt[used:] == pad_id).all()
        assert (pos[used:] == 0).all()
        assert list(np.unique(seg[:used])) == list(range(1, n_seg + 1))
        assert (np.diff(seg[:used]) >= 0).all(), "segments are contiguous"
        for s in range(1, n_seg + 1):
            idx = np.flatnonzero(seg == s)
            np.testing.assert_array_equal(pos[idx], np.arange(len(idx)))
            np.testing.assert_array_equal(tgt[idx][:-1], inp[idx][1:])  # next-token pairs
            out.append((tuple(inp[idx].tolist()), tuple(tgt[idx].tolist())))
    return out


def _drain(it, pad_id):
    """All pieces of a finite iterator (num_epochs=1), as a multiset."""
    pieces = collections.Counter()
    for batch in it:
        pieces.update(_segments(batch, pad_id))
    return pieces


def test_batches_have_the_documented_layout(data):
    data_dir, tok = data
    it = make_train_iterator(tokenizer=tok, seq_len=64, global_batch_size=4, data_dir=data_dir,
                             domains=DOMAINS, seed=3, process_index=0, process_count=1)
    expected = set()
    for domain in corpus.DOMAINS:
        expected |= set(_expected_pieces(tok, domain, "train", 64))
    fill = []
    for _ in range(12):
        batch = next(it)
        assert set(batch) == set(BATCH_KEYS)
        for k in BATCH_KEYS:
            assert batch[k].shape == (4, 64)
            assert batch[k].dtype == (np.float32 if k == "loss_mask" else np.int32)
        for piece in _segments(batch, tok.pad_id):
            assert piece in expected
        fill.append(batch["loss_mask"].mean())
    assert np.mean(fill) > 0.8  # Packing leaves little padding.


@pytest.mark.parametrize("domain,seq_len", [("math", 32), ("code", 64)])
def test_one_epoch_covers_every_piece_exactly_once(data, domain, seq_len):
    data_dir, tok = data
    it = make_train_iterator(tokenizer=tok, seq_len=seq_len, global_batch_size=1,
                             data_dir=data_dir, domains=(f"{domain}_first{MAX_DOCS}",),
                             num_epochs=1, seed=0, process_index=0, process_count=1)
    pieces = _drain(it, tok.pad_id)
    expected = _expected_pieces(tok, domain, "train", seq_len)
    assert any(len(p[0]) == seq_len for p in expected)  # Long documents really were cut.
    assert pieces == expected


@pytest.mark.parametrize("process_count", [2, 3])
def test_host_shards_are_disjoint_and_cover_the_data(data, process_count):
    data_dir, tok = data
    kwargs = dict(tokenizer=tok, seq_len=48, data_dir=data_dir, domains=(f"prose_first{MAX_DOCS}",),
                  num_epochs=1, seed=5)
    shards = []
    for index in range(process_count):
        it = make_train_iterator(global_batch_size=process_count, process_index=index,
                                 process_count=process_count, **kwargs)
        shards.append(_drain(it, tok.pad_id))
    for i in range(process_count):
        for j in range(i + 1, process_count):
            assert not set(shards[i]) & set(shards[j])
    assert sum(shards, collections.Counter()) == _expected_pieces(tok, "prose", "train", 48)


def _take(it, n):
    return [next(it) for _ in range(n)]


def _assert_same(batches_a, batches_b):
    assert len(batches_a) == len(batches_b)
    for a, b in zip(batches_a, batches_b):
        for k in BATCH_KEYS:
            np.testing.assert_array_equal(a[k], b[k])


@pytest.mark.parametrize("skip", [0, 5, 40])
def test_state_round_trips_through_json(data, skip):
    data_dir, tok = data
    kwargs = dict(tokenizer=tok, seq_len=48, global_batch_size=4, data_dir=data_dir,
                  domains=DOMAINS, mixture_weights=(0.5, 0.25, 0.25), seed=11,
                  process_index=0, process_count=1)
    it = make_train_iterator(**kwargs)
    _take(it, skip)  # 40 batches run several epochs over the small math source.
    state = json.loads(json.dumps(it.get_state()))
    expected = _take(it, 6)

    fresh = make_train_iterator(**kwargs)
    fresh.set_state(state)
    _assert_same(_take(fresh, 6), expected)

    it.set_state(state)  # Rewinding the same iterator works too.
    _assert_same(_take(it, 6), expected)


def test_same_seed_same_stream_other_seed_differs(data):
    data_dir, tok = data
    make = lambda seed: make_train_iterator(  # noqa: E731
        tokenizer=tok, seq_len=48, global_batch_size=2, data_dir=data_dir, domains=DOMAINS,
        seed=seed, process_index=0, process_count=1)
    _assert_same(_take(make(1), 3), _take(make(1), 3))
    a, b = _take(make(1), 3), _take(make(2), 3)
    assert any(not np.array_equal(x["inputs"], y["inputs"]) for x, y in zip(a, b))


def test_restore_rejects_state_from_other_settings(data):
    data_dir, tok = data
    kwargs = dict(tokenizer=tok, seq_len=48, global_batch_size=2, data_dir=data_dir,
                  domains=DOMAINS, process_index=0, process_count=1)
    state = make_train_iterator(seed=0, **kwargs).get_state()
    other = make_train_iterator(seed=1, **kwargs)
    with pytest.raises(ValueError, match="seed"):
        other.set_state(state)
    with pytest.raises(ValueError, match="state"):
        other.set_state({"grain": {}})


def test_domain_selection_and_weight_validation(data):
    data_dir, tok = data
    # Math documents are shorter than 256 tokens: every row starts with a whole problem.
    it = make_train_iterator(tokenizer=tok, seq_len=256, global_batch_size=2, data_dir=data_dir,
                             domains=(f"math_first{MAX_DOCS}",), process_index=0, process_count=1)
    for batch in _take(it, 3):
        for row in batch["inputs"]:
            assert tok.decode(row).startswith("<|endoftext|>Question: ")
    base = dict(tokenizer=tok, seq_len=64, global_batch_size=2, data_dir=data_dir,
                domains=DOMAINS, process_index=0, process_count=1)
    with pytest.raises(ValueError, match="mixture_weights"):
        make_train_iterator(mixture_weights=(1.0, 2.0), **base)
    with pytest.raises(ValueError, match="mixture_weights"):
        make_train_iterator(mixture_weights=(1.0, -1.0, 1.0), **base)
    with pytest.raises(ValueError, match="divisible"):
        make_train_iterator(**{**base, "global_batch_size": 3, "process_count": 2})
    with pytest.raises(ValueError, match="process_index"):
        make_train_iterator(**{**base, "process_index": 2, "process_count": 2})


def test_missing_or_corrupted_data_dir_fails_clearly(data, tmp_path):
    _, tok = data
    missing = str(tmp_path / "no_such_dir")
    with pytest.raises(DataError, match="no_such_dir"):
        make_train_iterator(tokenizer=tok, seq_len=32, global_batch_size=2, data_dir=missing,
                            process_index=0, process_count=1)
    with pytest.raises(DataError, match="no_such_dir"):
        make_eval_batches(tokenizer=tok, seq_len=32, global_batch_size=2, data_dir=missing,
                          process_index=0, process_count=1)
    # A data dir that has other configs but not the requested one.
    with pytest.raises(DataError, match="specjax_corpus/math"):
        make_train_iterator(tokenizer=tok, seq_len=32, global_batch_size=2, data_dir=data[0],
                            domains=("math",), process_index=0, process_count=1)


@pytest.mark.parametrize("process_count", [1, 2])
def test_eval_batches_are_static_disjoint_and_complete(data, process_count):
    data_dir, tok = data
    kwargs = dict(tokenizer=tok, seq_len=64, global_batch_size=4, data_dir=data_dir,
                  domains=DOMAINS)
    hosts = [make_eval_batches(process_index=i, process_count=process_count, **kwargs)
             for i in range(process_count)]
    for label, domain in zip(DOMAINS, corpus.DOMAINS):
        n_batches = {len(h[label]) for h in hosts}
        assert len(n_batches) == 1 and n_batches.pop() > 0  # Same count on every host.
        pieces = collections.Counter()
        for h in hosts:
            for batch in h[label]:
                assert batch["inputs"].shape == (4 // process_count, 64)
                pieces.update(_segments(batch, tok.pad_id))
        assert pieces == _expected_pieces(tok, domain, "heldout", 64)
    again = make_eval_batches(process_index=0, process_count=process_count, **kwargs)
    for label in DOMAINS:
        _assert_same(again[label], hosts[0][label])
    capped = make_eval_batches(process_index=0, process_count=1, max_batches=1, **kwargs)
    assert all(len(v) == 1 for v in capped.values())


def _user_builder_class():
    # A user's own TFDS text dataset: not registered, its text feature is called "content".
    class UserTextDs(tfds.core.GeneratorBasedBuilder, skip_registration=True):
        VERSION = tfds.core.Version("0.1.0")

        def _info(self):
            return tfds.core.DatasetInfo(builder=self, features=tfds.features.FeaturesDict(
                {"content": tfds.features.Text(), "n": tfds.features.Scalar(np.int64)}))

        def _split_generators(self, dl_manager):
            return {"train": self._generate_examples(40), "validation": self._generate_examples(7)}

        def _generate_examples(self, n):
            for i in range(n):
                yield i, {"content": f"user document {i}: " + "lorem ipsum " * (i % 9), "n": i}

    return UserTextDs


def test_any_prepared_tfds_text_dataset_plugs_in_by_name(data, tmp_path):
    _, tok = data
    data_dir = str(tmp_path / "user")
    _user_builder_class()(data_dir=data_dir, file_format="array_record").download_and_prepare(
        download_dir=os.path.join(data_dir, "downloads"))
    # The class is unregistered, so TFDS must find the dataset from the files by name alone.
    src = open_data_source("user_text_ds", data_dir, "validation", text_key="content")
    assert sorted(src[i]["n"] for i in range(len(src))) == list(range(7))
    it = make_train_iterator(tokenizer=tok, seq_len=32, global_batch_size=2, data_dir=data_dir,
                             dataset_name="user_text_ds", domains=None, text_key="content",
                             process_index=0, process_count=1)
    text = tok.decode(next(it)["inputs"][0])
    assert "user document" in text
    ev = make_eval_batches(tokenizer=tok, seq_len=32, global_batch_size=2, data_dir=data_dir,
                           dataset_name="user_text_ds", domains=None, text_key="content",
                           split="validation", process_index=0, process_count=1)
    assert list(ev) == ["user_text_ds"] and len(ev["user_text_ds"]) > 0
    with pytest.raises(DataError, match="text"):
        make_train_iterator(tokenizer=tok, seq_len=32, global_batch_size=2, data_dir=data_dir,
                            dataset_name="user_text_ds", domains=None,
                            process_index=0, process_count=1)


def test_state_saves_and_restores_through_orbax(data, tmp_path):
    ocp = pytest.importorskip("orbax.checkpoint")
    data_dir, tok = data
    kwargs = dict(tokenizer=tok, seq_len=48, global_batch_size=2, data_dir=data_dir,
                  domains=DOMAINS, seed=2, process_index=0, process_count=1)
    it = make_train_iterator(**kwargs)
    _take(it, 4)
    with ocp.CheckpointManager(str(tmp_path / "ckpt")) as mgr:
        mgr.save(4, args=ocp.args.Composite(data=ocp.args.JsonSave(it.get_state())))
        mgr.wait_until_finished()
    expected = _take(it, 3)
    with ocp.CheckpointManager(str(tmp_path / "ckpt")) as mgr:
        restored = mgr.restore(4, args=ocp.args.Composite(data=ocp.args.JsonRestore()))
    fresh = make_train_iterator(**kwargs)
    fresh.set_state(restored["data"])
    _assert_same(_take(fresh, 3), expected)


def test_package_exports_resolve_lazily():
    import specjax.data as data_pkg

    for name in data_pkg.__all__:
        assert getattr(data_pkg, name) is not None
    with pytest.raises(AttributeError):
        data_pkg.no_such_name
    from specjax.data import math_problems  # the submodule, whatever was imported before

    assert callable(math_problems.math_problems)
