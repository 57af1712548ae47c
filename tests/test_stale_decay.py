"""Production's stale confidences shrink towards the running prior by their age
(``SchedulerConfig.stale_decay``): the rule by hand, the device loop's and the host loop's budget
choices agree on it at every age, and the scheduling simulation drafts again after a pessimistic
draw. Exactness does not depend on it (the budget reads no draft of the step it admits): the
T = 1 chi-square tests of production (``test_engine.py``, ``test_engine_rows.py``) run with the
default decay, through plain steps.
"""
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))
from test_engine import _drafter, target  # noqa: E402,F401

from specjax.buckets import SPSProfile  # noqa: E402
from specjax.engine import Engine, EngineConfig, Request  # noqa: E402
from specjax.engine.device_loop import init_loop_state, production_step_choice  # noqa: E402
from specjax.sched_sim import Traces, simulate  # noqa: E402
from specjax.engine import device_policies as dp  # noqa: E402
from specjax.scheduling import SchedulerConfig, shrink_stale, survival_prior_update  # noqa: E402


def test_shrink_stale_by_hand_and_its_device_form():
    """Survivals ``a = cumprod(c)`` move towards the prior's by ``decay**lag``; the result is
    returned as confidences. The device loop's jnp form (f32) agrees."""
    stale = np.array([[0.9, 0.8], [0.1, 0.3]])
    prior = np.array([0.5, 0.5])  # survivals 0.5, 0.25
    lag = np.array([2, 1])
    # row 0: survivals 0.9, 0.72, weight 0.5**2: 0.5 + 0.25 * 0.4 = 0.6, 0.25 + 0.25 * 0.47
    # row 1: survivals 0.1, 0.03, weight 0.5: 0.5 - 0.5 * 0.4 = 0.3, 0.25 - 0.5 * 0.22 = 0.14
    want = [[0.6, 0.3675 / 0.6], [0.3, 0.14 / 0.3]]
    np.testing.assert_allclose(shrink_stale(stale, prior, lag, 0.5), want, rtol=1e-12)
    on_device = jax.jit(dp.shrink_stale, static_argnums=3)(
        jnp.asarray(stale, jnp.float32), jnp.asarray(prior, jnp.float32),
        jnp.asarray(lag, jnp.int32), 0.5)
    np.testing.assert_allclose(np.asarray(on_device), want, rtol=1e-6)
    assert shrink_stale(stale, prior, lag, 1.0) is stale  # decay 1: untouched, not recomputed
    np.testing.assert_allclose(shrink_stale(stale, prior, lag, 0.0),
                               np.broadcast_to(prior, stale.shape), rtol=1e-12)
    for bad in (-0.1, 1.5):
        with pytest.raises(ValueError, match="stale_decay"):
            SchedulerConfig("production", stale_decay=bad)


def test_survival_prior_and_its_device_form():
    """The prior's survivals are the moving average of the drafted ones' (by hand), so its summed
    survival is their mean (a mean of confidences would understate it); the jnp form, with
    fixed shapes and a mask of fresh rows, agrees with the numpy one, and a step with no fresh
    row leaves the prior alone."""
    fresh = np.array([[0.9, 0.9], [0.1, 0.1]])  # survivals 0.9, 0.81 and 0.1, 0.01
    first = survival_prior_update(np.full(2, 0.5), fresh, 1.0)
    np.testing.assert_allclose(first, [0.5, 0.41 / 0.5], rtol=1e-12)  # mean survivals 0.5, 0.41
    assert np.cumprod(first).sum() == pytest.approx(np.cumprod(fresh, axis=1).sum(axis=1).mean())
    np.testing.assert_allclose(survival_prior_update(first, fresh[:1], 0.1),
                               [0.54, (0.9 * 0.41 + 0.1 * 0.81) / 0.54], rtol=1e-12)
    rng = np.random.default_rng(0)
    prior, conf = rng.uniform(0.05, 1, 4), rng.uniform(0, 1, (5, 4))
    mask = np.array([True, False, True, True, False])
    got = jax.jit(dp.survival_prior_update)(jnp.asarray(prior, jnp.float32),
                                            jnp.asarray(conf, jnp.float32), jnp.asarray(mask),
                                            jnp.float32(0.1))
    np.testing.assert_allclose(np.asarray(got), survival_prior_update(prior, conf[mask], 0.1),
                               rtol=1e-5)
    none = jax.jit(dp.survival_prior_update)(jnp.asarray(prior, jnp.float32),
                                             jnp.asarray(conf, jnp.float32),
                                             jnp.zeros(5, bool), jnp.float32(0.1))
    np.testing.assert_array_equal(np.asarray(none), np.asarray(prior, np.float32))


# Two requests; a plain step runs at 2 steps/s, every verification and drafting step at 1: a step
# pays to draft when the admitted drafts' summed survival exceeds the 2 rows. The prior is 0.95
# per position (S = 2.710 per row), the rows' last drafted vector 0.05 (S = 0.053). Shrunk by
# 0.7**lag in survival space, S = 2.710 - 2.657 * 0.7**lag: 0.85 per row at lag 1 (total 1.70:
# plain), 1.41 at lag 2 (2.82: drafts). Exploration is off, so only the budget search decides.
GAMMA, PRIOR, PESSIMISTIC = 3, 0.95, 0.05


def _engine(target, loop, decay):
    d, p, f = _drafter("dspark", target)
    eng = Engine(target, d, p, f, EngineConfig(
        num_slots=2, max_len=32, gamma=GAMMA, prefill_buckets=(8,), loop=loop,
        scheduler=SchedulerConfig("production", explore_every=0, stale_decay=decay)))
    eng.set_sps(SPSProfile(tuple(eng.buckets), (1.0,) * len(eng.buckets), plain_s=0.5))
    return eng


def _device_budget(eng, lag: int) -> int:
    s = eng.config.num_slots
    ls = init_loop_state(None, s, GAMMA, 1)._replace(
        active=jnp.ones(s, bool), remaining=jnp.full(s, 20, jnp.int32),
        conf_hist=jnp.full((s, 2, GAMMA), PESSIMISTIC, jnp.float32),
        hist_n=jnp.full(s, 2, jnp.int32), prior=jnp.full(GAMMA, PRIOR, jnp.float32),
        prior_seen=jnp.bool_(True), since_draft=jnp.int32(lag - 1))
    choice = jax.jit(lambda ls: production_step_choice(
        eng._loop_spec, ls, jnp.asarray(eng.sps_table, jnp.float32),
        jnp.asarray(eng.sps_table_draft, jnp.float32), jnp.float32(eng.sps.plain_sps)))
    _, budget, drew, _ = choice(ls)
    assert bool(drew) == (int(budget) > 0)
    return int(budget)


def _host_budget(eng, lag: int) -> int:
    """The host loop reads the vector of two drafting steps ago: dated ``lag`` steps back."""
    if not any(eng.slots):
        for i in range(eng.config.num_slots):
            eng.submit(Request(prompt=[3, 1, 4, 1 + i], max_new_tokens=20))
        eng._admit()
    eng._conf_prior, eng._conf_prior_seen = np.full(GAMMA, PRIOR), True
    eng._host_steps = 100
    for live in eng.slots:
        live.conf_history.clear()
        live.conf_history.append((100 - lag, np.full(GAMMA, PESSIMISTIC)))
        live.conf_history.append((100 - lag + 1, np.full(GAMMA, PRIOR)))  # the newer: unread
    return eng._production_budget()


@pytest.mark.parametrize("decay", [1.0, 0.7])
def test_device_and_host_budgets_agree_as_the_stale_vector_ages(target, decay):
    device, host = _engine(target, "device", decay), _engine(target, "host", decay)
    budgets = {lag: (_device_budget(device, lag), _host_budget(host, lag))
               for lag in (1, 2, 3, 8, 40)}
    assert all(d == h for d, h in budgets.values()), budgets
    drafts = {lag: b[0] > 0 for lag, b in budgets.items()}
    if decay == 1.0:  # held as drafted: plain however old
        assert not any(drafts.values()), budgets
    else:  # the pessimistic vector gives way to the prior from lag 2 on
        assert drafts == {1: False, 2: True, 3: True, 8: True, 40: True}, budgets
        assert budgets[40][0] == 2 * GAMMA  # the prior alone: every draft of both rows


def test_simulated_production_drafts_again_after_a_pessimistic_draw():
    """Recorded steps of two kinds, drawn independently: half accept every draft with
    confidences 0.95, half none with 0.05. A drafting step costs 1.5 s, a plain one 1 s:
    always drafting emits 2.5 tokens per request-step (3.3 tokens/s for two requests) against
    plain decoding's 2 tokens/s, and the budget search drafts on the prior (the mean
    survivals: 1.38 accepted drafts per request) but not when both requests' vectors are
    pessimistic. Held as drafted, such a pair keeps
    drafting off until the next exploring step (1 in 16); decayed, it gives way within a step or
    two: production drafts on more steps and emits more tokens per second (the same draws)."""
    n = 200
    good = np.arange(n) % 2 == 0
    traces = Traces(np.where(good, GAMMA, 0), np.where(good[:, None], 0.95, 0.05)
                    * np.ones((n, GAMMA)))
    prof = SPSProfile((8, 16), (1.0, 1.0), draft_s=0.5)
    held = simulate(traces, SchedulerConfig("production", explore_every=16, stale_decay=1.0),
                    prof, 2, steps=400, seed=3)
    decayed = simulate(traces, SchedulerConfig("production", explore_every=16, stale_decay=0.5),
                       prof, 2, steps=400, seed=3)
    assert decayed.drafting_steps > held.drafting_steps, (decayed, held)
    assert decayed.throughput > held.throughput, (decayed, held)
