"""What the trainer trains: the :class:`TrainTask` protocol and the task registry.

The trainer owns the loop (sharding, optimizer, checkpoints, metrics); a task owns the model and
the loss. The split is "trained params + loss + frozen extras":

* ``params`` — the pytree the optimizer updates (created by :meth:`TrainTask.init_params` inside
  ``jax.jit(..., out_shardings=...)`` so it is born sharded);
* ``frozen`` — a pytree that the loss reads but that is never differentiated, never in the
  optimizer state and never checkpointed by the trainer (e.g. the frozen target / teacher when
  training drafters). It is placed on the mesh with the same logical-axis rules as ``params``;
* ``loss_fn(params, batch, rng, frozen) -> (loss, metrics)`` — a pure function of arrays.

Language-model pretraining (:mod:`specjax.training.lm_task`) is one implementation; drafter
tasks register themselves the same way with :func:`register_task`. Looking tasks up by name
(``make_task`` and friends) lives in :mod:`specjax.training.registry`, which imports the built-in
tasks: this module imports none of them, so a task module can import it without a cycle.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, Optional, Protocol, runtime_checkable

import jax
import ml_collections

PyTree = Any
Batch = Mapping[str, jax.Array]

# Reserved metric key: a task's ``loss`` is a mean over ``loss_weight`` units (e.g. target tokens).
# When present, microbatches and eval batches are combined as sum(w_i * loss_i) / sum(w_i), which
# makes gradient accumulation equal to the full-batch gradient of a token-mean loss.
LOSS_WEIGHT = "loss_weight"


@runtime_checkable
class TrainTask(Protocol):
    """A trainable model + loss (+ frozen, non-trained inputs)."""

    def init_params(self, rng: jax.Array) -> PyTree:
        """Fresh parameters from a raw ``uint32 [2]`` key. Traced under ``jax.jit``."""

    def param_logical_axes(self) -> PyTree:
        """Same structure as ``init_params``'s result; each leaf a tuple of logical axis names
        (one per dimension, see :mod:`specjax.training.sharding`) or ``None`` (replicated)."""

    def init_frozen(self) -> PyTree:
        """The frozen pytree (arrays; ``{}`` if none). Called once, outside jit."""

    def frozen_logical_axes(self) -> PyTree:
        """Logical axes of ``init_frozen()``'s leaves (same structure)."""

    def loss_fn(self, params: PyTree, batch: Batch, rng: jax.Array,
                frozen: PyTree) -> tuple[jax.Array, dict[str, jax.Array]]:
        """Scalar loss and scalar metrics (may include :data:`LOSS_WEIGHT`). Pure; traced."""

    # Optional: ``model_flops_per_row(seq) -> float``, the model FLOPs of one training row of
    # ``seq`` tokens (forward and backward). With it the trainer logs model TFLOP/s and, on a
    # TPU, MFU, and the pre-flight reports MFU (``Trainer.model_flops_per_step``).


@dataclasses.dataclass(frozen=True)
class TaskSpec:
    """A registered task.

    builder: ``(config) -> TrainTask`` given the full validated config.
    defaults: ``() -> ConfigDict`` of the task's own fields (``config.task.*`` minus ``name``).
    validate: optional ``(task_config: dict) -> None`` raising ``ConfigError`` naming the field.
    """

    builder: Callable[[ml_collections.ConfigDict], TrainTask]
    defaults: Callable[[], ml_collections.ConfigDict]
    validate: Optional[Callable[[dict], None]] = None


_REGISTRY: dict[str, TaskSpec] = {}


def register_task(name: str, builder, defaults, validate=None) -> None:
    """Registers a task under ``config.task.name == name`` (re-registering replaces it)."""
    _REGISTRY[name] = TaskSpec(builder, defaults, validate)


def registered_spec(name: str) -> Optional[TaskSpec]:
    """The spec registered under ``name`` (``None`` if none). Built-in tasks are registered only
    once their modules are imported: look tasks up through :mod:`specjax.training.registry`."""
    return _REGISTRY.get(name)


def registered_names() -> tuple[str, ...]:
    """Names registered so far (see :func:`registered_spec`)."""
    return tuple(_REGISTRY)
