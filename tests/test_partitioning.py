"""``specjax.models.partitioning.constrain_batch``: pins the batch axis only inside a mesh context
with batch axes of size > 1, only when the batch divides them, and never inside
``unconstrained()``; the trainer's steps trace under their mesh."""
import jax
import jax.numpy as jnp
import pytest

from specjax.models import partitioning
from specjax.training.sharding import LOGICAL_AXIS_RULES, make_mesh


def _constrained(fn, x, mesh=None) -> bool:
    def traced(x):
        if mesh is None:
            return fn(x)
        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
            return fn(x)
    return "sharding_constraint" in jax.jit(traced).lower(x).as_text()


def test_rule_table_and_module_agree():
    assert LOGICAL_AXIS_RULES["batch"] == partitioning.BATCH_MESH_AXES


@pytest.mark.parametrize("shape", [(8, 3), (8, 2, 5)])
def test_pins_the_batch_on_a_mesh_only(shape):
    x = jnp.ones(shape)
    fsdp = make_mesh({"data": 1, "fsdp": -1, "tensor": 1})
    tensor = make_mesh({"data": 1, "fsdp": 1, "tensor": -1})
    assert _constrained(partitioning.constrain_batch, x, fsdp)
    assert not _constrained(partitioning.constrain_batch, x)  # no mesh context
    assert not _constrained(partitioning.constrain_batch, x, tensor)  # no batch axis > 1
    assert not _constrained(partitioning.constrain_batch, jnp.ones((3,) + shape[1:]), fsdp)

    def off(x):
        with partitioning.unconstrained():
            return partitioning.constrain_batch(x)
    assert not _constrained(off, x, fsdp)
    # values never change
    with jax.sharding.use_abstract_mesh(fsdp.abstract_mesh):
        assert (jax.jit(partitioning.constrain_batch)(x) == x).all()


def test_trainer_traces_its_step_under_its_mesh():
    from specjax.training.config import default_config
    from specjax.training.trainer import Trainer
    from specjax.aot.programs import abstract_batch
    c = default_config("lm")
    c.model.preset = "tiny"
    c.data.batch_size, c.data.seq_len = 8, 16
    c.mesh.data, c.mesh.fsdp, c.mesh.tensor = 1, -1, 1
    trainer = Trainer(c, mesh=make_mesh(c.mesh.to_dict()))
    text = trainer._step.lower(trainer.abstract_state, abstract_batch(trainer.config),
                               trainer.abstract_frozen).as_text()
    assert 'sharding_constraint' in text and '{"fsdp"}' in text
