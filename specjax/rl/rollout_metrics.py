"""The metrics of one rollout call: counts, acceptance per draft position, τ, entropy, exactness.

:class:`~specjax.rl.rollout.SpeculativeRollout` writes one dict per call to its JSONL and to
Tunix's metrics logger; :func:`rollout_metrics` lists the fields. Acceptance per position comes from the
engine's own counts on the device loop, and from the results' emission times on the host loop
with a fixed draft length and no overlap (:func:`specjax.rl.acceptance.position_acceptance`);
elsewhere it is not reported.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from specjax.rl.acceptance import position_acceptance
from specjax.rl.scoring import exactness_gap

__all__ = ["rollout_metrics"]


def rollout_metrics(engine, results: Sequence, requests: Sequence, logp: Sequence[np.ndarray],
                    ent: Sequence[np.ndarray], wall: float, since: tuple[int, int]) -> dict:
    """Metrics of the requests an engine just served.

    Args:
      engine: the :class:`~specjax.engine.Engine` that served them.
      results, requests: its ``Result`` and ``Request`` per sequence, in the same order.
      logp, ent: per sequence, float ``[n_i]`` log-probs of the generated tokens under the
        sampling distribution and the policy's entropies there (the teacher-forced scoring).
      wall: wall seconds of the engine's run.
      since: ``(len(engine.stats), len(engine.loop_stats))`` before the run: the step / call
        statistics that belong to it.
    Returns:
      A JSON-able dict: ``sequences``, ``tokens``, ``steps``, ``drafted``, ``accepted``,
      ``acceptance``, ``tau`` (tokens per verification step), ``entropy`` (per token) and
      ``entropy_seq`` (per sequence), ``logp``, ``exactness_gap`` ± ``exactness_gap_se``,
      ``mean_length``, ``stopped``, ``wall_s``, ``tokens_per_s``; ``alpha_k`` (and, on the device
      loop, ``survival_k``) per draft position k where measurable. None where undefined.
    """
    cfg = engine.config
    accepted = int(sum(r.accepted for r in results))
    steps = int(sum(r.steps for r in results))
    n_tok = int(sum(len(r.tokens) for r in results))
    pos = None
    if getattr(cfg, "loop", "host") == "device":  # it counts drafts verified / accepted per position
        calls = engine.loop_stats[since[1]:]
        d = np.sum([c.drafted for c in calls], axis=0) if calls else np.zeros(cfg.gamma)
        a = np.sum([c.accepted for c in calls], axis=0) if calls else np.zeros(cfg.gamma)
        drafted, pos = int(np.sum(d)), (a, d)
    else:
        drafted = int(sum(s.drafts_verified for s in engine.stats[since[0]:]))
    all_ent = np.concatenate(ent) if ent else np.zeros(0)
    gap, gap_se = exactness_gap(logp, ent) if all_ent.size else (None, None)
    gap_se = gap_se if gap_se is not None and np.isfinite(gap_se) else None
    m = {"sequences": len(results), "tokens": n_tok, "steps": steps, "drafted": drafted,
         "accepted": accepted, "acceptance": accepted / drafted if drafted else None,
         # tokens per verification step (accepted drafts + one); the prefill emits the first
         "tau": (n_tok - len(results)) / steps if steps else None,
         "entropy": float(all_ent.mean()) if all_ent.size else None,
         "entropy_seq": float(np.mean([e.mean() for e in ent if e.size])) if all_ent.size
         else None,
         "logp": float(np.concatenate(logp).mean()) if all_ent.size else None,
         # mean of log p + H per token: 0 for exact samples (scoring.exactness_gap)
         "exactness_gap": gap, "exactness_gap_se": gap_se,
         "mean_length": n_tok / max(1, len(results)),
         "stopped": float(np.mean([r.finish_reason == "stop" for r in results])),
         "wall_s": wall, "tokens_per_s": n_tok / wall if wall > 0 else None}
    if pos is not None:
        # survival_k = P(drafts 1..k accepted | k drafts verified), exact counts;
        # alpha_k = survival_k / survival_{k-1}: the conditional acceptance at position k
        # (exact when the verified length does not depend on the position reached)
        a, d = pos
        surv = [float(a[j] / d[j]) if d[j] else None for j in range(len(d))]
        for j, sv in enumerate(surv):
            m[f"survival_{j + 1}"] = sv
            prev = 1.0 if j == 0 else surv[j - 1]
            m[f"alpha_{j + 1}"] = sv / prev if sv is not None and prev else None
    elif cfg.scheduler.policy == "fixed" and not cfg.overlap:
        k = min(cfg.scheduler.k, cfg.gamma)
        acc, tried = position_acceptance(results, [r.max_new_tokens for r in requests],
                                         requests[0].stop_tokens if requests else (), k)
        for j in range(k):
            m[f"alpha_{j + 1}"] = float(acc[j] / tried[j]) if tried[j] else None
    return m
