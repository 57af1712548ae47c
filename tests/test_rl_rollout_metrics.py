"""rollout_metrics: the per-rollout metrics, hand-computed on a stand-in engine (no Tunix)."""
from types import SimpleNamespace as NS

import numpy as np
import pytest

from specjax.rl.rollout_metrics import rollout_metrics
from specjax.rl.scoring import exactness_gap


def _results():
    # 2 sequences: tokens = 1 (prefill) + accepted drafts + 1 per verification step: 9 and 4
    return [NS(tokens=list(range(9)), accepted=6, steps=2, finish_reason="stop"),
            NS(tokens=list(range(4)), accepted=2, steps=1, finish_reason="length")]


LOGP = [np.array([-1.0, -0.5, -2.0, -0.1, -0.3, -0.2, -0.2, -0.1, -0.6]),
        np.array([-0.7, -1.5, -0.2, -0.6])]  # sums -5.0 and -3.0
ENT = [np.array([1.0, 0.5, 1.0, 0.2, 0.4, 0.3, 0.1, 0.2, 0.3]),
       np.array([1.0, 1.0, 0.1, 0.9])]  # sums 4.0 and 3.0


def test_device_loop_counts_only_its_calls_and_gives_survival_and_alpha():
    cfg = NS(loop="device", gamma=3, scheduler=NS(policy="fixed", k=3), overlap=False)
    old = NS(drafted=[100, 100, 100], accepted=[100, 100, 100])  # an earlier call: excluded
    # per position, over the two calls: drafted 6, 4, 2; accepted 5, 3, 0 (8 of 12 in all)
    calls = [NS(drafted=[4, 3, 1], accepted=[3, 2, 0]), NS(drafted=[2, 1, 1], accepted=[2, 1, 0])]
    engine = NS(config=cfg, stats=[], loop_stats=[old] + calls)
    m = rollout_metrics(engine, _results(), [], LOGP, ENT, wall=2.0, since=(0, 1))
    assert (m["sequences"], m["tokens"], m["steps"]) == (2, 13, 3)
    assert (m["drafted"], m["accepted"]) == (12, 8)
    assert m["acceptance"] == pytest.approx(8 / 12)
    assert m["tau"] == pytest.approx((13 - 2) / 3)  # the prefill's tokens are not steps
    # survival_k = accepted_k / drafted_k over the two calls: 5/6, 3/4, 0/2
    assert [m[f"survival_{k}"] for k in (1, 2, 3)] == pytest.approx([5 / 6, 3 / 4, 0.0])
    assert [m[f"alpha_{k}"] for k in (1, 2, 3)] == pytest.approx([5 / 6, 0.9, 0.0])
    assert m["entropy"] == pytest.approx(7.0 / 13)
    assert m["entropy_seq"] == pytest.approx((4.0 / 9 + 3.0 / 4) / 2)
    assert m["logp"] == pytest.approx(-8.0 / 13)
    gap, se = exactness_gap(LOGP, ENT)
    assert (m["exactness_gap"], m["exactness_gap_se"]) == pytest.approx((gap, se))
    assert m["exactness_gap"] == pytest.approx((7.0 - 8.0) / 13)
    assert m["mean_length"] == 6.5 and m["stopped"] == 0.5
    assert (m["wall_s"], m["tokens_per_s"]) == (2.0, 6.5)


def test_host_loop_without_a_fixed_length_reports_no_position_acceptance():
    cfg = NS(loop="host", gamma=3, scheduler=NS(policy="dspark", k=3), overlap=False)
    stats = [NS(drafts_verified=50), NS(drafts_verified=4), NS(drafts_verified=6)]
    engine = NS(config=cfg, stats=stats, loop_stats=[])
    m = rollout_metrics(engine, _results(), [], LOGP, ENT, wall=0.0, since=(1, 0))
    assert (m["drafted"], m["accepted"]) == (10, 8) and m["acceptance"] == 0.8
    assert not any(k.startswith(("alpha_", "survival_")) for k in m)
    assert m["tokens_per_s"] is None


def test_no_tokens_and_no_steps_give_none_not_nan():
    cfg = NS(loop="device", gamma=2, scheduler=NS(policy="none", k=0), overlap=False)
    engine = NS(config=cfg, stats=[], loop_stats=[])
    res = [NS(tokens=[], accepted=0, steps=0, finish_reason="length")]
    m = rollout_metrics(engine, res, [], [np.zeros(0)], [np.zeros(0)], wall=1.0, since=(0, 0))
    for k in ("acceptance", "tau", "entropy", "entropy_seq", "logp", "exactness_gap",
              "exactness_gap_se", "survival_1", "alpha_1", "alpha_2"):
        assert m[k] is None, k
    assert m["drafted"] == 0 and m["tokens_per_s"] == 0.0
