"""Shared fixtures of the drafter / speculative-loop tests: a tiny *sharp* random target, one of each
drafter (random but non-trivial params), and a chi-square test for sequentially sampled drafts.

Random init (normal(0, 0.02)) gives a near-uniform target and drafters whose q barely depends on
the context, which would make the exactness tests weak; every non-norm parameter is scaled up
(target x20: next-token entropy ~1.4 nats with V = 16; drafters x10) so that p and q are sharp,
context dependent and different from each other (acceptance well inside (0, 1)).
"""
from __future__ import annotations

import functools

import jax
import numpy as np
from flax import nnx

from specjax.drafters import (DraftLMDrafter, DSparkConfig, DSparkDrafter, MTPConfig, MTPDrafter,
                              NGramDrafter, dflash_config, shared_head)
from specjax.models import ModelConfig, init_model
from stats import chisquare_gof

VOCAB = 16
CONFIG = ModelConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_layers=2,
                     num_heads=4, num_kv_heads=2, head_dim=8)
GAMMA = 3

NEURAL = ("mtp", "mtp_shared", "dspark_markov", "dspark_rnn", "dflash", "draft_lm")
ALL = NEURAL + ("ngram",)


def scale_params(state, factor: float):
    """Multiplies every parameter except norm scales by ``factor``."""
    def sc(path, x):
        name = "/".join(str(getattr(p, "key", p)) for p in path)
        return x if "norm" in name else x * factor
    return jax.tree_util.tree_map_with_path(sc, state)


@functools.lru_cache(maxsize=None)
def target():
    """``(graphdef, state)`` of the tiny sharp target."""
    graphdef, state = nnx.split(init_model(CONFIG, seed=1))
    return graphdef, scale_params(state, 20.0)


@functools.lru_cache(maxsize=None)
def frozen():
    return shared_head(target())


@functools.lru_cache(maxsize=None)
def drafter(name: str):
    """``(drafter, params, frozen)`` for one of :data:`ALL` (and ``draft_lm_self``)."""
    if name == "mtp":  # 2 heads, γ = 3: depth 3 reuses the last head
        d, p = MTPDrafter.create(CONFIG, MTPConfig(num_heads=2), seed=3)
    elif name == "mtp_shared":
        d, p = MTPDrafter.create(CONFIG, MTPConfig(shared=True, intermediate_size=48), seed=4)
    elif name == "dspark_markov":
        d, p = DSparkDrafter.create(CONFIG, DSparkConfig(target_layers=(1, 2), rank=8), seed=5)
    elif name == "dspark_rnn":
        d, p = DSparkDrafter.create(CONFIG, DSparkConfig(head="rnn", rank=8, num_layers=2), seed=6)
    elif name == "dflash":
        d, p = DSparkDrafter.create(CONFIG, dflash_config(target_layers=(0, 2)), seed=7)
    elif name == "draft_lm":
        d, p = DraftLMDrafter.create(CONFIG.replace(num_layers=1, intermediate_size=32), seed=8)
        return d, scale_params(p, 15.0), None
    elif name == "draft_lm_self":  # the target itself: every greedy draft is accepted
        return (DraftLMDrafter(CONFIG, target()[0]), target()[1], None)
    elif name == "ngram":
        return NGramDrafter(VOCAB, max_ngram=3), None, None
    else:
        raise KeyError(name)
    return d, scale_params(p, 10.0), frozen()


def sequential_gof(tokens: np.ndarray, probs: np.ndarray, label: str = "", check: bool = True):
    """Chi-square test that ``tokens[:, k] ~ probs[:, k]`` sequentially (rows i.i.d.).

    ``tokens [N, K]``, ``probs [N, K, V]`` where ``probs[n, k]`` may depend on ``tokens[n, :k]``
    (it must be the same for rows sharing that prefix: asserted). Bins: every full K-token
    sequence whose (K-1)-prefix was observed, plus one bin per unobserved shorter prefix holding
    its whole mass; expected probability of a bin = product of the returned q along it.
    """
    n, k_len = tokens.shape
    counts, masses = [], []

    def rec(rows, depth, mass):
        q = probs[rows[0], depth].astype(np.float64)
        np.testing.assert_allclose(probs[rows, depth], np.broadcast_to(q, (len(rows), len(q))),
                                   atol=2e-6, err_msg=f"{label}: rows sharing a prefix disagree on q")
        x = tokens[rows, depth]
        for v in range(len(q)):
            sel = rows[x == v]
            if depth == k_len - 1 or len(sel) == 0:
                counts.append(len(sel))
                masses.append(mass * q[v])
            else:
                rec(sel, depth + 1, mass * q[v])

    rec(np.arange(n), 0, 1.0)
    return chisquare_gof(np.array(counts), np.array(masses), label=label, check=check)


# Prompts of different lengths for the temperature-0 (greedy) equivalence tests.
GREEDY_PROMPTS = ((1, 2, 3, 4, 5), (3, 1), (7, 7, 7, 7, 7, 7, 7, 7, 7, 1), (9,),
                  (2, 11, 4, 14, 6, 0, 3), (5, 5, 12))
GREEDY_NEW = 16


@functools.lru_cache(maxsize=None)
def greedy_reference():
    """Plain cached greedy decoding of the target (``specjax.models.generate``)."""
    from specjax.models.generate import generate as plain_generate
    tokens = plain_generate(nnx.merge(*target()), [list(p) for p in GREEDY_PROMPTS], GREEDY_NEW,
                            temperature=0.0)
    return [list(map(int, t)) for t in tokens]
