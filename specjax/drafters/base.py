"""Shared pieces of every drafter: the output types, the observation a drafter is updated with,
the frozen shared embedding / LM head, exact sampling from a drafter's logits, and the
teacher-forcing alignment helpers used for training.

Conventions (the same for every drafter; see :mod:`specjax.drafters` for the full interface):

* A decoding row has emitted ``n`` tokens ``t_0 .. t_{n-1}`` (prompt included). The target has
  consumed ``t_0 .. t_{n-2}`` (its cache length is ``n - 1``); ``t_{n-1}``, the *anchor* (the token
  the last verification emitted), is fed to the target at the next verification together with the
  drafts. Draft ``k`` (1-based) proposes ``t_{n-1+k}``.
* In teacher-forced (training) form the same thing is indexed by the *anchor position* ``i``: the
  target context is its hidden states at positions ``<= i``, the anchor is ``t_{i+1}``, and draft
  ``k`` predicts ``t_{i+1+k}`` given teacher-forced ``t_{i+2} .. t_{i+k}``. At inference
  ``i = n - 2``.
"""
from __future__ import annotations

import dataclasses
from typing import NamedTuple, Optional, Union

import jax
import jax.numpy as jnp
from flax import nnx

from specjax.models.transformer import embed_lookup, head_logits
from specjax.sampling import all_greedy, logits_to_probs, sample, sample_or_argmax

__all__ = [
    "DraftOutput",
    "TeacherForced",
    "Observation",
    "Sampling",
    "SharedHead",
    "shared_head",
    "draw",
    "teacher_forced_targets",
    "default_anchors",
    "param_logical_axes",
]

ArrayLike = Union[jax.Array, float, int]


class DraftOutput(NamedTuple):
    """γ proposed tokens per row and the exact distributions they were drawn from.

    tokens: int32 ``[B, γ]``; ``tokens[:, k] ~ probs[:, k]`` (or its argmax in argmax mode).
    probs: float32 ``[B, γ, V]``: ``q_k`` after the sampling transform (temperature / top-k /
      top-p), exactly what the verifier must be given.
    confidences: float32 ``[B, γ]``, ``c_k ≈ P(x_k accepted | x_<k accepted)``, or ``None`` when the
      drafter has no confidence head.
    """

    tokens: jax.Array
    probs: jax.Array
    confidences: Optional[jax.Array]


class TeacherForced(NamedTuple):
    """Training-time (teacher-forced) drafter outputs at A anchor positions per row.

    logits: float32 ``[B, A, γ, V]``: raw draft logits (before any sampling transform) for token
      ``t_{i+1+k}`` (k = 1..γ) where ``i = anchors[b, a]``; ``softmax`` of it is ``q_k`` at
      temperature 1.
    confidence_logits: float32 ``[B, A, γ]`` pre-sigmoid confidence-head outputs, or ``None``.
    """

    logits: jax.Array
    confidence_logits: Optional[jax.Array]


class Observation(NamedTuple):
    """What the target just consumed, handed to a drafter's ``prefill`` / ``commit``.

    tokens: int32 ``[B, T]``: tokens the target consumed, ``tokens[b, t]`` at position
      ``start[b] + t`` (prefill: the prompt; a speculative step: anchor + drafts).
    num_valid: int32 ``[B]``: the first ``num_valid[b]`` of them are committed (prompt length, or
      accepted drafts + 1); the rest are discarded.
    start: int32 ``[B]``: target position of ``tokens[:, 0]`` (the target cache length before).
    next_token: int32 ``[B]``: the token emitted after them (the new anchor, at position
      ``start + num_valid``), not consumed by the target yet.
    hidden: ``[len(hidden_layers), B, T, D]`` target hidden states of ``tokens`` for the layers the
      drafter asked for (``drafter.hidden_layers``), or ``None`` if it asked for none.
    """

    tokens: jax.Array
    num_valid: jax.Array
    start: jax.Array
    next_token: jax.Array
    hidden: Optional[jax.Array]


class Sampling(NamedTuple):
    """Per-request sampling transform (scalars or ``[B]`` arrays), shared by target and drafter.

    ``temperature == 0`` is greedy (one-hot argmax). Fields are passed to
    :func:`specjax.sampling.logits_to_probs` unchanged; ``None`` disables a filter.
    """

    temperature: ArrayLike = 1.0
    top_k: Optional[ArrayLike] = None
    top_p: Optional[ArrayLike] = None
    min_p: Optional[ArrayLike] = None

    def probs(self, logits: jax.Array) -> jax.Array:
        return logits_to_probs(logits, self.temperature, self.top_k, self.top_p, self.min_p)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SharedHead:
    """The target's embedding, final norm and LM head, shared (frozen) by MTP / DSpark drafters.

    A view of the target's own arrays (no copy; :func:`shared_head`), passed to drafter functions as
    the ``frozen`` argument, never part of the drafter's trainable params. Its methods reproduce
    :meth:`Transformer.embed_tokens` / :meth:`Transformer.lm_logits` exactly.
    """

    embed: jax.Array  # [V, D]
    norm_scale: jax.Array  # [D] the target's final RMSNorm scale
    lm_head: Optional[jax.Array]  # [D, V], None when tied to the embedding
    eps: float = dataclasses.field(default=1e-6, metadata=dict(static=True))
    dtype: str = dataclasses.field(default="float32", metadata=dict(static=True))

    @property
    def vocab_size(self) -> int:
        return self.embed.shape[0]

    @property
    def hidden_size(self) -> int:
        return self.embed.shape[1]

    @property
    def compute_dtype(self):
        return jnp.dtype(self.dtype)

    def embed_tokens(self, tokens: jax.Array) -> jax.Array:
        """``int [B, ...]`` -> ``[B, ..., D]`` (:func:`specjax.models.transformer.embed_lookup`)."""
        return embed_lookup(self.embed, tokens, self.compute_dtype)

    def final_norm(self, h: jax.Array) -> jax.Array:
        hf = h.astype(jnp.float32)
        hf = hf * jax.lax.rsqrt(jnp.mean(hf * hf, axis=-1, keepdims=True) + self.eps)
        return self.norm_scale.astype(h.dtype) * hf.astype(h.dtype)

    def lm_logits(self, h: jax.Array, *, normed: bool = False) -> jax.Array:
        """``[..., D]`` -> float32 ``[..., V]`` (target final norm unless ``normed``)."""
        if not normed:
            h = self.final_norm(h)
        return head_logits(h, self.embed, self.lm_head)

    def logical_axes(self) -> "SharedHead":
        """Same structure, each array leaf replaced by its logical axis names."""
        return dataclasses.replace(
            self, embed=("vocab", "embed"), norm_scale=("norm",),
            lm_head=None if self.lm_head is None else ("embed", "vocab"))


def shared_head(target) -> SharedHead:
    """The frozen shared embedding / LM head of a target :class:`~specjax.models.Transformer`
    (an nnx module, or ``(graphdef, state)``)."""
    if isinstance(target, tuple):
        target = nnx.merge(*target)
    c = target.config
    return SharedHead(
        embed=target.embed[...], norm_scale=target.final_norm.scale[...],
        lm_head=None if target.lm_head is None else target.lm_head[...],
        eps=c.rms_norm_eps, dtype=c.dtype)


def draw(key: jax.Array, logits: jax.Array, sampling: Sampling, argmax: bool = False):
    """Exact draw from a drafter's logits under the shared sampling transform.

    Args:
      key: PRNG key.
      logits: ``[B, V]`` any float dtype (converted to f32 by the transform).
      sampling: the request's :class:`Sampling` (``[B]`` or scalar fields).
      argmax: propose ``argmax q`` instead of a sample (target-only verification drafts greedily).
    Returns:
      ``(token int32 [B], q float32 [B, V])`` with ``token ~ q`` (or ``argmax q``).
    """
    q = sampling.probs(logits)
    if argmax:
        tok = jnp.argmax(q, axis=-1).astype(jnp.int32)
    else:  # an all-greedy batch draws no noise (same tokens: q is one-hot)
        tok = sample_or_argmax(all_greedy(sampling.temperature), lambda: sample(key, q), q)
    return tok, q


def default_anchors(batch: int, length: int) -> jax.Array:
    """Every position of every row as an anchor: ``int32 [B, T]``."""
    return jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))


def teacher_forced_targets(tokens: jax.Array, target_logits: jax.Array, gamma: int,
                           anchors: Optional[jax.Array] = None, valid: Optional[jax.Array] = None):
    """Labels and target distributions aligned with :class:`TeacherForced` outputs.

    Args:
      tokens: int32 ``[B, T]`` the sequence.
      target_logits: ``[B, T, V]`` the target's logits on ``tokens`` (position j predicts
        ``t_{j+1}``).
      gamma: draft length γ.
      anchors: int32 ``[B, A]`` anchor positions (default every position).
      valid: optional bool ``[B, T]`` real (non-padding) tokens; a label counts only if its token
        is valid.
    Returns:
      ``(labels int32 [B, A, γ], target_logits [B, A, γ, V], mask bool [B, A, γ])``: for anchor
      ``i`` and draft ``k`` (1-based), label ``t_{i+1+k}``, target logits at position ``i+k`` and
      mask ``i+1+k < T`` (and the label token valid). Masked entries hold clipped (arbitrary but
      in-range) values. Apply the sampling transform to the target logits yourself (training
      usually uses temperature 1: ``softmax``).
    """
    b, t = tokens.shape
    if anchors is None:
        anchors = default_anchors(b, t)
    k = jnp.arange(1, gamma + 1, dtype=jnp.int32)
    lab_pos = anchors[..., None] + 1 + k  # [B, A, γ]
    mask = (lab_pos < t) & (anchors[..., None] >= 0)
    lab_c = jnp.clip(lab_pos, 0, t - 1)
    bidx = jnp.arange(b)[:, None, None]
    labels = tokens[bidx, lab_c]
    if valid is not None:
        mask &= valid[bidx, lab_c]
    tl = target_logits[bidx, jnp.clip(lab_pos - 1, 0, t - 1)]
    return labels.astype(jnp.int32), tl, mask


def _is_var(x) -> bool:
    return isinstance(x, nnx.Variable)


def param_logical_axes(params) -> dict:
    """Pure dict of logical axis names (one tuple per array) of an ``nnx.State`` of params."""
    axes = jax.tree.map(lambda v: tuple(v.logical_axes), params, is_leaf=_is_var)
    return nnx.to_pure_dict(axes)


def gather_positions(x: jax.Array, idx: jax.Array) -> jax.Array:
    """``x[b, idx[b, a]]`` for ``x [B, T, ...]`` and ``idx [B, A]`` (indices clipped)."""
    idx = jnp.clip(idx, 0, x.shape[1] - 1)
    return x[jnp.arange(x.shape[0])[:, None], idx]


def drop_invalid(positions: jax.Array, valid: jax.Array, max_len: int) -> jax.Array:
    """Positions with invalid (or negative) entries moved to ``max_len`` (dropped by scatters)."""
    return jnp.where(valid & (positions >= 0), positions, max_len).astype(jnp.int32)
