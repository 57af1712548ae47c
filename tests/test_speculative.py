"""Speculative decoding loop at temperature 0: every drafter reproduces plain greedy decoding of the
target (with the KV cache) token for token, for rows of different lengths in one batch."""
import functools

import numpy as np
import pytest
from flax import nnx

from specjax import speculative as sp
from specjax.drafters import Sampling
from specjax.models.generate import generate as plain_generate
from test_drafters_common import ALL, GAMMA, drafter, target

PROMPTS = [[1, 2, 3, 4, 5], [3, 1], [7, 7, 7, 7, 7, 7, 7, 7, 7, 1], [9], [2, 11, 4, 14, 6, 0, 3],
           [5, 5, 12]]
MAX_NEW = 16


@functools.lru_cache(maxsize=None)
def reference():
    tokens = plain_generate(nnx.merge(*target()), PROMPTS, MAX_NEW, temperature=0.0)
    return [list(map(int, t)) for t in tokens]


def _check_stats(res: sp.SpecResult):
    assert res.num_accepted.shape == res.num_draft.shape == res.active.shape
    assert (res.num_accepted >= 0).all() and (res.num_accepted <= res.num_draft).all()
    assert (res.num_draft == GAMMA).all()
    np.testing.assert_array_equal(res.num_emitted, res.num_accepted + 1)
    # every active step emitted accepted + 1 tokens, and the rows got exactly MAX_NEW tokens
    assert all(len(t) == MAX_NEW for t in res.tokens)
    assert 1.0 <= res.tokens_per_step <= GAMMA + 1
    acc = res.acceptance_by_position()
    assert acc.shape == (GAMMA,)


# mtp_shared differs from mtp only in which head a depth indexes (covered in test_drafters.py); the
# draft LM runs as a copy of the target here (every draft accepted) and randomly in the lossless
# tests (mostly rejected).
SPEC_DRAFTERS = tuple(n for n in ALL if n not in ("mtp_shared", "draft_lm")) + ("draft_lm_self",)


@pytest.mark.parametrize("name", SPEC_DRAFTERS)
def test_greedy_spec_decoding_equals_greedy_decoding(name):
    d, params, fr = drafter(name)
    res = sp.generate(target(), d, params, fr, PROMPTS, MAX_NEW, gamma=GAMMA, method="greedy",
                      seed=3)
    assert res.tokens == reference(), (name, res.tokens, reference())
    _check_stats(res)
    if name == "draft_lm_self":  # drafting with the target itself: everything is accepted
        assert (res.num_accepted[res.active] == GAMMA).all()
        assert res.tokens_per_step == GAMMA + 1


def test_temperature_zero_rejection_sampling_equals_greedy():
    """Rejection sampling with one-hot p and q (temperature 0) is greedy decoding too."""
    d, params, fr = drafter("ngram")
    res = sp.generate(target(), d, params, fr, PROMPTS, MAX_NEW, gamma=GAMMA, method="rejection",
                      sampling=Sampling(temperature=0.0), seed=4)
    assert res.tokens == reference()
    _check_stats(res)
    assert res.mean_accepted > 0.5  # the repetitive greedy text is easy to look up


def test_generate_validates_inputs():
    d, params, fr = drafter("ngram")
    with pytest.raises(ValueError):
        sp.generate(target(), d, params, fr, [[1], []], 4, gamma=GAMMA)
    with pytest.raises(ValueError):
        sp.generate(target(), d, params, fr, [[1]], 4, gamma=GAMMA, method="beam")
    with pytest.raises(ValueError):
        sp.generate(target(), d, params, fr, [[1, 2]], 4, gamma=GAMMA, max_len=5)
