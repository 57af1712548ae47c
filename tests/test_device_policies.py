"""The jnp policies of the device loop choose exactly the lengths of the numpy references.

Inputs are dyadic (confidences k/8, SPS values small integers over 8) so every survival product, τ
sum and Θ product is exact in f32 and f64 alike: any disagreement is a logic difference, not
rounding. Ties are frequent by construction (few distinct confidence values) and cover the
candidate order (a descending, then smaller j, then smaller r).
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax import scheduling
from specjax.engine import device_policies as dp

S, G = 5, 4
B_MAX = S * (G + 1)


def _case(rng):
    conf = rng.integers(0, 9, size=(S, G)) / 8.0  # includes 0 and 1
    active = rng.random(S) < 0.75
    active[rng.integers(S)] = True
    cap = rng.integers(0, G + 1, size=S)
    sps = rng.integers(1, 17, size=B_MAX + 1) / 8.0
    if rng.random() < 0.5:  # a monotone SPS curve (the usual shape), with plateaus
        sps = np.sort(sps)[::-1].copy()
    return conf, active, cap, sps


def _host(fn, conf, active, cap, *args, **kw):
    rows = np.flatnonzero(active)
    out = np.full(S, -1, np.int64)
    out[rows] = fn(conf[rows], *args, max_len=cap[rows], **kw)
    return out


@jax.jit
def _device_all(conf, active, cap, sps, sps_d, budget, plain):
    c = jnp.asarray(conf, jnp.float32)
    return dict(
        dspark=dp.prefix_schedule(c, sps, cap, active, early_stop=True),
        retro=dp.prefix_schedule(c, sps, cap, active, early_stop=False),
        budget=dp.budget_search(c, sps, cap, active),
        budget_d=dp.budget_search(c, sps, cap, active, sps_d),
        budget_p=dp.budget_search(c, sps, cap, active, sps_d, plain),
        top=dp.top_budget_admission(c, budget, cap, active),
        thresh=dp.threshold_schedule(c, 0.375, cap, active),
        fixed=dp.fixed_k(3, cap, active),
    )


@pytest.mark.parametrize("seed", range(4))
def test_device_policies_match_numpy_references(seed):
    rng = np.random.default_rng(seed)
    for _ in range(50):
        conf, active, cap, sps = _case(rng)
        sps_d = sps / 2  # dyadic too
        plain = float(rng.integers(0, 17)) / 4  # 0: not measured (budget 0 scored with sps)
        budget = int(rng.integers(0, S * G + 2))
        dev = jax.tree.map(np.asarray, _device_all(
            jnp.asarray(conf, jnp.float32), jnp.asarray(active), jnp.asarray(cap, jnp.int32),
            jnp.asarray(sps, jnp.float32), jnp.asarray(sps_d, jnp.float32), jnp.int32(budget),
            jnp.float32(plain)))
        rows = np.flatnonzero(active)
        ref = dict(
            dspark=_host(scheduling.prefix_schedule, conf, active, cap, sps, early_stop=True),
            retro=_host(scheduling.prefix_schedule, conf, active, cap, sps, early_stop=False),
            top=_host(scheduling.top_budget_admission, conf, active, cap, budget),
            thresh=_host(scheduling.threshold_schedule, conf, active, cap, 0.375),
            fixed=_host(lambda c, k, max_len: scheduling.fixed_k(len(c), k, max_len),
                        conf, active, cap, 3),
        )
        for name, want in ref.items():
            np.testing.assert_array_equal(dev[name], want, err_msg=f"{name} {conf} {cap}")
        assert int(dev["budget"]) == scheduling.budget_search(conf[rows], sps, cap[rows])
        assert int(dev["budget_d"]) == scheduling.budget_search(conf[rows], sps, cap[rows], sps_d)
        assert int(dev["budget_p"]) == scheduling.budget_search(conf[rows], sps, cap[rows], sps_d,
                                                                plain_sps=plain)


def test_ties_follow_the_reference_order():
    """All confidences equal: candidates tie on a within a column, so the order is j, then r."""
    conf = np.full((S, G), 0.5)
    active = np.ones(S, bool)
    cap = np.full(S, G)
    for budget in range(S * G + 1):
        got = np.asarray(dp.top_budget_admission(jnp.asarray(conf, jnp.float32),
                                                 jnp.int32(budget), jnp.asarray(cap),
                                                 jnp.asarray(active)))
        want = scheduling.top_budget_admission(conf, budget, cap)
        np.testing.assert_array_equal(got, want)
        # j-major order: the first S admissions give every row one draft, and so on
        assert got.max() - got.min() <= 1
