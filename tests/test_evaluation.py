"""Offline-evaluation statistics (specjax/evaluation_stats.py, hand-computable cases) and the
anchor-state pipeline (specjax/evaluation.py).

* acceptance per position, τ with the bonus, predicted E[τ] from per-position acceptances, the
  entropy slope fit (against numpy.polyfit / the textbook standard error) and binned means;
* a simulation: independent Bernoulli acceptances give measured τ ≈ predicted τ;
* the jitted pipeline: with the target itself as the drafter (q = p), rejection sampling at T = 1
  and greedy verification accept every draft (τ = γ + 1, TV = 0), which fails if the anchor
  caches / anchor token / draft positions are misaligned by even one position;
* the fast per-drafter anchor states equal each drafter's own prefill on every prefix
  (same verification outcomes for the same keys);
* specjax.evaluation re-exports the statistics.
"""
import math
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax import evaluation as E
from specjax import evaluation_stats as ES


def test_acceptance_by_position_hand_case():
    a = np.array([0, 1, 3, 2, 3])
    rate, reached = ES.acceptance_by_position(a, 3)
    np.testing.assert_array_equal(reached, [5, 4, 3])
    np.testing.assert_allclose(rate, [4 / 5, 3 / 4, 2 / 3])
    # with fewer drafts verified on some steps: position k only counts steps that verified it
    rate, reached = ES.acceptance_by_position([2, 1, 1], 3, num_draft=[2, 1, 3])
    np.testing.assert_array_equal(reached, [3, 2, 0])  # row 1 verified only one draft
    np.testing.assert_allclose(rate[:2], [1.0, 1 / 2])
    assert np.isnan(rate[2])


def test_tau_includes_bonus_and_se():
    a = np.array([0, 1, 3, 2, 3])
    tau, se = ES.mean_accepted_length(a)
    assert tau == pytest.approx(2.8)  # (0+1+3+2+3)/5 accepted + 1 emitted by the target
    assert se == pytest.approx(np.std(a, ddof=1) / math.sqrt(5))
    assert ES.mean_accepted_length([3, 3, 3])[0] == 4.0  # γ = 3 all accepted: γ + 1 tokens


def test_expected_tau_from_alphas():
    assert ES.expected_tau([0.5, 0.5, 0.5]) == pytest.approx(1 + 0.5 + 0.25 + 0.125)
    assert ES.expected_tau([1.0, 1.0]) == 3.0
    assert ES.expected_tau([0.0, 1.0, 1.0]) == 1.0
    np.testing.assert_allclose(ES.expected_tau([[0.8, 0.5], [1.0, 0.0]]),
                               [1 + 0.8 + 0.4, 2.0])


def test_linear_fit_matches_polyfit_and_standard_error():
    rng = np.random.default_rng(0)
    x = rng.uniform(0, 5, 200)
    y = 0.9 - 0.12 * x + rng.normal(0, 0.05, 200)
    fit = ES.linear_fit(x, y)
    slope, intercept = np.polyfit(x, y, 1)
    assert fit["slope"] == pytest.approx(slope, rel=1e-10)
    assert fit["intercept"] == pytest.approx(intercept, rel=1e-10)
    resid = y - (intercept + slope * x)
    se = math.sqrt((resid ** 2).sum() / (200 - 2) / ((x - x.mean()) ** 2).sum())
    assert fit["slope_se"] == pytest.approx(se, rel=1e-10)
    assert fit["r"] == pytest.approx(np.corrcoef(x, y)[0, 1], rel=1e-10)
    # the slope's s.e. from the covariance numpy.polyfit reports
    _, cov = np.polyfit(x, y, 1, cov="unscaled")
    assert fit["slope_se"] == pytest.approx(math.sqrt(cov[0, 0] * (resid ** 2).sum() / 198),
                                            rel=1e-8)
    exact = ES.linear_fit([0, 1, 2, 3], [1.0, 0.8, 0.6, 0.4])
    assert exact["slope"] == pytest.approx(-0.2) and exact["slope_se"] == pytest.approx(0, abs=1e-12)
    assert math.isnan(ES.linear_fit([1, 1, 1], [0, 1, 2])["slope"])  # no spread in x


def test_entropy_and_bins():
    assert float(ES.entropy(np.full(4, 0.25))) == pytest.approx(math.log(4))
    assert float(ES.entropy(np.array([0.0, 1.0, 0.0]))) == 0.0
    assert float(ES.entropy(jnp.array([0.5, 0.5]))) == pytest.approx(math.log(2), rel=1e-6)
    b = ES.binned_means([0.1, 0.2, 1.5, 2.5, 2.9], [1, 0, 1, 0.5, 0.5], [0, 1, 2, 3])
    assert b["n"] == [2, 1, 2]
    np.testing.assert_allclose(b["mean"], [0.5, 1.0, 0.5])
    np.testing.assert_allclose(b["center"], [0.5, 1.5, 2.5])


def test_summarize_hand_case():
    # 4 steps, γ = 2; analytic acceptance 0.5 everywhere; entropy = 2 − 2·alpha exactly
    rec = ES.StepRecords(num_accepted=np.array([0, 1, 2, 2]),
                         accept_prob=np.array([[0.9, 0.4], [0.5, 0.6], [0.7, 0.8], [0.3, 0.2]]),
                         tv=np.zeros((4, 2)), entropy=np.zeros((4, 2)),
                         entropy_raw=np.zeros((4, 2)))
    rec.entropy = 2.0 - 2.0 * rec.accept_prob
    m = ES.summarize(rec)
    assert m["tau"] == pytest.approx(1 + 5 / 4)
    assert m["accept_rate"] == pytest.approx(5 / 4 / 2)
    np.testing.assert_allclose(m["acceptance"], [3 / 4, 2 / 3])
    np.testing.assert_allclose(m["reached"], [4, 3])
    # alpha_2 averages the three steps that reached position 2 (steps 1, 2, 3)
    np.testing.assert_allclose(m["alpha"], [(0.9 + 0.5 + 0.7 + 0.3) / 4, (0.6 + 0.8 + 0.2) / 3])
    a1, a2 = m["alpha"]
    assert m["tau_pred"] == pytest.approx(1 + a1 + a1 * a2)
    assert m["entropy_fit"]["slope"] == pytest.approx(-0.5)
    assert m["entropy_fit"]["n"] == 7


def test_predicted_tau_matches_measured_for_independent_positions():
    rng = np.random.default_rng(1)
    alpha = np.array([0.8, 0.6, 0.5])
    n = 20000
    u = rng.uniform(size=(n, 3))
    acc = u < alpha
    num = np.argmin(np.concatenate([acc, np.zeros((n, 1), bool)], 1), axis=1)  # first rejection
    tau, se = ES.mean_accepted_length(num)
    assert abs(tau - ES.expected_tau(alpha)) < 4 * se
    rate, _ = ES.acceptance_by_position(num, 3)
    np.testing.assert_allclose(rate, alpha, atol=0.02)


def test_evaluation_reexports_statistics():
    # users import the statistics from specjax.evaluation as well as from where they live
    for name in ES.__all__:
        assert getattr(E, name) is getattr(ES, name), name
        assert name in E.__all__, name


def test_anchor_positions():
    a = E.anchor_positions([10, 3, 6], 4, min_context=2, seed=0)
    assert a.shape == (3, 4)
    assert (a[0] >= 1).all() and (a[0] <= 8).all() and len(set(a[0])) == 4
    assert list(a[1]) == [1, -1, -1, -1]  # only i = 1 (L − 2) is possible
    assert sorted(a[2][a[2] >= 0]) == list(a[2][a[2] >= 0])


# ---------------------------------------------------------------------------------------------
# the jitted pipeline on the tiny sharp target of the drafter tests
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def common():
    sys.path.insert(0, __file__.rsplit("/", 1)[0])
    import test_drafters_common as C
    return C


def _rows(vocab, seed=0):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, vocab, (3, 20)).astype(np.int32)
    return tokens, np.array([20, 15, 9], np.int32)


def test_self_drafting_accepts_everything(common):
    """q = p (the target drafts for itself): RS at T=1 and greedy accept all γ drafts."""
    C = common
    target = C.target()
    drafter, params, frozen = C.drafter("draft_lm_self")
    tokens, lengths = _rows(C.VOCAB)
    recs = E.evaluate_drafter(target, drafter, params, frozen, tokens, lengths, gamma=3,
                              grid=(("rejection", 1.0), ("greedy", 0.0)), anchors_per_row=4,
                              min_context=2, seed=3)
    for cell, rec in recs.items():
        assert rec.num_accepted.size == 12  # 4 anchors in each of the 3 rows
        np.testing.assert_array_equal(rec.num_accepted, 3, err_msg=str(cell))
        np.testing.assert_allclose(rec.accept_prob, 1.0, atol=1e-5)
        np.testing.assert_allclose(rec.tv, 0.0, atol=1e-5)
        m = ES.summarize(rec)
        assert m["tau"] == 4.0 and m["tau_pred"] == pytest.approx(4.0, abs=1e-4)
    assert recs[("rejection", 1.0)].entropy.mean() > 0.3  # a sharp but not one-hot target


@pytest.mark.parametrize("name", ["mtp", "dspark_markov"])
def test_fast_anchor_states_equal_prefill(common, name):
    """The per-anchor views of one pass per row == the drafter's own prefill on each prefix."""
    C = common
    gd, tp = C.target()
    drafter, params, frozen = C.drafter(name)
    tokens, lengths = _rows(C.VOCAB, seed=1)
    anchors = E.anchor_positions(lengths, 4, min_context=2, seed=1)
    outs = []
    for generic in (False, True):
        cache, state, anchor_tok = E.prefix_states(
            gd, tp, drafter, params, frozen, jnp.asarray(tokens), jnp.asarray(lengths),
            jnp.asarray(anchors), gamma=3, max_len=24, generic=generic)
        outs.append(jax.device_get(E.verify_at_anchors(
            gd, tp, drafter, params, frozen, cache, state, anchor_tok, jax.random.key(5),
            jnp.float32(1.0), gamma=3, method="rejection")))
    valid = anchors.reshape(-1) >= 0
    for key in outs[0]:
        np.testing.assert_allclose(np.asarray(outs[0][key], np.float64)[valid],
                                   np.asarray(outs[1][key], np.float64)[valid], atol=2e-5,
                                   err_msg=f"{name}: {key}")
    assert 0 < np.asarray(outs[0]["accept_prob"])[valid].mean() < 1
