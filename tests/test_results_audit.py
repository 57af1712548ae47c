"""The numbers docs/RESULTS.md quotes about the committed results, recomputed from their JSON."""
import json
import os

from experiments import results_audit as A

FULL = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                    "experiments", "results", "full")


def test_tau_misses_counts_cells_beyond_tolerance():
    results = {"d": {"RS@1": {"all": {"tau": 3.0, "tau_pred": 3.06},
                              "math": {"tau": 2.0, "tau_pred": 2.04}}}}
    miss, n, worst, where = A.tau_misses(results)
    assert (miss, n, where) == (1, 2, "d RS@1 all") and abs(worst - 0.06) < 1e-12


def test_quoted_numbers_match_the_committed_results():
    summary = json.load(open(os.path.join(FULL, "summary.json")))
    s0 = {k: v for k, v in summary["bebop"]["results"].items() if k.endswith("_s0")}
    miss, n, worst, _ = A.tau_misses(s0)
    assert (miss, n, round(worst, 2)) == (6, 100, 0.13)
    for part, expected in (("dspark_g7", (4, 24, 0.08)), ("dspark_g15", (7, 24, 0.18))):
        miss, n, worst, _ = A.tau_misses(json.load(open(os.path.join(FULL, part, "results.json"))))
        assert (miss, n, round(worst, 2)) == expected, part
    cal = json.load(open(os.path.join(FULL, "dspark_g15", "calibration_dspark_markov_g15.json")))
    assert round(100 * max(cal["fit_ece_after"]), 1) == 2.5
    assert round(100 * max(cal["ece_cond_after"]), 1) == 39.4
