"""Policy "none" (plain decoding on the engine) never touches the drafter: admission skips the
drafter's prefill and the target's hidden states (``feeds_drafter``), and row-bucket calls pass
the drafter state through without gathering it. Checked on the state itself (bit for bit, with a
drafting policy as the control that does change it), on greedy tokens and on the sampled
distribution (chi-square at the 1e-6 level)."""
import jax
import numpy as np
import pytest
# target, sampling_target: test_engine's fixtures (the same tiny models)
from test_engine import (_assert_first_tokens_follow_target, _assert_greedy, _drafter,  # noqa: F401
                         _requests, _run_mixed, sampling_target, target)

from specjax.engine import Engine, EngineConfig, Request
from specjax.scheduling import SchedulerConfig


def _leaves(tree):
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


@pytest.mark.parametrize("loop,row_buckets", [("device", ()), ("device", "auto"), ("host", ())])
def test_none_leaves_the_drafter_state_as_it_was(target, loop, row_buckets):
    """An MTP head (its state: per-layer KV buffers and the target's hidden states) after mixed
    load under "none" is the initial state bit for bit; the tokens are plain greedy's. The same
    requests under fixed K change it (so the comparison can fail), on the device loop (all-slot
    and row-bucket calls) and on the host loop (its dense plain step)."""
    d, p, f = _drafter("mtp", target)
    changed = {}
    for policy in ("none", "fixed"):
        engine = Engine(target, d, p, f, EngineConfig(
            num_slots=4, max_len=40, gamma=3, prefill_buckets=(8,), loop=loop, loop_steps=3,
            row_buckets=row_buckets, scheduler=SchedulerConfig(policy, k=3)))
        assert engine.feeds_drafter == (policy != "none")
        engine.warmup(profile=False)
        before = _leaves(engine.state.drafter_state)
        rng = np.random.default_rng(3)
        reqs = _requests(rng, 8, stop=True)
        _assert_greedy(target, reqs, _run_mixed(engine, reqs, rng), (loop, policy))
        after = _leaves(engine.state.drafter_state)
        changed[policy] = any(not np.array_equal(a, b) for a, b in zip(before, after))
    assert changed == {"none": False, "fixed": True}


@pytest.mark.parametrize("loop", ["device", "host"])
def test_none_with_row_buckets_samples_from_the_target(sampling_target, loop):
    """Temperature 1, 4 slots, 1800 seeds of one prompt served in batches of 1, 2 and 3, so that
    device-loop calls and admissions run on row buckets of 1 and 2 rows (drafter state passed
    through whole) as well as all 4, and the host loop runs its dense plain step with 1-3 of
    its 4 slots active: the first three tokens follow the target's exact distribution."""
    d, p, f = _drafter("mtp", sampling_target)
    engine = Engine(sampling_target, d, p, f, EngineConfig(
        num_slots=4, max_len=24, gamma=3, prefill_buckets=(8,), loop_steps=2, loop=loop,
        row_buckets="auto" if loop == "device" else (), filters=False,
        scheduler=SchedulerConfig("none")))
    engine.warmup(profile=False)
    prompt = [3, 7, 1]
    seeds = iter(range(1800))
    toks = []
    for size in [1, 2, 3] * 300:
        batch = [Request(prompt=prompt, max_new_tokens=3, temperature=1.0, seed=next(seeds))
                 for _ in range(size)]
        toks += [r.tokens for r in engine.generate(batch)]
    stats = engine.loop_stats if loop == "device" else engine.stats
    assert {s.active for s in stats} == {1, 2, 3}
    _assert_first_tokens_follow_target(sampling_target, prompt, np.array(toks))
