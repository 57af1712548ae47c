"""Statistical exactness of the verifiers (chi-square at alpha = 1e-6, fixed seeds).

What is shown (docs/DESIGN.md, "The math"; Leviathan et al. 2023, Chen et al. 2023):
* rejection sampling: for every position j, the token emitted at j by rows that reached j is
  distributed as p_j (bonus included); the accepted-count histogram matches prod(alpha_i) with
  alpha = 1 - TV(p, q); after a rejection at j the token follows norm(max(0, p_j - q_j)); for
  peaked, overlapping, disjoint p/q, q with holes, p == q, residual underflow, top-k / top-p / min-p
  masks, V from 2 to 151936, mixed per-row num_draft (0..K) in one batch;
* an end-to-end speculative decoding loop with a context-dependent (bigram) target and drafter emits
  sequences distributed exactly as the target's own ancestral sampling, for rejection sampling and
  target-only sampling;
* target-only: exact outputs and acceptance p(argmax q);
* negative controls: the same tests reject (a) drafts sampled from bf16 logits but verified with the
  f32 q, (b) a residual |p - q| instead of max(0, p - q), (c) resampling from p after a rejection.

Drafts are drawn with numpy (float64 inverse CDF), independently of specjax's own sampler.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax import sampling as S
from specjax import verify as V
from stats import chisquare_gof, counts_of

MIN_ROWS = 2000  # only test a conditional distribution when it has at least this many draws


# ----------------------------------------------------------------------------------------------
# harness


def _draw(rng, probs, n):
    """n draws from each row of probs [K, V] -> int [n, K] (float64 inverse CDF)."""
    probs = np.asarray(probs, np.float64)
    cdf = np.cumsum(probs / probs.sum(-1, keepdims=True), axis=-1)
    u = rng.random((n, probs.shape[0]))
    x = np.stack([np.searchsorted(cdf[k], u[:, k], side="right") for k in range(probs.shape[0])], 1)
    return np.minimum(x, probs.shape[1] - 1).astype(np.int32)


@functools.partial(jax.jit, static_argnames=("method",))
def _verify_chunk(key, x, p, q, nd, method="rs"):
    b = x.shape[0]
    P = jnp.broadcast_to(p, (b,) + p.shape)
    if method == "rs":
        return V.rejection_sample(key, x, jnp.broadcast_to(q, (b,) + q.shape), P, nd)
    return V.target_only_sample(key, x, P, nd)


def simulate(p, q, n, seed, num_draft=None, method="rs", chunk=None):
    """Verify n rows that all share p [K+1, V] and q [K, V]. Returns numpy (drafts, nd, n_acc, tokens)."""
    p = np.asarray(p, np.float32)
    q = np.asarray(q, np.float32)
    k, vocab = q.shape
    rng = np.random.default_rng(seed)
    if method == "rs":
        drafts = _draw(rng, q, n)
    else:  # target-only drafts the argmax of q
        drafts = np.broadcast_to(np.argmax(q, -1).astype(np.int32), (n, k)).copy()
    nd = np.full((n,), k, np.int32) if num_draft is None else np.asarray(num_draft, np.int32)
    chunk = chunk or n
    key = jax.random.key(seed)
    outs = []
    for i, s in enumerate(range(0, n, chunk)):
        sl = slice(s, s + chunk)
        o = _verify_chunk(jax.random.fold_in(key, i), drafts[sl], p, q, nd[sl], method=method)
        outs.append(jax.device_get(o))
    n_acc = np.concatenate([o.num_accepted for o in outs])
    tokens = np.concatenate([o.tokens for o in outs])
    return drafts, nd, n_acc, tokens


def _accept_hist_probs(alpha, d):
    """P(num_accepted = j), j = 0..d, when position i is accepted w.p. alpha[i]."""
    probs = []
    surv = 1.0
    for j in range(d):
        probs.append(surv * (1.0 - alpha[j]))
        surv *= alpha[j]
    probs.append(surv)
    return np.maximum(np.asarray(probs), 0.0)


def check_structure(drafts, nd, n_acc, tokens, vocab):
    k = drafts.shape[1]
    assert (n_acc >= 0).all() and (n_acc <= nd).all()
    j = np.arange(k + 1)[None, :]
    emitted = j <= n_acc[:, None]
    assert ((tokens >= 0) & (tokens < vocab))[emitted].all(), "emitted token out of range"
    assert (tokens[~emitted] == -1).all(), "tokens past the emitted ones must be -1"
    acc = j[:, :k] < n_acc[:, None]
    assert (tokens[:, :k][acc] == drafts[acc]).all(), "accepted tokens must equal the drafts"


def check_outputs(p, q, drafts, nd, n_acc, tokens, label, method="rs", min_rows=MIN_ROWS):
    """All distributional claims for rows sharing p [K+1, V] and q [K, V]."""
    p64 = np.asarray(p, np.float64)
    q64 = np.asarray(q, np.float64)
    k, vocab = q64.shape
    check_structure(drafts, nd, n_acc, tokens, vocab)
    if method == "rs":
        alpha = np.minimum(p64[:k], q64).sum(-1)
    else:
        alpha = p64[np.arange(k), np.argmax(q64, -1)]
    tested = 0
    for d in np.unique(nd):
        rows = nd == d
        chisquare_gof(
            counts_of(n_acc[rows], d + 1), _accept_hist_probs(alpha, d), label=f"{label}: accepted-count histogram, num_draft={d}"
        )
        tested += 1
    for j in range(k + 1):
        rows = n_acc >= j
        if rows.sum() >= min_rows:
            chisquare_gof(counts_of(tokens[rows, j], vocab), p64[j], label=f"{label}: token at position {j}")
            tested += 1
    for j in range(k):
        rows = (n_acc == j) & (nd > j)
        if method == "rs":
            resid = np.maximum(p64[j] - q64[j], 0.0)
        else:
            resid = p64[j].copy()
            resid[np.argmax(q64[j])] = 0.0
        if rows.sum() >= min_rows and resid.sum() > 1e-6:
            chisquare_gof(counts_of(tokens[rows, j], vocab), resid, label=f"{label}: token after a rejection at {j}")
            tested += 1
    return tested


def _dirichlet(rng, shape, conc=1.0):
    return rng.dirichlet(np.full(shape[-1], conc), size=shape[:-1]).astype(np.float32)


def _case(name, rng):
    k, vocab = 3, 8
    if name == "overlapping":
        return _dirichlet(rng, (k + 1, vocab)), _dirichlet(rng, (k, vocab))
    if name == "peaked":
        p = np.full((k + 1, vocab), 0.05 / (vocab - 1), np.float32)
        q = np.full((k, vocab), 0.02 / (vocab - 1), np.float32)
        for j in range(k + 1):
            p[j, j] = 0.95
        for j in range(k):
            q[j, j if j != 1 else 5] = 0.98  # q agrees with p's mode at 0 and 2, not at 1
        return p, q
    if name == "disjoint":
        p = np.zeros((k + 1, vocab), np.float32)
        p[:, :4] = _dirichlet(rng, (k + 1, 4))
        q = np.zeros((k, vocab), np.float32)
        q[:, 4:] = _dirichlet(rng, (k, 4))
        return p, q
    if name == "q_holes":  # q is zero where p has mass (and vice versa)
        p = _dirichlet(rng, (k + 1, vocab))
        p[:, 0] = 0.0
        p /= p.sum(-1, keepdims=True)
        q = _dirichlet(rng, (k, vocab))
        q[:, 1::2] = 0.0
        q /= q.sum(-1, keepdims=True)
        return p, q
    if name == "v2":
        k, vocab = 4, 2
        return _dirichlet(rng, (k + 1, vocab)), _dirichlet(rng, (k, vocab))
    raise ValueError(name)


# ----------------------------------------------------------------------------------------------
# rejection sampling


@pytest.mark.parametrize("name", ["overlapping", "peaked", "disjoint", "q_holes", "v2"])
def test_rejection_sampling_distribution(name):
    rng = np.random.default_rng({"overlapping": 1, "peaked": 2, "disjoint": 3, "q_holes": 4, "v2": 5}[name])
    p, q = _case(name, rng)
    out = simulate(p, q, 300_000, seed=1)
    tested = check_outputs(p, q, *out, label=name)
    assert tested >= 3
    if name == "disjoint":  # alpha = 0: every row rejects at 0 and emits from p_0
        assert (out[2] == 0).all()


def test_mixed_num_draft_distribution():
    rng = np.random.default_rng(7)
    k, vocab = 4, 6
    p = _dirichlet(rng, (k + 1, vocab), 2.0)
    q = (0.7 * p[:k] + 0.3 * _dirichlet(rng, (k, vocab))).astype(np.float32)
    n = 300_000
    nd = rng.integers(0, k + 1, n).astype(np.int32)  # 0..K in one batch
    out = simulate(p, q, n, seed=2, num_draft=nd)
    tested = check_outputs(p, q, *out, label="mixed num_draft")
    assert tested >= 10
    # rows with num_draft = 0 emit one token from p_0; rows never exceed their num_draft
    rows0 = nd == 0
    assert (out[2][rows0] == 0).all()
    chisquare_gof(counts_of(out[3][rows0, 0], vocab), p[0], label="num_draft=0 rows")


def test_p_equals_q_accepts_everything():
    rng = np.random.default_rng(3)
    p = _dirichlet(rng, (5, 10))
    q = p[:4].copy()
    drafts, nd, n_acc, tokens = simulate(p, q, 200_000, seed=3)
    assert (n_acc == 4).all()
    check_structure(drafts, nd, n_acc, tokens, 10)
    chisquare_gof(counts_of(tokens[:, 4], 10), p[4], label="bonus when p == q")


def test_residual_underflow_falls_back_to_p():
    # q >= p everywhere (p sums to slightly less than 1, as rounding can make it): the residual
    # max(0, p - q) is exactly zero although rejections happen. The fallback draws from p.
    vocab = 6
    q = np.full((1, vocab), 1.0 / vocab, np.float32)
    p = np.stack([q[0] * np.float32(0.5), q[0]]).astype(np.float32)  # p_0 = q / 2 (sum 0.5), p_1 = q
    p[0, 2] = q[0, 2]  # token 2 is never rejected, all others are rejected half of the time
    assert (np.maximum(p[0] - q[0], 0) == 0).all()
    drafts, nd, n_acc, tokens = simulate(p, q, 200_000, seed=4)
    check_structure(drafts, nd, n_acc, tokens, vocab)
    rej = n_acc == 0
    assert rej.sum() > 50_000
    chisquare_gof(counts_of(tokens[rej, 0], vocab), p[0], label="fallback to p_0")
    # and the tiny-residual regime: p - q ~ 1e-8 (normal floats), residual drawn from it exactly
    p2 = q.copy()
    p2[0, 0] += np.float32(3e-8)
    p2[0, 1] -= np.float32(3e-8)
    p2 = np.concatenate([p2, q]).astype(np.float32)
    drafts, nd, n_acc, tokens = simulate(p2, q, 200_000, seed=5)
    check_structure(drafts, nd, n_acc, tokens, vocab)
    assert (tokens[n_acc == 0, 0] == 0).all()  # the only positive residual entry


@pytest.mark.parametrize("mask", ["top_k", "top_p", "min_p"])
def test_sampling_masks_never_violated(mask):
    rng = np.random.default_rng(11)
    k, vocab = 2, 32
    lt = rng.normal(size=(k + 1, vocab)) * 2
    ld = lt[:k] + rng.normal(size=(k, vocab))
    kw = {"top_k": dict(top_k=5), "top_p": dict(top_p=0.7), "min_p": dict(min_p=0.1)}[mask]
    l2p = jax.jit(lambda z: S.logits_to_probs(z, 0.8, **kw))
    p = np.asarray(l2p(jnp.asarray(lt, jnp.float32)))
    q = np.asarray(l2p(jnp.asarray(ld, jnp.float32)))
    assert (p == 0).sum() > 0
    out = simulate(p, q, 100_000, seed=6)
    # chisquare_gof fails on any draw in a zero-probability bin, i.e. outside the mask
    check_outputs(p, q, *out, label=mask)


def _structured(vocab, k, rng):
    support = np.unique(np.array([0, 1, 127, 128, 1023, 1024, 2047, 2048, vocab // 2, vocab - 2, vocab - 1]) % vocab)
    p = np.zeros((k + 1, vocab), np.float32)
    q = np.zeros((k, vocab), np.float32)
    p[:, support] = _dirichlet(rng, (k + 1, len(support)), 2.0)
    q[:, support] = _dirichlet(rng, (k, len(support)), 2.0)
    return p, q


@pytest.mark.parametrize("vocab,n,chunk", [(8193, 8000, 2000), (151936, 800, 400)])
def test_large_vocab_distribution(vocab, n, chunk):
    # Few draws (the noise is [n, V]), so this catches gross errors only -- ids past a tile boundary,
    # the vocab tail, out-of-range ids -- while the small-V tests above carry the statistical power.
    rng = np.random.default_rng(vocab)
    p, q = _structured(vocab, 1, rng)
    out = simulate(p, q, n, seed=8, chunk=chunk)
    tested = check_outputs(p, q, *out, label=f"V={vocab}", min_rows=200)
    assert tested >= 3


# ----------------------------------------------------------------------------------------------
# end-to-end speculative decoding with a context-dependent target


def _bigram(rng, vocab, conc):
    return rng.dirichlet(np.full(vocab, conc), size=vocab)


def spec_decode(P, Q, n, length, k, seed, method="rs", draft_dtype=None):
    """Run n independent speculative-decoding sequences from token 0 until each has >= length tokens.

    P, Q: bigram tables [V, V] (row = previous token). Drafts follow Q (rs) or argmax Q (target-only),
    starting from the last emitted token; the verification length of each row at each step is drawn
    uniformly from 0..k independently of the drafts (non-anticipating). If ``draft_dtype`` is given, the
    drafts are sampled from softmax(log(Q) cast to that dtype) while the verifier still gets Q (the
    classic bug). Returns int [n, length].
    """
    rng = np.random.default_rng(seed)
    vocab = P.shape[0]
    Qd = Q
    if draft_dtype is not None:
        temp = 0.25
        logits = temp * np.log(Q) + 10.0  # raw drafter logits with q = softmax(logits / temp)
        Qd = np.asarray(jax.nn.softmax(jnp.asarray(logits, draft_dtype).astype(jnp.float32) / temp, -1), np.float64)
    cdf_q = np.cumsum(Qd / Qd.sum(-1, keepdims=True), -1)
    Pf = jnp.asarray(P, jnp.float32)
    Qf = jnp.asarray(Q, jnp.float32)
    out = np.full((n, length + k + 1), -1, np.int64)
    lens = np.zeros(n, np.int64)
    prev = np.zeros(n, np.int64)
    key = jax.random.key(seed)
    step = 0
    while (lens < length).any():
        x = np.zeros((n, k), np.int64)
        cur = prev.copy()
        for j in range(k):
            if method == "rs":
                u = rng.random(n)
                cur = np.minimum((u[:, None] > cdf_q[cur]).sum(-1), vocab - 1)
            else:
                cur = np.argmax(Q[cur], -1)
            x[:, j] = cur
        ctx = np.concatenate([prev[:, None], x], 1)  # p_j conditions on the token before position j
        nd = rng.integers(0, k + 1, n)
        o = _spec_step(jax.random.fold_in(key, step), jnp.asarray(x, jnp.int32), jnp.asarray(ctx, jnp.int32),
                       Pf, Qf, jnp.asarray(nd, jnp.int32), method)
        n_acc, toks = (np.asarray(a) for a in jax.device_get(o))
        for j in range(k + 1):
            m = (j <= n_acc) & (lens < length + k + 1)
            out[m, np.minimum(lens[m], out.shape[1] - 1)] = toks[m, j]
            lens = lens + m
        prev = out[np.arange(n), lens - 1]
        step += 1
    return out[:, :length]


@functools.partial(jax.jit, static_argnames=("method",))
def _spec_step(key, x, ctx, P, Q, nd, method):
    p = P[ctx]  # [n, K+1, V]
    if method == "rs":
        return V.rejection_sample(key, x, Q[ctx[:, :-1]], p, nd)
    return V.target_only_sample(key, x, p, nd)


def _joint(P, length, vocab):
    """Target probability of every sequence of `length` tokens after token 0 (row-major ids)."""
    joint = np.zeros([vocab] * length)
    for idx in np.ndindex(*([vocab] * length)):
        pr, t = 1.0, 0
        for tok in idx:
            pr *= P[t, tok]
            t = tok
        joint[idx] = pr
    return joint.ravel()


def _seq_ids(seqs, vocab):
    ids = np.zeros(seqs.shape[0], np.int64)
    for j in range(seqs.shape[1]):
        ids = ids * vocab + seqs[:, j]
    return ids


@pytest.mark.parametrize("method", ["rs", "to"])
def test_end_to_end_sequences_match_target(method):
    rng = np.random.default_rng(21)
    vocab, length, k = 4, 3, 3
    P = _bigram(rng, vocab, 1.0)
    Q = 0.5 * P + 0.5 * _bigram(rng, vocab, 1.0)
    seqs = spec_decode(P, Q, 200_000, length, k, seed=22, method=method)
    chisquare_gof(counts_of(_seq_ids(seqs, vocab), vocab**length), _joint(P, length, vocab),
                  label=f"{method}: first {length} tokens vs target ancestral sampling")


# ----------------------------------------------------------------------------------------------
# target-only


def test_target_only_distribution_and_acceptance():
    rng = np.random.default_rng(31)
    k, vocab = 3, 8
    p = _dirichlet(rng, (k + 1, vocab), 0.5)
    q = (0.6 * p[:k] + 0.4 * _dirichlet(rng, (k, vocab), 0.5)).astype(np.float32)
    n = 300_000
    nd = rng.integers(0, k + 1, n).astype(np.int32)
    out = simulate(p, q, n, seed=32, num_draft=nd, method="to")
    tested = check_outputs(p, q, *out, label="target-only", method="to")
    assert tested >= 8
    # acceptance at position 0 is p_0(argmax q_0)
    rows = nd >= 1
    acc0 = (out[2][rows] >= 1).sum()
    a = p[0, np.argmax(q[0])]
    chisquare_gof([acc0, rows.sum() - acc0], [a, 1 - a], label="target-only acceptance = p(argmax q)")


# ----------------------------------------------------------------------------------------------
# negative controls: the same tests must catch biased samplers


def _textbook_rs(key, x, q, p, residual):
    """A straightforward single-position rejection sampler with a pluggable residual (for controls)."""
    ku, ke = jax.random.split(key)
    b = x.shape[0]
    qx = q[jnp.arange(b), x]
    px = p[jnp.arange(b), x]
    acc = jax.random.uniform(ku, (b,)) * qx < px
    w = {"max0": jnp.maximum(p - q, 0.0), "abs": jnp.abs(p - q), "p": p}[residual]
    y = S.race_argmax(w, S.exponential_noise(ke, w.shape))
    return jnp.where(acc, x, y)


@pytest.mark.parametrize("residual", ["max0", "abs", "p"])
def test_negative_control_residual(residual):
    rng = np.random.default_rng(41)
    vocab, n = 8, 300_000
    p = _dirichlet(rng, (1, vocab))[0]
    q = _dirichlet(rng, (1, vocab))[0]
    x = _draw(rng, q[None], n)[:, 0]
    y = jax.jit(_textbook_rs, static_argnums=4)(
        jax.random.key(42), jnp.asarray(x), jnp.broadcast_to(jnp.asarray(q), (n, vocab)),
        jnp.broadcast_to(jnp.asarray(p), (n, vocab)), residual
    )
    res = chisquare_gof(counts_of(np.asarray(y), vocab), p, check=False)
    if residual == "max0":
        assert res.passed, f"the correct textbook sampler must pass: {res}"
    else:
        assert not res.passed and res.pvalue < 1e-12, f"biased residual {residual!r} was not caught: {res}"


def test_negative_control_bf16_drafts():
    # drafts sampled from bf16-rounded logits (T = 0.25) but verified against the f32 q: biased,
    # and the end-to-end test sees it; the same test with f32 drafts passes (test above).
    rng = np.random.default_rng(51)
    vocab, length, k = 4, 2, 2
    # raw drafter logits near 10, temperature 0.25: bf16 rounding (spacing 0.0625 there) moves the
    # drafted probabilities by up to ~13%
    Q = _bigram(rng, vocab, 1.0)
    P = 0.3 * _bigram(rng, vocab, 1.0) + 0.7 * Q  # a target close to the drafter
    joint = _joint(P, length, vocab)
    seqs = spec_decode(P, Q, 200_000, length, k, seed=52, draft_dtype=jnp.bfloat16)
    res = chisquare_gof(counts_of(_seq_ids(seqs, vocab), vocab**length), joint, check=False)
    assert not res.passed and res.pvalue < 1e-12, f"bf16-drafting bias was not caught: {res}"
    # positive control: the identical setup with drafts from the f32 q passes
    seqs = spec_decode(P, Q, 200_000, length, k, seed=52)
    chisquare_gof(counts_of(_seq_ids(seqs, vocab), vocab**length), joint, label="f32 drafts (positive control)")
