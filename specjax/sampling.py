"""Logits -> probabilities, and exact categorical sampling.

One transform, :func:`logits_to_probs`, turns logits into the distribution a token is sampled from:
temperature, then top-k, then top-p (nucleus), then min-p, then a softmax in float32. Speculative
decoding is exact only if the draft tokens are sampled from *exactly* the ``q`` the verifier is given
and the target's ``p`` went through the *same* transform; so both the drafter and the target call this
one function with the same per-request settings (docs/DESIGN.md, "Invariants" 1). Temperature 0 means greedy:
the result is the one-hot of the (first) argmax.

Sampling uses the *exponential race* (equivalently the Gumbel-max trick): for a non-negative weight
vector ``w`` (it need not be normalised) and i.i.d. ``E_v ~ Exp(1)``, ``argmax_v w_v / E_v`` is
distributed as ``w / sum(w)``. It needs no normalisation and no cumulative sum, so it never divides by
an underflowed total and its result does not depend on the order of a floating-point reduction (a
tiled kernel and a one-shot ``jnp`` reference pick the same index for the same noise). Entries with
``w_v = 0`` are never chosen. :func:`exponential_noise` draws ``E`` from 32 random bits so that small
values of ``E`` (the ones that win races) keep full float32 relative precision; ``E`` lies in
``[1.2e-10, 16.7]``, finite and strictly positive, so ``1/E`` is finite and ``0 * (1/E)`` is never NaN.

Shapes: ``logits`` is ``[..., V]``; per-request parameters are scalars or arrays whose shape is a
*prefix* of the batch shape ``logits.shape[:-1]`` (e.g. ``[B]`` for logits ``[B, K, V]``: one setting
per request, shared by all its positions).

References: Leviathan, Kalman, Matias, "Fast Inference from Transformers via Speculative Decoding"
(ICML 2023); Chen et al., "Accelerating Large Language Model Decoding with Speculative Sampling"
(2023); Efraimidis & Spirakis, "Weighted random sampling with a reservoir" (2006) for the race;
Holtzman et al. 2020 (top-p); Nguyen et al. 2024 (min-p).
"""
from __future__ import annotations

from typing import Optional, Union

import jax
import jax.numpy as jnp

ArrayLike = Union[jax.Array, float, int]

__all__ = [
    "logits_to_probs",
    "exponential_noise",
    "exponential_from_bits",
    "uniform_from_bits",
    "race_argmax",
    "sample",
]


def _expand(param: ArrayLike, batch_shape: tuple, dtype) -> jax.Array:
    """Broadcast a scalar or a batch-prefix-shaped parameter to ``batch_shape + (1,)``."""
    a = jnp.asarray(param, dtype)
    if a.ndim > len(batch_shape) or a.shape != batch_shape[: a.ndim]:
        raise ValueError(
            f"sampling parameter of shape {a.shape} is not a prefix of the batch shape {batch_shape}"
        )
    a = a.reshape(a.shape + (1,) * (len(batch_shape) - a.ndim + 1))
    return jnp.broadcast_to(a, batch_shape + (1,))


def logits_to_probs(
    logits: jax.Array,
    temperature: ArrayLike = 1.0,
    top_k: Optional[ArrayLike] = None,
    top_p: Optional[ArrayLike] = None,
    min_p: Optional[ArrayLike] = None,
) -> jax.Array:
    """Probabilities (float32, ``[..., V]``) under temperature / top-k / top-p / min-p.

    Apply this same function, with the same per-request parameters, to the draft logits and to the
    target logits: that is what keeps speculative sampling exact.

    Args:
      logits: ``[..., V]`` any float dtype; computed in float32.
      temperature: scalar or batch-prefix array, ``>= 0``. ``0`` gives the one-hot of the first
        argmax of ``logits`` (greedy), whatever the other settings.
      top_k: ``None`` (off) or scalar / batch-prefix int array; values ``<= 0`` or ``>= V`` disable it
        for that request. Keeps every token whose scaled logit is ``>=`` the k-th largest (ties at the
        threshold are all kept).
      top_p: ``None`` or scalar / batch-prefix array in ``(0, 1]``; ``>= 1`` disables. Keeps the
        smallest prefix of tokens (sorted by probability, after top-k) whose mass reaches ``top_p``;
        the most likely token is always kept.
      min_p: ``None`` or scalar / batch-prefix array in ``[0, 1]``; ``0`` disables. Keeps tokens with
        ``p >= min_p * max(p)`` (a ratio, so it does not depend on the order of the other filters).

    Returns:
      float32 ``[..., V]``; every row sums to 1 up to rounding; filtered tokens are exactly 0.
    """
    x = jnp.asarray(logits).astype(jnp.float32)
    batch_shape = x.shape[:-1]
    vocab = x.shape[-1]
    t = _expand(temperature, batch_shape, jnp.float32)
    greedy = t <= 0.0
    z = x / jnp.where(greedy, 1.0, t)
    neg_inf = jnp.float32(-jnp.inf)
    threshold = jnp.full(batch_shape + (1,), neg_inf)

    static_k = isinstance(top_k, int) and not isinstance(top_k, bool)
    need_sort = top_p is not None or (top_k is not None and not static_k)
    if need_sort:
        sorted_z = -jnp.sort(-z, axis=-1)  # descending
    if top_k is not None:
        if static_k:
            if 0 < top_k < vocab:
                kth = jax.lax.top_k(z, top_k)[0][..., -1:]
                threshold = jnp.maximum(threshold, kth)
        else:
            k = _expand(top_k, batch_shape, jnp.int32)
            on = (k > 0) & (k < vocab)
            kth = jnp.take_along_axis(sorted_z, jnp.clip(k - 1, 0, vocab - 1), axis=-1)
            threshold = jnp.maximum(threshold, jnp.where(on, kth, neg_inf))
    if top_p is not None:
        tp = _expand(top_p, batch_shape, jnp.float32)
        kept = sorted_z >= threshold
        s = jnp.where(kept, sorted_z, neg_inf)
        ps = jax.nn.softmax(s, axis=-1)
        mass_before = jnp.cumsum(ps, axis=-1) - ps
        n_keep = jnp.maximum(jnp.sum((mass_before < tp) & kept, axis=-1, keepdims=True), 1)
        pth = jnp.take_along_axis(sorted_z, n_keep - 1, axis=-1)
        threshold = jnp.maximum(threshold, jnp.where(tp < 1.0, pth, neg_inf))
    if min_p is not None:
        mp = _expand(min_p, batch_shape, jnp.float32)
        zmax = jnp.max(z, axis=-1, keepdims=True)
        mth = zmax + jnp.log(jnp.maximum(mp, 1e-38))
        threshold = jnp.maximum(threshold, jnp.where(mp > 0.0, mth, neg_inf))

    probs = jax.nn.softmax(jnp.where(z >= threshold, z, neg_inf), axis=-1)
    onehot = jax.nn.one_hot(jnp.argmax(x, axis=-1), vocab, dtype=jnp.float32)
    return jnp.where(greedy, onehot, probs)


def exponential_noise(key: jax.Array, shape) -> jax.Array:
    """i.i.d. Exp(1) noise, float32, strictly positive and finite, for :func:`race_argmax`.

    ``E = -log1p(-v)`` with ``v = (bits + 0.5) * 2**-32`` from 32 random bits, so ``v`` (and the
    small ``E`` that decide a race) have float32 *relative* precision down to ``2**-33``; a plain
    23-bit uniform would quantise the race winners' ``E`` and bias large vocabularies towards low ids.
    """
    return exponential_from_bits(jax.random.bits(key, shape, jnp.uint32))


def exponential_from_bits(bits: jax.Array) -> jax.Array:
    """Exp(1) samples from uint32 random bits (see :func:`exponential_noise`); in ``[1.2e-10, 16.7]``."""
    v = (bits.astype(jnp.float32) + 0.5) * jnp.float32(2.0**-32)
    v = jnp.minimum(v, jnp.float32(1.0 - 2.0**-24))
    return -jnp.log1p(-v)


def uniform_from_bits(bits: jax.Array) -> jax.Array:
    """Uniform ``[0, 1)`` float32 from uint32 random bits (23 mantissa bits, as ``jax.random.uniform``)."""
    mant = jax.lax.shift_right_logical(bits, jnp.uint32(9)) | jnp.uint32(0x3F800000)
    return jax.lax.bitcast_convert_type(mant, jnp.float32) - 1.0


def race_argmax(weights: jax.Array, exponentials: jax.Array) -> jax.Array:
    """Index of ``argmax_v weights[..., v] / exponentials[..., v]`` (int32 ``[...]``).

    Distributed as ``weights / sum(weights)`` when ``exponentials`` are i.i.d. Exp(1). Computed as
    ``weights * (1 / exponentials)``; ties go to the smallest index; an all-zero row gives 0.
    """
    score = weights.astype(jnp.float32) * (1.0 / exponentials)
    return jnp.argmax(score, axis=-1).astype(jnp.int32)


def sample(key: jax.Array, probs: jax.Array) -> jax.Array:
    """Draw one token per row from ``probs`` (``[..., V]``, non-negative, need not sum to 1).

    Returns int32 ``[...]``. Zero-probability tokens are never drawn (unless the whole row is 0,
    which gives 0).
    """
    return race_argmax(probs, exponential_noise(key, probs.shape))


def sample_or_argmax(greedy, sample_fn, probs: jax.Array) -> jax.Array:
    """``sample_fn()`` unless ``greedy`` (bool scalar: every row is temperature 0), then the
    argmax of ``probs`` ``[..., V]`` without drawing any noise.

    Exact: a greedy row's ``probs`` is the one-hot of its argmax, which every sampler here
    returns whatever the noise, so skipping the noise changes no token. It saves the ``V``
    random numbers per row that dominate a small model's sampling cost.
    """
    return jax.lax.cond(jnp.asarray(greedy, bool),
                        lambda: jnp.argmax(probs, axis=-1).astype(jnp.int32), sample_fn)


def all_greedy(temperature, where=None) -> jax.Array:
    """Bool scalar: every row (where ``where``) has temperature 0."""
    t = jnp.asarray(temperature)
    greedy = t <= 0.0
    if where is not None:
        greedy = greedy | ~where
    return jnp.all(greedy)
