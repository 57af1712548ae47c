"""The trainer: sharded init, a jitted donating train step, eval, checkpoints (the host loop that
drives them, with logging, is ``train_loop.py``).

Usage::

    trainer = Trainer(config, workdir="runs/run")          # validates config, builds mesh + jit fns
    state = trainer.train(train_iter, eval_batches)          # resumes from workdir if possible
    trainer.last_eval                                        # {domain: {"ce": ..., ...}}

Everything on the device is a pure function of pytrees (docs/DESIGN.md, "Invariants" 3):

* :class:`TrainState` ``(step, params, opt_state, rng)`` is created by
  ``jax.jit(init_fn, out_shardings=state_shardings)`` — born sharded, and with exactly the
  shardings the train step takes and returns, so the step compiles once;
* the step is ``jax.jit(step_fn, donate_argnums=0)``: the old state's buffers are reused;
* ``frozen`` (the task's non-trained pytree) is placed once and passed to every step
  (not donated, not differentiated, not checkpointed).

Gradient accumulation splits the global batch ``[B, ...]`` into ``M`` microbatches by *strided*
rows (``x.reshape(B/M, M, ...).swapaxes(0, 1)``), so each microbatch is spread over every device
like the full batch, and ``lax.scan``s over them. Microbatch losses / gradients are combined by the
task's ``loss_weight`` (tokens), so ``M`` microbatches give the full-batch gradient of a
token-mean loss up to float summation order.
"""
from __future__ import annotations

import functools
import os
from typing import Any, Mapping, NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from specjax.compiler_options import parse_compiler_options
from specjax.models.attention import query_chunks
from specjax.training import checkpoint as ckpt_lib
from specjax.training import inputs as inputs_lib
from specjax.training import sharding as sharding_lib
from specjax.training.config import ConfigError, validate_config
from specjax.training.optimizer import current_learning_rate, make_optimizer
from specjax.training.registry import make_task
from specjax.training.tasks import LOSS_WEIGHT, TrainTask
from specjax.training.train_loop import StepHook, train_loop

PyTree = Any


class TrainState(NamedTuple):
    """Everything a resumed run needs from the device.

    step: int32 ``[]`` — optimizer steps taken.
    params: the task's trained pytree.
    opt_state: optax state (its ``hyperparams["learning_rate"]`` is the LR of the last update).
    rng: uint32 ``[2]`` raw PRNG key; split once per step (part goes to the loss).
    """

    step: jax.Array
    params: PyTree
    opt_state: PyTree
    rng: jax.Array


def _is_leaf_sharding(x) -> bool:
    return isinstance(x, NamedSharding)


def split_microbatches(x: jax.Array, num: int) -> jax.Array:
    """``[B, ...] -> [num, B // num, ...]``, microbatch ``i`` = rows ``i, i + num, ...``."""
    return x.reshape((x.shape[0] // num, num) + x.shape[1:]).swapaxes(0, 1)


def abstract_frozen(task: TrainTask) -> PyTree:
    """Shapes and dtypes of ``task.init_frozen()`` without creating it: the task's own
    ``abstract_frozen()`` when it has one (a drafter task's frozen target may be gigabytes),
    else ``jax.eval_shape(task.init_frozen)``."""
    fn = getattr(task, "abstract_frozen", None)
    return fn() if fn is not None else jax.eval_shape(task.init_frozen)


class Trainer:
    """Owns the mesh, shardings, optimizer, jitted functions, checkpoints and metric files.

    Args:
      config: a training config (validated here against :func:`default_config`'s schema, the
        device count and the process count).
      workdir: where ``checkpoints/``, ``metrics.jsonl``, ``loss_curve.png`` go. ``None`` disables
        checkpointing and files (in-memory runs, e.g. tests of the step).
      task: defaults to the registered task named by ``config.task.name``.
      mesh: defaults to :func:`sharding.make_mesh` over all devices with ``config.mesh``.

    ``compiler_options``: ``config.train.tpu_compiler_options`` as a dict when the mesh's devices
    are TPUs (a TPU VM, or a topology's devices for ahead-of-time compilation), else ``None``;
    the train and eval steps are jitted with it.
    """

    def __init__(self, config: Any, *, workdir: Optional[str] = None,
                 task: Optional[TrainTask] = None, mesh: Optional[Mesh] = None):
        num_devices = mesh.devices.size if mesh is not None else jax.device_count()
        self.config = validate_config(config, num_devices=num_devices,
                                      num_processes=jax.process_count())
        cfg = self.config
        self.mesh = mesh if mesh is not None else sharding_lib.make_mesh(cfg.mesh.to_dict())
        if tuple(self.mesh.axis_names) != sharding_lib.MESH_AXES:
            raise ValueError(f"mesh axes must be {sharding_lib.MESH_AXES}, got "
                             f"{self.mesh.axis_names}")
        wanted = sharding_lib.resolve_mesh_shape(cfg.mesh.to_dict(), self.mesh.devices.size)
        if tuple(self.mesh.devices.shape) != wanted:
            raise ConfigError(f"config.mesh resolves to {wanted} but the given mesh is "
                              f"{dict(self.mesh.shape)}")
        shards = sharding_lib.batch_shards(self.mesh)
        if jax.process_count() > 1 and shards % jax.process_count():
            raise ConfigError(
                f"config.mesh: the batch is split {shards} ways (data x fsdp) but there are "
                f"{jax.process_count()} processes, each feeding different rows; make data x fsdp "
                f"a multiple of the process count")
        self.task = task if task is not None else make_task(cfg)
        self.tx = make_optimizer(cfg.optimizer, cfg.train.num_steps)
        self.workdir = os.path.abspath(workdir) if workdir else None
        self.is_main = jax.process_index() == 0

        self.abstract_state: TrainState = jax.eval_shape(self._init_fn, jax.random.PRNGKey(0))
        self.state_shardings: TrainState = self._state_shardings()
        self.abstract_frozen = abstract_frozen(self.task)
        self.frozen_shardings = sharding_lib.tree_shardings(
            self.abstract_frozen, self.task.frozen_logical_axes(), self.mesh,
            on_indivisible=cfg.sharding.on_indivisible)
        self._frozen = None  # placed on first use (ahead-of-time compilation never needs it)
        self._batch_sharding = NamedSharding(
            self.mesh, sharding_lib.batch_sharding(self.mesh, 1).spec)
        replicated = sharding_lib.replicated(self.mesh)

        # TPU-only compiler options: the CPU and GPU compilers refuse TPU flags by name.
        self.compiler_options = (
            parse_compiler_options(cfg.train.tpu_compiler_options)
            if self.mesh.devices.flat[0].platform == "tpu" else {}) or None
        self._init = jax.jit(self._init_fn, out_shardings=self.state_shardings)
        self._step = jax.jit(
            self._on_mesh(self._train_step),
            in_shardings=(self.state_shardings, self._batch_sharding, self.frozen_shardings),
            out_shardings=(self.state_shardings, replicated), donate_argnums=0,
            compiler_options=self.compiler_options)
        self._eval_step = jax.jit(
            self._on_mesh(self._eval_fn),
            in_shardings=(self.state_shardings.params, self._batch_sharding,
                          self.frozen_shardings),
            out_shardings=replicated, compiler_options=self.compiler_options)

        self.checkpointer = None
        if self.workdir and cfg.checkpoint.every >= 0:
            self.checkpointer = ckpt_lib.Checkpointer(
                os.path.join(self.workdir, "checkpoints"), keep=cfg.checkpoint.keep,
                async_save=cfg.checkpoint.async_save)
        self.last_eval: dict[str, dict[str, float]] = {}
        # Wall-clock of the last train(): first step (compile + step), the whole step loop
        # (including the first step and checkpoint saves), the final evaluation.
        self.first_step_seconds: Optional[float] = None
        self.train_seconds: Optional[float] = None
        self.eval_seconds: Optional[float] = None

    @property
    def model_flops_per_step(self) -> Optional[float]:
        """Model FLOPs of one step on the whole batch, from the task's ``model_flops_per_row``
        (``None`` for a task without one): the numerator of the MFU the loop logs and the
        pre-flight's (:mod:`specjax.aot`)."""
        per_row = getattr(self.task, "model_flops_per_row", None)
        d = self.config.data
        return None if per_row is None else float(d.batch_size * per_row(d.seq_len))

    @property
    def frozen(self) -> PyTree:
        """The task's frozen pytree, placed on the mesh once (on first use)."""
        if self._frozen is None:
            # A task may load its frozen pytree straight into the shardings (a large target
            # restored shard by shard on every host) instead of building it on one host.
            load = getattr(self.task, "load_frozen", None)
            self._frozen = load(self.frozen_shardings) if load is not None else \
                jax.device_put(self.task.init_frozen(), self.frozen_shardings)
        return self._frozen

    # -- pure functions (traced) ----------------------------------------------------------------
    def _init_fn(self, key: jax.Array) -> TrainState:
        param_key, train_key = jax.random.split(key)
        params = self.task.init_params(param_key)
        return TrainState(step=jnp.zeros((), jnp.int32), params=params,
                          opt_state=self.tx.init(params), rng=train_key)

    def _grads(self, params, batch, rng, frozen):
        """Loss, metrics, grads and the loss weight of one (micro)batch."""
        with query_chunks(self.config.train.attention_chunk):
            (loss, metrics), grads = jax.value_and_grad(self.task.loss_fn, has_aux=True)(
                params, batch, rng, frozen)
        metrics = dict(metrics)
        weight = jnp.asarray(metrics.pop(LOSS_WEIGHT, 1.0), jnp.float32)
        return loss, metrics, grads, weight

    def _train_step(self, state: TrainState, batch, frozen):
        rng, step_rng = jax.random.split(state.rng)
        num_micro = self.config.train.grad_accum_steps
        if num_micro == 1:
            loss, metrics, grads, weight = self._grads(state.params, batch, step_rng, frozen)
        else:
            batch_axes = sharding_lib.batch_sharding(self.mesh, 1).spec[0]
            micro = jax.tree.map(
                lambda x: jax.lax.with_sharding_constraint(
                    split_microbatches(x, num_micro),
                    NamedSharding(self.mesh, PartitionSpec(None, batch_axes))), batch)

            def body(carry, xs):
                mb, i = xs
                loss, metrics, grads, w = self._grads(
                    state.params, mb, jax.random.fold_in(step_rng, i), frozen)
                sum_loss, sum_metrics, sum_grads, sum_w = carry
                sum_grads = jax.tree.map(lambda a, g: a + w * g, sum_grads, grads)
                sum_metrics = jax.tree.map(lambda a, m: a + w * m, sum_metrics, metrics)
                return (sum_loss + w * loss, sum_metrics, sum_grads, sum_w + w), None

            shapes = jax.eval_shape(self._grads, state.params,
                                    jax.tree.map(lambda x: x[0], micro), step_rng, frozen)
            # Accumulate in f32 whatever the parameter dtype (bf16 sums of many microbatches
            # lose the small ones; and w * g is f32, so a bf16 carry would change type).
            zeros = jax.tree.map(
                lambda s: jnp.zeros(s.shape, jnp.float32 if jnp.issubdtype(s.dtype, jnp.floating)
                                    else s.dtype), shapes)
            init = (zeros[0], zeros[1], zeros[2], zeros[3])
            (sum_loss, sum_metrics, sum_grads, weight), _ = jax.lax.scan(
                body, init, (micro, jnp.arange(num_micro)))
            inv = 1.0 / jnp.maximum(weight, 1e-12)
            loss = sum_loss * inv
            metrics = jax.tree.map(lambda m: m * inv, sum_metrics)
            grads = jax.tree.map(lambda g, p: (g * inv).astype(p.dtype), sum_grads,
                                 state.params)

        updates, opt_state = self.tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        metrics = {"loss": loss, **metrics, "grad_norm": optax.tree.norm(grads),
                   "lr": current_learning_rate(opt_state), LOSS_WEIGHT: weight}
        new_state = TrainState(step=state.step + 1, params=params, opt_state=opt_state, rng=rng)
        return new_state, metrics

    def _eval_fn(self, params, batch, frozen):
        with query_chunks(self.config.train.attention_chunk):
            loss, metrics = self.task.loss_fn(params, batch, jax.random.PRNGKey(0), frozen)
        metrics = dict(metrics)
        metrics.setdefault(LOSS_WEIGHT, jnp.ones((), jnp.float32))
        return {"loss": loss, **metrics}

    # -- shardings ------------------------------------------------------------------------------
    def _state_shardings(self) -> TrainState:
        on_indivisible = self.config.sharding.on_indivisible
        params = sharding_lib.tree_shardings(
            self.abstract_state.params, self.task.param_logical_axes(), self.mesh,
            on_indivisible=on_indivisible)
        replicated = sharding_lib.replicated(self.mesh)
        # Adam's moments are param-shaped: shard them like the params; the rest (counts,
        # injected hyperparameters) is replicated.
        opt = optax.tree_map_params(
            self.tx, lambda _, s: s, self.abstract_state.opt_state, params,
            transform_non_params=lambda _: replicated, is_leaf=_is_leaf_sharding)
        return TrainState(step=replicated, params=params, opt_state=opt, rng=replicated)

    def _on_mesh(self, fn):
        """``fn`` traced with this trainer's mesh as the abstract mesh context, so that the
        models' activation constraints (``specjax.models.partitioning.constrain_batch``: the
        batch stays split under FSDP) see the mesh; without one they do nothing."""
        abstract_mesh = self.mesh.abstract_mesh

        @functools.wraps(fn)
        def traced(*args):
            with jax.sharding.use_abstract_mesh(abstract_mesh):
                return fn(*args)
        return traced

    # -- public API -----------------------------------------------------------------------------
    def init_state(self) -> TrainState:
        """A fresh, sharded state from ``config.seed``."""
        return self._init(jax.random.PRNGKey(self.config.seed))

    def restore_or_init(self, train_iter: Optional[inputs_lib.BatchIterator] = None
                        ) -> TrainState:
        """The newest complete checkpoint in the workdir (restoring ``train_iter``'s position
        too), or a fresh state when there is none or resuming is off."""
        if self.checkpointer is None or not self.config.checkpoint.resume:
            return self.init_state()
        step = self.checkpointer.latest_step()
        if step is None:
            return self.init_state()
        abstract = ckpt_lib.abstract_with_shardings(self.abstract_state, self.state_shardings)
        state, data_state = self.checkpointer.restore(step, abstract)
        if train_iter is not None:
            train_iter.set_state(data_state)
        return state

    def step(self, state: TrainState, host_batch: Mapping[str, np.ndarray]
             ) -> tuple[TrainState, dict[str, jax.Array]]:
        """One optimizer step on this process's rows of the global batch (donates ``state``)."""
        cfg = self.config
        inputs_lib.check_batch(host_batch, cfg.data.batch_size // jax.process_count(),
                               cfg.data.seq_len)
        return self._step(state, inputs_lib.global_batch(host_batch, self.mesh), self.frozen)

    def evaluate(self, params: PyTree, eval_batches: Mapping[str, Any]) -> dict[str, dict]:
        """Token-weighted mean metrics per domain.

        Args:
          params: trained params (e.g. ``state.params``).
          eval_batches: ``{domain: iterable of host batches}`` (or a zero-argument callable
            returning one). Batches may have any row count: rows are padded with
            ``loss_mask = 0`` to a multiple of the batch split. Every process must pass the same
            number of batches per domain.
        Returns:
          ``{domain: {"loss", "ce", "accuracy", ..., "tokens"}}``.
        """
        local_multiple = max(sharding_lib.batch_shards(self.mesh) // jax.process_count(), 1)
        results = {}
        for domain, batches in eval_batches.items():
            batches = batches() if callable(batches) else batches
            pending = []
            for host_batch in batches:
                padded = inputs_lib.pad_rows(host_batch, local_multiple)
                pending.append(self._eval_step(
                    params, inputs_lib.global_batch(padded, self.mesh), self.frozen))
            if not pending:
                continue
            fetched = jax.device_get(pending)
            weights = np.array([m[LOSS_WEIGHT] for m in fetched], np.float64)
            total = weights.sum()
            summary = {}
            for key in fetched[0]:
                if key != LOSS_WEIGHT:
                    vals = np.array([m[key] for m in fetched], np.float64)
                    summary[key] = float((vals * weights).sum() / max(total, 1e-12))
            summary["tokens"] = float(total)
            results[domain] = summary
        return results

    def train(self, train_iter: inputs_lib.BatchIterator,
              eval_batches: Optional[Mapping[str, Any]] = None, *,
              stop_after: Optional[int] = None,
              hooks: Sequence[StepHook] = ()) -> TrainState:
        """Trains to ``config.train.num_steps``, resuming from the workdir when possible.

        Args:
          train_iter: this process's :class:`~specjax.training.inputs.BatchIterator`.
          eval_batches: see :meth:`evaluate`; evaluated every ``train.eval_every`` steps and at
            the end (results in :attr:`last_eval` and ``metrics.jsonl``).
          stop_after: stop (without saving) once this step is reached — a simulated crash, for
            resume tests.
          hooks: called after every step.
        Returns:
          The final :class:`TrainState`. The host loop itself is
          :func:`specjax.training.train_loop.train_loop`.
        """
        return train_loop(self, train_iter, eval_batches, stop_after=stop_after, hooks=hooks)

    def close(self) -> None:
        if self.checkpointer is not None:
            self.checkpointer.close()
