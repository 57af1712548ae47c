"""Pieces shared by the TPU rejection-sampling kernels (``rejection_sampling.py``,
``rejection_two_phase.py``): their tiling rules, the running race inside a kernel, and the
``[B, K]``-sized jnp epilogue (acceptance chain, token choice, emitted tokens)."""
from __future__ import annotations

import jax.numpy as jnp

from specjax.verify_types import VerifyOutput


def _balanced_tile(vocab: int, block_v: int) -> int:
    """Vocabulary tile of at most ``block_v`` lanes (a multiple of 128), balanced so that the last,
    partial tile wastes fewer than 128 lanes (V = 8193 in blocks of 2048 would fetch 25 % more
    than V)."""
    lanes = -(-vocab // 128)
    tiles = -(-(lanes * 128) // block_v)
    return -(-lanes // tiles) * 128


def _rows_per_block(bsz: int) -> int:
    """Batch rows per block: 8 (TPU's sublane tiling, so ``[B, V]`` noise is read in place), or
    all ``B`` rows when ``B % 8 != 0``."""
    return 8 if bsz % 8 == 0 else bsz


def _race_update(score, col, best_ref, idx_ref, i=...):
    """Running first-argmax over vocabulary tiles, inside a kernel: ``score [R, T]`` against the
    best so far in ``best_ref[i]`` / ``idx_ref[i]`` (``[R, 1]``); strictly better wins, so ties
    keep the earlier tile, and within a tile the lowest column wins."""
    # The index min-reduction runs in float32 (exact for ids < 2**24): float lane reductions are the
    # ones every TPU generation supports.
    m = jnp.max(score, axis=1, keepdims=True)
    j = jnp.min(jnp.where(score == m, col.astype(jnp.float32), jnp.inf), axis=1, keepdims=True)
    j = j.astype(jnp.int32)
    best = best_ref[i]
    better = m > best
    best_ref[i] = jnp.where(better, m, best)
    idx_ref[i] = jnp.where(better, j, idx_ref[i])


def _nd(num_draft, bsz, k):
    if num_draft is None:
        return jnp.full((bsz,), k, jnp.int32)
    return jnp.clip(jnp.asarray(num_draft, jnp.int32), 0, k).reshape(bsz)


def _accepted(draft_tokens, uniforms, num_draft, pa, qa):
    """The acceptance chain: ``n [B]``, drafts accepted before the first rejection, from
    ``pa = p_k(x_k)`` and ``qa = q_k(x_k)`` (``[B, K]`` or wider; the first ``K`` columns)."""
    k = draft_tokens.shape[1]
    kk = jnp.arange(k, dtype=jnp.int32)[None, :]
    active = kk < num_draft[:, None]
    accept = active & (qa[:, :k] > 0.0) & (uniforms.astype(jnp.float32) * qa[:, :k] < pa[:, :k])
    return jnp.sum(jnp.cumprod(accept.astype(jnp.int32), axis=1), axis=1).astype(jnp.int32)


def _choose(n, num_draft, r_pick, p_pick):
    """The emitted token: the residual race's winner after a rejection (``n < num_draft``) when one
    scored above 0, else the target race's (bonus, or a residual that underflowed); ``r_pick`` is
    None when there are no drafts."""
    p_pick = jnp.maximum(p_pick, 0)
    if r_pick is None:
        return p_pick
    return jnp.where((n < num_draft) & (r_pick >= 0), r_pick, p_pick)


def _emit(draft_tokens, n, y) -> VerifyOutput:
    """Tokens ``[B, K+1]``: the ``n`` accepted drafts, then ``y``, then ``-1``."""
    bsz, k = draft_tokens.shape
    j = jnp.arange(k + 1, dtype=jnp.int32)[None, :]
    xp = jnp.concatenate([draft_tokens.astype(jnp.int32), jnp.full((bsz, 1), -1, jnp.int32)], axis=1)
    tokens = jnp.where(j < n[:, None], xp, jnp.where(j == n[:, None], y[:, None], -1))
    return VerifyOutput(num_accepted=n, tokens=tokens.astype(jnp.int32))
