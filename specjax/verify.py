"""Exact verification of draft tokens: rejection sampling, target-only sampling and greedy.

Notation (docs/DESIGN.md, "The math"): ``p_k`` target distribution and ``q_k`` draft distribution at draft
position ``k`` (0-based here, ``k = 0..K-1``; ``p_K`` is the bonus distribution), ``K`` the padded
draft length, ``V`` the vocabulary, ``num_draft[b] = l_b <= K`` the drafts row ``b`` verifies.

**Rejection sampling** (Leviathan et al. 2023, Algorithm 1; Chen et al. 2023, "speculative
sampling"; Bebop §2, eq. 2). Draft ``x_k ~ q_k``. For ``k < l``: accept iff ``q_k(x_k) > 0`` and
``u_k * q_k(x_k) < p_k(x_k)`` with ``u_k ~ U[0, 1)``. At the first rejection ``n`` emit
``y ~ norm(max(0, p_n - q_n))``; if all ``l`` are accepted (``n = l``) emit the bonus ``y ~ p_l``.
Then every emitted position is distributed exactly as the target alone would sample it, and
``P(accept at k) = 1 - TV(p_k, q_k)``.

**Target-only** (Bebop §2, the common "greedy draft" baseline). Draft ``x_k = argmax q_k``; accept
iff ``u_k < p_k(x_k)``; on rejection emit ``y ~ p_n`` with ``x_n`` removed and renormalised; bonus
``y ~ p_l``. Acceptance is ``p_k(argmax q_k)``.

**Greedy** (temperature 0). Accept while ``x_k == argmax target_logits_k``; emit the target argmax
at the first mismatch (or the bonus position). Equals greedy autoregressive decoding token for token.

Randomness. Every sampler exists in two forms: a keyed form (``rejection_sample(key, ...)``) and a
form over explicit random inputs (``rejection_sample_with_noise(..., uniforms, exponentials)``), which
is what the keyed form calls, what tests pin, and what the Pallas kernel
(``pallas_kernels/rejection_sampling.py``) takes. The inputs are

* ``uniforms`` float32 ``[B, K]`` in ``[0, 1)`` -- one acceptance test per draft;
* ``exponentials`` float32 ``[B, V]``, i.i.d. Exp(1), strictly positive -- *one* vector per row,
  because a row emits exactly one sampled token (the correction at ``n`` or the bonus), and
  ``n`` is decided by the uniforms alone, independently of this noise.

The token is drawn with the *exponential race* ``argmax_v w_v / E_v`` (``w`` the unnormalised
residual, or ``p`` for the bonus), see :mod:`specjax.sampling`. Why this and not an inverse CDF with
one uniform per row: (i) it is exact without normalising ``w``, so a residual whose sum underflows
cannot produce NaN or an index ``>= V``, and entries with ``w_v = 0`` (``p <= q``, top-k/top-p masked
tokens) can never be emitted; (ii) it uses only elementwise ops and a max, so a tiled kernel, a padded
and a flattened layout all pick *bit-identical* tokens for the same noise, whereas an inverse CDF
depends on the summation order of a length-``V`` cumulative sum and disagrees with a tiled kernel near
bucket boundaries. The cost is ``V`` random numbers per *row* (not per position: ``[B, V]``, not
``[B, K+1, V]``), i.e. about ``1/(2K+1)`` of the probability bytes the verifier is handed.

Residual underflow: if no entry of ``max(0, p_n - q_n) * (1/E)`` is positive (``p_n`` and ``q_n``
agree to ~1e-36 everywhere, e.g. ``p == q`` up to rounding), the token is drawn from ``p_n`` with the
same race instead. Never NaN, never outside ``[0, V)``.

Cost of the ``jnp`` path: acceptance needs only the ``2K`` gathered scalars ``p_k(x_k), q_k(x_k)``
per row, and the residual / bonus only the one row ``n`` of ``p`` and ``q``; nothing of size
``[B, K, V]`` is materialised or even read. Rows run in parallel (vectorised; no Python loop over the
batch).

Layouts: the padded form here takes ``[B, K]`` / ``[B, K, V]`` / ``[B, K+1, V]`` arrays plus per-row
``num_draft`` (``0`` allowed). The flattened ragged form (rows packed into 1-D) is in
:mod:`specjax.verify_flat`, over the same cores.
"""
from __future__ import annotations

import functools
from typing import Optional, Tuple

import jax
import jax.numpy as jnp

from specjax.sampling import exponential_from_bits, uniform_from_bits
from specjax.verify_types import VerifyOutput

__all__ = [
    "VerifyOutput",
    "rejection_sample",
    "rejection_sample_with_noise",
    "target_only_sample",
    "target_only_sample_with_noise",
    "greedy_verify",
    "verify_noise",
    "resolve_impl",
]




# ----------------------------------------------------------------------------------------------
# randomness


def _row_keys(key: jax.Array, batch: int) -> jax.Array:
    """A single key -> ``split(key, batch)``; a batch of keys ``[batch]`` is returned as is."""
    key = jnp.asarray(key) if not isinstance(key, jax.Array) else key
    typed = jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key)
    single_ndim = 0 if typed else 1
    if key.ndim == single_ndim:
        return jax.random.split(key, batch)
    if key.ndim == single_ndim + 1 and key.shape[0] == batch:
        return key
    raise ValueError(f"key must be one key or a batch of {batch} keys, got shape {key.shape}")


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def verify_noise(key: jax.Array, batch: int, num_draft_max: int, vocab: int) -> Tuple[jax.Array, jax.Array]:
    """Random inputs of the explicit forms: ``(uniforms [B, K], exponentials [B, V])``.

    ``key`` is one key (split into ``B`` row keys) or ``B`` row keys. Row ``b``'s noise depends only
    on its own row key, so with per-row keys a row's result does not depend on the batch it is in.
    """
    keys = _row_keys(key, batch)

    def one(k):  # one stream of K + V random words per row
        bits = jax.random.bits(k, (num_draft_max + vocab,), jnp.uint32)
        return uniform_from_bits(bits[:num_draft_max]), exponential_from_bits(bits[num_draft_max:])

    return jax.vmap(one)(keys)


# ----------------------------------------------------------------------------------------------
# shared pieces


def _num_draft(num_draft, batch: int, k: int) -> jax.Array:
    if num_draft is None:
        return jnp.full((batch,), k, jnp.int32)
    return jnp.clip(jnp.asarray(num_draft, jnp.int32), 0, k).reshape(batch)


def _leading_true(accept: jax.Array) -> jax.Array:
    """Number of leading True along the last axis (int32)."""
    return jnp.sum(jnp.cumprod(accept.astype(jnp.int32), axis=-1), axis=-1).astype(jnp.int32)


def _emit(draft_tokens: jax.Array, n: jax.Array, last: jax.Array) -> VerifyOutput:
    """tokens[b, j] = draft[b, j] for j < n, last[b] at j = n, -1 after."""
    b, k = draft_tokens.shape
    j = jnp.arange(k + 1, dtype=jnp.int32)[None, :]
    padded = jnp.concatenate([draft_tokens.astype(jnp.int32), jnp.full((b, 1), -1, jnp.int32)], axis=1)
    tokens = jnp.where(j < n[:, None], padded, jnp.where(j == n[:, None], last[:, None], -1))
    return VerifyOutput(num_accepted=n, tokens=tokens.astype(jnp.int32))


def _block_size(vocab: int) -> int:
    """A divisor ``T`` of ``vocab`` with ``V/T + T`` minimal (``T`` near ``sqrt(V)``)."""
    best = 1
    for t in range(1, int(vocab**0.5) + 1):
        if vocab % t == 0:
            best = t
    return best


def _race(p_rows, p_ridx, q_rows, q_ridx, residual, use_residual, exponentials):
    """The correction / bonus token of every row by the exponential race.

    Row ``b`` races ``w = residual(p, q, cols)`` (``p = p_rows[p_ridx[b]]``, ``q = q_rows[q_ridx[b]]``)
    if ``use_residual[b]`` and some score ``w_v / E_v`` is positive, else it races ``p``; the winner is
    the first index of the largest score ``w_v * (1 / E_v)`` (the same formula and tie rule as the
    Pallas kernel, so the same token). Returns int32 ``[B]`` in ``[0, V)``.

    Nothing of size ``[B, V]`` is materialised: the vocabulary is viewed as ``V/T`` blocks of ``T``
    (``T`` a divisor near ``sqrt(V)``); one fused pass over the gathered rows yields every block's
    maximum of both races, then only the winning block (``T`` entries per row) is gathered again to
    find the index inside it. (Materialising ``[B, V]`` intermediates made the verifier 4-25x slower
    on this CPU: a (value, index) argmax over ``V`` is not vectorised by XLA:CPU, and temporaries
    above glibc's mmap threshold are page-faulted afresh on every call.)
    """
    bsz = p_ridx.shape[0]
    vocab = p_rows.shape[-1]
    t = _block_size(vocab)
    nb = vocab // t

    def scores(p, q, e, cols):
        r = 1.0 / e.astype(jnp.float32)
        p = p.astype(jnp.float32)
        s_p = p * r
        if residual is None:
            return s_p, None
        q = None if q is None else q.astype(jnp.float32)
        return s_p, residual(p, q, cols) * r

    # pass 1: block maxima [B, nb] of both races
    p3 = p_rows.reshape(-1, nb, t)[p_ridx]
    q3 = None if q_rows is None else q_rows.reshape(-1, nb, t)[q_ridx]
    e3 = exponentials.reshape(bsz, nb, t)
    cols3 = jax.lax.broadcasted_iota(jnp.int32, (1, nb, t), 1) * t + jax.lax.broadcasted_iota(jnp.int32, (1, nb, t), 2)
    s_p, s_w = scores(p3, q3, e3, cols3)
    # One variadic max-reduce: XLA:CPU fuses the gathers into it and reads each row once; two plain
    # jnp.max calls get routed to a library reduction that wants its input materialised first.
    ninf = jnp.float32(-jnp.inf)
    block_max, w_block_max = jax.lax.reduce(
        (s_p, s_p if s_w is None else s_w),
        (ninf, ninf),
        lambda a, b: (jnp.maximum(a[0], b[0]), jnp.maximum(a[1], b[1])),
        (2,),
    )
    if s_w is not None:
        use = use_residual & (jnp.max(w_block_max, axis=-1) > 0.0)
        block_max = jnp.where(use[:, None], w_block_max, block_max)
    block = jnp.argmax(block_max, axis=-1).astype(jnp.int32)  # first block holding the max, [B]
    # pass 2: the winning block only, [B, T]
    p_blk = p_rows.reshape(-1, nb, t)[p_ridx, block]
    q_blk = None if q_rows is None else q_rows.reshape(-1, nb, t)[q_ridx, block]
    e_blk = jnp.take_along_axis(e3, block[:, None, None], axis=1)[:, 0]
    cols = block[:, None] * t + jnp.arange(t, dtype=jnp.int32)[None, :]
    s_p, s_w = scores(p_blk, q_blk, e_blk, cols)
    score = s_p if s_w is None else jnp.where(use[:, None], s_w, s_p)
    idx = block * t + jnp.argmax(score, axis=-1).astype(jnp.int32)
    return jnp.clip(idx, 0, vocab - 1)


def _gather_at(rows: jax.Array, row_idx: jax.Array, col_idx: jax.Array) -> jax.Array:
    """rows[row_idx, col_idx] elementwise (float32), rows ``[M, V]``."""
    return rows[row_idx, col_idx].astype(jnp.float32)


def _rs_core(draft_tokens, q_rows, p_rows, d_idx, t_idx, uniforms, exponentials, num_draft, target_only):
    """Rejection sampling (or target-only when ``q_rows is None``) over row-indexed storage.

    draft_tokens int32 [B, K]; q_rows [N, V]; p_rows [M, V]; d_idx int32 [B, K] rows of q_rows;
    t_idx int32 [B, K+1] rows of p_rows; uniforms [B, K]; exponentials [B, V]; num_draft int32 [B].
    """
    bsz, k = draft_tokens.shape
    vocab = p_rows.shape[-1]
    x = draft_tokens.astype(jnp.int32)
    xs = jnp.clip(x, 0, vocab - 1)
    active = (jnp.arange(k, dtype=jnp.int32)[None, :] < num_draft[:, None]) & (x >= 0) & (x < vocab)
    pa = _gather_at(p_rows, t_idx[:, :k], xs)  # [B, K]
    u = uniforms.astype(jnp.float32)
    if target_only:
        accept = active & (u < pa)
    else:
        qa = _gather_at(q_rows, d_idx, xs)  # [B, K]
        accept = active & (qa > 0.0) & (u * qa < pa)
    n = _leading_true(accept)  # [B]
    rejected = n < num_draft
    p_ridx = jnp.take_along_axis(t_idx, n[:, None], axis=1)[:, 0]  # p_n: row of p_rows, [B]
    if k == 0:
        y = _race(p_rows, p_ridx, None, None, None, rejected, exponentials)
    elif target_only:
        x_n = jnp.take_along_axis(x, jnp.minimum(n, k - 1)[:, None], axis=1)[:, 0]
        residual = lambda p, q, cols: jnp.where(cols == x_n.reshape((-1,) + (1,) * (cols.ndim - 1)), 0.0, p)
        y = _race(p_rows, p_ridx, None, None, residual, rejected, exponentials)
    else:
        q_ridx = jnp.take_along_axis(d_idx, jnp.minimum(n, k - 1)[:, None], axis=1)[:, 0]
        residual = lambda p, q, cols: jnp.maximum(p - q, 0.0)
        y = _race(p_rows, p_ridx, q_rows, q_ridx, residual, rejected, exponentials)
    return _emit(x, n, y)


def _padded_indices(bsz: int, k: int):
    d_idx = jnp.arange(bsz * k, dtype=jnp.int32).reshape(bsz, k)
    t_idx = jnp.arange(bsz * (k + 1), dtype=jnp.int32).reshape(bsz, k + 1)
    return d_idx, t_idx


def _check_padded(draft_tokens, draft_probs, target_probs):
    if draft_tokens.ndim != 2:
        raise ValueError(f"draft_tokens must be [B, K], got {draft_tokens.shape}")
    bsz, k = draft_tokens.shape
    if target_probs.ndim != 3 or target_probs.shape[:2] != (bsz, k + 1):
        raise ValueError(f"target_probs must be [B, K+1, V] = [{bsz}, {k + 1}, V], got {target_probs.shape}")
    if draft_probs is not None and draft_probs.shape != (bsz, k, target_probs.shape[-1]):
        raise ValueError(f"draft_probs must be [B, K, V], got {draft_probs.shape} for target {target_probs.shape}")
    return bsz, k, target_probs.shape[-1]


# ----------------------------------------------------------------------------------------------
# padded forms


@jax.jit
def rejection_sample_with_noise(
    draft_tokens: jax.Array,
    draft_probs: jax.Array,
    target_probs: jax.Array,
    uniforms: jax.Array,
    exponentials: jax.Array,
    num_draft: Optional[jax.Array] = None,
) -> VerifyOutput:
    """Rejection sampling over explicit random inputs (the form the Pallas kernel mirrors).

    Args:
      draft_tokens: int32 ``[B, K]``, ``x_k ~ q_k`` drawn from exactly ``draft_probs``.
      draft_probs: float ``[B, K, V]`` (``q``; float32 recommended, read in its own dtype).
      target_probs: float ``[B, K+1, V]`` (``p``; position ``K`` is the bonus distribution).
      uniforms: float32 ``[B, K]`` in ``[0, 1)``.
      exponentials: float32 ``[B, V]``, i.i.d. Exp(1), ``> 0`` (see :func:`verify_noise`).
      num_draft: int32 ``[B]`` (default ``K``); row ``b`` verifies its first ``num_draft[b]`` drafts
        and draws its correction / bonus from ``target_probs[b, num_accepted[b]]``.

    Returns:
      :class:`VerifyOutput` with ``num_accepted [B]`` and ``tokens [B, K+1]`` (``-1`` past the
      emitted ones).
    """
    bsz, k, vocab = _check_padded(draft_tokens, draft_probs, target_probs)
    d_idx, t_idx = _padded_indices(bsz, k)
    return _rs_core(
        draft_tokens,
        draft_probs.reshape(bsz * k, vocab),
        target_probs.reshape(bsz * (k + 1), vocab),
        d_idx,
        t_idx,
        uniforms,
        exponentials,
        _num_draft(num_draft, bsz, k),
        target_only=False,
    )


IMPLS = ("auto", "jnp", "pallas")


def resolve_impl(impl: str, platform: Optional[str] = None) -> str:
    """``"auto"`` -> ``"pallas"`` on TPU / GPU (the fused kernel of
    ``pallas_kernels/rejection_sampling.py``), ``"jnp"`` elsewhere; other values pass through."""
    if impl not in IMPLS:
        raise ValueError(f"verifier impl must be one of {IMPLS}, got {impl!r}")
    if impl != "auto":
        return impl
    platform = platform or jax.default_backend()
    return "pallas" if platform in ("tpu", "gpu", "cuda", "rocm") else "jnp"


@functools.partial(jax.jit, static_argnames=("impl",))
def rejection_sample(key, draft_tokens, draft_probs, target_probs, num_draft=None, *,
                     impl: str = "jnp") -> VerifyOutput:
    """Rejection sampling (Leviathan et al. 2023; Chen et al. 2023) with noise from ``key``.

    ``key``: one PRNG key, or ``B`` per-row keys (then row ``b``'s result depends only on its own key
    and inputs: batch invariant). Shapes as in :func:`rejection_sample_with_noise`.
    ``impl``: ``"jnp"`` (gather-based, any backend) or ``"pallas"`` (the fused kernel; same noise,
    bit-identical tokens); resolve ``"auto"`` with :func:`resolve_impl` first.
    """
    bsz, k, vocab = _check_padded(draft_tokens, draft_probs, target_probs)
    u, e = verify_noise(key, bsz, k, vocab)
    if impl == "pallas":
        from pallas_kernels.rejection_sampling import rejection_sample_pallas
        return rejection_sample_pallas(draft_tokens, draft_probs, target_probs, u, e, num_draft)
    if impl != "jnp":
        raise ValueError(f"rejection_sample: impl must be 'jnp' or 'pallas', got {impl!r}")
    return rejection_sample_with_noise(draft_tokens, draft_probs, target_probs, u, e, num_draft)


@jax.jit
def target_only_sample_with_noise(
    draft_tokens: jax.Array,
    target_probs: jax.Array,
    uniforms: jax.Array,
    exponentials: jax.Array,
    num_draft: Optional[jax.Array] = None,
) -> VerifyOutput:
    """Target-only sampling over explicit random inputs.

    ``draft_tokens`` int32 ``[B, K]`` (normally ``argmax q_k``); ``target_probs`` ``[B, K+1, V]``;
    ``uniforms`` ``[B, K]``; ``exponentials`` ``[B, V]``; ``num_draft`` int32 ``[B]``. Accept iff
    ``u_k < p_k(x_k)``; on rejection draw from ``p_n`` with ``x_n`` zeroed (renormalisation is
    implicit in the race); bonus from ``p_l``.
    """
    bsz, k, vocab = _check_padded(draft_tokens, None, target_probs)
    d_idx, t_idx = _padded_indices(bsz, k)
    return _rs_core(
        draft_tokens,
        None,
        target_probs.reshape(bsz * (k + 1), vocab),
        d_idx,
        t_idx,
        uniforms,
        exponentials,
        _num_draft(num_draft, bsz, k),
        target_only=True,
    )


@jax.jit
def target_only_sample(key, draft_tokens, target_probs, num_draft=None) -> VerifyOutput:
    """Target-only sampling (Bebop's baseline; acceptance ``p(argmax q)``) with noise from ``key``."""
    bsz, k, vocab = _check_padded(draft_tokens, None, target_probs)
    u, e = verify_noise(key, bsz, k, vocab)
    return target_only_sample_with_noise(draft_tokens, target_probs, u, e, num_draft)


def _greedy_core(draft_tokens, target_argmax, num_draft):
    k = draft_tokens.shape[1]
    x = draft_tokens.astype(jnp.int32)
    active = jnp.arange(k, dtype=jnp.int32)[None, :] < num_draft[:, None]
    n = _leading_true(active & (x == target_argmax[:, :k]))
    y = jnp.take_along_axis(target_argmax, n[:, None], axis=1)[:, 0]
    return _emit(x, n, y)


@jax.jit
def greedy_verify(draft_tokens: jax.Array, target_logits: jax.Array, num_draft=None) -> VerifyOutput:
    """Greedy verification (temperature 0).

    ``draft_tokens`` int32 ``[B, K]``; ``target_logits`` ``[B, K+1, V]`` (any float dtype; only the
    argmax matters, first index on ties, as in greedy decoding); ``num_draft`` int32 ``[B]``.
    Accept while ``x_k == argmax_k``; emit the target argmax at the first mismatch / bonus position.
    """
    bsz, k, _ = _check_padded(draft_tokens, None, target_logits)
    target_argmax = jnp.argmax(target_logits, axis=-1).astype(jnp.int32)
    return _greedy_core(draft_tokens, target_argmax, _num_draft(num_draft, bsz, k))
