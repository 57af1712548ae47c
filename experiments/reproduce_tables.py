"""Tables of the reproduction driver (:mod:`experiments.reproduce`): the Bebop Table 2 and DSpark
Table 1 analogues and the calibration summary, each a mean over training seeds with standard
errors that combine the seed spread and the held-out sample (clustered by row,
:mod:`specjax.stats`), and their markdown."""
from __future__ import annotations

from typing import Optional

import numpy as np

DOMAINS = ("math", "code", "prose", "all")  # "all" = the three pooled
LOSS_NAMES = {"ce": "CE", "kl": "KL", "rkl": "reverse KL", "tv": "TV", "e2e_tv": "e2e-TV"}


def _mean_se(values):
    v = np.asarray([x for x in values if x is not None and np.isfinite(x)], np.float64)
    if v.size == 0:
        return float("nan"), float("nan")
    return float(v.mean()), (float(v.std(ddof=1) / np.sqrt(v.size)) if v.size > 1
                             else float("nan"))


def _quadrature(*se) -> float:
    """``sqrt(Σ se²)`` over the finite terms (nan when none is finite)."""
    v = [x for x in se if x is not None and np.isfinite(x)]
    return float(np.sqrt(np.sum(np.square(v)))) if v else float("nan")


def _rows_se(cells: list, ref_cells: Optional[list] = None) -> float:
    """Row-clustered s.e. of the seed-pooled acceptance (accepted / γ) of ``cells`` (one
    :func:`specjax.evaluation_stats.summarize` dict per seed, all on the same held-out rows), or of
    its difference to ``ref_cells`` (same seeds, rows and anchors: paired by row). Each row's
    accepted drafts and steps are summed over the seeds; nan when a cell lacks ``per_row`` or the
    pairs' anchors differ."""
    from specjax.stats import clustered_ratio
    y: dict = {}
    n: dict = {}
    for k, m in enumerate(cells):
        pr = m.get("per_row")
        if pr is None:
            return float("nan")
        g = len(m["acceptance"])
        sub = None
        if ref_cells is not None:
            sub = ref_cells[k].get("per_row")
            if sub is None or sub["row"] != pr["row"] or sub["steps"] != pr["steps"]:
                return float("nan")
        for i, r in enumerate(pr["row"]):
            v = pr["accepted"][i] - (sub["accepted"][i] if sub is not None else 0)
            y[r] = y.get(r, 0.0) + v / g
            n[r] = n.get(r, 0.0) + pr["steps"][i]
    if len(y) < 2:
        return float("nan")
    rows = sorted(y)
    return clustered_ratio([y[r] for r in rows], [n[r] for r in rows])[1]


def bebop_table(results: dict, losses, seeds: int, prefix: str = "bebop",
                ref: str = "ce") -> dict:
    """Per loss and domain: RS@1 / TO@1 acceptance (accepted / γ) and the Δ of RS@1 vs the
    ``ref`` loss (default CE), means over seeds, and the entropy slopes.

    Two sources of error are estimated and combined in quadrature (``*_se``; both are kept):

    * ``*_se_seeds`` — the s.e. over seeds (training randomness; nan with one seed);
    * ``*_se_rows`` — the held-out sample: the s.e. of the seed-pooled value clustered by
      held-out row (the anchors of one row share its context), paired by row for Δ (every drafter
      is evaluated at the same anchors).

    Slopes: ``rs_slope_se`` combines the seed s.e. with the mean over seeds of each seed's
    row-clustered slope s.e. (not divided by √seeds: the seeds share the rows)."""
    out = {}
    for loss in losses:
        row = {}
        for d in DOMAINS:
            cells, ref_cells, to, delta, slope_se_rows = [], [], [], [], []
            slopes = {"RS": [], "TO": []}
            for s in range(seeds):
                name = f"{prefix}_{loss}_s{s}"
                ce = f"{prefix}_{ref}_s{s}"
                if name not in results or d not in results[name].get("RS@1", {}):
                    continue
                m = results[name]["RS@1"][d]
                cells.append(m)
                slopes["RS"].append(-m["entropy_fit"]["slope"])
                slope_se_rows.append(m["entropy_fit"].get("slope_se_clustered", np.nan))
                if "TO@1" in results[name]:
                    to.append(results[name]["TO@1"][d]["accept_rate"])
                    slopes["TO"].append(-results[name]["TO@1"][d]["entropy_fit"]["slope"])
                if ce in results and d in results[ce].get("RS@1", {}):
                    ref_cells.append(results[ce]["RS@1"][d])
                    delta.append(m["accept_rate"] - ref_cells[-1]["accept_rate"])
            if not cells:
                continue
            rs_m, rs_se_seeds = _mean_se([m["accept_rate"] for m in cells])
            rs_se_rows = _rows_se(cells)
            if len(cells) == 1 and not np.isfinite(rs_se_rows):  # old JSON: no per-row sums
                rs_se_rows = float(cells[0]["accept_rate_se"])
            d_m, d_se_seeds = _mean_se(delta)
            d_se_rows = _rows_se(cells, ref_cells) if len(ref_cells) == len(cells) \
                else float("nan")
            sl_m, sl_se_seeds = _mean_se(slopes["RS"])
            sl_rows = [x for x in slope_se_rows if x is not None and np.isfinite(x)]
            row[d] = {"rs": rs_m, "rs_se": _quadrature(rs_se_seeds, rs_se_rows),
                      "rs_se_seeds": rs_se_seeds, "rs_se_rows": rs_se_rows,
                      "delta": d_m, "delta_se": _quadrature(d_se_seeds, d_se_rows),
                      "delta_se_seeds": d_se_seeds, "delta_se_rows": d_se_rows,
                      "to": _mean_se(to)[0], "to_se": _mean_se(to)[1],
                      "rs_slope": sl_m,
                      "rs_slope_se": _quadrature(sl_se_seeds,
                                                 float(np.mean(sl_rows)) if sl_rows else np.nan),
                      "to_slope": _mean_se(slopes["TO"])[0], "n_seeds": len(cells)}
        out[loss] = row
    return out


def bebop_delta_markdown(table: dict, ref: str) -> str:
    """One line per loss: Δ accepted/γ (points) vs ``ref`` per domain, ± s.e."""
    f = lambda v, p=1: "—" if v is None or not np.isfinite(v) else f"{v:.{p}f}"
    lines = [f"| Δ vs {LOSS_NAMES.get(ref, ref)} (points) | " + " | ".join(DOMAINS) + " |",
             "|---|" + "---|" * len(DOMAINS)]
    for loss, row in table.items():
        if loss == ref:
            continue
        lines.append(f"| {LOSS_NAMES.get(loss, loss)} | " + " | ".join(
            "—" if d not in row else
            f"{'+' if row[d]['delta'] >= 0 else ''}{f(100 * row[d]['delta'])} ± "
            f"{f(100 * row[d]['delta_se'])}" for d in DOMAINS) + " |")
    return "\n".join(lines) + "\n"


def bebop_markdown(table: dict) -> str:
    f = lambda v, p=1: "—" if v is None or not np.isfinite(v) else f"{v:.{p}f}"
    lines = ["| MTP loss (γ = 3) | " + " | ".join(f"{d} RS" for d in DOMAINS) + " | "
             + " | ".join(f"{d} TO" for d in DOMAINS) + " |",
             "|---|" + "---|" * (2 * len(DOMAINS))]
    for loss, row in table.items():
        cells = []
        for d in DOMAINS:
            m = row.get(d)
            if m is None:
                cells.append("—")
            elif loss == "ce":
                cells.append(f"{f(100 * m['rs'])} ± {f(100 * m['rs_se'])}")
            else:
                cells.append(f"{f(100 * m['rs'])} ({'+' if m['delta'] >= 0 else ''}"
                             f"{f(100 * m['delta'])} ± {f(100 * m['delta_se'])})")
        for d in DOMAINS:
            m = row.get(d)
            cells.append("—" if m is None else f"{f(100 * m['to'])}")
        lines.append(f"| {LOSS_NAMES.get(loss, loss)} | " + " | ".join(cells) + " |")
    lines.append("")
    lines.append("Entropy slopes b of α ≈ a − b·H (per nat; RS@1 and TO@1 per-draft acceptance "
                 "probabilities vs target entropy, all verified positions; mean over seeds; RS "
                 "± s.e. combining the seeds and the row-clustered fit):\n")
    lines.append("| | " + " | ".join(DOMAINS) + " |")
    lines.append("|---|" + "---|" * len(DOMAINS))
    if "ce" in table:
        lines.append("| TO (CE head) | " + " | ".join(
            f(table["ce"].get(d, {}).get("to_slope", np.nan), 3) for d in DOMAINS) + " |")
    for loss in ("ce", "kl", "rkl", "tv", "e2e_tv", "tv_scratch", "e2e_tv_scratch"):
        if loss in table:
            lines.append(f"| RS + {LOSS_NAMES.get(loss, loss)} | " + " | ".join(
                "—" if d not in table[loss] else
                f"{f(table[loss][d]['rs_slope'], 3)} ± {f(table[loss][d]['rs_slope_se'], 3)}"
                for d in DOMAINS) + " |")
    return "\n".join(lines) + "\n"


def seed_name(name: str, seed: int) -> str:
    """Run name of drafter ``name`` trained with ``seed``. Seed 0 keeps the bare name, so the
    workdirs of single-seed runs are reused when more seeds are added."""
    return name if seed == 0 else f"{name}_s{seed}"


def dspark_table(results: dict, names: dict, gammas, seeds: int = 1) -> dict:
    """Per drafter label and cell ``<domain>@<γ>``: τ (tokens per verification step, bonus
    included, RS@1) and the predicted E[τ], means over the seeds present.

    ``names``: ``{label: {γ: run name of seed 0}}``; seed s is ``seed_name(name, s)`` (a drafter
    without training, n-gram, has seed 0 only). Errors as in :func:`bebop_table`: ``tau_se``
    combines in quadrature the s.e. over seeds (``tau_se_seeds``; nan with one seed) and the
    row-clustered s.e. of the seed-pooled τ (``tau_se_rows``: every seed is evaluated at the same
    anchors, so each row's accepted drafts and steps are summed over the seeds)."""
    out = {}
    for label, by_g in names.items():
        row = {}
        for g in gammas:
            key = by_g.get(g)
            if key is None:
                continue
            for d in DOMAINS:
                cells = [results[k]["RS@1"][d] for k in (seed_name(key, s) for s in range(seeds))
                         if k in results and d in results[k].get("RS@1", {})]
                if not cells:
                    continue
                tau, se_seeds = _mean_se([m["tau"] for m in cells])
                # _rows_se is per draft (accepted / γ); τ − 1 = accepted per step
                se_rows = _rows_se(cells) * len(cells[0]["acceptance"])
                if not np.isfinite(se_rows) and len(cells) == 1:  # no per-row sums
                    se_rows = float(cells[0]["tau_se"])
                row[f"{d}@{g}"] = {"tau": tau, "tau_se": _quadrature(se_seeds, se_rows),
                                   "tau_se_seeds": se_seeds, "tau_se_rows": se_rows,
                                   "tau_pred": _mean_se([m["tau_pred"] for m in cells])[0],
                                   "tau_per_seed": [m["tau"] for m in cells],
                                   "n_seeds": len(cells)}
        out[label] = row
    return out


def calibration_over_seeds(cal: dict, seeds: int) -> dict:
    """Per confidence drafter (seed-0 run name): the per-position ECEs of
    :func:`experiments.offline_eval.calibration` as mean and s.e. over its seeds (``<key>`` and
    ``<key>_se``; the s.e. is nan with one seed). Keys: ``ece_before`` / ``ece_after`` (survival
    ECE on the scored half, before / after STS) and ``ece_cond_before`` / ``ece_cond_after``
    (conditional ECE)."""
    keys = ("ece_before", "ece_after", "ece_cond_before", "ece_cond_after")
    later = {seed_name(b, s) for b in cal for s in range(1, seeds)}  # runs of seeds ≥ 1
    out = {}
    for base in cal:
        if base in later:
            continue
        runs = [cal[n] for n in (seed_name(base, s) for s in range(seeds)) if cal.get(n)]
        if not runs:
            continue
        entry = {"n_seeds": len(runs)}
        for key in keys:
            per_pos = np.asarray([r[key] for r in runs], np.float64)  # [seeds, γ]
            stats = [_mean_se(per_pos[:, k]) for k in range(per_pos.shape[1])]
            entry[key] = [m for m, _ in stats]
            entry[key + "_se"] = [se for _, se in stats]
        out[base] = entry
    return out


def calibration_seeds_markdown(over: dict) -> str:
    """One table per confidence drafter: ECE (%) per position, mean ± s.e. over seeds."""
    f = lambda m, se: "—" if not np.isfinite(m) else (
        f"{100 * m:.1f}" + (f" ± {100 * se:.1f}" if np.isfinite(se) else ""))
    lines = []
    for name, e in over.items():
        g = len(e["ece_after"])
        lines += [f"\n**{name}** (mean ± s.e. over {e['n_seeds']} seeds, scored half)\n",
                  "| ECE (%) | " + " | ".join(str(k + 1) for k in range(g)) + " |",
                  "|" + "---|" * (g + 1)]
        for key, title in (("ece_before", "survival, before STS"),
                           ("ece_after", "survival, after STS"),
                           ("ece_cond_before", "conditional, before STS"),
                           ("ece_cond_after", "conditional, after STS")):
            lines.append(f"| {title} | " + " | ".join(
                f(m, se) for m, se in zip(e[key], e[key + "_se"])) + " |")
    return "\n".join(lines) + "\n"


def dspark_markdown(table: dict, gammas) -> str:
    f = lambda v, p=2: "—" if v is None or not np.isfinite(v) else f"{v:.{p}f}"
    cols = [(d, g) for g in gammas for d in DOMAINS]
    lines = ["| drafter | " + " | ".join(f"{d} γ={g}" for d, g in cols) + " |",
             "|---|" + "---|" * len(cols)]
    for label, row in table.items():
        lines.append(f"| {label} | " + " | ".join(
            (f"{f(row[f'{d}@{g}']['tau'])} ± {f(row[f'{d}@{g}']['tau_se'])}"
             if f"{d}@{g}" in row else "—") for d, g in cols) + " |")
    if "DFlash" in table and "DSpark-Markov" in table:
        gain = []
        for d, g in cols:
            a, b = table["DFlash"].get(f"{d}@{g}"), table["DSpark-Markov"].get(f"{d}@{g}")
            gain.append("—" if a is None or b is None else
                        f"{100 * (b['tau'] / a['tau'] - 1):+.1f}%")
        lines.append("| Markov vs DFlash | " + " | ".join(gain) + " |")
    return "\n".join(lines) + "\n"
