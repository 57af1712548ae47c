"""The verifiers of :mod:`specjax.verify` over rows packed into 1-D (the flattened ragged layout).

``R`` rows packed densely: the drafts of row ``r`` are flat entries ``draft_offsets[r] .. +
num_draft[r]`` of ``draft_tokens [N]``, ``draft_probs [N, V]`` and ``uniforms [N]``; its
``num_draft[r] + 1`` target distributions are rows ``target_offsets[r] .. + num_draft[r] + 1`` of
``target_probs [M, V]`` (e.g. the logits of a flat verification batch, where row ``r``'s tokens
``[anchor, x_1..x_l]`` sit at ``target_offsets[r]``). Each function returns the same
:class:`~specjax.verify_types.VerifyOutput` as its padded counterpart in :mod:`specjax.verify` for
the same random inputs: both gather their rows and run the same core.
"""
from __future__ import annotations

import functools
from typing import Tuple

import jax
import jax.numpy as jnp

from specjax.verify import _greedy_core, _num_draft, _rs_core, verify_noise
from specjax.verify_types import VerifyOutput

__all__ = [
    "rejection_sample_flat",
    "rejection_sample_flat_with_noise",
    "target_only_sample_flat_with_noise",
    "greedy_verify_flat",
    "flat_offsets",
    "flat_segment_ids",
    "pack_flat",
]


@jax.jit
def flat_offsets(num_draft: jax.Array) -> Tuple[jax.Array, jax.Array]:
    """Dense packing of ``R`` rows: ``(draft_offsets [R], target_offsets [R])``.

    Row ``r``'s ``num_draft[r]`` drafts start at the exclusive cumsum of ``num_draft``; its
    ``num_draft[r] + 1`` target distributions at the exclusive cumsum of ``num_draft + 1``.
    """
    nd = jnp.asarray(num_draft, jnp.int32)
    d_off = jnp.cumsum(nd) - nd
    t_off = jnp.cumsum(nd + 1) - (nd + 1)
    return d_off.astype(jnp.int32), t_off.astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("size",))
def flat_segment_ids(offsets: jax.Array, lengths: jax.Array, size: int) -> Tuple[jax.Array, jax.Array]:
    """``(segment_ids [size], positions [size])`` of a packed 1-D batch; padding gets ``-1, -1``.

    Entry ``offsets[r] + j`` (``j < lengths[r]``) has segment ``r`` and position ``j``. The verifier
    does not need these (offsets and lengths say the same); they are what attention masks use.
    """
    offsets = jnp.asarray(offsets, jnp.int32)
    lengths = jnp.asarray(lengths, jnp.int32)
    i = jnp.arange(size, dtype=jnp.int32)[:, None]
    inside = (i >= offsets[None, :]) & (i < offsets[None, :] + lengths[None, :])  # [size, R]
    seg = jnp.where(jnp.any(inside, axis=1), jnp.argmax(inside, axis=1), -1).astype(jnp.int32)
    pos = jnp.where(seg >= 0, i[:, 0] - offsets[jnp.maximum(seg, 0)], -1).astype(jnp.int32)
    return seg, pos


def _flat_indices(draft_offsets, target_offsets, num_draft, k, n_draft_rows, n_target_rows):
    nd = num_draft[:, None]
    j = jnp.arange(k + 1, dtype=jnp.int32)[None, :]
    t_idx = jnp.clip(target_offsets[:, None] + jnp.minimum(j, nd), 0, max(n_target_rows - 1, 0))
    d_idx = jnp.clip(
        draft_offsets[:, None] + jnp.minimum(j[:, :k], jnp.maximum(nd - 1, 0)), 0, max(n_draft_rows - 1, 0)
    )
    return d_idx.astype(jnp.int32), t_idx.astype(jnp.int32)


def _flat_prep(draft_tokens, target_probs, draft_offsets, target_offsets, num_draft, max_draft):
    if draft_tokens.ndim != 1 or target_probs.ndim != 2:
        raise ValueError(
            f"flat form wants draft_tokens [N] and target_probs [M, V], got {draft_tokens.shape}, {target_probs.shape}"
        )
    rows = jnp.asarray(num_draft).shape[0]
    nd = jnp.clip(jnp.asarray(num_draft, jnp.int32), 0, max_draft)
    n_flat = draft_tokens.shape[0]
    d_idx, t_idx = _flat_indices(
        jnp.asarray(draft_offsets, jnp.int32),
        jnp.asarray(target_offsets, jnp.int32),
        nd,
        max_draft,
        n_flat,
        target_probs.shape[0],
    )
    if n_flat == 0:  # no draft storage at all: every row must have num_draft 0
        tokens = jnp.zeros((rows, max_draft), jnp.int32)
    else:
        tokens = draft_tokens.astype(jnp.int32)[d_idx]
    return rows, nd, d_idx, t_idx, tokens


@functools.partial(jax.jit, static_argnames=("max_draft",))
def rejection_sample_flat_with_noise(
    draft_tokens: jax.Array,
    draft_probs: jax.Array,
    target_probs: jax.Array,
    draft_offsets: jax.Array,
    target_offsets: jax.Array,
    num_draft: jax.Array,
    uniforms: jax.Array,
    exponentials: jax.Array,
    *,
    max_draft: int,
) -> VerifyOutput:
    """Rejection sampling of ``R`` rows packed into 1-D (see the module docstring for the layout).

    Args:
      draft_tokens: int32 ``[N]``; draft_probs: ``[N, V]``; uniforms: float32 ``[N]`` -- row ``r``
        at ``draft_offsets[r] + j``, ``j < num_draft[r]``; other entries are ignored (padding).
      target_probs: ``[M, V]``, row ``r``'s ``p_j`` at ``target_offsets[r] + j``, ``j <= num_draft[r]``.
      draft_offsets, target_offsets, num_draft: int32 ``[R]``.
      exponentials: float32 ``[R, V]``.
      max_draft: static ``K >= max(num_draft)``; the output is ``tokens [R, K+1]``.

    Returns the :class:`VerifyOutput` that :func:`rejection_sample_with_noise` returns for the same
    rows padded to ``K`` with the same uniforms and exponentials.
    """
    rows, nd, d_idx, t_idx, tokens = _flat_prep(
        draft_tokens, target_probs, draft_offsets, target_offsets, num_draft, max_draft
    )
    vocab = target_probs.shape[-1]
    q_rows = draft_probs if draft_probs.shape[0] else jnp.zeros((1, vocab), target_probs.dtype)
    u = uniforms[d_idx] if uniforms.shape[0] else jnp.zeros((rows, max_draft), jnp.float32)
    return _rs_core(tokens, q_rows, target_probs, d_idx, t_idx, u, exponentials, nd, target_only=False)


@functools.partial(jax.jit, static_argnames=("max_draft",))
def rejection_sample_flat(
    key, draft_tokens, draft_probs, target_probs, draft_offsets, target_offsets, num_draft, *, max_draft: int
) -> VerifyOutput:
    """Keyed flat rejection sampling. With per-row keys ``[R]`` (or one key, split into ``R``) it
    returns exactly what :func:`rejection_sample` returns for the padded rows and the same keys."""
    rows = jnp.asarray(num_draft).shape[0]
    vocab = target_probs.shape[-1]
    u_pad, e = verify_noise(key, rows, max_draft, vocab)
    nd = jnp.clip(jnp.asarray(num_draft, jnp.int32), 0, max_draft)
    n_flat = draft_tokens.shape[0]
    j = jnp.arange(max_draft, dtype=jnp.int32)[None, :]
    dest = jnp.where(j < nd[:, None], jnp.asarray(draft_offsets, jnp.int32)[:, None] + j, n_flat)
    u_flat = jnp.zeros((n_flat,), jnp.float32).at[dest].set(u_pad, mode="drop")
    return rejection_sample_flat_with_noise(
        draft_tokens,
        draft_probs,
        target_probs,
        draft_offsets,
        target_offsets,
        num_draft,
        u_flat,
        e,
        max_draft=max_draft,
    )


@functools.partial(jax.jit, static_argnames=("max_draft",))
def target_only_sample_flat_with_noise(
    draft_tokens, target_probs, draft_offsets, target_offsets, num_draft, uniforms, exponentials, *, max_draft: int
) -> VerifyOutput:
    """Target-only sampling in the flat layout (shapes as :func:`rejection_sample_flat_with_noise`)."""
    rows, nd, d_idx, t_idx, tokens = _flat_prep(
        draft_tokens, target_probs, draft_offsets, target_offsets, num_draft, max_draft
    )
    u = uniforms[d_idx] if uniforms.shape[0] else jnp.zeros((rows, max_draft), jnp.float32)
    return _rs_core(tokens, None, target_probs, d_idx, t_idx, u, exponentials, nd, target_only=True)


@functools.partial(jax.jit, static_argnames=("max_draft",))
def greedy_verify_flat(
    draft_tokens, target_logits, draft_offsets, target_offsets, num_draft, *, max_draft: int
) -> VerifyOutput:
    """Greedy verification in the flat layout: ``draft_tokens [N]``, ``target_logits [M, V]``."""
    _, nd, _, t_idx, tokens = _flat_prep(
        draft_tokens, target_logits, draft_offsets, target_offsets, num_draft, max_draft
    )
    target_argmax = jnp.argmax(target_logits, axis=-1).astype(jnp.int32)[t_idx]  # [R, K+1]
    return _greedy_core(tokens, target_argmax, nd)


@functools.partial(jax.jit, static_argnames=("num_draft_slots", "num_target_slots"))
def pack_flat(draft_tokens, draft_probs, target_probs, uniforms, num_draft, *, num_draft_slots=None, num_target_slots=None):
    """Pack padded rows into the dense flat layout (a test / engine helper).

    Inputs are the padded-form arrays (``draft_probs`` may be ``None``); returns a dict with
    ``draft_tokens [N]``, ``draft_probs [N, V]`` (if given), ``target_probs [M, V]``, ``uniforms [N]``,
    ``draft_offsets [R]``, ``target_offsets [R]``, ``num_draft [R]``, where ``N`` / ``M`` default to
    ``B*K`` / ``B*(K+1)`` (bucket sizes; unused slots are zero / -1).
    """
    bsz, k = draft_tokens.shape
    nd = _num_draft(num_draft, bsz, k)
    d_off, t_off = flat_offsets(nd)
    n_slots = bsz * k if num_draft_slots is None else num_draft_slots
    m_slots = bsz * (k + 1) if num_target_slots is None else num_target_slots
    j = jnp.arange(k + 1, dtype=jnp.int32)[None, :]
    d_dest = jnp.where(j[:, :k] < nd[:, None], d_off[:, None] + j[:, :k], n_slots)
    t_dest = jnp.where(j <= nd[:, None], t_off[:, None] + j, m_slots)
    vocab = target_probs.shape[-1]
    out = dict(
        draft_tokens=jnp.full((n_slots,), -1, jnp.int32).at[d_dest].set(draft_tokens.astype(jnp.int32), mode="drop"),
        target_probs=jnp.zeros((m_slots, vocab), target_probs.dtype).at[t_dest].set(target_probs, mode="drop"),
        uniforms=jnp.zeros((n_slots,), jnp.float32).at[d_dest].set(uniforms.astype(jnp.float32), mode="drop"),
        draft_offsets=d_off,
        target_offsets=t_off,
        num_draft=nd,
    )
    if draft_probs is not None:
        out["draft_probs"] = jnp.zeros((n_slots, vocab), draft_probs.dtype).at[d_dest].set(draft_probs, mode="drop")
    return out
