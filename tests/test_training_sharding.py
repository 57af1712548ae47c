"""Mesh + logical-axis rules on 8 fake CPU devices: parameter (and Adam-moment) shardings are what
the rules table says, a data x fsdp x tensor = 2 x 2 x 2 train step (with and without gradient
accumulation) matches the single-device step, the step compiles once, and indivisible shapes or
meshes fail with messages naming the parameter / field."""
import jax
import numpy as np
import pytest
from _train_common import base_config
from jax.sharding import PartitionSpec as P

from specjax.models import get_preset
from specjax.training import (LOGICAL_AXIS_RULES, ConfigError, LMTask, ShardingError,
                              SyntheticLMIterator, Trainer, logical_to_spec, make_mesh,
                              tree_shardings)

MESH_222 = {"mesh.data": 2, "mesh.fsdp": 2, "mesh.tensor": 2}
# What the rules table gives the tiny model's parameters on a 2 x 2 x 2 mesh.
EXPECTED = {
    "['embed']": P("tensor", "fsdp"),  # (vocab, embed)
    "['final_norm']['scale']": P(),
    "['layers'][0]['attn']['q_proj']": P("fsdp", "tensor"),  # (embed, heads, head_dim)
    "['layers'][0]['attn']['k_proj']": P("fsdp", "tensor"),  # (embed, kv_heads, head_dim)
    "['layers'][0]['attn']['v_proj']": P("fsdp", "tensor"),
    "['layers'][0]['attn']['o_proj']": P("tensor", None, "fsdp"),  # (heads, head_dim, embed)
    "['layers'][0]['attn']['q_norm']['scale']": P(),  # (head_dim,)
    "['layers'][0]['mlp']['gate_proj']": P("fsdp", "tensor"),  # (embed, mlp)
    "['layers'][0]['mlp']['down_proj']": P("tensor", "fsdp"),  # (mlp, embed)
    "['layers'][1]['input_norm']['scale']": P(),
}


def _flat(tree, is_leaf=None):
    return {jax.tree_util.keystr(p): v
            for p, v in jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)[0]}


def _train(config, steps=3, mesh=None):
    trainer = Trainer(config, mesh=mesh)
    it = SyntheticLMIterator(batch_size=config.data.batch_size, seq_len=config.data.seq_len,
                             vocab_size=trainer.task.model_config.vocab_size)
    state = trainer.init_state()
    losses = []
    for _ in range(steps):
        batch = next(it)
        # Uneven loss tokens across rows (so across the strided microbatches 0,2,4,.. / 1,3,..):
        # only a token-weighted accumulation reproduces the full-batch token mean.
        batch["loss_mask"][0, :20] = 0
        batch["loss_mask"][2] = 0
        state, metrics = trainer.step(state, batch)
        losses.append(float(metrics["loss"]))
    return trainer, state, losses




def test_rules_table_specs_for_every_parameter():
    mesh = make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    task = LMTask(get_preset("tiny"))
    abstract = jax.eval_shape(task.init_params, jax.random.PRNGKey(0))
    specs = _flat(jax.tree.map(lambda s: s.spec, tree_shardings(
        abstract, task.param_logical_axes(), mesh)))
    for name, spec in EXPECTED.items():
        assert specs[name] == spec, name
    # Every spec follows the table: dimension i gets rule(logical_axes[i]) (size-1 axes dropped).
    axes = _flat(task.param_logical_axes(), is_leaf=lambda x: isinstance(x, tuple))
    for name, names in axes.items():
        want = [LOGICAL_AXIS_RULES.get(n) for n in names]
        got = list(specs[name]) + [None] * (len(names) - len(specs[name]))
        assert got == want, name


def test_sharded_accumulating_step_matches_single_device_step():
    """2 x 2 x 2 mesh with 2 microbatches vs one device with the whole batch: same losses and
    parameters after 3 steps (accumulation is token-weighted, so it is the full-batch gradient).
    Compiling costs more than stepping here, hence both claims share one sharded run."""
    one = make_mesh({"data": 1, "fsdp": 1, "tensor": 1}, devices=jax.devices()[:1])
    _, ref_state, ref_losses = _train(base_config({"checkpoint.every": -1}), mesh=one)
    ref_state = jax.device_get(ref_state)

    config = base_config({**MESH_222, "checkpoint.every": -1, "train.grad_accum_steps": 2})
    trainer, state, losses = _train(config)
    assert trainer.mesh.shape == {"data": 2, "fsdp": 2, "tensor": 2}
    assert trainer._step._cache_size() == 1, "born-sharded state: the step compiles once"

    # Actual shardings of the live state are the rules' (params and Adam moments alike).
    params = _flat(state.params)
    mu = _flat(state.opt_state.inner_state[1][0].mu)  # chain(clip, adamw) -> adamw's ScaleByAdam
    for name, spec in EXPECTED.items():
        assert params[name].sharding.spec == spec, name
        assert mu[name].sharding.spec == spec, name
        assert len(params[name].sharding.device_set) == 8

    np.testing.assert_allclose(losses, ref_losses, rtol=2e-5)
    got, ref = _flat(jax.device_get(state.params)), _flat(ref_state.params)
    for name in ref:
        np.testing.assert_allclose(got[name], ref[name], rtol=2e-4, atol=2e-6, err_msg=name)
    assert int(state.step) == int(ref_state.step) == 3


def test_indivisible_dimension_names_parameter_and_axis():
    mesh = make_mesh({"data": 1, "fsdp": 1, "tensor": 8})
    task = LMTask(get_preset("tiny"))  # 2 kv heads cannot split 8 ways
    abstract = jax.eval_shape(task.init_params, jax.random.PRNGKey(0))
    with pytest.raises(ShardingError, match=r"\['layers'\]\[0\]\['attn'\]\['k_proj'\].*"
                                            r"'kv_heads'.*size 2.*\('tensor',\)"):
        tree_shardings(abstract, task.param_logical_axes(), mesh)
    # The documented fallback replicates just that dimension.
    shardings = _flat(tree_shardings(abstract, task.param_logical_axes(), mesh,
                                     on_indivisible="replicate"))
    assert shardings["['layers'][0]['attn']['k_proj']"].spec == P()  # 2 kv heads
    assert shardings["['layers'][0]['attn']['q_proj']"].spec == P()  # 4 heads
    assert shardings["['layers'][0]['mlp']['gate_proj']"].spec == P(None, "tensor")  # 128 / 8
    assert shardings["['embed']"].spec == P("tensor")  # 256 / 8


def test_mesh_that_does_not_divide_devices_fails_naming_field():
    with pytest.raises(ShardingError, match=r"config\.mesh.*3 devices.*8"):
        make_mesh({"data": 1, "fsdp": 3, "tensor": 1})
    with pytest.raises(ShardingError, match=r"config\.mesh\.fsdp=-1 cannot be filled"):
        make_mesh({"data": 3, "fsdp": -1, "tensor": 1})
    with pytest.raises(ConfigError, match=r"config\.mesh"):
        Trainer(base_config({"mesh.data": 4, "mesh.fsdp": 4}))  # 16 > 8 devices
    with pytest.raises(ConfigError, match=r"config\.data\.batch_size.*data x fsdp = 8"):
        Trainer(base_config({"mesh.data": 2, "mesh.fsdp": 4, "data.batch_size": 4}))


def test_logical_to_spec_uses_each_mesh_axis_once():
    mesh = make_mesh({"data": 1, "fsdp": 2, "tensor": 4})
    # heads and mlp both map to 'tensor': the second one is replicated, not an invalid spec.
    assert logical_to_spec(("heads", "mlp"), (8, 8), mesh) == P("tensor")
    assert logical_to_spec(("batch", "length"), (4, 3), mesh) == P("fsdp")
    with pytest.raises(ShardingError, match="do not match its shape"):
        logical_to_spec(("embed",), (4, 4), mesh, name="w")
