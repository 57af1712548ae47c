"""Running drafter training: :func:`run_drafter` (train a ``"drafter"`` config in a workdir) and
:func:`load_drafter` (a trained drafter back from that workdir).

Kept apart from the task itself (:mod:`specjax.training.drafter_task`) because running needs the
trainer, the config validator and the data pipeline, and those need the task registry, which
imports the task: task -> registry -> config -> trainer -> this module, never back.
"""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Optional

import jax
import numpy as np

from specjax.training import distributed, drafter_data
from specjax.training.checkpoint import restore_params
from specjax.training.config import validate_config
from specjax.training.drafter_task import PHASE_KEY, DrafterTask, LossPhaseIterator
from specjax.training.lm_task import model_config_from
from specjax.training.run import make_inputs
from specjax.training.trainer import Trainer

__all__ = ["DrafterRunResult", "load_drafter", "make_drafter_inputs", "run_drafter"]


def load_drafter(workdir: str, *, step: Optional[int] = None):
    """A trained drafter from a drafter run's workdir: ``(drafter, params, task)``.

    Reads ``<workdir>/config.json`` (written by :func:`run_drafter`) and the newest (or ``step``)
    checkpoint's params; ``task.frozen_target()`` gives the target to pair it with.
    """
    with open(os.path.join(workdir, "config.json")) as f:
        config = validate_config(json.load(f))
    task = DrafterTask(config, load_frozen=False)
    sharding = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding),
                            task.abstract_params)
    params = restore_params(os.path.join(os.path.abspath(workdir), "checkpoints"), abstract, step)
    return task.drafter, params, task


@dataclasses.dataclass
class DrafterRunResult:
    """What :func:`run_drafter` returns: ``trainer`` (its ``task`` is the :class:`DrafterTask`),
    the final ``state``, ``eval`` ``{domain: metrics}``."""

    trainer: Any
    state: Any
    eval: dict


def make_drafter_inputs(config, mesh_batch_multiple: int = 1):
    """``(train_iterator, eval_batches)`` for a drafter config: token-row files when
    ``task.data_file`` is set, else ``config.data``'s pipeline (:func:`specjax.training.run.make_inputs`)."""
    t = config.task
    d = config.data
    if t.data_file:
        rows = drafter_data.load_rows(t.data_file)
        if rows["tokens"].shape[1] != d.seq_len:
            raise ValueError(f"{t.data_file} has rows of {rows['tokens'].shape[1]} tokens but "
                             f"config.data.seq_len is {d.seq_len}")
        per_host = d.batch_size // jax.process_count()
        train = drafter_data.TokenRowsIterator(rows, batch_size=per_host, seed=d.seed,
                                               shard_index=jax.process_index(),
                                               num_shards=jax.process_count())
        evals = None
        if t.eval_file and d.eval_batches:
            heldout = drafter_data.load_rows(t.eval_file)
            evals = drafter_data.eval_batches(
                heldout, batch_size=per_host,
                max_batches=None if d.eval_batches == -1 else d.eval_batches,
                shard_index=jax.process_index(), num_shards=jax.process_count())
    else:
        train, evals, _ = make_inputs(config, model_config_from(config).vocab_size)
    if t.warm_start_loss:
        train = LossPhaseIterator(train, t.switch_step)
        if evals:
            evals = {k: _with_phase(v, 1) for k, v in evals.items()}
    return train, evals


def run_drafter(config, workdir: Optional[str], *, mesh=None, task=None,
                stop_after: Optional[int] = None, hooks=()) -> DrafterRunResult:
    """Trains a drafter config in ``workdir`` (resuming from its checkpoints when present).

    Writes ``workdir/config.json``, ``metrics.jsonl``, ``loss_curve.png`` and ``checkpoints/``
    (the drafter's params + optimizer state + data position; the target is not copied).
    ``mesh`` / ``task`` default to all devices / ``DrafterTask(config)``; ``stop_after`` / ``hooks``:
    see :meth:`~specjax.training.trainer.Trainer.train`.
    """
    config = validate_config(config)
    if config.task.name != "drafter":
        raise ValueError(f"run_drafter needs config.task.name == 'drafter', got "
                         f"{config.task.name!r}")
    distributed.maybe_initialize(config.distributed)
    trainer = Trainer(config, workdir=workdir, mesh=mesh, task=task)
    if workdir and jax.process_index() == 0:
        os.makedirs(workdir, exist_ok=True)
        with open(os.path.join(workdir, "config.json"), "w") as f:
            json.dump(trainer.config.to_dict(), f, indent=2, sort_keys=True)
    train_iter, evals = make_drafter_inputs(trainer.config)
    try:
        state = trainer.train(train_iter, evals, stop_after=stop_after, hooks=hooks)
    finally:
        trainer.close()
        close = getattr(train_iter, "close", None)
        if close is not None:
            close()
    return DrafterRunResult(trainer=trainer, state=state, eval=trainer.last_eval)


def _with_phase(batches, phase: int):
    out = []
    for b in batches:
        b = dict(b)
        b[PHASE_KEY] = np.full(np.shape(b["inputs"]), phase, np.int32)
        out.append(b)
    return out
