"""The numbers docs/RESULTS.md quotes about the committed results, recomputed from their JSON."""
import json
import math
import os

import pytest

from experiments import results_audit as A

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FULL = os.path.join(ROOT, "experiments", "results", "full")
TPU = os.path.join(os.path.dirname(FULL), "tpu")


def _tpu_doc() -> str:
    return open(os.path.join(ROOT, "docs", "TPU.md")).read()


def test_tau_misses_counts_cells_beyond_tolerance():
    results = {"d": {"RS@1": {"all": {"tau": 3.0, "tau_pred": 3.06},
                              "math": {"tau": 2.0, "tau_pred": 2.04}}}}
    miss, n, worst, where = A.tau_misses(results)
    assert (miss, n, where) == (1, 2, "d RS@1 all") and abs(worst - 0.06) < 1e-12


def test_quoted_numbers_match_the_committed_results():
    summary = json.load(open(os.path.join(FULL, "summary.json")))
    s0 = {k: v for k, v in summary["bebop"]["results"].items() if k.endswith("_s0")}
    miss, n, worst, _ = A.tau_misses(s0)
    assert (miss, n, round(worst, 2)) == (8, 100, 0.15)
    for part, expected in (("dspark_g7", (6, 24, 0.10)), ("dspark_g15", (5, 24, 0.19))):
        miss, n, worst, _ = A.tau_misses(json.load(open(os.path.join(FULL, part, "results.json"))))
        assert (miss, n, round(worst, 2)) == expected, part
    cal = json.load(open(os.path.join(FULL, "dspark_g15", "calibration_dspark_markov_g15.json")))
    assert round(100 * max(cal["fit_ece_after"]), 1) == 2.8
    assert round(100 * max(cal["ece_cond_after"]), 1) == 27.3


def test_clustered_errors_are_in_the_committed_results():
    """The committed tables carry row-clustered errors and the per-row sums they come from."""
    for part in ("dspark_g7", "dspark_g15"):
        results = json.load(open(os.path.join(FULL, part, "results.json")))
        r = A.se_ratios(results)
        assert len(r) == 24, part
        m = results["dspark_markov_g7" if part == "dspark_g7" else "dspark_markov_g15"]["RS@1"]
        rows = m["math"]["per_row"]
        assert sum(rows["steps"]) == m["math"]["n_steps"]
    summary = json.load(open(os.path.join(FULL, "summary.json")))
    assert summary["mode_config"]["seeds"] >= 3
    e2e = summary["bebop"]["table_vs_kl"]["e2e_tv"]["all"]
    assert e2e["n_seeds"] >= 3 and e2e["delta_se"] >= max(e2e["delta_se_seeds"],
                                                          e2e["delta_se_rows"])


SEEDS = os.path.join(os.path.dirname(FULL), "dspark_seeds")


def test_quoted_three_seed_dspark_numbers_match_the_committed_results():
    """docs/RESULTS.md parts 2-3 quote the three-seed DSpark run: the Markov-vs-DFlash gain per
    seed, the predicted-τ misses, and the calibration means over seeds."""
    summary = json.load(open(os.path.join(SEEDS, "summary.json")))
    assert summary["dspark"]["seeds"] == 3
    table = summary["dspark"]["table"]
    for g, gains in ((7, [17.9, 15.7, 15.9]), (15, [25.7, 23.4, 21.6])):
        a, b = (table[k][f"all@{g}"]["tau_per_seed"] for k in ("DFlash", "DSpark-Markov"))
        assert [round(100 * (y / x - 1), 1) for x, y in zip(a, b)] == gains, g
    assert all(m["n_seeds"] == 3 for lab in ("DFlash", "DSpark-Markov", "DSpark-RNN", "draft LM",
                                             "MTP (CE, recursive)") for m in table[lab].values())
    for part, expected in (("dspark_g7", (10, 64, 0.10)), ("dspark_g15", (23, 64, 0.17))):
        miss, n, worst, _ = A.tau_misses(json.load(open(os.path.join(SEEDS, part, "results.json"))))
        assert (miss, n, round(worst, 2)) == expected, part
    over = summary["dspark"]["calibration_over_seeds"]
    worst_after = {k: round(100 * max(v["ece_after"]), 1) for k, v in over.items()}
    assert worst_after == {"dspark_markov_g7": 3.8, "dspark_rnn_g7": 4.1,
                           "dspark_markov_g15": 5.1, "dspark_rnn_g15": 7.6}


RL = os.path.join(os.path.dirname(FULL), "rl")


def _points(mean_se):
    """``[mean, se]`` as fractions -> the ``(+x.x, y.y)`` points docs/RL.md prints."""
    return round(100 * mean_se[0], 1), round(100 * mean_se[1], 1)


def test_quoted_rl_p16_100_numbers_match_the_committed_results():
    """docs/RL.md's "128 rollouts per step for 100 steps" section: the held-out gains per arm
    and seed, the paired difference of the arms, the acceptance drift and the rollout ratio."""
    study = json.load(open(os.path.join(RL, "study_math_stage_p16_100.json")))
    arms, claims = study["arms"], study["claims"]
    quoted = {("no_spec", "greedy_gain"): ((0.2, 1.3), [(0.5, 2.3), (0.5, 2.2), (-0.5, 2.1)]),
              ("no_spec", "sampled_gain"): ((2.1, 0.8), [(1.9, 1.4), (1.6, 1.4), (2.9, 1.3)]),
              ("rs_e2e_tv", "greedy_gain"): ((0.3, 1.2), [(-0.5, 1.9), (1.0, 2.4), (0.5, 1.9)]),
              ("rs_e2e_tv", "sampled_gain"): ((3.4, 0.8), [(3.1, 1.4), (3.4, 1.4), (3.6, 1.4)])}
    for (arm, key), (mean, per_seed) in quoted.items():
        gain = arms[arm][key]
        assert _points(gain["combined"]) == mean, (arm, key)
        assert [_points(g) for g in gain["per_seed"]] == per_seed, (arm, key)
    diff = claims["sampled_gain_equal_within_noise"]
    assert round(100 * diff["paired_diff_rs_e2e_tv_minus_no_spec"][0], 2) == 1.25
    assert round(100 * diff["paired_diff_rs_e2e_tv_minus_no_spec"][1], 1) == 1.0
    assert round(diff["over_seeds"][0] / diff["over_seeds"][1], 1) == 4.3  # "4.3 s.e."
    assert _points(claims["accuracy_gain_equal_within_noise"]
                   ["paired_diff_rs_e2e_tv_minus_no_spec"]) == (0.2, 0.6)
    drift = claims["rs_e2e_tv_acceptance_within_2_points"]
    assert [round(x, 1) for x in drift["trend_drift_points"]] == [-0.9, 0.2]
    assert round(drift["max_abs_drift_points"], 1) == 4.5 and drift["holds"]
    assert round(claims["rollout_speedup_vs_no_spec"]["rs_e2e_tv"], 2) == 0.40


def test_quoted_rl_t06_three_seed_numbers_match_the_committed_results():
    """docs/RL.md's "Three seeds" paragraph of the T = 0.6 section, and its seed 0 against the
    seed-0 JSON it says it reproduced."""
    study = json.load(open(os.path.join(RL, "study_math_stage_p16_100_t06_3seeds.json")))
    arms, claims = study["arms"], study["claims"]
    assert study["params"]["seeds"] == [0, 1, 2] and study["params"]["temps"] == [0.6]
    quoted = {("no_spec", "greedy_gain"): ((2.5, 1.4), [(0.5, 2.6), (3.5, 2.3), (3.5, 2.3)]),
              ("no_spec", "sampled_gain"): ((0.6, 0.8), [(0.1, 1.6), (1.6, 1.4), (0.1, 1.4)]),
              ("rs_e2e_tv", "greedy_gain"): ((2.2, 1.3), [(2.5, 2.2), (2.5, 2.3), (1.5, 2.1)]),
              ("rs_e2e_tv", "sampled_gain"): ((1.2, 0.8), [(1.6, 1.2), (0.8, 1.5), (1.4, 1.3)])}
    for (arm, key), (mean, per_seed) in quoted.items():
        gain = arms[arm][key]
        assert _points(gain["combined"]) == mean and gain["se_over"] == "evaluation floor"
        assert [_points(g) for g in gain["per_seed"]] == per_seed, (arm, key)
    raised = claims["grpo_raises_heldout_accuracy"]
    ratios = {(a, m): round(raised[a][m]["gain"] / raised[a][m]["se"], 1)
              for a in ("no_spec", "rs_e2e_tv") for m in ("greedy", "sampled")}
    assert ratios[("no_spec", "greedy")] == 1.8 and ratios[("rs_e2e_tv", "greedy")] == 1.7
    assert ratios[("rs_e2e_tv", "sampled")] == 1.6 and not raised["no_spec"]["sampled"]["holds"]
    assert max(ratios.values()) < 2
    greedy = claims["accuracy_gain_equal_within_noise"]
    assert _points(greedy["paired_diff_rs_e2e_tv_minus_no_spec"]) == (-0.3, 1.2)
    assert greedy["se_over"] == "seeds"
    assert [_points(g) for g in greedy["per_seed"]] == [(2.0, 2.3), (-1.0, 1.2), (-2.0, 1.9)]
    sampled = claims["sampled_gain_equal_within_noise"]
    assert _points(sampled["paired_diff_rs_e2e_tv_minus_no_spec"]) == (0.6, 1.0)
    assert [_points(g) for g in sampled["per_seed"]] == [(1.5, 1.8), (-0.9, 1.8), (1.2, 1.7)]
    assert round(100 * sampled["per_seed"][2][0], 2) == 1.25
    assert greedy["holds"] and sampled["holds"]
    drift = claims["rs_e2e_tv_acceptance_within_2_points"]
    assert [round(x, 1) for x in drift["trend_drift_points"]] == [-0.7, 0.1]
    assert round(drift["max_abs_drift_points"], 1) == 5.2 and not drift["holds_max"]
    mean = arms["rs_e2e_tv"]["mean"]
    assert (round(mean["acceptance"][0], 3), round(mean["acceptance"][-1], 3)) == (0.511, 0.512)
    assert (round(mean["tau"][0], 2), round(mean["tau"][-1], 2)) == (2.46, 2.46)
    assert (round(mean["entropy"][0], 3), round(mean["entropy"][-1], 3)) == (0.263, 0.264)
    # seed 0 here is the committed seed-0 run: same gains, same acceptance series
    seed0 = json.load(open(os.path.join(RL, "study_math_stage_p16_100_t06.json")))
    assert [study["adaptation"][0][k] for k in ("accept_rate", "alpha")] == \
        [seed0["adaptation"][0][k] for k in ("accept_rate", "alpha")]
    for arm in ("no_spec", "rs_e2e_tv"):
        for key in ("greedy_gain", "sampled_gain"):
            assert arms[arm][key]["per_seed"][0] == seed0["arms"][arm][key]["per_seed"][0]
    assert arms["rs_e2e_tv"]["seeds"][0] == 0
    assert arms["rs_e2e_tv"]["per_seed"][0] == seed0["arms"]["rs_e2e_tv"]["per_seed"][0]



def test_quoted_tpu_rejection_sampler_numbers_match_the_committed_results():
    """docs/TPU.md's Pallas rejection sampler: both kernels' compiled bytes as a share of one read
    of p and q, and their roofline times, from the one tpu_plan run."""
    path = os.path.join(TPU, "rejection", "plan.json")
    runs = {r["name"]: r for r in json.load(open(path))}
    one, two = runs["rejection[mosaic_tpu]"], runs["rejection[mosaic_tpu_two_phase]"]
    assert one["shapes"] == two["shapes"] == {"batch": 256, "gamma": 7, "vocab": 151936,
                                               "row_major": True}
    share = lambda r: round(r["bytes_accessed"] / r["notes"]["pq_bytes"], 2)  # noqa: E731
    assert (share(one), share(two)) == (1.08, 0.20)
    assert (round(1e3 * one["roofline_seconds"], 2), round(1e3 * two["roofline_seconds"], 3)) == (
        0.77, 0.145)
    doc = _tpu_doc()
    for quoted in ("**1.08x one read of `p` and `q`**", "**0.20x one read of `p` and `q`**",
                   "(0.145 ms at the v5e roofline, against\n1.08x and 0.77 ms)"):
        assert quoted in doc, quoted

def test_quoted_tpu_row_chunk_rounding_numbers_match_the_committed_results():
    """docs/TPU.md's rounding table and the tiling table it refers back to."""
    tpu = os.path.join(TPU, "chunk_fix")
    default, tiled = json.load(open(os.path.join(tpu, "rounding.json")))
    keys = ("chunk", "chunk_rows", "rows_per_chip")
    assert [default[k] for k in keys] == ["default", 400, 50]
    assert [tiled[k] for k in keys] == ["tiled", 320, 40]
    assert default["loss_rows"] == tiled["loss_rows"] == [4800]
    assert [round(r["temp_gib"], 2) for r in (default, tiled)] == [3.32, 3.30]
    assert [round(r["bytes_accessed_gb"], 2) for r in (default, tiled)] == [26.70, 27.17]
    assert round((default["temp_gib"] - tiled["temp_gib"]) * 1024) == 23
    assert round(100 * (default["temp_gib"] / tiled["temp_gib"] - 1), 1) == 0.7
    assert round(tiled["bytes_accessed_gb"] - default["bytes_accessed_gb"], 2) == 0.46
    assert round(100 * (tiled["bytes_accessed_gb"] / default["bytes_accessed_gb"] - 1), 1) == 1.7
    tiling = {r["chunk_rows"]: r for r in json.load(open(os.path.join(tpu, "tiling.json")))}
    assert {k: round(r["temp_gib"], 2) for k, r in tiling.items()} == {
        48: 4.04, 64: 3.46, 96: 4.04, 128: 3.46, 384: 3.46}
    assert round(tiling[48]["temp_gib"] - tiling[64]["temp_gib"], 2) == 0.58


def test_quoted_tpu_fsdp_width_numbers_match_the_committed_results():
    """docs/TPU.md's "FSDP width": the width study's table, built here from its JSON, and the
    roofline times and memory of the pod table's v5e-256 rows before and after the change."""
    doc = _tpu_doc()
    flat = " ".join(doc.split())  # the prose's line breaks fall anywhere
    name = {"qwen3-4b": "Qwen3-4B", "qwen3-8b": "Qwen3-8B"}
    width = json.load(open(os.path.join(TPU, "width", "width.json")))
    assert [(r["model"], r["fsdp"], r["data"]) for r in width] == [
        ("qwen3-4b", 256, 1), ("qwen3-4b", 32, 8), ("qwen3-8b", 256, 1), ("qwen3-8b", 32, 8)]
    for r in width:
        line = (f"| {name[r['model']]} | {r['fsdp']} x {r['data']} | {r['hidden_per_chip']} | "
                f"{r['temp_gib']:.2f} | {r['used_gib']:.2f} / 16.0 | "
                f"{r['bytes_accessed_gb']:.1f} |")
        assert line in doc, line
    assert f"({width[2]['used_gib']:.2f} -> {width[3]['used_gib']:.2f} GiB used)" in doc

    def v5e256(rows):
        return {(r["shapes"]["model"], r["shapes"]["drafter"]): r for r in rows
                if r["topology"] == "v5e:16x16" and r["shapes"]["seq"] == 4096}
    before = v5e256(json.load(open(os.path.join(TPU, "width", "table_before.json"))))
    after = v5e256(json.load(open(os.path.join(TPU, "table.json"))))
    for (model, drafter), label in [(("qwen3-4b", "mtp"), "4B + MTP"),
                                    (("qwen3-4b", "dspark"), "4B + DSpark"),
                                    (("qwen3-0.6b", "mtp"), "0.6B + MTP"),
                                    (("qwen3-0.6b", "dspark"), "0.6B + DSpark")]:
        b, a = before[(model, drafter)], after[(model, drafter)]
        assert b["mesh"]["fsdp"] == 256 and a["mesh"]["fsdp"] < 256
        assert a["fits"] and a["roofline_seconds"] < b["roofline_seconds"]
        quoted = f"{label} {b['roofline_seconds']:.3f} -> {a['roofline_seconds']:.3f} s"
        assert quoted in flat, quoted
    assert not before[("qwen3-4b", "mtp")]["fits"]
    gib = lambda r: f"{r['used_bytes'] / 2**30:.1f}"  # noqa: E731
    (b4, a4), (b06, a06) = [(gib(before[(m, "dspark")]), gib(after[(m, "dspark")]))
                            for m in ("qwen3-4b", "qwen3-0.6b")]
    assert f"(4B {b4} -> {a4} GiB, 0.6B {b06} -> {a06} GiB)" in flat


def test_quoted_tpu_attention_chunk_numbers_match_the_committed_results():
    """docs/TPU.md's attention-chunk table (built here from the four tpu_plan runs and the pod
    table's dense rows) and the numbers its paragraph quotes."""
    flat = " ".join(_tpu_doc().split())
    table = json.load(open(os.path.join(TPU, "table.json")))
    label = {"qwen3-8b": "Qwen3-8B", "qwen3-4b": "Qwen3-4B", "mtp": "MTP", "dspark": "DSpark",
             "v5e:16x16": "v5e-256", "v5e:2x4": "v5e-8"}

    def cell(r):
        return (f"{r['used_bytes'] / 2**30:.1f} / 16.0, {'fits' if r['fits'] else 'no'}, "
                f"{r['roofline_seconds']:.3g} s")
    chunked = {}
    for name in ("qwen3-8b_mtp_v5e-256", "qwen3-8b_mtp_v5e-8", "qwen3-8b_dspark_v5e-8",
                 "qwen3-4b_dspark_v5e-8"):
        (r,) = json.load(open(os.path.join(TPU, "attention", name, "plan.json")))
        m, d, topo = r["shapes"]["model"], r["shapes"]["drafter"], r["topology"]
        assert r["shapes"]["seq"] == 4096 and name == f"{m}_{d}_{label[topo]}"
        dense = {x["shapes"]["seq"]: x for x in table if (x["shapes"]["model"], x["shapes"][
            "drafter"], x["topology"]) == (m, d, topo)}
        assert not dense[4096]["fits"] and dense[2048]["fits"]
        line = (f"| {label[m]} + {label[d]}, {label[topo]} | {cell(dense[4096])} | {cell(r)} | "
                f"{cell(dense[2048])} |")
        assert line in flat, line
        chunked[name] = (r, dense)
    fits = [n for n, (r, _) in chunked.items() if r["fits"]]
    assert fits == ["qwen3-8b_mtp_v5e-256", "qwen3-4b_dspark_v5e-8"]
    for n in fits:  # "Both steps are longer than the 2048-token step of the same tokens"
        r, dense = chunked[n]
        assert r["roofline_seconds"] > dense[2048]["roofline_seconds"]
    assert f"{round(100 * chunked['qwen3-4b_dspark_v5e-8'][0]['hbm_fraction'])} % of HBM" in flat
    saved = [(d[4096]["used_bytes"] - r["used_bytes"]) / 2**30
             for r, d in (chunked["qwen3-8b_mtp_v5e-8"], chunked["qwen3-8b_dspark_v5e-8"])]
    assert f"save only {saved[0]:.2f} and {saved[1]:.2f} GiB there" in flat


def test_quoted_rl_online_update_numbers_match_the_committed_results():
    """docs/RL.md's online-update paragraph of the quickstart run: the claim the study now writes,
    computed by the study's own code from the committed arms (that JSON predates the claim)."""
    import numpy as np
    from experiments.rl_study_report import _claims
    study = json.load(open(os.path.join(RL, "study_quickstart_online.json")))
    assert "online_update_drift_minus_frozen_points" not in study["claims"]
    by_arm = {n: [{"seed": s, "records": [{}]} for s in a["seeds"]]
              for n, a in study["arms"].items()}
    online = _claims(study["arms"], by_arm)["online_update_drift_minus_frozen_points"]
    ce, tv = online["rs_e2e_tv_online_ce"], online["rs_e2e_tv_online_tv"]
    assert [round(x, 1) for x in ce["mean"]] == [8.1, 7.1] and ce["se_over"] == "seeds"
    assert [round(x, 1) for x, _ in ce["per_seed"]] == [21.1, 6.6, -3.4]
    assert [round(x, 1) for x in tv["mean"]] == [3.6, 4.1] and tv["se_over"] == "trend-fit floor"
    assert [round(x, 1) for x, _ in tv["per_seed"]] == [7.9, -0.1, 2.9]
    assert ce["within_2_se"] and tv["within_2_se"]
    per_seed_se = [se for c in (ce, tv) for _, se in c["per_seed"]]
    assert (round(min(per_seed_se), 1), round(max(per_seed_se), 1)) == (5.8, 8.4)
    spread = np.std([x for x, _ in tv["per_seed"]], ddof=1) / np.sqrt(3)
    assert round(spread, 1) == 2.3


def test_quoted_rl_t06_online_update_numbers_match_the_committed_results():
    """docs/RL.md's "Online drafter updates at T = 0.6, three seeds" paragraph."""
    import numpy as np
    study = json.load(open(os.path.join(RL, "study_math_stage_p16_100_t06_online.json")))
    arms = study["arms"]
    assert study["params"]["seeds"] == [0, 1, 2] and study["params"]["drafter_lr"] == 1e-4
    assert study["params"]["prompts_per_step"] * study["params"]["num_generations"] == 128
    rows = {"rs_e2e_tv": ((0.511, 0.512), [-0.7, -0.8, -0.6], 0.505, 0.502, 2.44, (0.263, 0.264)),
            "rs_e2e_tv_online_ce": ((0.511, 0.513), [1.5, 1.1, 0.8], 0.501, 0.505, 2.43,
                                    (0.263, 0.252)),
            "rs_e2e_tv_online_tv": ((0.511, 0.521), [0.7, 1.7, 1.3], 0.515, 0.519, 2.46,
                                    (0.263, 0.259))}
    for arm, (acc, drift, acc_mean, last20, tau, ent) in rows.items():
        m, per = arms[arm]["mean"], arms[arm]["per_seed"]
        assert (round(m["acceptance"][0], 3), round(m["acceptance"][-1], 3)) == acc, arm
        assert [round(100 * p["drift_trend"], 1) for p in per] == drift, arm
        assert all(0.5 <= round(100 * p["drift_trend_se"], 1) <= 0.7 for p in per), arm
        assert round(float(np.mean(m["acceptance"])), 3) == acc_mean, arm
        assert round(float(np.mean(m["acceptance"][-20:])), 3) == last20, arm
        assert round(float(np.mean(m["tau"])), 2) == tau, arm
        assert (round(m["entropy"][0], 3), round(m["entropy"][-1], 3)) == ent, arm
    # online - frozen acceptance over windows, paired by seed: each arm's eq. 16 total is its
    # acceptance minus its own step 0, and step 0 is the same rollout in every arm of a seed
    frozen = arms["rs_e2e_tv"]["per_seed"]
    assert len({round(arms[a]["mean"]["acceptance"][0], 12) for a in rows}) == 1

    def window(arm, lo, hi):
        d = [100 * (np.mean(p["decomposition"]["total"][lo:hi]) -
                    np.mean(f["decomposition"]["total"][lo:hi]))
             for p, f in zip(arms[arm]["per_seed"], frozen)]
        return (round(float(np.mean(d)), 1), round(float(np.std(d, ddof=1) / np.sqrt(3)), 1),
                [round(x, 1) for x in d])
    tv, ce = "rs_e2e_tv_online_tv", "rs_e2e_tv_online_ce"
    assert window(tv, 0, 100) == (1.0, 0.1, [1.0, 0.8, 1.2])
    assert window(tv, 80, 100) == (1.7, 0.2, [1.5, 2.0, 1.6])
    assert window(ce, 10, 50) == (-0.9, 0.2, [-0.9, -1.3, -0.6])
    w = study["claims"]["online_update_acceptance_minus_frozen_points"]
    claimed = {(a, k): (round(w[a][k]["mean"][0], 1), round(w[a][k]["mean"][1], 1),
                        w[a][k]["se_over"], w[a][k]["steps"]) for a in (ce, tv) for k in w[a]}
    assert claimed == {(tv, "run"): (1.0, 0.1, "seeds", 100),
                       (tv, "last_fifth"): (1.7, 0.2, "seeds", 20),
                       (ce, "run"): (-0.4, 0.2, "seeds", 100),
                       (ce, "last_fifth"): (0.3, 0.2, "per-step floor", 20)}
    tenths = lambda a: np.reshape(arms[a]["mean"]["acceptance"], (10, 10)).mean(1)
    assert np.all(tenths(tv) > tenths("rs_e2e_tv"))  # "above it in every tenth of the run"
    online = study["claims"]["online_update_drift_minus_frozen_points"]
    for arm, (mean, ratio) in {ce: ([1.8, 0.5], 3.7), tv: ([1.9, 0.5], 3.8)}.items():
        assert [round(x, 1) for x in online[arm]["mean"]] == mean, arm
        assert round(online[arm]["mean"][0] / online[arm]["mean"][1], 1) == ratio, arm
        assert not online[arm]["within_2_se"]
    # "Seed 0 alone gives +2.1 ± 0.9 (CE) and +1.4 ± 0.9 (TV)"
    assert [[round(x, 1) for x in online[a]["per_seed"][0]] for a in (ce, tv)] == [[2.1, 0.9],
                                                                                    [1.4, 0.9]]
    # eq. 16 mismatch part over the last 20 steps: mean over seeds ± s.e. over seeds
    for arm, want in {"rs_e2e_tv": (-1.0, 0.8), ce: (-0.6, 0.7), tv: (0.7, 0.9)}.items():
        mis = [100 * np.mean(p["decomposition"]["mismatch"][-20:]) for p in arms[arm]["per_seed"]]
        got = (round(float(np.mean(mis)), 1), round(float(np.std(mis, ddof=1) / np.sqrt(3)), 1))
        assert got == want, arm
    gains = {a: _points(arms[a]["greedy_gain"]["combined"]) for a in arms}
    assert gains == {"no_spec": (2.5, 1.4), "rs_e2e_tv": (2.2, 1.3), ce: (0.0, 1.2),
                     tv: (-0.5, 1.1)}
    vs = study["claims"]["gain_minus_no_spec_points"]
    got = {(a, m): (round(vs[a][m]["diff"][0], 1), round(vs[a][m]["diff"][1], 1),
                    vs[a][m]["holds"]) for a in (ce, tv) for m in ("greedy", "sampled")}
    assert got == {(ce, "greedy"): (-2.5, 1.8, True), (tv, "greedy"): (-3.0, 1.3, False),
                   (ce, "sampled"): (0.2, 1.1, True), (tv, "sampled"): (-0.6, 1.0, True)}
    z = abs(vs[tv]["greedy"]["diff"][0]) / vs[tv]["greedy"]["diff"][1]
    assert round(z, 1) == 2.4
    p = math.erfc(z / math.sqrt(2))  # two-sided normal p-value, and its union bound over six
    assert round(p, 2) == 0.02 and round(6 * p, 1) == 0.1


def test_quoted_rl_summary_table_matches_the_committed_results():
    """docs/RL.md's "What reproduces at this scale" table. (Its quickstart online-update drifts
    are computed and checked by ``test_quoted_rl_online_update_numbers_match_...`` above.)"""
    def study(name):
        return json.load(open(os.path.join(RL, f"study_{name}.json")))

    # e2e-TV - KL acceptance, in points, per gamma over every head trained for it
    gains = {}
    for name in ("quickstart", "heads_seed0", "heads_seed1", "sweep_seed0"):
        for cell in study(name)["adaptation_paired_gains"]["e2e_tv_vs_kl"]:
            base = cell["cap"] == 256 and (cell["temp"] == 1.0 or cell["gamma"] == 3)
            key = cell["gamma"] if base else (cell["gamma"], "other cap or T")
            gains.setdefault(key, []).append(cell["gain_points"])
    assert {g: (round(min(v), 1), round(max(v), 1)) for g, v in gains.items()} == {
        3: (1.5, 1.9), 5: (2.5, 3.3), 7: (3.1, 3.1), (5, "other cap or T"): (2.3, 2.9)}
    # e2e-TV > TV > KL > CE in every cell of the one study that trained all four
    cells = {}
    for head in study("quickstart")["adaptation"]:
        cells.setdefault((head["gamma"], head["cap"], head["temp"]), {})[head["loss"]] = \
            head["accept_rate"]
    full = [c for c in cells.values() if {"ce", "kl", "tv", "e2e_tv"} <= set(c)]
    assert len(full) == 3 and all(c["e2e_tv"] > c["tv"] > c["kl"] > c["ce"] for c in full)

    def slopes(name):
        c = study(name)["claims"]["slope_rs_e2e_tv_le_third_of_to"]
        return [round(x, 3) for x in c["slope_rs_e2e_tv"] + c["slope_to"]], c["holds"]
    assert slopes("math_stage") == ([-0.016, 0.026, -0.225, 0.030], True)
    assert slopes("quickstart") == ([-0.397, 0.022, -0.129, 0.006], False)

    drifts = {n: study(n)["claims"]["rs_e2e_tv_acceptance_within_2_points"]
              for n in ("math_stage", "math_stage_p16_100", "math_stage_p16_100_t06_4seeds",
                        "quickstart")}
    assert {n: [round(x, 1) for x in d["trend_drift_points"]] for n, d in drifts.items()} == {
        "math_stage": [-1.4, 0.5], "math_stage_p16_100": [-0.9, 0.2],
        "math_stage_p16_100_t06_4seeds": [-0.6, 0.1], "quickstart": [-31.9, 4.1]}
    slow = [round(d["max_abs_drift_points"], 1) for n, d in drifts.items() if n != "quickstart"]
    assert (min(slow), max(slow)) == (4.5, 10.0)

    # the T = 0.6 numbers of the exactness, premise and online rows (four seeds) are those of
    # docs/RL.md's "A fourth seed" table: test_quoted_rl_t06_four_seed_numbers_match_... below
    t1 = study("math_stage_p16_100")
    diff = t1["claims"]["sampled_gain_equal_within_noise"]["paired_diff_rs_e2e_tv_minus_no_spec"]
    assert (round(100 * diff[0], 2), round(100 * diff[1], 1)) == (1.25, 1.0)
    assert {(a, k): _points(t1["arms"][a][k]["combined"]) for a in ("no_spec", "rs_e2e_tv")
            for k in ("sampled_gain", "greedy_gain")} == {
        ("no_spec", "sampled_gain"): (2.1, 0.8), ("rs_e2e_tv", "sampled_gain"): (3.4, 0.8),
        ("no_spec", "greedy_gain"): (0.2, 1.3), ("rs_e2e_tv", "greedy_gain"): (0.3, 1.2)}

    bench = os.path.join(ROOT, "benchmarks", "results")
    speed = [json.load(open(os.path.join(bench, f"rl_rollout_speed{s}.json")))
             for s in ("", "_repeat")]
    assert [round(b["decoders"]["spec"]["speedup"], 2) for b in speed] == [0.81, 0.77]
    assert [round(b["bound"], 2) for b in speed] == [0.78, 0.82]
    assert all(b["baseline"] == "engine_none" for b in speed)
    assert round(speed[0]["decoders"]["spec"]["tau"], 2) == 3.37


def test_quoted_results_summary_table_matches_the_committed_results():
    """docs/RESULTS.md's "What reproduces" table."""
    bebop = json.load(open(os.path.join(FULL, "summary.json")))["bebop"]
    table = {loss: row["all"] for loss, row in bebop["table"].items()}
    vs_kl = bebop["table_vs_kl"]["e2e_tv"]["all"]
    assert _points([table["e2e_tv"]["delta"], table["e2e_tv"]["delta_se"]]) == (11.9, 1.1)
    assert _points([vs_kl["delta"], vs_kl["delta_se"]]) == (0.8, 0.5)
    to = [100 * t["to"] for t in table.values()]
    assert len(to) == 5 and (round(min(to), 1), round(max(to), 1)) == (19.5, 20.2)
    rs_slopes = [t["rs_slope"] for t in table.values()]
    assert (round(min(rs_slopes), 3), round(max(rs_slopes), 3)) == (0.020, 0.033)
    assert round(table["ce"]["to_slope"], 3) == 0.157  # the TO row: the CE head
    assert table["ce"]["rs_slope"] == max(rs_slopes)  # hard labels are the least flat
    dspark = json.load(open(os.path.join(SEEDS, "summary.json")))["dspark"]["table"]
    gain = {g: round(100 * (dspark["DSpark-Markov"][f"all@{g}"]["tau"] /
                            dspark["DFlash"][f"all@{g}"]["tau"] - 1), 1) for g in (7, 15)}
    assert gain == {7: 16.5, 15: 23.5}
    for g in (7, 15):  # the sequential baselines reach higher τ
        assert min(dspark[k][f"all@{g}"]["tau"] for k in ("MTP (CE, recursive)", "draft LM")) > \
            max(dspark[k][f"all@{g}"]["tau"] for k in ("DSpark-Markov", "DSpark-RNN", "DFlash"))
    # the survival peaks are test_quoted_three_seed_dspark_numbers_match_...'s worst_after
    over = json.load(open(os.path.join(SEEDS, "summary.json")))["dspark"]["calibration_over_seeds"]
    assert [round(100 * max(over[f"dspark_markov_g{g}"]["ece_cond_after"]), 1)
            for g in (7, 15)] == [11.7, 21.3]


def test_quoted_spec_vs_plain_summary_matches_the_committed_results():
    """docs/SPEC_VS_PLAIN.md's "In short" paragraph, from the committed benchmark JSON."""
    import numpy as np
    cells = json.load(open(os.path.join(ROOT, "benchmarks", "results",
                                        "spec_vs_plain.json")))["cells"]
    assert len(cells) == 18
    got = {}
    for k in ("spec:mtp:fixed", "spec:dspark:fixed"):
        s = [c["decoders"][k]["speedup"] for c in cells]
        p = [c["decoders"][k]["predicted_speedup"] for c in cells]
        got[k] = (round(min(s), 2), round(max(s), 2), round(float(np.median(s)), 2),
                  sum(x < 1 for x in p), round(min(p), 2), round(max(p), 2))
    assert got == {"spec:mtp:fixed": (0.34, 0.84, 0.58, 16, 0.44, 1.10),
                   "spec:dspark:fixed": (0.36, 0.73, 0.51, 17, 0.50, 1.05)}
    costs = [c["decoders"][k]["step_costs"] for c in cells
             for k in ("spec:mtp:fixed", "spec:dspark:fixed")]
    verify = [x["verify_s"] / x["plain_s"] for x in costs]
    assert (round(min(verify), 1), round(float(np.median(verify)), 1), round(max(verify), 1)) == \
        (1.4, 1.7, 2.0)
    draft = [c["decoders"]["spec:mtp:fixed"]["step_costs"] for c in cells]
    draft = [x["draft_s"] / x["plain_s"] for x in draft]
    assert (round(min(draft), 2), round(max(draft), 2)) == (1.35, 1.76)
    none = [c["engine_none_vs_fastest"] for c in cells if c["batch"] == 1]
    assert (round(min(none), 2), round(max(none), 2)) == (0.85, 1.00)


def test_quoted_second_spec_vs_plain_rerun_matches_its_results():
    """docs/SPEC_VS_PLAIN.md's "Second re-run" bullets, from its JSON (and the committed run's
    for the comparisons)."""
    import numpy as np
    results = os.path.join(ROOT, "benchmarks", "results")
    cells = json.load(open(os.path.join(results, "spec_vs_plain_rerun2.json")))
    sweep, cells = cells["max_len_sweep"], cells["cells"]
    first = json.load(open(os.path.join(results, "spec_vs_plain.json")))["cells"]
    assert len(cells) == len(first) == 18
    mtp, dspark = "spec:mtp:fixed", "spec:dspark:fixed"

    def span(xs, nd=2):
        return round(min(xs), nd), round(float(np.median(xs)), nd), round(max(xs), nd)

    assert [sum(a["decoders"][k]["tau"] == b["decoders"][k]["tau"] for a, b in zip(first, cells))
            for k in (mtp, dspark)] == [0, 18]
    speed = [max(c["decoders"][n]["tokens_per_s"] for n in ("generate", "engine_none",
                                                             "generate_host")) for c in cells]
    speed0 = [max(c["decoders"][n]["tokens_per_s"] for n in ("generate", "engine_none",
                                                              "generate_host")) for c in first]
    assert span([a / b for a, b in zip(speed, speed0)]) == (0.77, 0.99, 1.22)
    none = {b: span([c["engine_none_vs_fastest"] for c in cells if c["batch"] == b])
            for b in (1, 8, 32)}
    assert none == {1: (0.97, 0.99, 1.0), 8: (0.93, 0.94, 0.96), 32: (0.94, 0.96, 1.0)}
    none0 = {b: [c["engine_none_vs_fastest"] for c in first if c["batch"] == b] for b in (1, 8, 32)}
    assert [(round(min(v), 2), round(max(v), 2)) for v in none0.values()] == [
        (0.85, 1.0), (0.88, 0.97), (0.87, 0.98)]
    s = {k: span([c["decoders"][k]["speedup"] for c in cells]) for k in (mtp, dspark)}
    assert s == {mtp: (0.35, 0.59, 0.8), dspark: (0.33, 0.53, 0.81)}
    assert [round(float(np.median([c["decoders"][k]["speedup"] for c in cells
                                   if c["batch"] == 1])), 2) for k in (mtp, dspark)] == [0.7, 0.67]
    pred = {k: [c["decoders"][k]["predicted_speedup"] for c in cells] for k in (mtp, dspark)}
    assert {k: (sum(x < 1 for x in v), round(min(v), 2), round(max(v), 2))
            for k, v in pred.items()} == {mtp: (18, 0.43, 0.99), dspark: (17, 0.44, 1.11)}
    costs = [c["decoders"][k]["step_costs"] for c in cells for k in (mtp, dspark)]
    assert span([x["verify_s"] / x["plain_s"] for x in costs]) == (1.53, 1.82, 2.34)
    draft = [c["decoders"][mtp]["step_costs"] for c in cells]
    assert span([x["draft_s"] / x["plain_s"] for x in draft])[::2] == (1.12, 1.52)
    ratio = {k: [c["decoders"][k]["measured_over_predicted"] for c in cells] for k in (mtp, dspark)}
    assert [round(float(np.median(v)), 2) for v in ratio.values()] == [0.79, 0.82]
    both = ratio[mtp] + ratio[dspark]
    assert (round(min(both), 2), round(max(both), 2)) == (0.58, 1.12)
    step = {(r["batch"], r["max_len"]): r for r in sweep}
    assert [[round(step[b, 2048][f] / step[b, 256][f], 2) for b in (1, 8, 32)]
            for f in ("generate_step_s", "engine_none_step_s")] == [[1.22, 1.19, 1.14],
                                                                   [1.25, 1.02, 1.0]]


def _vs_no_spec_and_windows(claims, arms):
    """The RL study's paired numbers, rounded to the docs' points: ``(gain minus no_spec per
    (arm, metric) as [diff, se], online minus frozen acceptance per (arm, window) as [mean, se])``
    for the speculative ``arms`` (the windows for those of them with an online head)."""
    vs = claims["gain_minus_no_spec_points"]
    w = claims["online_update_acceptance_minus_frozen_points"]
    return ({(a, m): [round(x, 1) for x in vs[a][m]["diff"]] for a in arms
             for m in ("greedy", "sampled")},
            {(a, k): [round(x, 1) for x in w[a][k]["mean"]] for a in arms if a in w for k in w[a]})


def test_quoted_rl_t06_four_seed_numbers_match_the_committed_results():
    """docs/RL.md's "A fourth seed, all four arms" table and bullets; the 3-seed column is checked
    by the two T = 0.6 tests above."""
    import numpy as np
    study = json.load(open(os.path.join(RL, "study_math_stage_p16_100_t06_4seeds.json")))
    arms, claims = study["arms"], study["claims"]
    ce, tv = "rs_e2e_tv_online_ce", "rs_e2e_tv_online_tv"
    order = ("no_spec", "rs_e2e_tv", ce, tv)
    assert study["params"]["seeds"] == [0, 1, 2, 3] and all(arms[a]["seeds"] == [0, 1, 2, 3]
                                                            for a in order)
    assert [_points(arms[a]["greedy_gain"]["combined"]) for a in order] == [
        (1.9, 1.2), (2.1, 1.1), (-0.4, 1.1), (-0.5, 1.0)]
    assert [_points(arms[a]["sampled_gain"]["combined"]) for a in order] == [
        (0.4, 0.7), (1.3, 0.7), (0.8, 0.7), (0.1, 0.7)]
    vs = claims["gain_minus_no_spec_points"]
    diffs, windows = _vs_no_spec_and_windows(claims, order[1:])
    assert diffs == {
        ("rs_e2e_tv", "greedy"): [0.2, 1.0], ("rs_e2e_tv", "sampled"): [0.8, 0.9],
        (ce, "greedy"): [-2.3, 1.3], (ce, "sampled"): [0.4, 0.9],
        (tv, "greedy"): [-2.4, 1.1], (tv, "sampled"): [-0.3, 0.9]}
    assert [_points(claims[k]["paired_diff_rs_e2e_tv_minus_no_spec"])
            for k in ("accuracy_gain_equal_within_noise", "sampled_gain_equal_within_noise")] == [
        (0.2, 1.0), (0.8, 0.9)]
    assert not vs[tv]["greedy"]["holds"] and round(-vs[tv]["greedy"]["diff"][0] /
                                                   vs[tv]["greedy"]["diff"][1], 1) == 2.2
    w = claims["online_update_acceptance_minus_frozen_points"]
    assert windows == {
        (tv, "run"): [0.9, 0.2], (tv, "last_fifth"): [1.6, 0.1],
        (ce, "run"): [-0.6, 0.2], (ce, "last_fifth"): [0.0, 0.3]}
    assert [round(w[tv][k]["per_seed"][3][0], 1) for k in ("run", "last_fifth")] == [0.5, 1.3]
    drift = claims["rs_e2e_tv_acceptance_within_2_points"]
    assert [round(x, 1) for x in drift["trend_drift_points"]] == [-0.6, 0.1] and drift["holds"]
    raised = claims["grpo_raises_heldout_accuracy"]
    assert [round(raised[a]["greedy"]["gain"] / raised[a]["greedy"]["se"], 1)
            for a in ("rs_e2e_tv", "no_spec")] == [2.0, 1.6]
    # online minus frozen greedy gain, paired by seed: lower in all eight comparisons
    frozen = arms["rs_e2e_tv"]["greedy_gain"]["per_seed"]
    lower = {a: [round(100 * (g[0] - f[0]), 1) for g, f in zip(arms[a]["greedy_gain"]["per_seed"],
                                                                frozen)] for a in (tv, ce)}
    assert lower == {tv: [-3.5, -3.5, -1.0, -2.5], ce: [-1.0, -4.0, -1.5, -3.5]}
    # the training reward over the run, and the same step-0 evaluation in every arm
    assert [round(float(np.mean(arms[a]["mean"]["reward"])), 3) for a in order] == [
        0.098, 0.100, 0.096, 0.100]
    start = {a: arms[a]["mean"]["heldout_accuracy"][0] for a in order}
    assert set(start.values()) == {0.115}  # 23 of 200 (per problem: each arm's arm.json)
    assert arms["no_spec"]["greedy_gain"]["per_seed"][3][0] == 0.0


def test_quoted_rl_t06_five_seed_numbers_match_the_committed_results():
    """docs/RL.md's "A fifth seed, and two checks of exactness" (table, bullets) and the five-seed
    numbers of its summary table; the 4-seed column is checked by the four-seed test above."""
    import numpy as np
    study = json.load(open(os.path.join(RL, "study_math_stage_p16_100_t06_5seeds.json")))
    arms, claims = study["arms"], study["claims"]
    ce, tv = "rs_e2e_tv_online_ce", "rs_e2e_tv_online_tv"
    order = ("no_spec", "rs_e2e_tv", ce, tv)
    assert all(arms[a]["seeds"] == [0, 1, 2, 3, 4] for a in order)
    assert [_points(arms[a]["greedy_gain"]["combined"]) for a in order] == [
        (1.3, 1.0), (1.7, 1.0), (-0.1, 1.0), (-0.7, 0.9)]
    # the summary table's premise row: sampled gains without and with speculation
    assert [_points(arms[a]["sampled_gain"]["combined"]) for a in order[:2]] == [
        (0.1, 0.6), (1.4, 0.6)]
    vs = claims["gain_minus_no_spec_points"]
    diffs, windows = _vs_no_spec_and_windows(claims, order[1:])
    assert diffs == {
        ("rs_e2e_tv", "greedy"): [0.4, 0.8], ("rs_e2e_tv", "sampled"): [1.3, 0.8],
        (ce, "greedy"): [-1.4, 1.3], (ce, "sampled"): [0.8, 0.8],
        (tv, "greedy"): [-2.0, 0.9], (tv, "sampled"): [0.4, 0.9]}
    assert not vs[tv]["greedy"]["holds"] and round(-vs[tv]["greedy"]["diff"][0] /
                                                   vs[tv]["greedy"]["diff"][1], 1) == 2.1
    assert windows == {
        (tv, "run"): [1.0, 0.2], (tv, "last_fifth"): [1.7, 0.1],
        (ce, "run"): [-0.4, 0.2], (ce, "last_fifth"): [0.2, 0.3]}
    drift = claims["rs_e2e_tv_acceptance_within_2_points"]
    assert [round(x, 1) for x in drift["trend_drift_points"]] == [-0.8, 0.2]
    # seed 4's greedy gains, and online minus frozen per seed
    assert [round(100 * arms[a]["greedy_gain"]["per_seed"][4][0], 1) for a in order] == [
        -1.0, 0.0, 1.0, -1.5]
    frozen = arms["rs_e2e_tv"]["greedy_gain"]["per_seed"]
    assert [round(100 * (g[0] - f[0]), 1) for g, f in
            zip(arms[tv]["greedy_gain"]["per_seed"], frozen)] == [-3.5, -3.5, -1.0, -2.5, -1.5]
    assert [round(float(np.mean(arms[a]["mean"]["reward"])), 3) for a in order] == [
        0.097, 0.099, 0.096, 0.098]
    # the exactness monitor: every arm within 0.6 s.e. of 0 over its 500 steps
    ex = claims["rollouts_exact_samples_of_the_policy"]
    assert {a: [round(x, 5) for x in ex[a]["gap_nats"]] for a in order} == {
        "no_spec": [0.00013, 0.00024], "rs_e2e_tv": [0.00007, 0.00025],
        ce: [-0.00004, 0.00024], tv: [0.00005, 0.00023]}
    assert all(ex[a]["holds"] and ex[a]["steps"] == 500 and abs(ex[a]["z"]) < 0.6 for a in order)
    # the greedy evaluation through the plain decoder: seed 4, the same text on all 200 problems
    same = claims["greedy_evaluation_same_as_plain_decoder"]
    assert set(same) == {"rs_e2e_tv", ce, tv}
    for g in same.values():
        assert g["holds"] and [(x["seed"], x["same_text"], x["problems"]) for x in
                               g["per_seed"]] == [(4, 200, 200)]


def test_quoted_tpu_peak_breakdown_numbers_match_the_committed_results():
    """docs/TPU.md's "What fills a v5e-8 chip" section: its table (built here from the seven
    ``tpu_plan --explain_memory`` runs) and the numbers its paragraphs quote."""
    flat = " ".join(_tpu_doc().split())
    runs = {}
    for name in ("default", "attention_chunk_512", "no_latency_hiding_scheduler",
                 "no_windowed_einsum", "no_windowed_einsum_attention_chunk_512",
                 "dspark_default", "dspark_no_windowed_einsum_attention_chunk_512"):
        (r,) = json.load(open(os.path.join(TPU, "peak", name, "plan.json")))
        assert (r["shapes"]["model"], r["topology"], r["shapes"]["seq"]) == \
            ("qwen3-8b", "v5e:2x4", 4096)
        assert r["shapes"]["drafter"] == ("dspark" if name.startswith("dspark") else "mtp")
        assert r["shapes"]["attention_chunk"] == (512 if name.endswith("chunk_512") else 0)
        options = r["notes"].get("compiler_options", {})
        assert options == ({"xla_tpu_enable_latency_hiding_scheduler": False}
                           if name == "no_latency_hiding_scheduler" else
                           {"xla_tpu_enable_windowed_einsum_for_all_gather": False}
                           if "windowed" in name else {})
        runs[name] = r

    def largest(r):
        """The doc's words for the largest group: the compiler's op, or what the op computes."""
        g = r["notes"]["peak_live"]["groups"][0]
        if g["label"] == "AllocateBuffer":
            kind = "AllocateBuffer"
        elif "bkgts" in g["label"]:  # grouped attention's score einsum (models/attention.py)
            kind = "attention scores"
        else:
            assert "...d,dv->...v" in g["label"], g  # the LM head's matmul (models/transformer.py)
            kind = "LM-head matmul" + (" all-gather" if g["label"].startswith("all-gather") else "")
        return f"{g['count']} x {kind} `{g['shape']}`, {g['bytes'] / 2**30:.2f} GiB"

    def groups(name):
        """A run's peak groups by ``(label, shape)``."""
        return {(x["label"], x["shape"]): x for x in runs[name]["notes"]["peak_live"]["groups"]}

    for name, r in runs.items():
        cells = (f"{r['used_bytes'] / 2**30:.1f} / 16.0 | "
                 f"{'**yes**' if r['fits'] else 'no'} | {r['flops'] / 1e12:.0f} | "
                 f"{r['bytes_accessed'] / 1e9:.0f} | {r['roofline_seconds']:.3g} | "
                 f"{r['notes']['peak_live']['peak_bytes'] / 2**30:.1f} GiB; {largest(r)} |")
        assert f"(`{name}`) | {cells}" in flat, (name, cells)
    # the pod config's peak: what the paragraph under the command quotes
    live = runs["default"]["notes"]["peak_live"]
    g = groups("default")
    mlp = g[("AllocateBuffer", "bf16[1,4096,12288]")]
    q = g[("AllocateBuffer", "bf16[1,4096,32,128]")]
    kv = g[("AllocateBuffer", "bf16[1,4096,8,128]")]
    assert f"Of the {live['peak_bytes'] / 2**30:.1f} GiB alive at its peak (position " \
           f"{live['peak_position']:,} of {live['program_length']:,}), " \
           f"{mlp['bytes'] / 2**30:.2f} GiB are {mlp['count']} `AllocateBuffer`s" in flat
    qkv = (q["bytes"] + kv["bytes"]) / 2**30
    assert f"{qkv:.1f} GiB more are {q['count']} `[1,4096,32,128]` query and {kv['count']} " \
           f"`[1,4096,8,128]`" in flat
    first = min(x["first_start"] for x in (mlp, q, kv))
    last = max(x["last_start"] for x in (mlp, q, kv))
    ends = (min(x["first_end"] for x in (mlp, q, kv)), max(x["last_end"] for x in (mlp, q, kv)))
    assert f"start between positions {first:,} and {last:,}" in flat
    assert f"end between positions {ends[0]:,} and {ends[1]:,}" in flat
    assert last < live["peak_position"] < ends[1]
    ds = groups("dspark_default")[("AllocateBuffer", "bf16[1,4096,12288]")]
    assert f"same at its peak ({ds['count']} such buffers, {ds['bytes'] / 2**30:.2f} GiB;" in flat
    # the options' effect
    for name in ("no_latency_hiding_scheduler", "no_windowed_einsum"):
        assert "AllocateBuffer" not in [label for label, _ in groups(name)]
    assert "AllocateBuffer" in [label for label, _ in groups("attention_chunk_512")]
    table = json.load(open(os.path.join(TPU, "table.json")))
    v5e8 = {(r["shapes"]["seq"], r["shapes"]["drafter"]): r for r in table
            if (r["shapes"]["model"], r["topology"]) == ("qwen3-8b", "v5e:2x4")}
    at2048 = {d: v5e8[(2048, d)] for d in ("mtp", "dspark")}
    at4096 = {d: v5e8[(4096, d)] for d in ("mtp", "dspark")}
    m, d = runs["no_windowed_einsum_attention_chunk_512"], \
        runs["dspark_no_windowed_einsum_attention_chunk_512"]
    pct = lambda r: round(100 * r["hbm_fraction"])  # noqa: E731
    assert f"{m['used_bytes'] / 2**30:.1f} GiB for MTP ({pct(m)} % of HBM) " \
           f"and {d['used_bytes'] / 2**30:.1f} GiB for DSpark ({pct(d)} %), " \
           f"against {at2048['mtp']['used_bytes'] / 2**30:.1f} and " \
           f"{at2048['dspark']['used_bytes'] / 2**30:.1f} GiB" in flat
    # "What it costs in time the compiler cannot say": the FLOPs against the model FLOPs as
    # counted now (these runs were compiled with the earlier drafter terms; the loops/ runs of
    # the same configs have the current ones)
    now = {d: json.load(open(os.path.join(TPU, "loops", f"{d}_default", "plan.json")))[0]
           for d in ("mtp", "dspark")}
    for drafter in ("mtp", "dspark"):  # the table's rows have theirs counted again
        assert at4096[drafter]["model_flops"] == now[drafter]["model_flops"]

    def ratio(r):
        return r["flops"] / now[r["shapes"]["drafter"]]["model_flops"]
    assert f"the compiled FLOPs are {ratio(at4096['mtp']):.2f}x (MTP) and " \
           f"{ratio(at4096['dspark']):.2f}x (DSpark) of the model FLOPs at 4096 tokens; " \
           f"with them off, {ratio(m):.2f}x and {ratio(d):.2f}x" in flat
    assert ratio(runs["dspark_default"]) == ratio(at4096["dspark"])  # the table's compilation
    assert ratio(at4096["mtp"]) < ratio(m) and ratio(at4096["dspark"]) < ratio(d)
    assert f"(the table shows {m['roofline_seconds']:.3g} against " \
           f"{at4096['mtp']['roofline_seconds']:.3g} s for MTP;" in flat
    # "What the numbers mean": the default step's and the option's ratios, and the table's rows
    off = runs["no_windowed_einsum"]
    assert ratio(runs["default"]) == ratio(at4096["mtp"])  # the same compilation as the table's
    (now_off,) = json.load(open(os.path.join(TPU, "loops", "mtp_no_windowed_einsum",
                                              "plan.json")))
    assert (now["mtp"]["flops"], now_off["flops"]) == (runs["default"]["flops"], off["flops"])
    assert now["dspark"]["flops"] == runs["dspark_default"]["flops"]  # the same compilation
    assert f"below its model FLOPs ({ratio(runs['default']):.2f}x, and {ratio(off):.2f}x with " \
           f"windowed einsums off;" in flat
    # the table's rows against their model FLOPs
    compiled = lambda r: r["flops"] / r["model_flops"]  # noqa: E731
    short = [compiled(r) for r in table if compiled(r) < 1]
    where = sorted({r["topology"] for r in table if compiled(r) < 1})
    assert where == ["v5e:2x4", "v5p:2x4x4", "v6e:4x4"]
    assert f"all {len(short)} of the drafter-training table's {len(table)} rows where they fall " \
           f"below their model FLOPs ({min(short):.2f} to {max(short):.2f} times, on v5p-64, " \
           f"v6e-16 and v5e-8;" in flat
    seconds = [r["compile_seconds"] for r in runs.values()]
    assert f"{min(seconds):.0f} to {max(seconds):.0f} s of compilation each" in flat


def test_tpu_table_is_table_md_with_its_model_flops_counted_again():
    """docs/TPU.md's drafter-training table is ``table.md`` verbatim, whose roofline, bound and MFU
    cells are ``table.json``'s, and the rows carry model FLOPs counted again with the current
    formulas (``tpu_plan --table --recount_model_flops``): each keeps the smaller value it was
    compiled with, and its roofline, bound and MFU are what ``compile_report`` derives from its
    numbers. The bullet on the compute-bound rows matches them."""
    from specjax.aot import recount_model_flops
    flat = " ".join(_tpu_doc().split())
    md = open(os.path.join(TPU, "table.md")).read().strip()
    table = json.load(open(os.path.join(TPU, "table.json")))
    lines = md.splitlines()[2:]
    assert md in _tpu_doc() and len(lines) == len(table)
    for line, r in zip(lines, table):
        assert line.endswith(f"| {r['roofline_seconds']:.3g} | {r['bound']} | "
                             f"{100 * r['mfu']:.0f}% | {r['compile_seconds']:.0f} |"), line
        assert r["model_flops"] > r["notes"]["model_flops_compiled_with"]
        again = recount_model_flops(r, r["model_flops"])
        assert [again[k] for k in ("roofline_seconds", "bound", "mfu")] == \
            [r[k] for k in ("roofline_seconds", "bound", "mfu")]
    compute = {r["shapes"]["drafter"]: r for r in table if r["bound"] == "compute"}
    assert {(r["shapes"]["model"], r["topology"]) for r in compute.values()} == \
        {("qwen3-8b", "v5p:2x4x4")} and set(compute) == {"mtp", "dspark"}
    for r in compute.values():  # set by the model FLOPs: 100 % by construction
        assert r["model_flops"] > r["flops"] and r["mfu"] == pytest.approx(1.0)
    assert (f"except the two 8B steps on v5p-64, compute-bound by their model FLOPs "
            f"({compute['mtp']['roofline_seconds']:.2f} s for MTP, "
            f"{compute['dspark']['roofline_seconds']:.2f} s for DSpark;") in flat


def test_quoted_tpu_loop_aware_flops_match_the_committed_results():
    """docs/TPU.md's "Loop-aware FLOPs": the two v5e-8 Qwen3-8B + MTP compiles it quotes."""
    flat = " ".join(_tpu_doc().split())
    runs = {}
    for name in ("mtp_default", "mtp_no_windowed_einsum"):
        (r,) = json.load(open(os.path.join(TPU, "loops", name, "plan.json")))
        assert (r["shapes"]["model"], r["topology"], r["shapes"]["seq"], r["shapes"]["drafter"],
                r["shapes"]["attention_chunk"]) == ("qwen3-8b", "v5e:2x4", 4096, "mtp", 0)
        assert r["notes"].get("compiler_options", {}) == (
            {"xla_tpu_enable_windowed_einsum_for_all_gather": False} if "windowed" in name else {})
        assert r["notes"]["loops"]["unknown_trip_loops"] == 0
        # the accumulation loop is among the counted ones, with its microbatch count
        accum = r["shapes"]["grad_accum"]
        assert accum == 32 and any(c["trips"] == accum for c in r["notes"]["loops"]["costliest"])
        runs[name] = r
    on, off = runs["mtp_default"], runs["mtp_no_windowed_einsum"]

    def flops(r):
        return (f"{r['loop_flops'] / 1e12:,.0f}", f"{r['loop_flops'] / r['model_flops']:.2f}x",
                f"{r['flops'] / 1e12:,.0f}", f"{r['flops'] / r['model_flops']:.2f}x")
    a, b = flops(on), flops(off)
    assert (f"it reads {a[0]} TFLOP per chip with windowed einsums ({a[1]} the model FLOPs; cost "
            f"analysis {a[2]}, {a[3]}; {on['notes']['loops']['counted_loops']} loops, among them "
            f"the {on['shapes']['grad_accum']}-microbatch accumulation) and {b[0]} without "
            f"({b[1]}; cost analysis {b[2]}, {b[3]})") in flat
    gap = on["notes"]["loops"]["matmul_flops"] / off["notes"]["loops"]["matmul_flops"] - 1
    assert 0 < gap < 0.005 and "the same work, within 0.5 %" in flat
    assert f"counts {off['flops'] / on['flops']:.1f}x apart" in flat
    # the split by source line, grouped as the paragraph groups it
    total = on["notes"]["loops"]["matmul_flops"]
    share = {}
    for src in on["notes"]["loops"]["by_source"]:
        path, line = src["source"].split(" ")[0].rsplit(":", 1)
        group = {("specjax/models/transformer.py", "100"): "MLP",
                 ("specjax/models/transformer.py", "101"): "MLP",
                 ("specjax/models/transformer.py", "102"): "MLP",
                 ("specjax/models/transformer.py", "76"): "q and o",
                 ("specjax/models/transformer.py", "85"): "q and o",
                 ("specjax/models/transformer.py", "130"): "LM head"}.get(
            (path, line), "attention" if path == "specjax/models/attention.py" else path)
        share[group] = share.get(group, 0.0) + src["matmul_flops"] / total
    pct = {k: f"{100 * v:.0f} %" for k, v in share.items()}
    assert (f"the MLP's three matmuls (`specjax/models/transformer.py`) make {pct['MLP']} of it, "
            f"attention's scores and values (`specjax/models/attention.py`) {pct['attention']}, "
            f"the q and o projections {pct['q and o']}, the LM head {pct['LM head']}") in flat
    # the MTP term before: the earlier runs of the same config (peak/default) used it
    (before,) = json.load(open(os.path.join(TPU, "peak", "default", "plan.json")))
    assert before["flops"] == on["flops"]  # the same compilation
    factor = on["model_flops"] / before["model_flops"]
    assert (f"the model FLOPs were 1/{factor:.2f} of what they are now, and "
            f"{on['loop_flops'] / before['model_flops']:.2f}x below this count") in flat
    (ds_now,) = json.load(open(os.path.join(TPU, "loops", "dspark_default", "plan.json")))
    (ds_before,) = json.load(open(os.path.join(TPU, "peak", "dspark_default", "plan.json")))
    assert ds_before["flops"] == ds_now["flops"]  # the same compilation
    assert (on["shapes"]["anchors_per_row"], ds_now["shapes"]["anchors_per_row"]) == (256, 128)
    assert (f"the model FLOPs are now {factor:.2f}x what those runs used for MTP (256 anchors) "
            f"and {ds_now['model_flops'] / ds_before['model_flops']:.3f}x for DSpark (128 "
            f"anchors)") in flat
    assert abs(on["loop_flops"] / on["model_flops"] - 1) < 0.01
    assert (f"{on['compile_seconds']:.0f} and {off['compile_seconds']:.0f} s of compilation"
            in flat)
    from specjax.aot.chips import chip_of
    peak = chip_of(on["topology"]).peak_bf16_flops
    for r in (on, off):
        assert r["bound"] == "memory" and r["loop_flops"] / peak < r["roofline_seconds"]
    assert (f"({on['roofline_seconds']:.1f} and {off['roofline_seconds']:.1f} s of bytes against "
            f"{on['loop_flops'] / peak:.1f} and {off['loop_flops'] / peak:.1f} s of compute)"
            in flat)
    (d,) = json.load(open(os.path.join(TPU, "loops", "dspark_default", "plan.json")))
    assert (d["shapes"]["model"], d["topology"], d["shapes"]["seq"], d["shapes"]["drafter"],
            d["shapes"]["grad_accum"]) == ("qwen3-8b", "v5e:2x4", 4096, "dspark", 32)
    assert "compiler_options" not in d["notes"] and d["notes"]["loops"]["unknown_trip_loops"] == 0
    assert (f"(`dspark_default`, {d['compile_seconds']:.0f} s) reads "
            f"{d['loop_flops'] / 1e12:,.0f} TFLOP per chip, "
            f"{d['loop_flops'] / d['model_flops']:.2f}x its model FLOPs, where the cost analysis "
            f"counts {d['flops'] / 1e12:,.0f} ({d['flops'] / d['model_flops']:.2f}x)") in flat


def test_quoted_tpu_remat_policy_numbers_match_the_committed_results():
    """docs/TPU.md's "What each remat policy costs": its table, rebuilt from
    ``experiments/results/tpu/remat/remat.json``, and the figures its bullets quote."""
    doc = _tpu_doc()
    flat = " ".join(doc.split())
    rows = json.load(open(os.path.join(TPU, "remat", "remat.json")))
    assert {(r["model"], r["topology"], r["chips"], r["seq"], r["logits_chunk"]) for r in rows} \
        == {("qwen3-0.6b", "v5e:2x4", 8, 2048, 256)}
    by = {}
    for r in rows:
        per = r["batch"] // r["chips"]
        by[per, r["remat"]] = r
        if r["compiled"]:
            assert r["bound"] == "memory"
            cells = (f"| {per} | `{r['remat']}` | {r['used_gib']:.1f} / 16.0 | "
                     f"{'yes' if r['fits'] else 'no'} | {r['loop_over_model']:.2f}x | "
                     f"{r['flops'] / r['model_flops']:.2f}x | {r['bytes_accessed_gb']:.0f} | "
                     f"{r['roofline_seconds']:.3f} | {100 * r['mfu']:.0f} % |")
        else:
            cells = f"| {per} | `{r['remat']}` | {r['used_gib']:.1f} / 16.0 | refused | | | | | |"
        assert cells in doc, cells
    assert len(by) == 8 and not by[4, "none"]["compiled"] and not by[4, "all_dots"]["compiled"]

    def x(per, remat):
        return f"{by[per, remat]['loop_over_model']:.2f}x"

    def gib(per, remat):
        return f"{by[per, remat]['used_gib']:.1f}"
    assert (f"`full` keeps the least ({gib(1, 'full')} GiB at one row, {gib(4, 'full')} at four) "
            f"for the most recomputation: {x(1, 'full')} the model FLOPs against {x(1, 'none')} "
            f"without remat") in flat
    assert x(4, "full") == x(1, "full") and x(4, "dots") == x(1, "dots")
    assert max(by[k]["loop_over_model"] for k in by if by[k]["compiled"]) == \
        by[1, "full"]["loop_over_model"]
    assert min(by[k]["used_gib"] for k in by if k[0] == 1) == by[1, "full"]["used_gib"]
    assert f"included: {x(1, 'dots')}, {gib(1, 'dots')} GiB at one row" in flat
    assert (f"recomputes almost nothing ({x(1, 'all_dots')}) and saves almost nothing "
            f"({gib(1, 'all_dots')} against {gib(1, 'none')} GiB)") in flat
    assert f"Without remat the count is {x(1, 'none')}, not 1.00x" in flat
    full, dots = by[1, "full"], by[1, "dots"]
    assert full["roofline_seconds"] < dots["roofline_seconds"]
    assert full["bytes_accessed_gb"] < dots["bytes_accessed_gb"]
    assert (f"(`full` {full['roofline_seconds']:.3f} s against `dots` "
            f"{dots['roofline_seconds']:.3f} s at one row)") in flat
    cost = {k: by[1, k]["flops"] / by[1, k]["model_flops"] for k in ("all_dots", "none")}
    assert cost["all_dots"] < cost["none"]
    assert by[1, "all_dots"]["loop_over_model"] > by[1, "none"]["loop_over_model"]
    assert (f"(`all_dots` {cost['all_dots']:.2f}x below `none` {cost['none']:.2f}x)") in flat


def test_quoted_loop_profile_numbers_match_the_committed_results():
    """docs/SPEC_VS_PLAIN.md's "Where a step's time goes", from the two committed profiles, and
    its arithmetic ratios from the quickstart target's and head's configs (preset "small"; one
    shared MTP head, MLP width 256, γ 3), by the model FLOPs the engine programs count."""
    from specjax.drafters import MTPConfig, MTPDrafter
    from specjax.models import get_preset
    from specjax.models.flops import forward_flops_per_token
    doc = " ".join(open(os.path.join(ROOT, "docs", "SPEC_VS_PLAIN.md")).read().split())
    runs = [json.load(open(os.path.join(ROOT, "benchmarks", "results", f"{n}.json")))
            for n in ("loop_profile", "loop_profile_repeat")]
    assert [(r["steps"], round(r["tau"], 2)) for r in runs] == [(192, 1.98)] * 2
    assert "(192 loop steps, τ 1.98)" in doc
    assert [round(r["loop_s"] / r["wall_s"], 2) for r in runs] == [0.90, 0.90]
    assert "0.770 of 0.852 s, and 0.831 of 0.921 s" in doc
    assert [(round(r["loop_s"], 3), round(r["wall_s"], 3)) for r in runs] == \
        [(0.770, 0.852), (0.831, 0.921)]
    assert "Matmuls are 67.5 % and 68.4 %" in doc
    assert [round(100 * r["matmul_share"], 1) for r in runs] == [67.5, 68.4]

    def share(r, prefixes):
        return round(100 * sum(x["share"] for x in r["rows"]
                               if x["source"].startswith(prefixes)), 1)
    for prefixes, quoted in (
            ("specjax/models/transformer.py", "55.2 / 55.0 %"),
            ("specjax/models/attention.py", "9.9 / 9.8 %"),
            (("<dot>", "<fusion of dot>"), "12.3 / 12.3 %"),
            ("specjax/models/layers.py", "4.5 / 4.4 %"),
            ("specjax/drafters/mtp.py", "4.4 / 5.4 %"),
            ("specjax/drafters/blocks.py", "3.6 / 3.5 %"),
            ("specjax/sampling.py", "3.8 / 3.8 %"),
            ("specjax/engine/", "2.6 / 2.2 %"),
            ("specjax/verify.py", "0.3 / 0.3 %")):
        assert " / ".join(f"{share(r, prefixes):.1f}" for r in runs) + " %" == quoted
        assert quoted in doc, quoted
    ratios = [r["traced_wall_s_per_call"] / r["untraced_wall_s_per_call"] for r in runs]
    assert [round(x, 2) for x in ratios] == [1.20, 1.17] and "1.20x and 1.17x" in doc
    assert [round(r["ms_per_step"], 1) for r in runs] == [4.0, 4.3] and "4.0 and 4.3 ms" in doc
    target = get_preset("small")
    drafter, _ = MTPDrafter.create(target, MTPConfig(shared=True, intermediate_size=256))
    plain = forward_flops_per_token(target, 96)
    # the profiles ran the draft step as it was: a window of 2γ = 6 positions, every depth's
    # whole block at each (benchmarks/mtp_window.py restores it)
    from benchmarks.mtp_window import EarlierMTP
    earlier = EarlierMTP(drafter.config, drafter.target_config, drafter.graphdef)
    assert earlier.window(3) == 6
    assert round(earlier.propose_flops(96, 3) / plain, 2) == 3.08
    assert round(drafter.propose_flops(96, 3) / plain, 2) == 1.89
    assert "ran was 3.08x a plain decode step" in doc and "verifying 4 tokens 4.0x" in doc
    assert "the draft step is 1.89x a plain step" in doc


def test_quoted_mtp_window_numbers_match_the_committed_results():
    """docs/SPEC_VS_PLAIN.md's "The MTP draft step, now and as it was" and README's sentence on
    it, from the committed runs of benchmarks/mtp_window.py."""
    doc = " ".join(open(os.path.join(ROOT, "docs", "SPEC_VS_PLAIN.md")).read().split())
    readme = " ".join(open(os.path.join(ROOT, "README.md")).read().split())
    runs = [json.load(open(os.path.join(ROOT, "benchmarks", "results", f"{n}.json")))
            for n in ("mtp_window", "mtp_window_repeat")]
    for r in runs:
        assert (r["gamma"], r["flops_context"]) == (3, 96)
        dr = r["drafters"]
        assert [dr[n]["window"] for n in ("speculative", "speculative_window_only",
                                          "speculative_earlier")] == [4, 4, 6]
        earlier = dr["speculative_earlier"]["propose_flops"]
        assert round(dr["speculative_window_only"]["propose_flops"] / earlier, 3) == 0.711
        assert round(dr["speculative"]["propose_flops"] / earlier, 3) == 0.616
        assert r["config"]["reps"] == 7 and r["config"]["prompts"] == 2
        assert (r["config"]["prompt_len"], r["config"]["new_tokens"]) == (32, 128)
        assert "Intel" in r["machine"]["cpu"] and r["machine"]["cores"] == 2
        assert all(c["same_tokens"] for c in r["cells"])
    assert "fall to 0.711x with the window cut and to 0.616x with both" in doc
    assert "The arithmetic fell by 38 %" in doc
    assert "2-vCPU Intel Xeon VM" in doc and "median of 7 runs" in doc
    taus = {(c["domain"], c["temperature"]): round(c["decoders"][n]["tau"], 2)
            for r in runs for c in r["cells"] for n in ("speculative", "speculative_earlier")}
    assert taus == {("math", 0.0): 2.10, ("math", 1.0): 2.51, ("code", 0.0): 1.68,
                    ("code", 1.0): 2.67}
    assert "(τ 2.10 / 2.51 on math, 1.68 / 2.67 on code, T = 0 / 1)" in doc

    def span(cells, get, digits=2):
        vals = [round(get(c), digits) for c in cells]
        return f"{min(vals):.{digits}f}-{max(vals):.{digits}f}"
    cells = [c for r in runs for c in r["cells"]]
    now = span(cells, lambda c: c["over_earlier"])
    assert f"Now against as it was: {now}x the tokens/s" in doc
    medians = " and ".join(f"{r['over_earlier_median']:.3f}" for r in runs)
    assert f"(median over the four cells {medians})" in doc
    assert f"The window cut alone: {span(cells, lambda c: c['window_over_earlier'])}x" in doc
    assert f"on top of it: {span(cells, lambda c: c['last_depth_over_window'])}x" in doc
    assert (f"the speed-up is {span(cells, lambda c: c['speedup']['speculative'])}x now and "
            f"{span(cells, lambda c: c['speedup']['speculative_earlier'])}x as it was") in doc
    assert f"{now}x the tokens/s of the draft step as it was" in readme
    assert f"they made the MTP engine {now}x faster end to end" in doc
    # each piece timed alone
    costs = [r["step_costs"] for r in runs]
    assert {c[n]["context"] for c in costs for n in c} == {96}
    assert {c[n]["temperature"] for c in costs for n in c} == {1.0}

    def ms(key, name="speculative"):
        return " and ".join(f"{c[name][key] * 1e3:.2f}" for c in costs)
    ratios = " and ".join(
        f"{c['speculative']['draft_s'] / c['speculative_earlier']['draft_s']:.2f}x" for c in costs)
    assert (f"the draft step took {ms('draft_s')} ms now against "
            f"{ms('draft_s', 'speculative_earlier')} ms as it was ({ratios})") in doc
    assert (f"a verification of {ms('verify_s')} ms and a plain decode step of "
            f"{ms('plain_s')} ms") in doc
    # "under half of a speculative step" (draft + verification)
    assert all(c["speculative"]["draft_s"] < c["speculative"]["verify_s"] for c in costs)
    # the noise control: at γ = 1 the window is 2 positions either way, and the window-only and
    # the earlier drafter run one program
    g1 = json.load(open(os.path.join(ROOT, "benchmarks", "results", "mtp_window_gamma1.json")))
    assert g1["gamma"] == 1 and g1["config"]["reps"] == 5
    assert {d["window"] for d in g1["drafters"].values()} == {2}
    assert g1["drafters"]["speculative_window_only"]["propose_flops"] == \
        g1["drafters"]["speculative_earlier"]["propose_flops"]
    assert all(c["same_tokens"] for c in g1["cells"])
    assert f"their ratio is {span(g1['cells'], lambda c: c['window_over_earlier'])}" in doc
    taus = [c["decoders"]["speculative"]["tau"] for c in g1["cells"]]
    assert (f"the γ = 1 run reached {span(g1['cells'], lambda c: c['speedup']['speculative'])}x "
            f"(τ {min(taus):.2f}-{max(taus):.2f})") in doc


def test_quoted_tpu_engine_flops_numbers_match_the_committed_results():
    """docs/TPU.md's engine model-FLOPs check at scale (Qwen3-8B + MTP on v5p-8), from its JSON."""
    rows = {r["name"]: r for r in json.load(open(os.path.join(TPU, "engine_flops", "plan.json")))}
    doc = _tpu_doc()
    ratio = {n: r["model_flops"] / r["notes"]["loops"]["matmul_flops"] for n, r in rows.items()}
    for name, quoted in (("engine.draft", "0.1338"), ("engine.verify[N=256]", "1.046"),
                         ("engine.prefill[C=256]", "66.20")):
        assert round(ratio[name], 4) == 1.0, name
        tflop = rows[name]["model_flops"] / 1e12
        assert f"{tflop:.{len(quoted.split('.')[1])}f}" == quoted, name
    assert round(ratio["engine.verify[N=64]"], 2) == 0.82
    assert "(0.1338, 1.046 and 66.20 TFLOP per chip)" in doc and "0.82x its matmuls" in doc
    draft = rows["engine.draft"]
    wide = {r["name"]: r for r in json.load(open(os.path.join(
        TPU, "engine_flops", "earlier_draft_step", "plan.json")))}["engine.draft"]
    assert wide["model_flops"] == wide["notes"]["loops"]["matmul_flops"]
    flat = " ".join(doc.split())
    assert f"counted and compiled {wide['model_flops'] / 1e12:.4f} TFLOP" in flat
    assert (f"its roofline time was {wide['roofline_seconds'] * 1e3:.2f} ms against "
            f"{draft['roofline_seconds'] * 1e3:.2f} ms now") in flat
    assert (f"{wide['bytes_accessed'] / 1e9:.2f} against {draft['bytes_accessed'] / 1e9:.2f} GB "
            "per chip") in flat
    assert draft["bound"] == wide["bound"] == "memory"
    assert {r["shapes"]["max_len"] for r in rows.values()} == {2048}
    assert {r["shapes"]["slots"] for r in rows.values()} == {64}
    assert {r["shapes"]["flops_context"] for r in rows.values()} == {2048}


def test_quoted_row_bucket_numbers_match_the_committed_results():
    """docs/SERVING.md's "Idle slots" section (its table and bullets) and README's sentence, from
    the committed runs of benchmarks/row_buckets.py."""
    doc = open(os.path.join(ROOT, "docs", "SERVING.md")).read()
    flat = " ".join(doc.split())
    readme = " ".join(open(os.path.join(ROOT, "README.md")).read().split())
    runs = [json.load(open(os.path.join(ROOT, "benchmarks", "results", f"{n}.json")))
            for n in ("row_buckets", "row_buckets_repeat")]
    for r in runs:
        c = r["config"]
        assert (c["slots"], c["loads"], c["policies"]) == (32, [1, 2, 4, 8, 32], ["none", "fixed"])
        assert (c["prompt_len"], c["new_tokens"], c["temperature"], c["loop_steps"], c["reps"]) \
            == (32, 96, 0.0, 16, 5)
        assert r["gamma"] == 3 and "Intel" in r["machine"]["cpu"] and r["machine"]["cores"] == 2
        assert all(cell["same_tokens"] for cell in r["cells"])
    assert "All four decoders emitted the same tokens in every cell" in flat
    assert "2-vCPU Intel Xeon VM" in flat and "median of 5 alternating runs" in flat
    pairs = list(zip(runs[0]["cells"], runs[1]["cells"]))

    def both(key):
        return lambda a, b: f"{a[key]:.2f} / {b[key]:.2f}x"

    def rate(n):
        return lambda a, b: (f"{a['decoders'][n]['tokens_per_s']:.0f} / "
                             f"{b['decoders'][n]['tokens_per_s']:.0f}")
    for a, b in pairs:
        cols = [rate("all_slots"), rate("row_buckets"), both("rows_over_all"),
                both("rows_over_sized"), both("rows_over_generate")]
        row = f"| {a['policy']} | {a['load']} | " + " | ".join(f(a, b) for f in cols) + " |"
        assert row in doc, row

    def span(vals):
        return f"{min(vals):.2f}-{max(vals):.2f}x"
    cells = [c for r in runs for c in r["cells"]]
    one = {p: [c["rows_over_all"] for c in cells if c["load"] == 1 and c["policy"] == p]
           for p in ("none", "fixed")}
    assert f"{min(one['none']):.1f}-{max(one['none']):.1f}x faster with row buckets" in flat
    assert f"and {min(one['fixed']):.1f}-{max(one['fixed']):.1f}x faster with speculation" in flat
    assert f"{min(one['none']):.1f}-{max(one['none']):.1f}x faster with it than without" in readme
    eight = [c["rows_over_all"] for c in cells if c["load"] == 8]
    assert f"to {min(eight):.1f}-{max(eight):.1f}x at C = 8" in flat
    light = [c for c in cells if c["load"] < 32]
    assert f"ran at {span([c['rows_over_sized'] for c in light])} the tokens/s" in flat
    assert (f"both run the same program): "
            f"{span([c['rows_over_all'] for c in cells if c['load'] == 32])}") in flat
    fixed = [c["rows_over_generate"] for c in cells if c["policy"] == "fixed"]
    assert f"`generate()` {span(fixed)} for \"fixed\"" in flat
    w = [r["warmup_s"] for r in runs]
    for policy in ("none", "fixed"):
        quoted = (f"{w[0][policy + '/row_buckets']:.1f} / {w[1][policy + '/row_buckets']:.1f} s "
                  f"instead of {w[0][policy + '/all_slots']:.1f} / "
                  f"{w[1][policy + '/all_slots']:.1f} s (\"{policy}\")")
        assert quoted in flat, quoted


def test_quoted_serving_rerun_matches_its_results():
    """docs/SERVING.md's serving "Re-run on the current engine" (table and bullets), from
    benchmarks/results/serving_rerun.json beside the committed serving.json."""
    doc = open(os.path.join(ROOT, "docs", "SERVING.md")).read()
    flat = " ".join(doc.split())
    old, new = (json.load(open(os.path.join(ROOT, "benchmarks", "results", f"{n}.json")))
                for n in ("serving", "serving_rerun"))
    assert new["argv"][:-4] == old["argv"] and new["args"]["out"].endswith("serving_rerun.json")
    assert "Intel" in new["machine"] and "2 cpus" in new["machine"]
    assert "`--out benchmarks/results/serving_rerun.json --md runs/serving_rerun.md`" in flat

    def cells(d, c):
        p = d["closed_loop"][c]["policies"]
        fixed = {k: v["aggregate_tok_s"] for k, v in p.items() if k.startswith("fixed")}
        best = max(fixed, key=fixed.get)
        agg = {k: v["aggregate_tok_s"] for k, v in p.items()}
        return p, best, agg, agg["production"] / max(agg["none"], fixed[best])
    ratios, none_up = {}, []
    for c in new["closed_loop"]:
        p, best, agg, r = cells(new, c)
        _, _, agg_old, r_old = cells(old, c)
        ratios[int(c)] = r
        none_up.append(agg["none"] / agg_old["none"])
        row = (f"| {c} | {agg['production']:.0f} | {agg['none']:.0f} | {best} {agg[best]:.0f} | "
               f"{100 * p['production']['drafted_frac']:.0f} % | {r:.2f}x | {r_old:.2f}x | "
               f"{none_up[-1]:.2f}x |")
        assert row in doc, row
    drops = [cells(old, str(c))[3] - ratios[c] for c in (1, 2, 4, 8)]
    assert min(drops) > 0 and f"fell at C = 1-8 (by {min(drops):.2f}-{max(drops):.2f})" in flat
    holds = [c for c, r in ratios.items() if r >= 0.95]
    assert holds == [32] and f"holds at C = 32 only** ({ratios[32]:.2f}x)" in flat
    assert f"(`none` {min(none_up):.2f}-{max(none_up):.2f}x its aggregate" in flat
    one = new["closed_loop"]["1"]["policies"]
    assert (f"fixed K = 7 beat `none` ({one['fixed7']['aggregate_tok_s']:.0f} against "
            f"{one['none']['aggregate_tok_s']:.0f} tokens/s) while production drafted on "
            f"{100 * one['production']['drafted_frac']:.0f} %") in flat
    nones = [new["closed_loop"][c]["policies"]["none"]["aggregate_tok_s"] for c in ("8", "16", "32")]
    assert nones[0] > nones[1] > nones[2]
    assert f"({nones[0]:.0f} at C = 8, {nones[1]:.0f} at 16, {nones[2]:.0f} at 32)" in flat


def test_quoted_row_profile_rerun_matches_its_results():
    """docs/SERVING.md's "Re-run on the current engine" (table and bullets), from
    benchmarks/results/row_profiles_rerun.json beside the two earlier runs."""
    doc = open(os.path.join(ROOT, "docs", "SERVING.md")).read()
    flat = " ".join(doc.split())
    runs = [json.load(open(os.path.join(ROOT, "benchmarks", "results", f"{n}.json")))
            for n in ("row_profiles", "row_profiles_repeat", "row_profiles_rerun")]
    first, second, rerun = runs
    c = rerun["config"]
    assert (c["target"], c["drafter"]) == ("runs/qs_target", "runs/qs_dspark_markov")
    assert ("python -m benchmarks.row_profiles --target runs/qs_target --drafter "
            "runs/qs_dspark_markov --out benchmarks/results/row_profiles_rerun.json") in flat
    for key in ("slots", "loads", "temperatures", "new_tokens", "reps", "prompt_len",
                "loop_steps"):
        assert c[key] == first["config"][key], key
    assert "Intel" in rerun["machine"]["cpu"] and rerun["machine"]["cores"] == 2
    assert all(x["same_tokens"] for x in rerun["cells"] if x["temperature"] == 0)
    assert all(x["decoders"]["plain"]["decoder"] == "generate" for x in rerun["cells"])

    def none_rate(x):
        return x["decoders"]["engine_none"]["tokens_per_s"]
    speed = []
    for a, b, r in zip(first["cells"], second["cells"], rerun["cells"]):
        assert (a["temperature"], a["load"]) == (b["temperature"], b["load"]) == \
            (r["temperature"], r["load"])
        speed.append(none_rate(r) / none_rate(a))
        row = (f"| {r['temperature']:g} | {r['load']} | {r['cal_over_engine_none']:.2f}x | "
               f"{a['cal_over_engine_none']:.2f} / {b['cal_over_engine_none']:.2f}x | "
               f"{100 * r['decoders']['row_profiles_cal']['drafting_share']:.0f} % | "
               f"{r['row_profiles_over_engine_none']:.2f}x | {speed[-1]:.2f}x |")
        assert row in doc, row

    def span(vals):
        return f"{min(vals):.2f}-{max(vals):.2f}"
    assert f"engine `none` ran at {span(speed)}x its tokens/s of the first run" in flat
    now = [x["cal_over_engine_none"] for x in rerun["cells"]]
    before = [x["cal_over_engine_none"] for r in (first, second) for x in r["cells"]]
    assert f"plain decoding: {span(now)}x, against {span(before)}x in the two runs before" in flat
    spread = max(abs(a["cal_over_engine_none"] - b["cal_over_engine_none"])
                 for a, b in zip(first["cells"], second["cells"]))
    assert f"(up to {spread:.2f} between the first and the second run)" in flat
    # "no change shows": the re-run's range overlaps the earlier runs' widened by that spread
    assert min(now) >= min(before) - spread and max(now) <= max(before) + spread


def test_quoted_row_profile_numbers_match_the_committed_results():
    """docs/SERVING.md's "A profile per row bucket" (both tables and their bullets), from the
    committed runs of benchmarks/row_profiles.py."""
    doc = open(os.path.join(ROOT, "docs", "SERVING.md")).read()
    flat = " ".join(doc.split())
    runs = [json.load(open(os.path.join(ROOT, "benchmarks", "results", f"{n}.json")))
            for n in ("row_profiles", "row_profiles_repeat")]
    for r in runs:
        c = r["config"]
        assert (c["slots"], c["loads"], c["temperatures"]) == (32, [1, 2, 4, 8, 32], [0.0, 1.0])
        assert (c["new_tokens"], c["reps"], r["gamma"], r["row_buckets"]) == (96, 5, 7,
                                                                              [1, 2, 4, 8, 16])
        assert "Intel" in r["machine"]["cpu"] and r["machine"]["cores"] == 2
        assert all(cell["same_tokens"] for cell in r["cells"] if cell["temperature"] == 0)
        assert all(cell["decoders"]["plain"]["decoder"] == "generate" for cell in r["cells"])
    assert "At T = 0 all six decoders emitted the same tokens in every cell" in flat
    assert "(`generate()` in every cell here)" in flat and "median of 5 alternating runs" in flat

    def pair(a, b, f, unit=""):
        return f"{f(a)} / {f(b)}{unit}"

    def rate(n):
        return lambda c: f"{c['decoders'][n]['tokens_per_s']:.0f}"

    def share(n):
        return lambda c: f"{100 * c['decoders'][n]['drafting_share']:.0f}"

    def ratio(key):
        return lambda c: f"{c[key]:.2f}"
    for a, b in zip(runs[0]["cells"], runs[1]["cells"]):
        head = f"| {a['temperature']:g} | {a['load']} | "
        cols = [pair(a, b, rate("row_profiles")), pair(a, b, rate("slot_profile")),
                pair(a, b, ratio("row_over_slot_profile"), "x"),
                pair(a, b, share("row_profiles"), " %"), pair(a, b, share("slot_profile"), " %"),
                pair(a, b, ratio("row_profiles_over_plain"), "x")]
        assert head + " | ".join(cols) + " |" in doc, head + " | ".join(cols)
        cols = [pair(a, b, rate("row_profiles_cal")), pair(a, b, share("row_profiles_cal"), " %"),
                pair(a, b, ratio("cal_over_row_profiles"), "x"),
                pair(a, b, ratio("row_profiles_over_engine_none"), "x"),
                pair(a, b, ratio("cal_over_engine_none"), "x"),
                pair(a, b, ratio("cal_over_plain"), "x")]
        assert head + " | ".join(cols) + " |" in doc, head + " | ".join(cols)
    cells = [c for r in runs for c in r["cells"]]
    light = [c for c in cells if c["load"] < 32]

    def span(vals, d=2):
        return f"{min(vals):.{d}f}-{max(vals):.{d}f}"
    assert (f"Per-row / all-slot ran {span([c['row_over_slot_profile'] for c in light])}x at "
            f"C = 1-8, inside the null control's "
            f"{span([c['row_over_slot_profile'] for c in cells if c['load'] == 32])}x") in flat
    mid = [c for c in cells if c["load"] in (4, 8)]
    fewer = sum(c["decoders"]["row_profiles"]["drafting_share"]
                < c["decoders"]["slot_profile"]["drafting_share"] for c in mid)
    words = ["no", "one", "two", "three", "four", "five", "six", "seven", "eight"]
    assert f"drafted on fewer steps in {words[fewer]} of the eight cells" in flat
    # plain / drafting steps per second over the buckets each row count can fill (first run)
    first = runs[0]
    ratios = {}
    for name, prof in first["profiles"].items():
        rows = first["config"]["slots"] if name == "all" else int(name[len("rows"):])
        reach = next(i for i, b in enumerate(prof["buckets"]) if b >= rows * (first["gamma"] + 1))
        v = [prof["plain_sps"] / x for x in prof["steps_per_s"][:reach + 1]]
        ratios[name] = f"{min(v):.2f}x" if min(v) == max(v) else span(v) + "x"
    quoted = ", ".join(f"{ratios[f'rows{r}']} on {r}" + (" row" if r == 1 else "")
                       for r in first["row_buckets"])
    assert f"{quoted}, against {ratios['all']} in the all-slot program" in flat
    rows_s = [sum(v for k, v in r["profile_s"].items() if k != "all") for r in runs]
    alls = [r["profile_s"]["all"] for r in runs]
    assert (f"the row profiles took {rows_s[0]:.1f} / {rows_s[1]:.1f} s (1, 2, 4, 8 and 16 "
            f"rows) on top of {alls[0]:.1f} / {alls[1]:.1f} s") in flat
    assert (f"whole warm-up took {runs[0]['production_warmup_s']:.0f} / "
            f"{runs[1]['production_warmup_s']:.0f} s") in flat
    per_row = [c["decoders"]["row_profiles"] for c in cells]
    assert (f"at every load ({span([c['row_profiles_over_plain'] for c in cells])}x of the "
            f"fastest plain decoder): it drafted on "
            f"{span([100 * d['drafting_share'] for d in per_row], 0)} % of its steps at a τ of "
            f"{span([d['tau'] for d in per_row], 1)}") in flat
    rho = [x for c in cells for x in c["calibration_rho"]]
    cal_share = [100 * c["decoders"]["row_profiles_cal"]["drafting_share"] for c in cells]
    assert (f"ratios ρ_k of {span(rho)} (accepted over predicted, per position: the head as "
            f"trained over-states acceptance), stopped drafting ({span(cal_share, 0)} % of "
            f"steps) and ran at {span([c['cal_over_engine_none'] for c in cells])}x") in flat
    assert (f"Calibrated over uncalibrated: "
            f"{span([c['cal_over_row_profiles'] for c in light])}x at C = 1-8") in flat
    assert (f"{span([c['cal_over_engine_none'] for c in cells])}x calibrated, "
            f"{span([c['row_profiles_over_engine_none'] for c in cells])}x uncalibrated") in flat
    assert f"Drafting on {span(cal_share, 0)} % of its steps" in flat


def test_quoted_rollout_row_bucket_numbers_match_the_committed_results():
    """docs/RL.md's "Row buckets in rollouts", from the committed runs of
    benchmarks/rl_rollout_speed.py with the row-bucket engines."""
    flat = " ".join(open(os.path.join(ROOT, "docs", "RL.md")).read().split())
    names = ("rl_rollout_speed_rows", "rl_rollout_speed_rows_repeat")
    runs = [json.load(open(os.path.join(ROOT, "benchmarks", "results", f"{n}.json")))
            for n in names]
    for n, r in zip(names, runs):
        d = r["decoders"]
        assert "Intel" in r["machine"]["cpu"] and r["machine"]["cores"] == 2
        assert (r["sequences"], r["config"]["reps"], r["config"]["temperature"],
                r["config"]["new_tokens"]) == (32, 5, 1.0, 64)
        assert r["baseline"] == "engine_none_rows" and round(d["spec"]["tau"], 2) == 2.47
        assert d["engine_none"]["tokens"] == d["engine_none_rows"]["tokens"]
        row = (f"| `{n}.json` | " + " | ".join(f"{d[k]['wall_s']:.3f}" for k in (
            "generate", "engine_none", "engine_none_rows", "spec", "spec_rows"))
            + f" | {r['rows_speedup']:.2f}x | {d['spec']['speedup']:.2f}x / "
            f"{d['spec_rows']['speedup']:.2f}x |")
        assert row in flat, row

    def span(vals):
        return f"{min(vals):.2f}-{max(vals):.2f}x"
    assert f"rollout {span([r['rows_speedup'] for r in runs])} faster" in flat
    plain = [r["decoders"]["engine_none"]["wall_s"] / r["decoders"]["engine_none_rows"]["wall_s"]
             for r in runs]
    assert f"plain decoding in the engine {span(plain)} faster" in flat
    assert f"({span([r['decoders']['spec_rows']['speedup'] for r in runs])} with row buckets)" \
        in flat
    assert "τ 2.47 without row buckets" in flat


def test_quoted_confidence_staleness_matches_its_results():
    """docs/SERVING.md's "How fast the confidences go stale", from
    benchmarks/results/confidence_staleness.json."""
    flat = " ".join(open(os.path.join(ROOT, "docs", "SERVING.md")).read().split())
    res = json.load(open(os.path.join(ROOT, "benchmarks", "results",
                                      "confidence_staleness.json")))
    a = res["args"]
    assert (a["target"], a["drafter"], a["prompts"], a["new_tokens"], res["gamma"]) == \
        ("runs/qs_target", "runs/qs_dspark_markov", 16, 96, 7)
    assert a["domains"] == ["math", "code", "prose"] and a["temperatures"] == [0.0, 1.0]
    assert ("python -m benchmarks.confidence_staleness --target runs/qs_target --drafter "
            "runs/qs_dspark_markov") in flat
    lag = [{r["lag"]: r for r in c["lags"]} for c in res["cells"]]

    def pair(k, key, digits=2):
        return " / ".join(f"{x[k][key]:.{digits}f}" for x in lag)
    assert f"correlation {pair(1, 'corr')} at lag 1" in flat
    assert f"mean squared error {pair(1, 'mse_stale')} against {pair(1, 'mse_mean')}" in flat
    assert f"({pair(8, 'mse_stale')} against {pair(8, 'mse_mean')})" in flat
    assert f"far worse ({pair(16, 'mse_stale')} against {pair(16, 'mse_mean')})" in flat
    for x in lag:  # the stale vector loses to the mean by lag 8, the shrunk one wins up to it
        assert x[1]["mse_stale"] < x[1]["mse_mean"] and x[8]["mse_stale"] > x[8]["mse_mean"]
        assert all(x[k]["mse_shrunk"] < min(x[k]["mse_stale"], x[k]["mse_mean"])
                   for k in (1, 2, 4, 8))
    ranges = " / ".join(f"{min(x[k]['mse_shrunk'] for k in (1, 2, 4, 8)):.2f}-"
                        f"{max(x[k]['mse_shrunk'] for k in (1, 2, 4, 8)):.2f}" for x in lag)
    assert f"up to lag 8 ({ranges})" in flat
    # what production reads: the decay the JSON was measured at is the default, and the best
    from specjax.scheduling import SchedulerConfig
    decay = SchedulerConfig("production").stale_decay
    assert res["stale_decay"] == decay == res["best_decay_pooled"]
    assert f"(`SchedulerConfig.stale_decay`, default {decay:g};" in flat
    readme = " ".join(open(os.path.join(ROOT, "README.md")).read().split())
    assert f"`--stale-decay` (default {decay:g})" in readme
    for x in lag:  # below both the stale value and the mean at every lag
        assert all(r["mse_decay"] < min(r["mse_stale"], r["mse_mean"]) for r in x.values())
    ranges = " / ".join(f"{min(r['mse_decay'] for r in x.values()):.2f}-"
                        f"{max(r['mse_decay'] for r in x.values()):.2f}" for x in lag)
    assert f"every lag ({ranges} over lags 1-16)" in flat
    fits = [c["decay_fit"] for c in res["cells"]]
    assert all(f["lags"] == [1, 2, 4, 8, 16] for f in fits)

    def at(rho):
        return " / ".join(f"{f['mse'][f['grid'].index(rho)]:.3f}" for f in fits)
    assert (f"averaged over the five lags it is {at(decay)}, against {at(1.0)} for the vector "
            f"as drafted (ρ = 1) and {at(0.0)} for the prior alone (ρ = 0)") in flat
    best = " / ".join(f"{f['best']:g}" for f in fits)
    assert f"least at {best} (T = 0 / 1)" in flat


def test_quoted_stale_decay_simulation_matches_its_results():
    """docs/SERVING.md's 256-slot read-once counterfactual bullets on production with and without
    the stale-confidence decay, from experiments/results/sched_sim/slots256/cache_read_once/
    sim.json and the staleness replays beside it."""
    import statistics
    flat = " ".join(open(os.path.join(ROOT, "docs", "SERVING.md")).read().split())
    base = os.path.join(ROOT, "experiments", "results", "sched_sim")
    res = json.load(open(os.path.join(base, "slots256", "cache_read_once", "sim.json")))
    assert res["meta"]["reps"] == 8 and "This run pools 8 repetitions of 400 steps" in flat
    a = res["answers"]["per_concurrency"]
    low = ["1", "2", "4", "8"]

    def joined(key, cs=low):
        return " / ".join(f"{a[c][key]:.3f}" for c in cs)
    assert f"is {joined('production_vs_best_static')}× the better of `none`" in flat
    assert f"it is {joined('production_held_vs_best_static')}× at C = 1-8" in flat
    high = [c for c in a if int(c) >= 16]
    assert min(a[c]["production_vs_best_static"] for c in high) >= 0.975
    assert max(a[c]["production_vs_best_static"] for c in high) < 1.065  # "0.98-1.06×"
    share = {p: [r["drafting_steps"] / r["steps"] for r in res["rows"] if r["policy"] == p
                 and str(r["concurrency"]) in low] for p in ("production", "production ρ=1")}
    def span(xs):
        return f"{round(100 * min(xs))}-{round(100 * max(xs))} %"
    assert f"It drafted on {span(share['production ρ=1'])} of the steps" in flat
    assert f"the decayed form on {span(share['production'])}." in flat
    reps = {c: a[c]["production_vs_held_reps"] for c in a}
    medians = " / ".join(f"{statistics.median(reps[c]):.3f}" for c in low)
    assert f"has medians {medians} at C = 1-8 (every repetition above 1.03)" in flat
    assert min(min(reps[c]) for c in low) > 1.03
    r16 = reps["16"]
    assert (f"{statistics.median(r16):.3f} at C = 16 ({min(r16):.3f}-{max(r16):.3f}: the decay "
            "costs about 1 % there)") in flat
    assert all(0.9985 <= statistics.median(reps[c]) < 1.0005 for c in a if int(c) >= 32)
    for name in ("staleness_iid", "staleness_sequential"):  # the replays of the quick head
        s = json.load(open(os.path.join(base, name, "sim.json")))
        meds = [statistics.median(v["production_vs_held_reps"])
                for v in s["answers"]["per_concurrency"].values()]
        assert 0.998 <= min(meds) and max(meds) < 1.0055, (name, meds)  # "0.998-1.005"
        assert all(v["best_fixed_vs_none"] < 0.945
                   for v in s["answers"]["per_concurrency"].values())  # "0.69-0.94"
