"""Pieces shared by the rejection-sampling kernels' jnp epilogues (``rejection_sampling.py``,
``rejection_two_phase.py``): the acceptance chain and the emitted tokens, ``[B, K]``-sized."""
from __future__ import annotations

import jax.numpy as jnp

from specjax.verify_types import VerifyOutput


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


def _emit(draft_tokens, n, y) -> VerifyOutput:
    """Tokens ``[B, K+1]``: the ``n`` accepted drafts, then ``y``, then ``-1``."""
    bsz, k = draft_tokens.shape
    j = jnp.arange(k + 1, dtype=jnp.int32)[None, :]
    xp = jnp.concatenate([draft_tokens.astype(jnp.int32), jnp.full((bsz, 1), -1, jnp.int32)], axis=1)
    tokens = jnp.where(j < n[:, None], xp, jnp.where(j == n[:, None], y[:, None], -1))
    return VerifyOutput(num_accepted=n, tokens=tokens.astype(jnp.int32))
