"""Compiled shape buckets, prefill chunk plans and the SPS profile (specjax/buckets.py)."""
import numpy as np
import pytest

from specjax import buckets as B


def test_pick_bucket_bisect_and_errors():
    buckets = B.validate_buckets([32, 8, 16, 16])
    assert buckets == [8, 16, 32]
    assert [B.pick_bucket(buckets, n) for n in (1, 8, 9, 16, 17, 32)] == [8, 8, 16, 16, 32, 32]
    with pytest.raises(ValueError, match="exceed the largest bucket"):
        B.pick_bucket(buckets, 33)
    with pytest.raises(ValueError, match="positive"):
        B.validate_buckets([0, 4])
    assert B.default_buckets(40) == [8, 16, 32, 40]


def test_plan_chunks_pads_least_then_calls_least():
    b = [8, 16, 32, 64, 128]
    # 35: 32 + 8 = 40 positions (one call at 64 would pad 29; 8 x 5 = 40 takes 5 calls)
    assert B.plan_chunks(b, 35) == [32, 8]
    assert B.plan_chunks(b, 32) == [32]
    assert B.plan_chunks(b, 9) == [16]  # 16 positions either way: one call, not 8 + 8
    assert B.plan_chunks(b, 200) == [128, 64, 8]
    assert B.plan_chunks(b, 1) == [8]
    # longer than the largest bucket: full chunks of it first, the rest planned the same way
    assert B.plan_chunks([16, 64, 256], 300) == [256, 16, 16, 16]
    assert B.plan_chunks([32, 128], 35) == [32, 32]
    # a price per call: 35 as [32, 8] costs 40 + 2 * 32 = 104, as [64] 64 + 32 = 96
    assert B.plan_chunks(b, 35, call_cost=32) == [64]
    assert B.plan_chunks(b, 35, call_cost=8) == [32, 8]  # 56 against 72
    for n in range(1, 300):  # every chunk but the last full: the plan covers n, wastes < 8
        plan = B.plan_chunks(b, n)
        assert sum(plan[:-1]) < n <= sum(plan) < n + 8, (n, plan)
    assert B.prompt_chunk_buckets(96) == (8, 32, 128)
    assert B.prompt_chunk_buckets(8) == (8,) and B.prompt_chunk_buckets(9) == (8, 32)
    with pytest.raises(ValueError, match=">= 1"):
        B.plan_chunks(b, 0)
    with pytest.raises(ValueError, match="call_cost"):
        B.plan_chunks(b, 5, call_cost=-1)


def test_sps_profile_step_table_and_cache(tmp_path):
    calls = []
    fake_time = iter(np.arange(0, 1000, 0.5))  # each run_bucket takes 0.5 "s" of the fake clock

    def run_bucket(b):
        calls.append(b)

    prof = B.profile_sps(run_bucket, [4, 8], key="cpu/model", reps=3, warmup=1,
                         cache_path=str(tmp_path / "sps.json"), clock=lambda: next(fake_time))
    assert prof.buckets == (4, 8) and np.allclose(prof.steps_per_s, 2.0)
    assert calls == [4] * 4 + [8] * 4
    table = prof.table()
    assert table.shape == (9,) and np.all(table == 2.0)
    # Reused when the key matches (no new calls), re-measured when it does not.
    again = B.profile_sps(run_bucket, [4, 8], key="cpu/model", cache_path=str(tmp_path / "sps.json"))
    assert again == prof and len(calls) == 8
    B.profile_sps(run_bucket, [4, 8], key="other", reps=1, warmup=0,
                  cache_path=str(tmp_path / "sps.json"), clock=lambda: next(fake_time))
    assert len(calls) == 10
    step = B.SPSProfile((2, 4), (10.0, 5.0)).table()
    np.testing.assert_array_equal(step, [10, 10, 10, 5, 5])
    # The drafting step is timed too (0.5 "s") and saved / loaded with the profile.
    drafts = []
    with_draft = B.profile_sps(run_bucket, [4, 8], key="d", reps=3, warmup=1,
                               cache_path=str(tmp_path / "sps_d.json"),
                               clock=lambda: next(fake_time), run_draft=lambda: drafts.append(1))
    assert with_draft.draft_s == 0.5 and len(drafts) == 4
    np.testing.assert_allclose(with_draft.table_with_draft(), 1 / (0.5 + 0.5))
    assert B.SPSProfile.load(str(tmp_path / "sps_d.json")) == with_draft
    # ... and the plain decode step (production's steps at budget 0)
    plains = []
    with_plain = B.profile_sps(run_bucket, [4, 8], key="p", reps=3, warmup=1,
                               clock=lambda: next(fake_time), run_plain=lambda: plains.append(1))
    assert with_plain.plain_s == 0.5 and with_plain.draft_s == 0 and len(plains) == 4
