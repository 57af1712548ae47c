"""specjax.sampling: the logits -> probs transform (temperature / top-k / top-p / min-p, greedy)
against a numpy reference, per-request parameters, and exactness of the exponential-race sampler."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats as sps

from specjax import sampling as S
from stats import chisquare_gof, counts_of


def _softmax(z):
    z = z - np.max(z, -1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(-1, keepdims=True)


def ref_probs(logits, t, top_k, top_p, min_p):
    """numpy float64 reference for one row."""
    z = np.asarray(logits, np.float64)
    if t <= 0:
        out = np.zeros_like(z)
        out[np.argmax(z)] = 1.0
        return out
    z = z / t
    vocab = z.shape[-1]
    keep = np.ones(vocab, bool)
    if top_k is not None and 0 < top_k < vocab:
        keep &= z >= np.sort(z)[::-1][top_k - 1]
    if top_p is not None and top_p < 1.0:
        pr = _softmax(np.where(keep, z, -np.inf))
        order = np.argsort(-z, kind="stable")
        before = np.cumsum(pr[order]) - pr[order]
        n_keep = max(int(np.sum((before < top_p) & keep[order])), 1)
        sel = np.zeros(vocab, bool)
        sel[order[:n_keep]] = True
        keep &= sel
    if min_p is not None and min_p > 0:
        pr = _softmax(z)
        keep &= pr >= min_p * pr.max()
    return _softmax(np.where(keep, z, -np.inf))


_l2p = jax.jit(S.logits_to_probs)  # array-valued parameters (traced)
_l2p_static_k = jax.jit(S.logits_to_probs, static_argnames=("top_k",))


def test_temperature_and_dtype():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(4, 3, 33)).astype(np.float32)
    for t in (0.3, 1.0, 2.5):
        got = _l2p(jnp.asarray(logits, jnp.bfloat16), t)
        assert got.dtype == jnp.float32
        ref = _softmax(np.asarray(jnp.asarray(logits, jnp.bfloat16).astype(jnp.float32), np.float64) / t)
        np.testing.assert_allclose(np.asarray(got), ref, rtol=2e-5, atol=1e-7)
    assert np.isfinite(np.asarray(_l2p(jnp.asarray(logits) * 1e4, 1e-3))).all()


def test_temperature_zero_is_one_hot_first_argmax():
    logits = jnp.array([[1.0, 3.0, 3.0, -1.0], [0.0, 0.0, 0.0, 0.0], [5.0, 1.0, 2.0, 7.0]])
    got = np.asarray(_l2p(logits, 0.0, top_k=2, top_p=0.5, min_p=0.2))
    np.testing.assert_array_equal(got, np.eye(4)[[1, 0, 3]])
    # per-row temperature mixing greedy and sampled rows, broadcast over positions: [B] over [B, K, V]
    rng = np.random.default_rng(1)
    lg = rng.normal(size=(3, 2, 9)).astype(np.float32)
    temps = jnp.array([0.0, 1.0, 0.5])
    got = np.asarray(_l2p(jnp.asarray(lg), temps))
    for b in range(3):
        for k in range(2):
            np.testing.assert_allclose(got[b, k], ref_probs(lg[b, k], float(temps[b]), None, None, None), rtol=2e-5, atol=1e-7)


def test_filters_match_reference_per_row():
    rng = np.random.default_rng(2)
    b, vocab = 24, 50
    logits = (rng.normal(size=(b, vocab)) * 2).astype(np.float32)
    temps = rng.uniform(0.3, 2.0, b).astype(np.float32)
    temps[3] = 0.0
    top_k = rng.integers(0, vocab + 3, b).astype(np.int32)  # 0 and >= V disable
    top_k[:4] = [0, 1, vocab, 7]
    top_p = rng.uniform(0.05, 1.0, b).astype(np.float32)
    top_p[:3] = [1.0, 0.9, 0.01]
    min_p = rng.uniform(0.0, 0.3, b).astype(np.float32)
    min_p[:2] = [0.0, 0.0]
    got = np.asarray(_l2p(jnp.asarray(logits), jnp.asarray(temps), jnp.asarray(top_k), jnp.asarray(top_p), jnp.asarray(min_p)))
    for i in range(b):
        ref = ref_probs(logits[i], temps[i], int(top_k[i]), float(top_p[i]), float(min_p[i]))
        np.testing.assert_array_equal(got[i] > 0, ref > 0, err_msg=f"row {i}: kept set differs")
        np.testing.assert_allclose(got[i], ref, rtol=3e-5, atol=1e-7, err_msg=f"row {i}")
        np.testing.assert_allclose(got[i].sum(), 1.0, rtol=1e-5)
    # each filter alone, scalar settings, static top-k path (lax.top_k) == traced top-k path
    for kw in (dict(top_k=5), dict(top_p=0.8), dict(min_p=0.1)):
        g = np.asarray(_l2p_static_k(jnp.asarray(logits), 0.7, **kw))
        for i in range(b):
            ref = ref_probs(logits[i], 0.7, kw.get("top_k"), kw.get("top_p"), kw.get("min_p"))
            np.testing.assert_array_equal(g[i] > 0, ref > 0)
            np.testing.assert_allclose(g[i], ref, rtol=3e-5, atol=1e-7)
    np.testing.assert_array_equal(
        np.asarray(_l2p_static_k(jnp.asarray(logits), 1.0, top_k=5)), np.asarray(_l2p(jnp.asarray(logits), 1.0, top_k=5))
    )
    assert ((np.asarray(_l2p_static_k(jnp.asarray(logits), 1.0, top_k=5)) > 0).sum(-1) == 5).all()


def test_bad_parameter_shape():
    with pytest.raises(ValueError):
        S.logits_to_probs(jnp.zeros((2, 3, 5)), jnp.ones((3,)))


def test_exponential_noise_is_exp1():
    e = np.asarray(jax.jit(S.exponential_noise, static_argnums=1)(jax.random.key(0), (500_000,)), np.float64)
    assert np.isfinite(e).all() and (e > 0).all() and e.max() < 17.0
    edges = sps.expon.ppf(np.linspace(0, 1, 51))  # 50 equiprobable bins
    counts = np.histogram(e, bins=edges)[0]
    chisquare_gof(counts, np.full(50, 1 / 50), label="Exp(1) noise")
    # the small values that win races keep their resolution: the 1e-6 quantile is resolved finely
    small = np.sort(e)[:50]
    assert len(np.unique(small)) == 50
    u = np.asarray(S.uniform_from_bits(jnp.arange(0, 2**32, 2**22, dtype=jnp.uint32)))
    assert u.min() == 0.0 and u.max() < 1.0


@functools.partial(jax.jit, static_argnums=2)
def _draws(key, probs, n):
    return S.sample(key, jnp.broadcast_to(probs, (n,) + probs.shape))


def test_sample_distribution():
    # a distribution with zeros, a dominant token and a long flat tail
    vocab = 100
    p = np.zeros(vocab)
    p[0] = 0.4
    p[1] = 0.0
    p[2:] = 0.6 / (vocab - 2)
    p[vocab // 2] = 0.0
    y = np.asarray(_draws(jax.random.key(1), jnp.asarray(p, jnp.float32), 200_000))
    chisquare_gof(counts_of(y, vocab), p, label="sample()")
    # unnormalised weights give the same draws (the race needs no normalisation)
    y2 = np.asarray(_draws(jax.random.key(1), jnp.asarray(p * 1e-20, jnp.float32), 200_000))
    np.testing.assert_array_equal(y, y2)


def test_race_argmax_respects_zero_weights():
    w = jnp.array([[0.0, 0.0, 1e-30, 0.0], [0.0, 0.0, 0.0, 0.0]])
    e = jnp.array([[1e-10, 1e-10, 16.0, 1e-10], [1.0, 0.5, 0.1, 2.0]])
    assert S.race_argmax(w, e).tolist() == [2, 0]


def test_all_greedy_batches_skip_the_noise_and_pick_the_same_tokens():
    """``sample_or_argmax`` on a greedy batch returns what the sampler returns for one-hot rows
    (for any key), and on a batch that is not all greedy it is the sampler itself."""
    from specjax.sampling import all_greedy, logits_to_probs, sample, sample_or_argmax
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.normal(size=(6, 50)), jnp.float32)
    onehot = logits_to_probs(logits, jnp.zeros(6))
    for seed in range(5):
        key = jax.random.key(seed)
        quiet = jax.jit(lambda: sample_or_argmax(True, lambda: sample(key, onehot), onehot))()
        np.testing.assert_array_equal(np.asarray(quiet), np.asarray(sample(key, onehot)))
    probs = logits_to_probs(logits, jnp.ones(6))
    key = jax.random.key(7)
    noisy = sample_or_argmax(False, lambda: sample(key, probs), probs)
    np.testing.assert_array_equal(np.asarray(noisy), np.asarray(sample(key, probs)))
    assert bool(all_greedy(jnp.asarray([0.0, 0.0])))
    assert not bool(all_greedy(jnp.asarray([0.0, 1.0])))
    assert bool(all_greedy(jnp.asarray([0.0, 1.0]), where=jnp.asarray([True, False])))
