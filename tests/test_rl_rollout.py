"""SpeculativeRollout (a Tunix rollout engine over the specjax engine) and the Tunix policy adapter.

* Exactness after a weight update: rollouts have the *updated* policy's distribution over whole
  3-token completions (chi-square at the 1e-6 level), with rejection sampling at T = 1 and under
  top-p, and with target-only verification; the same samples are far from the stale policy's
  distribution (the check can see stale weights). The same after an online drafter update.
* The exactness monitor (``exactness_gap``: mean of log p + H) stays within noise of 0 for those
  rollouts, and is far from 0 for samples of another policy (it can see a wrong sampler).
* update_params compiles nothing.
* The adapter's log-probs (Tunix's own ``compute_per_token_logps``) equal specjax's forward.
* Acceptance per draft position from step time stamps, metrics, knob refusal.
"""
import json
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from scipy import stats as sps

pytest.importorskip("tunix")

from tunix.rl import common as tunix_common  # noqa: E402
from tunix.rl.rollout.base_rollout import RolloutConfig  # noqa: E402

from specjax.drafters import MTPConfig, MTPDrafter  # noqa: E402
from specjax.engine import EngineConfig, Result  # noqa: E402
from specjax.models import ModelConfig, apply_jit, init_model  # noqa: E402
from specjax.rl import SpeculativeRollout, TunixPolicy  # noqa: E402
from specjax.rl.acceptance import position_acceptance  # noqa: E402
from specjax.sampling import logits_to_probs  # noqa: E402
from specjax.scheduling import SchedulerConfig  # noqa: E402
from _shared_once import count_compiles  # noqa: E402
from id_tokenizer import EOS, PAD, IdTokenizer  # noqa: E402
from stats import chisquare_gof  # noqa: E402

pytestmark = pytest.mark.xdist_group("rl")

V = 6
# most rollouts never stop early (eos_tokens=[99]); EOS and PAD are the toy tokenizer's ids
CFG = ModelConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                  num_kv_heads=2, head_dim=8)
PROMPT = (3, 0, 2)
NEW = 3
GAMMA = 2


def _model(seed, scale):
    m = init_model(CFG, seed=seed)
    m.embed[...] = m.embed[...] * scale  # random init is nearly flat: make it peaked
    return m


def _rollout(model, method="rejection", filters=True, **kw):
    d, p = MTPDrafter.create(CFG, MTPConfig(), seed=3)
    # 32 slots and one verification bucket: few steps and few compilations
    ec = EngineConfig(num_slots=32, max_len=16, gamma=GAMMA, prefill_buckets=(4,),
                      token_buckets=(32 * (GAMMA + 1),),
                      scheduler=SchedulerConfig("fixed", k=GAMMA), overlap=False, method=method,
                      filters=filters)
    rc = RolloutConfig(max_tokens_to_generate=NEW, max_prompt_length=4, temperature=1.0,
                       eos_tokens=[99])
    return SpeculativeRollout(rollout_actor=TunixPolicy(model), tokenizer=IdTokenizer(),
                              rollout_config=rc, drafter=d, drafter_params=p, engine_config=ec,
                              score_batch=256, **kw)


def _exact(model, top_p=None):
    """P(t1, t2, t3 | PROMPT) ``[V, V, V]`` of the model alone (T = 1, optional top-p)."""
    gd, st = nnx.split(model)
    ctx = [list(PROMPT) + list(c) for n in range(NEW) for c in itertools.product(range(V),
                                                                                   repeat=n)]
    out = {}
    for c in ctx:  # contexts have different lengths: one forward each (43 of them)
        logits = apply_jit(gd, st, jnp.asarray([c])).logits[0, -1]
        out[tuple(c)] = np.asarray(logits_to_probs(logits, 1.0, None, top_p), np.float64)
    joint = np.zeros((V,) * NEW)
    for seq in itertools.product(range(V), repeat=NEW):
        pr = 1.0
        for i in range(NEW):
            pr *= out[PROMPT + seq[:i]][seq[i]]
        joint[seq] = pr
    return joint


def _counts(rollout, n, rc):
    out = rollout.generate([" ".join(map(str, PROMPT))] * n, rc)
    toks = np.stack(out.tokens)
    assert toks.shape == (n, NEW)
    return np.bincount(np.ravel_multi_index(toks.T, (V,) * NEW), minlength=V ** NEW)


# two-sided normal quantile at the 1e-6 level: an exact sampler's |gap| / s.e. exceeds it with
# probability 1e-6 (the gap is a mean of 6,000 independent sequence sums: the CLT holds)
Z_1E6 = float(sps.norm.isf(0.5e-6))


def _assert_gap_is_noise(m):
    """The rollout's exactness monitor (mean of log p + H per token) is 0 up to its noise."""
    assert m["exactness_gap_se"] > 0
    assert abs(m["exactness_gap"]) < Z_1E6 * m["exactness_gap_se"], m


@pytest.mark.parametrize("method,top_p", [("rejection", None), ("rejection", 0.8),
                                          ("target_only", None)])
def test_rollouts_follow_the_updated_policy(method, top_p):
    old, new = _model(1, 6.0), _model(2, 6.0)
    # without top-p the engine runs without the filters, as the RL study's and the default
    # rollout engine do
    rollout = _rollout(old, method, filters=top_p is not None)
    rc = RolloutConfig(max_tokens_to_generate=NEW, max_prompt_length=4, temperature=1.0,
                       top_p=top_p if top_p else 1.0, eos_tokens=[99], seed=11)
    _counts(rollout, 16, rc)  # serve the old policy first (its state must not linger)
    stale_joint = _exact(old, top_p)  # before the update overwrites `old` in place
    policy = rollout.model()
    nnx.update(policy.model, nnx.state(new))  # what the learner's optimizer step does in place
    if method == "rejection":
        rollout.update_params(nnx.state(policy, nnx.Param))
    # target_only: no update_params call, as under Tunix when the rollout's model is the
    # learner's own module (it skips the weight sync): the rollout must notice the new arrays
    n = 6000
    counts = _counts(rollout, n, rc)
    m = rollout.last_metrics
    assert m["weights_version"] == 1 and m["drafted"] > 0.5 * n and m["accepted"] > 0.03 * n
    chisquare_gof(counts, _exact(new, top_p), label=f"{method} top_p={top_p}")
    _assert_gap_is_noise(m)
    stale = chisquare_gof(counts, stale_joint, check=False)
    assert not stale.passed, f"stale weights not distinguishable: {stale}"


def test_rollouts_stay_exact_after_an_online_drafter_update():
    """The online-update arms' path: :class:`specjax.rl.online.OnlineDrafterUpdate` steps on the
    rollout's own sequences, then ``set_drafter_params``. The drafter moves (its teacher-forced
    acceptance changes), and the rollouts keep the policy's distribution (chi-square at 1e-6): a
    verifier that drafted from the new head but kept the old head's q would not."""
    from specjax.rl.online import OnlineDrafterUpdate
    model = _model(1, 6.0)
    rollout = _rollout(model, "rejection", filters=False)
    rc = RolloutConfig(max_tokens_to_generate=NEW, max_prompt_length=4, temperature=1.0,
                       eos_tokens=[99], seed=13)
    _counts(rollout, 64, rc)  # sequences to train on, and the old head served once
    batch = rollout.last_batch
    rows = np.array([list(p) + list(r.tokens) for p, r in zip(batch["prompts"],
                                                             batch["results"])], np.int32)
    engine = rollout.engine
    upd = OnlineDrafterUpdate(engine.drafter, "tv", learning_rate=0.05, gamma=GAMMA)
    params, opt = engine.params, upd.init(engine.params)
    valid = np.ones_like(rows, bool)
    before = float(upd.loss_and_metrics(params, engine.graphdef, engine.target_state, rows,
                                        valid)[1]["alpha_mean"])
    for _ in range(5):
        params, opt, _ = upd.step(params, opt, engine.graphdef, engine.target_state, rows, valid)
    after = float(upd.loss_and_metrics(params, engine.graphdef, engine.target_state, rows,
                                       valid)[1]["alpha_mean"])
    assert abs(after - before) > 0.05, (before, after)  # a different head, not a nudge
    rollout.set_drafter_params(params)
    n = 6000
    counts = _counts(rollout, n, rc)
    m = rollout.last_metrics
    assert m["drafted"] > 0.5 * n and m["accepted"] > 0.03 * n
    chisquare_gof(counts, _exact(model), label="after an online drafter update")
    _assert_gap_is_noise(m)


def test_exactness_gap_by_hand():
    from specjax.rl.scoring import exactness_gap
    # sequence sums: (-1 + 0.5) + (-2 + 1.5) = -1 over 2 tokens, (-0.2 + 0.7) = 0.5 over 1
    gap, se = exactness_gap([np.array([-1.0, -2.0]), np.array([-0.2])],
                            [np.array([0.5, 1.5]), np.array([0.7])])
    assert gap == pytest.approx(-0.5 / 3)
    # clustered: G / (G - 1) * sum (s_i - r n_i)^2 / N^2
    r = -0.5 / 3
    assert se == pytest.approx(np.sqrt(2 * ((-1 - 2 * r) ** 2 + (0.5 - r) ** 2) / 9))
    assert np.isnan(exactness_gap([np.zeros(0)], [np.zeros(0)])[0])
    assert np.isnan(exactness_gap([np.array([-1.0])], [np.array([1.0])])[1])  # one sequence
    # a token the policy cannot produce is a loud -inf, not a skipped value
    assert exactness_gap([np.array([-np.inf, -1.0]), np.array([-1.0])],
                         [np.array([1.0, 1.0]), np.array([1.0])])[0] == -np.inf
    with pytest.raises(ValueError, match="equal"):
        exactness_gap([np.zeros(2)], [np.zeros(3)])
    with pytest.raises(ValueError, match="rows"):
        exactness_gap([np.zeros(2)], [])


def test_exactness_gap_sees_samples_of_another_policy():
    """Sequences drawn exactly from one model and scored under it: the gap is noise. The same
    sequences scored under a second model (a sampler that does not follow the policy it is
    scored by): the gap is many standard errors from 0."""
    from specjax.rl.scoring import exactness_gap, score_rows
    a, b = _model(1, 6.0), _model(2, 6.0)
    joint = _exact(a).ravel()
    rng = np.random.default_rng(0)
    seqs = np.stack(np.unravel_index(rng.choice(joint.size, 6000, p=joint / joint.sum()),
                                     (V,) * NEW), axis=1)
    rows = np.concatenate([np.tile(PROMPT, (len(seqs), 1)), seqs], axis=1).astype(np.int32)
    t = np.ones(len(rows), np.float32)
    zs = {}
    for name, model in (("own", a), ("other", b)):
        gd, st = nnx.split(model)
        lp, en = (np.asarray(x)[:, len(PROMPT) - 1:] for x in score_rows(gd, st, rows, t))
        gap, se = exactness_gap(list(lp), list(en))
        zs[name] = gap / se
    assert abs(zs["own"]) < Z_1E6, zs
    assert abs(zs["other"]) > Z_1E6, zs


def test_update_params_compiles_nothing():
    old, new = _model(1, 6.0), _model(2, 6.0)
    rollout = _rollout(old)
    rc = RolloutConfig(max_tokens_to_generate=NEW, max_prompt_length=4, temperature=1.0,
                       eos_tokens=[99])
    out = rollout.generate(["3 0 2", "1 1"] * 10, rc)
    prompts = jnp.asarray(out.left_padded_prompt_tokens)
    comps = jnp.asarray(np.stack([np.pad(t, (0, NEW - len(t)), constant_values=PAD)
                                  for t in out.tokens]))
    before = rollout.get_per_token_logps(prompts, comps)  # compiles the learner-side scoring
    new_state = nnx.state(TunixPolicy(new), nnx.Param)
    with count_compiles() as compiles:
        rollout.update_params(new_state)
        rollout.generate(["3 0 2", "1 1"] * 10, rc)
        after = rollout.get_per_token_logps(prompts, comps)
    assert compiles == []
    assert not np.allclose(np.asarray(before), np.asarray(after))  # the new weights are served


def _tunix_layout(rng, b, p_len, c_len):
    prompts = np.full((b, p_len), PAD, np.int32)
    comps = np.full((b, c_len), PAD, np.int32)
    real = []
    for i in range(b):
        p = rng.integers(0, 4, size=int(rng.integers(1, p_len + 1)))
        c = rng.integers(0, 4, size=int(rng.integers(1, c_len + 1)))
        prompts[i, p_len - len(p):] = p
        comps[i, :len(c)] = c
        real.append((p, c))
    return prompts, comps, real


def test_adapter_logps_equal_specjax_forward():
    model = _model(1, 6.0)
    policy = TunixPolicy(model)
    rng = np.random.default_rng(0)
    prompts, comps, real = _tunix_layout(rng, 6, 5, 4)
    gd, st = nnx.split(policy)
    got = np.asarray(tunix_common.compute_per_token_logps(
        gd, st, jnp.asarray(prompts), jnp.asarray(comps), pad_id=PAD, eos_id=EOS,
        stop_gradient=True, temperature=0.7))
    rollout = _rollout(model)
    rollout._config = RolloutConfig(temperature=0.7)
    mine = np.asarray(rollout.get_per_token_logps(jnp.asarray(prompts), jnp.asarray(comps)))
    mgd, mst = nnx.split(model)
    # float32 throughout; the padded and unpadded forwards differ only in reduction lengths
    # (masked keys add exact zeros), so results agree to a few ulps of the log-prob scale.
    for i, (p, c) in enumerate(real):
        seq = jnp.asarray([list(p) + list(c)])
        logits = np.asarray(apply_jit(mgd, mst, seq).logits[0], np.float64) / 0.7
        lsm = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1,
                              keepdims=True)) - logits.max(-1, keepdims=True)
        ref = np.array([lsm[len(p) - 1 + j, c[j]] for j in range(len(c))])
        tol = 64 * np.finfo(np.float32).eps * max(1.0, np.abs(logits).max())
        np.testing.assert_allclose(got[i, :len(c)], ref, atol=tol, rtol=0)
        np.testing.assert_allclose(mine[i, :len(c)], ref, atol=tol, rtol=0)


def test_rollout_logprobs_metrics_and_jsonl(tmp_path):
    model = _model(1, 6.0)
    path = tmp_path / "rollout.jsonl"
    rollout = _rollout(model, metrics_jsonl=str(path))
    rc = RolloutConfig(max_tokens_to_generate=NEW, max_prompt_length=4, temperature=0.8,
                       eos_tokens=[EOS], return_logprobs=True, seed=3)
    out = rollout.generate(["3 0 2", "1 2 3 0"] * 20, rc)
    assert out.left_padded_prompt_tokens.shape == (40, 4)
    assert out.left_padded_prompt_tokens[0, 0] == PAD
    gd, st = nnx.split(model)
    for i in range(4):  # logprobs are the exact sampling log-probs (temperature 0.8)
        prompt = [int(t) for t in out.left_padded_prompt_tokens[i] if t != PAD]
        toks = list(out.tokens[i])
        assert EOS not in toks and len(out.logprobs[i]) == len(toks)
        for j, t in enumerate(toks):
            logits = apply_jit(gd, st, jnp.asarray([prompt + toks[:j]])).logits[0, -1]
            ref = float(jax.nn.log_softmax(logits / 0.8)[t])
            assert out.logprobs[i][j] == pytest.approx(ref, abs=1e-5)
    line = json.loads(path.read_text().splitlines()[-1])
    for k in ("tau", "acceptance", "entropy", "drafted", "accepted", "wall_s", "alpha_1",
              "alpha_2"):
        assert k in line
    assert 0 < line["entropy"] < np.log(V)
    assert line["accepted"] <= line["drafted"]


def test_refuses_knobs_it_cannot_honour():
    rollout = _rollout(_model(1, 6.0))
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        rollout.generate(["3 0 2"], RolloutConfig(max_prompt_length=4, tensor_parallel_size=2))
    with pytest.raises(ValueError, match="max_prompt_length"):
        rollout.generate(["3 0 2 1 1"], RolloutConfig(max_prompt_length=4,
                                                      max_tokens_to_generate=2))


def test_default_engine_compiles_filters_only_when_asked():
    """The default engine config has top-k / top-p filters exactly when the rollout config asks
    for them; a later call asking for them on a filter-less engine is refused, not ignored."""
    d, p = MTPDrafter.create(CFG, MTPConfig(), seed=3)

    def make(**rc_kw):
        rc = RolloutConfig(max_tokens_to_generate=NEW, max_prompt_length=4, temperature=1.0,
                           eos_tokens=[99], **rc_kw)
        return SpeculativeRollout(rollout_actor=TunixPolicy(_model(1, 6.0)),
                                  tokenizer=IdTokenizer(), rollout_config=rc, drafter=d,
                                  drafter_params=p)

    assert not make().engine.config.filters
    assert make(top_p=0.9).engine.config.filters
    assert make(top_k=5).engine.config.filters
    plain = make()
    with pytest.raises(ValueError, match="filters=False"):
        plain.generate(["3 0 2"], RolloutConfig(max_tokens_to_generate=NEW, max_prompt_length=4,
                                                temperature=1.0, top_p=0.5, eos_tokens=[99]))


def _result(tokens, sizes):
    times = [float(i) for i, s in enumerate(sizes) for _ in range(s)]
    return Result("r", list(tokens), "length", token_times=times)


def test_position_acceptance_from_step_stamps():
    # k = 2, max_new = 6. r1: prefill 1 token; step 1 (ℓ = 2) accepts both; step 2
    # (ℓ = min(2, 6-4-1) = 1) rejects its draft; step 3 (ℓ = 0) verifies nothing.
    r1 = _result([1, 1, 1, 1, 1, 1], [1, 3, 1, 1])
    # r2: step 1 (ℓ = 2) accepts draft 1, then emits the stop token 4: position 2 is unknown.
    r2 = _result([1, 1, 4], [1, 2])
    acc, tried = position_acceptance([r1, r2], [6, 6], [4], 2)
    np.testing.assert_array_equal(acc, [2, 1])
    np.testing.assert_array_equal(tried, [3, 1])
    with pytest.raises(ValueError, match="fixed draft length"):
        position_acceptance([_result([1, 1, 1, 1, 1], [1, 4])], [6], [], 2)
