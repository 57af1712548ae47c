"""Online confidence calibration of the device loop (specjax/engine/online_calibration.py):
hand-computed statistics under jit, and the ratio it converges to. Exactness with the engine is
tests/test_engine.py::test_temperature1_engine_with_scheduler_is_lossless (calibrate=True)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.engine import online_calibration as oc
from specjax.engine import EngineConfig
from specjax.scheduling import SchedulerConfig


def test_update_counts_reached_positions_only():
    """Slot 0 verified 3 drafts and accepted 1: positions 1-2 reached, 1 accepted. Slot 1 verified
    2, accepted both: positions 1-2 reached and accepted, 3 not reached (not verified). Slot 2 is
    idle (ℓ = -1); slot 3 verified none (ℓ = 0)."""
    conf = jnp.asarray([[0.9, 0.8, 0.7], [0.6, 0.5, 0.4], [0.3, 0.3, 0.3], [0.2, 0.2, 0.2]])
    ell = jnp.asarray([3, 2, -1, 0], jnp.int32)
    n_acc = jnp.asarray([1, 2, 0, 0], jnp.int32)
    acc, pred = jax.jit(oc.update)(jnp.ones(3), jnp.full(3, 2.0), conf, ell, n_acc,
                                   jnp.bool_(True))
    np.testing.assert_allclose(acc, oc.DECAY * 1 + np.array([2, 1, 0]), rtol=1e-6)
    np.testing.assert_allclose(pred, oc.DECAY * 2 + np.array([0.9 + 0.6, 0.8 + 0.5, 0.0]),
                               rtol=1e-6)
    # a step that did not draft changes nothing
    same = jax.jit(oc.update)(jnp.ones(3), jnp.full(3, 2.0), conf, ell, n_acc, jnp.bool_(False))
    np.testing.assert_array_equal(same[0], np.ones(3))
    np.testing.assert_array_equal(same[1], np.full(3, 2.0))


def test_ratios_by_hand_and_calibrate_clips():
    acc, pred = jnp.asarray([8.0, 0.0]), jnp.asarray([4.0, 0.0])
    pooled = 9.0 / 5.0
    np.testing.assert_allclose(jax.jit(oc.ratios)(acc, pred),
                               [(8 + oc.PSEUDO * pooled) / (4 + oc.PSEUDO), pooled], rtol=1e-6)
    np.testing.assert_array_equal(oc.ratios(jnp.zeros(3), jnp.zeros(3)), np.ones(3))
    np.testing.assert_allclose(oc.calibrate(jnp.asarray([[0.2, 0.9]]), jnp.asarray([2.0, 2.0])),
                               [[0.4, 1.0]], rtol=1e-6)


def test_converges_to_the_observed_conditional_acceptance():
    """A head that says 0.3 at every position while the verifier accepts each draft with
    probability 0.75: after many steps the calibrated confidence is near 0.75 at the positions
    the drafts reach: within 5 standard errors (p ≈ 6e-7) of the exponentially weighted window,
    whose effective size per reached draft stream is (1 + λ) / (1 - λ), λ = DECAY."""
    rng = np.random.default_rng(0)
    s, g = 8, 3
    conf = jnp.full((s, g), 0.3)
    ell = jnp.full((s,), g, jnp.int32)
    acc, pred = jnp.zeros(g), jnp.zeros(g)
    step = jax.jit(oc.update)
    for _ in range(2000):
        accepted = rng.random((s, g)) < 0.75
        n_acc = np.where(accepted.all(1), g, np.argmin(accepted, axis=1)).astype(np.int32)
        acc, pred = step(acc, pred, conf, ell, jnp.asarray(n_acc), jnp.bool_(True))
    cal = np.asarray(oc.calibrate(conf[0], oc.ratios(acc, pred)))
    # position k is reached by s · 0.75^k drafts per step, each step weighted λ^age
    n_eff = s * 0.75 ** np.arange(g) * (1 + oc.DECAY) / (1 - oc.DECAY)
    se = np.sqrt(0.75 * 0.25 / n_eff)
    assert np.all(np.abs(cal - 0.75) < 5 * se), (cal, se)


def test_config_refuses_what_it_cannot_calibrate():
    with pytest.raises(ValueError, match="device loop only"):
        EngineConfig(scheduler=SchedulerConfig("dspark"), loop="host", online_calibration=True)
    with pytest.raises(ValueError, match="does not read"):
        EngineConfig(scheduler=SchedulerConfig("fixed"), online_calibration=True)
