"""The report side of the serving benchmark (:mod:`benchmarks.serving`): the markdown tables, the
serving goals computed from the closed-loop medians, and the aggregate / per-user Pareto plot.

It works on the results dict that ``benchmarks.serving`` writes as JSON, so a saved run can be
re-rendered (``--render``) or its goals checked without an engine.
"""
from __future__ import annotations

import os

import numpy as np

# "<policy>+cal": the policy reading confidences calibrated online on the verifier's past
# decisions (EngineConfig.online_calibration; device loop only). Defined here, not beside
# POLICIES, because the goals default to these and this module must not import the benchmark.
CALIBRATED = ("dspark+cal", "production+cal")


def write_markdown(report: dict, path: str, argv) -> None:
    lines = ["# Serving benchmark (measured)", "",
             f"Machine: {report['machine']} ({report['backend']}), γ = {report['gamma']}. "
             "Medians over repetitions; see `benchmarks/serving.py`.", "",
             "Command: `.venv/bin/python -m benchmarks.serving "
             + " ".join(argv or []) + "`", ""]
    for c, block in report["closed_loop"].items():
        lines += [f"## Closed loop, concurrency {c}", "",
                  "| policy | aggregate tok/s | per-user tok/s | τ | mean bucket | TTFT ms | "
                  "ITL p50 ms | ITL p99 ms | step ms | drafted | scheduler µs/step | "
                  "scheduler cost | overlapped µs/step |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for p, r in block["policies"].items():
            lines.append(f"| {p} | {r['aggregate_tok_s']:.1f} | {r['per_user_tok_s']:.1f} | "
                         f"{r['tau']:.2f} | {r['mean_bucket']:.1f} | {r['ttft_ms']:.1f} | "
                         f"{r['itl_p50_ms']:.1f} | {r['itl_p99_ms']:.1f} | "
                         f"{r['step_ms']:.1f} | {100 * r['drafted_frac']:.0f}% | "
                         f"{r['host_us_per_step']:.0f} | "
                         f"{100 * r['host_frac']:.2f}% | "
                         f"{r.get('host_overlap_us_per_step', 0):.0f} |")
        lines.append("")
    lines += goals_markdown(report)
    if report["overlap"]:
        o = report["overlap"]
        lines += [f"Overlap of drafting with host work at concurrency {o['concurrency']}: "
                  f"aggregate throughput on/off = {o['median']:.3f} (runs: "
                  + ", ".join(f"{x:.3f}" for x in o["on_over_off_aggregate"]) + ")", ""]
    for rate, block in report["poisson"].items():
        lines += [f"## Open loop, Poisson {rate} requests/s", "",
                  "| policy | aggregate tok/s | per-user tok/s | TTFT ms (from arrival) | "
                  "ITL p99 ms |", "|---|---|---|---|---|"]
        for p, r in block.items():
            lines.append(f"| {p} | {r['aggregate_tok_s']:.1f} | {r['per_user_tok_s']:.1f} | "
                         f"{r['ttft_ms']:.1f} | {r['itl_p99_ms']:.1f} |")
        lines.append("")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write("\n".join(lines))


def _mtp1_curve(cl: dict):
    """MTP-1's ``(aggregates, per-user speeds)`` in order of concurrency when they form a
    trade-off curve (aggregate strictly rising, per-user speed not rising), else a note why not."""
    pts = [(cl[c]["policies"]["mtp1"]["aggregate_tok_s"], cl[c]["policies"]["mtp1"]["per_user_tok_s"])
           for c in sorted(cl, key=int)]
    xs, ys = [a for a, _ in pts], [u for _, u in pts]
    if len(pts) < 2:
        return "fewer than two concurrencies"
    if any(b <= a for a, b in zip(xs, xs[1:])) or any(b > a for a, b in zip(ys, ys[1:])):
        return ("MTP-1's aggregate / per-user points are not a trade-off curve in concurrency "
                "order, so a per-user speed 'at the same aggregate' is not defined")
    return xs, ys


def goals(report: dict, policies=("dspark", "production", *CALIBRATED)) -> dict:
    """The serving goals per confidence policy, from the closed-loop medians (no thresholds here).

    * ``vs_best_fixed[C]``: the policy's aggregate / the best fixed-K (fixed*, mtp1) aggregate.
    * ``vs_none_at_max``: its aggregate / no-speculation aggregate at the highest C.
    * ``per_user_vs_mtp1[C]``: at each of its points whose aggregate lies inside MTP-1's range,
      its per-user speed / MTP-1's per-user speed at the same aggregate (linear interpolation
      along MTP-1's curve). Only defined when MTP-1's points, in order of concurrency, form a
      trade-off curve (aggregate rising, per-user speed not rising); otherwise "the same
      aggregate" is ambiguous (several concurrencies reach it), the dict stays empty and
      ``per_user_vs_mtp1_note`` says why.
    """
    cl = report["closed_loop"]
    out = {}
    for pol in policies:
        if not cl or pol not in next(iter(cl.values()))["policies"]:
            continue
        g = {"vs_best_fixed": {}, "vs_none_at_max": None, "per_user_vs_mtp1": {}}
        for c, block in cl.items():
            pols = block["policies"]
            fixed = {p: r["aggregate_tok_s"] for p, r in pols.items()
                     if p.startswith("fixed") or p == "mtp1"}
            if fixed:
                best = max(fixed, key=fixed.get)
                g["vs_best_fixed"][c] = {"ratio": pols[pol]["aggregate_tok_s"] / fixed[best],
                                         "best_fixed": best}
        top = cl[max(cl, key=int)]["policies"]
        if "none" in top:
            g["vs_none_at_max"] = top[pol]["aggregate_tok_s"] / top["none"]["aggregate_tok_s"]
        curve = _mtp1_curve(cl) if "mtp1" in next(iter(cl.values()))["policies"] else None
        if isinstance(curve, str):
            g["per_user_vs_mtp1_note"] = curve
        elif curve is not None:
            xs, ys = curve
            for c, b in cl.items():
                agg, user = (b["policies"][pol][k] for k in ("aggregate_tok_s", "per_user_tok_s"))
                if xs[0] <= agg <= xs[-1]:
                    g["per_user_vs_mtp1"][c] = user / float(np.interp(agg, xs, ys))
        out[pol] = g
    return out


def goals_markdown(report: dict) -> list[str]:
    lines = ["## Goals (computed from the medians above)", ""]
    for pol, g in goals(report).items():
        parts = ["aggregate / best fixed-K aggregate: " + ", ".join(
            f"C={c}: {v['ratio']:.2f} ({v['best_fixed']})" for c, v in g["vs_best_fixed"].items())]
        if g["vs_none_at_max"] is not None:
            parts.append(f"aggregate / no speculation at the highest concurrency: "
                         f"{g['vs_none_at_max']:.2f}")
        if g["per_user_vs_mtp1"]:
            parts.append("per-user speed / MTP-1's at the same aggregate: " + ", ".join(
                f"C={c}: {v:.2f}" for c, v in g["per_user_vs_mtp1"].items()))
        elif g.get("per_user_vs_mtp1_note"):
            parts.append(f"per-user speed vs MTP-1: not computed ({g['per_user_vs_mtp1_note']})")
        lines += [f"* **{pol}**: " + "; ".join(parts) + "."]
    return lines + [""]


def plot_pareto(report: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 4.5))
    pols = next(iter(report["closed_loop"].values()))["policies"].keys()
    for p in pols:
        xs = [b["policies"][p]["per_user_tok_s"] for b in report["closed_loop"].values()]
        ys = [b["policies"][p]["aggregate_tok_s"] for b in report["closed_loop"].values()]
        ax.plot(xs, ys, marker="o", label=p)
    ax.set_xlabel("per-user tokens/s")
    ax.set_ylabel("aggregate tokens/s")
    ax.set_title("Closed-loop concurrency sweep (each point one concurrency)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
