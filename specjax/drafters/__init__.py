"""Drafters: propose γ draft tokens, the exact distributions q they were drawn from, and (when the
drafter has a confidence head) per-position confidences. See docs/DRAFTERS.md.

Interface (every drafter; all functions are pure over pytrees and jit-compatible; the drafter
object itself is a frozen, hashable dataclass holding static configuration and the nnx graphdef,
so it is passed to ``jax.jit`` as a *static* argument)::

    drafter, params = MTPDrafter.create(target_config, MTPConfig(...), seed)   # or DSparkDrafter,
                                                                              # DraftLMDrafter, NGramDrafter(V)
    frozen = shared_head(target)        # the target's embedding / final norm / LM head (MTP, DSpark)
                                        # None for the draft LM and the n-gram drafter
    drafter.hidden_layers               # target hidden states it needs (static tuple)
    drafter.has_confidence              # static bool

    state = drafter.init_state(batch, max_len, gamma)                  # empty decoding state
    state = drafter.prefill(params, frozen, state, obs: Observation)   # after the target's prefill
    draft, state = drafter.propose(params, frozen, state, key, *, gamma,
                                   sampling=Sampling(temperature, top_k, top_p, min_p),
                                   argmax=False)                       # -> DraftOutput
    state = drafter.commit(params, frozen, state, obs: Observation)    # after verification
    tf = drafter.teacher_forced(params, frozen, tokens [B,T], hidden [m,B,T,D], *, gamma,
                                anchors=None)                          # -> TeacherForced (training)
    drafter.train_flops(seq, anchors, gamma)  # model FLOPs of one training row (trainable
                                              # drafters; the drafter task adds the target's)
    drafter.propose_flops(context, gamma)     # forward FLOPs of one row's propose, attending to
                                              # `context` cached positions
    drafter.prefill_flops(rows, chunk, context, gamma)  # of prefill over rows x chunk positions
    drafter.commit_flops(tokens, context, gamma)        # of commit over `tokens` positions

* ``DraftOutput(tokens int32 [B, γ], probs f32 [B, γ, V], confidences f32 [B, γ] | None)``.
  ``tokens[:, k]`` is drawn from exactly ``probs[:, k]`` (``specjax.sampling.logits_to_probs`` with
  the request's settings, then the exponential-race sampler), so ``probs`` is what the verifier is
  given. ``argmax=True`` (target-only verification) proposes ``argmax probs`` instead.
* ``Observation(tokens [B,T], num_valid [B], start [B], next_token [B], hidden [m,B,T,D] | None)``:
  the tokens the target consumed at positions ``start + t`` (prefill: the prompt; a step: anchor +
  drafts), how many are committed, the newly emitted token that follows them, and the target's
  hidden states for ``drafter.hidden_layers``.
* ``TeacherForced(logits f32 [B, A, γ, V], confidence_logits f32 [B, A, γ] | None)``: at anchor
  position ``i`` (target context through ``i``, anchor token ``t_{i+1}``), draft ``k`` predicts
  ``t_{i+1+k}`` with teacher-forced ``t_{i+2..i+k}``. :func:`teacher_forced_targets` returns the
  matching labels, target logits and mask, ready for :mod:`specjax.losses`
  (ce / kl / tv / e2e_tv over ``[..., γ, V]``, ``dspark_loss`` with ``confidence_logits``).

Alignment: with ``n`` tokens emitted, the target has consumed ``t_0..t_{n-2}``; ``t_{n-1}`` is the
anchor; inference is the teacher-forced form at ``i = n - 2`` with the drafts as teacher tokens.

Drafters:

* :class:`MTPDrafter` (:mod:`.mtp`): chained MTP heads (DeepSeek-V3 / Qwen), separate or shared;
  per-depth KV caches, recomputed over a window of the last γ + 1 positions each step.
* :class:`DSparkDrafter` (:mod:`.dspark`): DFlash parallel backbone with context K/V injection
  (own cache of context K/V over the full prefix), Markov or RNN sequential head, confidence head;
  :func:`dflash_config` gives the DFlash baseline.
* :class:`DraftLMDrafter` (:mod:`.draft_lm`): an independent small Transformer with its own cache.
* :class:`NGramDrafter` (:mod:`.ngram`): prompt lookup, one-hot q.

The reference decoding loop that drives them is :mod:`specjax.speculative`.
"""
from specjax.drafters.base import (DraftOutput, Observation, Sampling, SharedHead, TeacherForced,
                                   default_anchors, draw, param_logical_axes, shared_head,
                                   teacher_forced_targets)
from specjax.drafters.draft_lm import DraftLMDrafter, DraftLMState
from specjax.drafters.dspark import (DSparkConfig, DSparkDrafter, DSparkModule, DSparkState,
                                     dflash_config)
from specjax.drafters.mtp import MTPConfig, MTPDrafter, MTPHead, MTPHeads, MTPState
from specjax.drafters.ngram import NGramDrafter, NGramState

__all__ = [
    "DraftOutput", "Observation", "Sampling", "SharedHead", "TeacherForced", "default_anchors",
    "draw", "param_logical_axes", "shared_head", "teacher_forced_targets",
    "DraftLMDrafter", "DraftLMState",
    "DSparkConfig", "DSparkDrafter", "DSparkModule", "DSparkState", "dflash_config",
    "MTPConfig", "MTPDrafter", "MTPHead", "MTPHeads", "MTPState",
    "NGramDrafter", "NGramState",
]
