"""The host driver :func:`specjax.speculative.generate` (``method="greedy"``: greedy verification)
reproduces plain cached greedy decoding for rows of different lengths; its statistics are
consistent. (Every drafter at temperature 0 through the jitted step: test_speculative_lossless.py.)
"""
import numpy as np
import pytest

from specjax import speculative as sp
from test_drafters_common import (GAMMA, GREEDY_NEW, GREEDY_PROMPTS, drafter, greedy_reference,
                                  target)


def _check_stats(res: sp.SpecResult):
    assert res.num_accepted.shape == res.num_draft.shape == res.active.shape
    assert (res.num_accepted >= 0).all() and (res.num_accepted <= res.num_draft).all()
    assert (res.num_draft == GAMMA).all()
    np.testing.assert_array_equal(res.num_emitted, res.num_accepted + 1)
    assert all(len(t) == GREEDY_NEW for t in res.tokens)
    assert res.active[0].all()
    assert 1.0 <= res.tokens_per_step <= GAMMA + 1
    acc = res.acceptance_by_position()
    assert acc.shape == (GAMMA,)


@pytest.mark.parametrize("name", ["draft_lm_self", "ngram"])
def test_generate_greedy_equals_greedy_decoding(name):
    d, params, fr = drafter(name)
    res = sp.generate(target(), d, params, fr, [list(p) for p in GREEDY_PROMPTS], GREEDY_NEW,
                      gamma=GAMMA, method="greedy", seed=3)
    assert res.tokens == greedy_reference()
    _check_stats(res)
    if name == "draft_lm_self":  # drafting with the target itself: everything is accepted
        assert (res.num_accepted[res.active] == GAMMA).all()
        assert res.tokens_per_step == GAMMA + 1
        np.testing.assert_array_equal(res.acceptance_by_position(), np.ones(GAMMA))
    else:
        assert res.mean_accepted > 0.5  # the repetitive greedy text is easy to look up


def test_generate_eos_and_validation():
    d, params, fr = drafter("ngram")
    ref = greedy_reference()
    eos = ref[0][3]
    res = sp.generate(target(), d, params, fr, [list(p) for p in GREEDY_PROMPTS], GREEDY_NEW,
                      gamma=GAMMA, method="greedy", eos_id=eos)
    assert res.tokens == [r[:r.index(eos) + 1] if eos in r else r for r in ref]
    with pytest.raises(ValueError):
        sp.generate(target(), d, params, fr, [[1], []], 4, gamma=GAMMA)
    with pytest.raises(ValueError):
        sp.generate(target(), d, params, fr, [[1]], 4, gamma=GAMMA, method="beam")
    with pytest.raises(ValueError):
        sp.generate(target(), d, params, fr, [[1, 2]], 4, gamma=GAMMA, max_len=5)
