"""Exact per-token log-probabilities and entropies of completions under the policy.

A rollout needs, for every sampled token, ``log p(token)`` under the distribution it was sampled
from (temperature, top-k, top-p applied to the policy's logits: :func:`specjax.sampling.
logits_to_probs`), and that distribution's entropy (the quantity that bounds speculative
acceptance, Bebop §3). Both come from one teacher-forced forward of ``prompt + completion``
through the target (:func:`specjax.models.transformer.apply`).

The verifier computes the target's probabilities of every emitted token during decoding, so it
could return these values without a second forward; the engine's public results do not carry them,
and recomputing them here is exact and cheap next to decoding (the RL learner recomputes its own
log-probs for the update anyway).

Layouts: rows are ``[prompt, completion, pad...]`` (right-padded) so that plain causal attention is
exact for every real token; :func:`right_align` converts Tunix's layout (left-padded prompts next
to right-padded completions) into it.
"""
from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from specjax.models.transformer import apply
from specjax.sampling import logits_to_probs
from specjax.stats import clustered_ratio

__all__ = ["token_logprobs", "score_rows", "right_align", "tunix_logps", "exactness_gap"]


def token_logprobs(logits: jax.Array, targets: jax.Array, temperature, top_k=None,
                   top_p=None) -> tuple[jax.Array, jax.Array]:
    """Log-probability of ``targets`` and entropy under the sampling transform.

    Args:
      logits: float ``[B, T, V]``.
      targets: int ``[B, T]``.
      temperature, top_k, top_p: scalars or ``[B]`` arrays, as in
        :func:`specjax.sampling.logits_to_probs` (``temperature == 0``: greedy, a one-hot).
    Returns:
      ``(logp, entropy)``, float32 ``[B, T]`` each; ``logp`` is ``-inf`` for a token the transform
      gives probability 0. Computed as a log-softmax over the kept tokens (not ``log(probs)``), so
      tiny probabilities keep full relative precision.
    """
    x = jnp.asarray(logits, jnp.float32)
    probs = logits_to_probs(x, temperature, top_k, top_p)
    t = jnp.asarray(temperature, jnp.float32)
    t = t.reshape(t.shape + (1,) * (x.ndim - t.ndim))  # [B] -> [B, 1, 1]: one per request
    greedy = t <= 0.0
    z = jnp.where(probs > 0, x / jnp.where(greedy, 1.0, t), -jnp.inf)
    logq = jax.nn.log_softmax(z, axis=-1)
    logq = jnp.where(greedy, jnp.where(probs > 0, 0.0, -jnp.inf), logq)
    logp = jnp.take_along_axis(logq, targets[..., None].astype(jnp.int32), axis=-1)[..., 0]
    entropy = -jnp.sum(jnp.where(probs > 0, probs * logq, 0.0), axis=-1)
    return logp, entropy


@functools.partial(jax.jit, static_argnames=("graphdef",))
def score_rows(graphdef, state, rows: jax.Array, temperature, top_k=None, top_p=None):
    """Teacher-forced scores of right-padded rows.

    Args:
      graphdef, state: the target (``nnx.split``).
      rows: int32 ``[B, L]``: prompt, completion, then padding (any ids: causal attention keeps
        later tokens out of earlier scores).
      temperature, top_k, top_p: ``[B]`` arrays (or scalars).
    Returns:
      ``(logp, entropy)`` float32 ``[B, L - 1]``: entry ``t`` scores ``rows[:, t + 1]`` given
      ``rows[:, :t + 1]``.
    """
    logits = apply(graphdef, state, rows).logits[:, :-1]
    return token_logprobs(logits, rows[:, 1:], temperature, top_k, top_p)


def right_align(prompt_tokens: jax.Array, completion_tokens: jax.Array, pad_id: int):
    """Tunix layout -> right-padded rows.

    Args:
      prompt_tokens: int ``[B, P]`` left-padded with ``pad_id``.
      completion_tokens: int ``[B, C]`` (right-padded).
    Returns:
      ``(rows [B, P + C], start [B])``: the real prompt tokens moved to the front, followed by the
      completion; ``start[b]`` is the row index of completion token 0 (= real prompt length).
    """
    p = prompt_tokens.shape[1]
    rows = jnp.concatenate([prompt_tokens, completion_tokens], axis=1)
    npad = jnp.sum(jnp.cumprod(prompt_tokens == pad_id, axis=1), axis=1)  # leading pads only
    idx = jnp.arange(rows.shape[1])[None, :] + npad[:, None]
    shifted = jnp.take_along_axis(rows, jnp.minimum(idx, rows.shape[1] - 1), axis=1)
    shifted = jnp.where(idx < rows.shape[1], shifted, pad_id)
    return shifted, p - npad


@functools.partial(jax.jit, static_argnames=("graphdef", "pad_id"))
def tunix_logps(graphdef, state, prompt_tokens, completion_tokens, temperature, *,
                pad_id: int, top_k: Optional[int] = None, top_p=None):
    """``log p(completion token)`` ``[B, C]`` for Tunix's layout (see :func:`right_align`)."""
    rows, start = right_align(prompt_tokens, completion_tokens, pad_id)
    logp, _ = score_rows.__wrapped__(graphdef, state, rows, temperature, top_k, top_p)
    c = completion_tokens.shape[1]
    # completion token j sits at row index start + j and is scored by entry start + j - 1
    idx = start[:, None] - 1 + jnp.arange(c)[None, :]
    return jnp.take_along_axis(logp, idx, axis=1)


def exactness_gap(logp, entropy) -> tuple[float, float]:
    """An exactness monitor for sampled sequences: ``(mean of log p(x_t) + H_t, clustered s.e.)``.

    For a token drawn from the policy, ``E[log p(x_t) | prefix] = -H_t`` (the entropy of the
    distribution it was drawn from), so ``log p(x_t) + H_t`` has mean 0 whatever the prefix, and
    its sum over a sequence, stopped by a stop token or the length cap, has mean 0 too (optional
    stopping). A sampler that departs from the policy, say a verifier that leans toward its
    drafter's guesses, moves the mean away from 0: its ``|gap| / s.e.`` grows as the square root
    of the tokens seen. A token the policy gives probability 0 makes the gap ``-inf``.
    Its power is partial: drawing from ``q`` instead of ``p`` shifts the mean by
    ``H(p) − H(q) − KL(q‖p)`` per token, which is 0 for some ``q ≠ p``. The chi-square tests
    against enumerated sequence distributions are the complete check; this one runs on real
    rollouts, at any scale.
    The mean is per token; the s.e. takes each sequence as a cluster (its tokens share a prefix).

    Args:
      logp: per sequence, float ``[n_i]`` log-probabilities of the sampled tokens (as
        :func:`token_logprobs` computes them, under the sampling transform).
      entropy: per sequence, float ``[n_i]`` entropies of the same distributions.
    Returns:
      ``(gap, se)``; ``(nan, nan)`` without tokens, s.e. nan for one sequence.
    """
    if len(logp) != len(entropy):
        raise ValueError(f"{len(logp)} log-prob rows for {len(entropy)} entropy rows")
    sums, counts = [], []
    for lp, en in zip(logp, entropy):
        lp, en = np.asarray(lp, np.float64), np.asarray(en, np.float64)
        if lp.shape != en.shape or lp.ndim != 1:
            raise ValueError(f"want equal [n] rows, got {lp.shape} and {en.shape}")
        if lp.size:
            sums.append(float(np.sum(lp + en)))
            counts.append(lp.size)
    if not counts:
        return float("nan"), float("nan")
    if not np.all(np.isfinite(sums)):
        return float("-inf") if np.any(np.isneginf(sums)) else float("nan"), float("nan")
    return clustered_ratio(sums, counts)
