"""The policy replay simulator (specjax/sched_sim.py) on hand-computable traces and profiles."""
import numpy as np
import pytest

from specjax.buckets import SPSProfile
from specjax.sched_sim import SimResult, Traces, simulate, sweep
from specjax.scheduling import SchedulerConfig

G = 4


def _profile(step_seconds, draft_s=0.0, max_tokens=64):
    """SPS per bucket 1..max_tokens from ``step_seconds(B)``."""
    buckets = tuple(range(1, max_tokens + 1))
    return SPSProfile(buckets, tuple(1.0 / step_seconds(b) for b in buckets), "test", draft_s)


def _traces(num_accepted, conf):
    n = len(num_accepted)
    return Traces(np.asarray(num_accepted), np.broadcast_to(np.asarray(conf, float), (n, G)))


def test_no_speculation_emits_one_token_per_request_step():
    prof = _profile(lambda b: 0.01 + 0.001 * b)
    r = simulate(_traces([2, 4, 0], [0.9] * G), SchedulerConfig("none"), prof, 8, steps=10)
    assert (r.tokens, r.verified_drafts, r.drafting_steps) == (80, 0, 0)
    assert r.seconds == pytest.approx(10 * (0.01 + 0.008))
    assert r.per_user == pytest.approx(1 / 0.018) and r.tau == 1.0


def test_fixed_k_truncates_the_recorded_acceptance():
    """Every recorded step accepted 2 of 4: verifying K = 1 accepts 1, K = 3 accepts 2."""
    prof = _profile(lambda b: 0.01 + 0.001 * b, draft_s=0.002)
    tr = _traces([2] * 5, [0.9] * G)
    for k, acc in ((1, 1), (3, 2)):
        r = simulate(tr, SchedulerConfig("fixed", k=k), prof, 4, steps=7)
        assert r.tokens == 7 * 4 * (acc + 1)
        assert r.seconds == pytest.approx(7 * (0.01 + 0.001 * 4 * (k + 1) + 0.002))
        assert r.drafting_steps == 7 and r.verified_drafts == 7 * 4 * k


def test_when_every_token_costs_the_same_the_lossless_policies_do_not_speculate():
    """SPS(B) = 1 / B: a draft accepted with probability a < 1 adds a < 1 tokens for one token of
    cost, so Θ only falls. Algorithm 1 and the production budget admit nothing, and match none."""
    prof = _profile(lambda b: 0.001 * b, draft_s=0.0)
    tr = _traces([1, 3, 0, 2], [0.8, 0.7, 0.6, 0.5])
    none = simulate(tr, SchedulerConfig("none"), prof, 6, steps=20, seed=1)
    for policy in ("dspark", "production"):
        r = simulate(tr, SchedulerConfig(policy, explore_every=0), prof, 6, steps=20, seed=1)
        assert r.verified_drafts == 0 and r.tokens == none.tokens
        assert r.seconds == pytest.approx(none.seconds)


def test_when_verification_is_free_algorithm_1_verifies_every_draft():
    """A flat SPS (one step costs the same at any B): every admission raises Θ, so Algorithm 1
    verifies all γ drafts of every request and emits what fixed K = γ emits, on the same draws."""
    prof = _profile(lambda b: 0.01)
    tr = _traces([0, 1, 2, 3, 4], [0.9, 0.8, 0.7, 0.6])
    full = simulate(tr, SchedulerConfig("fixed", k=G), prof, 8, steps=30, seed=3)
    d = simulate(tr, SchedulerConfig("dspark"), prof, 8, steps=30, seed=3)
    assert d.verified_drafts == 8 * 30 * G and d.tokens == full.tokens


def test_production_budgets_from_stale_confidences_and_stops_drafting_when_it_does_not_pay():
    """Drafting costs 10x a verification step: no budget pays for it, so after its prior the
    production policy drafts only on exploration steps (every 4th step here)."""
    prof = _profile(lambda b: 0.01, draft_s=0.1)
    tr = _traces([4] * 3, [0.99] * G)
    r = simulate(tr, SchedulerConfig("production", explore_every=4), prof, 2, steps=40)
    assert r.drafting_steps == 10
    assert r.tokens == 2 * (40 + 10 * G)


def test_sweep_pairs_policies_on_common_draws_and_checks_inputs():
    prof = _profile(lambda b: 0.01 + 0.0005 * b, max_tokens=40)
    tr = _traces([1, 2, 3], [0.9, 0.8, 0.7, 0.6])
    res = sweep(tr, [SchedulerConfig("none"), SchedulerConfig("fixed", k=2)], prof, [1, 4],
                steps=5)
    assert [(r.policy, r.concurrency) for r in res] == [("none", 1), ("fixed K=2", 1),
                                                        ("none", 4), ("fixed K=2", 4)]
    assert all(isinstance(r, SimResult) and r.throughput > 0 for r in res)
    with pytest.raises(ValueError, match="largest bucket"):
        simulate(tr, SchedulerConfig("fixed", k=4), prof, 10, steps=1)
    with pytest.raises(ValueError, match="concurrency"):
        simulate(tr, SchedulerConfig("none"), prof, 41)
    with pytest.raises(ValueError, match="biased"):
        simulate(tr, SchedulerConfig("retrospective"), prof, 2)
    with pytest.raises(ValueError, match=r"\[0, γ"):
        Traces(np.array([5]), np.ones((1, 4)))


def test_traces_load_pools_domains(tmp_path):
    np.savez(tmp_path / "t.npz", **{"math/num_accepted": np.array([1, 2]),
                                    "math/confidences": np.full((2, 3), 0.5),
                                    "code/num_accepted": np.array([0]),
                                    "code/confidences": np.full((1, 3), 0.25)})
    t = Traces.load(str(tmp_path / "t.npz"))
    assert t.gamma == 3 and sorted(t.num_accepted.tolist()) == [0, 1, 2]
    assert Traces.load(str(tmp_path / "t.npz"), ["code"]).num_accepted.tolist() == [0]
    with pytest.raises(ValueError, match="no traces"):
        Traces.load(str(tmp_path / "t.npz"), ["prose"])


def test_scheduler_sim_quick_on_the_committed_traces(tmp_path):
    """The CLI end to end on the committed DSpark-Markov γ = 7 traces (synthetic SPS profile):
    every policy at every concurrency, files written, and fixed K = γ emits 1 + the recorded mean
    acceptance per request-step (within 4 s.e. of its draws)."""
    import json
    from experiments import scheduler_sim
    out = scheduler_sim.main(["--quick", "--out", str(tmp_path)])
    assert out["simulation"] is True
    assert {(r["policy"], r["concurrency"]) for r in out["rows"]} >= {
        (p, c) for p in ("none", "dspark", "production", "fixed K=7") for c in (1, 2, 4, 8)}
    for name in ("sim.json", "sim.md", "sim.png"):
        assert (tmp_path / name).exists()
    assert json.load(open(tmp_path / "sim.json"))["answers"]["per_concurrency"]
    tr = Traces.load(scheduler_sim.DEFAULT_TRACES)
    full = [r for r in out["rows"] if r["policy"] == "fixed K=7"]
    draws = sum(r["steps"] * r["concurrency"] for r in full)
    tau = sum(r["tokens"] for r in full) / draws
    se = tr.num_accepted.std() / np.sqrt(draws)
    assert abs(tau - 1 - tr.num_accepted.mean()) < 4 * se
    assert all(r["tau"] == 1.0 for r in out["rows"] if r["policy"] == "none")


def test_cache_read_once_profile_is_the_roofline_of_weights_plus_one_kv_read():
    """The counterfactual profile: compiled FLOPs, bytes = weights' share + C slots' KV once."""
    from experiments.configs.tpu_pod import get_config
    from experiments.scheduler_sim import cache_once_profiles
    from specjax.aot import chip_of
    from specjax.models.flops import matmul_params
    from specjax.training.lm_task import model_config_from
    reports = [{"name": "engine.draft", "roofline_seconds": 1e-3},
               {"name": "engine.verify[N=16]", "shapes": {"bucket": 16}, "flops": 1e9,
                "mesh": {"tensor": 4}},
               {"name": "engine.verify[N=512]", "shapes": {"bucket": 512}, "flops": 5e13,
                "mesh": {"tensor": 4}}]
    prof = cache_once_profiles(reports, "qwen3-8b", "v5p-8", [1, 64], context=1024)
    m = model_config_from(get_config("qwen3-8b,dspark,v5p-8"))
    chip = chip_of("v5p-8")
    weights = matmul_params(m) * 2 / 4  # bf16 weights over 4-way tensor parallelism
    kv = m.num_layers * 2 * m.num_kv_heads * m.head_dim * 2 / 4
    for c in (1, 64):
        assert 1 / prof[c].steps_per_s[0] == pytest.approx((weights + c * 1024 * kv)
                                                           / chip.hbm_bandwidth)
        assert 1 / prof[c].steps_per_s[1] == pytest.approx(5e13 / chip.peak_bf16_flops)
        assert prof[c].draft_s == 1e-3 and prof[c].buckets == (16, 512)


def _two_requests():
    """Request 7: three steps accepting 0, 1, 2 drafts; request 3: two steps accepting 4, 4."""
    return Traces(np.array([0, 1, 2, 4, 4]), np.full((5, G), 0.5),
                  request=np.array([7, 7, 7, 3, 3]))


def test_sequential_replay_walks_each_request_in_order():
    """Each simulated request replays one recorded request's steps in order, then moves on to
    another (a new request, flagged so production forgets its history): with every draft
    verified (fixed K = γ), its tokens are the replayed steps' acceptances + 1."""
    from specjax.sched_sim import _sequential_draws
    tr = _two_requests()
    start, length = tr.request_spans()
    assert start.tolist() == [0, 3] and length.tolist() == [3, 2]
    draws, new = _sequential_draws(tr, np.random.default_rng(0), 40, 3)
    for t in range(1, 40):
        for r in range(3):
            if new[t, r]:
                assert draws[t, r] in (0, 3) and draws[t - 1, r] in (2, 4)  # end -> a start
            else:
                assert draws[t, r] == draws[t - 1, r] + 1 and draws[t, r] not in (0, 3)
    assert new.any()
    res = simulate(tr, SchedulerConfig("fixed", k=G), _profile(lambda b: 1.0), 3, steps=40,
                   seed=5, sequential=True)
    draws, _ = _sequential_draws(tr, np.random.default_rng(5), 40, 3)
    assert res.tokens == int((tr.num_accepted[draws] + 1).sum())
    with pytest.raises(ValueError, match="request"):
        simulate(_traces([0, 1], 0.5), SchedulerConfig("none"), _profile(lambda b: 1.0), 1,
                 sequential=True)
    with pytest.raises(ValueError, match="contiguous"):
        Traces(np.array([0, 1, 2]), np.full((3, G), 0.5), request=np.array([1, 2, 1]))


def test_traces_load_keeps_requests_apart_across_names(tmp_path):
    np.savez(tmp_path / "t.npz", **{"T0/num_accepted": np.array([1, 2, 0]),
                                    "T0/confidences": np.full((3, 3), 0.5),
                                    "T0/request": np.array([0, 0, 1]),
                                    "T1/num_accepted": np.array([3]),
                                    "T1/confidences": np.full((1, 3), 0.5),
                                    "T1/request": np.array([0])})
    t = Traces.load(str(tmp_path / "t.npz"))
    assert t.request.tolist() == [0, 0, 1, 2]  # T1's request 0 is not T0's
    assert t.request_spans()[1].tolist() == [2, 1, 1]


def test_scheduler_sim_repetitions_calibration_and_refusals(tmp_path):
    """``--reps 2`` sums each cell over two draws and keeps each one's production / held ratio;
    ``--sequential`` on traces without request ids is refused; ``calibrated`` pulls
    over-confident confidences down to the acceptance they state."""
    from experiments import scheduler_sim
    one = scheduler_sim.main(["--quick", "--out", str(tmp_path / "a")])
    two = scheduler_sim.main(["--quick", "--reps", "2", "--out", str(tmp_path / "b")])
    steps = {(r["policy"], r["concurrency"]): r["steps"] for r in one["rows"]}
    assert all(r["steps"] == 2 * steps[(r["policy"], r["concurrency"])] for r in two["rows"])
    assert all(len(a["production_vs_held_reps"]) == 2
               for a in two["answers"]["per_concurrency"].values())
    assert "repetitions" in (tmp_path / "b" / "sim.md").read_text()
    with pytest.raises(SystemExit):
        scheduler_sim.main(["--quick", "--sequential", "--out", str(tmp_path / "c")])
    # confidences 0.9 everywhere, half the steps accept nothing, half everything
    over = Traces(np.tile([0, G], 100), np.full((200, G), 0.9))
    cal, sts = scheduler_sim.calibrated(over)
    assert cal.confidences[:, 0].mean() == pytest.approx(0.5, abs=0.05)  # half accept draft 1
    assert sts.temperatures[0] > 1
