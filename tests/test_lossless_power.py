"""Lossless, with power: the library's rejection sampler passes a chi-square test that provably
catches small biases planted in a *copy of the library's own verifier*.

Setup. One verification position (K = 1) over V = 2 tokens: drafts x ~ q (numpy, float64 inverse
CDF), then :func:`specjax.verify.rejection_sample` (and copies of it) returns the emitted token,
which must be distributed as p. The copies are ``specjax/verify.py``'s source with one line
replaced, executed as a separate module:

* ``faithful``: no change (shows that copying alone changes nothing);
* ``bf16_q``: the accept test reads q stored in bfloat16 (``u * bf16(q_x) < p_x``) while drafts
  come from the exact q. bf16 keeps 8 significant bits, so the relative rounding error is at most
  2^-9 ~ 0.2 %: the smallest bias a real precision bug produces;
* ``abs_residual``: the residual after a rejection is ``|p - q|`` instead of ``max(0, p - q)``.

(``p - q`` without the ``max(0, .)`` is *not* a bug in this verifier: the token is drawn by the
race ``argmax_v w_v / E_v`` with ``E_v > 0``, where negative weights can never win while any
weight is positive, and the all-non-positive case falls back to p explicitly.)

Power (why n = N_DRAWS is enough). For a mutant the emitted token follows a known distribution
pi1 (computed exactly below, :func:`emitted_distribution`) instead of pi0 = p. Pearson's statistic
over n draws is then approximately noncentral chi-square with df = V - 1 and noncentrality
lambda = n * w^2, with Cohen's effect size w^2 = sum_v (pi1_v - pi0_v)^2 / pi0_v. The test
rejects when the statistic exceeds c = chi2.isf(1e-6, df); the power is ncx2.sf(c, df, lambda).
With V = 2, p = (0.98, 0.02) and q_0 just below the midpoint of two bf16 neighbours in [0.5, 1)
(so bf16 rounds it down by almost 2^-9 relative), the bf16 mutant emits token 0 with
probability p_0 * q_0 / bf16(q_0) = 0.98 * 1.00197: w^2 ~ 1.9e-4, and power >= 1 - 1e-4 needs
n >= ~4e5 (:func:`required_draws` computes it; the test asserts N_DRAWS exceeds it). Putting p_0
near 1 maximises w^2 = p_0 eps^2 / p_1 for a relative error eps in q_0, so this is the most
sensitive two-token configuration for that bug. A correct sampler fails with probability 1e-6.
"""
from __future__ import annotations

import math
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats as sps

import specjax.verify as verify_lib
from stats import ALPHA, chisquare_gof, counts_of

N_DRAWS = 600_000
POWER = 1 - 1e-4
SEED = 20_240_613

# q_0 = (253.5 - 2^-12) / 256: just below the midpoint of the bf16 neighbours 253/256 and
# 254/256, so bf16 rounds it down to 253/256 (relative error 1.97e-3 ~ 2^-9). Exact in float32.
Q0 = (253.5 - 2.0 ** -12) / 256
P = np.array([0.98, 0.02])
Q = np.array([Q0, 1.0 - Q0])

# The planted bugs: (line in specjax/verify.py, its replacement).
MUTATIONS = {
    "faithful": None,
    "bf16_q": ("qa = _gather_at(q_rows, d_idx, xs)  # [B, K]",
               "qa = _gather_at(q_rows.astype(jnp.bfloat16), d_idx, xs)  # [B, K]"),
    "abs_residual": ("residual = lambda p, q, cols: jnp.maximum(p - q, 0.0)",
                     "residual = lambda p, q, cols: jnp.abs(p - q)"),
}


def verifier_copy(name: str) -> types.ModuleType:
    """``specjax/verify.py`` re-executed as a new module, with mutation ``name`` applied."""
    with open(verify_lib.__file__) as f:
        source = f.read()
    mutation = MUTATIONS[name]
    if mutation is not None:
        old, new = mutation
        assert source.count(old) == 1, f"the line to mutate is no longer in verify.py: {old!r}"
        source = source.replace(old, new)
    module = types.ModuleType(f"verify_copy_{name}")
    module.__file__ = verify_lib.__file__
    exec(compile(source, f"<verify.py copy: {name}>", "exec"), module.__dict__)
    return module


def emitted_distribution(p, q, *, q_accept=None, residual=None):
    """Exact distribution of the token emitted at one position by rejection sampling.

    P(emit v) = q_v * min(1, p_v / q'_v) + (1 - sum_x q_x min(1, p_x / q'_x)) * r_v, where q' is
    the q the accept test reads (default q) and r the normalised residual (default max(0, p - q)).
    """
    q_accept = q if q_accept is None else q_accept
    accept = np.minimum(1.0, p / q_accept)
    w = np.maximum(p - q, 0.0) if residual is None else residual
    return q * accept + (1.0 - np.sum(q * accept)) * w / w.sum()


def expected_under(name: str) -> np.ndarray:
    if name == "bf16_q":
        q_bf16 = np.asarray(jnp.asarray(Q, jnp.float32).astype(jnp.bfloat16).astype(jnp.float32),
                            np.float64)
        return emitted_distribution(P, Q, q_accept=q_bf16)
    if name == "abs_residual":
        return emitted_distribution(P, Q, residual=np.abs(P - Q))
    return emitted_distribution(P, Q)


def required_draws(pi0, pi1, alpha=ALPHA, power=POWER) -> int:
    """Smallest n with ncx2.sf(chi2.isf(alpha, df), df, n * w^2) >= power (df = bins - 1)."""
    df = len(pi0) - 1
    w2 = float(np.sum((pi1 - pi0) ** 2 / pi0))
    crit = sps.chi2.isf(alpha, df)
    lo, hi = 1, 1
    while sps.ncx2.sf(crit, df, hi * w2) < power:
        hi *= 2
    while lo < hi:  # bisection on n
        mid = (lo + hi) // 2
        if sps.ncx2.sf(crit, df, mid * w2) >= power:
            hi = mid
        else:
            lo = mid + 1
    return lo


def emitted_tokens(module, seed: int) -> np.ndarray:
    """N_DRAWS rows: draft x ~ q, verify against p with ``module.rejection_sample``."""
    rng = np.random.default_rng(seed)
    x = (rng.random(N_DRAWS) >= Q[0]).astype(np.int32)  # inverse CDF of q over {0, 1}
    q = jnp.broadcast_to(jnp.asarray(Q, jnp.float32), (N_DRAWS, 1, 2))
    p = jnp.broadcast_to(jnp.asarray(P, jnp.float32), (N_DRAWS, 2, 2))
    out = module.rejection_sample(jax.random.key(seed), jnp.asarray(x)[:, None], q, p)
    return np.asarray(out.tokens[:, 0])


def test_configuration_is_what_the_derivation_assumes():
    q32 = np.float32(Q0)
    assert float(q32) == Q0 and float(np.float32(1.0 - Q0)) == 1.0 - Q0
    q_bf16 = float(jnp.asarray(Q0, jnp.float32).astype(jnp.bfloat16))
    assert q_bf16 == 253 / 256 and P[0] < q_bf16 < Q0
    assert math.isclose((Q0 - q_bf16) / Q0, 2.0 ** -9, rel_tol=0.01)


@pytest.mark.parametrize("name", ["bf16_q", "abs_residual"])
def test_sample_size_has_the_power_to_see_each_planted_bug(name):
    pi1 = expected_under(name)
    need = required_draws(P, pi1)
    assert N_DRAWS >= need, f"{name}: {N_DRAWS} draws < {need} needed for power {POWER}"
    if name == "bf16_q":  # the derivation's numbers
        assert math.isclose(pi1[0] / P[0], Q0 / (253 / 256))
        assert 3e5 < need < N_DRAWS


def test_library_verifier_is_lossless():
    chisquare_gof(counts_of(emitted_tokens(verify_lib, SEED), 2), P,
                  label="specjax.verify.rejection_sample")


@pytest.mark.parametrize("name", list(MUTATIONS))
def test_verifier_copies(name):
    tokens = emitted_tokens(verifier_copy(name), SEED)
    res = chisquare_gof(counts_of(tokens, 2), P, check=False)
    if name == "faithful":
        assert res.passed, f"the unmodified copy must pass: {res}"
        return
    assert not res.passed, f"planted bug {name!r} was not caught: {res}"
    # ... and what was seen is the bug's own distribution, not an artefact of the copy.
    chisquare_gof(counts_of(tokens, 2), expected_under(name), label=f"{name} vs its prediction")
