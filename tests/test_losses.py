"""Losses: hand values, float64 numpy references, Bebop eq. 11, e2e-TV finite differences, masks,
zero-probability targets, and the compiled-memory property of the custom-VJP TV loss."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax import losses as L
from specjax.losses import tv as tv_losses

FLOOR = L.DEFAULT_LOG_P_FLOOR


# ---------------------------------------------------------------- float64 numpy references
def np_softmax(z):
    z = np.asarray(z, np.float64)
    e = np.exp(z - z.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def np_ce(z, labels):
    z = np.asarray(z, np.float64)
    lse = np.log(np.exp(z - z.max(-1, keepdims=True)).sum(-1)) + z.max(-1)
    return lse - np.take_along_axis(z, labels[..., None], -1)[..., 0]


def np_kl(z, p):
    q, p = np_softmax(z), np.asarray(p, np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        t = np.where(p > 0, p * (np.log(p) - np.log(q)), 0.0)
    return t.sum(-1)


def np_rkl(z, p, floor=FLOOR):
    q, p = np_softmax(z), np.asarray(p, np.float64)
    with np.errstate(divide="ignore"):
        lp = np.maximum(np.log(p), floor)
    return np.where(q > 0, q * (np.log(q) - lp), 0.0).sum(-1)


def np_tv(z, p):
    return 1.0 - np.minimum(np_softmax(z), np.asarray(p, np.float64)).sum(-1)


def np_tv_grad_eq11(z, p):
    """Bebop eq. 11: dtv/dz_j = -q_j([q_j <= p_j] - S), S = sum_v [q_v <= p_v] q_v."""
    q, p = np_softmax(z), np.asarray(p, np.float64)
    ind = (q <= p).astype(np.float64)
    s = (ind * q).sum(-1, keepdims=True)
    return -q * (ind - s)


def np_e2e(z, p):
    alpha = 1.0 - np_tv(z, p)
    return 1.0 - np.cumprod(alpha, -1).mean(-1)


def np_dspark(z, p, labels, conf, w=None, coefs=(0.1, 0.9, 1.0)):
    g = z.shape[-2]
    w = np.exp(-np.arange(g) / g) if w is None else w
    tv = np_tv(z, p)
    c = 1.0 / (1.0 + np.exp(-np.asarray(conf, np.float64)))
    t = 1.0 - tv
    bce = -(t * np.log(c) + (1 - t) * np.log(1 - c))
    l1 = np.abs(np_softmax(z) - p).sum(-1)
    return (w * (coefs[0] * np_ce(z, labels) + coefs[1] * l1 + coefs[2] * bce)).sum(-1)


def value_and_grad(fn, x):
    """Jitted per-position values and the gradient of their sum (one compile instead of many
    eager primitive dispatches: keeps the file fast on a shared 2-core machine)."""
    return jax.jit(lambda y: (fn(y), jax.grad(lambda v: jnp.sum(fn(v)))(y)))(jnp.asarray(x))


def random_inputs(seed, shape, zero_frac=0.3, scale=3.0):
    """Draft logits and a target distribution with exact zeros (as top-k / top-p masks make)."""
    rng = np.random.default_rng(seed)
    z = rng.normal(size=shape) * scale
    logits_p = rng.normal(size=shape) * scale
    logits_p[rng.random(shape) < zero_frac] = -np.inf
    logits_p[..., 0] = 0.0  # at least one non-zero entry per row
    p = np_softmax(logits_p)
    return z.astype(np.float32), p.astype(np.float32)


# ---------------------------------------------------------------- hand-computed values
Z3 = np.log(np.array([1.0, 2.0, 1.0], np.float32))  # q = [.25, .5, .25]
P3 = np.array([0.6, 0.4, 0.0], np.float32)


def test_hand_values_under_jit():
    z, p = jnp.asarray(Z3), jnp.asarray(P3)
    assert float(jax.jit(L.ce_loss)(z, jnp.asarray(1))) == pytest.approx(math.log(2), abs=1e-6)
    # KL(p||q) = .6 ln(.6/.25) + .4 ln(.4/.5); the p=0 term is 0.
    kl = 0.6 * math.log(0.6 / 0.25) + 0.4 * math.log(0.4 / 0.5)
    assert float(jax.jit(L.kl_loss)(z, p)) == pytest.approx(kl, abs=1e-6)
    # KL(q||p) with log 0 clamped to the floor.
    rkl = 0.25 * math.log(0.25 / 0.6) + 0.5 * math.log(0.5 / 0.4) + 0.25 * (math.log(0.25) - FLOOR)
    assert float(jax.jit(L.reverse_kl_loss)(z, p)) == pytest.approx(rkl, abs=1e-5)
    # TV: min = [.25, .4, 0] -> 1 - .65.
    assert float(jax.jit(L.tv_loss)(z, p)) == pytest.approx(0.35, abs=1e-6)
    # eq. 11: ind = [1, 0, 0], S = .25 -> -q(ind - S) = [-.1875, .125, .0625].
    g = jax.jit(jax.grad(L.tv_loss))(z, p)
    np.testing.assert_allclose(g, [-0.1875, 0.125, 0.0625], atol=1e-6)


def test_e2e_and_dspark_hand_values():
    # Three positions with tv = [.35, .5, 0]: alpha = [.65, .5, 1], prefix products
    # [.65, .325, .325], e2e = 1 - (.65 + .325 + .325)/3 = 1 - 1.3/3.
    z = np.stack([Z3, np.log([1.0, 1.0, 2.0]), np.log([1.0, 1.0, 1.0])])
    z = jnp.asarray(z.astype(np.float32))
    p = jnp.asarray(np.array([P3, [0.5, 0.5, 0.0], [1 / 3] * 3], np.float32))
    tv = jax.jit(L.tv_loss)(z, p)
    np.testing.assert_allclose(tv, [0.35, 0.5, 0.0], atol=1e-6)
    assert float(jax.jit(L.e2e_tv_loss)(z, p)) == pytest.approx(1 - 1.3 / 3, abs=1e-6)
    # DSpark at conf logit 0 (c = .5): bce = ln 2 whatever the target.
    labels = jnp.asarray([1, 0, 2])
    conf = jnp.zeros(3)
    w = np.exp(-np.arange(3) / 3)
    ce = np.array([math.log(2), math.log(4), math.log(3)])
    want = np.sum(w * (0.1 * ce + 0.9 * 2 * np.array([0.35, 0.5, 0.0]) + math.log(2)))
    assert float(jax.jit(L.dspark_loss)(z, p, labels, conf)) == pytest.approx(want, abs=1e-5)
    np.testing.assert_allclose(L.dspark_position_weights(3), w, rtol=1e-6)


# ---------------------------------------------------------------- float64 references
def test_losses_match_float64_reference():
    z, p = random_inputs(0, (4, 3, 50))
    labels = np.random.default_rng(1).integers(0, 50, size=(4, 3))
    conf = np.random.default_rng(2).normal(size=(4, 3)).astype(np.float32) * 2
    tol = dict(rtol=2e-5, atol=2e-6)
    np.testing.assert_allclose(jax.jit(L.ce_loss)(z, labels), np_ce(z, labels), **tol)
    np.testing.assert_allclose(jax.jit(L.kl_loss)(z, p), np_kl(z, p), **tol)
    np.testing.assert_allclose(jax.jit(L.reverse_kl_loss)(z, p), np_rkl(z, p), rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(jax.jit(L.tv_loss)(z, p), np_tv(z, p), **tol)
    np.testing.assert_allclose(jax.jit(L.tv_loss_autodiff)(z, p), np_tv(z, p), **tol)
    np.testing.assert_allclose(jax.jit(L.e2e_tv_loss)(z, p), np_e2e(z, p), **tol)
    np.testing.assert_allclose(jax.jit(L.dspark_loss)(z, p, labels, conf),
                               np_dspark(z, p, labels, conf), **tol)


def test_x64_inputs_stay_float64():
    z, p = random_inputs(3, (5, 40))
    with jax.enable_x64(True):
        z64, p64 = jnp.asarray(z, jnp.float64), jnp.asarray(p, jnp.float64)
        tv, g = value_and_grad(lambda x: L.tv_loss(x, p64), z64)
        assert tv.dtype == jnp.float64 and g.dtype == jnp.float64
        np.testing.assert_allclose(tv, np_tv(z, p), rtol=1e-12, atol=1e-14)
        np.testing.assert_allclose(g, np_tv_grad_eq11(z, p), rtol=1e-12, atol=1e-15)
        np.testing.assert_allclose(jax.jit(L.kl_loss)(z64, p64), np_kl(z, p),
                                   rtol=1e-12, atol=1e-14)


def test_axis_argument():
    z, p = random_inputs(4, (6, 30))
    labels = np.arange(6) % 30
    def both(z, p):
        return (L.tv_loss(z, p), L.kl_loss(z, p), L.reverse_kl_loss(z, p), L.ce_loss(z, labels))

    def both_t(zt, pt):
        return (L.tv_loss(zt, pt, axis=0), L.kl_loss(zt, pt, axis=0),
                L.reverse_kl_loss(zt, pt, axis=0), L.ce_loss(zt, labels, axis=0))

    for a, b in zip(jax.jit(both)(z, p), jax.jit(both_t)(z.T, p.T)):
        np.testing.assert_allclose(a, b, rtol=1e-6)


# ---------------------------------------------------------------- TV gradient: eq. 11 and autodiff
@pytest.mark.parametrize("chunk_size", [None, 0, 1, 4])
def test_tv_gradient_is_bebop_eq11_and_autodiff(chunk_size):
    z, p = random_inputs(5, (3, 4, 64))
    cot = np.random.default_rng(6).normal(size=(3, 4)).astype(np.float32)  # non-uniform upstream

    def f(fn):
        return jax.jit(jax.grad(lambda x: jnp.sum(cot * fn(x, p))))(z)

    g = f(lambda x, p: L.tv_loss(x, p, chunk_size=chunk_size))
    np.testing.assert_allclose(g, cot[..., None] * np_tv_grad_eq11(z, p), rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(g, f(L.tv_loss_autodiff), rtol=1e-5, atol=1e-7)
    # Bebop Prop. 3: bounded gradient |dtv/dz_j| <= q_j (per unit upstream gradient).
    assert np.all(np.abs(g) <= np.abs(cot)[..., None] * np_softmax(z) + 1e-7)


def test_tv_chunking_does_not_change_values_or_vmap():
    z, p = random_inputs(7, (12, 33))
    sizes = (0, 1, 2, 5, 7, 100)  # 5 and 7 do not divide 12: rounded down to a divisor
    vals = jax.jit(lambda z, p: [L.tv_loss(z, p, chunk_size=cs) for cs in sizes])(z, p)
    for v in vals[1:]:
        np.testing.assert_allclose(v, vals[0], rtol=1e-6, atol=1e-7)
    vm = jax.jit(jax.vmap(lambda a, b: L.tv_loss(a, b, chunk_size=2)))(
        z.reshape(3, 4, 33), p.reshape(3, 4, 33))
    np.testing.assert_allclose(vm, vals[0].reshape(3, 4), rtol=1e-6, atol=1e-7)
    assert tv_losses._rows_per_chunk(12, 33, 5) == 4 and tv_losses._rows_per_chunk(13, 33, 5) == 1


def test_default_tv_chunk_splits_over_the_batch_shards():
    """The default row chunk is a multiple of the mesh's batch shards (its outer factor carries
    the data-parallel sharding; a smaller chunk made XLA replicate part of the logits on every
    chip), about the per-device budget on each, and unchanged without a mesh."""
    from jax.sharding import AbstractMesh, AxisType
    from specjax.models import partitioning
    v = 151936
    per_device = L.DEFAULT_CHUNK_ELEMENTS // v  # 55 rows at the Qwen3 vocabulary
    n = 64 * 256 * 3  # one row of 256 anchors x γ = 3 per chip on 64 chips
    assert tv_losses._rows_per_chunk(n, v, None) == 48  # the largest divisor of n up to 55
    for shards in (2, 8, 64, 256):
        rows = tv_losses._rows_per_chunk(n, v, None, shards)
        assert n % rows == 0 and rows % shards == 0, shards
        assert shards * per_device // 2 < rows <= shards * per_device, shards
    assert tv_losses._rows_per_chunk(n, v, 5, 64) == 4  # an explicit chunk is taken as given
    assert tv_losses._rows_per_chunk(n + 1, v, None, 64) == tv_losses._rows_per_chunk(n + 1, v, None)
    explicit = (AxisType.Explicit,) * 3
    with jax.sharding.use_abstract_mesh(AbstractMesh((2, 32, 4), ("data", "fsdp", "tensor"),
                                                     axis_types=explicit)):
        assert partitioning.batch_axes() == (("data", "fsdp"), 64)
        with partitioning.unconstrained():
            assert partitioning.batch_axes() == ((), 1)
    assert partitioning.batch_axes() == ((), 1)
    # experiments/fsdp_scaling.py --study chunk compiles "before the fix" with this switch: the
    # vocabulary-only rule inside it, the current rule again after it
    from experiments.fsdp_scaling import old_row_chunk
    with old_row_chunk():
        assert tv_losses._rows_per_chunk(n, v, None, 64) == 48
    assert tv_losses._rows_per_chunk(n, v, None, 64) % 64 == 0
    # --study tiling forces a chunk, records the rows it was asked to split, refuses a non-divisor
    from experiments.fsdp_scaling import forced_row_chunk
    with forced_row_chunk(96) as seen:
        assert tv_losses._rows_per_chunk(n, v, None, 64) == 96 == tv_losses._rows_per_chunk(n, v, 5)
        with pytest.raises(ValueError, match="does not divide"):
            tv_losses._rows_per_chunk(n + 1, v, None)
    assert seen == [n, n]
    assert tv_losses._rows_per_chunk(n, v, None, 64) % 64 == 0


def test_tv_bf16_logits():
    z, p = random_inputs(8, (4, 100))
    zb = jnp.asarray(z, jnp.bfloat16)
    tv, g = value_and_grad(lambda x: L.tv_loss(x, p), zb)
    assert tv.dtype == jnp.float32 and g.dtype == jnp.bfloat16
    np.testing.assert_allclose(tv, np_tv(np.asarray(zb, np.float32), p), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(g, np.float32),
                               np_tv_grad_eq11(np.asarray(zb, np.float32), p), atol=4e-3)


def test_no_gradient_reaches_targets():
    z, p = random_inputs(9, (2, 3, 20))
    labels = np.zeros((2, 3), np.int32)
    conf = np.zeros((2, 3), np.float32)
    def total(p):
        return (L.tv_loss(z, p).sum() + L.e2e_tv_loss(z, p).sum() + L.kl_loss(z, p).sum()
                + L.reverse_kl_loss(z, p).sum() + L.dspark_loss(z, p, labels, conf).sum())

    assert not np.any(jax.jit(jax.grad(total))(jnp.asarray(p)))


# ---------------------------------------------------------------- e2e TV gradient
def test_e2e_tv_gradient_matches_finite_differences_float64():
    z, p = random_inputs(10, (2, 3, 7), zero_frac=0.2, scale=1.5)
    with jax.enable_x64(True):
        z64, p64 = jnp.asarray(z, jnp.float64), jnp.asarray(p, jnp.float64)
        f = jax.jit(lambda x: jnp.sum(jnp.asarray([1.0, -0.7]) * L.e2e_tv_loss(x, p64)))
        g = np.asarray(jax.grad(f)(z64))
        eps = 1e-6
        fd = np.zeros_like(g)
        flat = np.asarray(z64).ravel()
        for i in range(flat.size):
            e = np.zeros_like(flat)
            e[i] = eps
            fd.ravel()[i] = (f(jnp.asarray((flat + e).reshape(z.shape)))
                             - f(jnp.asarray((flat - e).reshape(z.shape)))) / (2 * eps)
        np.testing.assert_allclose(g, fd, rtol=1e-6, atol=1e-9)
        # And in closed form: dL/dtv_i = (1/γ) Σ_{j≥i} Π_{l≤j, l≠i} α_l, times eq. 11.
        alpha = 1.0 - np_tv(z, p)
        gamma = alpha.shape[-1]
        dl_dtv = np.zeros_like(alpha)
        for i in range(gamma):
            for j in range(i, gamma):
                dl_dtv[..., i] += np.prod(np.delete(alpha[..., : j + 1], i, axis=-1), -1) / gamma
        want = np.array([1.0, -0.7])[:, None, None] * dl_dtv[..., None] * np_tv_grad_eq11(z, p)
        np.testing.assert_allclose(g, want, rtol=1e-9, atol=1e-12)
    # Later positions' gradient depends on earlier α (flows through the product): position 2's
    # gradient scales with α_1.
    assert np.abs(g[:, 1]).sum() > 0 and np.abs(g[:, 2]).sum() > 0


def test_e2e_tv_gradient_with_zero_acceptance_is_finite():
    # Position 1 is (numerically) disjoint from its target, α_1 ≈ 0: the product kills position 2's
    # gradient, and nothing is NaN.
    z = jnp.asarray(np.log(np.array([[[1.0, 1e-30], [1.0, 1.0]]], np.float32) + 1e-38))
    p = jnp.asarray(np.array([[[0.0, 1.0], [0.5, 0.5]]], np.float32))
    _, g = value_and_grad(lambda x: L.e2e_tv_loss(x, p), z)
    assert np.all(np.isfinite(g))
    np.testing.assert_allclose(g[0, 1], 0.0, atol=1e-12)


# ---------------------------------------------------------------- masks / where
def test_where_masks_positions_value_and_gradient():
    z, p = random_inputs(11, (3, 4, 25))
    labels = np.random.default_rng(12).integers(0, 25, size=(3, 4))
    conf = np.random.default_rng(13).normal(size=(3, 4)).astype(np.float32)
    mask = np.array([[1, 1, 1, 0], [1, 1, 0, 0], [0, 0, 0, 0]], bool)
    # Garbage at masked positions: -inf logits, padding labels. Must not leak NaN anywhere.
    z_bad = np.where(mask[..., None], z, -np.inf).astype(np.float32)
    labels_bad = np.where(mask, labels, -1)
    w = np.exp(-np.arange(4) / 4)
    refs = {"ce": np_ce(z, labels), "tv": np_tv(z, p), "tv_chunked": np_tv(z, p), "kl": np_kl(z, p),
            "rkl": np_rkl(z, p), "dspark": np_dspark(z, p, labels, conf, w=w * mask),
            "dspark_inf": np_dspark(z, p, labels, conf, w=w * mask)}

    @jax.jit
    def run(z, z_bad):
        # ce / kl / rkl get finite logits (documented requirement); the custom-VJP losses get -inf
        # rows at masked positions.
        fns = {"ce": (lambda x: L.ce_loss(x, labels_bad, where=mask), z),
               "kl": (lambda x: L.kl_loss(x, p, where=mask), z),
               "rkl": (lambda x: L.reverse_kl_loss(x, p, where=mask), z),
               "tv": (lambda x: L.tv_loss(x, p, where=mask), z_bad),
               "tv_chunked": (lambda x: L.tv_loss(x, p, where=mask, chunk_size=1), z_bad),
               "e2e": (lambda x: L.e2e_tv_loss(x, p, where=mask), z_bad),
               "dspark": (lambda x: L.dspark_loss(x, p, labels_bad, conf, where=mask), z),
               "dspark_inf": (lambda x: L.dspark_loss(x, p, labels_bad, conf, where=mask), z_bad)}
        return {k: (f(x), jax.grad(lambda y, f=f: jnp.sum(f(y)))(x)) for k, (f, x) in fns.items()}

    out = run(z, z_bad)
    for name, (val, g) in out.items():
        val, g = np.asarray(val), np.asarray(g)
        assert np.all(np.isfinite(val)) and np.all(np.isfinite(g)), name
        assert np.all(g[~mask] == 0), name
        if name in refs and not name.startswith("dspark"):
            assert np.all(val[~mask] == 0), name
            np.testing.assert_allclose(val[mask], refs[name][mask], rtol=2e-5, atol=2e-5)
        elif name in refs:  # DSpark: masked positions drop out of the weighted sum
            np.testing.assert_allclose(val, refs[name], rtol=2e-5, atol=1e-6)

    # e2e with a prefix mask = e2e of the shorter chain; fully masked row -> 0.
    e2e = out["e2e"][0]
    assert float(e2e[0]) == pytest.approx(float(np_e2e(z[0, :3], p[0, :3])), rel=1e-5)
    assert float(e2e[1]) == pytest.approx(float(np_e2e(z[1, :2], p[1, :2])), rel=1e-5)
    assert float(e2e[2]) == 0.0


def test_e2e_where_non_prefix_mask_skips_position():
    tv = jnp.asarray([[0.2, 0.9, 0.5]])
    got = L.e2e_tv_from_tv(tv, where=jnp.asarray([[True, False, True]]))
    # α = [.8, (skipped), .5] -> terms .8 and .4 over 2 valid positions.
    assert float(got[0]) == pytest.approx(1 - (0.8 + 0.4) / 2)


def test_where_shape_errors():
    z, p = random_inputs(14, (2, 3, 10))
    with pytest.raises(ValueError, match="masks positions"):
        L.tv_loss(z, p, where=np.ones((2, 3, 10), bool))
    with pytest.raises(TypeError, match="boolean"):
        L.tv_loss(z, p, where=np.ones((2, 3)))
    with pytest.raises(ValueError, match="same shape"):
        L.kl_loss(z, p[..., :5])
    with pytest.raises(ValueError, match=r"\[\.\.\., γ, V\]"):
        L.e2e_tv_loss(z[0, 0], p[0, 0])
    with pytest.raises(TypeError, match="integer"):
        L.ce_loss(z, np.zeros((2, 3), np.float32))
    with pytest.raises(ValueError, match="confidence_logits"):
        L.dspark_loss(z, p, np.zeros((2, 3), np.int32), np.zeros((2, 4), np.float32))


# ---------------------------------------------------------------- zeros in p / q
def test_no_nan_when_p_or_q_has_zeros():
    z, p = random_inputs(15, (3, 4, 30), zero_frac=0.7)
    assert (p == 0).mean() > 0.5
    labels = np.zeros((3, 4), np.int32)
    conf = np.zeros((3, 4), np.float32)
    # Draft logits with -inf entries (q exactly 0), both where p = 0 and where p > 0.
    z_inf = z.copy()
    z_inf[..., 5:10] = -np.inf
    @jax.jit
    def run(x, p, p_kl):
        fns = {"kl": lambda x: L.kl_loss(x, p_kl), "rkl": lambda x: L.reverse_kl_loss(x, p),
               "tv": lambda x: L.tv_loss(x, p), "e2e": lambda x: L.e2e_tv_loss(x, p),
               "dspark": lambda x: L.dspark_loss(x, p, labels, conf)}
        return {k: (f(x), jax.grad(lambda y, f=f: jnp.sum(f(y)))(x)) for k, f in fns.items()}

    # (Forward KL is +inf where p > 0 = q, so its p is zeroed where the draft logit is -inf.)
    for zz, p_kl in ((z, p), (z_inf, np.where(np.isinf(z_inf), 0, p))):
        for name, (val, g) in run(zz, p, p_kl).items():
            assert np.all(np.isfinite(val)), name
            assert np.all(np.isfinite(g)), name
    # Reverse KL: q mass on a p = 0 token costs q·(log q − floor) and is pushed down.
    # Its gradient is Bebop eq. 17 with log p clamped: q_j (log q_j − log p_j − KL(q‖p)).
    _, g = value_and_grad(lambda x: L.reverse_kl_loss(x, p), z)
    q = np_softmax(z)
    with np.errstate(divide="ignore"):
        lp = np.maximum(np.log(p.astype(np.float64)), FLOOR)
    want = q * (np.log(q) - lp - np_rkl(z, p)[..., None])
    np.testing.assert_allclose(g, want, rtol=1e-4, atol=1e-5)
    forbidden = lambda x: (np_softmax(x) * (p == 0)).sum()
    assert forbidden(z - 0.05 * np.asarray(g)) < forbidden(z)
    # Forward KL with p > 0 where q = 0 is +inf (the true value), documented.
    assert np.isinf(float(L.kl_loss(jnp.asarray([0.0, -np.inf]), jnp.asarray([0.5, 0.5]))))


def test_dspark_terms_and_gradients():
    z, p = random_inputs(16, (2, 5, 40))
    labels = np.random.default_rng(17).integers(0, 40, size=(2, 5))
    conf = np.random.default_rng(18).normal(size=(2, 5)).astype(np.float32)
    t = jax.jit(L.dspark_loss_terms)(z, p, labels, conf)
    np.testing.assert_allclose(t.l1, np.abs(np_softmax(z) - p).sum(-1), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(t.tv, np_tv(z, p), rtol=1e-5, atol=1e-6)
    # The fused CE + TV gradient equals autodiff of the plain formulas.
    def naive(x):
        w = L.dspark_position_weights(5)
        tv = L.tv_loss_autodiff(x, p)
        ce = L.ce_loss(x, labels)
        bce = -((1 - jax.lax.stop_gradient(tv)) * jax.nn.log_sigmoid(conf)
                + jax.lax.stop_gradient(tv) * jax.nn.log_sigmoid(-conf))
        return jnp.sum(w * (0.1 * ce + 0.9 * 2 * tv + bce), axis=-1)

    v1, g1 = value_and_grad(lambda x: L.dspark_loss(x, p, labels, conf, chunk_size=3), z)
    v2, g2 = value_and_grad(naive, z)
    np.testing.assert_allclose(v1, v2, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(g1, g2, rtol=1e-5, atol=1e-7)
    # The confidence term never trains the draft distribution (its target is detached) ...
    _, gz = value_and_grad(lambda x: L.dspark_loss(x, p, labels, conf, ce_coef=0.0, l1_coef=0.0), z)
    assert not np.any(gz)
    # ... and its gradient w.r.t. the confidence logit is w_k (σ(c) − (1 − tv_k)).
    _, gc = value_and_grad(lambda c: L.dspark_loss(z, p, labels, c), conf)
    w = np.exp(-np.arange(5) / 5)
    want = w * (1 / (1 + np.exp(-conf.astype(np.float64))) - (1 - np_tv(z, p)))
    np.testing.assert_allclose(gc, want, rtol=1e-5, atol=1e-6)
    # Custom weights and coefficients.
    wc = np.array([1.0, 0.0, 2.0, 0.0, 1.0], np.float32)
    np.testing.assert_allclose(
        jax.jit(lambda w: L.dspark_loss(z, p, labels, conf, weights=w, ce_coef=1.0, l1_coef=0.5,
                                        conf_coef=0.0))(wc),
        np_dspark(z, p, labels, conf, w=wc, coefs=(1.0, 0.5, 0.0)), rtol=2e-5, atol=1e-6)


# ---------------------------------------------------------------- memory property (compile only)
def _temp_bytes(fn, shape):
    spec = jax.ShapeDtypeStruct(shape, jnp.float32)
    step = jax.jit(jax.value_and_grad(lambda z, p: jnp.sum(fn(z, p))))
    compiled = step.lower(spec, spec).compile()
    m = compiled.memory_analysis()
    if m is None:
        pytest.skip("backend reports no memory analysis")
    return m.temp_size_in_bytes


def test_custom_vjp_tv_temporaries_are_chunk_sized():
    # [256 tokens, 8192 vocab] f32 = 8 MiB; chunks of 16 rows. The custom-VJP loss must allocate far
    # less than one [tokens, V] temporary; plain autodiff needs at least one.
    shape, buf = (256, 8192), 256 * 8192 * 4
    ours = _temp_bytes(lambda z, p: L.tv_loss(z, p, chunk_size=16), shape)
    naive = _temp_bytes(L.tv_loss_autodiff, shape)
    assert ours < 0.5 * buf, ours / buf
    assert naive >= buf, naive / buf
    # DSpark (fused CE + TV): also chunk-sized, not one extra buffer per position.
    # (γ = 2: with a size-1 γ axis XLA:CPU adds a layout copy of the output gradient.)
    blocks = (128, 2)
    small = jax.ShapeDtypeStruct(blocks, jnp.float32)
    lab = jax.ShapeDtypeStruct(blocks, jnp.int32)
    z3 = jax.ShapeDtypeStruct(blocks + shape[1:], jnp.float32)
    m = jax.jit(jax.grad(lambda z, p, l, c: L.dspark_loss(z, p, l, c, chunk_size=16).sum())).lower(
        z3, z3, lab, small).compile().memory_analysis()
    assert m.temp_size_in_bytes < 0.5 * buf, m.temp_size_in_bytes / buf


def test_chunked_tv_under_data_and_vocab_sharding_needs_no_all_gather():
    # Tokens sharded over `data`, vocabulary over `tensor` (8 fake CPU devices, Auto axes as in
    # specjax.training.sharding): the chunk loop slices an unsharded axis, so no device gathers
    # the logits; the gradient keeps the input sharding.
    from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

    if jax.device_count() < 8:
        pytest.skip("needs the 8 fake CPU devices of conftest.py")
    mesh = jax.make_mesh((4, 2), ("data", "tensor"), axis_types=(AxisType.Auto,) * 2)
    sharding = NamedSharding(mesh, P("data", "tensor"))
    z, p = random_inputs(19, (64, 256))
    zs, ps = jax.device_put(z, sharding), jax.device_put(p, sharding)
    f = jax.jit(lambda z, p: value_and_grad(lambda x: L.tv_loss(x, p, chunk_size=4), z))
    hlo = f.lower(zs, ps).compile().as_text()
    assert "all-gather" not in hlo and "all-to-all" not in hlo
    tv, g = f(zs, ps)
    assert g.sharding.is_equivalent_to(sharding, 2)
    np.testing.assert_allclose(tv, np_tv(z, p), rtol=2e-5, atol=2e-6)
    np.testing.assert_allclose(g, np_tv_grad_eq11(z, p), rtol=1e-4, atol=1e-7)
