"""Language-model pretraining as a :class:`~specjax.training.tasks.TrainTask`.

Loss: token-mean cross-entropy over ``loss_mask``, plus an optional z-loss
``z * mean(logsumexp(logits)^2)`` (PaLM) that keeps the softmax normaliser near 1.

Batch (all ``[B, T]``; the layout of :mod:`specjax.data`'s pipeline):
  ``inputs`` int32, ``targets`` int32, ``loss_mask`` (0/1), and optionally ``positions`` int32 and
  ``segment_ids`` int32 for rows that pack several documents.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_collections
from flax import nnx

from specjax.models import ModelConfig, Transformer, get_preset
from specjax.models.flops import forward_flops_per_token
from specjax.training.checkpoint import warm_start_params
from specjax.training.errors import ConfigError
from specjax.training.tasks import LOSS_WEIGHT, register_task


def model_config_from(config: ml_collections.ConfigDict) -> ModelConfig:
    """``config.model.preset`` with ``config.model.overrides`` applied."""
    return get_preset(config.model.preset, **dict(config.model.overrides))


def _is_var(x) -> bool:
    return isinstance(x, nnx.Variable)


class LMTask:
    """Next-token prediction for a :class:`~specjax.models.Transformer`.

    ``params`` is the model's pure state dict (``nnx.to_pure_dict``), so it is a plain nested dict
    of arrays for optax and Orbax; the (static) graph definition is kept on the task.
    """

    def __init__(self, model_config: ModelConfig, *, z_loss: float = 0.0, remat: str = "none",
                 logits_chunk: int = 0, init_from: str = ""):
        from specjax.training.memory import REMAT_POLICIES
        if remat not in REMAT_POLICIES:
            raise ValueError(f"remat must be one of {sorted(REMAT_POLICIES)}, got {remat!r}")
        self.model_config = model_config
        self.z_loss = float(z_loss)
        self.remat = remat
        self.logits_chunk = int(logits_chunk)
        abstract = nnx.eval_shape(lambda: Transformer(model_config, rngs=nnx.Rngs(params=0)))
        self.graphdef, abstract_state = nnx.split(abstract)
        axes = jax.tree.map(lambda v: tuple(v.logical_axes), abstract_state, is_leaf=_is_var)
        self._axes = nnx.to_pure_dict(axes)
        self._init_values = None
        if init_from:  # continued training: the newest params of another LM run, fresh optimizer
            self._init_values = warm_start_params(init_from, nnx.to_pure_dict(abstract_state))

    # -- TrainTask -------------------------------------------------------------------------------
    def init_params(self, rng: jax.Array):
        if self._init_values is not None:
            return jax.tree.map(jnp.asarray, self._init_values)
        model = Transformer(self.model_config, rngs=nnx.Rngs(params=rng))
        return nnx.to_pure_dict(nnx.state(model))

    def param_logical_axes(self):
        return self._axes

    def init_frozen(self):
        return {}

    def frozen_logical_axes(self):
        return {}

    def model_flops_per_row(self, seq: int) -> float:
        """Model FLOPs of one training row of ``seq`` tokens, forward and backward (PaLM,
        appendix B: ``6 N + 12 L H Dh seq`` per token; :mod:`specjax.models.flops`)."""
        return 3 * forward_flops_per_token(self.model_config, seq) * seq

    def loss_fn(self, params, batch, rng, frozen):
        del rng, frozen  # deterministic model, nothing frozen
        model = self.model(params)
        if self.remat == "none" and self.logits_chunk <= 0:
            out = model(batch["inputs"], positions=batch.get("positions"),
                        segment_ids=batch.get("segment_ids"))
            return lm_loss(out.logits, batch["targets"], batch.get("loss_mask"),
                           z_loss=self.z_loss)
        from specjax.training import memory
        h = memory.hidden_states(model, batch["inputs"], positions=batch.get("positions"),
                                 segment_ids=batch.get("segment_ids"), remat=self.remat)
        if self.logits_chunk <= 0:
            return lm_loss(model.lm_logits(h), batch["targets"], batch.get("loss_mask"),
                           z_loss=self.z_loss)
        return memory.chunked_lm_loss(model, h, batch["targets"], batch.get("loss_mask"),
                                      chunk=self.logits_chunk, z_loss=self.z_loss)

    # -- helpers ---------------------------------------------------------------------------------
    def model(self, params) -> Transformer:
        """An nnx model view of ``params`` (for sampling / evaluation code)."""
        return nnx.merge(self.graphdef, params)


def lm_loss(logits: jax.Array, targets: jax.Array, loss_mask=None, *, z_loss: float = 0.0):
    """Masked token-mean cross-entropy (+ z-loss).

    Args:
      logits: f32 ``[B, T, V]``; targets: int ``[B, T]``; loss_mask: ``[B, T]`` (default all 1).
    Returns:
      ``(loss, metrics)``: metrics hold ``ce`` (nats/token), ``z_loss``, ``accuracy`` and
      ``loss_weight`` (number of target tokens, for exact microbatch / eval averaging).
    """
    logits = logits.astype(jnp.float32)
    mask = jnp.ones(targets.shape, jnp.float32) if loss_mask is None \
        else loss_mask.astype(jnp.float32)
    lse = jax.nn.logsumexp(logits, axis=-1)
    target_logit = jnp.take_along_axis(logits, targets[..., None].astype(jnp.int32), -1)[..., 0]
    weight = mask.sum()
    denom = jnp.maximum(weight, 1.0)  # an all-padding batch gives 0 loss, not NaN
    ce = ((lse - target_logit) * mask).sum() / denom
    zl = z_loss * ((lse ** 2) * mask).sum() / denom
    correct = (jnp.argmax(logits, -1) == targets).astype(jnp.float32)
    metrics = {"ce": ce, "z_loss": zl, "accuracy": (correct * mask).sum() / denom,
               LOSS_WEIGHT: weight}
    return ce + zl, metrics


def _defaults() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.z_loss = 0.0  # 1e-4 is the usual value when enabled
    # an LM run's workdir whose newest params start this run ("" = fresh init); the optimizer,
    # the schedule and the data stream start afresh (continued training, e.g. a math stage)
    c.init_from = ""
    return c


def _validate(task_config: dict) -> None:
    if task_config["z_loss"] < 0:
        raise ConfigError(f"config.task.z_loss: must be >= 0, got {task_config['z_loss']}")


def _build(config: ml_collections.ConfigDict) -> LMTask:
    return LMTask(model_config_from(config), z_loss=config.task.z_loss,
                  remat=config.train.remat, logits_chunk=config.train.logits_chunk,
                  init_from=config.task.init_from)


register_task("lm", _build, _defaults, _validate)
