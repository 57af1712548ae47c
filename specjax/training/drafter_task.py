"""Drafter training against a frozen target: the ``"drafter"`` :class:`TrainTask`.

The split (see :mod:`specjax.training.tasks`) is

* ``params`` — the drafter's own parameters only (MTP heads, the DSpark / DFlash backbone with its
  sequential and confidence heads, or an independent draft LM);
* ``frozen`` — ``{"target": <the target's params>}``: the teacher. Loaded once from the target's
  trainer checkpoint (``task.target_workdir``), never differentiated, never in the optimizer
  state, never checkpointed with the drafter. The shared embedding / final norm / LM head that
  MTP and DSpark drafters use (:func:`specjax.drafters.shared_head`) is a *view* of these frozen
  arrays, so it is frozen too (DSpark §3.3: "shares its embedding layer and language modeling head
  and keeps them frozen");
* ``loss_fn`` — per step, on the fly: the target forward on the batch (with the hidden layers the
  drafter reads), under ``stop_gradient``; anchor sampling; the drafter's teacher-forced pass on the
  ground-truth continuation; the selected loss.

Teacher forcing and anchors. At anchor position ``i`` the drafter sees the target context through
``i`` and the anchor token ``t_{i+1}``; draft ``k = 1..γ`` is scored against the target's
distribution ``p_k`` at position ``i + k`` (its prediction of ``t_{i+1+k}``) and the label
``t_{i+1+k}``; for ``k >= 2`` the drafter's inputs are the true tokens ``t_{i+2..i+k}``
(:func:`specjax.drafters.teacher_forced_targets`). ``task.anchors_per_row = A > 0`` samples ``A``
anchors per row, uniformly without replacement among the row's valid anchor positions (DSpark
§3.3, "we randomly sample multiple anchor positions from each target sequence"), fresh every step
from the step's RNG (checkpointed, so a resumed run samples the same anchors); ``0`` uses every
position. Labels crossing a packed document boundary (``segment_ids``) or falling on padding are
masked out. (The drafters' teacher-forced passes treat a row as one sequence: with packed rows their
own attention can see the previous documents of the row; the one-document-per-row files of
:mod:`specjax.training.drafter_data` avoid that.)

Losses (``task.loss``; ``p = softmax(target logits / task.target_temperature)``, detached):

=========  ====================================================================================
``ce``     ``−log q_k(t_{i+1+k})`` (hard ground-truth labels)
``kl``     ``KL(p_k ‖ q_k)``
``rkl``    ``KL(q_k ‖ p_k)``
``tv``     ``1 − Σ_v min(p_k, q_k)`` (Bebop eq. 10, closed-form gradient eq. 11)
``e2e_tv`` ``1 − (1/γ) Σ_j Π_{i≤j} (1 − tv_i)`` per block (Bebop eq. 13)
``dspark`` ``Σ_k w_k [0.1·ce + 0.9·‖q_k − p_k‖₁ + 1.0·bce(c_k, 1 − tv_k)]`` per block (DSpark
           eq. 9–12; the BCE only for drafters with a confidence head)
=========  ====================================================================================

Per-position losses are averaged over valid positions with weights ``w_k`` (``task.position_weights``:
``"uniform"`` or ``"exp"`` = DSpark's ``exp(−(k−1)/γ)``); block losses over valid blocks.

Loss schedule (Bebop-style fine-tuning at equal total budget): ``task.warm_start_loss = "ce"`` and
``task.switch_step = S`` train with CE for the first ``S`` optimizer steps and with ``task.loss``
afterwards, in one run. The step is not visible to a task's ``loss_fn``, so the schedule travels
with the data: :class:`LossPhaseIterator` stamps each batch with ``loss_phase`` (0 before the
switch, 1 after) from its own step counter, which is part of the checkpointed iterator state, so a
resumed run switches at the same step. :func:`specjax.training.drafter_run.run_drafter` (and
``experiments/train_drafter.py``) wraps the iterators; a batch without ``loss_phase`` under a schedule is an error. Alternatively
``task.init_from`` warm-starts the params from another drafter run's checkpoint (a fresh optimizer).

Metrics (always, whatever the loss; detached): ``ce``, ``top1``, ``tv`` (mean), ``alpha_k``
(teacher-forced per-position RS acceptance ``1 − tv_k``, k = 1..γ), ``accept_rate`` (``1 − e2e_tv``,
the expected accepted drafts / γ of a block under rejection sampling), ``conf_bce`` (confidence
heads), ``loss_weight``.

The ``config.task`` fields with their checks, building the drafter and loading the target live in
:mod:`specjax.training.drafter_build` (its public names are re-exported here).
"""
from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from flax import nnx

from specjax import losses as L
from specjax.losses.dspark import _sigmoid_bce
from specjax.drafters import shared_head, teacher_forced_targets
from specjax.models.flops import forward_flops_per_token
from specjax.training.checkpoint import run_checkpoints_dir, warm_start_params
from specjax.training.drafter_build import (DRAFTERS, LOSSES, build_drafter, drafter_defaults,
                                            load_target, logical_axes_of, target_abstract_params,
                                            validate_task)
from specjax.training.lm_task import model_config_from
from specjax.training.tasks import LOSS_WEIGHT, register_task

__all__ = ["LOSSES", "DRAFTERS", "DrafterTask", "LossPhaseIterator", "build_drafter",
           "drafter_defaults", "load_target", "target_abstract_params"]

PHASE_KEY = "loss_phase"


# ------------------------------------------------------------------------------------------------
# the task
# ------------------------------------------------------------------------------------------------
def position_tv(z, p):
    """TV distance ``[..., γ]`` between the drafter's softmax(z) and the target's p
    ``[..., γ, V]`` at every teacher-forced draft position (1 − TV: the position's RS acceptance)."""
    q = jax.nn.softmax(z.astype(jnp.float32), axis=-1)
    return 1.0 - jnp.sum(jnp.minimum(p, q), axis=-1)


def block_acceptance(tv, mask):
    """``(acc, valid)``, both ``[...]`` over anchor blocks: a block's expected RS acceptance
    ``1 − e2e_tv`` (0 where the block is invalid) and its validity as float. Summed over all
    blocks they give ``accept_rate``; summed per row, its row-clustered parts."""
    valid = mask[..., 0].astype(jnp.float32)
    return (1.0 - L.e2e_tv_from_tv(tv, where=mask)) * valid, valid


class DrafterTask:
    """Trains a drafter against a frozen target (see the module docstring).

    Attributes:
      drafter: the static drafter object (pass its ``params`` to the drafter API).
      target_config / target_graphdef: the frozen target's architecture.
      gamma: γ.
    """

    def __init__(self, config: ml_collections.ConfigDict, *, load_frozen: bool = True):
        t = config.task
        self.task_config = t
        self.target_config = model_config_from(config)
        self.gamma = int(t.gamma)
        self.drafter, self._factory = build_drafter(t, self.target_config)
        self.uses_head = t.drafter != "draft_lm"
        abstract = nnx.eval_shape(lambda: self._factory(nnx.Rngs(params=0)))
        state = nnx.state(abstract)
        self._axes = logical_axes_of(state)
        self.abstract_params = nnx.to_pure_dict(state)
        (self.target_graphdef, self._target_abstract,
         self._target_axes) = target_abstract_params(self.target_config)
        self._frozen = None
        self._init_values = None
        if t.init_from:
            self._init_values = warm_start_params(t.init_from, self.abstract_params)
        self._load_frozen = load_frozen

    # -- TrainTask -------------------------------------------------------------------------------
    def init_params(self, rng: jax.Array):
        if self._init_values is not None:
            return jax.tree.map(jnp.asarray, self._init_values)
        return nnx.to_pure_dict(nnx.state(self._factory(nnx.Rngs(params=rng))))

    def param_logical_axes(self):
        return self._axes

    def model_flops_per_row(self, seq: int) -> float:
        """Model FLOPs of one training row of ``seq`` tokens: the frozen target's forward (its LM
        head only at the drafted rows when anchors are sampled; over every position otherwise,
        where the full logits are computed and gathered) plus the drafter's own count
        (``drafter.train_flops``: forward, backward and its uses of the shared head)."""
        c, a = self.target_config, self.task_config.anchors_per_row
        head = c.vocab_size * c.hidden_size
        head_rows = a * self.gamma if a else seq
        return (forward_flops_per_token(c, seq) - 2 * head) * seq + 2 * head * head_rows \
            + self.drafter.train_flops(seq, a or seq, self.gamma)

    def frozen_target(self):
        """``(graphdef, params)`` of the frozen target (loaded once, host/device arrays)."""
        if self._frozen is None:
            t = self.task_config
            with jax.ensure_compile_time_eval():  # concrete even when called under eval_shape
                params = load_target(self.target_config, t.target_workdir, step=t.target_step,
                                     seed=t.target_seed)[1]
            self._frozen = jax.device_get(params)
        return self.target_graphdef, self._frozen

    def init_frozen(self):
        return {"target": self.frozen_target()[1]}

    def load_frozen(self, shardings):
        """The frozen pytree placed with ``shardings`` (``{"target": ...}``, from the trainer).

        A target checkpoint (``task.target_workdir``) is restored by Orbax directly into the
        shardings: every host reads only its own shards, and no device or host ever holds the
        whole target (what a pod needs for an 8B target on 16 GiB chips). A random target
        (tests) is created on the host and placed.
        """
        t = self.task_config
        if not t.target_workdir:
            return jax.device_put(self.init_frozen(), shardings)
        from specjax.training.checkpoint import abstract_with_shardings, restore_params
        abstract = abstract_with_shardings(self._target_abstract, shardings["target"])
        directory = run_checkpoints_dir(t.target_workdir)
        step = None if t.target_step < 0 else t.target_step
        return {"target": restore_params(directory, abstract, step)}

    def abstract_frozen(self):
        """Shapes / dtypes of :meth:`init_frozen` without loading the target."""
        return {"target": jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype),
                                       self._target_abstract)}

    def frozen_logical_axes(self):
        return {"target": self._target_axes}

    # -- helpers ---------------------------------------------------------------------------------
    def shared_head(self, frozen):
        """The frozen shared embedding / LM head view (``None`` for the draft LM)."""
        if not self.uses_head:
            return None
        return shared_head((self.target_graphdef, frozen["target"]))

    def sample_anchors(self, rng: jax.Array, seg: jax.Array) -> Optional[jax.Array]:
        """``int32 [B, A]`` anchors per row (``-1`` = none left), or ``None`` (every position).

        Valid anchors ``i``: a real token whose first label ``t_{i+2}`` exists in the same
        segment. Sampled uniformly without replacement (top-A of i.i.d. uniforms).
        """
        a = int(self.task_config.anchors_per_row)
        b, t = seg.shape
        if a <= 0 or a >= t:
            return None
        idx = jnp.arange(t)
        nxt2 = jnp.concatenate([seg[:, 2:], jnp.zeros((b, 2), seg.dtype)], axis=1)
        valid = (seg > 0) & (nxt2 == seg) & (idx[None, :] + 2 < t)
        u = jax.random.uniform(rng, (b, t))
        score = jnp.where(valid, u, -1.0)
        top, pos = jax.lax.top_k(score, a)
        return jnp.where(top >= 0, pos, -1).astype(jnp.int32)

    def target_forward(self, frozen, batch, *, logits: bool = True):
        """Frozen target on the batch: ``(logits [B, T, V], hidden [m, B, T, D] | None)``.

        With ``logits=False`` the first result is the last block's output ``[B, T, D]`` (before
        the final norm) instead: the caller applies the LM head only at the positions it needs
        (:meth:`teacher_forced` with sampled anchors), and the ``[B, T, V]`` logits are never
        computed (jit removes the unused head).
        """
        target = nnx.merge(self.target_graphdef, frozen["target"])
        layers = tuple(self.drafter.hidden_layers)
        extra = () if logits else (self.target_config.num_layers,)
        out = target(batch["inputs"], positions=batch.get("positions"),
                     segment_ids=batch.get("segment_ids"), hidden_layers=layers + extra)
        hidden = None if out.hidden is None else jax.lax.stop_gradient(out.hidden)
        if logits:
            return jax.lax.stop_gradient(out.logits), hidden
        return hidden[-1], (hidden[:-1] if layers else None)

    def teacher_forced(self, params, batch, rng, frozen):
        """Drafter and target sides of one batch: ``(logits [B,A,γ,V], conf_logits | None,
        target probs [B,A,γ,V], labels [B,A,γ], mask [B,A,γ])``."""
        tokens = batch["inputs"].astype(jnp.int32)
        b, t = tokens.shape
        seg = batch.get("segment_ids")
        if seg is None:
            mask_tok = batch.get("loss_mask")
            seg = (jnp.ones((b, t), jnp.int32) if mask_tok is None
                   else (mask_tok > 0).astype(jnp.int32))
        seg = seg.astype(jnp.int32)
        anchors = self.sample_anchors(rng, seg)
        # With sampled anchors only B x A x γ positions need the target's distribution: gather
        # the last hidden state there and apply the LM head to those rows only (the full
        # [B, T, V] logits would dominate the step's memory at a 151k vocabulary). With every
        # position as an anchor the logits are computed once per position and gathered.
        t_out, hidden = self.target_forward(frozen, batch, logits=anchors is None)
        tf = self.drafter.teacher_forced(params, self.shared_head(frozen), tokens, hidden,
                                         gamma=self.gamma, anchors=anchors)
        labels, tl, mask = teacher_forced_targets(tokens, t_out, self.gamma, anchors)
        if anchors is not None:
            tl = jax.lax.stop_gradient(
                nnx.merge(self.target_graphdef, frozen["target"]).lm_logits(tl))
        if anchors is None:
            anchors = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        rows = jnp.arange(b)[:, None, None]
        lab_pos = anchors[..., None] + 1 + jnp.arange(1, self.gamma + 1, dtype=jnp.int32)
        seg_a = seg[rows[..., 0], jnp.clip(anchors, 0, t - 1)][..., None]
        seg_l = seg[rows, jnp.clip(lab_pos, 0, t - 1)]
        mask = mask & (seg_l == seg_a) & (seg_a > 0)
        p = jax.nn.softmax(tl.astype(jnp.float32) / self.task_config.target_temperature, axis=-1)
        return tf.logits, tf.confidence_logits, jax.lax.stop_gradient(p), labels, mask

    def _weights(self, kind: str) -> jax.Array:
        if kind == "exp" or kind == "dspark":
            return L.dspark_position_weights(self.gamma)
        return jnp.ones((self.gamma,), jnp.float32)

    def loss_of(self, kind: str, z, conf, p, labels, mask):
        """``(loss, weight)`` of one loss kind (see the module docstring)."""
        m = mask.astype(jnp.float32)
        block_valid = mask[..., 0].astype(jnp.float32)
        n_blocks = block_valid.sum()
        if kind == "e2e_tv":
            per_block = L.e2e_tv_loss(z, p, where=mask)
            return (per_block * block_valid).sum() / jnp.maximum(n_blocks, 1.0), n_blocks
        if kind == "dspark":
            c = self.task_config.dspark_loss
            conf_coef = c.conf_coef if conf is not None else 0.0
            conf = conf if conf is not None else jnp.zeros(z.shape[:-1], jnp.float32)
            per_block = L.dspark_loss(z, p, labels, conf, ce_coef=c.ce_coef, l1_coef=c.l1_coef,
                                      conf_coef=conf_coef, where=mask)
            return (per_block * block_valid).sum() / jnp.maximum(n_blocks, 1.0), n_blocks
        if kind == "ce":
            per = L.ce_loss(z, labels, where=mask)
        elif kind == "kl":
            per = L.kl_loss(z, p, where=mask)
        elif kind == "rkl":
            per = L.reverse_kl_loss(z, p, where=mask)
        elif kind == "tv":
            per = L.tv_loss(z, p, where=mask)
        else:
            raise ValueError(kind)
        w = self._weights(self.task_config.position_weights) * m
        weight = w.sum()
        return (per * w).sum() / jnp.maximum(weight, 1e-9), weight

    def loss_fn(self, params, batch, rng, frozen):
        t = self.task_config
        z, conf, p, labels, mask = self.teacher_forced(params, batch, rng, frozen)
        if t.warm_start_loss:
            if PHASE_KEY not in batch:
                raise ValueError(
                    f"config.task.warm_start_loss={t.warm_start_loss!r} needs batches stamped with "
                    f"{PHASE_KEY!r} (LossPhaseIterator); train with "
                    f"specjax.training.drafter_run.run_drafter / experiments.train_drafter")
            phase = batch[PHASE_KEY].reshape(-1)[0]
            loss, weight = jax.lax.cond(
                phase == 0, lambda: self.loss_of(t.warm_start_loss, z, conf, p, labels, mask),
                lambda: self.loss_of(t.loss, z, conf, p, labels, mask))
        else:
            loss, weight = self.loss_of(t.loss, z, conf, p, labels, mask)
        metrics = self.metrics(z, conf, p, labels, mask)
        metrics[LOSS_WEIGHT] = weight
        return loss, metrics

    def metrics(self, z, conf, p, labels, mask) -> dict:
        """Detached diagnostics (see the module docstring)."""
        z = jax.lax.stop_gradient(z)
        m = mask.astype(jnp.float32)
        n = jnp.maximum(m.sum(), 1.0)
        tv = position_tv(z, p)
        ce = L.ce_loss(z, labels, where=mask)
        top1 = (jnp.argmax(z, axis=-1) == labels).astype(jnp.float32)
        out = {"ce": (ce * m).sum() / n, "top1": (top1 * m).sum() / n, "tv": (tv * m).sum() / n}
        per_pos = m.reshape(-1, self.gamma).sum(0)
        alpha = ((1.0 - tv) * m).reshape(-1, self.gamma).sum(0) / jnp.maximum(per_pos, 1.0)
        for k in range(self.gamma):
            out[f"alpha_{k + 1}"] = alpha[k]
        acc, block_valid = block_acceptance(tv, mask)
        out["accept_rate"] = acc.sum() / jnp.maximum(block_valid.sum(), 1.)
        if conf is not None:
            bce = _sigmoid_bce(jax.lax.stop_gradient(conf), 1.0 - tv)
            out["conf_bce"] = (bce * m).sum() / n
        return out


# ------------------------------------------------------------------------------------------------
# loss schedule through the data
# ------------------------------------------------------------------------------------------------
class LossPhaseIterator:
    """Wraps a :class:`~specjax.training.inputs.BatchIterator`, adding ``loss_phase`` (int32
    ``[B, T]``: 0 for the first ``switch_step`` batches, 1 after). Its step count is part of the
    (checkpointed) state, so a resumed run switches at the same optimizer step."""

    def __init__(self, inner, switch_step: int, *, fixed_phase: Optional[int] = None):
        self.inner, self.switch_step, self.fixed_phase = inner, int(switch_step), fixed_phase
        self._step = 0

    def __iter__(self):
        return self

    def __next__(self):
        batch = dict(next(self.inner))
        shape = np.shape(batch["inputs"])
        phase = self.fixed_phase if self.fixed_phase is not None else \
            int(self._step >= self.switch_step)
        batch[PHASE_KEY] = np.full(shape, phase, np.int32)
        self._step += 1
        return batch

    def get_state(self):
        return {"inner": self.inner.get_state(), "step": self._step}

    def set_state(self, state):
        self.inner.set_state(state["inner"])
        self._step = int(state["step"])

    def close(self):
        close = getattr(self.inner, "close", None)
        if close is not None:
            close()


def _build(config: ml_collections.ConfigDict) -> DrafterTask:
    return DrafterTask(config)


register_task("drafter", _build, drafter_defaults, validate_task)
