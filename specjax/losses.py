"""Drafter training losses: CE, KL, reverse KL, TV, end-to-end TV and the DSpark objective.

All losses are *per position*: the last axis of the logits / probabilities is the vocabulary ``V``
and is reduced; every leading axis is kept (``[..., V] -> [...]``). The sequence-level losses
(:func:`e2e_tv_loss`, :func:`dspark_loss`) also reduce the draft-position axis ``γ`` just before the
vocabulary (``[..., γ, V] -> [...]``). Reductions over batch/tokens are left to the caller, as in
``optax.losses``.

The *target* side (``target_probs``) is always detached inside with :func:`jax.lax.stop_gradient`:
the target model is frozen while a drafter trains (docs/DESIGN.md, "Losses (the target side detached)").

``where`` (optional, boolean) masks *positions*, not vocabulary entries: it must broadcast to the
per-position output shape (``[...]`` for the elementwise losses, ``[..., γ]`` for the sequence
losses). A masked position contributes a loss of exactly 0 and a gradient of exactly 0. To exclude
vocabulary entries, give them ``target_probs == 0`` / ``draft_logits == -inf`` instead.

Notation (docs/DESIGN.md "The math"): target ``p``, draft ``q = softmax(z)`` from draft logits ``z``,
``TV(p, q) = ½ Σ|p − q| = 1 − Σ min(p, q)``; rejection-sampling acceptance ``α = 1 − TV``.

Memory. :func:`tv_loss` (and everything built on it) has a hand-written VJP that uses Bebop's
closed-form gradient (eq. 11), ``∂tv/∂z_j = −q_j([q_j ≤ p_j] − S)``, ``S = Σ_v [q_v ≤ p_v] q_v``.
Its residuals are the inputs plus two scalars per position (the log-partition and ``S``); ``q`` is
recomputed in the backward pass. Both passes walk over the positions in row chunks (a
``fori_loop``), so with a 151,936-token vocabulary the only buffer of size ``[tokens, V]`` the loss
itself allocates is the gradient it returns. ``benchmarks/loss_memory.py`` measures this against
plain autodiff; numbers are in ``docs/LOSSES.md``. CE / KL / reverse KL use ordinary autodiff.

References:
  * Bebop — Li, Jiang, et al. (Qwen Team), "Breaking Entropy Bounds: Accelerating RL Training via
    MTP with Rejection Sampling", arXiv 2606.12370, §4.1 eq. 10–11 (TV loss and its gradient),
    §4.2 eq. 13 (e2e TV), App. C eq. 17 (reverse KL), App. F (fused TV kernel).
  * DSpark — DeepSeek, §3.2.1 eq. 8 (confidence target ``c* = 1 − ½‖p_d − p_t‖₁``) and §3.3
    eq. 9–12 (``L = 0.1·L_ce + 0.9·L_tv + 1.0·L_conf``, position weights ``w_k = exp(−(k−1)/γ)``).
  * Leviathan, Kalman, Matias, "Fast Inference from Transformers via Speculative Decoding"
    (ICML 2023): acceptance rate ``Σ min(p, q) = 1 − TV``.
"""
from __future__ import annotations

import functools
import math
from typing import NamedTuple, Optional, Union

import jax
import jax.numpy as jnp
import numpy as np

from specjax.models import partitioning

ArrayLike = Union[jax.Array, np.ndarray, float]

__all__ = [
    "ce_loss",
    "kl_loss",
    "reverse_kl_loss",
    "tv_loss",
    "tv_loss_autodiff",
    "e2e_tv_loss",
    "e2e_tv_from_tv",
    "dspark_position_weights",
    "DSparkTerms",
    "dspark_loss_terms",
    "dspark_loss",
    "DEFAULT_CHUNK_ELEMENTS",
]

# Row-chunk size for the TV loss, in elements of one [rows, V] block: 2**23 f32 = 32 MiB, i.e. 55
# rows of a 151,936-token vocabulary. Big enough that each loop step is a long, bandwidth-bound
# pass; small enough that a few such blocks are negligible next to one [tokens, V] buffer.
DEFAULT_CHUNK_ELEMENTS = 2**23

# Reverse-KL floor for log p: the log of the smallest normal float32 (≈ −87.34). A token the
# target gives exactly zero probability (top-k / top-p masks) is treated as if p were that small,
# so KL(q‖p) stays finite and its gradient pushes q's mass there down hard instead of being NaN/inf.
DEFAULT_LOG_P_FLOOR = float(np.log(np.finfo(np.float32).tiny))


# ----------------------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------------------
def _check_float(name: str, x: jax.Array) -> None:
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"{name} must be a floating-point array, got dtype {x.dtype}")


def _compute_dtype(*xs: jax.Array):
    """float32 at least: bf16 logits / probs are upcast inside the (fused) computation."""
    return jnp.result_type(jnp.float32, *[x.dtype for x in xs])


def _check_same_shape(a: jax.Array, b: jax.Array, an: str, bn: str) -> None:
    if a.shape != b.shape:
        raise ValueError(f"{an} {a.shape} and {bn} {b.shape} must have the same shape")


def _position_mask(where: Optional[ArrayLike], shape: tuple,
                   name: str = "where") -> Optional[jax.Array]:
    """``where`` broadcast to the per-position shape (bool), or None."""
    if where is None:
        return None
    w = jnp.asarray(where)
    if w.dtype != jnp.bool_:
        raise TypeError(f"{name} must be a boolean array, got dtype {w.dtype}")
    try:
        return jnp.broadcast_to(w, shape)
    except ValueError:
        raise ValueError(
            f"{name} of shape {w.shape} does not broadcast to the per-position shape {shape} "
            "(it masks positions, not vocabulary entries)"
        ) from None


def _masked(loss: jax.Array, mask: Optional[jax.Array]) -> jax.Array:
    return loss if mask is None else jnp.where(mask, loss, jnp.zeros((), loss.dtype))


def _vocab_last(x: jax.Array, axis: int) -> jax.Array:
    axis = axis % x.ndim if x.ndim else 0
    return x if axis == x.ndim - 1 else jnp.moveaxis(x, axis, -1)


# ----------------------------------------------------------------------------------------------
# CE / KL / reverse KL (plain autodiff)
# ----------------------------------------------------------------------------------------------
def ce_loss(
    draft_logits: jax.Array,
    labels: jax.Array,
    *,
    axis: int = -1,
    where: Optional[ArrayLike] = None,
) -> jax.Array:
    r"""Cross-entropy with hard labels, ``−log q(x*)`` with ``q = softmax(draft_logits)``.

    Args:
      draft_logits: ``[..., V]`` float (any float dtype; computed in at least float32).
      labels: ``[...]`` integer token ids in ``[0, V)``. Ids outside that range (e.g. ``-1``
        padding) are only allowed at positions masked out by ``where``.
      axis: the vocabulary axis of ``draft_logits`` (default last).
      where: optional bool, broadcastable to ``[...]``; False positions give 0 loss and 0 gradient.

    Returns:
      ``[...]`` float32 losses, ``logsumexp(z) − z[x*]``.

    References: DSpark eq. 9; Bebop footnote 4 (CE = forward KL + H(p), same gradient).
    """
    _check_float("draft_logits", draft_logits)
    z = _vocab_last(jnp.asarray(draft_logits), axis)
    labels = jnp.asarray(labels)
    if not jnp.issubdtype(labels.dtype, jnp.integer):
        raise TypeError(f"labels must be integer token ids, got dtype {labels.dtype}")
    if labels.shape != z.shape[:-1]:
        raise ValueError(f"labels {labels.shape} must have the draft_logits shape without the "
                         f"vocabulary axis, {z.shape[:-1]}")
    mask = _position_mask(where, labels.shape)
    z = z.astype(_compute_dtype(z))
    # Clip so that padding ids index safely; their loss is then removed by `where`.
    safe = jnp.clip(labels, 0, z.shape[-1] - 1)
    picked = jnp.take_along_axis(z, safe[..., None], axis=-1)[..., 0]
    return _masked(jax.nn.logsumexp(z, axis=-1) - picked, mask)


def kl_loss(
    draft_logits: jax.Array,
    target_probs: jax.Array,
    *,
    axis: int = -1,
    where: Optional[ArrayLike] = None,
) -> jax.Array:
    r"""Forward KL, ``KL(p‖q) = Σ_v p_v (log p_v − log q_v)``, ``q = softmax(draft_logits)``.

    Terms with ``p_v = 0`` are exactly 0 (the ``0·log 0 = 0`` convention), so top-k / top-p-masked
    targets are fine. ``p_v > 0`` where ``q_v = 0`` (a ``-inf`` draft logit) gives ``+inf``: that is
    the true value. ``p`` is not renormalised.

    Args:
      draft_logits: ``[..., V]`` float.
      target_probs: ``[..., V]`` float, detached inside.
      axis: the vocabulary axis (default last).
      where: optional bool, broadcastable to ``[...]``.

    Returns:
      ``[...]`` float32. Gradient w.r.t. the logits: ``q·Σp − p`` (``= q − p`` for normalised p).

    References: Bebop §4.1 and Table 1 (gradient ``q_j − p_j``).
    """
    _check_float("draft_logits", draft_logits)
    _check_float("target_probs", target_probs)
    z = _vocab_last(jnp.asarray(draft_logits), axis)
    p = _vocab_last(jax.lax.stop_gradient(jnp.asarray(target_probs)), axis)
    _check_same_shape(z, p, "draft_logits", "target_probs")
    mask = _position_mask(where, z.shape[:-1])
    dt = _compute_dtype(z, p)
    log_q = jax.nn.log_softmax(z.astype(dt), axis=-1)
    p = p.astype(dt)
    pos = p > 0
    # Double `where`: log(1) in the untaken branch keeps its forward and backward finite.
    log_p = jnp.log(jnp.where(pos, p, 1.0))
    terms = jnp.where(pos, p * (log_p - log_q), 0.0)
    return _masked(jnp.sum(terms, axis=-1), mask)


def reverse_kl_loss(
    draft_logits: jax.Array,
    target_probs: jax.Array,
    *,
    axis: int = -1,
    where: Optional[ArrayLike] = None,
    log_p_floor: float = DEFAULT_LOG_P_FLOOR,
) -> jax.Array:
    r"""Reverse KL, ``KL(q‖p) = Σ_v q_v (log q_v − log p_v)``, ``q = softmax(draft_logits)``.

    Zero target probabilities. ``p`` built with top-k / top-p masks is exactly 0 on many tokens
    where ``q > 0``, and then ``KL(q‖p) = +inf``. Here ``log p`` is clamped from below,
    ``log p ← max(log p, log_p_floor)``; the default floor is ``log(float32 tiny) ≈ −87.34``, i.e.
    a zero is treated as the smallest normal float32. The loss stays finite, its gradient
    ``q_j(log q_j − log p_j − KL)`` (Bebop eq. 17) drives ``q`` off the forbidden tokens strongly,
    and nothing is NaN. Tokens with ``q_v = 0`` contribute 0 (``0·log 0 = 0``).

    Args:
      draft_logits: ``[..., V]`` float.
      target_probs: ``[..., V]`` float, detached inside.
      axis: the vocabulary axis (default last).
      where: optional bool, broadcastable to ``[...]``.
      log_p_floor: lower clamp for ``log p`` (a float; must be finite).

    Returns:
      ``[...]`` float32.

    References: Bebop App. C, eq. 17.
    """
    _check_float("draft_logits", draft_logits)
    _check_float("target_probs", target_probs)
    if not math.isfinite(log_p_floor):
        raise ValueError(f"log_p_floor must be finite, got {log_p_floor}")
    z = _vocab_last(jnp.asarray(draft_logits), axis)
    p = _vocab_last(jax.lax.stop_gradient(jnp.asarray(target_probs)), axis)
    _check_same_shape(z, p, "draft_logits", "target_probs")
    mask = _position_mask(where, z.shape[:-1])
    dt = _compute_dtype(z, p)
    log_q = jax.nn.log_softmax(z.astype(dt), axis=-1)
    q = jnp.exp(log_q)
    log_p = jnp.maximum(jnp.log(p.astype(dt)), log_p_floor)  # log 0 = -inf -> floor, no NaN
    nz = q > 0
    log_q_safe = jnp.where(nz, log_q, 0.0)  # -inf logits: keep the untaken branch finite
    terms = jnp.where(nz, q * (log_q_safe - log_p), 0.0)
    return _masked(jnp.sum(terms, axis=-1), mask)


# ----------------------------------------------------------------------------------------------
# TV with Bebop's closed-form gradient, chunked over rows
# ----------------------------------------------------------------------------------------------
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


# ----------------------------------------------------------------------------------------------
# end-to-end TV
# ----------------------------------------------------------------------------------------------
def e2e_tv_from_tv(tv: jax.Array, *, where: Optional[ArrayLike] = None) -> jax.Array:
    r"""End-to-end TV from per-position TV distances: ``1 − (1/γ) Σ_j Π_{i≤j} (1 − tv_i)``.

    ``Σ_j Π_{i≤j} α_i`` is the expected number of accepted drafts of a γ-chain under rejection
    sampling (Bebop eq. 12), so this is ``1 −`` the normalised expected acceptance length.

    With ``where`` (bool, broadcastable to ``[..., γ]``): a masked position i is skipped, i.e. it
    neither adds a term ``j = i`` nor a factor (``α_i := 1``), and the sum is divided by the number
    of unmasked positions instead of γ. For the usual *prefix* mask (the first n positions valid)
    this is exactly the e2e loss of the shorter n-chain. A row with no valid position gives 0.

    Args:
      tv: ``[..., γ]`` per-position TV distances (differentiable).
      where: optional bool mask, broadcastable to ``[..., γ]``.

    Returns:
      ``[...]``; the gradient flows through every factor of every prefix product.
    """
    tv = jnp.asarray(tv)
    if tv.ndim < 1:
        raise ValueError(f"tv must have a draft-position axis, got shape {tv.shape}")
    mask = _position_mask(where, tv.shape)
    alpha = 1.0 - tv
    if mask is not None:
        alpha = jnp.where(mask, alpha, 1.0)
    # cumprod differentiates through an associative scan of products (no division), so an α = 0
    # factor gives correct, finite gradients.
    survive = jnp.cumprod(alpha, axis=-1)
    if mask is None:
        return 1.0 - jnp.mean(survive, axis=-1)
    count = jnp.sum(mask, axis=-1)
    total = jnp.sum(jnp.where(mask, survive, 0.0), axis=-1)
    return jnp.where(count > 0, 1.0 - total / jnp.maximum(count, 1), 0.0)


def e2e_tv_loss(
    draft_logits: jax.Array,
    target_probs: jax.Array,
    *,
    where: Optional[ArrayLike] = None,
    chunk_size: Optional[int] = None,
) -> jax.Array:
    r"""End-to-end TV loss (Bebop eq. 13): ``1 − (1/γ) Σ_{j=1..γ} Π_{i≤j} (1 − tv_i)``.

    Args:
      draft_logits: ``[..., γ, V]`` draft logits of the γ chained draft positions.
      target_probs: ``[..., γ, V]`` target probabilities, detached inside.
      where: optional bool broadcastable to ``[..., γ]`` (see :func:`e2e_tv_from_tv` for how masked
        positions enter the product and the normalisation).
      chunk_size: passed to :func:`tv_loss`.

    Returns:
      ``[...]``. The gradient flows through the whole prefix product into every position's logits:
      ``∂L/∂tv_i = (1/γ) Σ_{j≥i} Π_{l≤j, l≠i} α_l``, then Bebop eq. 11 per position, so memory is
      that of :func:`tv_loss`.

    References: Bebop §4.2 eq. 12–13.
    """
    z = jnp.asarray(draft_logits)
    if z.ndim < 2:
        raise ValueError(f"draft_logits must be [..., γ, V], got shape {z.shape}")
    mask = _position_mask(where, z.shape[:-1])
    tv = tv_loss(z, target_probs, where=mask, chunk_size=chunk_size)
    return e2e_tv_from_tv(tv, where=mask)


# ----------------------------------------------------------------------------------------------
# DSpark
# ----------------------------------------------------------------------------------------------
def dspark_position_weights(gamma: int, dtype=jnp.float32) -> jax.Array:
    """DSpark position weights ``w_k = exp(−(k−1)/γ)`` for ``k = 1..γ`` (DSpark §3.3)."""
    if gamma < 1:
        raise ValueError(f"gamma must be >= 1, got {gamma}")
    return jnp.exp(-jnp.arange(gamma, dtype=dtype) / gamma)


class DSparkTerms(NamedTuple):
    """Unweighted per-position terms of the DSpark objective, each ``[..., γ]``."""

    ce: jax.Array    # −log q_k(x*_k)
    l1: jax.Array    # ‖q_k − p_k‖₁ = 2·tv_k (exact for normalised p)
    conf: jax.Array  # bce(σ(conf_k), stop_grad(1 − tv_k))
    tv: jax.Array    # tv_k; 1 − tv_k is the confidence target c*_k (DSpark eq. 8)


def _sigmoid_bce(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """``−t log σ(x) − (1 − t) log σ(−x)``, stable for large |x| (log-sigmoid form)."""
    return -(targets * jax.nn.log_sigmoid(logits) + (1.0 - targets) * jax.nn.log_sigmoid(-logits))


def dspark_loss_terms(
    draft_logits: jax.Array,
    target_probs: jax.Array,
    labels: jax.Array,
    confidence_logits: jax.Array,
    *,
    where: Optional[ArrayLike] = None,
    chunk_size: Optional[int] = None,
) -> DSparkTerms:
    r"""The three DSpark per-position terms, unweighted; see :func:`dspark_loss`.

    ``ce`` and ``tv`` come from one chunked custom-VJP pass (the TV kernel of :func:`tv_loss` also
    produces ``logsumexp(z) − z[x*]``), so their summed gradient is written once, with no extra
    logits-sized buffer. ``l1 = 2·tv`` (equal to ``Σ|q − p|`` when ``Σ p = 1``). The confidence
    target ``1 − tv`` is detached: the confidence loss trains only the confidence head, never the
    draft distribution. Masked positions (``where`` False) have all terms 0; their labels may be
    padding ids (they are clipped into range before indexing).

    Args: as :func:`dspark_loss`. Returns: :class:`DSparkTerms`, each ``[..., γ]`` float32.
    """
    z = jnp.asarray(draft_logits)
    if z.ndim < 2:
        raise ValueError(f"draft_logits must be [..., γ, V], got shape {z.shape}")
    _check_float("draft_logits", z)
    p = jax.lax.stop_gradient(jnp.asarray(target_probs))
    _check_float("target_probs", p)
    c = jnp.asarray(confidence_logits)
    _check_float("confidence_logits", c)
    if c.shape != z.shape[:-1]:
        raise ValueError(f"confidence_logits {c.shape} must be [..., γ] = {z.shape[:-1]}")
    labels = jnp.asarray(labels)
    if not jnp.issubdtype(labels.dtype, jnp.integer):
        raise TypeError(f"labels must be integer token ids, got dtype {labels.dtype}")
    if labels.shape != z.shape[:-1]:
        raise ValueError(f"labels {labels.shape} must be [..., γ] = {z.shape[:-1]}")
    mask = _position_mask(where, z.shape[:-1])
    # One chunked custom-VJP pass gives both tv and ce and one fused gradient; computed
    # separately, the CE and TV gradients would be two logits-sized buffers that are then summed.
    tv, ce = _tv_and_ce(z, p, labels, mask, chunk_size, with_ce=True)
    target = jax.lax.stop_gradient(1.0 - tv)
    conf = _masked(_sigmoid_bce(c.astype(_compute_dtype(c)), target), mask)
    return DSparkTerms(ce=ce, l1=2.0 * tv, conf=conf, tv=tv)


def dspark_loss(
    draft_logits: jax.Array,
    target_probs: jax.Array,
    labels: jax.Array,
    confidence_logits: jax.Array,
    *,
    weights: Optional[ArrayLike] = None,
    ce_coef: float = 0.1,
    l1_coef: float = 0.9,
    conf_coef: float = 1.0,
    where: Optional[ArrayLike] = None,
    chunk_size: Optional[int] = None,
) -> jax.Array:
    r"""DSpark drafter objective for γ-token blocks (DSpark §3.3 eq. 9–12).

    ``L = Σ_k w_k [ce_coef·(−log q_k(x*_k)) + l1_coef·‖q_k − p_k‖₁
    + conf_coef·bce(σ(conf_k), stop_grad(1 − tv_k))]``, with ``w_k = exp(−(k−1)/γ)`` by default.
    As in the paper the positions are *summed*, not averaged; the defaults are the paper's
    ``α_ce = 0.1, α_tv = 0.9, α_conf = 1.0``. The paper writes ``L_tv`` as the L1 norm, i.e.
    ``2·tv``, and that is what ``l1_coef`` multiplies here. The BCE target ``c*_k = 1 − tv_k`` is
    the analytic acceptance rate of position k given its prefix was accepted (eq. 8).

    Args:
      draft_logits: ``[..., γ, V]``.
      target_probs: ``[..., γ, V]``, detached inside.
      labels: ``[..., γ]`` integer ground-truth tokens ``x*_k``.
      confidence_logits: ``[..., γ]`` pre-sigmoid confidence-head outputs.
      weights: ``[γ]`` (or broadcastable to ``[..., γ]``) position weights; default
        :func:`dspark_position_weights`.
      ce_coef, l1_coef, conf_coef: term coefficients.
      where: optional bool broadcastable to ``[..., γ]``; masked positions contribute nothing
        (labels there may be padding ids).
      chunk_size: passed to :func:`tv_loss`.

    Returns:
      ``[...]`` float32 (one loss per block). Use :func:`dspark_loss_terms` for the parts.
    """
    z = jnp.asarray(draft_logits)
    if z.ndim < 2:
        raise ValueError(f"draft_logits must be [..., γ, V], got shape {z.shape}")
    gamma = z.shape[-2]
    w = dspark_position_weights(gamma) if weights is None else jnp.asarray(weights, jnp.float32)
    try:
        w = jnp.broadcast_to(w, z.shape[:-1])
    except ValueError:
        raise ValueError(f"weights of shape {w.shape} do not broadcast to [..., γ] = "
                         f"{z.shape[:-1]}") from None
    mask = _position_mask(where, z.shape[:-1])
    t = dspark_loss_terms(z, target_probs, labels, confidence_logits, where=mask,
                          chunk_size=chunk_size)
    per_pos = ce_coef * t.ce + l1_coef * t.l1 + conf_coef * t.conf
    return jnp.sum(_masked(w * per_pos, mask), axis=-1)
