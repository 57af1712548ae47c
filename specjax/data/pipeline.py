"""Input pipeline: TFDS array_record sources -> grain -> packed, sharded, checkpointable batches.

Built on ``grain`` (its ``MapDataset`` / ``IterDataset`` API: random access over the TFDS
``array_record`` data source, index shuffling, first-fit packing, mixing, and iterator state).
Per source (one TFDS dataset, e.g. one corpus domain)::

    tfds.data_source ─► shard [process_index::process_count] (documents) ─► shuffle(seed)
      ─► repeat ─► tokenize ─► chunk to ≤ T ─► first-fit pack into rows of T
    then: mix the sources' rows by weight ─► batch [per_host_batch, T] ─► numpy dict

Documents. Each document becomes ``<|endoftext|> text <|endoftext|>`` (EOS doubles as the
beginning-of-document token) and is turned into next-token pairs *before* packing:
``inputs = ids[:-1]``, ``targets = ids[1:]``, so no target ever crosses a document boundary.
A document longer than ``T`` is cut into consecutive pieces of ``T`` pairs (each piece restarts
at position 0). Packing puts whole pieces into rows first-fit (a piece is never split across
rows); the leftover tail of a row is padding.

Batch (numpy, one dict per step)::

    inputs      int32   [B, T]  token ids (pad_id in padding)
    targets     int32   [B, T]  next token of each input (pad_id in padding)
    segment_ids int32   [B, T]  1, 2, ... per packed piece within a row; 0 = padding
    positions   int32   [B, T]  position within the piece (0-based); 0 in padding
    loss_mask   float32 [B, T]  1.0 where segment_ids > 0, else 0.0

``B`` is the per-host batch ``global_batch_size // process_count``. Attention must be causal
*and* restricted to equal segment ids; positions feed the rotary embedding.

Sharding. Each host reads a disjoint stride of every source's documents
(``[process_index::process_count]``); the shards together are the whole split. Each host then
shuffles its shard with the same seed and reshuffles every epoch (grain folds the epoch into the
seed), so the stream depends only on (data, seed, process_index, process_count, settings).

Mixture. ``mixture_weights`` are proportions of *rows* (≈ tokens, since rows are nearly full);
every row comes from a single source, which keeps per-domain accounting simple.

Checkpointing. :meth:`DataIterator.get_state` returns a JSON-serialisable dict (grain's
iterator state plus the settings it is valid for); :meth:`DataIterator.set_state` on an iterator
made with the same settings continues the stream exactly where it was, e.g. after an Orbax
restore (save it with ``ocp.args.JsonSave``). Restoring under different settings raises.

Any TFDS text dataset prepared on disk in ``array_record`` format plugs in through
``dataset_name`` / ``data_dir`` / ``text_key``; with ``domains=None`` the dataset is used as a
single source.
"""
from __future__ import annotations

import hashlib
import json
import os
from typing import Any, Mapping, Sequence

import grain
import numpy as np
from grain import experimental as grain_exp

from specjax.data.corpus import DOMAINS
from specjax.data.tfds_builder import DATASET_NAME, DataError, open_data_source
from specjax.data.tokenizer import Tokenizer

__all__ = ["DataIterator", "make_train_iterator", "make_eval_batches", "BATCH_KEYS"]

BATCH_KEYS = ("inputs", "targets", "segment_ids", "positions", "loss_mask")
_STATE_VERSION = 1


# ----------------------------------------------------------------------------------------------
# Per-element transforms (module-level classes so grain can name them in its debug output)


class _TokenizeAndChunk(grain.transforms.Map):
    """TFDS record -> list of ``{"inputs": int32[n], "targets": int32[n]}`` pieces, n <= T."""

    def __init__(self, tokenizer: Tokenizer, text_key: str, seq_len: int):
        self._tok = tokenizer
        self._key = text_key
        self._seq_len = seq_len

    def map(self, record):
        text = record[self._key]
        if isinstance(text, bytes):  # tfds.features.Text decodes to bytes in data sources.
            text = text.decode("utf-8", errors="replace")
        body = self._tok.encode(text)
        if not body:
            return []
        ids = np.asarray([self._tok.eos_id, *body, self._tok.eos_id], dtype=np.int32)
        inputs, targets = ids[:-1], ids[1:]
        t = self._seq_len
        return [{"inputs": inputs[i:i + t], "targets": targets[i:i + t]}
                for i in range(0, len(inputs), t)]


class _Flatten(grain_exp.FlatMapTransform):
    max_fan_out = 1 << 20  # Not enforced by the iterator version; documents may be long.

    def flat_map(self, pieces):
        return pieces


class _FinalizeRow(grain.transforms.Map):
    """grain's packed row -> the batch keys of the module docstring."""

    def map(self, row):
        seg = row["inputs_segment_ids"].astype(np.int32)
        return {
            "inputs": row["inputs"].astype(np.int32),
            "targets": row["targets"].astype(np.int32),
            "segment_ids": seg,
            "positions": row["inputs_positions"].astype(np.int32),
            "loss_mask": (seg > 0).astype(np.float32),
        }


# ----------------------------------------------------------------------------------------------
# Iterator


class DataIterator:
    """Iterator over numpy batch dicts with checkpointable state (see the module docstring).

    Attributes:
      spec: JSON-able settings this stream depends on (validated on :meth:`set_state`).
    """

    def __init__(self, dataset: grain.IterDataset, spec: dict[str, Any]):
        self._dataset = dataset
        self._it = iter(dataset)
        self.spec = spec

    def __iter__(self) -> "DataIterator":
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        return next(self._it)

    def get_state(self) -> dict[str, Any]:
        """JSON-serialisable position in the stream (plain dicts, lists, ints, strings)."""
        state = {"version": _STATE_VERSION, "spec": self.spec, "grain": self._it.get_state()}
        return json.loads(json.dumps(state, default=_json_default))

    def set_state(self, state: Mapping[str, Any]) -> None:
        """Continue from a state returned by :meth:`get_state` (of an identically built iterator)."""
        if not isinstance(state, Mapping) or state.get("version") != _STATE_VERSION \
                or "grain" not in state:
            raise ValueError("not a specjax DataIterator state (expected keys version/spec/grain "
                             f"with version {_STATE_VERSION})")
        saved = state.get("spec", {})
        diffs = {k: (saved.get(k), v) for k, v in self.spec.items() if saved.get(k) != v}
        if diffs:
            details = ", ".join(f"{k}: saved {a!r} != now {b!r}" for k, (a, b) in diffs.items())
            raise ValueError(f"iterator state was saved under different settings ({details})")
        self._it.set_state(state["grain"])

    def close(self) -> None:
        """Stop prefetch threads (also happens when the iterator is garbage collected)."""
        close = getattr(self._it, "close", None)
        if close is not None:
            try:
                close()
            except NotImplementedError:
                pass


def _json_default(x):
    if isinstance(x, np.integer):
        return int(x)
    if isinstance(x, np.floating):
        return float(x)
    if isinstance(x, np.ndarray):
        return x.tolist()
    raise TypeError(f"iterator state contains a non-JSON value of type {type(x).__name__}")


# ----------------------------------------------------------------------------------------------
# Builders


def make_train_iterator(
    *,
    tokenizer: Tokenizer,
    seq_len: int,
    global_batch_size: int,
    data_dir: str | os.PathLike,
    dataset_name: str = DATASET_NAME,
    domains: Sequence[str] | None = DOMAINS,
    mixture_weights: Sequence[float] | Mapping[str, float] | None = None,
    text_key: str = "text",
    split: str = "train",
    seed: int = 0,
    process_index: int | None = None,
    process_count: int | None = None,
    num_epochs: int | None = None,
    shuffle: bool = True,
    num_packing_bins: int | None = None,
    num_threads: int = 1,
    prefetch_buffer_size: int = 32,
) -> DataIterator:
    """Packed training batches ``[global_batch_size // process_count, seq_len]`` for this host.

    Args:
      tokenizer: a :class:`specjax.data.tokenizer.Tokenizer`.
      seq_len: T, tokens per row.
      global_batch_size: rows per step across all hosts (divisible by ``process_count``).
      data_dir: TFDS data directory.
      dataset_name: TFDS dataset; with ``domains`` each source is ``f"{dataset_name}/{domain}"``
        (a builder config), with ``domains=None`` the dataset itself is the only source.
      domains: source configs to mix (default: the corpus's math, code and prose), or names of
        subset configs such as ``"math_first100"``.
      mixture_weights: row proportions per domain (sequence aligned with ``domains`` or a
        mapping); default uniform.
      text_key: the text feature of the TFDS examples.
      split: TFDS split to read.
      seed: shuffling seed (documents and packed rows).
      process_index, process_count: this host and the number of hosts (default: from JAX).
      num_epochs: passes over each source; None repeats forever. When any source runs out the
        iterator stops.
      shuffle: shuffle documents and packed rows (False: file order, e.g. for debugging).
      num_packing_bins: rows packed together (more = less padding); default max(8, batch).
      num_threads, prefetch_buffer_size: grain read/tokenize threads and buffer per source.
    Returns:
      a :class:`DataIterator` yielding dicts with :data:`BATCH_KEYS`.
    """
    process_index, process_count = _process(process_index, process_count)
    seq_len, global_batch_size = _positive("seq_len", seq_len), \
        _positive("global_batch_size", global_batch_size)
    if global_batch_size % process_count:
        raise ValueError(f"global_batch_size={global_batch_size} is not divisible by "
                         f"process_count={process_count}")
    per_host = global_batch_size // process_count
    bins = num_packing_bins if num_packing_bins is not None else max(8, per_host)
    names = _source_names(dataset_name, domains)
    weights = _weights(names, mixture_weights)

    rows = {}
    for i, (label, name) in enumerate(names.items()):
        rows[label] = _packed_rows(
            name, data_dir=data_dir, split=split, text_key=text_key, tokenizer=tokenizer,
            seq_len=seq_len, seed=_derive_seed(seed, i), shard=(process_index, process_count),
            num_epochs=num_epochs, shuffle=shuffle, bins=bins, num_threads=num_threads,
            prefetch=prefetch_buffer_size)
    ds = rows[next(iter(rows))] if len(rows) == 1 else \
        grain.IterDataset.mix(rows, {k: weights[k] for k in rows})
    ds = ds.batch(per_host, drop_remainder=True)
    spec = {
        "kind": "train", "sources": names, "weights": weights, "split": split,
        "text_key": text_key, "seq_len": seq_len, "global_batch_size": global_batch_size,
        "per_host_batch": per_host, "seed": seed, "process_index": process_index,
        "process_count": process_count, "num_epochs": num_epochs, "shuffle": shuffle,
        "num_packing_bins": bins, "tokenizer": _tokenizer_id(tokenizer),
    }
    return DataIterator(ds, spec)


def make_eval_batches(
    *,
    tokenizer: Tokenizer,
    seq_len: int,
    global_batch_size: int,
    data_dir: str | os.PathLike,
    dataset_name: str = DATASET_NAME,
    domains: Sequence[str] | None = DOMAINS,
    text_key: str = "text",
    split: str = "heldout",
    process_index: int | None = None,
    process_count: int | None = None,
    max_batches: int | None = None,
) -> dict[str, list[dict[str, np.ndarray]]]:
    """One deterministic pass over each source's ``split``, packed, as a list of batches.

    Every host packs the whole split the same way (file order, no shuffling), pads the rows to a
    multiple of ``global_batch_size`` with all-padding rows (``loss_mask`` 0), and keeps rows
    ``[process_index::process_count]``: all hosts get the same number of batches of the same
    shape (no host waits at a collective), the hosts' rows are disjoint and cover the split.

    Returns:
      ``{domain (or dataset_name when domains is None): [batch, ...]}``, each batch a dict of
      :data:`BATCH_KEYS` arrays of shape ``[global_batch_size // process_count, seq_len]``;
      at most ``max_batches`` batches per source.
    """
    process_index, process_count = _process(process_index, process_count)
    seq_len, global_batch_size = _positive("seq_len", seq_len), \
        _positive("global_batch_size", global_batch_size)
    if global_batch_size % process_count:
        raise ValueError(f"global_batch_size={global_batch_size} is not divisible by "
                         f"process_count={process_count}")
    per_host = global_batch_size // process_count
    out = {}
    for label, name in _source_names(dataset_name, domains).items():
        ds = _packed_rows(name, data_dir=data_dir, split=split, text_key=text_key,
                          tokenizer=tokenizer, seq_len=seq_len, seed=0, shard=(0, 1),
                          num_epochs=1, shuffle=False, bins=max(8, global_batch_size),
                          num_threads=1, prefetch=32)
        rows = []
        limit = None if max_batches is None else max_batches * global_batch_size
        for row in ds:
            rows.append(row)
            if limit is not None and len(rows) >= limit:
                break
        n_total = -(-len(rows) // global_batch_size) * global_batch_size
        rows += [_padding_row(seq_len, tokenizer.pad_id)] * (n_total - len(rows))
        mine = rows[process_index::process_count]
        out[label] = [_stack(mine[i:i + per_host]) for i in range(0, len(mine), per_host)]
    return out


def _packed_rows(name, *, data_dir, split, text_key, tokenizer, seq_len, seed, shard,
                 num_epochs, shuffle, bins, num_threads, prefetch) -> grain.IterDataset:
    """One source's stream of packed rows (dicts of [T] arrays)."""
    source = open_data_source(name, data_dir, split, text_key)
    index, count = shard
    if len(source) < count:
        raise DataError(f"{source.where} has {len(source)} records, fewer than the "
                        f"{count} hosts sharing it")
    ds = grain.MapDataset.source(source)[index::count]
    if shuffle:
        ds = ds.shuffle(seed=seed)
    if num_epochs != 1:
        ds = ds.repeat(num_epochs)  # Reseeds the shuffle every epoch.
    ds = ds.map(_TokenizeAndChunk(tokenizer, text_key, seq_len))
    it = ds.to_iter_dataset(grain.ReadOptions(num_threads=num_threads,
                                              prefetch_buffer_size=prefetch))
    it = grain_exp.FlatMapIterDataset(it, _Flatten())
    it = grain_exp.FirstFitPackIterDataset(
        it, length_struct={"inputs": seq_len, "targets": seq_len}, num_packing_bins=bins,
        seed=_derive_seed(seed, 1), shuffle_bins=shuffle,
        padding_struct={"inputs": tokenizer.pad_id, "targets": tokenizer.pad_id})
    return it.map(_FinalizeRow())


# ----------------------------------------------------------------------------------------------
# Helpers


def _source_names(dataset_name: str, domains: Sequence[str] | None) -> dict[str, str]:
    if not isinstance(dataset_name, str) or not dataset_name:
        raise ValueError(f"dataset_name must be a non-empty string, got {dataset_name!r}")
    if domains is None:
        return {dataset_name: dataset_name}
    if isinstance(domains, str):
        domains = (domains,)
    if not domains or len(set(domains)) != len(domains):
        raise ValueError(f"domains must be a non-empty sequence without repeats, got {domains!r}")
    return {d: f"{dataset_name}/{d}" for d in domains}


def _weights(names: dict[str, str], weights) -> dict[str, float]:
    labels = list(names)
    if weights is None:
        w = {k: 1.0 for k in labels}
    elif isinstance(weights, Mapping):
        if set(weights) != set(labels):
            raise ValueError(f"mixture_weights keys {sorted(weights)} != domains {labels}")
        w = {k: float(weights[k]) for k in labels}
    else:
        weights = list(weights)
        if len(weights) != len(labels):
            raise ValueError(f"{len(weights)} mixture_weights for {len(labels)} domains {labels}")
        w = dict(zip(labels, map(float, weights)))
    if any(not np.isfinite(v) or v < 0 for v in w.values()) or sum(w.values()) <= 0:
        raise ValueError(f"mixture_weights must be finite, >= 0 and not all 0, got {w}")
    total = sum(w.values())
    return {k: v / total for k, v in w.items()}


def _process(index: int | None, count: int | None) -> tuple[int, int]:
    if index is None or count is None:
        import jax  # Deferred: the data modules are usable without initialising a backend.

        index = jax.process_index() if index is None else index
        count = jax.process_count() if count is None else count
    if not (isinstance(count, int) and count >= 1 and isinstance(index, int)
            and 0 <= index < count):
        raise ValueError(f"need 0 <= process_index < process_count, got {index}, {count}")
    return index, count


def _positive(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return int(value)


def _derive_seed(seed: int, *salt: int) -> int:
    """Independent 32-bit seed per (seed, salt...): sources must not share permutations."""
    return int(np.random.SeedSequence([int(seed) & 0xFFFFFFFF, *salt]).generate_state(1)[0])


def _tokenizer_id(tok: Tokenizer) -> str:
    # Batches depend on every merge; a content hash catches a swapped tokenizer on restore.
    digest = hashlib.sha256(tok.hf.to_str().encode()).hexdigest()[:16]
    return f"{tok.vocab_size}:{digest}"


def _padding_row(seq_len: int, pad_id: int) -> dict[str, np.ndarray]:
    zeros = np.zeros(seq_len, np.int32)
    pads = np.full(seq_len, pad_id, np.int32)
    return {"inputs": pads, "targets": pads, "segment_ids": zeros, "positions": zeros,
            "loss_mask": np.zeros(seq_len, np.float32)}


def _stack(rows: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    return {k: np.stack([r[k] for r in rows]) for k in BATCH_KEYS}
