"""Online drafter updates during RL: one optimizer step of the drafter on a batch of rollouts.

Bebop §5.2-5.3: a drafter trained once before RL (e2e-TV) is normally kept frozen; when it is
updated online, it trains on the rollouts the policy just produced, with its *own* optimizer: a
separate learning rate and a separate gradient-norm normalisation (the drafter's gradient is
clipped to ``max_grad_norm`` on its own), so the drafter loss never touches the policy's gradients
or its optimizer state. The target here is the *current* policy (teacher-forced on the rollout
rows, no gradient), the drafter sees the rows exactly as in offline training
(:meth:`specjax.drafters.MTPDrafter.teacher_forced`, labels from
:func:`specjax.drafters.teacher_forced_targets`).

Losses: ``"ce"`` (hard labels = the sampled tokens), ``"kl"`` (forward KL to the policy),
``"tv"`` (Bebop eq. 10) and ``"e2e_tv"`` (Bebop eq. 13), all from :mod:`specjax.losses`.

Usage::

    upd = OnlineDrafterUpdate(drafter, "tv", learning_rate=1e-4, gamma=3)
    opt_state = upd.init(params)
    params, opt_state, metrics = upd.step(params, opt_state, graphdef, target_state, rows, valid)
    rollout.set_drafter_params(params)   # the engine serves them (same shapes: no recompile)
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from specjax import losses as L
from specjax.drafters import shared_head, teacher_forced_targets

__all__ = ["ONLINE_LOSSES", "OnlineDrafterUpdate", "drafter_loss"]

ONLINE_LOSSES = ("ce", "kl", "tv", "e2e_tv")


def drafter_loss(kind: str, logits: jax.Array, target_logits: jax.Array, labels: jax.Array,
                 mask: jax.Array, temperature: float = 1.0) -> jax.Array:
    """Mean drafter loss over valid positions (blocks for ``e2e_tv``).

    Args:
      kind: one of :data:`ONLINE_LOSSES`.
      logits: drafter logits ``[B, A, γ, V]``; target_logits: the policy's ``[B, A, γ, V]``.
      labels: int ``[B, A, γ]`` (the rollout's tokens); mask: bool ``[B, A, γ]``.
      temperature: the policy's sampling temperature (``p = softmax(target_logits / T)``).
    Returns:
      A scalar.
    """
    if kind not in ONLINE_LOSSES:
        raise ValueError(f"online drafter loss must be one of {ONLINE_LOSSES}, got {kind!r}")
    p = jax.lax.stop_gradient(jax.nn.softmax(target_logits.astype(jnp.float32) / temperature, -1))
    m = mask.astype(jnp.float32)
    if kind == "e2e_tv":
        valid = m[..., 0]
        per_block = L.e2e_tv_loss(logits, p, where=mask)
        return (per_block * valid).sum() / jnp.maximum(valid.sum(), 1.0)
    per = {"ce": lambda: L.ce_loss(logits, labels, where=mask),
           "kl": lambda: L.kl_loss(logits, p, where=mask),
           "tv": lambda: L.tv_loss(logits, p, where=mask)}[kind]()
    return (per * m).sum() / jnp.maximum(m.sum(), 1.0)


class OnlineDrafterUpdate:
    """The drafter's own optimizer: ``clip_by_global_norm(max_grad_norm)`` then Adam(lr).

    Args:
      drafter: an MTP / DSpark drafter (one that reads the target's hidden states and shares its
        embedding / LM head).
      loss: one of :data:`ONLINE_LOSSES`.
      learning_rate, max_grad_norm: the drafter's own (never the policy's).
      gamma: chain depth trained (the engine's γ).
      temperature: the rollout temperature (the policy distribution the drafter should match).
    """

    def __init__(self, drafter, loss: str, *, learning_rate: float, gamma: int,
                 max_grad_norm: float = 1.0, temperature: float = 1.0):
        if loss not in ONLINE_LOSSES:
            raise ValueError(f"online drafter loss must be one of {ONLINE_LOSSES}, got {loss!r}")
        if not learning_rate > 0 or not max_grad_norm > 0 or gamma < 1 or not temperature > 0:
            raise ValueError("learning_rate, max_grad_norm and temperature must be > 0, gamma >= 1")
        self.drafter, self.loss, self.gamma = drafter, loss, int(gamma)
        self.temperature = float(temperature)
        self.optimizer = optax.chain(optax.clip_by_global_norm(max_grad_norm),
                                     optax.adam(learning_rate))
        self._step = jax.jit(functools.partial(_step, self), static_argnames=("graphdef",))
        # jitted too: run eagerly, the loss dispatched (and compiled) every op of both models
        self._loss = jax.jit(functools.partial(_loss, self), static_argnames=("graphdef",))

    def init(self, params):
        return self.optimizer.init(params)

    def loss_and_metrics(self, params, graphdef, target_state, rows, valid):
        """``(loss, {"loss", "alpha_mean"})`` of the drafter on ``rows`` (no update); the
        arguments are those of :meth:`step`."""
        rows, valid = _rows_and_valid(rows, valid)
        return self._loss(params, graphdef, target_state, rows, valid)

    def step(self, params, opt_state, graphdef, target_state, rows, valid):
        """One optimizer step.

        Args:
          params, opt_state: the drafter's params and this optimizer's state.
          graphdef, target_state: the current policy (``nnx.split`` of the Transformer).
          rows: int32 ``[B, T]`` rollout sequences (prompt + completion, right-padded).
          valid: bool ``[B, T]`` real tokens.
        Returns:
          ``(params, opt_state, metrics)``; metrics (before the step): ``loss``, ``grad_norm``,
          ``alpha_mean`` (teacher-forced RS acceptance ``1 − TV`` averaged over positions).
        """
        rows, valid = _rows_and_valid(rows, valid)
        return self._step(params, opt_state, rows, valid, target_state, graphdef=graphdef)


def _rows_and_valid(rows, valid):
    """``rows`` as int32 and ``valid`` as bool, both ``[B, T]`` (else a ValueError)."""
    rows, valid = jnp.asarray(rows, jnp.int32), jnp.asarray(valid, bool)
    if rows.ndim != 2 or rows.shape != valid.shape:
        raise ValueError(f"rows and valid must be equal [B, T], got {rows.shape}, {valid.shape}")
    return rows, valid


def _loss(upd, params, graphdef, target_state, rows, valid):
    target = nnx.merge(graphdef, target_state)
    out = target(rows, hidden_layers=upd.drafter.hidden_layers)
    t_logits = jax.lax.stop_gradient(out.logits)
    hidden = None if out.hidden is None else jax.lax.stop_gradient(out.hidden)
    head = jax.lax.stop_gradient(shared_head(target))
    tf = upd.drafter.teacher_forced(params, head, rows, hidden, gamma=upd.gamma)
    labels, tl, mask = teacher_forced_targets(rows, t_logits, upd.gamma, valid=valid)
    b, t = rows.shape
    anchor_ok = valid[:, :, None]  # the anchor token itself is real
    mask = mask & anchor_ok[:, :tf.logits.shape[1]]
    loss = drafter_loss(upd.loss, tf.logits, tl, labels, mask, upd.temperature)
    p = jax.nn.softmax(tl.astype(jnp.float32) / upd.temperature, -1)
    q = jax.nn.softmax(jax.lax.stop_gradient(tf.logits).astype(jnp.float32), -1)
    alpha = jnp.sum(jnp.minimum(p, q), -1)
    m = mask.astype(jnp.float32)
    return loss, {"loss": loss, "alpha_mean": (alpha * m).sum() / jnp.maximum(m.sum(), 1.0)}


def _step(upd, params, opt_state, rows, valid, target_state, *, graphdef):
    (_, metrics), grads = jax.value_and_grad(
        lambda p: _loss(upd, p, graphdef, target_state, rows, valid), has_aux=True)(params)
    metrics["grad_norm"] = optax.tree.norm(grads)
    updates, opt_state = upd.optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, metrics
