"""The corpus as a TFDS dataset in ``array_record`` format, opening TFDS data sources, and the
one-call ``prepare_default_data`` (corpus -> tokenizer.json -> TFDS) used by ``make quickstart``.

Dataset ``specjax_corpus`` has one builder config per domain (``specjax_corpus/math``,
``specjax_corpus/code``, ``specjax_corpus/prose``) and two splits, ``train`` and ``heldout``
(:mod:`specjax.data.corpus` defines them). Each example is ``{"text": str, "key": str}`` where
``key`` is the document's stable corpus key. The files are written with
``file_format="array_record"`` and read back with ``tfds.data_source`` (random access, no
TensorFlow anywhere). Building is deterministic: the same corpus gives byte-identical
``.array_record`` files (TFDS orders records by a hash of their keys).

A subset build (``max_docs=n``: the first n documents of every split) gets its own config name,
``<domain>_first<n>``, so it can never be mistaken for the full dataset. TFDS reads such configs
from the files on disk (they are not in ``BUILDER_CONFIGS``).

Layout written by :func:`prepare_default_data` under ``data_dir``::

    data_dir/
      tokenizer.json                        byte-level BPE (specjax.data.tokenizer)
      specjax_data.json                     manifest: what was built, from which corpus and code
      specjax_corpus/<config>/1.0.0/        TFDS dataset_info.json, features.json,
        specjax_corpus-train.array_record-00000-of-00001, ...-heldout...
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import time
from typing import Any, Sequence

import tensorflow_datasets as tfds
from etils import epath
from tensorflow_datasets.core import utils as tfds_utils

from specjax.code_version import DATA_SOURCES, source_hash
from specjax.data import corpus as corpus_lib
from specjax.data import tokenizer as tokenizer_lib

__all__ = [
    "DATASET_NAME",
    "DataError",
    "SpecjaxCorpus",
    "SpecjaxCorpusConfig",
    "build_corpus_dataset",
    "corpus_dataset_name",
    "open_data_source",
    "PreparedData",
    "prepare_default_data",
]

DATASET_NAME = "specjax_corpus"
MANIFEST = "specjax_data.json"
TOKENIZER_FILE = "tokenizer.json"


class DataError(RuntimeError):
    """A dataset could not be opened or read; the message names the path and what to do."""


def _config_name(domain: str, max_docs: int | None) -> str:
    return domain if max_docs is None else f"{domain}_first{max_docs}"


class _LocalDatasetInfo(tfds.core.DatasetInfo):
    """DatasetInfo of a dataset that is never published: nothing to look up in TFDS's bucket.

    A builder whose data is not prepared yet asks ``initialize_from_bucket`` for published
    metadata; TFDS makes a temporary directory for it first and never removes it (with GCS
    disabled it then returns), so every such builder left an empty ``/tmp/tmp*tfds`` behind."""

    def initialize_from_bucket(self) -> None:
        return None


class SpecjaxCorpusConfig(tfds.core.BuilderConfig):
    """Builder config: one corpus domain, optionally only its first ``max_docs`` documents/split."""

    def __init__(self, *, domain: str, max_docs: int | None = None, **kwargs):
        if domain not in corpus_lib.DOMAINS:
            raise ValueError(f"unknown domain {domain!r}; expected one of {corpus_lib.DOMAINS}")
        kwargs.setdefault("name", _config_name(domain, max_docs))
        kwargs.setdefault("description", f"specjax embedded corpus, {domain} domain"
                          + (f", first {max_docs} documents per split" if max_docs else ""))
        super().__init__(**kwargs)
        self.domain = domain
        self.max_docs = max_docs


class SpecjaxCorpus(tfds.core.GeneratorBasedBuilder):
    """The embedded math / code / prose corpus (no download; generated from the stdlib)."""

    VERSION = tfds.core.Version("1.0.0")
    RELEASE_NOTES = {"1.0.0": "Initial release."}
    BUILDER_CONFIGS = [SpecjaxCorpusConfig(domain=d) for d in corpus_lib.DOMAINS]

    @tfds_utils.classproperty
    @classmethod
    def code_path(cls) -> epath.Path:
        # TFDS's default resolves the package through the `importlib_resources` backport, which
        # is not a dependency here; the path is only used to look for a (non-existent)
        # checksums file next to the builder.
        return epath.Path(os.path.abspath(__file__))

    def _info(self) -> tfds.core.DatasetInfo:
        # DatasetInfo directly, not dataset_info_from_configs: the latter reads README/CITATION
        # files from this module's package directory, which is specjax/data, not a TFDS folder.
        return _LocalDatasetInfo(
            builder=self,
            description=("Embedded specjax corpus: generated arithmetic word problems (math), "
                         "Python standard library source (code), stdlib docstrings and pydoc "
                         "help topics (prose). See specjax/data/corpus.py."),
            features=tfds.features.FeaturesDict({
                "text": tfds.features.Text(),
                "key": tfds.features.Text(),
            }),
        )

    def _split_generators(self, dl_manager):
        del dl_manager  # Nothing to download.
        return {split: self._generate_examples(split) for split in corpus_lib.SPLITS}

    def _generate_examples(self, split: str):
        cfg = self.builder_config
        for doc in corpus_lib.load_documents(cfg.domain, split, cfg.max_docs):
            yield doc.key, {"text": doc.text, "key": doc.key}


def corpus_dataset_name(domain: str, max_docs: int | None = None) -> str:
    """TFDS name of one domain's dataset, e.g. ``"specjax_corpus/math"``."""
    return f"{DATASET_NAME}/{_config_name(domain, max_docs)}"


@contextlib.contextmanager
def _progress_bars(enabled: bool):
    from tensorflow_datasets.core.utils import tqdm_utils

    previous = getattr(tqdm_utils, "_active", True)
    (tfds.enable_progress_bar if enabled else tfds.disable_progress_bar)()
    try:
        yield
    finally:
        (tfds.enable_progress_bar if previous else tfds.disable_progress_bar)()


def build_corpus_dataset(data_dir: str | os.PathLike, domains: Sequence[str] = corpus_lib.DOMAINS,
                         *, max_docs: int | None = None, progress: bool = False) -> dict[str, str]:
    """Write the corpus as TFDS array_record datasets under ``data_dir`` (skips ones present).

    Args:
      data_dir: TFDS data directory (created if missing).
      domains: which domains to build.
      max_docs: only the first ``max_docs`` documents per split (config ``<domain>_first<n>``).
      progress: show TFDS's progress bars.
    Returns:
      ``{domain: tfds_name}``, names to pass to :func:`open_data_source` / the input pipeline.
    """
    data_dir = os.fspath(data_dir)
    os.makedirs(data_dir, exist_ok=True)
    names = {}
    with _progress_bars(progress):
        for domain in domains:
            # TFDS wants registered configs by name; only subset configs are passed as objects.
            config = (domain if max_docs is None
                      else SpecjaxCorpusConfig(domain=domain, max_docs=max_docs))
            builder = SpecjaxCorpus(config=config, data_dir=data_dir, file_format="array_record")
            builder.download_and_prepare(download_dir=os.path.join(data_dir, "downloads"))
            names[domain] = corpus_dataset_name(domain, max_docs)
    return names


def open_data_source(dataset_name: str, data_dir: str | os.PathLike, split: str,
                     text_key: str = "text", *, check: bool = True):
    """Open a prepared TFDS dataset's split as a random-access source (``len``, ``[i]``).

    Works for any TFDS dataset prepared on disk in ``array_record`` format (``dataset_name`` may
    carry a config and version, e.g. ``"my_text/small:1.0.0"``); nothing is downloaded or built.

    Args:
      dataset_name: TFDS name.
      data_dir: the TFDS data directory it was prepared in.
      split: split name (TFDS slicing syntax such as ``"train[:10%]"`` works too).
      text_key: the feature holding the text; checked to exist.
      check: read each shard's first and last record now, so a truncated or corrupted file fails
        here with a clear message instead of deep inside the input pipeline.
    Raises:
      DataError: naming ``data_dir`` and the dataset when it is missing, unreadable or lacks
        ``text_key``.
    """
    data_dir = os.fspath(data_dir)
    where = f"TFDS dataset {dataset_name!r} (split {split!r}) in data_dir {data_dir!r}"
    if not os.path.isdir(data_dir):
        raise DataError(f"data directory does not exist: {data_dir!r} (needed for {where}). "
                        "Prepare it first, e.g. specjax.data.prepare_default_data(data_dir).")
    try:
        source = tfds.data_source(dataset_name, split=split, data_dir=data_dir, download=False,
                                  try_gcs=False)
    except Exception as e:  # TFDS raises many types; all mean "cannot open this dataset".
        raise DataError(f"cannot open {where}: {type(e).__name__}: {_first_lines(e)}. "
                        "Is it prepared (array_record format) and intact?") from e
    features = source.dataset_info.features
    if text_key not in features:
        raise DataError(f"{where} has no feature {text_key!r}; features: {sorted(features)}")
    if check:
        _probe(source, where)
    return _CheckedSource(source, where)


class _CheckedSource:
    """Random-access source that turns low-level read errors into a :class:`DataError`."""

    def __init__(self, source, where: str):
        self._source = source
        self.where = where
        self.dataset_info = source.dataset_info

    def __len__(self) -> int:
        return len(self._source)

    def __getitem__(self, index: int) -> dict[str, Any]:
        try:
            return self._source[index]
        except IndexError:
            raise
        except Exception as e:
            raise DataError(f"reading record {index} of {self.where} failed: "
                            f"{type(e).__name__}: {_first_lines(e)} (corrupted file?)") from e

    def __repr__(self) -> str:
        return f"_CheckedSource({self.where}, {len(self)} records)"


def _probe(source, where: str) -> None:
    n = len(source)
    if n == 0:
        return
    indices = {0, n - 1}
    try:  # First and last record of every shard: catches truncated and overwritten files.
        split_info = source.dataset_info.splits[source.split]
        start = 0
        for length in split_info.shard_lengths:
            if length:
                indices.update((start, start + length - 1))
            start += length
    except Exception:  # Sliced splits ("train[:10%]") have no per-shard lengths; keep the ends.
        pass
    for i in sorted(i for i in indices if 0 <= i < n):
        try:
            source[i]
        except Exception as e:
            raise DataError(f"{where} is unreadable at record {i}: {type(e).__name__}: "
                            f"{_first_lines(e)}. The files are corrupted or truncated; delete "
                            "the dataset directory and prepare it again.") from e


def _first_lines(e: BaseException, limit: int = 400) -> str:
    text = " ".join(str(e).split())
    return text if len(text) <= limit else text[:limit] + " ..."


# ----------------------------------------------------------------------------------------------
# prepare_default_data


@dataclasses.dataclass(frozen=True)
class PreparedData:
    """What :func:`prepare_default_data` made.

    Attributes:
      data_dir: the TFDS data directory.
      tokenizer_path: path of ``tokenizer.json``.
      dataset_names: ``{domain: tfds_name}``.
      built: True if anything was (re)built by this call, False if all was reused.
    """

    data_dir: str
    tokenizer_path: str
    dataset_names: dict[str, str]
    built: bool

    def load_tokenizer(self) -> tokenizer_lib.Tokenizer:
        return tokenizer_lib.load_tokenizer(self.tokenizer_path)


def prepare_default_data(data_dir: str | os.PathLike, vocab_size: int = 2048, *,
                         max_docs: int | None = None, force: bool = False,
                         progress: bool = False, verbose: bool = True) -> PreparedData:
    """Build corpus -> ``tokenizer.json`` -> TFDS array_record under ``data_dir``, once.

    Reuses everything when ``data_dir/specjax_data.json`` says the same corpus (fingerprint),
    the same data code (:data:`specjax.code_version.DATA_SOURCES`), vocabulary size and
    ``max_docs`` were built and the files are still there; otherwise (or with
    ``force``) rebuilds this function's own outputs (``tokenizer.json`` and
    ``data_dir/specjax_corpus``), leaving anything else in ``data_dir`` alone.
    The first full build takes 5-20 s on 2 CPU cores. On several hosts sharing a filesystem,
    call it from one process (e.g. ``jax.process_index() == 0``) and wait for it elsewhere.
    """
    data_dir = os.path.abspath(os.fspath(data_dir))
    os.makedirs(data_dir, exist_ok=True)
    tok_path = os.path.join(data_dir, TOKENIZER_FILE)
    manifest_path = os.path.join(data_dir, MANIFEST)
    wanted = {"corpus_fingerprint": corpus_lib.corpus_fingerprint(),
              "code_version": source_hash(DATA_SOURCES), "vocab_size": vocab_size,
              "max_docs": max_docs, "domains": list(corpus_lib.DOMAINS),
              "dataset_version": str(SpecjaxCorpus.VERSION)}
    names = {d: corpus_dataset_name(d, max_docs) for d in corpus_lib.DOMAINS}

    if not force and _manifest_matches(manifest_path, wanted) and os.path.isfile(tok_path) \
            and all(_is_prepared(data_dir, n) for n in names.values()):
        return PreparedData(data_dir, tok_path, names, built=False)

    log = print if verbose else (lambda *a, **k: None)
    if os.path.exists(manifest_path):
        os.remove(manifest_path)  # Invalidate first: an interrupted rebuild is never "current".
    shutil.rmtree(os.path.join(data_dir, DATASET_NAME), ignore_errors=True)
    t0 = time.perf_counter()
    tok = tokenizer_lib.train_tokenizer(vocab_size=vocab_size, max_docs=max_docs,
                                        save_path=tok_path)
    t1 = time.perf_counter()
    log(f"[specjax.data] trained tokenizer ({tok.vocab_size} tokens) in {t1 - t0:.1f}s -> {tok_path}")
    build_corpus_dataset(data_dir, max_docs=max_docs, progress=progress)
    t2 = time.perf_counter()
    log(f"[specjax.data] wrote TFDS array_record datasets in {t2 - t1:.1f}s -> "
        f"{os.path.join(data_dir, DATASET_NAME)}")
    tmp = f"{manifest_path}.tmp.{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump({**wanted, "dataset_names": names,
                   "build_seconds": round(t2 - t0, 1)}, f, indent=2, sort_keys=True)
    os.replace(tmp, manifest_path)
    return PreparedData(data_dir, tok_path, names, built=True)


def _manifest_matches(path: str, wanted: dict) -> bool:
    try:
        with open(path) as f:
            have = json.load(f)
    except (OSError, ValueError):
        return False
    return all(have.get(k) == v for k, v in wanted.items())


def _is_prepared(data_dir: str, name: str) -> bool:
    dataset, config = name.split("/")
    version_dir = os.path.join(data_dir, dataset, config, str(SpecjaxCorpus.VERSION))
    return os.path.isfile(os.path.join(version_dir, "dataset_info.json"))
