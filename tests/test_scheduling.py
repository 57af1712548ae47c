"""Host-side scheduling policies: Algorithm 1, production form, Appendix A bias."""
import itertools

import numpy as np
import pytest
from scipy import stats

from specjax import buckets
from specjax import scheduling as S
from specjax.buckets import SPSProfile


def test_bucket_names_are_importable_from_scheduling():
    """Users import the bucket and profile names from :mod:`specjax.scheduling`."""
    for name in ("SPSProfile", "default_buckets", "pick_bucket", "plan_chunks", "profile_sps",
                 "prompt_chunk_buckets", "validate_buckets"):
        assert getattr(S, name) is getattr(buckets, name)
        assert name in S.__all__
    assert all(hasattr(S, name) for name in S.__all__)


def _brute_force_best(conf, sps):
    r, g = conf.shape
    best = -1.0
    for lengths in itertools.product(range(g + 1), repeat=r):
        if r + sum(lengths) < len(sps):
            best = max(best, S.expected_throughput(conf, np.array(lengths), sps))
    return best


@pytest.mark.parametrize("seed", range(6))
def test_algorithm1_matches_brute_force_when_unimodal(seed):
    """SPS(B) = 1 / (t0 + t1 B) (a smooth cost curve) makes Θ unimodal along the greedy path."""
    rng = np.random.default_rng(seed)
    r, g = 3, 4
    conf = rng.uniform(0.2, 1.0, size=(r, g))
    t0, t1 = rng.uniform(0.5, 2.0), rng.uniform(0.05, 0.6)
    sps = 1.0 / (t0 + t1 * np.arange(r * (g + 1) + 1))
    lengths = S.prefix_schedule(conf, sps)
    assert np.all(lengths <= g)
    got = S.expected_throughput(conf, lengths, sps)
    assert got == pytest.approx(_brute_force_best(conf, sps), rel=1e-12)


def test_algorithm1_early_stop_vs_global_search_on_a_cliff():
    """A jagged SPS curve: early stop halts at the first drop, the global search crosses it."""
    conf = np.array([[0.95, 0.95, 0.95, 0.95]])
    sps = np.array([1.0, 1.0, 0.50, 0.49, 0.48, 0.47])  # cliff between B=1 and B=2
    assert S.prefix_schedule(conf, sps).tolist() == [0]
    assert S.prefix_schedule(conf, sps, early_stop=False).tolist() == [4]


def test_lengths_respect_caps_and_bucket_limit():
    conf = np.full((4, 6), 0.99)
    sps = np.ones(11)  # flat: every admission raises Θ until B_max = 10
    lengths = S.prefix_schedule(conf, sps, max_len=np.array([6, 0, 2, 6]))
    assert lengths[1] == 0 and lengths[2] <= 2
    assert 4 + lengths.sum() <= 10
    with pytest.raises(ValueError, match="do not fit"):
        S.prefix_schedule(np.full((12, 2), 0.5), sps)
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        S.prefix_schedule(np.array([[1.5]]), sps)


def test_production_form_never_exceeds_budget_and_admits_by_live_rank():
    rng = np.random.default_rng(0)
    sps = 1.0 / (1.0 + 0.08 * np.arange(64 + 1))
    for _ in range(200):
        r, g = rng.integers(1, 8), rng.integers(1, 7)
        live = rng.uniform(0, 1, size=(r, g))
        stale = rng.uniform(0, 1, size=(r, g))
        budget = S.budget_search(stale, sps)
        lengths = S.production_schedule(live, stale, sps)
        assert lengths.sum() <= budget and r + lengths.sum() < len(sps)
        # Live rank: every admitted candidate has survival ≥ every non-admitted one.
        a = S.prefix_survival(live)
        admitted = np.arange(g)[None, :] < lengths[:, None]
        if admitted.any() and (~admitted & (a > 0)).any():
            assert a[admitted].min() >= a[~admitted & (a > 0)].max()
        # The budget depends on stale confidences only: changing live ones leaves Σℓ ≤ budget.
        assert S.production_schedule(rng.uniform(0, 1, size=(r, g)), stale, sps).sum() <= budget


def test_budget_search_prices_drafting():
    """Budget 0 means no drafting: it is scored without the drafting cost, budgets > 0 with it."""
    conf = np.array([[0.8, 0.5], [0.6, 0.5]])  # a = [[.8, .4], [.6, .3]]
    prof = SPSProfile((2, 4, 6), (10.0, 8.0, 5.0))
    # Free drafting: Θ(0) = 2·10 = 20; Θ(1) = 2.8·8 = 22.4; Θ(2) = 3.4·8 = 27.2 (best);
    # Θ(3) = 3.8·5 = 19; Θ(4) = 4.1·5 = 20.5.
    assert S.budget_search(conf, prof.table()) == 2
    # Drafting costs 0.05 s: with-draft SPS = 1/(1/8 + .05) = 5.714 (B ≤ 4), 1/(.2 + .05) = 4
    # (B ≤ 6): Θ(2) = 3.4·5.714 = 19.43 < Θ(0) = 20 -> do not draft.
    costly = SPSProfile((2, 4, 6), (10.0, 8.0, 5.0), draft_s=0.05)
    np.testing.assert_allclose(costly.table_with_draft()[3:5], 1 / (1 / 8 + 0.05))
    assert S.budget_search(conf, costly.table(), sps_table_draft=costly.table_with_draft()) == 0
    # 0.03 s: Θ(2) = 3.4/(0.125 + 0.03) = 21.94 > 20 -> budget 2 again.
    cheap = SPSProfile((2, 4, 6), (10.0, 8.0, 5.0), draft_s=0.03)
    assert S.budget_search(conf, cheap.table(), sps_table_draft=cheap.table_with_draft()) == 2
    with pytest.raises(ValueError, match="draft_s"):
        SPSProfile((2,), (1.0,), draft_s=-1.0)


def test_simple_policies():
    conf = np.array([[0.9, 0.8, 0.1], [0.4, 0.9, 0.9]])
    sps = np.ones(10)
    cfg = S.SchedulerConfig
    assert S.schedule(cfg("none"), conf, sps).tolist() == [0, 0]
    assert S.schedule(cfg("fixed", k=2), conf, sps).tolist() == [2, 2]
    assert S.schedule(cfg("fixed", k=9), conf, sps).tolist() == [3, 3]
    assert S.schedule(cfg("mtp1"), conf, sps).tolist() == [1, 1]
    # a = [[.9, .72, .072], [.4, .36, .324]] ≥ 0.5 -> [2, 0]
    assert S.schedule(cfg("threshold", threshold=0.5), conf, sps).tolist() == [2, 0]
    with pytest.raises(ValueError, match="policy"):
        cfg("bogus")


def _appendix_a_first_token(policy_early_stop: bool, n: int, seed: int) -> np.ndarray:
    """Simulates DSpark Appendix A: one request, γ = 2, vocabulary {A=0, B=1}.

    p_t = (0.7, 0.3) and q = (0.5, 0.5) at position 1 (so a_1 = 1 − TV = 0.8); the Markov
    confidence of position 2 depends on the drawn x_1: c_2 = 0.9 if x_1 = A else 0.
    SPS(1) = 1.0, SPS(2) = 0.5, SPS(3) = 0.45. Returns counts of the first emitted token.
    """
    rng = np.random.default_rng(seed)
    p, q = np.array([0.7, 0.3]), np.array([0.5, 0.5])
    sps = np.array([1.0, 1.0, 0.5, 0.45])
    x1 = (rng.random(n) < q[1]).astype(int)
    out = np.empty(n, int)
    lengths = {}
    for x in (0, 1):  # the schedule is a function of x1 only: evaluate once per value
        conf = np.array([[0.8, 0.9 if x == 0 else 0.0]])
        lengths[x] = S.prefix_schedule(conf, sps, early_stop=policy_early_stop)[0]
    ell = np.where(x1 == 0, lengths[0], lengths[1])
    u = rng.random(n)
    accept = (ell >= 1) & (u * q[x1] < p[x1])
    residual = np.maximum(p - q, 0)
    residual /= residual.sum()
    fresh_p = (rng.random(n) < p[1]).astype(int)
    fresh_res = (rng.random(n) < residual[1]).astype(int)
    out = np.where(ell == 0, fresh_p, np.where(accept, x1, fresh_res))
    return np.bincount(out, minlength=2)


def test_appendix_a_global_search_is_biased_and_early_stop_is_exact():
    n = 200_000
    crit = stats.chi2.isf(1e-6, df=1)
    p = np.array([0.7, 0.3])

    def chi2(counts):
        exp = p * counts.sum()
        return float(np.sum((counts - exp) ** 2 / exp))

    exact = _appendix_a_first_token(True, n, seed=1)
    biased = _appendix_a_first_token(False, n, seed=1)
    assert chi2(exact) < crit
    assert chi2(biased) > crit
    # The biased distribution is the paper's (0.85, 0.15).
    assert biased[0] / n == pytest.approx(0.85, abs=0.005)
