"""Cluster-robust standard errors (specjax/stats.py) and their use in the offline tables."""
import numpy as np
import pytest

from experiments import reproduce_tables as R
from specjax import evaluation_stats as ES
from specjax import stats as S


def test_cluster_sums_groups_by_id():
    ids, sums, counts = S.cluster_sums([1.0, 2.0, 3.0, 4.0], [7, 3, 7, 7])
    np.testing.assert_array_equal(ids, [3, 7])
    np.testing.assert_allclose(sums, [2.0, 8.0])
    np.testing.assert_allclose(counts, [1, 3])
    with pytest.raises(ValueError, match="differ in shape"):
        S.cluster_sums([1.0, 2.0], [0])


def test_clustered_mean_by_hand():
    # clusters {0: [0, 2], 1: [4, 6]}: mean 3; y_g − r n_g = (2 − 6, 10 − 6) = (−4, 4);
    # var = 2/1 · 32 / 16 = 4 -> s.e. 2 (the four values treated as independent give 1.29)
    m, se = S.clustered_mean([0.0, 2.0, 4.0, 6.0], [0, 0, 1, 1])
    assert (m, se) == pytest.approx((3.0, 2.0))


def test_clustered_slope_se_by_hand():
    # x = 0..3, y = (0, 1, 1, 3): slope 0.9, residuals (0.1, 0.2, −0.7, 0.4), Sxx = 5;
    # scores (x − x̄) e = (−0.15, −0.1, −0.35, 0.6) -> cluster sums (−0.25, 0.25);
    # var = 2/1 · 0.125 / 25 -> s.e. 0.1
    se = S.clustered_slope_se([0, 1, 2, 3], [0, 1, 1, 3], [0, 0, 1, 1])
    assert se == pytest.approx(0.1)
    fit = ES.linear_fit([0, 1, 2, 3], [0, 1, 1, 3], clusters=[0, 0, 1, 1])
    assert fit["slope"] == pytest.approx(0.9)
    assert fit["slope_se_clustered"] == pytest.approx(0.1)
    assert np.isnan(S.clustered_slope_se([0, 1, 2], [0, 1, 3], [5, 5, 5]))  # one cluster


def test_duplicating_observations_inside_clusters_leaves_the_clustered_se_unchanged():
    """Copies of an observation in its own cluster carry no new information: the clustered s.e.
    of the mean and of the slope are exactly unchanged, while the independent-sample ones shrink
    by about √2."""
    rng = np.random.default_rng(0)
    x, y, c = rng.normal(size=30), rng.normal(size=30), np.arange(30) // 3
    x2, y2, c2 = np.repeat(x, 2), np.repeat(y, 2), np.repeat(c, 2)
    assert S.clustered_mean(y2, c2)[1] == pytest.approx(S.clustered_mean(y, c)[1], rel=1e-12)
    assert S.clustered_slope_se(x2, y2, c2) == pytest.approx(S.clustered_slope_se(x, y, c),
                                                             rel=1e-12)
    iid, iid2 = ES.linear_fit(x, y)["slope_se"], ES.linear_fit(x2, y2)["slope_se"]
    assert iid2 < 0.75 * iid


def test_clustered_se_matches_the_spread_of_the_estimate_under_row_effects():
    """Monte Carlo with a row effect (between-row s.d. 1, within 0.5, 40 rows × 8 anchors): the
    mean clustered s.e. must match the empirical s.d. of the mean over 2,000 draws, while the
    independent-steps s.e. understates it by about √(1 + 7·0.8) ≈ 2.6 (intra-row correlation
    0.8). With 2,000 draws the empirical s.d. itself is known to ±1.6 % (1 s.e.) and the CR1
    estimate is biased low by O(1/G) = 2.5 %, so ±10 % is several s.e. wide."""
    rng = np.random.default_rng(123)
    rows, per, reps = 40, 8, 2000
    c = np.repeat(np.arange(rows), per)
    means, se_cl, se_iid = [], [], []
    for _ in range(reps):
        v = np.repeat(rng.normal(size=rows), per) + 0.5 * rng.normal(size=rows * per)
        m, se = S.clustered_mean(v, c)
        means.append(m)
        se_cl.append(se)
        se_iid.append(v.std(ddof=1) / np.sqrt(v.size))
    sd = np.std(means, ddof=1)
    assert 0.9 < np.mean(se_cl) / sd < 1.1
    assert np.mean(se_iid) / sd < 0.5


def _records(num_accepted, rows, gamma=2):
    n = len(num_accepted)
    return ES.StepRecords(num_accepted=np.asarray(num_accepted),
                          accept_prob=np.full((n, gamma), .5), tv=np.zeros((n, gamma)),
                          entropy=np.zeros((n, gamma)), entropy_raw=np.zeros((n, gamma)),
                          row=np.asarray(rows))


def test_summarize_clusters_by_row_and_keeps_per_row_sums():
    rec = _records([0, 1, 2, 2], [0, 0, 1, 1])
    m = ES.summarize(rec)
    assert m["per_row"] == {"row": [0, 1], "steps": [2, 2], "accepted": [1, 4]}
    assert m["n_rows"] == 2
    # accepted per step: clustered s.e. of the mean (as in test_clustered_mean_by_hand)
    assert m["tau_se"] == pytest.approx(S.clustered_mean([0, 1, 2, 2], [0, 0, 1, 1])[1])
    assert m["accept_rate_se"] == pytest.approx(m["tau_se"] / 2)
    assert m["tau_se_iid"] == pytest.approx(np.std([0, 1, 2, 2], ddof=1) / 2)


def test_concat_keeps_rows_of_one_set_and_separates_different_sets():
    a, b = _records([0, 1], [0, 1]), _records([2, 2], [0, 1])
    np.testing.assert_array_equal(ES.StepRecords.concat([a, b]).row, [0, 1, 0, 1])
    np.testing.assert_array_equal(ES.StepRecords.concat([a, b], distinct_rows=True).row,
                                  [0, 1, 2, 3])


def _cell(accepted_per_row, steps_per_row, gamma=3):
    acc, n = np.asarray(accepted_per_row, float), np.asarray(steps_per_row, float)
    return {"accept_rate": acc.sum() / n.sum() / gamma, "acceptance": [0.0] * gamma,
            "per_row": {"row": list(range(len(acc))), "steps": [int(x) for x in n],
                        "accepted": [int(x) for x in acc]},
            "entropy_fit": {"slope": -0.1, "slope_se_clustered": 0.02}}


def test_bebop_table_combines_seed_and_row_errors():
    """Two seeds of two losses on the same three rows. The seed s.e. is the spread of the two
    seeds' rates; the row s.e. pools the seeds' per-row sums; Δ is paired by row, so a loss equal
    to the reference row by row has Δ = 0 with a zero row s.e."""
    res = {"b_ce_s0": {"RS@1": {"math": _cell([3, 6, 9], [4, 4, 4])}},
           "b_ce_s1": {"RS@1": {"math": _cell([4, 6, 8], [4, 4, 4])}},
           "b_tv_s0": {"RS@1": {"math": _cell([3, 6, 9], [4, 4, 4])}},
           "b_tv_s1": {"RS@1": {"math": _cell([5, 7, 9], [4, 4, 4])}}}
    t = R.bebop_table(res, ["ce", "tv"], seeds=2, prefix="b")
    ce, tv = t["ce"]["math"], t["tv"]["math"]
    assert ce["rs"] == pytest.approx(18 / 36)
    assert ce["rs_se_seeds"] == pytest.approx(0.0)  # both seeds accept 18 of 36
    # rows pooled over seeds: (7, 12, 17) / 3 accepted out of 8 steps each
    assert ce["rs_se_rows"] == pytest.approx(S.clustered_ratio(np.array([7, 12, 17]) / 3,
                                                               [8, 8, 8])[1])
    assert ce["rs_se"] == pytest.approx(ce["rs_se_rows"])
    # Δ per seed: 0 and (21 − 18)/36; paired per-row differences (0 + 1, 0 + 1, 0 + 1)/3
    assert tv["delta"] == pytest.approx(3 / 36 / 2)
    assert tv["delta_se_seeds"] == pytest.approx(3 / 36 / 2)
    assert tv["delta_se_rows"] == pytest.approx(0.0)  # the same shift on every row
    assert tv["delta_se"] == pytest.approx(np.hypot(tv["delta_se_seeds"], tv["delta_se_rows"]))
    assert tv["rs_slope"] == pytest.approx(0.1) and tv["rs_slope_se"] == pytest.approx(0.02)
    # anchors that differ between a loss and its reference cannot be paired
    res["b_tv_s1"]["RS@1"]["math"]["per_row"]["steps"] = [3, 4, 5]
    assert np.isnan(R.bebop_table(res, ["tv"], seeds=2, prefix="b")["tv"]["math"]["delta_se_rows"])


def _tau_cell(accepted_per_row, steps_per_row, gamma=3, tau_pred=2.0):
    m = _cell(accepted_per_row, steps_per_row, gamma)
    m["tau"] = 1 + sum(accepted_per_row) / sum(steps_per_row)
    m["tau_pred"] = tau_pred
    return m


def test_dspark_table_pools_seeds_and_rows():
    """Seed 0 keeps the bare run name; τ is the mean over seeds, its s.e. combines the seed
    spread and the row-clustered s.e. of the seed-pooled τ; a drafter with one seed (n-gram)
    keeps its own row-clustered s.e."""
    res = {"mk": {"RS@1": {"math": _tau_cell([3, 6, 9], [4, 4, 4], tau_pred=2.0)}},
           "mk_s1": {"RS@1": {"math": _tau_cell([6, 6, 6], [4, 4, 4], tau_pred=3.0)}},
           "ng": {"RS@1": {"math": _tau_cell([0, 1, 2], [4, 4, 4])}}}
    t = R.dspark_table(res, {"Markov": {7: "mk"}, "n-gram": {7: "ng"}}, (7,), seeds=2)
    mk = t["Markov"]["math@7"]
    assert mk["tau"] == pytest.approx(2.5) and mk["tau_pred"] == pytest.approx(2.5)
    assert mk["tau_per_seed"] == pytest.approx([2.5, 2.5]) and mk["n_seeds"] == 2
    assert mk["tau_se_seeds"] == pytest.approx(0.0)
    # rows pooled over seeds: accepted (9, 12, 15) out of 8 steps each
    assert mk["tau_se_rows"] == pytest.approx(S.clustered_ratio([9, 12, 15], [8, 8, 8])[1])
    assert mk["tau_se"] == pytest.approx(mk["tau_se_rows"])
    ng = t["n-gram"]["math@7"]
    assert ng["n_seeds"] == 1 and np.isnan(ng["tau_se_seeds"])
    assert ng["tau"] == pytest.approx(1.25)
    assert ng["tau_se"] == pytest.approx(S.clustered_ratio([0, 1, 2], [4, 4, 4])[1])


def test_calibration_over_seeds_is_the_per_position_mean_and_se():
    def cal(after):
        return {"ece_before": [0.1, 0.2], "ece_after": after, "ece_cond_before": [0.3, 0.4],
                "ece_cond_after": [0.5, float("nan")]}
    over = R.calibration_over_seeds({"m": cal([0.02, 0.04]), "m_s1": cal([0.04, 0.04]),
                                     "r": cal([0.01, 0.01])}, seeds=2)
    assert set(over) == {"m", "r"} and over["m"]["n_seeds"] == 2 and over["r"]["n_seeds"] == 1
    assert over["m"]["ece_after"] == pytest.approx([0.03, 0.04])
    assert over["m"]["ece_after_se"] == pytest.approx([0.01, 0.0])  # std(ddof=1) / sqrt(2)
    assert over["m"]["ece_before"] == pytest.approx([0.1, 0.2])
    assert np.isnan(over["m"]["ece_cond_after"][1])  # no block reached: stays unknown
    assert np.isnan(over["r"]["ece_after_se"][0])
    md = R.calibration_seeds_markdown(over)
    assert "| survival, after STS | 3.0 ± 1.0 | 4.0 ± 0.0 |" in md


def test_calibration_halves_split_by_row():
    """STS is fitted on one half of the held-out rows and scored on the other: no row (of either
    domain) has anchors on both sides, and every step lands in exactly one half."""
    from experiments.offline_eval import split_halves
    rows_a = np.repeat(np.arange(9), np.arange(1, 10))  # row r holds r + 1 anchors
    recs = [_records(np.zeros(rows_a.size, int), rows_a),
            _records(np.zeros(5, int), [0, 0, 1, 2, 2])]
    fit, score = split_halves(recs, seed=3)
    all_rows = ES.StepRecords.concat(recs, distinct_rows=True).row
    assert sorted(np.concatenate([fit, score]).tolist()) == list(range(all_rows.size))
    assert not set(all_rows[fit]) & set(all_rows[score])
    assert len(set(all_rows[fit])) == len(np.unique(all_rows)) // 2
    # without rows: half of the steps each
    recs[0].row = recs[1].row = None
    fit, score = split_halves(recs, seed=3)
    assert (len(fit), len(score)) == (25, 25)


def test_saved_traces_round_trip(tmp_path):
    from experiments.offline_eval import save_traces
    rec = _records([0, 2, 1], [4, 4, 5])
    rec.confidences = np.array([[0.5, 0.25], [0.75, 0.5], [1.0, 0.125]])
    save_traces({"math": rec}, str(tmp_path / "t.npz"))
    z = np.load(tmp_path / "t.npz")
    np.testing.assert_array_equal(z["math/num_accepted"], [0, 2, 1])
    np.testing.assert_array_equal(z["math/row"], [4, 4, 5])
    np.testing.assert_array_equal(z["math/confidences"], rec.confidences)  # exact in float16
