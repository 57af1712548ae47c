"""Drafters: parameter pytrees, inference == teacher-forced training forward (across several
speculative steps, ragged rows), and the exactness of q (drafted tokens are distributed exactly as
the q handed to the verifier: chi-square at 1e-6 over thousands of rows).
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from specjax.drafters import (DSparkConfig, MTPConfig, MTPDrafter, NGramDrafter, Observation,
                              Sampling, SharedHead, param_logical_axes, teacher_forced_targets)
from specjax.losses import ce_loss
from specjax.models import apply, init_cache
from specjax.sampling import logits_to_probs
from test_drafters_common import CONFIG, GAMMA, NEURAL, VOCAB, drafter, frozen, sequential_gof, target

MAX_LEN = 32
PROMPT_LENS = np.array([5, 2, 7, 4, 8, 3, 6, 1])
# Accepted drafts per step for the ragged rows (the correction token is random).
ACCEPT = np.array([[0, 1, 2, 3, 3, 2, 1, 0],
                   [3, 0, 1, 2, 3, 3, 0, 1]])
N_SAME = 8192  # identical rows (same context at every step) for the chi-square tests
SAMPLING = Sampling(temperature=0.8, top_p=0.95)


def _is_param(x):
    return isinstance(x, nnx.Variable)


# ------------------------------------------------------------------------------------------------
# parameters


@pytest.mark.parametrize("name", NEURAL)
def test_params_have_logical_axes_and_exclude_frozen_head(name):
    d, params, fr = drafter(name)
    leaves = jax.tree.leaves(params, is_leaf=_is_param)
    assert leaves
    for v in leaves:
        assert isinstance(v, nnx.Param)
        axes = v.logical_axes
        assert isinstance(axes, tuple) and len(axes) == v[...].ndim, (axes, v[...].shape)
    axes = param_logical_axes(params)
    assert jax.tree.structure(axes, is_leaf=lambda x: isinstance(x, tuple)) == \
        jax.tree.structure(nnx.to_pure_dict(params))
    if name == "draft_lm":
        return  # an independent LM owns its embedding
    assert isinstance(fr, SharedHead)
    np.testing.assert_array_equal(fr.embed, target()[1]["embed"][...])
    paths = [jax.tree_util.keystr(p) for p, _ in
             jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(params))[0]]
    assert not any(p in ("['embed']", "['lm_head']") for p in paths), paths
    for v in leaves:  # nothing shaped like the embedding / LM head
        assert v[...].shape not in ((CONFIG.vocab_size, CONFIG.hidden_size),
                                    (CONFIG.hidden_size, CONFIG.vocab_size))


@pytest.mark.parametrize("name", ["mtp", "dspark_rnn"])
def test_teacher_forced_gradients_flow_to_params_only(name):
    d, params, fr = drafter(name)
    gd, st = target()
    tokens = jax.random.randint(jax.random.key(0), (2, 12), 0, VOCAB)
    anchors = jnp.array([[0, 3, 7], [1, 5, 9]], jnp.int32)

    @jax.jit
    def loss_and_grad(params, fr, st):
        out = apply(gd, st, tokens, hidden_layers=d.hidden_layers)
        labels, _, mask = teacher_forced_targets(tokens, out.logits, GAMMA, anchors)

        def loss(p):
            tf = d.teacher_forced(p, fr, tokens, out.hidden, gamma=GAMMA, anchors=anchors)
            assert tf.logits.shape == (2, 3, GAMMA, VOCAB)
            return jnp.sum(jnp.where(mask, ce_loss(tf.logits, labels), 0.0))

        return jax.value_and_grad(loss)(params)

    value, grads = loss_and_grad(params, fr, st)
    assert np.isfinite(float(value))
    g = nnx.to_pure_dict(grads)
    assert jax.tree.structure(g) == jax.tree.structure(nnx.to_pure_dict(params))
    norms = [float(jnp.abs(x).max()) for x in jax.tree.leaves(g)]
    assert all(np.isfinite(norms)) and sum(n > 0 for n in norms) >= 0.8 * len(norms)


def test_teacher_forced_targets_alignment():
    tokens = jnp.arange(10, dtype=jnp.int32)[None] + 100
    logits = jnp.broadcast_to(jnp.arange(10, dtype=jnp.float32)[None, :, None], (1, 10, 4))
    labels, tl, mask = teacher_forced_targets(tokens, logits, 3, jnp.array([[0, 6, 7]]))
    # anchor i, draft k: label t_{i+1+k}, target logits of position i+k, valid iff i+1+k < T
    np.testing.assert_array_equal(labels[0, 0], [102, 103, 104])
    np.testing.assert_array_equal(tl[0, 0, :, 0], [1, 2, 3])
    np.testing.assert_array_equal(mask[0], [[1, 1, 1], [1, 1, 0], [1, 0, 0]])


def test_config_errors():
    with pytest.raises(ValueError):
        DSparkConfig(head="lstm")
    d, p = MTPDrafter.create(CONFIG, MTPConfig(num_heads=1))
    state = d.init_state(2, 8, gamma=2)
    with pytest.raises(ValueError, match="gamma"):
        d.propose(p, frozen(), state, jax.random.key(0), gamma=3)
    with pytest.raises(ValueError):
        NGramDrafter(VOCAB, max_ngram=1, min_ngram=2)


# ------------------------------------------------------------------------------------------------
# inference == teacher-forced, and q is exact


def _scenario(accept=ACCEPT, n_same=N_SAME):
    rng = np.random.default_rng(0)
    b = len(PROMPT_LENS)
    prompts = np.zeros((b + n_same, 8), np.int32)
    prompts[:b] = rng.integers(0, VOCAB, (b, 8))
    prompts[b:] = rng.integers(0, VOCAB, 8)
    lens = np.concatenate([PROMPT_LENS, np.full(n_same, 6)]).astype(np.int32)
    first = np.concatenate([rng.integers(0, VOCAB, b), np.full(n_same, rng.integers(VOCAB))])
    accept = np.concatenate([accept, np.zeros((len(accept), n_same), np.int64)], axis=1)
    corr = np.concatenate([rng.integers(0, VOCAB, (len(accept), b)),
                           np.repeat(rng.integers(0, VOCAB, (len(accept), 1)), n_same, 1)], axis=1)
    return prompts, lens, first.astype(np.int32), accept.astype(np.int32), corr.astype(np.int32)


def _decode(name, accept=ACCEPT, n_same=N_SAME, max_verify=None):
    """prefill -> (propose -> verify forward -> commit(accept, corr)) x steps -> propose."""
    d, params, fr = drafter(name)
    gd, st = target()
    prompts, lens, first, accept, corr = _scenario(accept, n_same)
    b = len(lens)
    state_kw = {} if max_verify is None else {"max_verify": max_verify}

    @jax.jit
    def run(params, fr, st, key):
        cache = init_cache(CONFIG, b, MAX_LEN)
        out = apply(gd, st, prompts, cache=cache, num_valid=lens, hidden_layers=d.hidden_layers)
        cache = out.cache
        ds = d.prefill(params, fr, d.init_state(b, MAX_LEN, GAMMA, **state_kw),
                       Observation(jnp.asarray(prompts), jnp.asarray(lens),
                                   jnp.zeros((b,), jnp.int32), jnp.asarray(first), out.hidden))
        anchor = jnp.asarray(first)
        drafts = []
        for s, key_s in enumerate(jax.random.split(key, len(accept) + 1)):
            dr, ds = d.propose(params, fr, ds, key_s, gamma=GAMMA, sampling=SAMPLING)
            drafts.append(dr)
            if s == len(accept):
                break
            vt = jnp.concatenate([anchor[:, None], dr.tokens], axis=1)
            start = cache.lengths
            out = apply(gd, st, vt, cache=cache, hidden_layers=d.hidden_layers)
            cache = out.cache.rollback(start + accept[s] + 1)
            anchor = jnp.asarray(corr[s])
            ds = d.commit(params, fr, ds, Observation(vt, jnp.asarray(accept[s]) + 1, start,
                                                      anchor, out.hidden))
        return drafts

    return jax.device_get(run(params, fr, st, jax.random.key(42)))


def _teacher_forced(name, drafts, accept=ACCEPT):
    """Per decoding step, ``(q [rows, γ, V], confidences [rows, γ] or None)`` of the training
    forward at anchor n-2 with that step's drafts as teacher tokens (the ragged rows only)."""
    d, params, fr = drafter(name)
    gd, st = target()
    prompts, lens, first, accept, corr = _scenario(accept, 0)
    rows = len(PROMPT_LENS)
    seqs = np.zeros((len(drafts), rows, MAX_LEN), np.int32)
    anchors = np.zeros((len(drafts), rows), np.int32)
    for r in range(rows):
        ctx = list(prompts[r, :lens[r]]) + [first[r]]
        for s, dr in enumerate(drafts):
            anchors[s, r] = len(ctx) - 2
            full = ctx + list(dr.tokens[r])
            seqs[s, r, :len(full)] = full
            if s < len(accept):
                ctx = ctx + list(dr.tokens[r, :accept[s, r]]) + [corr[s, r]]

    @jax.jit
    def tf(params, fr, st, seqs, anchors):
        out = apply(gd, st, seqs, hidden_layers=d.hidden_layers)
        r = d.teacher_forced(params, fr, seqs, out.hidden, gamma=GAMMA, anchors=anchors[:, None])
        q = logits_to_probs(r.logits[:, 0], SAMPLING.temperature, top_p=SAMPLING.top_p)
        c = None if r.confidence_logits is None else jax.nn.sigmoid(r.confidence_logits[:, 0])
        return q, c

    return [jax.device_get(tf(params, fr, st, jnp.asarray(seqs[s]), jnp.asarray(anchors[s])))
            for s in range(len(drafts))]


@pytest.mark.parametrize("name", NEURAL)
def test_propose_equals_teacher_forced_and_q_is_exact(name):
    """Each step's q (and confidences) equal the training forward at anchor n-2 with the drafts as
    teacher tokens, for ragged rows after commits of 0..γ accepted drafts; and, over thousands of
    rows with one context, the drafted γ-token sequences are distributed as the product of the
    returned (sequential / chained) q's, at every step (chi-square, 1e-6)."""
    d, _, _ = drafter(name)
    rows = len(PROMPT_LENS)
    drafts = _decode(name)
    for s, (dr, (q, c)) in enumerate(zip(drafts, _teacher_forced(name, drafts))):
        np.testing.assert_allclose(dr.probs[:rows], q, atol=2e-5, err_msg=f"step {s}")
        assert dr.tokens.dtype == np.int32 and dr.probs.dtype == np.float32
        if d.has_confidence:
            np.testing.assert_allclose(dr.confidences[:rows], c, atol=2e-5)
            assert dr.confidences.shape == (len(PROMPT_LENS) + N_SAME, GAMMA)
        else:
            assert dr.confidences is None
    for s, dr in enumerate(drafts):
        res = sequential_gof(dr.tokens[rows:], dr.probs[rows:], label=f"{name} step {s}")
        assert res.df >= 5, res  # the test has power (q is not degenerate)


# Three commits with at most K accepted drafts each, so that an entry written two steps back
# (outside any window) is read.
ACCEPT_K1 = np.array([[0, 1, 1, 0, 1, 1, 0, 1],
                      [1, 0, 1, 1, 0, 1, 1, 0],
                      [1, 1, 0, 1, 1, 0, 1, 1]])


@pytest.mark.parametrize("max_verify,accept", [(None, ACCEPT), (1, ACCEPT_K1)],
                         ids=["K=gamma", "K=1"])
def test_mtp_window_is_the_smallest_that_keeps_propose_exact(monkeypatch, max_verify, accept):
    """The MTP state recomputes W = max(K + 1, γ) positions per depth (γ + 1 at the default
    K = γ, γ at K = 1 < γ - 1): with W, propose equals the training forward after commits of up
    to K accepted drafts; with W - 1 it does not (a stale or missing cache entry is read)."""
    rows = len(PROMPT_LENS)
    w = MTPDrafter.window(GAMMA, max_verify)
    assert w == (GAMMA + 1 if max_verify is None else GAMMA)
    drafts = _decode("mtp", accept, n_same=0, max_verify=max_verify)
    assert drafts[0].probs.shape == (rows, GAMMA, VOCAB)
    for s, (dr, (q, _)) in enumerate(zip(drafts, _teacher_forced("mtp", drafts, accept))):
        np.testing.assert_allclose(dr.probs, q, atol=2e-5, err_msg=f"step {s}")
    monkeypatch.setattr(MTPDrafter, "window", staticmethod(lambda gamma, max_verify=None: w - 1))
    drafts = _decode("mtp", accept, n_same=0, max_verify=max_verify)
    worst = max(np.abs(dr.probs - q).max()
                for dr, (q, _) in zip(drafts, _teacher_forced("mtp", drafts, accept)))
    assert worst > 1e-2, worst


def test_mtp_last_depth_at_its_query_only_drafts_as_the_whole_block(monkeypatch):
    """The last depth runs its block at the query position only (keys / values everywhere):
    the same q at every step as running it at every window position, and the same cache."""
    rows = len(PROMPT_LENS)
    assert MTPDrafter.last_depth_queries == 1
    cut = _decode("mtp", n_same=0)
    monkeypatch.setattr(MTPDrafter, "last_depth_queries", None)
    full = _decode("mtp", n_same=0)
    assert len(cut) == len(full) == len(ACCEPT) + 1
    for s, (a, b) in enumerate(zip(cut, full)):
        assert a.probs.shape == (rows, GAMMA, VOCAB)
        np.testing.assert_allclose(a.probs, b.probs, atol=1e-6, err_msg=f"step {s}")
        np.testing.assert_array_equal(a.tokens, b.tokens)


def test_mtp_window_errors():
    assert MTPDrafter.window(3, 0) == 3 and MTPDrafter.window(1) == 2
    with pytest.raises(ValueError, match="gamma >= 1"):
        MTPDrafter.window(0)
    with pytest.raises(ValueError, match="max_verify >= 0"):
        MTPDrafter.window(3, -1)


# ------------------------------------------------------------------------------------------------
# n-gram


def test_ngram_prompt_lookup():
    d = NGramDrafter(VOCAB, max_ngram=3, min_ngram=1)
    hist = [[1, 2, 3, 4, 1, 2], [5, 6, 5, 6, 5, 0], [1, 2, 3, 0, 0, 0], [7, 3, 9, 3, 0, 0]]
    n = [6, 5, 3, 4]
    state = d.init_state(4, 8, 3)
    state = state.__class__(history=state.history.at[:, :6].set(jnp.array(hist)),
                            num_emitted=jnp.array(n, jnp.int32))
    out, _ = d.propose(None, None, state, jax.random.key(0), gamma=3)
    np.testing.assert_array_equal(out.tokens, [[3, 4, 1],    # (1, 2) seen at 0..1
                                               [6, 5, 6],    # (5, 6, 5) at 0..2, periodic copy
                                               [3, 3, 3],    # no match: repeat the last token
                                               [9, 3, 9]])   # (3) at 1 -> 9, 3, 9
    np.testing.assert_array_equal(out.probs, jax.nn.one_hot(out.tokens, VOCAB))
    assert out.confidences is None
