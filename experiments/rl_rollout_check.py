r"""Two-sample check of the RL study's rollouts: speculative against plain, at the same weights.

    python -m experiments.rl_rollout_check --target_workdir <target> --head <drafter workdir> \
        [--temperature 1.5] [--n 512] [--method rejection] [--out check.json]

Both samples come from :class:`experiments.rl_study_arms.StudyRollout`, the study's own rollout
(``plain=True`` is its no-speculation decoder), on the same prompts (held-out math problems, each
repeated), with the study's engine shape. If speculative rollouts were not samples of the policy,
per-sequence statistics would differ between the two samples. Compared per sequence: completion
length, mean per-token entropy of the policy and mean log-probability of the sampled tokens
(both at the sampling temperature), with a two-sample Kolmogorov-Smirnov test each
(``scipy.stats.ks_2samp``); the pooled per-token means are also given with standard errors
clustered by sequence.

A temperature above the study's 1.0 flattens the policy against the frozen head, so acceptance
is lower and corrections are frequent: the regime in which a verification bug would show.
This is a check at one set of weights, not a proof; the proofs are the chi-square tests of
``tests/test_rl_rollout.py`` and ``tests/test_engine*.py``.
"""
from __future__ import annotations

import argparse
import json
import sys

import numpy as np


def _sample(rollout, prompts, rc) -> dict:
    out = rollout.generate(prompts, rc)
    ent = rollout.last_batch["entropy"]
    lp = [np.asarray(x, np.float64) for x in out.logprobs]
    lens = np.array([len(r.tokens) for r in rollout.last_batch["results"]], np.float64)
    return {"length": lens, "entropy_sum": np.array([e.sum() for e in ent]),
            "logp_sum": np.array([x.sum() for x in lp]), "n_logp": np.array([len(x) for x in lp]),
            "metrics": rollout.last_metrics}


def compare(a: dict, b: dict) -> dict:
    """KS tests and pooled means of the per-sequence statistics of two samples."""
    from scipy import stats

    from specjax.stats import clustered_ratio
    out = {}
    per_seq = {
        "length": (a["length"], b["length"]),
        "mean_entropy": (a["entropy_sum"] / np.maximum(a["length"], 1),
                         b["entropy_sum"] / np.maximum(b["length"], 1)),
        "mean_logp": (a["logp_sum"] / np.maximum(a["n_logp"], 1),
                      b["logp_sum"] / np.maximum(b["n_logp"], 1)),
    }
    for k, (x, y) in per_seq.items():
        ks = stats.ks_2samp(x, y)
        out[k] = {"ks_statistic": float(ks.statistic), "ks_pvalue": float(ks.pvalue),
                  "mean_a": float(np.mean(x)), "mean_b": float(np.mean(y))}
    for name, key, n in (("entropy_per_token", "entropy_sum", "length"),
                         ("logp_per_token", "logp_sum", "n_logp")):
        out[name] = {"a": clustered_ratio(a[key], a[n]), "b": clustered_ratio(b[key], b[n])}
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target_workdir", required=True)
    ap.add_argument("--head", required=True, help="a trained MTP head's workdir")
    ap.add_argument("--temperature", type=float, default=1.5)
    ap.add_argument("--n", type=int, default=512, help="sequences per sample")
    ap.add_argument("--method", default="rejection", choices=("rejection", "target_only"))
    ap.add_argument("--max_new_tokens", type=int, default=64)
    ap.add_argument("--out", default="")
    a = ap.parse_args(argv)
    if a.n < 16 or a.temperature <= 0:
        ap.error("--n must be >= 16 and --temperature > 0")
    import ml_collections
    from tunix.rl.rollout.base_rollout import RolloutConfig

    from experiments.rl import build_target
    from experiments.rl_study import mode_params
    from experiments.rl_study_arms import StudyRollout, study_engine_config
    from specjax.rl import TunixPolicy
    from specjax.rl import task as T
    from specjax.training.drafter_run import load_drafter

    # the study's full-mode shapes (slots, prompt length) and problem split
    p = mode_params("full", {"max_new_tokens": a.max_new_tokens})
    model, tok = build_target(ml_collections.ConfigDict(dict(
        target_workdir=a.target_workdir, preset=p["preset"], seed=0, data_dir="")))
    drafter, dparams, task = load_drafter(a.head)
    gamma = task.gamma
    _, heldout = T.split_problems(p["problem_seed"], 256, 64)
    prompts = [heldout[i % len(heldout)].prompt for i in range(a.n)]
    ec = study_engine_config(p, a.method, gamma)
    samples = {}
    for name, plain, seed in (("plain", True, 1), ("speculative", False, 2)):
        rc = RolloutConfig(max_tokens_to_generate=a.max_new_tokens,
                           max_prompt_length=p["max_prompt_length"],
                           temperature=a.temperature, eos_tokens=[tok.eos_id], seed=seed,
                           return_logprobs=True)
        r = StudyRollout(rollout_actor=TunixPolicy(model), tokenizer=T.TunixTokenizer(tok),
                         rollout_config=rc, drafter=drafter, drafter_params=dparams,
                         frozen="shared", engine_config=ec, plain=plain)
        samples[name] = _sample(r, prompts, rc)
    res = {"temperature": a.temperature, "n": a.n, "method": a.method, "gamma": gamma,
           "acceptance": samples["speculative"]["metrics"].get("acceptance"),
           "tau": samples["speculative"]["metrics"].get("tau"),
           "compare": compare(samples["plain"], samples["speculative"])}
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)
    json.dump(res, sys.stdout, indent=1)
    return res


if __name__ == "__main__":
    main()
