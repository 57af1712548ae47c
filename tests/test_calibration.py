"""Calibration: ECE / Brier / AUROC against hand values and brute force, survival bookkeeping,
Sequential Temperature Scaling (order preservation, ECE reduction), reliability PNG."""
import itertools

import jax.numpy as jnp
import numpy as np
import pytest

from specjax import calibration as C


def synthetic_blocks(seed, n=20000, betas=(2.5, 0.4, 3.0, 1.6)):
    """Held-out blocks with known conditional acceptance probabilities.

    True conditional logits u[n, k]; accepted[n, k] ~ Bernoulli(σ(u)) given the prefix; the head
    reports β_k·u (β > 1 over-confident, β < 1 under-confident), so T_k = β_k is the ideal STS.
    Entries after the first rejection hold random garbage (they must be ignored).
    """
    rng = np.random.default_rng(seed)
    gamma = len(betas)
    u = rng.normal(loc=np.linspace(1.5, 0.5, gamma), scale=1.2, size=(n, gamma))
    accepted = rng.random((n, gamma)) < C.sigmoid(u)
    return u * np.asarray(betas), accepted, u


# ---------------------------------------------------------------- metrics: hand values
def test_ece_hand_value_and_bins():
    probs = np.array([0.1, 0.2, 0.8, 0.9])
    labels = np.array([0, 1, 1, 1], bool)
    # 2 bins: [0, .5): pred .15 vs .5 -> .35; [.5, 1]: pred .85 vs 1 -> .15; weights 1/2 each.
    assert C.expected_calibration_error(probs, labels, n_bins=2) == pytest.approx(0.25)
    counts, mp, ml = C.reliability_bins(np.array([0.0, 0.5, 1.0]), np.array([0, 1, 1]), n_bins=2)
    np.testing.assert_array_equal(counts, [1, 2])  # 0.5 and 1.0 both land in the last bin
    np.testing.assert_allclose(mp, [0.0, 0.75])
    first_two = np.array([1, 1, 0, 0], bool)
    assert C.expected_calibration_error(probs, labels, n_bins=2, where=first_two) \
        == pytest.approx(0.35)
    assert np.isnan(C.expected_calibration_error(probs, labels, where=np.zeros(4, bool)))
    # Perfect calibration within bins -> 0.
    assert C.expected_calibration_error([0.25] * 4, [1, 0, 0, 0], n_bins=10) == pytest.approx(0.0)
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        C.expected_calibration_error([1.5], [1])


def test_brier_hand_values():
    assert C.brier_score([0.1, 0.9], [0, 0]) == pytest.approx((0.01 + 0.81) / 2)
    assert C.brier_score([1.0, 0.0, 0.5], [1, 0, 1]) == pytest.approx(0.25 / 3)
    assert C.brier_score([0.3, 0.9], [1, 1], where=[True, False]) == pytest.approx(0.49)


def brute_force_auroc(scores, labels):
    pos = [s for s, y in zip(scores, labels) if y]
    neg = [s for s, y in zip(scores, labels) if not y]
    wins = sum(1.0 if a > b else 0.5 if a == b else 0.0 for a, b in itertools.product(pos, neg))
    return wins / (len(pos) * len(neg))


@pytest.mark.parametrize("seed", range(4))
def test_auroc_matches_pairwise_count_with_ties(seed):
    rng = np.random.default_rng(seed)
    n = 200
    scores = rng.integers(0, 8, size=n).astype(float)  # heavy ties
    if seed % 2:
        scores += rng.normal(size=n) * (rng.random(n) < 0.5)  # mixed tied / distinct
    labels = rng.random(n) < C.sigmoid(scores - scores.mean())
    assert C.auroc(scores, labels) == pytest.approx(brute_force_auroc(scores, labels), abs=1e-12)


def test_auroc_edge_cases():
    assert C.auroc([0.1, 0.9], [0, 1]) == 1.0
    assert C.auroc([0.9, 0.1], [0, 1]) == 0.0
    assert C.auroc([0.5, 0.5, 0.5], [0, 1, 1]) == 0.5
    assert np.isnan(C.auroc([0.1, 0.2], [1, 1]))
    assert C.auroc([0.1, 0.9, 0.3], [0, 1, 1], where=[True, True, False]) == 1.0


# ---------------------------------------------------------------- survival bookkeeping
def test_survival_ignores_entries_after_first_rejection_and_unverified():
    acc = np.array([[1, 1, 1],
                    [1, 0, 1],   # rejected at 2; the trailing 1 is garbage
                    [0, 1, 1],   # rejected at 1
                    [1, 1, 0]], bool)
    survived, observed = C.survival(acc)
    np.testing.assert_array_equal(survived, [[1, 1, 1], [1, 0, 0], [0, 0, 0], [1, 1, 0]])
    assert observed.all()
    # Verified to 1 draft each: block 0 (accepted) is unknown beyond 1; block 2 (rejected at 1) is a
    # known negative at every position.
    survived, observed = C.survival(acc, num_verified=np.array([1, 2, 1, 0]))
    np.testing.assert_array_equal(observed, [[1, 0, 0], [1, 1, 1], [1, 1, 1], [0, 0, 0]])
    np.testing.assert_array_equal(survived, [[1, 0, 0], [1, 0, 0], [0, 0, 0], [0, 0, 0]])
    with pytest.raises(ValueError):
        C.survival(acc, num_verified=np.array([1, 2, 4, 0]))
    with pytest.raises(ValueError):
        C.survival(acc.astype(int))


# ---------------------------------------------------------------- STS
def test_sts_lowers_ece_on_miscalibrated_heads_and_recovers_temperatures():
    betas = (2.5, 0.4, 3.0, 1.6)
    logits, acc, _ = synthetic_blocks(0, betas=betas)
    sts = C.sequential_temperature_scaling(logits, acc)
    before = C.position_metrics(logits, acc)
    after = C.position_metrics(logits, acc, temperatures=sts.temperatures)
    np.testing.assert_allclose(after["ece"], sts.ece_after, rtol=1e-12)
    np.testing.assert_allclose(before["ece"], sts.ece_before, rtol=1e-12)
    assert np.all(before["ece"] > 0.03), before["ece"]
    assert np.all(after["ece"] < before["ece"])
    assert np.all(after["ece"] < 0.015), after["ece"]
    # The head's stated meaning (conditional acceptance) is calibrated too.
    assert np.all(after["ece_cond"] < 0.02), after["ece_cond"]
    # The fitted temperatures undo the miscalibration (roughly: ECE is a noisy objective).
    np.testing.assert_allclose(sts.temperatures, betas, rtol=0.25)
    # Held-out check: a fresh sample from the same process stays calibrated.
    logits2, acc2, _ = synthetic_blocks(1, betas=betas)
    held = C.position_metrics(logits2, acc2, temperatures=sts.temperatures)
    assert np.all(held["ece"] < 0.02), held["ece"]
    # Brier improves as well (proper scoring rule).
    assert np.all(after["brier"] <= before["brier"] + 1e-4)


def test_sts_is_order_preserving():
    logits, acc, _ = synthetic_blocks(2, n=5000)
    sts = C.sequential_temperature_scaling(logits, acc)
    assert np.all(sts.temperatures > 0)
    raw = C.sigmoid(logits)
    cal = sts.apply(logits)
    for k in range(logits.shape[1]):
        # Per position: the ranking of c_k is unchanged (ties included).
        np.testing.assert_array_equal(np.argsort(raw[:, k], kind="stable"),
                                      np.argsort(cal[:, k], kind="stable"))
    # Prefix products are non-increasing along the chain.
    a = np.cumprod(cal, axis=1)
    assert np.all(np.diff(a, axis=1) <= 0)
    # Among blocks sharing the same prefix logits, the order of a_k is the order of the raw a_k.
    for k in range(1, logits.shape[1]):
        shared = logits.copy()
        shared[:, :k] = logits[0, :k]
        a_raw = np.cumprod(C.sigmoid(shared), axis=1)
        a_cal = np.cumprod(sts.apply(shared), axis=1)
        np.testing.assert_array_equal(np.argsort(a_raw[:, k], kind="stable"),
                                      np.argsort(a_cal[:, k], kind="stable"))


def test_cross_prefix_order_of_products_can_change():
    # Documented limitation: per-position temperatures preserve each c_k's order, but the order of
    # a_2 = c_1·c_2 between blocks with *different* prefixes can flip when T_1 != T_2.
    logits = np.array([[2.0, -1.0], [-1.0, 2.0]])
    a_raw = np.cumprod(C.sigmoid(logits), axis=1)[:, 1]
    assert a_raw[0] == pytest.approx(a_raw[1])
    a_cal = np.cumprod(C.apply_temperatures(logits, [0.5, 2.0]), axis=1)[:, 1]
    assert a_cal[0] != pytest.approx(a_cal[1])


def test_sts_sequential_and_well_calibrated_input_keeps_t_near_one():
    logits, acc, _ = synthetic_blocks(3, betas=(1.0, 1.0, 1.0, 1.0))
    sts = C.sequential_temperature_scaling(logits, acc)
    np.testing.assert_allclose(sts.temperatures, 1.0, rtol=0.25)
    assert np.all(sts.ece_after <= sts.ece_before + 1e-12)
    # Sequential: position k's fit depends on earlier temperatures; refitting position 2 alone with
    # T_1 = 1 forced gives a different optimum when position 1 is miscalibrated.
    logits_m, acc_m, _ = synthetic_blocks(4, betas=(3.0, 1.0, 1.0, 1.0))
    full = C.sequential_temperature_scaling(logits_m, acc_m)
    assert full.temperatures[0] > 2.0
    grid = C.DEFAULT_TEMPERATURE_GRID
    a1_raw = C.sigmoid(logits_m[:, 0])
    surv = C.survival(acc_m)[0][:, 1]
    eces = [C.expected_calibration_error(a1_raw * C.sigmoid(logits_m[:, 1] / t), surv)
            for t in grid]
    assert grid[int(np.argmin(eces))] != pytest.approx(full.temperatures[1], rel=0.05)


def test_sts_with_partial_verification_and_grid_argument():
    logits, acc, _ = synthetic_blocks(5, n=8000)
    nv = np.random.default_rng(0).integers(0, 5, size=logits.shape[0])
    sts = C.sequential_temperature_scaling(logits, acc, num_verified=nv, n_bins=10,
                                           grid=[0.5, 1.0, 2.0, 3.0])
    assert set(sts.temperatures) <= {0.5, 1.0, 2.0, 3.0}
    m = C.position_metrics(logits, acc, temperatures=sts.temperatures, num_verified=nv, n_bins=10)
    np.testing.assert_allclose(m["ece"], sts.ece_after, rtol=1e-12)
    surv, obs = C.survival(acc, nv)
    np.testing.assert_array_equal(m["n"], obs.sum(0))
    with pytest.raises(ValueError, match="grid"):
        C.sequential_temperature_scaling(logits, acc, grid=[0.0, 1.0])


def test_apply_temperatures_numpy_and_jax():
    logits = np.array([[0.0, 1.0, -2.0], [3.0, -1.0, 0.5]])
    t = np.array([0.5, 1.0, 2.0])
    want = 1 / (1 + np.exp(-logits / t))
    np.testing.assert_allclose(C.apply_temperatures(logits, t), want, rtol=1e-12)
    got = C.apply_temperatures(jnp.asarray(logits, jnp.float32), t)
    assert isinstance(got, type(jnp.zeros(1)))
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6)
    with pytest.raises(ValueError, match="positive"):
        C.apply_temperatures(logits, [1.0, 0.0, 1.0])
    with pytest.raises(ValueError, match="γ"):
        C.apply_temperatures(logits, [1.0, 1.0])
    # Stable at extreme logits.
    assert np.all(np.isfinite(C.sigmoid(np.array([-1e4, 1e4]))))


def test_position_metrics_conditional_and_input_checks():
    logits, acc, u = synthetic_blocks(6, n=6000, betas=(1.0, 1.0, 1.0, 1.0))
    m = C.position_metrics(logits, acc)
    surv, _ = C.survival(acc)
    np.testing.assert_array_equal(m["n_cond"][0], logits.shape[0])
    np.testing.assert_array_equal(m["n_cond"][1:], surv[:, :-1].sum(0))
    np.testing.assert_allclose(m["survival_rate"], surv.mean(0))
    assert np.all(m["auroc"] > 0.6) and np.all(m["auroc_cond"] > 0.6)
    with pytest.raises(TypeError, match="bool"):
        C.position_metrics(logits, acc.astype(np.int32))
    with pytest.raises(ValueError, match="shape"):
        C.position_metrics(logits, acc[:, :2])


def test_reliability_png(tmp_path):
    from specjax.calibration_plot import plot_reliability
    logits, acc, _ = synthetic_blocks(7, n=3000)
    sts = C.sequential_temperature_scaling(logits, acc, grid=np.geomspace(0.2, 5, 41))
    path = plot_reliability(str(tmp_path / "rel.png"), logits, acc, temperatures=sts.temperatures,
                            positions=[1, 3], title="synthetic")
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    plot_reliability(str(tmp_path / "raw.png"), logits, acc)  # before only
    assert (tmp_path / "raw.png").stat().st_size > 1000
    with pytest.raises(ValueError, match="positions"):
        plot_reliability(str(tmp_path / "x.png"), logits, acc, positions=[0])
