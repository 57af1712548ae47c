"""Attention math and the cached attention whose cost follows the context, not ``max_len``.

Four pieces:

* :func:`grouped_attention`: dense grouped-query attention with a boolean mask (training, scoring
  and the jnp reference of every cached mode). Inside :func:`query_chunks` (at trace time) it
  walks the queries in chunks, each under ``jax.checkpoint``, so that one chunk's
  ``[B, H, chunk, S]`` scores are alive at a time instead of the whole ``[B, H, T, S]``, in the
  forward and the backward pass (training at long sequences, docs/TPU.md "Memory").
* :func:`write_kv`: writes one layer's new keys/values into the whole layered cache array
  ``[layers, slots, max_len, kv_heads, head_dim]`` at ``(layer, slot, position)``. One scatter into
  the full array, so under buffer donation (or as a ``lax.while_loop`` carry) XLA updates it in
  place: a step moves the bytes of its new tokens, not a copy of the cache.
* :func:`windowed_attention`: attends queries to the first ``W`` positions of every slot, where
  ``W`` is the smallest *window bucket* that covers the longest context in the batch
  (:func:`kv_windows`; a ``lax.switch`` over one branch per bucket). Positions ``>= W`` are never
  read, so attention costs ``S · W`` key reads, not ``S · max_len``.
* :func:`block_cached_attention`: the same windowed read for a block of new tokens per slot that
  attends to the committed cache plus itself, leaving the cache untouched (the engine's flattened
  verification writes the block's keys after its bucket branch).

Why length buckets over the slot-contiguous cache rather than a paged cache with block tables: on a
CPU (and for the dense jnp path on any backend) a slice ``[:, :W]`` of a contiguous slot row is
one cheap strided read that XLA fuses into the score matmul, while a block-table gather costs a
gather per page. The contiguous layout *is* a paged layout with the trivial block table
``page_table[s] = s · (max_len / page) + arange(max_len / page)`` (see
:func:`contiguous_page_table`), so a paged kernel such as jax's ``ragged_paged_attention`` reads
the same buffer with per-sequence lengths and no bucketing. The price of buckets is the padding
to the next power of two and the ragged batch paying for its longest row.
"""
from __future__ import annotations

import contextlib
import contextvars
from typing import Sequence

import jax
import jax.numpy as jnp
from einops import rearrange

_NEG_INF = -1e30

# The smallest window bucket: below it the switch costs more than the keys it saves.
MIN_WINDOW = 128


def attention_weights_mask(q_pos, k_pos, q_seg=None, k_seg=None, k_valid=None):
    """Boolean mask ``[B, T, S]``: key visible to query (causal by position, same segment)."""
    mask = k_pos[:, None, :] <= q_pos[:, :, None]
    if q_seg is not None:
        mask &= q_seg[:, :, None] == k_seg[:, None, :]
    if k_valid is not None:
        mask &= k_valid[:, None, :]
    return mask


_QUERY_CHUNK = contextvars.ContextVar("specjax_attention_query_chunk", default=0)


@contextlib.contextmanager
def query_chunks(chunk: int):
    """Inside the ``with`` (at trace time), :func:`grouped_attention` computes ``chunk`` queries
    at a time (``0``: all at once). Each query's output is the same computation as without (the
    softmax of its own row of scores); only which rows are alive at once changes. A query length
    that is not a multiple of ``chunk`` is padded with masked rows (dropped from the result); one
    of at most ``chunk`` is computed in one piece.

    The setting is read while a function is traced, and jit's cache does not key on it: enter the
    ``with`` inside the traced function (as :class:`specjax.training.Trainer` does around its
    loss), or around the first call of a new ``jax.jit``."""
    if chunk < 0:
        raise ValueError(f"query_chunks: chunk must be >= 0, got {chunk}")
    token = _QUERY_CHUNK.set(int(chunk))
    try:
        yield
    finally:
        _QUERY_CHUNK.reset(token)


def grouped_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
    """Grouped-query attention.

    Args:
      q: ``[B, T, H, Dh]``; k, v: ``[B, S, KVH, Dh]``; mask: bool ``[B, T, S]``.
    Returns:
      ``[B, T, H, Dh]`` in q's dtype. Softmax in f32; rows with no visible key give zeros.
    """
    chunk, t = _QUERY_CHUNK.get(), q.shape[1]
    if chunk <= 0 or t <= chunk:
        return _dense_attention(q, k, v, mask)
    pad = -t % chunk  # masked rows: zeros out, no gradient, sliced off
    if pad:
        q = jnp.pad(q, ((0, 0), (0, pad), (0, 0), (0, 0)))
        mask = jnp.pad(mask, ((0, 0), (0, pad), (0, 0)))
    n = (t + pad) // chunk
    qs = rearrange(q, "b (n c) h d -> n b c h d", n=n)
    ms = rearrange(mask, "b (n c) s -> n b c s", n=n)
    # checkpoint: the backward pass recomputes one chunk's scores instead of keeping all of them.
    # Unrolled: XLA's cost analysis counts a loop's body once, which would hide all chunks but
    # one from the FLOPs and bytes that AOT pre-flights report (specjax.aot).
    one = jax.checkpoint(lambda qc, mc: _dense_attention(qc, k, v, mc))
    _, out = jax.lax.scan(lambda carry, xs: (carry, one(*xs)), None, (qs, ms), unroll=True)
    return rearrange(out, "n b c h d -> b (n c) h d")[:, :t]


def _dense_attention(q, k, v, mask):
    dh = q.shape[-1]
    kvh = k.shape[2]
    qg = rearrange(q, "b t (k g) d -> b t k g d", k=kvh)  # query heads grouped by their KV head
    scores = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32)
    scores = scores * (dh ** -0.5)
    m = mask[:, None, None, :, :]
    scores = jnp.where(m, scores, _NEG_INF)
    probs = jax.nn.softmax(scores, axis=-1)
    probs = jnp.where(m, probs, 0.0)
    out = jnp.einsum("bkgts,bskd->btkgd", probs.astype(v.dtype), v,
                     preferred_element_type=jnp.float32)
    return rearrange(out, "b t k g d -> b t (k g) d").astype(q.dtype)


def kv_windows(max_len: int, min_window: int = MIN_WINDOW) -> tuple[int, ...]:
    """Window buckets for a cache of ``max_len`` positions: powers of two from ``min_window``
    below ``max_len``, then ``max_len`` itself (static; one attention branch each)."""
    if max_len <= 0:
        raise ValueError(f"max_len must be positive, got {max_len}")
    out, w = [], min_window
    while w < max_len:
        out.append(w)
        w *= 2
    out.append(max_len)
    return tuple(out)


def write_kv(k_all: jax.Array, v_all: jax.Array, layer: int, slots: jax.Array,
             positions: jax.Array, k: jax.Array, v: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Scatters one layer's new entries into the layered cache (in place under donation).

    Args:
      k_all, v_all: ``[layers, slots, max_len, kv_heads, head_dim]``.
      layer: static layer index.
      slots, positions: int32, same shape ``[...]``: where each new entry goes. Positions
        ``>= max_len`` (padding) are dropped, never clamped onto valid entries.
      k, v: ``[..., kv_heads, head_dim]``.
    """
    k_all = k_all.at[layer, slots, positions].set(k.astype(k_all.dtype), mode="drop")
    v_all = v_all.at[layer, slots, positions].set(v.astype(v_all.dtype), mode="drop")
    return k_all, v_all


def trace_platform() -> str:
    """Platform the code is being traced for: the mesh in context (``jax.set_mesh``; how AOT
    compiles for a TPU topology from a CPU host), else the default backend."""
    mesh = jax.sharding.get_abstract_mesh()
    if not mesh.empty:
        return mesh.abstract_device.platform
    return jax.default_backend()


def window_switch(need: jax.Array, windows: Sequence[int], branch, *operands):
    """Runs ``branch(w)(*operands)`` for the smallest window ``w >= need`` (``lax.switch`` over the
    static ``windows``; one branch when there is a single window). ``branch(w)`` must read only
    the first ``w`` positions of the caches it slices."""
    if len(windows) == 1:
        return branch(windows[0])(*operands)
    idx = jnp.searchsorted(jnp.asarray(windows, jnp.int32), need.astype(jnp.int32), side="left")
    idx = jnp.minimum(idx, len(windows) - 1)
    return jax.lax.switch(idx, [branch(w) for w in windows], *operands)


def windowed_attention(q: jax.Array, q_pos: jax.Array, k_all: jax.Array, v_all: jax.Array,
                       layer: int, windows: Sequence[int], need: jax.Array) -> jax.Array:
    """Causal attention of each slot's queries to its cached keys, reading only a window.

    Args:
      q: ``[S, T, H, Dh]`` queries of each slot (rows = cache slots).
      q_pos: int32 ``[S, T]`` query positions (a query sees cached positions ``<= q_pos``).
      k_all, v_all: layered cache ``[layers, S, max_len, KVH, Dh]`` (this call's keys written).
      layer: static layer index.
      windows: static window buckets (:func:`kv_windows`), ascending, the last ``= max_len``.
      need: int32 scalar, how many leading positions must be visible (max over the batch of the
        last real query position + 1). The smallest window ``>= need`` is used.
    Returns:
      ``[S, T, H, Dh]``.
    """
    s, t = q_pos.shape

    def attend(k, v, w):
        k_pos = jnp.broadcast_to(jnp.arange(w, dtype=jnp.int32), (s, w))
        mask = attention_weights_mask(q_pos, k_pos)
        return grouped_attention(q, k.astype(q.dtype), v.astype(q.dtype), mask)

    return layer_window_switch(k_all, v_all, layer, windows, need, attend)


def layer_window_switch(k_all: jax.Array, v_all: jax.Array, layer: int, windows: Sequence[int],
                        need: jax.Array, attend):
    """``attend(k, v, w)`` on the first ``w`` positions of one layer of the layered cache
    ``[layers, S, max_len, KVH, Dh]``, for the smallest window ``w >= need``
    (:func:`window_switch`).

    Which operands the branches get is a per-compiler choice, measured on both (one slice of
    exactly the window inside the branch, never a materialised layer row, is the goal):

    * TPU: only this layer's cache. Handing the branches the whole layered cache made the TPU
      compiler copy every layer's cache inside each branch (tests/test_aot_tpu.py).
    * CPU: the whole layered cache. Handing it one layer's rows made XLA:CPU materialise that
      layer's row ``[S, max_len, ...]`` in the attention's layout before the switch, for k and v,
      every layer and step: a copy proportional to max_len
      (tests/test_attention_window.py::test_cached_step_writes_the_cache_in_place).
    """
    def window(k, v, w):
        return attend(jax.lax.slice_in_dim(k, 0, w, axis=1),
                      jax.lax.slice_in_dim(v, 0, w, axis=1), w)

    if trace_platform() == "cpu":
        def branch(w: int):
            return lambda k_all, v_all: window(k_all[layer], v_all[layer], w)
        return window_switch(need, windows, branch, k_all, v_all)

    def layer_branch(w: int):
        return lambda k_layer, v_layer: window(k_layer, v_layer, w)
    return window_switch(need, windows, layer_branch, k_all[layer], v_all[layer])


def block_cached_attention(q: jax.Array, q_pos: jax.Array, k_new: jax.Array, v_new: jax.Array,
                           new_valid: jax.Array, k_all: jax.Array, v_all: jax.Array, layer: int,
                           windows: Sequence[int], lengths: jax.Array) -> jax.Array:
    """Attention of a block of new tokens per slot to the slot's *committed* cache and to the
    block itself, with the cache only read (the new keys are written later, by the caller).

    A query at position p of slot s sees the cached positions ``< lengths[s]`` and the block's
    own keys at positions ``<= p``: the same keys as writing the block first and attending to
    positions ``<= p``, so the result equals :func:`windowed_attention` after :func:`write_kv`.
    Keeping the cache read-only lets a caller run this inside a ``lax.switch`` (the engine's
    verification buckets) without the compiler copying the cache in and out of the branch.

    Args:
      q: ``[S, G, H, Dh]`` the block's queries (G = static block length per slot).
      q_pos: int32 ``[S, G]`` their positions (``lengths[s] + j``).
      k_new, v_new: ``[S, G, KVH, Dh]`` the block's keys / values.
      new_valid: bool ``[S, G]``: block entry is a real token.
      k_all, v_all: layered cache ``[layers, S, max_len, KVH, Dh]`` (read only).
      layer: static layer index. windows: :func:`kv_windows` of the cache.
      lengths: int32 ``[S]`` committed positions per slot.
    Returns:
      ``[S, G, H, Dh]``.
    """
    s, g = q_pos.shape
    need = jnp.max(jnp.where(jnp.any(new_valid, axis=1), lengths, 0))

    def attend(k, v, w):
        k_pos = jnp.concatenate([jnp.broadcast_to(jnp.arange(w, dtype=jnp.int32), (s, w)),
                                 q_pos], axis=1)
        valid = jnp.concatenate([jnp.arange(w, dtype=jnp.int32)[None, :] < lengths[:, None],
                                 new_valid], axis=1)
        mask = attention_weights_mask(q_pos, k_pos, k_valid=valid)
        k = jnp.concatenate([k.astype(q.dtype), k_new.astype(q.dtype)], axis=1)
        v = jnp.concatenate([v.astype(q.dtype), v_new.astype(q.dtype)], axis=1)
        return grouped_attention(q, k, v, mask)

    return layer_window_switch(k_all, v_all, layer, windows, need, attend)


def contiguous_page_table(num_slots: int, max_len: int, page_size: int) -> jax.Array:
    """Block table that reads the slot-contiguous cache as pages: ``int32 [S, max_len/page]``.

    Slot s's page j is page ``s · (max_len / page) + j`` of the cache reshaped to
    ``[S · max_len / page, page, KVH, Dh]`` (a free reshape of one layer's ``[S, max_len, ...]``).
    """
    if max_len % page_size:
        raise ValueError(f"max_len {max_len} must be a multiple of page_size {page_size}")
    per = max_len // page_size
    return (jnp.arange(num_slots, dtype=jnp.int32)[:, None] * per
            + jnp.arange(per, dtype=jnp.int32)[None, :])
