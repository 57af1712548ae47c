"""Analysis of the RL study (``experiments/rl_study.py``; what it means: docs/RL.md; the figures:
``experiments/rl_study_figures.py``).

:func:`summarize` turns the adaptation cells and the arms' per-step records into ``study.json``:
per-arm series (mean over seeds), the entropy-acceptance slope (Bebop Fig. 8), the eq. 16
decomposition (Fig. 3), the acceptance drift from step 0, held-out accuracy gains and rollout /
step latency (Fig. 7), and the claims checked against their thresholds; :func:`study_markdown`
writes its tables.
"""
from __future__ import annotations

import json

import numpy as np

from specjax.evaluation import to_jsonable
from specjax.rl.study_stats import (decompose_delta_alpha, mean_se, ols_slope,
                                    pooled_exactness_gap, seed_mean_se)
from specjax.rl.task import paired_gain

# held-out accuracy measures: (name in the summary, per-problem key in the run records)
HELDOUT_METRICS = (("greedy", "heldout_correct"), ("sampled", "heldout_sampled_per_problem"))

SERIES = ("acceptance", "tau", "entropy", "reward", "heldout_accuracy", "heldout_sampled_accuracy",
          "rollout_s", "step_s", "reward_s", "update_s")


def _series(records, key):
    return [r.get(key) for r in records]


def _slope_and_decomp(recs):
    a = np.array([r.get("acceptance") for r in recs], dtype=object)
    if any(x is None for x in a):
        return None
    a = a.astype(np.float64)
    h = np.array([r["entropy"] for r in recs], np.float64)
    early = max(2, len(recs) // 2)  # b from the early phase (Bebop eq. 16)
    b_early, _ = ols_slope(h[:early], a[:early])
    b_all, _ = ols_slope(h, a)
    # The fitted change of acceptance from the first to the last step: a single step's
    # acceptance carries the sampling noise of one batch of rollouts, so the maximum distance
    # from step 0 (also reported) grows with the number of steps even when nothing drifts.
    b_t, se_t = ols_slope(np.arange(len(a)), a)
    return {"slope": b_all, "slope_early": b_early,
            "decomposition": decompose_delta_alpha(a, h, b_early),
            "drift_max": float(np.max(np.abs(a - a[0]))),
            "drift_trend": float(b_t * (len(a) - 1)), "drift_trend_se": float(se_t * (len(a) - 1))}


def summarize(p: dict, adapt: list[dict], arms: list[dict]) -> dict:
    """The study's summary (JSON-ready)."""
    by_arm: dict[str, list[dict]] = {}
    for run in arms:
        by_arm.setdefault(run["arm"], []).append(run)
    out_arms = {}
    for name, runs in by_arm.items():
        steps = min(len(r["records"]) for r in runs)
        mean = {}
        for key in SERIES:
            vals = [[x for x in _series(r["records"][:steps], key)] for r in runs]
            mean[key] = [mean_se([v[t] for v in vals])[0] if any(v[t] is not None for v in vals)
                         else None for t in range(steps)]
        per_seed = [_slope_and_decomp(r["records"][:steps]) for r in runs]
        a = {"seeds": [r["seed"] for r in runs], "steps": steps, "mean": mean,
             "per_seed": per_seed,
             "alpha_per_position": [[r["records"][t].get(f"alpha_{k + 1}")
                                     for k in range(p["gamma"])] for t in range(steps)
                                    for r in runs[:1]]}
        if all(x is not None for x in per_seed):
            a["slope"] = mean_se([x["slope"] for x in per_seed])
            a["drift_max"] = mean_se([x["drift_max"] for x in per_seed])
            a["drift_trend"] = mean_se([x["drift_trend"] for x in per_seed])
        acc0 = [r["records"][0].get("heldout_accuracy") for r in runs]
        gains = [r["heldout_accuracy_end"] - a0 for r, a0 in zip(runs, acc0) if a0 is not None]
        a["accuracy_gain"] = mean_se(gains)
        # the evaluation after the last step (mean over seeds; plotted at x = steps)
        a["heldout_end"] = {key: mean_se([r["heldout_accuracy_end"] if key == "heldout_accuracy"
                                          else r.get("heldout_end", {}).get(key) for r in runs])[0]
                            for key in ("heldout_accuracy", "heldout_sampled_accuracy")}
        for metric, key in HELDOUT_METRICS:
            g = _paired_gain(runs, key)
            if g is not None:
                a[f"{metric}_gain"] = g
        a["rollout_s"] = mean_se([np.mean(_latency(r["records"], "rollout_s")) for r in runs])
        a["step_s"] = mean_se([np.mean(_latency(r["records"], "step_s")) for r in runs])
        out_arms[name] = a
    claims = _claims(out_arms, by_arm)
    return {"mode": p["mode"], "params": {k: v for k, v in p.items()}, "adaptation": adapt,
            "adaptation_gain_e2e_tv_vs_kl": _gains(adapt), "arms": out_arms, "claims": claims}


def _latency(records: list[dict], key: str) -> list[float]:
    """``key`` of the steps that time the RL step alone.

    Step 0 compiles, so it is left out when there are later steps. Runs recorded before
    ``eval_s`` existed counted the next step's held-out evaluation in a step's ``step_s``: those
    steps (followed by an evaluation without ``eval_s``) are left out too."""
    keep = []
    for t, r in enumerate(records):
        nxt = records[t + 1] if t + 1 < len(records) else {}
        if (t == 0 and len(records) > 1) or (nxt.get("heldout_accuracy") is not None
                                                and "eval_s" not in nxt):
            continue
        keep.append(r[key])
    return keep


def _per_problem(run: dict, key: str):
    """``(step 0, end)`` values of ``key`` per held-out problem (``[n]`` each), or None."""
    start, end = run["records"][0].get(key), run.get("heldout_end", {}).get(key)
    return None if start is None or end is None else (start, end)


def _paired_gain(runs: list[dict], key: str) -> dict | None:
    """Held-out accuracy gain (step 0 -> end) of one arm, from per-problem values ``key``.

    Per seed: the mean change over the held-out problems, with its s.e. over problems (the same
    problems are scored before and after, so the change is paired by problem; this s.e. is the
    evaluation's noise only). Over seeds: ``over_seeds`` is ``mean_se`` of the per-seed gains
    (their spread, which also carries the training run's noise; nan for one seed) and
    ``combined`` the mean with :func:`~specjax.rl.study_stats.seed_mean_se`'s s.e., the larger of
    that spread and the evaluation noise (``se_over`` says which); the claims use ``combined``."""
    per_seed = []
    for r in runs:
        v = _per_problem(r, key)
        if v is None:
            return None
        per_seed.append(list(paired_gain(*v)))
    m, se, how = seed_mean_se(per_seed)
    return {"per_seed": per_seed, "over_seeds": mean_se([g for g, _ in per_seed]),
            "combined": [m, se], "se_over": how}


def _gains(adapt):
    cells = {(c["loss"], c["gamma"], c["cap"], c["temp"]): c for c in adapt}
    out = []
    for (loss, g, cap, t), c in cells.items():
        if loss == "e2e_tv" and ("kl", g, cap, t) in cells:
            out.append({"gamma": g, "cap": cap, "temp": t,
                        "gain_points": 100 * (c["accept_rate"] - cells[("kl", g, cap, t)]["accept_rate"])})
    return out


def _gain_minus_no_spec(by_arm, name, key):
    """Arm ``name``'s held-out gain minus no_spec's, paired by seed and by problem: per seed the
    difference of the two arms' per-problem changes (its s.e. over problems), over seeds
    :func:`seed_mean_se` (a few seeds can agree far more closely than their evaluation noise
    allows, so the spread of the seeds alone is not a s.e.). ``None`` without paired data."""
    g0 = {r["seed"]: r for r in by_arm["no_spec"]}
    per_seed = []
    for r in by_arm[name]:
        a_ = _per_problem(r, key)
        b_ = _per_problem(g0[r["seed"]], key) if r["seed"] in g0 else None
        if a_ is not None and b_ is not None:
            per_seed.append(list(paired_gain(np.subtract(b_[1], b_[0]),
                                             np.subtract(a_[1], a_[0]))))
    if not per_seed:
        return None
    m, se, how = seed_mean_se(per_seed)
    return {"diff": [m, se], "per_seed": per_seed,
            "over_seeds": mean_se([x for x, _ in per_seed]), "se_over": how,
            "holds": bool(abs(m) <= 2 * se)}


def _online_minus_frozen_windows(by_arm, name):
    """Online arm ``name``'s acceptance minus the frozen ``rs_e2e_tv`` arm's, in points, paired by
    seed and by step: ``{"run": ..., "last_fifth": ...}``, each ``{"mean": [m, se], "per_seed":
    [[d, se], ...], "se_over", "within_2_se"}``. Per seed ``d`` is the mean of the per-step
    differences over the window and its s.e. their spread over steps (steps taken as
    independent); over seeds :func:`seed_mean_se` floored at those. ``None`` without pairs."""
    frozen = {r["seed"]: r for r in by_arm.get("rs_e2e_tv", [])}
    diffs = []
    for r in by_arm.get(name, []):
        f = frozen.get(r["seed"])
        if f is None or len(f["records"]) != len(r["records"]):
            continue
        a = [x.get("acceptance") for x in r["records"]]
        b = [x.get("acceptance") for x in f["records"]]
        if len(a) >= 2 and None not in a and None not in b:
            diffs.append(100 * (np.asarray(a, np.float64) - np.asarray(b, np.float64)))
    if not diffs:
        return None
    out = {}
    for window, lo in (("run", 0), ("last_fifth", -max(2, len(diffs[0]) // 5))):
        per_seed = [[float(d[lo:].mean()), float(d[lo:].std(ddof=1) / np.sqrt(d[lo:].size))]
                    for d in diffs]
        m, se, how = seed_mean_se(per_seed, floor_label="per-step floor",
                                  one_seed_label="steps (one seed)")
        out[window] = {"mean": [m, se], "per_seed": per_seed, "se_over": how,
                       "steps": int(diffs[0][lo:].size), "within_2_se": bool(abs(m) <= 2 * se)}
    return out


def _exactness_gap(runs: list[dict]) -> dict | None:
    """An arm's training rollouts checked for exactness: each step's mean ``log p(x_t) + H_t``
    (its records' ``logp + entropy``, the same tokens), pooled over the arm's steps and seeds by
    :func:`~specjax.rl.study_stats.pooled_exactness_gap`. None when the records carry no
    log-probs."""
    return pooled_exactness_gap([r["logp"] + r["entropy"] for run in runs for r in run["records"]
                                 if r.get("logp") is not None and r.get("entropy") is not None])


def _greedy_same_as_plain(runs: list[dict]) -> dict | None:
    """The final greedy evaluation through the arm's speculative engine against the plain
    decoder (``run_arm`` repeats it): per seed the problems whose completions are the same text
    and the two accuracies. ``holds``: the same text on every problem of every seed checked.
    Runs without the repeat (the no-speculation arm, runs recorded before it existed) are left
    out; None when no run has it."""
    per_seed = []
    for r in runs:
        end = r.get("heldout_end", {})
        same, plain = end.get("greedy_text_same_as_plain"), end.get("greedy_plain_correct")
        if same is None or plain is None:
            continue
        per_seed.append({"seed": r["seed"], "same_text": int(np.sum(same)), "problems": len(same),
                         "accuracy_engine": r["heldout_accuracy_end"],
                         "accuracy_plain": float(np.mean(plain))})
    if not per_seed:
        return None
    return {"per_seed": per_seed,
            "holds": all(x["same_text"] == x["problems"] for x in per_seed)}


def _claims(arms, by_arm):
    c = {}
    to, rs = arms.get("to_ce", {}), arms.get("rs_e2e_tv", {})
    if "slope" in to and "slope" in rs:
        c["slope_rs_e2e_tv_le_third_of_to"] = {
            "slope_to": to["slope"], "slope_rs_e2e_tv": rs["slope"],
            "holds": bool(abs(rs["slope"][0]) <= abs(to["slope"][0]) / 3)}
    if "drift_max" in rs:
        trend, se = rs["drift_trend"]
        c["rs_e2e_tv_acceptance_within_2_points"] = {
            "max_abs_drift_points": 100 * rs["drift_max"][0],
            "trend_drift_points": [100 * trend, 100 * se],
            "holds_max": bool(rs["drift_max"][0] <= 0.02),
            "holds": bool(abs(trend) <= 0.02)}
    # every speculative arm's held-out gain minus no_spec's (each one's rollouts are exact
    # samples of its own policy, so each should train as well as plain rollouts); the claims
    # name RS + e2e-TV
    vs_plain = {}
    for name in by_arm if "no_spec" in by_arm else ():
        if name == "no_spec":
            continue
        for metric, key in HELDOUT_METRICS:
            if (d := _gain_minus_no_spec(by_arm, name, key)) is not None:
                vs_plain.setdefault(name, {})[metric] = d
    for claim, metric in (("accuracy_gain_equal_within_noise", "greedy"),
                          ("sampled_gain_equal_within_noise", "sampled")):
        if (d := vs_plain.get("rs_e2e_tv", {}).get(metric)) is not None:
            c[claim] = {"paired_diff_rs_e2e_tv_minus_no_spec": d["diff"],
                        **{k: v for k, v in d.items() if k != "diff"}}
    for name, g in vs_plain.items():
        c.setdefault("gain_minus_no_spec_points", {})[name] = {
            m: {"diff": [100 * d["diff"][0], 100 * d["diff"][1]], "se_over": d["se_over"],
                "holds": d["holds"]} for m, d in g.items()}
    # Bebop §5.3: online drafter updates bring little over the frozen e2e-TV head. Per seed the
    # online arm's fitted acceptance drift minus the frozen arm's (same seed, same head at step 0;
    # s.e. of each fitted trend in quadrature), over seeds seed_mean_se (floored at the fits' noise)
    frozen = {r["seed"]: x for r, x in zip(by_arm.get("rs_e2e_tv", []),
                                             rs.get("per_seed", []))}
    for name in ("rs_e2e_tv_online_ce", "rs_e2e_tv_online_tv"):
        if name not in arms:
            continue
        per_seed = [[100 * (x["drift_trend"] - f["drift_trend"]),
                     100 * float(np.hypot(x["drift_trend_se"], f["drift_trend_se"]))]
                    for r, x in zip(by_arm[name], arms[name]["per_seed"])
                    if x is not None and (f := frozen.get(r["seed"])) is not None]
        if per_seed:
            m, se, how = seed_mean_se(per_seed, floor_label="trend-fit floor",
                                      one_seed_label="trend fit (one seed)")
            c.setdefault("online_update_drift_minus_frozen_points", {})[name] = {
                "mean": [m, se], "per_seed": per_seed, "se_over": how,
                "within_2_se": bool(abs(m) <= 2 * se)}
        # a line fits a curve that dips and recovers badly: also the plain difference of the
        # acceptance, step by step against the frozen arm of the same seed, over the run and over
        # its last fifth
        windows = _online_minus_frozen_windows(by_arm, name)
        if windows:
            c.setdefault("online_update_acceptance_minus_frozen_points", {})[name] = windows
    for name, a in arms.items():
        g = {}
        for metric, _ in HELDOUT_METRICS:
            if f"{metric}_gain" in a:
                x = a[f"{metric}_gain"]
                m, se = x["combined"]
                g[metric] = {"gain": m, "se": se, "holds": bool(m > se), "se_over": x["se_over"]}
        if g:
            c.setdefault("grpo_raises_heldout_accuracy", {})[name] = g
    for name, runs in by_arm.items():
        if (g := _greedy_same_as_plain(runs)) is not None:
            c.setdefault("greedy_evaluation_same_as_plain_decoder", {})[name] = g
        if (g := _exactness_gap(runs)) is not None:
            c.setdefault("rollouts_exact_samples_of_the_policy", {})[name] = g
    if "no_spec" in arms:
        base = arms["no_spec"]["rollout_s"][0]
        c["rollout_speedup_vs_no_spec"] = {
            n: base / a["rollout_s"][0] for n, a in arms.items() if a["rollout_s"][0] > 0}
    return c


def _pm(ms, scale=1.0, fmt=".2f"):
    """``mean ± se`` of a ``(mean, se)`` pair (``mean`` alone when the s.e. is nan)."""
    m, se = ms
    if m is None or not np.isfinite(m):
        return "-"
    return f"{scale * m:{fmt}}" + (f" ± {scale * se:{fmt.lstrip('+')}}" if np.isfinite(se) else "")


def _first_last(series, fmt=".3f"):
    v = [x for x in series if x is not None]
    return f"{v[0]:{fmt}} → {v[-1]:{fmt}}" if v else "-"


def study_markdown(summary: dict) -> str:
    """The study's tables (adaptation, paired gains, arms, claims) as markdown, every number
    read from ``summary`` (what :func:`summarize` returns, plus ``adaptation_paired_gains``)."""
    p = summary["params"]
    rl = (f"RL γ = {p['gamma']}, temperature {p['temperature']}, {len(p['seeds'])} seed(s), "
          f"{p['rl_steps']} steps." if summary["arms"] else "no RL arms (adaptation only).")
    lines = [f"Mode `{summary['mode']}`, overrides `{p.get('overrides', {})}`; {rl}", "",
             "**Pre-RL adaptation** (held-out teacher-forced RS acceptance):", "",
             "| loss | γ | capacity | T | accept rate | α per position |",
             "|---|---|---|---|---|---|"]
    for c in sorted(summary["adaptation"], key=lambda c: (c["gamma"], c["cap"], c["temp"],
                                                          c["loss"])):
        lines.append(f"| {c['loss']} | {c['gamma']} | {c['cap']} | {c['temp']} | "
                     f"{c['accept_rate']:.4f} | {' '.join(f'{a:.3f}' for a in c['alpha'])} |")
    gains = summary.get("adaptation_paired_gains") or {}
    if any(gains.values()):
        lines += ["", "**Paired gains** (points, ± s.e. clustered by held-out row):", "",
                  "| comparison | γ | capacity | T | gain | rows |", "|---|---|---|---|---|---|"]
        for name, rows in gains.items():
            for g in rows:
                lines.append(f"| {name.replace('_vs_', ' over ')} | {g['gamma']} | {g['cap']} | "
                             f"{g['temp']} | {g['gain_points']:+.2f} ± {g['gain_se_points']:.2f} "
                             f"| {g['rows']} |")
    if not summary["arms"]:  # adaptation only (``--set arms=``)
        return "\n".join(lines) + "\n"
    lines += ["", "**GRPO arms** (series: mean over seeds, first → last step; "
              "± s.e. over seeds):", "",
              "| arm | acceptance | fitted drift (points) | entropy | slope b | τ | "
              "held-out acc. start → end | acc. gain (points) | rollout s | step s |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for n, a in summary["arms"].items():
        m = a["mean"]
        acc = [x for x in m["heldout_accuracy"] if x is not None]
        drift = _pm(a.get("drift_trend", (None, 0)), 100, "+.1f")
        lines.append(
            f"| {n} | {_first_last(m['acceptance'])} | {drift} | "
            f"{_first_last(m['entropy'])} | {_pm(a.get('slope', (None, 0)), 1, '.3f')} | "
            f"{_first_last(m['tau'], '.2f')} | {acc[0] if acc else float('nan'):.3f} → "
            f"{acc[0] + a['accuracy_gain'][0] if acc else float('nan'):.3f} | "
            f"{_pm(a['accuracy_gain'], 100, '+.1f')} | {_pm(a['rollout_s'])} | "
            f"{_pm(a['step_s'])} |")
    gains = [(n, a) for n, a in summary["arms"].items() if "greedy_gain" in a]
    if gains:
        lines += ["", "**Held-out accuracy gain**, step 0 → end (points; per seed ± s.e. over "
                  "the held-out problems, paired by problem; last column: mean over seeds ± "
                  "the larger of the seeds' spread and their evaluation noise, "
                  "`specjax.rl.study_stats.seed_mean_se`):", "",
                  "| arm | metric | start → end | gain per seed | mean (s.e. from) |",
                  "|---|---|---|---|---|"]
        for n, a in gains:
            for metric, key in (("greedy", "heldout_accuracy"),
                                ("sampled", "heldout_sampled_accuracy")):
                g = a.get(f"{metric}_gain")
                if g is None:
                    continue
                v = [x for x in a["mean"].get(key) or [] if x is not None]
                start = f"{v[0]:.3f} → {v[0] + g['combined'][0]:.3f}" if v else "-"
                seeds = ", ".join(_pm(x, 100, "+.1f") for x in g["per_seed"])
                lines.append(f"| {n} | {metric} | {start} | {seeds} | "
                             f"{_pm(g['combined'], 100, '+.1f')} ({g['se_over']}) |")
    lines += ["", "**Claims:**", ""]
    for k, v in summary["claims"].items():
        lines.append(f"- `{k}`: {_claim_text(v)}")
    return "\n".join(lines) + "\n"


def _claim_text(v) -> str:
    """A claim's record as the study JSON writes it (undefined spreads as ``null``), floats to
    4 significant digits so the bullet stays readable; the JSON keeps the full values."""
    def short(x):
        if isinstance(x, dict):
            return {k: short(y) for k, y in x.items()}
        if isinstance(x, list):
            return [short(y) for y in x]
        return float(f"{x:.4g}") if isinstance(x, float) else x
    return json.dumps(short(to_jsonable(v)))
