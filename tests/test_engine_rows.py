"""Row buckets (``EngineConfig.row_buckets``): the device loop and admission run on the active
slots only. Same greedy tokens as plain decoding for every drafter and policy, the same sampled
tokens as the all-slot engine with a deterministic drafter, the target's distribution (chi-square
at the 1e-6 level) with a sampling drafter and competing requests, and no compilation after
warm-up; plus the row choice and config errors."""
import dataclasses

import jax
import numpy as np
import pytest
from _shared_once import count_compiles
# target, sampling_target: test_engine's fixtures (the same tiny models)
from test_engine import (V, _assert_first_tokens_follow_target, _assert_greedy, _drafter,  # noqa: F401
                         _greedy_reference, _requests, _run_mixed, sampling_target, target)

from specjax.buckets import SPSProfile
from specjax.engine import Engine, EngineConfig, Request
from specjax.engine import device_driver, engine as engine_mod
from specjax.engine.device_loop import LoopSpec
from specjax.engine.loop_rows import pick_rows, row_bucket_spec, shrink_point, spec_for_rows
from specjax.engine.requests import parse_row_buckets
from specjax.engine.step_costs import fill_unreachable
from specjax.engine.warmup import row_cache_path
from specjax.scheduling import SchedulerConfig

pytestmark = pytest.mark.xdist_group("engine")


def test_row_bucket_config_and_choice():
    assert EngineConfig(num_slots=32, row_buckets="auto").loop_row_buckets == (1, 2, 4, 8, 16)
    assert EngineConfig(num_slots=5, row_buckets="auto").loop_row_buckets == (1, 2, 4)
    assert EngineConfig(num_slots=1, row_buckets="auto").loop_row_buckets == ()
    assert EngineConfig(num_slots=8, row_buckets=(4, 2, 4)).loop_row_buckets == (2, 4)
    with pytest.raises(ValueError, match=r"\[1, num_slots\)"):
        EngineConfig(num_slots=4, row_buckets=(4,))
    with pytest.raises(ValueError, match="'auto'"):
        EngineConfig(num_slots=4, row_buckets="all")
    with pytest.raises(ValueError, match="device loop only"):
        EngineConfig(num_slots=4, row_buckets=(2,), loop="host")
    # flag / config values
    assert [parse_row_buckets(v) for v in ("auto", "none", "", None, "4,1", (2, 8))] == [
        "auto", (), (), (), (4, 1), (2, 8)]
    with pytest.raises(ValueError, match="comma-separated row counts"):
        parse_row_buckets("half")
    # active slots first, then idle ones up to the smallest bucket; none fits -> every slot
    assert pick_rows([False, True, False, True, False], (1, 2, 4)) == [1, 3]
    assert pick_rows([False, True, False, False, False], (2, 4)) == [1, 0]
    assert pick_rows([True, True, True, False, False], (1, 2, 4)) == [0, 1, 2, 3]
    assert pick_rows([False] * 3, (1, 2)) == [0]
    assert pick_rows([True, True, True, False, True], (1, 2)) is None
    # a call returns once the active slots fit the next smaller row bucket
    assert shrink_point(None, (1, 2, 4)) == 4 and shrink_point(4, (1, 2, 4)) == 2
    assert shrink_point(1, (1, 2, 4)) == -1 and shrink_point(None, ()) == -1
    spec = LoopSpec(policy="fixed", gamma=3, buckets=(4, 8, 16, 32), method="rejection",
                    max_steps=4)
    assert spec_for_rows(spec, 1).buckets == (4,)
    assert spec_for_rows(spec, 3).buckets == (4, 8, 16)  # 12 tokens: bucket 16
    assert spec_for_rows(spec, 8).buckets == (4, 8, 16, 32)
    # the profiles time only the engine's row buckets (no program exists for another count)
    assert row_bucket_spec((1, 2, 4), spec, 2) == spec_for_rows(spec, 2)
    with pytest.raises(ValueError, match=r"rows=3 is not one of the engine's row buckets"):
        row_bucket_spec((1, 2, 4), spec, 3)
    # a row bucket's profile: rates of the buckets it can fill, the last one repeated
    assert fill_unreachable([3.0, 2.0], 4) == (3.0, 2.0, 2.0, 2.0)
    with pytest.raises(ValueError, match="3 rates for 2 buckets"):
        fill_unreachable([1.0, 1.0, 1.0], 2)
    assert row_cache_path("runs/sps.json", 4) == "runs/sps.rows4.json"
    assert row_cache_path(None, 4) is None


GREEDY_CASES = {"mtp": ("fixed",), "dspark": ("dspark", "production"), "ngram": ("none",),
                "draft_lm": ("mtp1",)}


@pytest.mark.parametrize("kind", sorted(GREEDY_CASES))
def test_row_buckets_keep_greedy_decoding_under_mixed_load(target, kind, monkeypatch):
    """Arrivals in waves make the number of active slots move between calls, so calls run on
    1, 2 and all 4 rows (counted), and prompts are admitted into row buckets as well."""
    calls = []
    real_loop, real_prefill = device_driver.run_loop_rows, engine_mod.prefill_rows
    monkeypatch.setattr(device_driver, "run_loop_rows",
                        lambda *a, **k: calls.append(("loop", a[6].shape[0])) or real_loop(*a, **k))
    monkeypatch.setattr(engine_mod, "prefill_rows",
                        lambda *a, **k: calls.append(("prefill", a[6].shape[0]))
                        or real_prefill(*a, **k))
    d, p, f = _drafter(kind, target)
    for policy in GREEDY_CASES[kind]:
        cfg = EngineConfig(num_slots=4, max_len=40, gamma=3, prefill_buckets=(8,),
                           loop_steps=3, row_buckets="auto",
                           scheduler=SchedulerConfig(policy, k=3, threshold=0.3))
        engine = Engine(target, d, p, f, cfg)
        engine.warmup(profile=False)
        engine.sps_table = 1.0 / (1.0 + 0.3 * np.arange(engine.buckets[-1] + 1))
        engine.sps_table_draft = engine.sps_table
        calls.clear()
        rng = np.random.default_rng(len(kind) * 100 + len(policy))
        reqs = _requests(rng, 10, stop=True)
        _assert_greedy(target, reqs, _run_mixed(engine, reqs, rng), (kind, policy))
        assert {r for c, r in calls if c == "loop"} == {1, 2}, calls  # and full calls between
        assert {r for c, r in calls if c == "prefill"} >= {1}, calls


def test_a_call_returns_when_its_slots_fit_a_smaller_row_bucket(target):
    """Four requests admitted together that end after 2, 5, 10 and 16 tokens, with room for all
    of them in one call (``loop_steps`` 64): the first call returns when two are left, the second
    (on 2 rows) when one is left, the third runs it on 1 row; the tokens are plain greedy's."""
    d, p, f = _drafter("ngram", target)
    for policy in ("none", "fixed"):
        engine = Engine(target, d, p, f, EngineConfig(
            num_slots=4, max_len=40, gamma=3, prefill_buckets=(8,), loop_steps=64,
            row_buckets="auto", scheduler=SchedulerConfig(policy, k=3)))
        engine.warmup(profile=False)
        reqs = [Request(prompt=[1 + i, 2, 3], max_new_tokens=n, temperature=0.0)
                for i, n in enumerate((2, 5, 10, 16))]
        results = engine.generate(reqs)
        assert [s.active for s in engine.loop_stats] == [4, 2, 1], policy
        for req, res in zip(reqs, results):
            assert res.tokens == _greedy_reference(target, req)[0]


def test_row_buckets_emit_the_same_sampled_tokens_with_a_deterministic_drafter(target):
    """The n-gram drafter's drafts are a function of the history, and every other random number
    of a request is keyed by its seed and step count: on a subset of rows the engine must emit,
    at temperature 1 and with top-k, exactly the tokens it emits on all slots."""
    d, p, f = _drafter("ngram", target)
    out = {}
    for rb in ((), "auto"):
        cfg = EngineConfig(num_slots=4, max_len=40, gamma=3, prefill_buckets=(4, 8),
                           loop_steps=2, row_buckets=rb, scheduler=SchedulerConfig("fixed", k=3))
        engine = Engine(target, d, p, f, cfg)
        engine.warmup(profile=False)
        rng = np.random.default_rng(7)
        reqs = _requests(rng, 12, temperature=1.0)
        reqs = [dataclasses.replace(r, top_k=5 if i % 3 == 0 else None)
                for i, r in enumerate(reqs)]
        out[rb] = [r.tokens for r in _run_mixed(engine, reqs, rng)]
    assert out[()] == out["auto"]
    assert sum(map(len, out[()])) > 40


# per-row profiles that price the 1- and 2-row programs unlike the all-slot one: drafting is
# free on 1 row, dear on 2
_ROW_PROFILES = {1: SPSProfile((4, 8, 16), (1.0, 1.0, 1.0), draft_s=0.0),
                 2: SPSProfile((4, 8, 16), (1.0, 0.5, 0.25), draft_s=0.8, plain_s=0.5)}


@pytest.mark.parametrize("policy,draft_s,by_rows", [("dspark", 0.0, None),
                                                    ("production", 0.4, None),
                                                    ("production", 0.4, _ROW_PROFILES)])
def test_row_buckets_engine_is_lossless_at_temperature1(sampling_target, policy, draft_s,
                                                        by_rows):
    """Many seeds of one prompt, arriving 0-3 per call into 4 slots (calls on 1, 2 and 4 rows),
    compete for the verification budget with the sampling DSpark drafter; the first three tokens
    follow the target's exact joint / marginal (chi-square, 1e-6 level). Also with a profile per
    row bucket, so that the lengths chosen move with the call's rows."""
    d, p, f = _drafter("dspark", sampling_target)
    cfg = EngineConfig(num_slots=4, max_len=24, gamma=3, prefill_buckets=(2, 8), loop_steps=2,
                       row_buckets="auto", filters=False, scheduler=SchedulerConfig(policy))
    engine = Engine(sampling_target, d, p, f, cfg)
    engine.warmup(profile=False)
    engine.set_sps(SPSProfile((4, 8, 16), (1.0, 0.9, 0.5), draft_s=draft_s), by_rows=by_rows)
    prompt, n = [3, 7, 1], 3000
    rng = np.random.default_rng(0)
    ids, seed = [], 0
    while seed < n or engine.has_work():
        for _ in range(int(rng.integers(0, 4))):
            if seed < n:
                ids.append(engine.submit(Request(prompt=prompt, max_new_tokens=4,
                                                 temperature=1.0, seed=seed)))
                seed += 1
        if engine.has_work():
            engine.step()
    actives = {s.active for s in engine.loop_stats}
    assert {1, 2} <= actives and max(actives) >= 3, actives
    results = [engine.finished[i] for i in ids]
    assert sum(r.accepted for r in results) > 0.2 * n
    toks = np.array([r.tokens[:3] for r in results])
    _assert_first_tokens_follow_target(sampling_target, prompt, toks)


def test_row_buckets_compile_nothing_after_warmup(target):
    jax.clear_caches()  # programs compiled by earlier tests must not hide a compile
    d, p, f = _drafter("dspark", target)
    engine = Engine(target, d, p, f, EngineConfig(num_slots=4, max_len=40, gamma=3,
                                                  prefill_buckets=(4, 8), loop_steps=3,
                                                  row_buckets="auto",
                                                  scheduler=SchedulerConfig("dspark")))
    engine.warmup(profile=False)
    engine.set_sps(SPSProfile(tuple(engine.buckets), (100.0,) * len(engine.buckets)))
    with count_compiles() as compiles:
        rng = np.random.default_rng(0)
        for step in range(60):
            for _ in range(int(rng.integers(0, 3)) if step % 20 < 10 else 0):
                engine.submit(Request(prompt=rng.integers(0, V, size=int(rng.integers(2, 16))).tolist(),
                                      max_new_tokens=int(rng.integers(1, 20)),
                                      temperature=float(rng.choice([0.0, 1.0])), seed=step))
            if engine.has_work():
                engine.step()
    assert len({s.active for s in engine.loop_stats}) >= 3
    assert compiles == []


def _draft_steps(engine, reqs):
    engine.loop_stats.clear()
    engine.generate(reqs)
    return sum(s.draft_steps for s in engine.loop_stats), {s.active for s in engine.loop_stats}


def test_a_call_on_a_row_bucket_reads_that_buckets_profile(target):
    """production (without exploration) drafts or not by the SPS tables it is given: a profile
    whose plain step is (nearly) free never drafts, one whose plain step is (nearly) endless
    does. One request at a time runs on 1 row, so it follows the 1-row profile, whatever the
    all-slot one says."""
    d, p, f = _drafter("dspark", target)
    engine = Engine(target, d, p, f, EngineConfig(
        num_slots=4, max_len=40, gamma=3, prefill_buckets=(8,), loop_steps=4, row_buckets="auto",
        scheduler=SchedulerConfig("production", explore_every=0)))
    engine.warmup(profile=False)
    b = tuple(engine.buckets)
    plain_wins = SPSProfile(b, (1.0,) * len(b), plain_s=1e-9)
    draft_wins = SPSProfile(b, (1.0,) * len(b), plain_s=1e9)
    reqs = [Request(prompt=[3, 1, 4], max_new_tokens=12, temperature=0.0)]
    for full, one, drafts in ((plain_wins, draft_wins, True), (draft_wins, plain_wins, False),
                              (draft_wins, None, True), (plain_wins, None, False)):
        engine.set_sps(full, by_rows=None if one is None else {1: one})
        n, actives = _draft_steps(engine, reqs)
        assert actives == {1}
        assert (n > 0) == drafts, (n, drafts)
    with pytest.raises(ValueError, match=r"rows \[4\]"):
        engine.set_sps(plain_wins, by_rows={4: plain_wins})
    with pytest.raises(ValueError, match=r"\(rows 2\)"):
        engine.set_sps(plain_wins, by_rows={2: SPSProfile((4,), (1.0,))})


@pytest.mark.parametrize("policy", ["production", "dspark"])
def test_warmup_profiles_each_row_bucket_and_then_compiles_nothing(target, policy, tmp_path):
    """Warm-up times a profile on every row bucket's program (production: the loop itself;
    dspark: its steps on the gathered rows), with the buckets a call on those rows can fill, and
    keeps them beside ``sps_cache``; a second engine loads them. Serving after warm-up compiles
    nothing (the profile ran the row programs the engine runs)."""
    jax.clear_caches()
    d, p, f = _drafter("dspark", target)
    cache = str(tmp_path / "sps.json")
    cfg = EngineConfig(num_slots=4, max_len=40, gamma=3, prefill_buckets=(8,), loop_steps=3,
                       row_buckets="auto", profile_reps=1, sps_cache=cache,
                       scheduler=SchedulerConfig(policy))
    engine = Engine(target, d, p, f, cfg)
    ticks = []
    engine.warmup(progress=lambda *a: ticks.append(a))
    # one tick per compiled program or profile, in order
    assert [t[2] for t in ticks] == [
        "prefill chunk 8", "prefill chunk 8 on 1 row", "prefill chunk 8 on 2 rows",
        "device loop", "device loop on 1 row", "device loop on 2 rows",
        "SPS profile", "SPS profile on 1 row", "SPS profile on 2 rows"]
    assert [t[:2] for t in ticks] == [(i + 1, 9) for i in range(9)]
    assert sorted(engine.sps_rows) == [1, 2] and engine.sps.key.endswith("ctx10")
    for r, prof in engine.sps_rows.items():
        assert prof.key == f"{engine.sps.key}/rows{r}" and prof.plain_s > 0
        assert list(prof.buckets) == engine.buckets
        reach = len(spec_for_rows(engine._loop_spec, r).buckets)
        assert reach < len(engine.buckets)  # 4 and 8 tokens: buckets 4 and 8 of (4, 8, 16)
        assert all(x == prof.steps_per_s[reach - 1] for x in prof.steps_per_s[reach:])
        assert SPSProfile.load(row_cache_path(cache, r)) == prof
    with count_compiles() as compiles:
        rng = np.random.default_rng(1)
        for step in range(30):
            for _ in range(int(rng.integers(0, 3)) if step % 10 < 5 else 0):
                engine.submit(Request(prompt=rng.integers(0, V, size=5).tolist(),
                                      max_new_tokens=int(rng.integers(1, 12)),
                                      temperature=1.0, seed=step))
            if engine.has_work():
                engine.step()
    assert len({s.active for s in engine.loop_stats}) >= 2
    assert compiles == []
    again = Engine(target, d, p, f, cfg)
    again.warmup()
    assert again.sps == engine.sps and again.sps_rows == engine.sps_rows  # loaded, not timed


def test_production_profiles_run_the_engines_compiled_loops(target):
    """The production profile times the engine's own loop programs (all slots and each row
    bucket) with the argument types the engine passes: after warm-up it builds no executable
    (a Python-int shrink point, say, would compile the whole loop again)."""
    from specjax.engine.loop_profile import production_loop_profile
    jax.clear_caches()  # programs compiled by earlier tests must not hide a compile
    d, p, f = _drafter("dspark", target)
    engine = Engine(target, d, p, f, EngineConfig(
        num_slots=4, max_len=40, gamma=3, prefill_buckets=(8,), loop_steps=3, row_buckets="auto",
        scheduler=SchedulerConfig("production")))
    engine.warmup(profile=False)
    with count_compiles() as compiles:
        for rows in (None, 1, 2):
            production_loop_profile(engine, reps=1, rows=rows)
    assert compiles == []
