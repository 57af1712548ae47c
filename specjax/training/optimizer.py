"""The optimizer: global-norm clipping + AdamW under a warmup + cosine schedule.

The whole chain is wrapped in ``optax.inject_hyperparams`` so the learning rate actually used at
each step lives in the optimizer state (``opt_state.hyperparams["learning_rate"]``) and can be
logged without recomputing the schedule on the host.
"""
from __future__ import annotations

import jax
import ml_collections
import optax


def make_schedule(opt: ml_collections.ConfigDict, num_steps: int) -> optax.Schedule:
    """Linear warmup 0 -> ``learning_rate`` over ``warmup_steps``, then cosine to
    ``end_lr_ratio * learning_rate`` over ``decay_steps`` (0 = the rest of ``num_steps``)."""
    decay = opt.decay_steps or max(num_steps - opt.warmup_steps, 1)
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=opt.learning_rate, warmup_steps=opt.warmup_steps,
        decay_steps=opt.warmup_steps + decay, end_value=opt.learning_rate * opt.end_lr_ratio)


def _decay_mask(params):
    # Weight decay on matrices only: norms' scales (1-D) are not decayed.
    return jax.tree.map(lambda p: p.ndim >= 2, params)


def make_optimizer(opt: ml_collections.ConfigDict, num_steps: int) -> optax.GradientTransformation:
    """``inject_hyperparams(chain(clip_by_global_norm, adamw))(learning_rate=schedule)``."""

    def chain(learning_rate):
        parts = []
        if opt.clip_norm > 0:
            parts.append(optax.clip_by_global_norm(opt.clip_norm))
        parts.append(optax.adamw(learning_rate, b1=opt.b1, b2=opt.b2, eps=opt.eps,
                                 weight_decay=opt.weight_decay, mask=_decay_mask))
        return optax.chain(*parts)

    return optax.inject_hyperparams(chain)(learning_rate=make_schedule(opt, num_steps))


def current_learning_rate(opt_state) -> jax.Array:
    """The LR used by the most recent update (f32 scalar)."""
    return opt_state.hyperparams["learning_rate"]
