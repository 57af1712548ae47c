"""Tasks by name: the built-in tasks (``"lm"``, ``"drafter"``) plus any registered with
:func:`specjax.training.tasks.register_task`.

Importing this module imports the built-in task modules, which register themselves; the config
validator and the trainer look tasks up here.
"""
from __future__ import annotations

import ml_collections

from specjax.training import drafter_task, lm_task, tasks  # noqa: F401  (registers the built-ins)


def registered_tasks() -> tuple[str, ...]:
    """Every task name ``config.task.name`` may take."""
    return tasks.registered_names()


def _spec(name: str) -> tasks.TaskSpec:
    spec = tasks.registered_spec(name)
    if spec is None:
        raise KeyError(f"unknown task {name!r}; registered: {sorted(tasks.registered_names())}")
    return spec


def task_defaults(name: str) -> ml_collections.ConfigDict:
    """``config.task`` schema for task ``name``: ``name`` plus the task's own fields."""
    c = ml_collections.ConfigDict({"name": name})
    c.update(_spec(name).defaults())
    return c


def validate_task_config(name: str, task_config: dict) -> None:
    """Runs task ``name``'s own validator (raises ``ConfigError`` naming the field)."""
    spec = _spec(name)
    if spec.validate is not None:
        spec.validate(task_config)


def make_task(config: ml_collections.ConfigDict) -> tasks.TrainTask:
    """Builds the task named by ``config.task.name`` from the (validated) config."""
    return _spec(config.task.name).builder(config)
