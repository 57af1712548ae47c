"""Orbax checkpoints of the train state and the input iterators' positions.

One checkpoint = directory ``<workdir>/checkpoints/<step>/`` with two items:

* ``state`` — the :class:`~specjax.training.trainer.TrainState` (step, params, optimizer state,
  RNG key), saved from its sharded arrays (each process writes its own shards) and restored
  directly into the target shardings;
* ``data``  — JSON ``{"processes": [state_of_process_0, state_of_process_1, ...]}``: every
  process's iterator position (they read different shards, so each has its own). The states are
  all-gathered to process 0, which writes them; on restore each process takes its own entry.

Saves are asynchronous: ``save`` returns once the arrays are copied to host memory and training
continues while a background thread writes. Orbax writes into a temporary directory and renames it
only after every file is committed, so a process killed mid-save (even SIGKILL) leaves no
checkpoint that looks complete: :meth:`Checkpointer.latest_step` only sees finished ones.
"""
from __future__ import annotations

import json
import os
from typing import Any, Optional

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath


def _allgather_json(value: Any) -> list:
    """Every process's ``value`` (JSON-serialisable), in process order."""
    if jax.process_count() == 1:
        return [value]
    from jax.experimental import multihost_utils
    data = np.frombuffer(json.dumps(value).encode(), np.uint8)
    lengths = multihost_utils.process_allgather(np.array([len(data)], np.int32))
    padded = np.zeros(int(np.max(lengths)), np.uint8)
    padded[:len(data)] = data
    gathered = multihost_utils.process_allgather(padded)
    return [json.loads(bytes(row[:int(n)]).decode())
            for row, n in zip(np.asarray(gathered), np.asarray(lengths).reshape(-1))]


def _state_handler(replica_parallel: bool) -> ocp.PyTreeCheckpointHandler:
    """PyTree handler whose ``jax.Array`` handler has replica-parallel writes on or off.

    Replica-parallel saving splits each *replicated* array into per-replica slices so replicas
    write in parallel (good for bandwidth on large pods). Each distinct slice is an eager
    ``lax.slice`` that compiles on first use: on fake CPU devices that is ~600 compilations and
    seconds of blocking on the first save of every process, for no gain. Hence "auto" = off on CPU.
    """
    th = ocp.type_handlers
    registry = th.create_type_handler_registry(
        (int, th.ScalarHandler()), (float, th.ScalarHandler()), (bytes, th.ScalarHandler()),
        (np.number, th.ScalarHandler()), (np.ndarray, th.NumpyHandler()),
        (jax.Array, th.ArrayHandler(use_replica_parallel=replica_parallel)),
        (str, th.StringHandler()))
    return ocp.PyTreeCheckpointHandler(type_handler_registry=registry)


def abstract_with_shardings(tree: Any, shardings: Any) -> Any:
    """``jax.ShapeDtypeStruct`` leaves carrying the shardings to restore into."""
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                        tree, shardings)


class Checkpointer:
    """Keep-N, optionally asynchronous checkpoints of ``(state, per-process data state)``.

    Args:
      directory: absolute path (``<workdir>/checkpoints``); created if missing.
      keep: newest checkpoints to keep.
      async_save: write in a background thread.
      replica_parallel: see :func:`_state_handler`; ``None`` = on unless the backend is CPU.
    """

    def __init__(self, directory: str, *, keep: int = 3, async_save: bool = True,
                 replica_parallel: Optional[bool] = None):
        if replica_parallel is None:
            replica_parallel = jax.default_backend() != "cpu"
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True,
                                               enable_async_checkpointing=async_save)
        registry = ocp.handlers.DefaultCheckpointHandlerRegistry()
        state_handler = _state_handler(replica_parallel)
        registry.add("state", ocp.args.PyTreeSave, state_handler)
        registry.add("state", ocp.args.PyTreeRestore, state_handler)
        registry.add("data", ocp.args.JsonSave, ocp.JsonCheckpointHandler())
        registry.add("data", ocp.args.JsonRestore, ocp.JsonCheckpointHandler())
        self.directory = directory
        self._manager = ocp.CheckpointManager(directory, options=options,
                                              handler_registry=registry)

    def latest_step(self) -> Optional[int]:
        """Newest *complete* checkpoint's step, or ``None``."""
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        return list(self._manager.all_steps())

    def save(self, step: int, state: Any, data_state: Any) -> None:
        """Starts saving; returns once device buffers are safe to donate / overwrite.

        ``data_state`` is this process's iterator state; it must be captured *now* (the caller's
        iterator keeps moving), so it is serialised eagerly.
        """
        payload = {"processes": _allgather_json(json.loads(json.dumps(data_state)))}
        self._manager.save(step, args=ocp.args.Composite(
            state=ocp.args.PyTreeSave(state), data=ocp.args.JsonSave(payload)))

    def restore(self, step: int, abstract_state: Any) -> tuple[Any, Any]:
        """Returns ``(state, this process's data state)``; ``abstract_state`` leaves are
        ``ShapeDtypeStruct`` with shardings (see :func:`abstract_with_shardings`)."""
        restore_args = ocp.checkpoint_utils.construct_restore_args(abstract_state)
        restored = self._manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.PyTreeRestore(item=abstract_state, restore_args=restore_args),
            data=ocp.args.JsonRestore()))
        per_process = restored.data["processes"]
        if len(per_process) != jax.process_count():
            raise ValueError(f"checkpoint {step} in {self.directory} was written by "
                             f"{len(per_process)} processes, this run has {jax.process_count()}; "
                             f"the input iterators' positions cannot be mapped")
        return restored.state, per_process[jax.process_index()]

    def wait(self) -> None:
        """Blocks until pending asynchronous saves are committed."""
        self._manager.wait_until_finished()

    def close(self) -> None:
        self._manager.close()


def restore_params(directory: str, abstract_params: Any, step: Optional[int] = None) -> Any:
    """Loads only ``params`` from a trainer checkpoint, directly into the given shardings.

    This is how a drafter task loads its frozen target: ``abstract_params`` is a pytree of
    ``ShapeDtypeStruct`` (with ``sharding``) shaped like the target's params. ``step`` defaults to
    the newest complete checkpoint.
    """
    manager = ocp.CheckpointManager(directory)
    try:
        step = manager.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no complete checkpoint in {directory}")
        restore_args = jax.tree.map(
            lambda x: ocp.ArrayRestoreArgs(sharding=x.sharding, global_shape=x.shape,
                                           dtype=x.dtype), abstract_params)
        restored = manager.restore(step, args=ocp.args.Composite(state=ocp.args.PyTreeRestore(
            item={"params": abstract_params}, restore_args={"params": restore_args},
            partial_restore=True)))
        return restored.state["params"]
    finally:
        manager.close()


def run_checkpoints_dir(workdir: str) -> str:
    """``<workdir>/checkpoints``, absolute for a local path; a URL (``gs://...``, what pods use)
    is kept as given."""
    base = workdir if "://" in workdir else os.path.abspath(workdir)
    return os.path.join(base, "checkpoints")


def warm_start_params(workdir: str, abstract_params: Any) -> Any:
    """The newest params of the run in ``workdir`` (its ``checkpoints/``), as host arrays shaped
    like ``abstract_params`` (a pytree of ``ShapeDtypeStruct``): what a task's ``init_from``
    starts a new run from (the trainer then places them with its own shardings)."""
    sharding = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding),
                            abstract_params)
    directory = run_checkpoints_dir(workdir)
    if not epath.Path(directory).is_dir():  # checked first: Orbax's manager would create it
        raise FileNotFoundError(f"init_from={workdir!r}: no {directory}; give the workdir of a "
                                "run that saved a checkpoint")
    return jax.device_get(restore_params(directory, abstract))
