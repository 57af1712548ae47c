"""The device-loop timing program of ``benchmarks/model_step_cost.py`` runs the forward it claims
to time: ``steps`` forwards at one fixed context, each fed ``(tokens + i) % vocab``.

Tolerance: the loop's forwards and the reference forwards are the same float32 operations in
different XLA programs, so they may differ only by the order of each dot's reduction. For a dot of
length n that error is at most about n·eps·Σ|a·b| (eps = 2^-24); with n ≤ 256 (the tiny preset's
widest contraction) it stays below 2e-5 of the terms' magnitude per dot, and a few layers compound
it to well under 1e-4 of the checksum's absolute terms. Feeding the same tokens every step moves
the checksum by more than 1e-3 of them (checked below), and the lengths must come back unchanged.
"""
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from benchmarks.model_step_cost import _forward_loop
from specjax.models import apply_jit, cached_forward, get_preset, init_cache, init_model


def _prefilled(config, graphdef, state, prompt, max_len):
    cache = init_cache(config, prompt.shape[0], max_len)
    return cached_forward(graphdef, state, prompt, cache).cache


def test_forward_loop_repeats_the_step_at_a_fixed_context():
    config = get_preset("tiny")
    graphdef, state = nnx.split(init_model(config, seed=0))
    batch, context, steps, max_len = 2, 12, 3, 20
    prompt = jax.random.randint(jax.random.key(1), (batch, context), 0, config.vocab_size)
    tokens = prompt[:, :4]  # a verify(3) step

    cache, checksum = _forward_loop(graphdef, state, tokens,
                                    _prefilled(config, graphdef, state, prompt, max_len),
                                    vocab=config.vocab_size, steps=steps)
    np.testing.assert_array_equal(np.asarray(cache.lengths), np.full((batch,), context))

    terms = []
    for i in range(steps):
        fresh = _prefilled(config, graphdef, state, prompt, max_len)
        out = apply_jit(graphdef, state, (tokens + i) % config.vocab_size, cache=fresh)
        terms.append(np.asarray(jnp.max(out.logits, axis=-1), np.float64))
    expected = sum(t.sum() for t in terms)
    scale = sum(np.abs(t).sum() for t in terms)
    assert abs(float(checksum) - expected) <= 1e-4 * scale, (float(checksum), expected)

    # A planted fault the check must see: the same tokens every step.
    same = sum(np.asarray(jnp.max(apply_jit(
        graphdef, state, tokens, cache=_prefilled(config, graphdef, state, prompt, max_len)
    ).logits, axis=-1), np.float64).sum() for _ in range(steps))
    assert abs(same - expected) > 1e-3 * scale
