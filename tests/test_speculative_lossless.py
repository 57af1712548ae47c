"""Losslessness of speculative decoding with every drafter (chi-square at the 1e-6 level).

Thousands of rows of the same prompt (two prompt lengths in one ragged batch), each with its own
randomness, are prefilled (first new token t_m from the target alone) and run through two
speculative steps; the joint distribution of the first three emitted tokens (t_m, t_{m+1}, t_{m+2})
is compared with the target's exact distribution, computed from the target alone (one forward
over all V^2 continuations, same sampling transform). t_{m+1} and t_{m+2} come from accepted
drafts, corrections and bonus tokens of the speculative steps. A negative control shows that the
same check catches a drafter that samples from one q and hands the verifier another.
"""
import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax import speculative as sp
from specjax.drafters import Sampling
from specjax.models import apply_jit
from specjax.sampling import logits_to_probs
from stats import chisquare_gof, counts_of
from test_drafters_common import ALL, GAMMA, VOCAB, drafter, target

N = 8192  # rows per prompt group
PROMPTS = ([3, 9, 1], [12, 0, 7, 7, 2, 5])
MAX_LEN = 16


def _sampling(temperature=1.0, top_k=0, top_p=1.0) -> Sampling:
    # Always arrays (0 / 1.0 disable the filters) so that every setting shares one compiled step.
    return Sampling(temperature=jnp.float32(temperature), top_k=jnp.int32(top_k),
                    top_p=jnp.float32(top_p))


PLAIN = dict(temperature=1.0)
FILTERED = dict(temperature=0.7, top_k=6, top_p=0.9)


@functools.lru_cache(maxsize=None)
def exact_joint(prompt: tuple, temperature=1.0, top_k=0, top_p=1.0) -> np.ndarray:
    """P(t_m, t_{m+1}, t_{m+2}) ``[V, V, V]`` from the target alone."""
    gd, st = target()
    m = len(prompt)
    ab = np.stack(np.meshgrid(np.arange(VOCAB), np.arange(VOCAB), indexing="ij"), -1).reshape(-1, 2)
    seqs = np.concatenate([np.tile(np.asarray(prompt), (len(ab), 1)), ab], axis=1)
    logits = apply_jit(gd, st, jnp.asarray(seqs, jnp.int32)).logits[:, m - 1:m + 2]
    p = np.asarray(logits_to_probs(logits, temperature, top_k, top_p), np.float64)  # [V^2, 3, V]
    p0 = p[0, 0]  # same for every row
    p1 = p[::VOCAB, 1]  # rows with b = 0: p(. | prompt, a)
    p2 = p[:, 2].reshape(VOCAB, VOCAB, VOCAB)  # p(. | prompt, a, b)
    return p0[:, None, None] * p1[:, :, None] * p2


def _first_three(first, outs) -> np.ndarray:
    toks = np.concatenate([np.asarray(first)[:, None]] + [np.asarray(o.tokens) for o in outs], 1)
    order = np.argsort(toks < 0, axis=1, kind="stable")  # emitted tokens first, in order
    out = np.take_along_axis(toks, order, axis=1)[:, :3]
    assert (out >= 0).all()
    return out


def _run(d, params, fr, method, sampling, seed):
    gd, st = target()
    lens = np.repeat([len(p) for p in PROMPTS], N).astype(np.int32)
    tokens = np.zeros((len(lens), 8), np.int32)
    for g, p in enumerate(PROMPTS):
        tokens[g * N:(g + 1) * N, :len(p)] = p
    key = jax.random.key(seed)
    state, first = sp.prefill(gd, st, d, params, fr, jnp.asarray(tokens), jnp.asarray(lens),
                              jax.random.fold_in(key, 0), sampling, max_len=MAX_LEN, gamma=GAMMA,
                              method=method)
    outs = []
    for i in (1, 2):
        state, out = sp.step(gd, st, d, params, fr, state, jax.random.fold_in(key, i), sampling,
                             gamma=GAMMA, method=method)
        outs.append(jax.device_get(out))
    return _first_three(first, outs), outs


def _check(emitted, settings, label, check=True):
    results = []
    for g, prompt in enumerate(PROMPTS):
        e = emitted[g * N:(g + 1) * N]
        counts = counts_of(e[:, 0] * VOCAB * VOCAB + e[:, 1] * VOCAB + e[:, 2], VOCAB ** 3)
        probs = exact_joint(tuple(prompt), **settings)
        results.append(chisquare_gof(counts, probs.ravel(), label=f"{label} prompt {g}",
                                     check=check))
    return results


def _group(name):
    return pytest.param(name, marks=pytest.mark.xdist_group(f"lossless_{name}"))


# mtp_shared differs from mtp only in which head a depth indexes (covered in test_drafters.py).
@pytest.mark.parametrize("name", [_group(n) for n in ALL if n != "mtp_shared"])
def test_rejection_sampling_is_lossless(name):
    d, params, fr = drafter(name)
    emitted, outs = _run(d, params, fr, "rejection", _sampling(**PLAIN), seed=11)
    _check(emitted, PLAIN, name)
    acc = outs[0].num_accepted
    assert 0.02 < (acc > 0).mean() < 0.98, "both accepted and rejected drafts must occur"


@pytest.mark.parametrize("name", [_group("dspark_markov"), _group("mtp")])
def test_rejection_sampling_is_lossless_with_temperature_top_k_top_p(name):
    d, params, fr = drafter(name)
    emitted, _ = _run(d, params, fr, "rejection", _sampling(**FILTERED), seed=12)
    _check(emitted, FILTERED, f"{name} filtered")


@pytest.mark.xdist_group("lossless_dspark_markov")
def test_target_only_sampling_is_lossless():
    """Target-only verification with argmax drafts from a sequential (Markov) head."""
    d, params, fr = drafter("dspark_markov")
    emitted, outs = _run(d, params, fr, "target_only", _sampling(**PLAIN), seed=13)
    _check(emitted, PLAIN, "dspark target-only")
    assert (outs[0].num_accepted > 0).mean() > 0.02


@dataclasses.dataclass(frozen=True)
class MisreportedQ:
    """Negative control: drafts from the inner drafter's q but hands the verifier
    ``0.5 q + 0.5 uniform`` (exactly the bug of sampling from one q and verifying with another)."""

    inner: Any

    @property
    def hidden_layers(self):
        return self.inner.hidden_layers

    def init_state(self, *a, **k):
        return self.inner.init_state(*a, **k)

    def prefill(self, *a, **k):
        return self.inner.prefill(*a, **k)

    def commit(self, *a, **k):
        return self.inner.commit(*a, **k)

    def propose(self, *a, **k):
        out, state = self.inner.propose(*a, **k)
        return out._replace(probs=0.5 * out.probs + 0.5 / VOCAB), state


@pytest.mark.xdist_group("lossless_ngram")
def test_negative_control_misreported_q_is_caught():
    """Same seeds and check as test_rejection_sampling_is_lossless[ngram], which passes."""
    d, params, fr = drafter("ngram")
    emitted, _ = _run(MisreportedQ(d), params, fr, "rejection", _sampling(**PLAIN), seed=11)
    results = _check(emitted, PLAIN, "misreported q", check=False)
    assert not any(r.passed for r in results), results
