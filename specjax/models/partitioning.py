"""Where activations live on a device mesh: the batch axis of activations, pinned.

specjax's models carry no sharding of their own: a jitted step gets its inputs' and parameters'
shardings (``specjax.training.sharding``) and XLA's partitioner propagates them. One place where
propagation goes wrong is the embedding lookup under FSDP: the table ``[V, D]`` is sharded on
``D`` over the ``fsdp`` axis and the tokens ``[B, T]`` on ``B`` over the same axis, and the
gather's output ``[B, T, D]`` can keep only one of the two. The partitioner keeps the table's,
which replicates the batch: every chip then runs the whole global batch through the network (per
chip memory grew with the number of chips at one row per chip, measured by ``specjax.aot``
compiles for TPU; tests/test_aot_tpu.py). :func:`constrain_batch` after the lookup keeps the
batch split, so the table is all-gathered instead (what FSDP means).

A no-op outside a mesh context (``jax.set_mesh`` or ``jax.sharding.use_abstract_mesh``), so
single-device code, tests and the engine are unchanged; the trainer traces its steps under its
mesh. The constraint sits after the embedding lookup and the LM head
(``specjax.models.transformer.embed_lookup`` / ``head_logits``, shared by the target and the
drafters' frozen head).
"""
from __future__ import annotations

import contextlib
import contextvars
import math

import jax
from jax.sharding import PartitionSpec

# The mesh axes the batch of activations is split over, major to minor: the "batch" entry of
# specjax.training.sharding.LOGICAL_AXIS_RULES, which is defined from this one.
BATCH_MESH_AXES = ("data", "fsdp")

_ENABLED = contextvars.ContextVar("specjax_constrain_batch", default=True)


@contextlib.contextmanager
def unconstrained():
    """Inside the ``with`` (at trace time), :func:`constrain_batch` does nothing: for programs
    whose leading axis is not a batch to split over ``data`` / ``fsdp``, e.g. the serving
    engine's steps compiled ahead of time, whose slots are replicated over the ``data`` axis
    (independent engine replicas, ``specjax.aot.engine_steps``)."""
    token = _ENABLED.set(False)
    try:
        yield
    finally:
        _ENABLED.reset(token)


def batch_axes() -> tuple:
    """``(axes, shards)``: the active mesh's batch axes of size > 1 and the product of their
    sizes; ``((), 1)`` outside a mesh or inside :func:`unconstrained`."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or not _ENABLED.get():
        return (), 1
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))
    axes = tuple(a for a in BATCH_MESH_AXES if sizes.get(a, 1) > 1)
    return axes, math.prod(sizes[a] for a in axes)


def constrain_batch(x: jax.Array) -> jax.Array:
    """``x [B, ...]`` with its leading axis split over the active mesh's batch axes.

    Returns ``x`` unchanged when no mesh is active, inside :func:`unconstrained`, when the mesh
    has no batch axis of size > 1, or when ``B`` is not divisible by their product (then the
    partitioner decides, as before).
    """
    axes, shards = batch_axes()
    if not axes or x.ndim == 0 or x.shape[0] % shards:
        return x
    return jax.lax.with_sharding_constraint(x, PartitionSpec(axes))
