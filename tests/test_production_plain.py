"""Production's steps without drafts run the plain decode step, and the device loop's profile.

A step whose budget (from stale confidences) is 0 draws no drafts; the device loop then runs the
dense decode step of policy "none" and commits the drafter as after a verification of no drafts,
instead of a flattened verification of ℓ = 0. The token distribution is the target's either way
(the T = 1 chi-square of ``test_engine.py::test_temperature1_engine_with_scheduler_is_lossless``
runs production with both kinds of steps); these tests pin the drafter state and the policy's
choice.
"""
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))
from test_engine import CFG, _drafter, _greedy_reference, target  # noqa: E402,F401

from specjax.buckets import SPSProfile  # noqa: E402
from specjax.drafters.base import Sampling  # noqa: E402
from specjax.engine import Engine, EngineConfig, Request  # noqa: E402
from specjax.engine.device_loop import plain_step, init_loop_state  # noqa: E402
from specjax.engine.steps import verify_core  # noqa: E402
from specjax.scheduling import SchedulerConfig  # noqa: E402


def _prefilled_engine(target, kind, slots=2):
    d, p, f = _drafter(kind, target)
    eng = Engine(target, d, p, f, EngineConfig(num_slots=slots, max_len=32, gamma=3,
                                               prefill_buckets=(8,), loop="device",
                                               scheduler=SchedulerConfig("fixed", k=3)))
    # No warmup(): these tests call the step functions directly, never the compiled loop.
    eng.submit(Request(prompt=[3, 1, 4, 1, 5], max_new_tokens=8))
    eng._admit()
    return eng


@pytest.mark.parametrize("kind", ["mtp", "dspark"])
def test_plain_step_commits_the_drafter_like_a_verification_of_no_drafts(target, kind):
    """Same token, same cache lengths and the same drafter state as verifying ℓ = 0 drafts.

    Tolerance of the float leaves (hidden states, drafter keys/values): the dense decode and the
    flattened verification run the same float32 operations in different layouts, so they differ
    only in the order of each reduction, by at most about n·2^-24 of the terms' magnitude for a
    length-n dot (n ≤ 64 here) per layer; 1e-4 of each leaf's largest magnitude bounds two layers
    of that with a wide margin, while a commit at a wrong position or of a wrong token changes
    entries by their whole size."""
    eng = _prefilled_engine(target, kind)
    s = eng.config.num_slots
    active = np.array([eng.slots[i] is not None for i in range(s)])
    greedy = Sampling(temperature=jnp.zeros((s,), jnp.float32))
    keys = eng._slot_keys(0)
    state = eng.state
    ls = init_loop_state(state, s, 3, 4)._replace(active=jnp.asarray(active))
    plain, tok = jax.jit(lambda ls: plain_step(eng.graphdef, eng.target_state, ls, greedy, keys,
                                                eng.drafter, eng.params, eng.frozen))(ls)
    nd = jnp.where(jnp.asarray(active), 0, -1)
    drafts = jnp.zeros((s, 3), jnp.int32)
    probs = jnp.full((s, 3, CFG.vocab_size), 1.0 / CFG.vocab_size)
    ver, res = verify_core(eng.graphdef, eng.target_state, eng.drafter, eng.params, eng.frozen,
                           state, drafts, probs, nd, keys, greedy, bucket=eng.buckets[0],
                           gamma=3, method="rejection")
    np.testing.assert_array_equal(np.asarray(tok[active, 0]), np.asarray(res.tokens[active, 0]))
    np.testing.assert_array_equal(np.asarray(plain.anchor), np.asarray(ver.anchor))
    np.testing.assert_array_equal(np.asarray(plain.cache.lengths), np.asarray(ver.cache.lengths))
    n = int(state.cache.lengths[0]) + 1  # written positions of the active slot
    np.testing.assert_allclose(np.asarray(plain.cache.k[:, 0, :n]), np.asarray(ver.cache.k[:, 0, :n]),
                               atol=1e-4 * float(jnp.max(jnp.abs(ver.cache.k))))
    for a, b in zip(jax.tree.leaves(plain.drafter_state), jax.tree.leaves(ver.drafter_state)):
        a, b = np.asarray(a), np.asarray(b)
        if np.issubdtype(b.dtype, np.integer):
            np.testing.assert_array_equal(a, b)
        else:
            np.testing.assert_allclose(a, b, atol=1e-4 * max(float(np.max(np.abs(b))), 1e-30))


def test_verification_writes_the_cache_alike_during_or_after_the_forward(target):
    """``verify_core(write_during=False)`` (the device loop's order: read-only forward, then
    every new key/value written) gives the host step's tokens, lengths, cache and drafter state.
    Sampled at T = 1 with the same keys: both orders draw the same verification noise, and their
    logits differ only in the order of the attention's reductions (tolerance as in the test
    above), far below what moves a draw except at a boundary no fixed seed here sits on."""
    eng = _prefilled_engine(target, "mtp")
    s = eng.config.num_slots
    active = np.array([eng.slots[i] is not None for i in range(s)])
    rng = np.random.default_rng(3)
    drafts = jnp.asarray(rng.integers(0, CFG.vocab_size, size=(s, 3)), jnp.int32)
    probs = jax.nn.softmax(jnp.asarray(rng.normal(size=(s, 3, CFG.vocab_size)), jnp.float32))
    nd = jnp.where(jnp.asarray(active), 3, -1)
    sampling = Sampling(temperature=jnp.ones((s,), jnp.float32))
    keys = eng._slot_keys(0)
    out = {}
    for during in (True, False):
        out[during] = verify_core(eng.graphdef, eng.target_state, eng.drafter, eng.params,
                                  eng.frozen, eng.state, drafts, probs, nd, keys, sampling,
                                  bucket=eng.buckets[-1], gamma=3, method="rejection",
                                  write_during=during)
    (host, host_res), (loop, loop_res) = out[True], out[False]
    np.testing.assert_array_equal(np.asarray(host_res.tokens), np.asarray(loop_res.tokens))
    np.testing.assert_array_equal(np.asarray(host.cache.lengths), np.asarray(loop.cache.lengths))
    np.testing.assert_array_equal(np.asarray(host.anchor), np.asarray(loop.anchor))
    for a, b in [(host.cache.k, loop.cache.k), (host.cache.v, loop.cache.v),
                 *zip(jax.tree.leaves(host.drafter_state), jax.tree.leaves(loop.drafter_state))]:
        a, b = np.asarray(a), np.asarray(b)
        if np.issubdtype(b.dtype, np.integer):
            np.testing.assert_array_equal(a, b)
        else:
            np.testing.assert_allclose(a, b, atol=1e-4 * max(float(np.max(np.abs(b))), 1e-30))
    # the drafts were written: the cache changed past the prompt in both orders
    n0 = int(eng.state.cache.lengths[0])
    assert not np.allclose(np.asarray(host.cache.k[:, 0, n0:n0 + 4]), 0)


def _production(target, plain_s, draft_s, loop="device", explore_every=16):
    d, p, f = _drafter("dspark", target)
    cfg = EngineConfig(num_slots=4, max_len=32, gamma=3, prefill_buckets=(8,), loop=loop,
                       scheduler=SchedulerConfig("production", explore_every=explore_every))
    eng = Engine(target, d, p, f, cfg)
    eng.warmup(profile=False)
    eng.set_sps(SPSProfile(tuple(eng.buckets), (1.0,) * len(eng.buckets), draft_s=draft_s,
                           plain_s=plain_s))
    return eng


@pytest.mark.parametrize("loop", ["device", "host"])
@pytest.mark.parametrize("plain_s,draft_s,drafts_every_step", [(1e-3, 0.0, False),
                                                                (1e3, 0.0, True)])
def test_production_drafts_only_when_the_plain_step_is_slower(target, plain_s, draft_s,
                                                              drafts_every_step, loop):
    """A plain step 1000x faster than a verification: production drafts only to explore (once
    per ``explore_every`` steps); 1000x slower: it drafts on every step where a draft fits (not
    where every active request has one token left: at most one such step per request). Greedy
    output equals plain greedy decoding either way. Both loops run the plain step at budget 0
    and score it with ``plain_s``; on the host loop its steps' stats say which kind ran."""
    eng = _production(target, plain_s, draft_s, loop)
    rng = np.random.default_rng(0)
    reqs = [Request(prompt=rng.integers(0, CFG.vocab_size, size=5).tolist(), max_new_tokens=12)
            for _ in range(6)]
    results = eng.generate(reqs)
    for req, res in zip(reqs, results):
        assert res.tokens == _greedy_reference(target, req)[0]
    if loop == "host":
        steps, draft_steps, calls = len(eng.stats), sum(s.drafted for s in eng.stats), 0
        plain = [s for s in eng.stats if not s.drafted]
        assert all(s.bucket == eng.config.num_slots and s.drafts_verified == 0 for s in plain)
    else:
        steps = sum(s.steps for s in eng.loop_stats)
        draft_steps = sum(s.draft_steps for s in eng.loop_stats)
        calls = len(eng.loop_stats)
    if drafts_every_step:
        assert steps - len(reqs) <= draft_steps <= steps, (draft_steps, steps)
    else:
        every = eng.config.scheduler.explore_every
        assert 0 < draft_steps <= steps // every + 1 + calls, (draft_steps, steps)


def test_production_exploration_backs_off_while_it_never_pays(target):
    """With a plain step 1000x faster than any verification the budget search never drafts; after
    the fresh engine's first step (which drafts to see confidences) the exploring steps come after
    16, 32, 64, 128, 256, 256, ... steps without drafting (cumulative 1, 17, 49, 113, 241, 497,
    ...), not every 16 steps. An exploring step that finds no room for a draft (every request on
    its last token) is retried on the next step, hence the slack."""
    from specjax.engine.device_loop import EXPLORE_BACKOFF
    eng = _production(target, 1e-3, 0.0)
    every = eng.config.scheduler.explore_every
    rng = np.random.default_rng(1)
    reqs = [Request(prompt=rng.integers(0, CFG.vocab_size, size=5).tolist(), max_new_tokens=20)
            for _ in range(60)]
    eng.generate(reqs)
    # the plain steps run as an inner loop of the device loop: it too stops at loop_steps
    assert max(s.steps for s in eng.loop_stats) == eng.config.loop_steps
    steps = sum(s.steps for s in eng.loop_stats)
    draft_steps = sum(s.draft_steps for s in eng.loop_stats)
    marks, t, gap = [1], 1, every
    while t <= steps:
        t += gap
        marks.append(t)
        gap = min(2 * gap, EXPLORE_BACKOFF * every)
    due = lambda n: sum(m <= n for m in marks)  # noqa: E731
    assert steps > 240, steps
    assert due(steps - 20) <= draft_steps <= due(steps), (draft_steps, steps, marks)
    assert draft_steps < steps // every - 5  # far fewer than a fixed interval would take


@pytest.mark.parametrize("loop", ["device", "host"])
def test_a_fresh_production_engine_drafts_once_to_see_confidences(target, loop):
    """Before any drafts were drawn the stale confidences are a 0.5 guess; a fresh engine's first
    step drafts to measure them instead of decoding ``explore_every`` plain steps on the guess.
    Then, with drafting 1000x dearer than a verification (on the device loop, also a plain step
    1000x faster), no step drafts again within two 12-token requests (the next exploration is
    due after 64 plain steps): only the first step of the engine's life is such a step. Greedy
    output equals plain greedy decoding."""
    eng = _production(target, 1e-3, 1e3, loop, explore_every=64)
    req = Request(prompt=[3, 1, 4, 1, 5], max_new_tokens=12)
    ref = _greedy_reference(target, req)[0]

    def drafting_flags():
        if loop == "host":
            return [s.drafted for s in eng.stats]
        return [s.draft_steps for s in eng.loop_stats]

    assert eng.generate([req])[0].tokens == ref
    first = drafting_flags()
    assert first[0] == 1 and sum(first) == 1, first  # the first step (device: first call) only
    assert eng.generate([req])[0].tokens == ref
    assert sum(drafting_flags()) == 1, drafting_flags()


@pytest.mark.parametrize("policy", ["dspark", "production"])
def test_device_loop_profile_is_measured_and_cached(target, tmp_path, policy):
    """warmup() of a device-loop engine with a confidence policy measures its profile, saves it
    under a key naming how it was measured and reuses it. Algorithm 1: pieces timed in loops
    (every bucket, the draft and the plain step > 0 s). Production: its own loop forced into each
    choice (whole drafting steps, so draft_s = 0; the forcing checks its own drafting counts),
    and the engine is left idle and serves exactly afterwards."""
    d, p, f = _drafter("dspark", target)
    path = str(tmp_path / "sps.json")
    cfg = EngineConfig(num_slots=2, max_len=32, gamma=3, prefill_buckets=(8,), loop="device",
                       scheduler=SchedulerConfig(policy), sps_cache=path, profile_reps=1)
    eng = Engine(target, d, p, f, cfg)
    eng.warmup()
    prof = eng.sps
    how = "production-loop" if policy == "production" else "device-loop"
    assert prof.key.endswith(f"/{how}/ctx8") and len(prof.steps_per_s) == len(eng.buckets)
    assert all(v > 0 for v in prof.steps_per_s) and prof.plain_s > 0
    if policy == "production":
        assert prof.draft_s == 0  # (which choice is faster is a timing: not asserted here)
        req = Request(prompt=[3, 1, 4, 1, 5], max_new_tokens=8)
        assert eng.generate([req])[0].tokens == _greedy_reference(target, req)[0]
    else:
        assert prof.draft_s > 0
    assert SPSProfile.load(path) == prof
    again = Engine(target, d, p, f, cfg)
    again.warmup()
    assert again.sps == prof  # loaded, not re-measured (timings never repeat exactly)


def test_profiled_steps_are_not_folded_or_dead_code(target):
    """Each step the profile times keeps its work inside the timing loop: the loop program's flops
    are at least half of the same step compiled alone with all its outputs returned. (A draft
    whose tokens nobody reads, or a verification of compile-time constants, compiled to a few
    flops and made drafting look free.)"""
    from specjax.engine.step_costs import loop_program, profile_steps
    d, p, f = _drafter("dspark", target)
    eng = Engine(target, d, p, f, EngineConfig(num_slots=2, max_len=32, gamma=3,
                                               prefill_buckets=(8,), loop="device",
                                               scheduler=SchedulerConfig("fixed", k=3)))
    eng.warmup(profile=False)
    fns, carries = profile_steps(eng, context=8)
    assert set(fns) == {f"verify/{b}" for b in eng.buckets} | {"draft", "plain"}

    def flops(compiled):
        c = compiled.cost_analysis()
        return float((c[0] if isinstance(c, (list, tuple)) else c).get("flops", 0.0))

    for name in ("draft", "plain", f"verify/{eng.buckets[-1]}"):
        fn = fns[name]
        alone = flops(jax.jit(lambda c, fn=fn: fn(0, c)).lower(carries[name]).compile())
        looped = flops(loop_program(fn, 4).lower(carries[name]).compile())
        assert alone > 1e4, (name, alone)  # a forward of the test model, not a no-op
        assert looped >= 0.5 * alone, (name, looped, alone)


@pytest.mark.parametrize("loop", ["device", "host"])
def test_an_exploring_step_drafts_across_a_bucket_cliff(target, loop):
    """Exploration must draft even where the verification profile alone never favours drafts: 4
    busy slots fill bucket 4 with their anchors, and any draft moves the step to bucket 8, 100x
    slower. The budget search then never drafts (not even without the drafting cost), but every
    ``explore_every`` steps without drafting an exploring step still drafts, on either loop, so
    the stale confidences can turn drafting back on."""
    d, p, f = _drafter("dspark", target)
    cfg = EngineConfig(num_slots=4, max_len=48, gamma=3, prefill_buckets=(8,), loop=loop,
                       scheduler=SchedulerConfig("production", explore_every=4))
    eng = Engine(target, d, p, f, cfg)
    eng.warmup(profile=False)
    assert eng.buckets == [4, 8, 16]
    eng.set_sps(SPSProfile((4, 8, 16), (1.0, 0.01, 0.01), plain_s=1.0))
    for batch in range(2):  # two rounds of 4 requests that run together
        reqs = [Request(prompt=[3, 1, 4, 4 * batch + i], max_new_tokens=16) for i in range(4)]
        for req, res in zip(reqs, eng.generate(reqs)):
            assert res.tokens == _greedy_reference(target, req)[0]
    if loop == "host":
        steps, draft_steps = len(eng.stats), sum(s.drafted for s in eng.stats)
    else:
        steps = sum(s.steps for s in eng.loop_stats)
        draft_steps = sum(s.draft_steps for s in eng.loop_stats)
    # the first step, then one in 4 (the device loop backs off: after 4, then 8 more steps)
    assert steps >= 20 and draft_steps >= 3, (draft_steps, steps)
    assert draft_steps <= 1 + steps // 4, (draft_steps, steps)
