"""The speculative loop with every drafter: lossless at temperature 1 (chi-square at the 1e-6 level),
greedy decoding at temperature 0.

One ragged batch per drafter (one compiled prefill + step): 2 x 4096 rows of two prompts of
different lengths at temperature 1, each row with its own randomness, plus a few rows of other
prompt lengths at temperature 0 (per-row sampling settings).

* Lossless: the first new token t_m comes from the target alone (prefill); two speculative steps
  give t_{m+1}, t_{m+2} (accepted drafts, corrections, bonus tokens). Their joint distribution is
  compared with the target's exact one, computed from the target alone (one forward over all V^2
  continuations, same sampling transform).
* Greedy: the temperature-0 rows of that batch, after its two steps, are a prefix of plain cached
  greedy decoding (rejection sampling with one-hot p and q is greedy decoding); the same prompts
  alone in a small batch, stepped until they have 16 new tokens, equal it token for token. (The
  long greedy run has its own small batch: stepping the 8,192 sampled rows along, which need only
  two steps, made up most of each test's time.)
* A negative control shows that the same check catches a drafter that samples from one q and hands
  the verifier another.
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
from test_drafters_common import (ALL, GAMMA, GREEDY_NEW, GREEDY_PROMPTS, VOCAB, drafter,
                                  greedy_reference, target)

N = 4096  # rows per prompt group
PROMPTS = ((3, 9, 1), (12, 0, 7, 7, 2, 5))
N_LOSSLESS = N * len(PROMPTS)
MAX_LEN = 32
MAX_STEPS = 24

PLAIN = dict(temperature=1.0)
FILTERED = dict(temperature=0.7, top_k=6, top_p=0.9)
# mtp_shared differs from mtp only in which head a depth indexes (covered in test_drafters.py).
SPEC = [n for n in ALL if n != "mtp_shared"]


def _sampling(temperature=1.0, top_k=0, top_p=1.0, n_sampled=N_LOSSLESS) -> Sampling:
    """Per-row settings: the first ``n_sampled`` rows get these, the greedy rows after them
    temperature 0. Always arrays (top_k 0 / top_p 1 disable the filters) so every setting shares
    one compiled step."""
    b = n_sampled + len(GREEDY_PROMPTS)
    temp = np.full(b, temperature, np.float32)
    temp[n_sampled:] = 0.0
    return Sampling(temperature=jnp.asarray(temp), top_k=jnp.full((b,), top_k, jnp.int32),
                    top_p=jnp.full((b,), top_p, jnp.float32))


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


def _emitted(first, outs) -> np.ndarray:
    """Emitted tokens per row, in order, padded with -1: ``[B, 1 + steps (γ+1)]``."""
    toks = np.concatenate([np.asarray(first)[:, None]] + [o.tokens for o in outs], 1)
    order = np.argsort(toks < 0, axis=1, kind="stable")  # emitted tokens first, in order
    return np.take_along_axis(toks, order, axis=1)


def _run(d, params, fr, method, settings, seed, rows_per_prompt=N):
    """Prefill + speculative steps over ``rows_per_prompt`` rows of each of PROMPTS (sampled with
    ``settings``) followed by one row of each GREEDY_PROMPTS (temperature 0): two steps when there
    are sampled rows (all the lossless check reads), else until every greedy row has GREEDY_NEW
    tokens."""
    gd, st = target()
    n_sampled = rows_per_prompt * len(PROMPTS)
    prompts = [p for p in PROMPTS for _ in range(rows_per_prompt)] + [list(p) for p in
                                                                       GREEDY_PROMPTS]
    lens = np.array([len(p) for p in prompts], np.int32)
    tokens = np.zeros((len(prompts), 16), np.int32)
    for i, p in enumerate(prompts):
        tokens[i, :len(p)] = p
    key = jax.random.key(seed)
    sampling = _sampling(**settings, n_sampled=n_sampled)
    state, first = sp.prefill(gd, st, d, params, fr, jnp.asarray(tokens), jnp.asarray(lens),
                              jax.random.fold_in(key, 0), sampling, max_len=MAX_LEN, gamma=GAMMA,
                              method=method)
    outs = []
    greedy_count = np.ones(len(GREEDY_PROMPTS), np.int64)
    for i in range(1, MAX_STEPS + 1):
        state, out = sp.step(gd, st, d, params, fr, state, jax.random.fold_in(key, i), sampling,
                             gamma=GAMMA, method=method)
        outs.append(jax.device_get(out))
        greedy_count += outs[-1].num_accepted[n_sampled:] + 1
        if i >= 2 and (n_sampled or greedy_count.min() >= GREEDY_NEW):
            break
    return _emitted(first, outs), outs


def _check_lossless(emitted, settings, label, check=True):
    results = []
    for g, prompt in enumerate(PROMPTS):
        e = emitted[g * N:(g + 1) * N, :3]
        assert (e >= 0).all()
        counts = counts_of(e[:, 0] * VOCAB * VOCAB + e[:, 1] * VOCAB + e[:, 2], VOCAB ** 3)
        probs = exact_joint(tuple(prompt), **settings)
        results.append(chisquare_gof(counts, probs.ravel(), label=f"{label} prompt {g}",
                                     check=check))
    return results


def _check_greedy(emitted, label):
    """The greedy rows (the last len(GREEDY_PROMPTS) rows): a prefix of greedy decoding after a
    two-step run beside sampled rows, all GREEDY_NEW tokens of it after a greedy-only run."""
    ref = greedy_reference()
    rows = emitted[-len(GREEDY_PROMPTS):]
    got = [[int(t) for t in row[:GREEDY_NEW] if t >= 0] for row in rows]
    assert all(len(g) >= 3 for g in got), (label, got)  # first token + at least one per step
    assert got == [r[:len(g)] for r, g in zip(ref, got)], (label, got, ref)
    return got


def _check_greedy_alone(d, params, fr, method, label):
    emitted, _ = _run(d, params, fr, method, PLAIN, seed=3, rows_per_prompt=0)
    got = _check_greedy(emitted, label)
    assert got == greedy_reference(), (label, got)


# The temperature / top-k / top-p variant runs for these (same compiled step, other settings).
FILTERED_TOO = ("dspark_markov", "mtp")


@pytest.mark.parametrize("name", SPEC)
def test_speculative_decoding_is_lossless_and_greedy_at_temperature_zero(name):
    d, params, fr = drafter(name)
    emitted, outs = _run(d, params, fr, "rejection", PLAIN, seed=11)
    _check_lossless(emitted, PLAIN, name)
    acc = outs[0].num_accepted[:N_LOSSLESS]
    assert 0.02 < (acc > 0).mean() < 0.98, "both accepted and rejected drafts must occur"
    assert (outs[0].num_draft == GAMMA).all()
    _check_greedy(emitted, name)
    _check_greedy_alone(d, params, fr, "rejection", name)
    if name in FILTERED_TOO:
        emitted, _ = _run(d, params, fr, "rejection", FILTERED, seed=12)
        _check_lossless(emitted, FILTERED, f"{name} temperature 0.7, top-k 6, top-p 0.9")


def test_target_only_sampling_is_lossless_and_greedy_at_temperature_zero():
    """Target-only verification with argmax drafts from a sequential (Markov) head."""
    d, params, fr = drafter("dspark_markov")
    emitted, outs = _run(d, params, fr, "target_only", PLAIN, seed=13)
    _check_lossless(emitted, PLAIN, "dspark target-only")
    _check_greedy(emitted, "dspark target-only")
    _check_greedy_alone(d, params, fr, "target_only", "dspark target-only")
    assert (outs[0].num_accepted[:N_LOSSLESS] > 0).mean() > 0.02


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


def test_negative_control_misreported_q_is_caught():
    """Same seeds and check as the n-gram drafter's lossless test, which passes."""
    d, params, fr = drafter("ngram")
    emitted, _ = _run(MisreportedQ(d), params, fr, "rejection", PLAIN, seed=11)
    results = _check_lossless(emitted, PLAIN, "misreported q", check=False)
    assert not any(r.passed for r in results), results
