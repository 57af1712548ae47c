"""Serving engine: greedy equivalence under mixed load, losslessness at temperature 1, the
Appendix A bias caught by the same check, request handling, and no compilation after warm-up."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from _shared_once import count_compiles, count_graphdef_hashes
from scipy import stats

from specjax.buckets import SPSProfile
from specjax.drafters import (DraftLMDrafter, DraftOutput, DSparkConfig, DSparkDrafter,
                              MTPConfig, MTPDrafter, NGramDrafter, dflash_config, shared_head)
from specjax.drafters.base import draw
from specjax.engine import Engine, EngineConfig, Request
from specjax.models import ModelConfig, init_model
from specjax.models.config import ModelConfig as _MC
from specjax.models.generate import generate
from specjax.models.kv_cache import NewKV
from specjax.models.transformer import ForwardOutput
from specjax.scheduling import SchedulerConfig

pytestmark = pytest.mark.xdist_group("engine")

V = 16
CFG = ModelConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                  num_kv_heads=2, head_dim=8)
CRIT = lambda df: stats.chi2.isf(1e-6, df)  # noqa: E731


def _scaled_target(scale: float):
    """The tests' tiny model (seed 1) with its tied embedding scaled by ``scale``: random init
    logits are nearly flat, and the scale sets how peaked the next-token distributions are."""
    model = init_model(CFG, seed=1)
    model.embed[...] = model.embed[...] * scale
    return model


@pytest.fixture(scope="module")
def target():
    """The greedy tests' target: scaled until each next token is nearly certain (no near-ties
    for argmax to flip on)."""
    return _scaled_target(25.0)


# The temperature-1 tests' target: the same weights with the embedding scaled by 5. After the
# tests' prompt [3, 7, 1] the first token carries 1.4 nats (most likely 0.69), the joint of the
# first two 2.9 nats and the third token's marginal 2.4 nats: sampling at temperature 0.8 instead
# of 1 would put the expected chi-square statistics of :func:`_assert_first_tokens_follow_target`
# (3000 samples) at about 7x (joint) and 15x (marginal) their 1e-6 critical values, 0.04x at the
# greedy target's scale, where every token is nearly certain (under 1e-4 nats)
# (test_the_temperature1_checks_would_see_a_tempered_sampler).
SAMPLING_SCALE = 5.0


@pytest.fixture(scope="module")
def sampling_target():
    return _scaled_target(SAMPLING_SCALE)


def _drafter(kind, target):
    if kind == "ngram":
        return NGramDrafter(V), None, None
    if kind == "draft_lm":
        d, p = DraftLMDrafter.create(CFG.replace(num_layers=1), seed=5)
        return d, p, None
    if kind == "mtp":
        d, p = MTPDrafter.create(CFG, MTPConfig(), seed=3)
        return d, p, shared_head(target)
    cfg = {"dspark": DSparkConfig(rank=8), "dspark_rnn": DSparkConfig(head="rnn", rank=8),
           "dflash": dflash_config()}[kind]
    d, p = DSparkDrafter.create(CFG, cfg, seed=4)
    return d, p, shared_head(target)


def _requests(rng, n, *, temperature=0.0, stop=False):
    out = []
    for _ in range(n):
        prompt = rng.integers(0, V, size=int(rng.integers(2, 11))).tolist()
        stop_tokens = tuple(int(t) for t in rng.choice(V, size=2, replace=False)) if stop else ()
        out.append(Request(prompt=prompt, max_new_tokens=int(rng.integers(1, 14)),
                           stop_tokens=stop_tokens, temperature=temperature,
                           seed=int(rng.integers(1 << 30))))
    return out


# Greedy references decode a fixed REF_NEW tokens into a fixed REF_LEN-position cache and keep the
# request's prefix (greedy decoding is prefix-consistent). One shape for every request: the
# references compile twice per target (prompt pads 8 and 16), not once per (prompt length,
# max_new_tokens) pair, which had cost most of the mixed-load tests' time.
REF_NEW, REF_LEN = 16, 32
_REFS: dict = {}


def _greedy_reference(target, req):
    assert len(req.prompt) + req.max_new_tokens <= REF_LEN and req.max_new_tokens <= REF_NEW
    key = (id(target), tuple(req.prompt))
    if key not in _REFS:
        _REFS[key] = generate(target, [req.prompt], REF_NEW, temperature=0.0, max_len=REF_LEN)[0]
    toks = _REFS[key][:req.max_new_tokens]
    for i, t in enumerate(toks):
        if t in req.stop_tokens:
            return toks[:i + 1], "stop"
    return toks, "length"


def _assert_greedy(target, requests, results, label):
    """Each result's tokens and finish reason are plain greedy decoding's."""
    for req, res in zip(requests, results):
        ref, reason = _greedy_reference(target, req)
        assert res.tokens == ref, (label, req)
        assert res.finish_reason == reason, (label, req)


def _run_mixed(engine, requests, rng):
    """Submits requests in waves while others run (arrivals during decoding)."""
    ids, pending = [], list(requests)
    while pending or engine.has_work():
        for _ in range(int(rng.integers(0, 3))):
            if pending:
                ids.append(engine.submit(pending.pop(0)))
        if engine.has_work():
            engine.step()
    return [engine.finished[i] for i in ids]


# Every drafter with its policies (one engine per drafter: the compiled steps are shared).
GREEDY_CASES = {"ngram": ("fixed", "none"), "draft_lm": ("mtp1",), "mtp": ("fixed",),
                "dflash": ("fixed",), "dspark": ("dspark", "production", "threshold"),
                "dspark_rnn": ("dspark",)}


# Every drafter on the device loop (the default). The host loop's own code is drafter-agnostic
# except its numpy policies and its overlap merges: it runs the drafters that exercise the
# policies, dspark (every confidence policy) and ngram (fixed K and "none"); the merges are checked
# for every drafter's state layout by test_merge_rows_takes_each_slot_from_its_source.
GREEDY_LOOPS = ([(k, "device") for k in sorted(GREEDY_CASES)]
                + [("dspark", "host"), ("ngram", "host")])


@pytest.mark.parametrize("kind,loop", GREEDY_LOOPS)
def test_temperature0_equals_greedy_decoding_under_mixed_load(target, kind, loop):
    d, p, f = _drafter(kind, target)
    for policy in GREEDY_CASES[kind]:
        # One verification bucket and one prefill chunk (prompts up to 10 tokens are fed in
        # chunks of 8) keep compilation to a minimum. A per-token cost curve (as if every B had
        # its own bucket) makes the confidence policies choose varied lengths.
        cfg = EngineConfig(num_slots=3, max_len=40, gamma=3, token_buckets=(12,),
                           prefill_buckets=(8,), loop=loop, loop_steps=4,
                           scheduler=SchedulerConfig(policy, k=3, threshold=0.3))
        engine = Engine(target, d, p, f, cfg)
        engine.warmup(profile=False)
        engine.sps_table = 1.0 / (1.0 + 0.3 * np.arange(13))
        rng = np.random.default_rng(len(kind) * 100 + len(policy))
        reqs = _requests(rng, 8, stop=True)
        _assert_greedy(target, reqs, _run_mixed(engine, reqs, rng), (kind, policy))


@pytest.mark.parametrize("loop", ["device", "host"])
def test_prefill_plan_feeds_prompts_in_planned_chunks_without_changing_tokens(target, loop):
    """Admission feeds prompts in the chunks :func:`specjax.buckets.plan_chunks` plans for the
    longest prompt admitted: with buckets (2, 8), 10 tokens go in as 8 + 2 (not 8 + 8) and 5 as
    2 + 2 + 2 (not 8). Greedy outputs equal plain greedy decoding, so every chunk wrote the cache
    and the drafter's state as one call would have."""
    d, p, f = _drafter("mtp", target)
    cfg = EngineConfig(num_slots=3, max_len=40, gamma=3, token_buckets=(12,),
                       prefill_buckets=(2, 8), loop=loop, loop_steps=4,
                       scheduler=SchedulerConfig("fixed", k=3))
    engine = Engine(target, d, p, f, cfg)
    engine.warmup(profile=False)
    rng = np.random.default_rng(11)
    first = [Request(prompt=rng.integers(0, V, n).tolist(), max_new_tokens=6, seed=n)
             for n in (10, 5, 3)]  # admitted together: the plan of the 10-token prompt
    ids = [engine.submit(r) for r in first]
    engine.step()
    assert (engine.prefill_calls, engine.prefill_positions) == (2, 10)
    engine.run()
    alone = Request(prompt=rng.integers(0, V, 5).tolist(), max_new_tokens=6, seed=5)
    ids.append(engine.submit(alone))
    engine.run()
    assert (engine.prefill_calls, engine.prefill_positions) == (5, 16)
    for req, rid in zip(first + [alone], ids):
        ref, _ = _greedy_reference(target, req)
        assert engine.finished[rid].tokens == ref, req
    reqs = _requests(rng, 8, stop=True)  # arrivals while others decode
    for req, res in zip(reqs, _run_mixed(engine, reqs, rng)):
        ref, reason = _greedy_reference(target, req)
        assert res.tokens == ref and res.finish_reason == reason, req


@pytest.mark.parametrize("kind", sorted(GREEDY_CASES))
def test_merge_rows_takes_each_slot_from_its_source(target, kind):
    """The host loop's overlap merges admitted slots' drafter rows (``merge_rows``) into the
    pre-dispatched state. For every drafter's state layout, drafting from the merged state gives,
    slot by slot, exactly what drafting from that slot's source state gives (rows never mix)."""
    from specjax.drafters.base import Observation, Sampling
    from specjax.engine.steps import merge_rows
    d, p, f = _drafter(kind, target)
    s, max_len, g, t = 3, 40, 3, 8

    def prefilled(seed):
        toks = jnp.asarray(np.random.default_rng(seed).integers(0, V, (s, t)), jnp.int32)
        out = target(toks, hidden_layers=d.hidden_layers)
        obs = Observation(tokens=toks, num_valid=jnp.full((s,), t, jnp.int32),
                          start=jnp.zeros((s,), jnp.int32),
                          next_token=jnp.argmax(out.logits[:, -1], -1).astype(jnp.int32),
                          hidden=out.hidden)
        return d.prefill(p, f, d.init_state(s, max_len, g), obs)

    def draft(state):
        out, _ = d.propose(p, f, state, jax.random.key(0), gamma=g, sampling=Sampling(0.0),
                           argmax=True)
        return np.asarray(out.tokens), np.asarray(out.probs)

    old, new = prefilled(1), prefilled(2)
    mask = np.array([True, False, True])
    merged = merge_rows(d, jnp.asarray(mask), new, old, max_len=max_len, gamma=g)
    (t_old, q_old), (t_new, q_new), (t_mrg, q_mrg) = draft(old), draft(new), draft(merged)
    assert not np.array_equal(t_old, t_new) or not np.array_equal(q_old, q_new)  # sources differ
    # Same program, same inputs per row: each row is reproduced bit for bit.
    np.testing.assert_array_equal(t_mrg, np.where(mask[:, None], t_new, t_old))
    np.testing.assert_array_equal(q_mrg, np.where(mask[:, None, None], q_new, q_old))


_EXACT: dict = {}


def _exact_first_tokens(target, prompt):
    """Exact joint P(t1, t2) and marginal P(t3) of the target alone at temperature 1 (computed
    once per target and prompt: the scheduler tests share them)."""
    key = (id(target), tuple(prompt))
    if key not in _EXACT:
        _EXACT[key] = _exact_first_tokens_uncached(target, prompt)
    return _EXACT[key]


def _exact_first_tokens_uncached(target, prompt, temperature: float = 1.0):
    gd, st = nnx.split(target)
    fwd = jax.jit(lambda toks: nnx.merge(gd, st)(toks).logits[:, -1] / temperature)
    p1 = np.asarray(jax.nn.softmax(fwd(jnp.asarray([prompt]))[0]), np.float64)
    ctx2 = jnp.asarray([prompt + [a] for a in range(V)])
    p2 = np.asarray(jax.nn.softmax(fwd(ctx2), axis=-1), np.float64)  # [t1, t2]
    ctx3 = jnp.asarray([prompt + [a, b] for a in range(V) for b in range(V)])
    p3 = np.asarray(jax.nn.softmax(fwd(ctx3), axis=-1), np.float64).reshape(V, V, V)
    joint12 = p1[:, None] * p2
    marg3 = np.einsum("ab,abc->c", joint12, p3)
    return joint12, marg3


def _entropy(p):
    p = np.ravel(p)
    p = p[p > 0]
    return float(-np.sum(p * np.log(p)))


def _assert_first_tokens_follow_target(target, prompt, toks):
    """Chi-square at the 1e-6 level: the first two tokens of ``toks`` (int ``[n, >= 3]``, n
    samples after ``prompt``) follow the target's exact joint, the third its exact marginal.

    The target must spread its probability (≥ 1 nat per distribution): over a nearly
    deterministic one any sampler that returns the most likely token passes."""
    joint12, marg3 = _exact_first_tokens(target, prompt)
    assert _entropy(joint12) >= 1.0 and _entropy(marg3) >= 1.0, \
        ("the test has no power on this target", _entropy(joint12), _entropy(marg3))
    c12 = np.zeros((V, V))
    np.add.at(c12, (toks[:, 0], toks[:, 1]), 1)
    stat, df = _chi2(c12, joint12)
    assert stat < CRIT(df), (stat, df)
    stat, df = _chi2(np.bincount(toks[:, 2], minlength=V), marg3)
    assert stat < CRIT(df), (stat, df)


def _chi2(counts, probs):
    """Pearson statistic with bins of expected count < 5 pooled; returns (stat, df)."""
    counts, probs = np.ravel(counts).astype(float), np.ravel(probs)
    exp = probs * counts.sum()
    small = exp < 5
    c = np.append(counts[~small], counts[small].sum())
    e = np.append(exp[~small], exp[small].sum())
    keep = e > 0
    c, e = c[keep], e[keep]
    return float(np.sum((c - e) ** 2 / e)), len(c) - 1


def _expected_statistic(counts_probs, true_probs, n):
    """The mean of :func:`_chi2`'s statistic for ``n`` samples drawn from ``true_probs`` and
    tested against ``counts_probs`` (bins pooled as :func:`_chi2` pools them): df + the
    noncentrality ``n Σ (q - p)² / p``. Returns ``(mean, df)``."""
    p, q = np.ravel(counts_probs), np.ravel(true_probs)
    small = p * n < 5
    p = np.append(p[~small], p[small].sum())
    q = np.append(q[~small], q[small].sum())
    keep = p > 0
    p, q = p[keep], q[keep]
    df = len(p) - 1
    return df + n * float(np.sum((q - p) ** 2 / p)), df


def test_the_temperature1_checks_would_see_a_tempered_sampler(target, sampling_target):
    """The power of :func:`_assert_first_tokens_follow_target` at the scheduler tests' 3000
    samples: a sampler at temperature 0.8 instead of 1 puts the mean statistic at over 4x (the
    first two tokens' joint) and over 10x (the third's marginal) the 1e-6 critical value on
    ``sampling_target``; on the greedy tests' ``target`` it stays under it (no power there)."""
    prompt, n = [3, 7, 1], 3000
    for model, seen in ((sampling_target, True), (target, False)):
        exact = _exact_first_tokens_uncached(model, prompt)
        biased = _exact_first_tokens_uncached(model, prompt, temperature=0.8)
        ratios = []
        for p, q in zip(exact, biased):
            mean, df = _expected_statistic(p, q, n)
            ratios.append(mean / CRIT(df))
        if seen:
            assert ratios[0] > 4 and ratios[1] > 10, ratios
        else:
            assert max(ratios) < 1, ratios


@pytest.mark.parametrize("policy,draft_s,loop,calibrate", [("dspark", 0.0, "device", False),
                                                           ("dspark", 0.0, "device", True),
                                                           ("production", 0.15, "device", False),
                                                           ("production", 0.15, "device", True),
                                                           ("dspark", 0.0, "host", False),
                                                           ("production", 0.15, "host", False)])
def test_temperature1_engine_with_scheduler_is_lossless(sampling_target, policy, draft_s, loop,
                                                        calibrate):
    """Many seeds of one prompt share 4 slots and compete for the verification budget.

    Buckets 4 / 8 / 16 with SPS 1.0 / 0.9 / 0.5: a full batch of 4 anchors can add at most 4 of
    its 12 drafts (the cliff to 16 never pays), so requests' drafts are admitted by rank against
    each other, and crossing into bucket 8 needs a confident first draft. With a drafting cost
    (``draft_s``) the production budget is sometimes 0 and those steps skip drafting entirely:
    whether a step drafts at all is decided from stale confidences too. ``calibrate``: the
    policies read confidences calibrated online on the verifier's past decisions. Prefill
    buckets (2, 8) feed the 3-token prompt in two chunks (2 + 2,
    :func:`specjax.buckets.plan_chunks`), so chunked prefill is under the same test.
    """
    d, p, f = _drafter("dspark", sampling_target)
    cfg = EngineConfig(num_slots=4, max_len=24, gamma=3, prefill_buckets=(2, 8),
                       scheduler=SchedulerConfig(policy), overlap=True, filters=False, loop=loop,
                       online_calibration=calibrate)
    engine = Engine(sampling_target, d, p, f, cfg)
    engine.warmup(profile=False)
    assert engine.buckets == [4, 8, 16]
    engine.set_sps(SPSProfile((4, 8, 16), (1.0, 0.9, 0.5), draft_s=draft_s))
    prompt = [3, 7, 1]
    n = 3000
    results = engine.generate([Request(prompt=prompt, max_new_tokens=4, temperature=1.0, seed=s)
                               for s in range(n)])
    assert engine.prefill_positions == 2 * engine.prefill_calls  # every prompt fed as 2 + 2
    toks = np.array([r.tokens[:3] for r in results])
    verified = np.array([r.accepted for r in results])
    assert verified.sum() > 0.2 * n  # drafts were really verified and accepted
    if draft_s and loop == "device":  # both kinds of steps really happened
        draft_steps = sum(s.draft_steps for s in engine.loop_stats)
        assert 0 < draft_steps < sum(s.steps for s in engine.loop_stats)
    if draft_s and loop == "host":
        drafted = [s.drafted for s in engine.stats]
        assert 0 < sum(drafted) < len(drafted), np.mean(drafted)
        # never more than explore_every - 1 steps in a row without drafting
        gaps = np.diff(np.flatnonzero(drafted))
        assert gaps.max() <= cfg.scheduler.explore_every, gaps.max()
    if calibrate:  # the calibration saw verified drafts and moved the confidences
        rho, _, pred = engine.calibration_state()
        assert float(np.sum(pred)) > 10 and np.all(np.abs(rho - 1) > 1e-3), rho
    _assert_first_tokens_follow_target(sampling_target, prompt, toks)


# ---- DSpark Appendix A at the engine level ---------------------------------------------------


class ConstTarget(nnx.Module):
    """A "target" whose next-token distribution is (0.7, 0.3) everywhere (V = 2)."""

    def __init__(self):
        self.config = _MC(vocab_size=2, hidden_size=8, intermediate_size=8, num_layers=1,
                          num_heads=1, num_kv_heads=1, head_dim=8)
        self.logits = nnx.Param(jnp.log(jnp.asarray([0.7, 0.3])))

    def __call__(self, tokens, *, cache=None, num_valid=None, hidden_layers=(), logits_at=None):
        b, t = tokens.shape
        logits = jnp.broadcast_to(self.logits[...], (b, t if logits_at is None else 1, 2))
        cache = cache.replace(lengths=cache.lengths + num_valid)
        return ForwardOutput(logits=logits, cache=cache, hidden=None)

    def forward_flat_kv(self, tokens, segment_ids, cache, *, grid_len, hidden_layers=()):
        n = tokens.shape[0]
        nothing = jnp.zeros((1, n, 1, 8))  # no keys to keep: every entry is dropped on write
        kv = NewKV(k=nothing, v=nothing, slots=jnp.zeros((n,), jnp.int32),
                   positions=jnp.full((n,), cache.max_len, jnp.int32))
        return ForwardOutput(logits=jnp.broadcast_to(self.logits[...], (n, 2)), cache=None,
                             hidden=None), kv

    def forward_flat(self, tokens, segment_ids, cache, *, grid_len, hidden_layers=()):
        out, _ = self.forward_flat_kv(tokens, segment_ids, cache, grid_len=grid_len)
        return out._replace(cache=cache)


@dataclasses.dataclass(frozen=True)
class AppendixADrafter:
    """q = (0.5, 0.5); c_1 = 0.8; c_2 = 0.9 if x_1 = A (token 0) else 0 (DSpark Appendix A)."""

    hidden_layers: tuple = ()
    has_confidence: bool = True

    def init_state(self, batch, max_len, gamma, max_verify=None):
        return jnp.zeros((batch,), jnp.int32)

    def prefill(self, params, frozen, state, obs):
        return state

    commit = prefill

    def propose(self, params, frozen, state, key, *, gamma, sampling, argmax=False):
        b = state.shape[0]
        keys = jax.random.split(key, gamma)
        logits = jnp.zeros((b, 2))
        xs, qs = zip(*[draw(keys[k], logits, sampling, argmax) for k in range(gamma)])
        tokens = jnp.stack(xs, axis=1)
        c2 = jnp.where(tokens[:, 0] == 0, 0.9, 0.0)
        conf = jnp.stack([jnp.full((b,), 0.8), c2] + [jnp.zeros((b,))] * (gamma - 2), axis=1)
        return DraftOutput(tokens, jnp.stack(qs, axis=1), conf), state


def _appendix_a_counts(policy, n, loop):
    engine = Engine(ConstTarget(), AppendixADrafter(), None, None,
                    EngineConfig(num_slots=1, max_len=16, gamma=2, token_buckets=(1, 2, 3),
                                 prefill_buckets=(1,), scheduler=SchedulerConfig(policy),
                                 filters=False, overlap=False, loop=loop))
    engine.warmup(profile=False)
    engine.set_sps(SPSProfile((1, 2, 3), (1.0, 0.5, 0.45)))
    res = engine.generate([Request(prompt=[0], max_new_tokens=4, temperature=1.0, seed=s)
                           for s in range(n)])
    # Token 0 comes from the prefill (the target alone); token 1 is the first verified one.
    return np.bincount([r.tokens[1] for r in res], minlength=2)


@pytest.mark.parametrize("loop", ["device", "host"])
def test_appendix_a_engine_check_catches_retrospective_search(loop):
    n = 1500
    p = np.array([0.7, 0.3])
    exact = _appendix_a_counts("dspark", n, loop)
    biased = _appendix_a_counts("retrospective", n, loop)
    assert _chi2(exact, p)[0] < CRIT(1)
    assert _chi2(biased, p)[0] > CRIT(1)
    assert biased[0] / n == pytest.approx(0.85, abs=0.04)


# ---- request handling and compilation ---------------------------------------------------------


@pytest.mark.parametrize("loop", ["device", "host"])
def test_request_validation_cancel_and_queue(target, loop):
    d, p, f = _drafter("ngram", target)
    engine = Engine(target, d, p, f, EngineConfig(num_slots=2, max_len=24, gamma=2,
                                                  prefill_buckets=(8,), filters=False, loop=loop,
                                                  loop_steps=2, scheduler=SchedulerConfig("fixed")))
    with pytest.raises(ValueError, match="non-empty"):
        engine.submit(Request(prompt=[]))
    with pytest.raises(ValueError, match=r"\[0, 16\)"):
        engine.submit(Request(prompt=[99]))
    with pytest.raises(ValueError, match="max_len"):
        engine.submit(Request(prompt=[1] * 10, max_new_tokens=20))
    with pytest.raises(ValueError, match="filters"):
        engine.submit(Request(prompt=[1], max_new_tokens=4, top_k=3))
    with pytest.raises(ValueError, match="confidence head"):
        Engine(target, d, p, f, EngineConfig(scheduler=SchedulerConfig("dspark")))
    ids = [engine.submit(Request(prompt=[1, 2], max_new_tokens=10, temperature=0.0))
           for _ in range(4)]
    engine.step()
    assert engine.num_active == 2 and len(engine.queue) == 2  # the queue holds the rest
    for live_id in (ids[0], ids[2]):  # a running and a queued request's id cannot be reused
        with pytest.raises(ValueError, match="duplicate"):
            engine.submit(Request(prompt=[1], max_new_tokens=4, request_id=live_id))
    assert engine.cancel(ids[0]) and engine.cancel(ids[3])
    assert engine.num_active == 1 and len(engine.queue) == 1
    engine.run()
    assert engine.finished[ids[0]].finish_reason == "cancelled"
    assert engine.finished[ids[3]].finish_reason == "cancelled"
    assert engine.finished[ids[1]].tokens == engine.finished[ids[2]].tokens
    assert len(engine.finished[ids[1]].tokens) == 10
    with pytest.raises(ValueError, match="duplicate"):
        engine.submit(Request(prompt=[1], max_new_tokens=4, request_id=ids[1]))


@pytest.mark.parametrize("policy,loop", [("dspark", "host"), ("none", "host"),
                                         ("production", "device"), ("production", "host"),
                                         ("none", "device")])
def test_no_compilation_after_warmup(target, policy, loop):
    """≥ 200 steps with arrivals, departures and changing concurrency compile nothing (with
    overlap on, so admissions merge pre-dispatched drafter rows; "none" runs its plain step, and
    so does production on the host loop at budget 0).

    The jit caches are cleared first: steps compiled by earlier tests (e.g. with committed
    inputs that this engine's warm-up would not have produced) must not hide a compile."""
    jax.clear_caches()
    d, p, f = _drafter("dspark", target)
    # Weights committed to a device, as a restored checkpoint's are.
    dev = jax.devices()[0]
    graphdef, state = nnx.split(target)
    committed = (graphdef, jax.device_put(state, dev))
    p, f = jax.device_put(p, dev), jax.device_put(f, dev)
    engine = Engine(committed, d, p, f, EngineConfig(num_slots=4, max_len=40, gamma=3,
                                                  prefill_buckets=(4, 8), overlap=True,
                                                  loop=loop, loop_steps=3,
                                                  scheduler=SchedulerConfig(policy)))
    engine.warmup(profile=True)  # the profiling path runs too, but its timings are this CPU's:
    # a flat profile (verification costs the same at every bucket) makes the schedulers draft
    # whenever a confidence is positive, so the buckets used do not depend on the machine.
    # Production on the host loop: a plain step 10^4x faster than any verification, so it drafts
    # only on its first step and to explore, and both of its kinds of steps run.
    plain_s = 1e-6 if (policy, loop) == ("production", "host") else 0.0
    if plain_s:  # warm-up timed that plain step (under its own key: older profiles lack it)
        assert engine.sps.plain_s > 0 and engine.sps.key.endswith("/host-plain")
    engine.set_sps(SPSProfile(tuple(engine.buckets), (100.0,) * len(engine.buckets),
                              plain_s=plain_s))
    with count_compiles() as compiles, count_graphdef_hashes() as hashed:
        rng = np.random.default_rng(0)
        steps = 0
        while steps < 200:
            for _ in range(int(rng.integers(0, 2)) if steps % 40 < 20 else 0):
                engine.submit(Request(prompt=rng.integers(0, V, size=int(rng.integers(2, 16))).tolist(),
                                      max_new_tokens=int(rng.integers(1, 20)),
                                      temperature=float(rng.choice([0.0, 1.0])),
                                      top_k=int(rng.integers(1, V)) if rng.random() < 0.3 else None,
                                      seed=steps))
            if engine.has_work():
                engine.step()
                steps += 1
            else:
                engine.submit(Request(prompt=[1, 2, 3], max_new_tokens=5))
    stats = engine.stats if loop == "host" else engine.loop_stats
    assert len({s.active for s in stats}) >= 3  # concurrency really changed
    if policy != "none" and loop == "host":  # "none": the dense plain step (its bucket: S)
        assert len({s.bucket for s in engine.stats}) >= 2
    if plain_s:
        assert 0 < sum(s.drafted for s in stats) < len(stats) // 4
    assert compiles == []
    # and the static graphdefs of the target and the drafter are not hashed again at each call
    # (specjax.models.graphdef): warm-up hashed them once
    assert hashed == []


@pytest.mark.parametrize("loop", ["device", "host"])
def test_failed_step_frees_slots_and_serving_continues(target, monkeypatch, loop):
    from specjax.engine import device_driver, host_loop

    d, p, f = _drafter("ngram", target)
    engine = Engine(target, d, p, f, EngineConfig(num_slots=2, max_len=24, gamma=2,
                                                  prefill_buckets=(8,), filters=False, loop=loop,
                                                  scheduler=SchedulerConfig("fixed")))
    ids = [engine.submit(Request(prompt=[1, 2], max_new_tokens=6, temperature=0.0))
           for _ in range(3)]
    engine_mod, name = (host_loop, "verify_step") if loop == "host" else \
        (device_driver, "run_loop")
    real = getattr(engine_mod, name)
    calls = {"n": 0}

    def flaky(*args, **kw):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("device lost")
        return real(*args, **kw)

    monkeypatch.setattr(engine_mod, name, flaky)
    with pytest.warns(UserWarning, match="device lost"):
        engine.run()
    reasons = [engine.finished[i].finish_reason for i in ids]
    assert reasons == ["error", "error", "length"]
    assert "device lost" in engine.finished[ids[0]].error
    ref, _ = _greedy_reference(target, Request(prompt=[1, 2], max_new_tokens=6))
    assert engine.finished[ids[2]].tokens == ref


@pytest.mark.parametrize("kind,policy", [("mtp", "fixed"), ("dspark", "fixed"),
                                         ("dspark", "production")])
def test_device_loop_never_copies_the_target_cache(target, kind, policy, monkeypatch):
    """The compiled device loop holds no copy as large as the whole layered target cache.

    The verification bucket switch once wrote the cache inside its branches, and XLA copied the
    whole cache in and out of the conditional on every step (k and v, several times). Now the
    branches only read it and the new keys/values are written after the switch."""
    import re
    import specjax.engine.device_driver as driver
    d, p, f = _drafter(kind, target)
    max_len, slots = 512, 2
    eng = Engine(target, d, p, f, EngineConfig(num_slots=slots, max_len=max_len, gamma=3,
                                               loop="device", prefill_buckets=(16,),
                                               scheduler=SchedulerConfig(policy, k=3)))
    captured = {}
    real = driver.run_loop

    def spy(*args, **kwargs):
        captured["call"] = (args, kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(driver, "run_loop", spy)
    eng.generate([Request(prompt=[1, 2, 3], max_new_tokens=4, temperature=1.0, seed=0)])
    args, kwargs = captured["call"]
    text = real.lower(*args, **kwargs).compile().as_text()
    whole = CFG.num_layers * slots * max_len * CFG.num_kv_heads * CFG.head_dim
    sizes = []
    for line in text.splitlines():
        if " copy(" in line or "copy-start" in line:
            shape = re.search(r"= \w+\[([\d,]*)\]", line)
            if shape and shape.group(1):
                sizes.append(int(np.prod([int(x) for x in shape.group(1).split(",")])))
    assert sizes, "the compiled loop has no copies at all: the parse is broken"
    assert max(sizes) < whole, (max(sizes), whole)
