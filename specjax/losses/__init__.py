"""Drafter training losses: CE, KL, reverse KL, TV, end-to-end TV and the DSpark objective.

All losses are *per position*: the last axis of the logits / probabilities is the vocabulary ``V``
and is reduced; every leading axis is kept (``[..., V] -> [...]``). The sequence-level losses
(:func:`e2e_tv_loss`, :func:`dspark_loss`) also reduce the draft-position axis ``γ`` just before the
vocabulary (``[..., γ, V] -> [...]``). Reductions over batch/tokens are left to the caller, as in
``optax.losses``.

The *target* side (``target_probs``) is always detached inside with :func:`jax.lax.stop_gradient`:
the target model is frozen while a drafter trains (docs/DESIGN.md, "Losses (the target side detached)").

``where`` (optional, boolean) masks *positions*, not vocabulary entries: it must broadcast to the
per-position output shape (``[...]`` for the elementwise losses, ``[..., γ]`` for the sequence
losses). A masked position contributes a loss of exactly 0 and a gradient of exactly 0. To exclude
vocabulary entries, give them ``target_probs == 0`` / ``draft_logits == -inf`` instead.

Notation (docs/DESIGN.md "The math"): target ``p``, draft ``q = softmax(z)`` from draft logits ``z``,
``TV(p, q) = ½ Σ|p − q| = 1 − Σ min(p, q)``; rejection-sampling acceptance ``α = 1 − TV``.

Memory. :func:`tv_loss` (and everything built on it) has a hand-written VJP that uses Bebop's
closed-form gradient (eq. 11), ``∂tv/∂z_j = −q_j([q_j ≤ p_j] − S)``, ``S = Σ_v [q_v ≤ p_v] q_v``.
Its residuals are the inputs plus two scalars per position (the log-partition and ``S``); ``q`` is
recomputed in the backward pass. Both passes walk over the positions in row chunks (a
``fori_loop``), so with a 151,936-token vocabulary the only buffer of size ``[tokens, V]`` the loss
itself allocates is the gradient it returns. ``benchmarks/loss_memory.py`` measures this against
plain autodiff; numbers are in ``docs/LOSSES.md``. CE / KL / reverse KL use ordinary autodiff.

References:
  * Bebop — Li, Jiang, et al. (Qwen Team), "Breaking Entropy Bounds: Accelerating RL Training via
    MTP with Rejection Sampling", arXiv 2606.12370, §4.1 eq. 10–11 (TV loss and its gradient),
    §4.2 eq. 13 (e2e TV), App. C eq. 17 (reverse KL), App. F (fused TV kernel).
  * DSpark — DeepSeek, §3.2.1 eq. 8 (confidence target ``c* = 1 − ½‖p_d − p_t‖₁``) and §3.3
    eq. 9–12 (``L = 0.1·L_ce + 0.9·L_tv + 1.0·L_conf``, position weights ``w_k = exp(−(k−1)/γ)``).
  * Leviathan, Kalman, Matias, "Fast Inference from Transformers via Speculative Decoding"
    (ICML 2023): acceptance rate ``Σ min(p, q) = 1 − TV``.
"""
from specjax.losses.divergences import DEFAULT_LOG_P_FLOOR, ce_loss, kl_loss, reverse_kl_loss
from specjax.losses.dspark import DSparkTerms, dspark_loss, dspark_loss_terms, dspark_position_weights
from specjax.losses.e2e_tv import e2e_tv_from_tv, e2e_tv_loss
from specjax.losses.tv import DEFAULT_CHUNK_ELEMENTS, tv_loss, tv_loss_autodiff

__all__ = [
    "ce_loss",
    "kl_loss",
    "reverse_kl_loss",
    "tv_loss",
    "tv_loss_autodiff",
    "e2e_tv_loss",
    "e2e_tv_from_tv",
    "dspark_position_weights",
    "DSparkTerms",
    "dspark_loss_terms",
    "dspark_loss",
    "DEFAULT_CHUNK_ELEMENTS",
    "DEFAULT_LOG_P_FLOOR",
]
