"""The RL study: its statistics (hand-computed), the online drafter update, and (opt-in, slow on
CPU) the tiny end-to-end study with checks on its JSON and figures."""
import json
import math
import os

import numpy as np
import pytest

from specjax.rl.study_stats import clustered_ratio, decompose_delta_alpha, mean_se, ols_slope


def test_clustered_ratio_by_hand():
    # r = 6 / 6 = 1; residuals y - r n = (0, -1, 1); var = 3/2 * 2 / 36 = 1/12
    r, se = clustered_ratio([2, 1, 3], [2, 2, 2])
    assert r == 1.0 and se == pytest.approx(math.sqrt(1 / 12), rel=1e-12)
    # one token per cluster: the usual s / sqrt(n)
    v = np.array([1.0, 2.0, 4.0, 7.0])
    r, se = clustered_ratio(v, np.ones(4))
    assert r == pytest.approx(v.mean()) and se == pytest.approx(v.std(ddof=1) / 2.0, rel=1e-12)
    # clustering widens the error of correlated tokens: 2 clusters of identical tokens
    _, se_cl = clustered_ratio([0.0, 4.0], [2, 2])
    _, se_iid = clustered_ratio([0, 0, 1, 1], [1, 1, 1, 1])
    assert se_cl > se_iid
    assert math.isnan(clustered_ratio([1.0], [2.0])[1])
    with pytest.raises(ValueError):
        clustered_ratio([1, 2], [1])


def test_slope_and_decomposition():
    b, se = ols_slope([0, 1, 2, 3], [1.0, 0.5, 0.0, -0.5])
    assert b == pytest.approx(-0.5) and se == pytest.approx(0.0, abs=1e-12)
    a, h = [0.8, 0.7, 0.75, 0.6], [1.0, 1.2, 1.1, 1.5]
    d = decompose_delta_alpha(a, h, -0.4)
    assert d["entropy"] == pytest.approx([0.0, -0.08, -0.04, -0.2])
    assert np.allclose(np.add(d["entropy"], d["mismatch"]), d["total"], rtol=0, atol=1e-15)
    assert d["total"][0] == 0.0
    assert mean_se([1.0, 3.0]) == (2.0, 1.0)


def test_seed_mean_se_is_floored_at_the_evaluation_noise():
    from specjax.rl.study_stats import seed_mean_se
    # spread over seeds: s.d. 1/sqrt(2), s.e. 1/2 > floor sqrt(0.1^2 * 2) / 2
    m, se, how = seed_mean_se([(1.0, 0.1), (2.0, 0.1)])
    assert (m, how) == (1.5, "seeds") and se == pytest.approx(0.5)
    # seeds closer than their own evaluation noise: floor sqrt(3 * 0.3^2) / 3 = 0.3 / sqrt(3)
    m, se, how = seed_mean_se([(1.0, 0.3), (1.01, 0.3), (1.02, 0.3)])
    assert how == "evaluation floor" and se == pytest.approx(0.3 / math.sqrt(3))
    assert seed_mean_se([(2.0, 0.5)]) == (2.0, 0.5, "held-out problems (one seed)")
    # the labels name what each seed's s.e. measures; the numbers do not depend on them
    assert seed_mean_se([(1.0, 0.3), (1.01, 0.3), (1.02, 0.3)], floor_label="fit floor") == (
        pytest.approx(1.01), pytest.approx(0.3 / math.sqrt(3)), "fit floor")
    assert seed_mean_se([(2.0, 0.5)], one_seed_label="fit") == (2.0, 0.5, "fit")
    with pytest.raises(ValueError):
        seed_mean_se([])


def test_online_drafter_update_lowers_its_loss():
    import jax
    from flax import nnx

    from specjax.drafters import MTPConfig, MTPDrafter
    from specjax.models import ModelConfig, init_model
    from specjax.rl.online import OnlineDrafterUpdate
    cfg = ModelConfig(vocab_size=16, hidden_size=32, intermediate_size=64, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=8)
    target = init_model(cfg, seed=0)
    graphdef, state = nnx.split(target)
    drafter, params = MTPDrafter.create(cfg, MTPConfig(), seed=1)
    rows = np.asarray(jax.random.randint(jax.random.key(0), (4, 12), 0, 16), np.int32)
    valid = np.ones_like(rows, bool)
    valid[1, 9:] = False
    for loss in ("tv", "ce"):
        upd = OnlineDrafterUpdate(drafter, loss, learning_rate=1e-2, gamma=2, max_grad_norm=1.0)
        p, opt = params, upd.init(params)
        first = None
        for _ in range(15):
            p, opt, m = upd.step(p, opt, graphdef, state, rows, valid)
            first = float(m["loss"]) if first is None else first
        last = float(upd.loss_and_metrics(p, graphdef, state, rows, valid)[0])
        assert last < first, (loss, first, last)
        assert jax.tree.structure(p) == jax.tree.structure(params)
    # the evaluation takes what step takes: int64 rows and a 0/1 mask give the same program
    again = upd.loss_and_metrics(p, graphdef, state, rows.astype(np.int64), valid.astype(np.int8))
    assert float(again[0]) == last
    with pytest.raises(ValueError, match="rows and valid"):
        upd.loss_and_metrics(p, graphdef, state, rows, valid[:, :-1])
    with pytest.raises(ValueError):
        OnlineDrafterUpdate(drafter, "rkl", learning_rate=1e-3, gamma=2)


def check_study(summary: dict, results_dir: str, mode: str) -> None:
    """Structure and sane ranges of a study summary (also usable on a small/full run)."""
    assert summary["adaptation"] and summary["arms"]
    for c in summary["adaptation"]:
        assert 0.0 <= c["accept_rate"] <= 1.0 and all(0.0 <= a <= 1.0 for a in c["alpha"])
    for name, a in summary["arms"].items():
        m = a["mean"]
        assert a["steps"] >= 2
        for t in range(a["steps"]):
            assert m["entropy"][t] >= 0 and m["rollout_s"][t] > 0 and m["step_s"][t] > 0
            assert 0.0 <= m["reward"][t] <= 1.0
            if name != "no_spec":
                assert 0.0 <= m["acceptance"][t] <= 1.0 and m["tau"][t] >= 1.0
        for ps in a["per_seed"]:
            if ps is None:
                assert name == "no_spec"
                continue
            d = ps["decomposition"]
            assert np.allclose(np.add(d["entropy"], d["mismatch"]), d["total"], rtol=0,
                               atol=1e-12)
        assert 0.0 <= m["heldout_accuracy"][0] <= 1.0
    # every arm's rollouts pass the exactness monitor (mean log p + H = 0) at the 1e-6 level
    # (no verdict from a few steps: the tiny mode's two)
    exact = summary["claims"]["rollouts_exact_samples_of_the_policy"]
    assert set(exact) == set(summary["arms"]), exact
    for g in exact.values():
        assert g["holds"] is (None if g["steps"] < 30 else True), exact
    # each speculative arm's final greedy evaluation was repeated through the plain decoder
    greedy = summary["claims"]["greedy_evaluation_same_as_plain_decoder"]
    assert set(greedy) == set(summary["arms"]) - {"no_spec"}
    for g in greedy.values():
        for x in g["per_seed"]:
            assert x["problems"] == summary["params"]["n_heldout"]
            assert 0 <= x["same_text"] <= x["problems"]
            assert 0.0 <= x["accuracy_plain"] <= 1.0 and 0.0 <= x["accuracy_engine"] <= 1.0
            if x["same_text"] == x["problems"]:  # the same texts score the same
                assert x["accuracy_plain"] == x["accuracy_engine"]
    for fig in ("fig3_decomposition", "fig6_accept_length", "fig7_latency", "fig8_entropy_slope",
                "fig9a_online_updates", "heldout_accuracy", "adaptation"):
        assert os.path.getsize(os.path.join(results_dir, f"{fig}_{mode}.png")) > 1000


def test_tiny_study_end_to_end(tmp_path):
    """What `python -m experiments.rl_study --mode tiny` runs: every head loss and arm trained, run,
    summarised and plotted, then checked like the committed results (about a minute on a 2-core
    CPU under the suite's XLA flags)."""
    pytest.importorskip("tunix")
    from experiments import rl_study
    s = rl_study.run_study("tiny", str(tmp_path / "w"), results_dir=str(tmp_path / "r"))
    check_study(s, str(tmp_path / "r"), "tiny")
    with open(tmp_path / "r" / "study_tiny.json") as f:
        assert json.load(f)["arms"].keys() == s["arms"].keys()
    assert {a["name"] for a in rl_study.ARMS} == set(s["arms"])


def test_study_json_is_strict(tmp_path):
    """One seed leaves the spread over seeds undefined (nan): written as null, not NaN."""
    from specjax.evaluation import write_json  # what run_study writes study_<name>.json with
    from specjax.rl.study_stats import mean_se
    path = tmp_path / "s.json"
    write_json(str(path), {"gain": mean_se([0.5]), "params": {"seeds": (0,)}})

    def refuse(name):
        raise ValueError(f"non-strict JSON constant {name}")
    assert json.loads(path.read_text(), parse_constant=refuse) == {
        "gain": [0.5, None], "params": {"seeds": [0]}}


def test_study_overrides_are_typed_and_checked(tmp_path):
    from experiments import rl_study as S
    o = S.parse_overrides(["rl_steps=30", "seeds=0,1", "temps=0.6,1.0", "learning_rate=3e-5"])
    assert o == {"rl_steps": 30, "seeds": (0, 1), "temps": (0.6, 1.0), "learning_rate": 3e-5}
    p = S.mode_params("small", o)
    assert p["rl_steps"] == 30 and p["seeds"] == (0, 1) and p["overrides"] == o
    assert p["temperature"] == 1.0 and p["gamma"] == 3  # derived after the overrides
    assert S.parse_overrides(["warm_start=false"]) == {"warm_start": False}
    for bad in (["rl_step=3"], ["rl_steps"], ["rl_steps=3.5"], ["seeds="], ["warm_start=no"]):
        with pytest.raises(ValueError):
            S.parse_overrides(bad)
    # a workdir keeps its parameters: resuming with others is refused, the same ones pass
    S._check_workdir_params(str(tmp_path), p)
    S._check_workdir_params(str(tmp_path), S.mode_params("small", o))
    with pytest.raises(ValueError, match="rl_steps"):
        S._check_workdir_params(str(tmp_path), S.mode_params("small", {"rl_steps": 31}))
    # choosing a subset of the arms does not change how the finished ones were produced
    sub = S.parse_overrides(["arms=no_spec,rs_e2e_tv"])
    S._check_workdir_params(str(tmp_path), S.mode_params("small", dict(o, **sub)))
    # ... nor does choosing more seeds (each arm / seed is its own run)
    S._check_workdir_params(str(tmp_path), S.mode_params("small", dict(o, seeds=(0, 1, 2))))
    # "arms=" is the adaptation alone; an empty list of anything else is still an error
    assert S.parse_overrides(["arms="]) == {"arms": ()}
    S._check_workdir_params(str(tmp_path), S.mode_params("small", dict(o, arms=())))
    # a second training seed of the heads is another study
    assert S.parse_overrides(["head_seed=1"]) == {"head_seed": 1}
    with pytest.raises(ValueError, match="head_seed"):
        S._check_workdir_params(str(tmp_path), S.mode_params("small", dict(o, head_seed=1)))
    # a params.json written before head_seed existed resumes as head_seed = 0
    old = tmp_path / "old"
    S._check_workdir_params(str(old), p)
    stored = json.loads((old / "params.json").read_text())
    del stored["head_seed"]
    (old / "params.json").write_text(json.dumps(stored))
    S._check_workdir_params(str(old), p)
    with pytest.raises(ValueError, match="head_seed"):
        S._check_workdir_params(str(old), S.mode_params("small", dict(o, head_seed=2)))
    # ... and one written before eval_samples existed as eval_samples = 0 (no sampled eval)
    del stored["eval_samples"]
    (old / "params.json").write_text(json.dumps(stored))
    S._check_workdir_params(str(old), S.mode_params("small", dict(o, eval_samples=0)))
    with pytest.raises(ValueError, match="eval_samples"):
        S._check_workdir_params(str(old), p)


def test_adaptation_only_summary_has_no_arm_tables_or_figures(tmp_path):
    """``--set arms=``: the summary, its markdown and its figures hold the adaptation alone."""
    pytest.importorskip("matplotlib")
    from experiments import rl_study as S
    from experiments.rl_study_figures import write_figures
    from experiments.rl_study_report import study_markdown, summarize
    p = S.mode_params("small", {"arms": ()})
    adapt = [dict(loss=loss, gamma=3, cap=64, temp=1.0, accept_rate=a, alpha=[a, a, a])
             for loss, a in (("kl", 0.75), ("e2e_tv", 0.78))]
    s = summarize(p, adapt, [])
    assert s["arms"] == {} and s["claims"] == {}
    assert s["adaptation_gain_e2e_tv_vs_kl"][0]["gain_points"] == pytest.approx(3.0)
    md = study_markdown(s)
    assert "| e2e_tv | 3 | 64 | 1.0 | 0.7800 |" in md and "GRPO arms" not in md
    assert "no RL arms" in md and "seed(s)" not in md
    paths = write_figures(s, str(tmp_path), "t")
    assert [os.path.basename(x) for x in paths] == ["adaptation_t.png"]


def test_summary_claims_on_synthetic_arms():
    """Hand-made records: TO's acceptance falls 0.1 per nat of entropy, RS's 0.01; RS's acceptance
    alternates ±3 points around a flat line (max drift 6 points, fitted trend ~0)."""
    from experiments.rl_study_report import summarize
    steps, gamma = 11, 2  # odd: the ±3 wobble has no linear trend
    h = 1.0 + 0.1 * np.arange(steps)

    def records(acc):
        return [{"acceptance": float(a), "entropy": float(e), "tau": 2.0, "reward": 0.1,
                 "heldout_accuracy": 0.1 if t == 0 else None, "rollout_s": 1.0, "step_s": 2.0,
                 "alpha_1": float(a), "alpha_2": float(a)} for t, (a, e) in enumerate(zip(acc, h))]

    wobble = 0.03 * (-1.0) ** np.arange(steps)
    arms = []
    for seed in (0, 1):
        arms.append({"arm": "no_spec", "seed": seed, "records": records(np.full(steps, 0.5)),
                     "heldout_accuracy_end": 0.2})
        arms.append({"arm": "to_ce", "seed": seed, "records": records(0.6 - 0.1 * (h - 1)),
                     "heldout_accuracy_end": 0.2})
        arms.append({"arm": "rs_e2e_tv", "seed": seed, "heldout_accuracy_end": 0.2 + 0.01 * seed,
                     "records": records(0.8 - 0.01 * (h - 1) + wobble)})
        # online TV: half the frozen head's loss over the run (-0.5 points against -1.0)
        arms.append({"arm": "rs_e2e_tv_online_tv", "seed": seed, "heldout_accuracy_end": 0.2,
                     "records": records(0.8 - 0.005 * (h - 1) + wobble)})
    s = summarize({"mode": "test", "gamma": gamma}, [], arms)
    c = s["claims"]
    assert c["slope_rs_e2e_tv_le_third_of_to"]["holds"]
    assert s["arms"]["to_ce"]["slope"][0] == pytest.approx(-0.1)
    drift = c["rs_e2e_tv_acceptance_within_2_points"]
    assert drift["max_abs_drift_points"] == pytest.approx(6.9, abs=1e-9)  # 6 + 0.9 of the trend
    assert not drift["holds_max"] and drift["holds"]
    assert abs(drift["trend_drift_points"][0]) < 2
    # the arms' difference is paired by problem: records without per-problem scores give none
    assert "accuracy_gain_equal_within_noise" not in c
    assert c["rollout_speedup_vs_no_spec"]["rs_e2e_tv"] == pytest.approx(1.0)
    # online minus frozen drift, paired by seed: +0.5 points in both seeds; the seeds agree
    # exactly, so the s.e. is the floor of the two trend fits' own noise (the wobble's)
    online = c["online_update_drift_minus_frozen_points"]["rs_e2e_tv_online_tv"]
    assert [d for d, _ in online["per_seed"]] == pytest.approx([0.5, 0.5])
    fit = s["arms"]["rs_e2e_tv"]["per_seed"][0]["drift_trend_se"]
    assert fit > 0 and online["per_seed"][0][1] == pytest.approx(100 * np.sqrt(2) * fit)
    assert online["mean"] == pytest.approx([0.5, 100 * np.sqrt(2) * fit / np.sqrt(2)])
    assert online["se_over"] == "trend-fit floor"
    assert online["within_2_se"] == (0.5 <= 2 * 100 * fit)
    assert "rs_e2e_tv_online_ce" not in c["online_update_drift_minus_frozen_points"]
    # the same comparison step by step: online - frozen = 100 * 0.005 * 0.1 t = 0.05 t points
    # (t = 0..10): over the run mean 0.25, s.d. 0.05 sqrt(11), s.e. 0.05; over the last fifth
    # (the last 2 steps: 0.45, 0.5) mean 0.475, s.e. 0.025. The seeds agree, so each mean's
    # s.e. is the per-step floor: one seed's s.e. / sqrt(2)
    w = c["online_update_acceptance_minus_frozen_points"]["rs_e2e_tv_online_tv"]
    assert all(x == pytest.approx([0.25, 0.05]) for x in w["run"]["per_seed"])
    assert len(w["run"]["per_seed"]) == 2
    assert w["run"]["mean"] == pytest.approx([0.25, 0.05 / np.sqrt(2)])
    assert w["run"]["se_over"] == "per-step floor" and w["run"]["steps"] == steps
    assert w["last_fifth"]["steps"] == 2
    assert w["last_fifth"]["mean"] == pytest.approx([0.475, 0.025 / np.sqrt(2)])
    assert not w["run"]["within_2_se"] and not w["last_fifth"]["within_2_se"]
    assert "rs_e2e_tv_online_ce" not in c["online_update_acceptance_minus_frozen_points"]
    from experiments.rl_study_report import study_markdown
    s["params"].update(temperature=1.0, seeds=(0, 1), rl_steps=steps)
    md = study_markdown(s)
    assert "| to_ce | 0.600 → 0.500 |" in md and "-0.100 ± 0.000" in md  # slope b of TO
    assert "| 0.100 → 0.205 | +10.5 ± 0.5 |" in md  # rs_e2e_tv's held-out accuracy and its gain
    # claims bullets read like the JSON: an undefined spread is null, not Python's nan
    s["claims"]["toy"] = {"x": [0.123456789, float("nan")], "holds": True}
    md = study_markdown(s)
    assert '- `toy`: {"x": [0.1235, null], "holds": true}' in md and "nan" not in md


def test_exactness_claim_by_hand_and_on_a_biased_arm():
    """The pooled exactness monitor: per step ``logp + entropy`` (the rollout's mean log p + H).
    An exact arm wobbles around 0; a biased one sits 0.02 nats above it."""
    from scipy import stats as sps

    from experiments.rl_study_report import summarize
    from specjax.rl.study_stats import Z_1E6
    assert Z_1E6 == pytest.approx(sps.norm.isf(0.5e-6), rel=1e-6)
    wobble = 0.01 * np.tile([1.0, -1.0, 2.0, -2.0, 0.5, -0.5], 3)  # 18 steps a seed
    arms = []
    for seed in (0, 1):
        for name, shift in (("exact", 0.0), ("biased", 0.02)):
            arms.append({"arm": name, "seed": seed, "heldout_accuracy_end": 0.2, "records": [
                {"logp": -0.3 + w + shift, "entropy": 0.3, "rollout_s": 1.0, "step_s": 1.0}
                for w in wobble]})
    arms[0]["records"].append({"logp": None, "entropy": None, "rollout_s": 1.0, "step_s": 1.0})
    c = summarize({"mode": "test", "gamma": 2}, [], arms)["claims"]
    g = c["rollouts_exact_samples_of_the_policy"]
    sd = np.std(np.tile(wobble, 2), ddof=1)  # 36 steps, mean 0
    assert g["exact"]["steps"] == 36  # the step without tokens is left out
    assert g["exact"]["gap_nats"] == pytest.approx([0.0, sd / 6], abs=1e-12)
    assert g["exact"]["holds"] is True
    assert g["biased"]["gap_nats"] == pytest.approx([0.02, sd / 6])
    assert g["biased"]["z"] == pytest.approx(0.02 / (sd / 6))
    assert g["biased"]["z"] > Z_1E6 and g["biased"]["holds"] is False
    # a few steps: a mean and a s.e., no verdict
    few = summarize({"mode": "test", "gamma": 2}, [], [dict(arms[1], records=arms[1]["records"][
        :6])])["claims"]["rollouts_exact_samples_of_the_policy"]["biased"]
    assert few["steps"] == 6 and few["holds"] is None
    from specjax.rl.study_stats import pooled_exactness_gap
    assert pooled_exactness_gap([None, 0.1, None]) is None  # one value: no spread
    # a token the policy cannot produce (-inf) fails the check outright
    bad = pooled_exactness_gap([float("-inf")] + [0.0] * 40)
    assert bad["z"] == float("-inf") and bad["holds"] is False


def test_greedy_same_as_plain_claim():
    """Per seed: problems whose final greedy text is the same through both decoders, and both
    accuracies; runs recorded without the repeat are left out."""
    from experiments.rl_study_report import _greedy_same_as_plain
    old = {"seed": 0, "heldout_accuracy_end": 0.5, "heldout_end": {}}
    same = {"seed": 1, "heldout_accuracy_end": 0.5, "heldout_end": {
        "greedy_text_same_as_plain": [1, 1, 1, 1], "greedy_plain_correct": [1, 0, 1, 0]}}
    assert _greedy_same_as_plain([old]) is None
    g = _greedy_same_as_plain([old, same])
    assert g == {"per_seed": [{"seed": 1, "same_text": 4, "problems": 4,
                               "accuracy_engine": 0.5, "accuracy_plain": 0.5}], "holds": True}
    differ = {"seed": 2, "heldout_accuracy_end": 0.25, "heldout_end": {
        "greedy_text_same_as_plain": [1, 0, 1, 1], "greedy_plain_correct": [1, 1, 0, 0]}}
    g = _greedy_same_as_plain([same, differ])
    assert g["per_seed"][1]["same_text"] == 3 and g["per_seed"][1]["accuracy_plain"] == 0.5
    assert not g["holds"]


def test_paired_gain_by_hand():
    from experiments.rl_study_gains import paired_gain
    from specjax.stats import clustered_ratio
    n = np.array([2.0, 2.0, 4.0])
    a, b = (np.array([2.0, 1.0, 3.0]), n), (np.array([1.0, 1.0, 2.0]), n)
    g = paired_gain(a, b)
    assert g["a"] == pytest.approx(6 / 8) and g["b"] == pytest.approx(4 / 8)
    assert g["gain_points"] == pytest.approx(25.0) and g["rows"] == 3
    assert g["gain_se_points"] == pytest.approx(100 * clustered_ratio([1.0, 0.0, 1.0], n)[1])
    with pytest.raises(ValueError, match="same rows"):
        paired_gain(a, (b[0], n + 1))


def test_rollout_check_statistics():
    from experiments.rl_rollout_check import compare
    rng = np.random.default_rng(0)

    def sample(shift):
        n = rng.integers(5, 40, 300).astype(np.float64)
        return {"length": n, "entropy_sum": n * (1.0 + shift + 0.1 * rng.standard_normal(300)),
                "logp_sum": -n * (1.0 + shift), "n_logp": n}

    a = sample(0.0)
    same = compare(a, a)
    assert same["length"]["ks_statistic"] == 0.0 and same["mean_logp"]["ks_pvalue"] == 1.0
    assert same["entropy_per_token"]["a"] == same["entropy_per_token"]["b"]
    shifted = compare(a, sample(0.2))  # every sequence's entropy and log-prob moved by 0.2 nats
    assert shifted["mean_entropy"]["ks_pvalue"] < 1e-6 and shifted["mean_logp"]["ks_pvalue"] < 1e-6
    assert shifted["logp_per_token"]["a"][0] == pytest.approx(-1.0)
    assert shifted["logp_per_token"]["b"][0] == pytest.approx(-1.2)


def test_rollout_speed_benchmark_measures_every_decoder():
    """``benchmarks/rl_rollout_speed.py`` on a tiny random policy: every decoder ran each rep, the
    speculative engine's τ is a real tokens-per-step figure, and the speed-ups and the bound are
    the ratios of the timings it recorded."""
    pytest.importorskip("tunix")
    from benchmarks.rl_rollout_speed import measure
    from specjax.drafters import MTPConfig, MTPDrafter
    from specjax.models import ModelConfig, init_model
    cfg = ModelConfig(vocab_size=32, hidden_size=32, intermediate_size=64, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=8)
    model = init_model(cfg, seed=0)
    drafter, params = MTPDrafter.create(cfg, MTPConfig(), seed=1)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, 32, size=int(n)).tolist() for n in (3, 5, 4, 6)]
    r = measure(model, drafter, params, prompts, eos_id=0, gamma=2, new_tokens=6,
                max_prompt_length=8, temperature=1.0, reps=1, cost_reps=1)
    d = r["decoders"]
    assert set(d) == {"generate", "engine_none", "engine_none_rows", "spec", "spec_filters",
                      "spec_rows"}
    for name, x in d.items():
        assert len(x["walls"]) == 1 and all(4 <= t <= 4 * 6 for t in x["tokens"]), name
    assert 1.0 <= d["spec"]["tau"] <= 3.0  # γ = 2
    base = d[r["baseline"]]["tokens_per_s"]
    assert r["baseline"] == max(("generate", "engine_none", "engine_none_rows"),
                                key=lambda n: d[n]["tokens_per_s"])
    assert d["spec"]["speedup"] == pytest.approx(d["spec"]["tokens_per_s"] / base)
    c = r["step_costs"]
    assert r["bound"] == pytest.approx(d["spec"]["tau"] * c["plain_s"] /
                                       (c["draft_s"] + c["verify_s"]))
    assert r["measured_over_bound"] == pytest.approx(d["spec"]["speedup"] / r["bound"])
    for name in ("engine_none", "engine_none_rows", "spec", "spec_filters", "spec_rows"):
        assert 0 < d[name]["prefill_s"] < d[name]["wall_s"], name  # admitting took some of a rep
    assert r["rows_speedup"] == pytest.approx(d["spec"]["wall_s"] / d["spec_rows"]["wall_s"])


def test_accuracy_per_problem_groups_samples_by_problem():
    from specjax.data.math_problems import MathProblem
    from specjax.rl import task as T
    probs = [MathProblem(question="q1", answer=3, solution=""),
             MathProblem(question="q2", answer=5, solution="")]
    per = T.accuracy_per_problem(["#### 3", "#### 4", "#### 3", "#### 5", "x", "#### 5"], probs, 3)
    assert per.tolist() == pytest.approx([2 / 3, 2 / 3])
    assert T.accuracy_per_problem(["#### 3", "#### 4"], probs, 1).tolist() == [1.0, 0.0]
    with pytest.raises(ValueError, match="completions"):
        T.accuracy_per_problem(["#### 3"] * 5, probs, 3)


def test_heldout_gains_are_paired_by_problem():
    """One seed, four held-out problems: gains and their s.e. over problems, by hand."""
    from experiments.rl_study_report import study_markdown, summarize

    def run(arm, greedy, sampled):
        recs = [{"entropy": 0.3, "reward": 0.1, "rollout_s": 1.0, "step_s": 2.0,
                 "heldout_accuracy": float(np.mean(greedy[0])), "heldout_correct": greedy[0],
                 "heldout_sampled_accuracy": float(np.mean(sampled[0])),
                 "heldout_sampled_per_problem": sampled[0]}] + \
               [{"entropy": 0.3, "reward": 0.1, "rollout_s": 1.0, "step_s": 2.0}]
        return {"arm": arm, "seed": 0, "records": recs,
                "heldout_accuracy_end": float(np.mean(greedy[1])),
                "heldout_end": {"heldout_correct": greedy[1],
                                "heldout_sampled_accuracy": float(np.mean(sampled[1])),
                                "heldout_sampled_per_problem": sampled[1]}}

    start = [0.25, 0.5, 0.0, 0.0]
    arms = [run("no_spec", ([0, 1, 0, 0], [1, 1, 0, 1]), (start, [0.5, 0.5, 0.25, 0.25])),
            run("rs_e2e_tv", ([0, 1, 0, 0], [0, 1, 0, 0]), (start, [0.25, 0.5, 0.25, 0.25])),
            run("rs_e2e_tv_online_ce", ([0, 1, 0, 0], [1, 1, 1, 1]), (start, start))]
    s = summarize({"mode": "test", "gamma": 2}, [], arms)
    ns = s["arms"]["no_spec"]
    # greedy: changes (1, 0, 0, 1): mean 1/2, s.d. sqrt(1/3), s.e. sqrt(1/3) / 2
    assert ns["greedy_gain"]["per_seed"][0] == pytest.approx([0.5, math.sqrt(1 / 3) / 2])
    # sampled: changes (1/4, 0, 1/4, 1/4): mean 3/16, s.d. 1/8, s.e. 1/16
    assert ns["sampled_gain"]["per_seed"][0] == pytest.approx([0.1875, 0.0625])
    assert math.isnan(ns["sampled_gain"]["over_seeds"][1])  # one seed: no s.e. over seeds
    assert ns["heldout_end"] == {"heldout_accuracy": 0.75, "heldout_sampled_accuracy": 0.375}
    c = s["claims"]
    raised = c["grpo_raises_heldout_accuracy"]
    assert raised["no_spec"]["sampled"]["holds"] and raised["no_spec"]["greedy"]["holds"]
    assert raised["rs_e2e_tv"]["greedy"] == {"gain": 0.0, "se": 0.0, "holds": False,
                                             "se_over": "held-out problems (one seed)"}
    # rs - no_spec per problem: (-1/4, 0, 0, 0): mean -1/16, s.d. 1/8, s.e. 1/16
    eq = c["sampled_gain_equal_within_noise"]
    assert eq["paired_diff_rs_e2e_tv_minus_no_spec"] == pytest.approx([-0.0625, 0.0625])
    assert eq["holds"]
    # greedy, rs - no_spec per problem: (0 - 1, 0, 0, 0 - 1): mean -1/2, s.e. sqrt(1/3) / 2
    eq = c["accuracy_gain_equal_within_noise"]
    assert eq["paired_diff_rs_e2e_tv_minus_no_spec"] == pytest.approx([-0.5, math.sqrt(1 / 3) / 2])
    assert eq["se_over"] == "held-out problems (one seed)" and eq["holds"]
    # every speculative arm against no_spec, in points; rs_e2e_tv's equals the claims above
    per_arm = c["gain_minus_no_spec_points"]
    assert "no_spec" not in per_arm
    assert per_arm["rs_e2e_tv"]["greedy"]["diff"] == pytest.approx(
        [-50.0, 100 * math.sqrt(1 / 3) / 2])
    assert per_arm["rs_e2e_tv"]["sampled"]["diff"] == pytest.approx([-6.25, 6.25])
    # online_ce - no_spec, greedy per problem: (1 - 1, 0, 1, 0): mean 1/4, s.d. 1/2, s.e. 1/4
    assert per_arm["rs_e2e_tv_online_ce"]["greedy"]["diff"] == pytest.approx([25.0, 25.0])
    # sampled: (0 - 1/4, 0, 0 - 1/4, 0 - 1/4): mean -3/16, s.e. 1/16: 3 s.e. apart
    ce = per_arm["rs_e2e_tv_online_ce"]["sampled"]
    assert ce["diff"] == pytest.approx([-18.75, 6.25]) and not ce["holds"]
    s["params"].update(temperature=1.0, seeds=(0,), rl_steps=2)
    md = study_markdown(s)
    assert "| no_spec | sampled | 0.188 → 0.375 | +18.8 ± 6.2 | +18.8 ± 6.2 (held-out problems " \
        "(one seed)) |" in md
    assert "| rs_e2e_tv | greedy | 0.250 → 0.250 | +0.0 ± 0.0 | +0.0 ± 0.0 (held-out" in md


def test_latency_leaves_out_compilation_and_evaluations():
    from experiments.rl_study_report import _latency
    recs = [{"step_s": 9.0, "heldout_accuracy": 0.1}, {"step_s": 1.0}, {"step_s": 5.0},
            {"step_s": 2.0, "heldout_accuracy": 0.2}, {"step_s": 3.0}]
    # step 0 compiles; step 2's time held step 3's evaluation (recorded before eval_s existed)
    assert _latency(recs, "step_s") == [1.0, 2.0, 3.0]
    recs[3]["eval_s"] = 4.0  # recorded apart: step 2's time is its own
    assert _latency(recs, "step_s") == [1.0, 5.0, 2.0, 3.0]
    assert _latency(recs[:1], "step_s") == [9.0]  # one step: its time, compile included


def test_heldout_eval_greedy_and_sampled():
    """``task.heldout_eval`` on a fake generator: greedy scored per problem, samples grouped by
    problem (problem-major), and the paired gain by hand."""
    import types
    from specjax.data.math_problems import MathProblem
    from specjax.rl import task as T
    probs = [MathProblem(question=f"q{i}", answer=i, solution="") for i in range(3)]
    calls = []

    def generate(prompts, config):
        calls.append((len(prompts), config))
        if config == "greedy":  # right on problems 0 and 2
            text = ["#### 0", "#### 9", "#### 2"]
        else:  # 2 samples per problem: right 1 / 2, 2 / 2, 0 / 2
            text = ["#### 0", "x", "#### 1", "#### 1", "#### 5", "#### 6"]
        return types.SimpleNamespace(text=text)

    ev = T.heldout_eval(generate, probs, "greedy", "sampled", 2)
    assert calls == [(3, "greedy"), (6, "sampled")]
    assert ev["heldout_correct"] == [1, 0, 1] and ev["heldout_accuracy"] == pytest.approx(2 / 3)
    assert ev["heldout_sampled_per_problem"] == [0.5, 1.0, 0.0]
    assert ev["heldout_sampled_accuracy"] == pytest.approx(0.5)
    assert ev["heldout_sampled_se"] == pytest.approx(0.5 / math.sqrt(3))  # s.d. 1/2 over 3
    assert set(T.heldout_eval(generate, probs, "greedy")) == {"heldout_accuracy",
                                                              "heldout_correct"}
    with pytest.raises(ValueError, match="sampled_config"):
        T.heldout_eval(generate, probs, "greedy", None, 2)
    # changes (0.5, -1, 0.5): mean 0, s.d. sqrt(3/4), s.e. 1/2
    assert T.paired_gain([0.5, 1.0, 0.0], [1.0, 0.0, 0.5]) == pytest.approx((0.0, 0.5))
    with pytest.raises(ValueError):
        T.paired_gain([], [])


def test_an_interrupted_arm_reruns_with_a_fresh_rollout_log(tmp_path):
    """run_arm appends to rollout.jsonl; a rerun of an arm without arm.json must not append to the
    interrupted run's log. Other files in the directory stay."""
    from experiments.rl_study_arms import fresh_arm_dir
    d = tmp_path / "arms" / "rs_e2e_tv_s1"
    assert fresh_arm_dir(str(d)) == str(d) and d.is_dir()  # created when missing
    (d / "rollout.jsonl").write_text('{"step": 0}\n{"step": 1}\n')
    (d / "events.out").write_text("x")
    fresh_arm_dir(str(d))
    assert not (d / "rollout.jsonl").exists() and (d / "events.out").read_text() == "x"


def test_run_arms_resumes_finished_arms_and_reports_progress(tmp_path, monkeypatch, capsys):
    """Finished arms are read back, not rerun; each arm that runs gets a start and an end line on
    stderr (a log file shows no Tunix bar). ``run_arm`` is replaced by a recorder here."""
    import experiments.rl_study_arms as arms_mod
    import specjax.training.drafter_run as drafter_run
    from experiments.rl_study import mode_params, parse_overrides, run_arms
    with pytest.raises(ValueError, match="takes a tuple"):
        mode_params("tiny", {"arms": "no_spec,rs_e2e_tv"})  # would be a tuple of characters
    with pytest.raises(ValueError, match="unknown study parameter 'rl_step'"):
        mode_params("tiny", {"rl_step": 3})
    p = mode_params("tiny", parse_overrides(["arms=no_spec,rs_e2e_tv", "seeds=0,1"]))
    adapt = [{"gamma": p["gamma"], "cap": p["cap"], "temp": p["temperature"], "loss": loss,
              "name": f"{loss}_head"} for loss in ("ce", "e2e_tv")]
    done = tmp_path / "arms" / "no_spec_s1"
    done.mkdir(parents=True)
    (done / "arm.json").write_text(json.dumps({"arm": "no_spec", "seed": 1, "finished": True}))
    ran = []

    def fake_run_arm(arm, seed, p, model, tok, drafter, dparams, d):
        ran.append((arm["name"], seed, drafter))
        return {"arm": arm["name"], "seed": seed, "records": [{"heldout_accuracy": 0.25}],
                "heldout_accuracy_end": 0.5, "train_seconds": 90.0}
    monkeypatch.setattr(arms_mod, "run_arm", fake_run_arm)
    monkeypatch.setattr(drafter_run, "load_drafter", lambda path: (os.path.basename(path), {}, {}))
    out = run_arms(p, lambda: "model", "tok", adapt, str(tmp_path))
    # no_spec drafts nothing and takes the first trained head; rs_e2e_tv takes the e2e-TV head
    assert ran == [("no_spec", 0, "ce_head"), ("rs_e2e_tv", 0, "e2e_tv_head"),
                   ("rs_e2e_tv", 1, "e2e_tv_head")]
    assert [(o["arm"], o["seed"]) for o in out] == [("no_spec", 0), ("no_spec", 1),
                                                   ("rs_e2e_tv", 0), ("rs_e2e_tv", 1)]
    assert out[1]["finished"]
    err = capsys.readouterr().err.splitlines()
    assert err == [
        f"rl_study: arm 1/4: no_spec seed 0, {p['rl_steps']} GRPO steps",
        "rl_study: arm no_spec seed 0: held-out greedy accuracy 0.250 -> 0.500 (1.5 min of GRPO)",
        f"rl_study: arm 3/4: rs_e2e_tv seed 0, {p['rl_steps']} GRPO steps",
        "rl_study: arm rs_e2e_tv seed 0: held-out greedy accuracy 0.250 -> 0.500 "
        "(1.5 min of GRPO)",
        f"rl_study: arm 4/4: rs_e2e_tv seed 1, {p['rl_steps']} GRPO steps",
        "rl_study: arm rs_e2e_tv seed 1: held-out greedy accuracy 0.250 -> 0.500 "
        "(1.5 min of GRPO)"]


def test_study_rollout_plain_text_is_the_plain_decoder_then_speculation_again():
    """``StudyRollout.plain_text`` (the final greedy evaluation's second decoder) decodes with
    ``specjax.models.generate`` and hands the engine back: greedy, both give the same text, and
    the next call drafts again."""
    pytest.importorskip("tunix")
    from tunix.rl.rollout.base_rollout import RolloutConfig

    from experiments.rl_study_arms import StudyRollout
    from id_tokenizer import IdTokenizer
    from specjax.drafters import MTPConfig, MTPDrafter
    from specjax.engine import EngineConfig
    from specjax.models import ModelConfig, init_model
    from specjax.rl import TunixPolicy
    from specjax.scheduling import SchedulerConfig

    cfg = ModelConfig(vocab_size=6, hidden_size=32, intermediate_size=64, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=8)
    model = init_model(cfg, seed=1)
    model.embed[...] = model.embed[...] * 6.0  # peaked next-token distributions: no near-ties
    d, p = MTPDrafter.create(cfg, MTPConfig(), seed=3)
    ec = EngineConfig(num_slots=4, max_len=16, gamma=2, prefill_buckets=(4,),
                      scheduler=SchedulerConfig("fixed", k=2), overlap=False, filters=False)
    rc = RolloutConfig(max_tokens_to_generate=6, max_prompt_length=4, temperature=0.0,
                       eos_tokens=[99])
    r = StudyRollout(rollout_actor=TunixPolicy(model), tokenizer=IdTokenizer(), rollout_config=rc,
                     drafter=d, drafter_params=p, engine_config=ec)
    prompts = ["3 0 2", "1 2 3 0", "0 0", "2"]
    spec = r.generate(prompts, rc, mode="eval")
    assert r.last_metrics["drafted"] > 0
    plain = r.plain_text(prompts, rc)
    assert r.last_metrics["drafted"] == 0 and r.last_metrics["steps"] > 0  # the plain decoder
    assert plain == spec.text and all(len(t.split()) == 6 for t in plain)
    r.generate(prompts, rc, mode="eval")
    assert r.last_metrics["drafted"] > 0  # the engine is back
