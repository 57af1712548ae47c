"""Key/value cache laid out for speculative decoding.

Layout: ``k, v: [layers, slots, max_len, kv_heads, head_dim]`` plus ``lengths: int32 [slots]``.

* A row ("slot") owns one sequence. ``lengths[s]`` is the number of *committed* positions of slot s:
  positions ``0 .. lengths[s]-1`` hold keys/values of tokens that are part of the sequence.
* A forward call writes its T new tokens at positions ``lengths[s] + t`` (per-row offsets), in place
  (:func:`specjax.models.attention.write_kv`), *before*
  attending, and a query at position p attends to keys at positions ``<= p``. Entries at positions
  ``>= lengths[s]`` are therefore never read before being overwritten, so rejected draft tokens are
  rolled back by setting ``lengths`` alone (:meth:`KVCache.rollback`): no copy, no zeroing.
* Writes past ``max_len`` are dropped (scatter ``mode="drop"``), never clamped onto valid entries;
  callers must keep ``lengths + T <= max_len`` (the engine checks this on the host).

The flattened ragged mode of the serving engine (tokens of many slots packed in one 1-D batch with a
segment id = slot and a position per token) writes into the same arrays at ``(slot, position)``.
"""
from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp

from specjax.models.attention import write_kv
from specjax.models.config import ModelConfig


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    """Decoding cache of a target (or draft) transformer.

    Attributes:
      k: keys, ``[layers, slots, max_len, kv_heads, head_dim]`` (post-RoPE, post-QK-norm).
      v: values, same shape as ``k``.
      lengths: ``int32 [slots]``, committed positions per slot.
    """

    k: jax.Array
    v: jax.Array
    lengths: jax.Array

    @property
    def num_layers(self) -> int:
        return self.k.shape[0]

    @property
    def num_slots(self) -> int:
        return self.k.shape[1]

    @property
    def max_len(self) -> int:
        return self.k.shape[2]

    def rollback(self, lengths: jax.Array) -> "KVCache":
        """Returns the cache with ``lengths`` replaced (discarding everything at or past them).

        The cache (``lengths`` included) is donated by the jitted steps: pass a fresh array (or a
        host numpy array) rather than one you keep using.
        """
        return dataclasses.replace(self, lengths=jnp.asarray(lengths, jnp.int32))

    def replace(self, **kwargs) -> "KVCache":
        return dataclasses.replace(self, **kwargs)


def init_cache(config: ModelConfig, num_slots: int, max_len: int, dtype=None) -> KVCache:
    """Allocates an empty cache (all lengths 0).

    Args:
      config: model configuration (layers, kv heads, head_dim).
      num_slots: S, sequences held at once.
      max_len: positions per slot.
      dtype: storage dtype; defaults to the model's compute dtype.
    """
    if num_slots <= 0 or max_len <= 0:
        raise ValueError(f"num_slots and max_len must be positive, got {num_slots}, {max_len}")
    dtype = config.compute_dtype if dtype is None else dtype
    shape = (config.num_layers, num_slots, max_len, config.num_kv_heads, config.head_dim)
    return KVCache(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype),
                   lengths=jnp.zeros((num_slots,), jnp.int32))


class NewKV(NamedTuple):
    """Keys/values of N new tokens, not yet in the cache.

    k, v: ``[layers, N, KVH, Dh]``; slots, positions: int32 ``[N]`` where they go (positions
    ``>= max_len`` are padding and are dropped on write).
    """

    k: jax.Array
    v: jax.Array
    slots: jax.Array
    positions: jax.Array

    def write(self, cache: KVCache) -> KVCache:
        """The cache with these entries written in place (lengths kept): one
        :func:`~specjax.models.attention.write_kv` per layer, as the cached forward writes."""
        k, v = cache.k, cache.v
        for layer in range(k.shape[0]):
            k, v = write_kv(k, v, layer, self.slots, self.positions, self.k[layer], self.v[layer])
        return cache.replace(k=k, v=v)

    def pad(self, n: int, max_len: int) -> "NewKV":
        """Padded to ``n`` entries (the padding is dropped on write): one static shape for every
        verification bucket."""
        extra = n - self.slots.shape[0]
        if extra < 0:
            raise ValueError(f"cannot pad {self.slots.shape[0]} entries to {n}")
        widths = ((0, 0), (0, extra), (0, 0), (0, 0))
        return NewKV(k=jnp.pad(self.k, widths), v=jnp.pad(self.v, widths),
                     slots=jnp.pad(self.slots, (0, extra)),
                     positions=jnp.pad(self.positions, (0, extra), constant_values=max_len))
