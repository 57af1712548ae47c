"""Deterministic properties of specjax.verify: shapes, num_draft handling, batch invariance,
determinism, no NaN / out-of-range ids, the flattened ragged form, and greedy == greedy decoding."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax import sampling as S
from specjax import verify as V
from specjax import verify_flat as VF


def make_batch(seed, b, k, vocab, overlap=0.5, sharp=2.0):
    """numpy test data (no XLA compiles): x [B,K] ~ q, q [B,K,V], p [B,K+1,V], num_draft [B] (0 and K included)."""
    rng = np.random.default_rng(seed)

    def softmax(z):
        z = np.exp(z - z.max(-1, keepdims=True))
        return z / z.sum(-1, keepdims=True)

    p = softmax(sharp * rng.normal(size=(b, k + 1, vocab))).astype(np.float32)
    q = (overlap * p[:, :k] + (1 - overlap) * softmax(sharp * rng.normal(size=(b, k, vocab)))).astype(np.float32)
    cdf = np.cumsum(q.astype(np.float64), -1)
    x = np.minimum((rng.random((b, k, 1)) * cdf[..., -1:] > cdf).sum(-1), vocab - 1).astype(np.int32)
    nd = rng.integers(0, k + 1, b).astype(np.int32)
    nd[0], nd[-1] = 0, k
    return jnp.asarray(x), jnp.asarray(q), jnp.asarray(p), jnp.asarray(nd)


def make_noise(seed, b, k, vocab):
    """numpy explicit noise: uniforms [B,K] in [0,1), exponentials [B,V] > 0."""
    rng = np.random.default_rng(seed)
    u = rng.random((b, k), dtype=np.float32)
    e = np.maximum(rng.exponential(size=(b, vocab)), 1e-30).astype(np.float32)
    return jnp.asarray(u), jnp.asarray(e)


def assert_same(a: V.VerifyOutput, b: V.VerifyOutput):
    np.testing.assert_array_equal(np.asarray(a.num_accepted), np.asarray(b.num_accepted))
    np.testing.assert_array_equal(np.asarray(a.tokens), np.asarray(b.tokens))


def check_structure(out, x, nd, vocab):
    n = np.asarray(out.num_accepted)
    t = np.asarray(out.tokens)
    x = np.asarray(x)
    b, k = x.shape
    assert out.num_accepted.dtype == jnp.int32 and out.tokens.dtype == jnp.int32
    assert t.shape == (b, k + 1) and n.shape == (b,)
    assert ((n >= 0) & (n <= np.asarray(nd))).all()
    j = np.arange(k + 1)[None]
    assert (t[j > n[:, None]] == -1).all()
    emitted = t[j <= n[:, None]]
    assert ((emitted >= 0) & (emitted < vocab)).all()
    acc = j[:, :k] < n[:, None]
    assert (t[:, :k][acc] == x[acc]).all()


# ----------------------------------------------------------------------------------------------
# padded forms


@pytest.mark.parametrize("b,k,vocab", [(1, 1, 2), (8, 8, 1000)])
def test_rejection_structure_and_jit(b, k, vocab):
    x, q, p, nd = make_batch(0, b, k, vocab)
    key = jax.random.key(1)
    out = V.rejection_sample(key, x, q, p, nd)
    check_structure(out, x, nd, vocab)
    assert_same(out, jax.jit(V.rejection_sample)(key, x, q, p, nd))
    assert_same(out, V.rejection_sample(key, x, q, p, nd))  # determinism for a fixed key
    # the keyed form is the explicit form over verify_noise
    u, e = V.verify_noise(key, b, k, vocab)
    assert_same(out, V.rejection_sample_with_noise(x, q, p, u, e, nd))
    # default num_draft = K
    check_structure(V.rejection_sample(key, x, q, p), x, np.full(b, k), vocab)


def test_num_draft_zero_and_full_and_truncation():
    b, k, vocab = 6, 5, 50
    x, q, p, _ = make_batch(2, b, k, vocab, overlap=0.9)
    nd = jnp.array([0, 1, 2, 3, 5, 0], jnp.int32)
    u, e = make_noise(3, b, k, vocab)
    out = V.rejection_sample_with_noise(x, q, p, u, e, nd)
    check_structure(out, x, nd, vocab)
    assert int(out.num_accepted[0]) == 0 and int(out.num_accepted[5]) == 0
    # a row with num_draft = d gives the same result as the row truncated to K = d
    for i in range(b):
        d = int(nd[i])
        alone = V.rejection_sample_with_noise(
            x[i : i + 1, :d], q[i : i + 1, :d], p[i : i + 1, : d + 1], u[i : i + 1, :d], e[i : i + 1], None
        )
        assert int(alone.num_accepted[0]) == int(out.num_accepted[i])
        np.testing.assert_array_equal(np.asarray(alone.tokens[0]), np.asarray(out.tokens[i, : d + 1]))
        assert (np.asarray(out.tokens[i, d + 1 :]) == -1).all()


def test_batch_invariance_with_row_keys():
    b, k, vocab = 7, 4, 100
    x, q, p, nd = make_batch(4, b, k, vocab)
    keys = jax.random.split(jax.random.key(5), b)
    out = V.rejection_sample(keys, x, q, p, nd)
    for i in range(b):
        sl = slice(i, i + 1)
        assert_same(V.VerifyOutput(out.num_accepted[sl], out.tokens[sl]), V.rejection_sample(keys[sl], x[sl], q[sl], p[sl], nd[sl]))
    # one key == the same key split into per-row keys
    key = jax.random.key(6)
    assert_same(V.rejection_sample(key, x, q, p, nd), V.rejection_sample(jax.random.split(key, b), x, q, p, nd))


def test_hand_computed_cases():
    vocab = 4
    p = jnp.array([[[0.1, 0.2, 0.3, 0.4], [0.25, 0.25, 0.25, 0.25]]], jnp.float32)
    q = jnp.array([[[0.4, 0.3, 0.2, 0.1]]], jnp.float32)
    e = jnp.ones((1, vocab), jnp.float32)
    # x = 2: q(2) = 0.2 <= p(2) = 0.3 -> accepted whatever u; bonus = race on p_1 with equal noise -> first max = 0
    out = V.rejection_sample_with_noise(jnp.array([[2]]), q, p, jnp.array([[0.999]]), e)
    assert out.num_accepted.tolist() == [1] and out.tokens.tolist() == [[2, 0]]
    # x = 0: accept iff u * 0.4 < 0.1 -> u = 0.3 rejects; residual max(0, p - q) = [0, 0, 0.1, 0.3] -> 3
    out = V.rejection_sample_with_noise(jnp.array([[0]]), q, p, jnp.array([[0.3]]), e)
    assert out.num_accepted.tolist() == [0] and out.tokens.tolist() == [[3, -1]]
    out = V.rejection_sample_with_noise(jnp.array([[0]]), q, p, jnp.array([[0.2]]), e)
    assert out.tokens.tolist() == [[0, 0]]
    # the noise decides within the residual: make entry 2 win (w/E: 0.1/0.01 > 0.3/1)
    e2 = jnp.array([[1.0, 1.0, 0.01, 1.0]], jnp.float32)
    out = V.rejection_sample_with_noise(jnp.array([[0]]), q, p, jnp.array([[0.3]]), e2)
    assert out.tokens.tolist() == [[2, -1]]
    # q(x) = 0 at the drafted token: always rejected, even with u = 0
    q0 = jnp.array([[[0.0, 0.5, 0.5, 0.0]]], jnp.float32)
    out = V.rejection_sample_with_noise(jnp.array([[0]]), q0, p, jnp.array([[0.0]]), e)
    assert out.num_accepted.tolist() == [0] and out.tokens[0, 0] in (0, 3)
    # an out-of-range draft id (a bug upstream) is rejected, never emitted
    for bad in (-1, vocab, 10**6):
        out = V.rejection_sample_with_noise(jnp.array([[bad]]), q, p, jnp.array([[0.0]]), e)
        assert out.num_accepted.tolist() == [0] and 0 <= int(out.tokens[0, 0]) < vocab


def test_no_nan_no_out_of_range_edge_cases():
    vocab = 9
    # p == q exactly: residual is zero, everything accepted, bonus from p_K
    p = jnp.tile(jnp.arange(1, vocab + 1, dtype=jnp.float32)[None, None] / 45.0, (3, 4, 1))
    q = p[:, :3]
    x = jnp.array([[0, 4, 8], [8, 8, 8], [1, 2, 3]], jnp.int32)
    u, e = make_noise(7, 3, 3, vocab)
    out = V.rejection_sample_with_noise(x, q, p, jnp.full_like(u, 0.999999), e)
    assert out.num_accepted.tolist() == [3, 3, 3]
    # residual all zero with rejections (q >= p, p sums to < 1): fallback to p, valid ids
    p2 = q * 0.5
    p2 = jnp.concatenate([p2, p[:, 3:]], axis=1)
    out = V.rejection_sample_with_noise(x, q, p2, jnp.full_like(u, 0.9), e)
    assert out.num_accepted.tolist() == [0, 0, 0]
    t = np.asarray(out.tokens[:, 0])
    assert ((t >= 0) & (t < vocab)).all()
    # residual below float32 range (denormal differences flush to zero): still a valid id
    p3 = q.at[:, :, 0].add(1e-42).at[:, :, 1].add(-1e-42)
    p3 = jnp.concatenate([p3, p[:, 3:]], axis=1)
    out = V.rejection_sample_with_noise(x, q, p3, jnp.full_like(u, 0.999999), e)
    t = np.asarray(out.tokens)
    assert ((t >= -1) & (t < vocab)).all()
    # all-zero target rows (garbage padding rows): valid ids, no NaN
    z = jnp.zeros((3, 4, vocab), jnp.float32)
    out = V.rejection_sample_with_noise(x, q, z, u, e)
    assert out.num_accepted.tolist() == [0, 0, 0]
    assert ((np.asarray(out.tokens[:, 0]) >= 0) & (np.asarray(out.tokens[:, 0]) < vocab)).all()


def test_bf16_probs_are_read_exactly():
    b, k, vocab = 4, 3, 64
    x, q, p, nd = make_batch(8, b, k, vocab)
    q16, p16 = q.astype(jnp.bfloat16), p.astype(jnp.bfloat16)
    u, e = make_noise(9, b, k, vocab)
    assert_same(
        V.rejection_sample_with_noise(x, q16, p16, u, e, nd),
        V.rejection_sample_with_noise(x, q16.astype(jnp.float32), p16.astype(jnp.float32), u, e, nd),
    )


def test_target_only_structure_and_rule():
    b, k, vocab = 6, 4, 30
    _, q, p, nd = make_batch(10, b, k, vocab)
    x = jnp.argmax(q, -1).astype(jnp.int32)
    u, e = V.verify_noise(jax.random.key(11), b, k, vocab)
    out = V.target_only_sample_with_noise(x, p, u, e, nd)
    check_structure(out, x, nd, vocab)
    assert_same(out, V.target_only_sample(jax.random.key(11), x, p, nd))
    # acceptance rule u < p(x), chain until the first rejection
    pa = np.take_along_axis(np.asarray(p[:, :k]), np.asarray(x)[..., None], -1)[..., 0]
    acc = (np.asarray(u) < pa) & (np.arange(k)[None] < np.asarray(nd)[:, None])
    n = np.cumprod(acc, 1).sum(1)
    np.testing.assert_array_equal(np.asarray(out.num_accepted), n)
    # a rejected draft is never re-emitted at its own position
    for i in range(b):
        if n[i] < int(nd[i]):
            assert int(out.tokens[i, n[i]]) != int(x[i, n[i]])


def test_k_zero():
    b, vocab = 3, 17
    _, _, p, _ = make_batch(0, b, 0, vocab)
    x = jnp.zeros((b, 0), jnp.int32)
    q = jnp.zeros((b, 0, vocab), jnp.float32)
    out = V.rejection_sample(jax.random.key(1), x, q, p)
    assert out.tokens.shape == (b, 1) and out.num_accepted.tolist() == [0] * b
    out = V.target_only_sample(jax.random.key(1), x, p)
    assert out.tokens.shape == (b, 1)
    out = V.greedy_verify(x, jnp.log(p))
    np.testing.assert_array_equal(np.asarray(out.tokens[:, 0]), np.asarray(jnp.argmax(p[:, 0], -1)))


def test_temperature_zero_rejection_sampling_is_greedy():
    # one-hot p and q (logits_to_probs at T = 0): rejection sampling reduces to greedy verification
    b, k, vocab = 16, 4, 11
    rng = np.random.default_rng(12)
    lt = jnp.asarray(rng.normal(size=(b, k + 1, vocab)), jnp.float32)
    ld = lt[:, :k] + jnp.asarray(0.8 * rng.normal(size=(b, k, vocab)), jnp.float32)
    p = S.logits_to_probs(lt, 0.0)
    q = S.logits_to_probs(ld, 0.0)
    x = jnp.argmax(ld, -1).astype(jnp.int32)
    nd = jnp.asarray(rng.integers(0, k + 1, b), jnp.int32)
    u, e = make_noise(15, b, k, vocab)
    assert_same(V.rejection_sample_with_noise(x, q, p, u, e, nd), V.greedy_verify(x, lt, nd))


# ----------------------------------------------------------------------------------------------
# greedy == greedy autoregressive decoding


class ToyLM:
    """A deterministic 'model': next-token logits from a table indexed by the last two tokens."""

    def __init__(self, seed, vocab):
        self.vocab = vocab
        self.table = np.random.default_rng(seed).normal(size=(vocab, vocab, vocab)).astype(np.float32)

    def logits(self, seq):  # logits for the token after seq
        return self.table[seq[-2], seq[-1]]


def greedy_ar(lm, prompt, n):
    seq = list(prompt)
    while len(seq) < len(prompt) + n:
        seq.append(int(np.argmax(lm.logits(seq))))
    return seq


def greedy_speculative(target, drafter, prompt, n, k, rng):
    seq = list(prompt)
    steps = 0
    while len(seq) < len(prompt) + n:
        drafts = []
        ctx = list(seq)
        for _ in range(k):
            drafts.append(int(np.argmax(drafter.logits(ctx))))
            ctx.append(drafts[-1])
        logits = np.stack([target.logits(seq + drafts[:j]) for j in range(k + 1)])  # [K+1, V]
        nd = int(rng.integers(0, k + 1))
        out = V.greedy_verify(jnp.asarray([drafts], jnp.int32), jnp.asarray(logits[None]), jnp.asarray([nd]))
        t = np.asarray(out.tokens[0])
        seq.extend(int(v) for v in t[: int(out.num_accepted[0]) + 1])
        steps += 1
    return seq[: len(prompt) + n], steps


def test_greedy_matches_autoregressive_decoding():
    vocab = 12
    target = ToyLM(0, vocab)
    rng = np.random.default_rng(1)
    for noise, k in [(0.0, 4), (0.7, 3), (3.0, 5)]:
        drafter = ToyLM(0, vocab)
        drafter.table = target.table + noise * rng.normal(size=target.table.shape).astype(np.float32)
        prompt = [1, 2]
        ref = greedy_ar(target, prompt, 40)
        got, steps = greedy_speculative(target, drafter, prompt, 40, k, rng)
        assert got == ref, f"noise={noise}"
        if noise == 0.0:
            assert steps < 40  # a perfect drafter accepts (nearly) everything


def test_greedy_verify_batched_rule():
    b, k, vocab = 8, 5, 20
    logits = jnp.asarray(np.random.default_rng(20).normal(size=(b, k + 1, vocab)), jnp.bfloat16)
    am = np.asarray(jnp.argmax(logits, -1))
    rng = np.random.default_rng(0)
    x = np.where(rng.random((b, k)) < 0.7, am[:, :k], (am[:, :k] + 1) % vocab).astype(np.int32)
    nd = np.array([0, 1, 2, 3, 4, 5, 5, 5], np.int32)
    out = V.greedy_verify(jnp.asarray(x), logits, jnp.asarray(nd))
    for i in range(b):
        n = 0
        while n < nd[i] and x[i, n] == am[i, n]:
            n += 1
        assert int(out.num_accepted[i]) == n
        assert out.tokens[i].tolist() == list(x[i, :n]) + [int(am[i, n])] + [-1] * (k - n)


# ----------------------------------------------------------------------------------------------
# flattened ragged form == padded form


@pytest.mark.parametrize("extra_slots", [0, 7])
def test_flat_equals_padded(extra_slots):
    b, k, vocab = 9, 6, 77
    x, q, p, nd = make_batch(30, b, k, vocab, overlap=0.8)
    u, e = make_noise(31, b, k, vocab)
    pk = VF.pack_flat(x, q, p, u, nd, num_draft_slots=int(nd.sum()) + extra_slots,
                     num_target_slots=int(nd.sum()) + b + extra_slots)
    padded = V.rejection_sample_with_noise(x, q, p, u, e, nd)
    flat = VF.rejection_sample_flat_with_noise(
        pk["draft_tokens"], pk["draft_probs"], pk["target_probs"], pk["draft_offsets"], pk["target_offsets"],
        pk["num_draft"], pk["uniforms"], e, max_draft=k,
    )
    assert_same(flat, padded)
    flat_jit = jax.jit(VF.rejection_sample_flat_with_noise, static_argnames="max_draft")(
        pk["draft_tokens"], pk["draft_probs"], pk["target_probs"], pk["draft_offsets"], pk["target_offsets"],
        pk["num_draft"], pk["uniforms"], e, max_draft=k,
    )
    assert_same(flat_jit, padded)
    # keyed forms agree for the same (per-row) keys
    keys = jax.random.split(jax.random.key(32), b)
    assert_same(
        VF.rejection_sample_flat(keys, pk["draft_tokens"], pk["draft_probs"], pk["target_probs"],
                                pk["draft_offsets"], pk["target_offsets"], pk["num_draft"], max_draft=k),
        V.rejection_sample(keys, x, q, p, nd),
    )
    # target-only and greedy
    xa = jnp.argmax(q, -1).astype(jnp.int32)
    pk2 = VF.pack_flat(xa, None, p, u, nd)
    assert_same(
        VF.target_only_sample_flat_with_noise(pk2["draft_tokens"], pk2["target_probs"], pk2["draft_offsets"],
                                             pk2["target_offsets"], pk2["num_draft"], pk2["uniforms"], e, max_draft=k),
        V.target_only_sample_with_noise(xa, p, u, e, nd),
    )
    logits = jnp.log(p)
    pk3 = VF.pack_flat(xa, None, logits, u, nd)
    assert_same(
        VF.greedy_verify_flat(pk3["draft_tokens"], pk3["target_probs"], pk3["draft_offsets"], pk3["target_offsets"],
                             pk3["num_draft"], max_draft=k),
        V.greedy_verify(xa, logits, nd),
    )


def test_flat_custom_layout_and_segments():
    # rows packed out of order with gaps, targets interleaved as in a flat verification batch
    vocab, k = 13, 3
    x, q, p, _ = make_batch(40, 3, k, vocab, overlap=0.9)
    nd = jnp.array([2, 0, 3], jnp.int32)
    u, e = make_noise(41, 3, k, vocab)
    d_off = jnp.array([6, 0, 1], jnp.int32)  # row 0 drafts at 6..7, row 2 at 1..3, row 1 none
    t_off = jnp.array([0, 3, 4], jnp.int32)  # row 0 targets 0..2, row 1 at 3, row 2 at 4..7
    n_flat, m_flat = 9, 8
    dt = np.full(n_flat, -1, np.int32)
    dp = np.zeros((n_flat, vocab), np.float32)
    uf = np.zeros(n_flat, np.float32)
    tp = np.zeros((m_flat, vocab), np.float32)
    for r in range(3):
        for j in range(int(nd[r])):
            dt[int(d_off[r]) + j] = int(x[r, j])
            dp[int(d_off[r]) + j] = np.asarray(q[r, j])
            uf[int(d_off[r]) + j] = float(u[r, j])
        for j in range(int(nd[r]) + 1):
            tp[int(t_off[r]) + j] = np.asarray(p[r, j])
    flat = VF.rejection_sample_flat_with_noise(dt, dp, tp, d_off, t_off, nd, uf, e, max_draft=k)
    assert_same(flat, V.rejection_sample_with_noise(x, q, p, u, e, nd))
    seg, pos = VF.flat_segment_ids(t_off, nd + 1, 10)
    assert seg.tolist() == [0, 0, 0, 1, 2, 2, 2, 2, -1, -1]
    assert pos.tolist() == [0, 1, 2, 0, 0, 1, 2, 3, -1, -1]
    d, t = VF.flat_offsets(jnp.array([2, 0, 3]))
    assert d.tolist() == [0, 2, 2] and t.tolist() == [0, 3, 4]


def test_backend_dispatch_pallas_equals_jnp_and_auto_resolves_by_platform():
    """``impl="pallas"`` (the kernel module; off TPU/GPU its jnp mirror) picks bit-identical tokens
    to the gather-based verifier from the same key; "auto" means the kernel on TPU / GPU only."""
    from specjax.verify import rejection_sample, resolve_impl
    rng = np.random.default_rng(3)
    b, k, v = 6, 3, 50
    q = rng.dirichlet(np.ones(v) * 0.3, size=(b, k)).astype(np.float32)
    p = rng.dirichlet(np.ones(v) * 0.3, size=(b, k + 1)).astype(np.float32)
    x = np.stack([[rng.choice(v, p=q[i, j] / q[i, j].sum()) for j in range(k)] for i in range(b)])
    nd = rng.integers(0, k + 1, size=b).astype(np.int32)
    keys = jax.random.split(jax.random.key(0), b)
    a = rejection_sample(keys, x, q, p, nd, impl="jnp")
    c = rejection_sample(keys, x, q, p, nd, impl="pallas")
    np.testing.assert_array_equal(np.asarray(a.tokens), np.asarray(c.tokens))
    np.testing.assert_array_equal(np.asarray(a.num_accepted), np.asarray(c.num_accepted))
    assert resolve_impl("auto", "cpu") == "jnp"
    assert resolve_impl("auto", "tpu") == resolve_impl("auto", "gpu") == "pallas"
    assert resolve_impl("jnp", "tpu") == "jnp"
    with pytest.raises(ValueError):
        resolve_impl("cuda")
