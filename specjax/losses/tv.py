"""TV distance with Bebop's closed-form gradient (eq. 11), chunked over rows.

The forward and the hand-written backward walk over the positions in row chunks (``fori_loop``),
so apart from the returned gradient no ``[tokens, V]`` buffer is allocated; see the memory
paragraph of ``specjax.losses`` and ``docs/LOSSES.md``.
"""
from __future__ import annotations

import functools
import math
from typing import Optional

import jax
import jax.numpy as jnp

from specjax.losses._common import (ArrayLike, _check_float, _check_same_shape, _compute_dtype,
                                    _masked, _position_mask, _vocab_last)
from specjax.models import partitioning

# Row-chunk size for the TV loss, in elements of one [rows, V] block: 2**23 f32 = 32 MiB, i.e. 55
# rows of a 151,936-token vocabulary. Big enough that each loop step is a long, bandwidth-bound
# pass; small enough that a few such blocks are negligible next to one [tokens, V] buffer.
DEFAULT_CHUNK_ELEMENTS = 2**23


def _rows_per_chunk(n_rows: int, vocab: int, chunk_size: Optional[int], shards: int = 1) -> int:
    """Rows handled per loop step: a divisor of ``n_rows`` (so no padding copy is ever made).

    ``shards``: how many ways the rows are split over devices (the mesh's batch axes). The
    default chunk is then ``shards`` times the per-device budget and a multiple of ``shards``
    where ``n_rows`` allows: the loop's outer row factor (the chunk) carries the data-parallel
    sharding, and a chunk with fewer rows than shards cannot be split, so XLA replicated part of
    the ``[rows, V]`` logits on every device (per-chip memory grew with the chips: 4.0 GiB of
    temporaries for Qwen3-0.6B + MTP at one row per chip on 8 TPU chips, 15.1 GiB on 128).
    """
    shards = max(int(shards), 1)
    if n_rows % shards:
        shards = 1  # rows the mesh cannot split evenly: the partitioner decides, as without one
    if chunk_size is None:
        target = shards * max(1, DEFAULT_CHUNK_ELEMENTS // max(vocab, 1))
    elif chunk_size <= 0:
        target = n_rows  # chunking off: one fused pass
    else:
        target = chunk_size
    if target >= n_rows:
        return max(n_rows, 1)
    # Largest divisor of n_rows not above the target, a multiple of the shards if one exists.
    # Token counts are normally highly composite; a prime count degrades to one row per step,
    # which is slow but still correct and small.
    if shards > 1:
        for k in range(target - target % shards, 0, -shards):
            if n_rows % k == 0:
                return k
    for k in range(target, 0, -1):
        if n_rows % k == 0:
            return k
    return 1


def _tv_block(z: jax.Array, p: jax.Array, labels: jax.Array, with_ce: bool):
    """tv, log-partition, S and (optionally) CE for a block of rows ``[r, V]`` (in f32 or wider)."""
    dt = _compute_dtype(z, p)
    z = z.astype(dt)
    p = p.astype(dt)
    lse = jax.nn.logsumexp(z, axis=-1)
    # A row of all -inf logits (only meaningful at masked positions) would give q = NaN.
    lse = jnp.where(jnp.isfinite(lse), lse, 0.0)
    q = jnp.exp(z - lse[..., None])
    # Σ (q − p)_+ equals 1 − Σ min(p, q) because Σ q = 1, whatever Σ p is, and it has no
    # catastrophic cancellation when q ≈ p (1 − Σ min would subtract two numbers near 1).
    tv = jnp.sum(jnp.maximum(q - p, 0.0), axis=-1)
    s = jnp.sum(jnp.where(q <= p, q, 0.0), axis=-1)
    if with_ce:
        ce = lse - jnp.take_along_axis(z, labels[..., None], axis=-1)[..., 0]
    else:
        ce = jnp.zeros_like(tv)
    return tv, lse, s, ce


def _tv_grad_block(z, p, lse, s, g_tv, labels, g_ce, with_ce: bool):
    """Bebop eq. 11 times the cotangent, ``−g·q_j([q_j ≤ p_j] − S)``, plus (optionally) the CE
    gradient ``g_ce·(q − onehot(label))``, for a block of rows — one fused elementwise pass."""
    dt = _compute_dtype(z, p)
    q = jnp.exp(z.astype(dt) - lse[..., None])
    ind = (q <= p.astype(dt)).astype(dt)
    grad = g_tv[..., None] * q * (s[..., None] - ind)
    if with_ce:
        onehot = jax.lax.broadcasted_iota(jnp.int32, q.shape, q.ndim - 1) == labels[..., None]
        grad = grad + g_ce[..., None] * (q - onehot.astype(dt))
    return grad.astype(z.dtype)


def _tv_forward(z2, p2, mask, labels, rows, with_ce):
    """Chunked forward on ``[T, V]``; returns tv, lse, S, ce (each ``[T]``)."""
    n, v = z2.shape
    if rows >= n:
        tv, lse, s, ce = _tv_block(z2, p2, labels, with_ce)
    else:
        # Row t = c·m + j: step j handles rows {c·m + j}. The loop slices the *inner* axis, so a
        # data-parallel sharding of the token axis (it lands on the outer factor c) and a tensor-
        # parallel sharding of the vocabulary stay local: no all-gather (tests/test_losses.py).
        m = n // rows
        z3, p3, l2 = z2.reshape(rows, m, v), p2.reshape(rows, m, v), labels.reshape(rows, m)
        dt = _compute_dtype(z2, p2)

        def body(j, carry):
            take = functools.partial(jax.lax.dynamic_index_in_dim, index=j, axis=1, keepdims=False)
            outs = _tv_block(take(z3), take(p3), take(l2), with_ce)
            return tuple(jax.lax.dynamic_update_index_in_dim(c, o, j, axis=1)
                         for c, o in zip(carry, outs))

        # zeros_like of a (dead, compiled away) reduction rather than zeros: the carries then
        # inherit the operands' row sharding, which explicit-sharding meshes require for
        # dynamic_update_slice (and which slicing a vocab-sharded axis would not give).
        init = tuple(jnp.zeros_like(jnp.max(z3, axis=-1), dtype=dt) for _ in range(4))
        tv, lse, s, ce = (x.reshape(n) for x in jax.lax.fori_loop(0, m, body, init))
    return jnp.where(mask, tv, 0.0), lse, s, jnp.where(mask, ce, 0.0)


def _tv_backward(z2, p2, mask, labels, lse, s, g_tv, g_ce, rows, with_ce):
    n, v = z2.shape
    g_tv = jnp.where(mask, g_tv, 0.0)
    g_ce = jnp.where(mask, g_ce, 0.0)
    if rows >= n:
        out = _tv_grad_block(z2, p2, lse, s, g_tv, labels, g_ce, with_ce)
    else:
        m = n // rows
        z3, p3 = z2.reshape(rows, m, v), p2.reshape(rows, m, v)
        small = [x.reshape(rows, m) for x in (lse, s, g_tv, labels, g_ce)]

        def body(j, acc):
            take = functools.partial(jax.lax.dynamic_index_in_dim, index=j, axis=1, keepdims=False)
            lse_j, s_j, gtv_j, lab_j, gce_j = (take(x) for x in small)
            blk = _tv_grad_block(take(z3), take(p3), lse_j, s_j, gtv_j, lab_j, gce_j, with_ce)
            return jax.lax.dynamic_update_index_in_dim(acc, blk, j, axis=1)

        out = jax.lax.fori_loop(0, m, body, jnp.zeros_like(z3)).reshape(n, v)
    # Masked rows: exactly zero even if their logits were all -inf (q there is computed as 0, but
    # be explicit rather than rely on it).
    return jnp.where(mask[:, None], out, jnp.zeros((), out.dtype))


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _tv_rows(z2, p2, mask, labels, rows, with_ce):
    tv, _, _, ce = _tv_forward(z2, p2, mask, labels, rows, with_ce)
    return tv, ce


def _tv_rows_fwd(z2, p2, mask, labels, rows, with_ce):
    tv, lse, s, ce = _tv_forward(z2, p2, mask, labels, rows, with_ce)
    # Residuals: the inputs (alive anyway) and two scalars per row; q is recomputed in backward.
    return (tv, ce), (z2, p2, mask, labels, lse, s)


def _tv_rows_bwd(rows, with_ce, res, cotangents):
    z2, p2, mask, labels, lse, s = res
    g_tv, g_ce = cotangents
    grad = _tv_backward(z2, p2, mask, labels, lse, s, g_tv, g_ce, rows, with_ce)
    return grad, None, None, None


_tv_rows.defvjp(_tv_rows_fwd, _tv_rows_bwd)


def _tv_and_ce(z, p, labels, mask, chunk_size, with_ce):
    """Shared entry: ``z``, ``p`` ``[..., V]`` (vocab last), ``labels`` / ``mask`` ``[...]`` or
    None. Returns per-position (tv, ce) (ce is zeros unless ``with_ce``)."""
    _check_same_shape(z, p, "draft_logits", "target_probs")
    if z.ndim == 0 or z.shape[-1] == 0:
        raise ValueError(f"draft_logits needs a non-empty vocabulary axis, got shape {z.shape}")
    batch = z.shape[:-1]
    mask = jnp.ones(batch, jnp.bool_) if mask is None else mask
    n, v = math.prod(batch), z.shape[-1]
    labels = jnp.zeros(batch, jnp.int32) if labels is None else jnp.clip(labels, 0, v - 1)
    rows = _rows_per_chunk(n, v, chunk_size, partitioning.batch_axes()[1])
    # Reshaping the leading axes to one row axis is free (a bitcast) for row-major arrays.
    tv, ce = _tv_rows(z.reshape(n, v), p.reshape(n, v), mask.reshape(n),
                      labels.astype(jnp.int32).reshape(n), rows, with_ce)
    return tv.reshape(batch), ce.reshape(batch)


def tv_loss(
    draft_logits: jax.Array,
    target_probs: jax.Array,
    *,
    axis: int = -1,
    where: Optional[ArrayLike] = None,
    chunk_size: Optional[int] = None,
) -> jax.Array:
    r"""Total-variation loss ``tv = 1 − Σ_v min(p_v, q_v)``, ``q = softmax(draft_logits)``.

    ``1 − tv`` is the rejection-sampling acceptance probability of a draft token sampled from ``q``
    and verified against ``p``. The value is computed as ``Σ_v max(q_v − p_v, 0)``, which equals
    ``1 − Σ min(p, q)`` exactly since ``Σ q = 1`` (also when ``p`` is not normalised) and does not
    lose precision when ``q ≈ p``.

    Gradient (``jax.custom_vjp``, Bebop eq. 11):
    ``∂tv/∂z_j = −q_j([q_j ≤ p_j] − S)``, ``S = Σ_v [q_v ≤ p_v] q_v``; no gradient reaches
    ``target_probs``. At an exact tie ``q_j = p_j`` this takes the ``q ≤ p`` side, as Bebop does;
    autodiff of ``jnp.minimum`` would split the tie ½–½ (ties have measure zero for real logits).
    The gradient is bounded, ``|∂tv/∂z_j| ≤ q_j ≤ 1`` (Bebop Prop. 3).

    Memory: the backward recomputes ``q`` from the saved log-partition, so residuals are the two
    inputs plus two floats per position; both passes loop over chunks of rows, so apart from the
    returned gradient no ``[tokens, V]`` temporary is allocated (see ``docs/LOSSES.md``).

    Args:
      draft_logits: ``[..., V]`` float (bf16 is computed in f32; the gradient has the logits'
        dtype).
      target_probs: ``[..., V]`` float probabilities (zeros allowed), detached inside.
      axis: the vocabulary axis (default last).
      where: optional bool broadcastable to ``[...]``; False positions give 0 and 0 gradient.
      chunk_size: rows (positions) per loop step. ``None`` (default): about
        ``DEFAULT_CHUNK_ELEMENTS / V`` rows, rounded down to a divisor of the number of positions;
        ``0``: no chunking (one fused pass, leaving memory to the compiler).

    Returns:
      ``[...]`` float32 (float64 under x64 with f64 inputs) TV distances in ``[0, 1]``.

    References: Bebop §4.1 eq. 10–11 and App. F (Algorithms 1–2).
    """
    _check_float("draft_logits", draft_logits)
    _check_float("target_probs", target_probs)
    z = _vocab_last(jnp.asarray(draft_logits), axis)
    p = _vocab_last(jax.lax.stop_gradient(jnp.asarray(target_probs)), axis)
    mask = _position_mask(where, z.shape[:-1])
    return _tv_and_ce(z, p, None, mask, chunk_size, with_ce=False)[0]


def tv_loss_autodiff(
    draft_logits: jax.Array,
    target_probs: jax.Array,
    *,
    where: Optional[ArrayLike] = None,
) -> jax.Array:
    """Reference TV: ``1 − Σ min(p, softmax(z))`` differentiated by plain autodiff.

    Kept for tests and ``benchmarks/loss_memory.py``; train with :func:`tv_loss`, which has the
    same value and (away from exact ties ``q = p``) the same gradient, with less memory.
    Shapes as :func:`tv_loss` (vocabulary last).
    """
    z = jnp.asarray(draft_logits)
    p = jax.lax.stop_gradient(jnp.asarray(target_probs))
    _check_same_shape(z, p, "draft_logits", "target_probs")
    dt = _compute_dtype(z, p)
    q = jax.nn.softmax(z.astype(dt), axis=-1)
    tv = 1.0 - jnp.sum(jnp.minimum(p.astype(dt), q), axis=-1)
    return _masked(tv, _position_mask(where, z.shape[:-1]))
