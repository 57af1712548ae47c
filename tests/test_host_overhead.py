"""Per-call host work the engine and the decoders avoid: hashing a graphdef at every jitted call
(specjax.models.graphdef keeps the hash) and folding the host loop's drafting key eagerly."""
import functools
import pickle

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from _shared_once import count_graphdef_hashes

from specjax.drafters import DraftLMDrafter, DSparkDrafter, MTPDrafter
from specjax.models import ModelConfig, init_model
from specjax.models.generate import generate
from specjax.models.graphdef import HashedGraphDef, hash_once

CFG = ModelConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_layers=2, num_heads=2,
                  num_kv_heads=1, head_dim=8)


def test_a_hashed_graphdef_is_the_graphdef_it_wraps():
    model = init_model(CFG, seed=0)
    graphdef, state = nnx.split(model)
    h = hash_once(graphdef)
    assert isinstance(h, HashedGraphDef) and isinstance(h, nnx.GraphDef)
    assert h == graphdef and graphdef == h and not (h != graphdef) and not (graphdef != h)
    assert hash(h) == hash(graphdef)
    assert hash_once(h) is h and hash_once("not a graphdef") == "not a graphdef"
    other = nnx.split(init_model(CFG.replace(num_layers=1), seed=0))[0]
    assert hash_once(other) != h and h != other
    assert pickle.loads(pickle.dumps(h)) == h
    assert jax.tree.leaves({"g": h, "x": 1}) == [1]  # static, like a GraphDef
    merged = nnx.merge(h, state)
    x = jnp.asarray([[1, 2, 3]])
    np.testing.assert_array_equal(merged(x).logits, model(x).logits)


def test_the_hash_is_computed_once():
    graphdef = nnx.split(init_model(CFG, seed=0))[0]
    h = hash_once(graphdef)
    traces = []

    @functools.partial(jax.jit, static_argnames=("g",))
    def f(x, g):
        traces.append(g)
        return x + 1

    with count_graphdef_hashes() as computed:
        for _ in range(5):
            f(1.0, g=h)
    assert computed == ["HashedGraphDef"] and len(traces) == 1
    with count_graphdef_hashes() as computed:
        for _ in range(5):
            f(1.0, g=graphdef)
    # a plain graphdef: hashed at every call; jit keys on the type too, so it traced again
    assert len(computed) >= 5 and len(traces) == 2


def test_drafters_and_generate_hold_hashed_graphdefs():
    from specjax.drafters import DSparkConfig, MTPConfig
    for drafter, _ in (MTPDrafter.create(CFG, MTPConfig(), seed=1),
                       DSparkDrafter.create(CFG, DSparkConfig(rank=4), seed=1),
                       DraftLMDrafter.create(CFG.replace(num_layers=1), seed=1)):
        assert isinstance(drafter.graphdef, HashedGraphDef), type(drafter)
    model = init_model(CFG, seed=0)
    generate(model, [[1, 2, 3]], 4, max_len=16, loop="host")  # compiled here
    with count_graphdef_hashes() as computed:
        out = generate(model, [[1, 2, 3]], 4, max_len=16, loop="host")
    assert len(out[0]) == 4
    # one hash for this call's graphdef (nnx.split makes a new one), not one per step
    assert computed == ["HashedGraphDef"]


def test_the_host_loops_drafting_keys_are_the_eager_fold_ins():
    """Engine._next_key folds the draw count into the engine's key in a jitted call: the keys are
    those of the eager ``jax.random.fold_in(key, n)`` it replaced, n = 1, 2, ..."""
    from types import SimpleNamespace

    from specjax.engine import Engine
    eng = SimpleNamespace(_key=jax.random.key(7), _draws=0)
    got = [jax.random.key_data(Engine._next_key(eng)) for _ in range(3)]
    want = [jax.random.key_data(jax.random.fold_in(jax.random.key(7), n)) for n in (1, 2, 3)]
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert eng._draws == 3
