"""benchmarks/serving_report.py's goal arithmetic on hand-made reports (no engine)."""
import math

from benchmarks.serving_report import goals


def _report(mtp1, dspark):
    """closed_loop with per-C (aggregate, per-user) pairs for mtp1 and dspark."""
    return {"closed_loop": {str(c): {"policies": {
        "mtp1": {"aggregate_tok_s": m[0], "per_user_tok_s": m[1]},
        "dspark": {"aggregate_tok_s": d[0], "per_user_tok_s": d[1]}}}
        for c, m, d in zip((1, 2, 4), mtp1, dspark)}}


def test_per_user_vs_mtp1_interpolates_along_a_trade_off_curve():
    # MTP-1: (100, 100) -> (200, 60) -> (300, 40); dspark at aggregate 150 has per-user 90:
    # MTP-1 there is 80 (halfway between 100 and 60), so the ratio is 90 / 80
    g = goals(_report([(100, 100), (200, 60), (300, 40)], [(150, 90), (400, 10), (50, 5)]),
              policies=("dspark",))["dspark"]
    assert set(g["per_user_vs_mtp1"]) == {"1"}  # 400 and 50 lie outside MTP-1's range
    assert math.isclose(g["per_user_vs_mtp1"]["1"], 90 / 80)
    assert math.isclose(g["vs_best_fixed"]["1"]["ratio"], 150 / 100)


def test_per_user_vs_mtp1_refuses_a_non_monotone_curve():
    # aggregate falls from C = 2 to C = 4: 250 is reached at two concurrencies
    g = goals(_report([(100, 100), (300, 60), (200, 40)], [(250, 90), (250, 50), (250, 30)]),
              policies=("dspark",))["dspark"]
    assert g["per_user_vs_mtp1"] == {} and "not a trade-off curve" in g["per_user_vs_mtp1_note"]
