"""Training: mesh + logical-axis sharding, the jitted train loop, tasks, checkpoints, metrics.

Entry points: :class:`Trainer` (the loop), :func:`default_config` / :func:`validate_config`
(the config schema), :class:`TrainTask` + :func:`register_task` (what is trained), and
:func:`specjax.training.run.run` (distributed init + inputs + trainer; what
``experiments/train.py`` and the quickstart call).
See docs/TRAINING.md.
"""
from specjax.training.checkpoint import Checkpointer, restore_params
from specjax.training.config import ConfigError, default_config, validate_config
from specjax.training.inputs import BatchIterator, SyntheticLMIterator, global_batch
from specjax.training.lm_task import LMTask, lm_loss, model_config_from
from specjax.training.sharding import (LOGICAL_AXIS_RULES, MESH_AXES, ShardingError,
                                       logical_to_spec, make_mesh, tree_shardings)
from specjax.training.registry import make_task
from specjax.training.tasks import LOSS_WEIGHT, TrainTask, register_task
from specjax.training.trainer import TrainState, Trainer

__all__ = [
    "Checkpointer", "restore_params", "ConfigError", "default_config", "validate_config",
    "BatchIterator", "SyntheticLMIterator", "global_batch", "LMTask", "lm_loss",
    "model_config_from", "LOGICAL_AXIS_RULES", "MESH_AXES", "ShardingError", "logical_to_spec",
    "make_mesh", "tree_shardings", "LOSS_WEIGHT", "TrainTask", "make_task", "register_task",
    "TrainState", "Trainer",
]
