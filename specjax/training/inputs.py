"""Input side of the trainer: the iterator protocol, a synthetic stream, host -> global arrays.

The trainer consumes any :class:`BatchIterator`: ``next()`` gives this *process's* rows of the
global batch as numpy ``{"inputs", "targets", "segment_ids", "positions", "loss_mask"}``
(each ``[per_host_batch, T]``), and ``get_state()`` / ``set_state()`` round-trip a
JSON-serialisable position so a resumed run sees exactly the batches it would have seen.
:mod:`specjax.data`'s pipeline implements it; :class:`SyntheticLMIterator` is a tiny stand-in for
tests. :func:`global_batch` assembles the per-process rows into one global ``jax.Array`` sharded
over the mesh's batch axes (``jax.make_array_from_process_local_data``).
"""
from __future__ import annotations

import math
from typing import Any, Iterator, Mapping, Protocol, runtime_checkable

import jax
import numpy as np
from jax.sharding import Mesh

from specjax.training import sharding as sharding_lib

BATCH_KEYS = ("inputs", "targets", "segment_ids", "positions", "loss_mask")


@runtime_checkable
class BatchIterator(Protocol):
    def __next__(self) -> dict[str, np.ndarray]: ...
    def get_state(self) -> Any: ...  # JSON-serialisable
    def set_state(self, state: Any) -> None: ...


class SyntheticLMIterator:
    """A learnable toy stream: rows pack two "documents", each an arithmetic progression mod V.

    Batch ``k`` of shard ``s`` is a pure function of ``(seed, s, k)``, so the state is just ``k``.
    Different shards (processes) get different data. The second document of each row starts at a
    random split point, exercising ``segment_ids`` / per-document ``positions`` / ``loss_mask``
    (the last token of each document has no target).

    Args:
      batch_size: rows per ``next()`` (this process's share of the global batch).
      seq_len: T.
      vocab_size: V (tokens are in ``[1, V)``; 0 is the padding id).
    """

    def __init__(self, *, batch_size: int, seq_len: int, vocab_size: int, seed: int = 0,
                 shard_index: int = 0, num_shards: int = 1):
        if not 0 <= shard_index < num_shards:
            raise ValueError(f"shard_index {shard_index} outside [0, {num_shards})")
        self.batch_size, self.seq_len, self.vocab_size = batch_size, seq_len, vocab_size
        self.seed, self.shard_index, self.num_shards = seed, shard_index, num_shards
        self._step = 0

    def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
        return self

    def batch_at(self, k: int) -> dict[str, np.ndarray]:
        rng = np.random.default_rng([self.seed, self.shard_index, k])
        b, t, v = self.batch_size, self.seq_len, self.vocab_size
        split = rng.integers(2, t - 1, size=b) if t > 3 else np.full(b, t)
        col = np.arange(t)[None, :]
        second = col >= split[:, None]
        positions = np.where(second, col - split[:, None], col).astype(np.int32)
        start = rng.integers(1, v, size=(b, 2))
        stride = rng.integers(1, 4, size=(b, 2))
        doc = second.astype(np.int64)
        seq = (np.take_along_axis(start, doc, 1) + np.take_along_axis(stride, doc, 1) * positions)
        tokens = (1 + seq % (v - 1)).astype(np.int32)
        targets = np.concatenate([tokens[:, 1:], np.zeros((b, 1), np.int32)], axis=1)
        last_of_doc = np.concatenate([second[:, 1:] != second[:, :-1],
                                      np.ones((b, 1), bool)], axis=1)
        return {"inputs": tokens, "targets": targets, "segment_ids": (doc + 1).astype(np.int32),
                "positions": positions, "loss_mask": (~last_of_doc).astype(np.int32)}

    def __next__(self) -> dict[str, np.ndarray]:
        batch = self.batch_at(self._step)
        self._step += 1
        return batch

    def get_state(self) -> dict:
        return {"step": self._step, "shard_index": self.shard_index}

    def set_state(self, state: Mapping) -> None:
        if state.get("shard_index", self.shard_index) != self.shard_index:
            raise ValueError(f"iterator state of shard {state['shard_index']} restored into "
                             f"shard {self.shard_index}")
        self._step = int(state["step"])


def check_batch(batch: Mapping[str, np.ndarray], rows: int, seq_len: int) -> None:
    """Raises a clear error when a host batch does not have the expected keys / shape."""
    missing = {"inputs", "targets"} - set(batch)
    if missing:
        raise ValueError(f"input batch lacks keys {sorted(missing)}; got {sorted(batch)}")
    for key, value in batch.items():
        if np.shape(value) != (rows, seq_len):
            raise ValueError(f"input batch[{key!r}] has shape {np.shape(value)}, expected "
                             f"[per_host_batch={rows}, seq_len={seq_len}]")


def global_batch(host_batch: Mapping[str, np.ndarray], mesh: Mesh) -> dict[str, jax.Array]:
    """This process's rows -> global arrays ``[rows * process_count, ...]`` split over the mesh's
    batch axes. Every process must call it with the same keys and shapes."""
    n = jax.process_count()
    out = {}
    for key, value in host_batch.items():
        value = np.asarray(value)
        sharding = sharding_lib.batch_sharding(mesh, value.ndim)
        out[key] = jax.make_array_from_process_local_data(
            sharding, value, (value.shape[0] * n,) + value.shape[1:])
    return out


def pad_rows(batch: Mapping[str, np.ndarray], multiple: int) -> dict[str, np.ndarray]:
    """Pads rows up to a multiple of ``multiple``; padded rows have ``loss_mask == 0``
    (used for eval batches of arbitrary size; requires a ``loss_mask`` to stay exact)."""
    rows = len(next(iter(batch.values())))
    target = math.ceil(rows / multiple) * multiple
    if target == rows:
        return dict(batch)
    if "loss_mask" not in batch:
        raise ValueError(f"cannot pad an eval batch of {rows} rows to a multiple of {multiple} "
                         f"without a loss_mask")
    out = {}
    for key, value in batch.items():
        value = np.asarray(value)
        pad = np.zeros((target - rows,) + value.shape[1:], value.dtype)
        if key == "segment_ids":
            pad += 1  # a valid segment so padded rows attend to something (no all-masked rows)
        out[key] = np.concatenate([value, pad])
    return out
