"""Cached attention costs follow the context, not max_len: the step reads only a window of the
cache and writes it in place; the device decode loop equals the host loop token for token."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from specjax.models import ModelConfig, cached_forward, init_cache, init_model
from specjax.models.attention import kv_windows
from specjax.models.generate import generate

CFG = ModelConfig(vocab_size=32, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                  num_kv_heads=2, head_dim=8)


def test_kv_windows():
    assert kv_windows(100) == (100,)
    assert kv_windows(128) == (128,)
    assert kv_windows(512) == (128, 256, 512)
    assert kv_windows(600) == (128, 256, 512, 600)
    with pytest.raises(ValueError):
        kv_windows(0)


@pytest.mark.parametrize("flat", [False, True])
def test_positions_past_the_window_are_never_read(flat):
    """NaN keys/values at every position ≥ 128 of a 1024-position cache: a step whose context fits
    the first window stays finite (one read of a NaN would poison the softmax or the value sum);
    the same step with a context past 128 reads them and is NaN (the check has power)."""
    model = init_model(CFG, seed=0)
    g, st = nnx.split(model)
    cache = init_cache(CFG, 2, 1024)
    nan_tail = jnp.arange(1024)[None, None, :, None, None] >= 128
    cache = cache.replace(k=jnp.where(nan_tail, jnp.nan, cache.k),
                          v=jnp.where(nan_tail, jnp.nan, cache.v))

    def step(context):
        c = jax.tree.map(jnp.copy, cache).rollback(jnp.asarray([context, 5], jnp.int32))
        if flat:
            from specjax.models import apply_flat_jit
            tokens = jnp.asarray([1, 2, 3, 4], jnp.int32)
            seg = jnp.asarray([0, 0, 1, 1], jnp.int32)
            return apply_flat_jit(g, st, tokens, seg, c, grid_len=2).logits
        return cached_forward(g, st, jnp.ones((2, 2), jnp.int32), c).logits

    assert np.isfinite(np.asarray(step(100))).all()
    assert np.isnan(np.asarray(step(200))).any()


def test_cached_step_writes_the_cache_in_place():
    """The compiled decode step aliases its cache output to the donated input, and outside the
    window branches it copies nothing as large as one layer's rows ``[S, max_len, KVH, Dh]`` (in
    any layout or transposition), at two cache sizes. Such a copy makes a step's cost grow with
    max_len at a fixed context. (Inside a branch, a copy of the window itself is the read.)"""
    import re
    model = init_model(CFG, seed=0)
    g, st = nnx.split(model)
    for max_len in (256, 1024):
        cache = init_cache(CFG, 4, max_len)
        comp = cached_forward.lower(g, st, jnp.zeros((4, 1), jnp.int32), cache).compile()
        mem = comp.memory_analysis()
        assert mem.alias_size_in_bytes >= cache.k.nbytes + cache.v.nbytes
        layer_row = 4 * max_len * CFG.num_kv_heads * CFG.head_dim
        copies = [line for line in comp.as_text().splitlines()
                  if " copy(" in line or "copy-start" in line]
        for line in copies:
            shape = re.search(r"= \w+\[([\d,]*)\]", line)
            size = int(np.prod([int(d) for d in shape.group(1).split(",") if d])) if shape else 0
            assert size < layer_row or "/cond/branch_" in line, line


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_device_decode_loop_equals_host_loop(temperature):
    model = init_model(CFG, seed=3)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 32, size=n).tolist() for n in (3, 7, 1)]
    kw = dict(temperature=temperature, eos_id=5, seed=11, max_len=64)
    host = generate(model, prompts, 20, loop="host", **kw)
    dev = generate(model, prompts, 20, loop="device", **kw)
    assert dev == host
    assert any(len(t) < 20 for t in dev) or 5 not in sum(dev, [])  # EOS cut where it appeared


@pytest.mark.parametrize("kind", ["mtp", "dspark"])
def test_drafters_read_only_the_window_of_their_caches(kind):
    """A drafter's own caches: NaN at every position >= 128 of a 1024-position cache. Drafting
    with contexts inside the first window stays finite; with a context past 128 the NaNs are read
    (the check has power)."""
    import dataclasses
    from specjax.drafters import DSparkConfig, DSparkDrafter, MTPConfig, MTPDrafter
    from specjax.drafters.base import shared_head
    model = init_model(CFG, seed=0)
    frozen = shared_head(model)
    if kind == "mtp":
        d, p = MTPDrafter.create(CFG, MTPConfig(), seed=1)
    else:
        d, p = DSparkDrafter.create(CFG, DSparkConfig(rank=4), seed=1)
    state = d.init_state(2, 1024, 3)
    tail = lambda c: jnp.where(jnp.arange(1024)[None, :, None, None] >= 128, jnp.nan, c)
    state = dataclasses.replace(state, k=tuple(map(tail, state.k)), v=tuple(map(tail, state.v)))

    def draft(context):
        ctx = jnp.asarray([context, 5], jnp.int32)
        st = (dataclasses.replace(state, num_emitted=ctx) if kind == "mtp"
              else dataclasses.replace(state, ctx_len=ctx))
        out, _ = jax.jit(lambda st: d.propose(p, frozen, st, jax.random.key(0), gamma=3))(st)
        return np.asarray(out.probs)

    assert np.isfinite(draft(100)).all()
    assert np.isnan(draft(300)).any()
