"""Figures of the RL study (``experiments/rl_study.py``): the analogues of Bebop's Fig. 3, 6, 7,
8 and 9a, held-out accuracy through RL and the pre-RL adaptation sweep, drawn from the summary
that :func:`experiments.rl_study_report.summarize` returns (what they show: docs/RL.md).
"""
from __future__ import annotations

import os

import numpy as np


def write_figures(summary: dict, out_dir: str, tag: str) -> list[str]:
    """Writes the study's PNGs into ``out_dir``; returns their paths."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    arms, paths = summary["arms"], []

    def save(fig, name):
        path = os.path.join(out_dir, f"{name}_{tag}.png")
        fig.tight_layout()
        fig.savefig(path, dpi=90)
        plt.close(fig)
        paths.append(path)

    if arms:  # a study run with no arms (``--set arms=``) has only the adaptation figure
        _arm_figures(arms, save, plt)
    # pre-RL adaptation: accept rate per loss across the sweep cells
    fig, ax = plt.subplots(figsize=(6, 3.2))
    cells = summary["adaptation"]
    keys = sorted({(c["gamma"], c["cap"], c["temp"]) for c in cells})
    for loss in sorted({c["loss"] for c in cells}):
        v = {(c["gamma"], c["cap"], c["temp"]): c["accept_rate"] for c in cells if c["loss"] == loss}
        ax.plot(range(len(keys)), [v.get(k, np.nan) for k in keys], "o-", label=loss)
    ax.set_xticks(range(len(keys)), [f"γ{g} c{c} T{t}" for g, c, t in keys], rotation=30,
                  fontsize=7)
    ax.set_ylabel("held-out RS accept rate"), ax.legend(fontsize=7)
    save(fig, "adaptation")
    return paths


def _arm_figures(arms: dict, save, plt) -> None:
    """The analogues of Bebop's Fig. 3, 6, 8, 9a and 7 (one PNG each, through ``save``)."""
    spec = [n for n in arms if arms[n]["per_seed"] and arms[n]["per_seed"][0] is not None]
    # Fig. 3: eq. 16 decomposition (first seed)
    fig, axes = plt.subplots(1, max(1, len(spec)), figsize=(3.2 * max(1, len(spec)), 2.8),
                             squeeze=False)
    for ax, n in zip(axes[0], spec):
        d = arms[n]["per_seed"][0]["decomposition"]
        for k, col in (("total", "gray"), ("entropy", "tab:orange"), ("mismatch", "tab:green")):
            ax.plot(d[k], color=col, label=k)
        ax.set_title(n, fontsize=8)
        ax.set_xlabel("RL step")
    axes[0][0].set_ylabel("Δα")
    axes[0][0].legend(fontsize=7)
    save(fig, "fig3_decomposition")
    # Fig. 6: accept length (τ) through RL
    fig, ax = plt.subplots(figsize=(5, 3.2))
    for n in spec:
        ax.plot(arms[n]["mean"]["tau"], label=n)
    ax.set_xlabel("RL step"), ax.set_ylabel("τ (tokens / verify step)"), ax.legend(fontsize=7)
    save(fig, "fig6_accept_length")
    # Fig. 8: entropy vs acceptance per arm
    fig, ax = plt.subplots(figsize=(5, 3.2))
    for n in spec:
        h, a = arms[n]["mean"]["entropy"], arms[n]["mean"]["acceptance"]
        s = arms[n].get("slope", [float("nan")])[0]
        ax.scatter(h, a, s=12, label=f"{n} (b={s:.2f})")
    ax.set_xlabel("policy entropy (nats)"), ax.set_ylabel("acceptance"), ax.legend(fontsize=7)
    save(fig, "fig8_entropy_slope")
    # Fig. 9a: online updates
    fig, ax = plt.subplots(figsize=(5, 3.2))
    for n in ("rs_e2e_tv", "rs_e2e_tv_online_ce", "rs_e2e_tv_online_tv", "rs_ce"):
        if n in arms:
            ax.plot(arms[n]["mean"]["tau"], label=n)
    ax.set_xlabel("RL step"), ax.set_ylabel("τ"), ax.legend(fontsize=7)
    save(fig, "fig9a_online_updates")
    # Fig. 7: rollout and step latency
    fig, ax = plt.subplots(figsize=(6, 3.2))
    names = list(arms)
    x = np.arange(len(names))
    ax.bar(x - 0.2, [arms[n]["rollout_s"][0] for n in names], 0.4, label="rollout")
    ax.bar(x + 0.2, [arms[n]["step_s"][0] for n in names], 0.4, label="step")
    ax.set_xticks(x, names, rotation=30, fontsize=7), ax.set_ylabel("seconds"), ax.legend()
    save(fig, "fig7_latency")
    # held-out accuracy through RL: greedy and (when measured) sampled at the rollout temperature
    fig, ax = plt.subplots(figsize=(7.5, 3.2))
    for i, n in enumerate(arms):
        for key, style in (("heldout_accuracy", "o-"), ("heldout_sampled_accuracy", "s--")):
            v = list(arms[n]["mean"].get(key) or [])
            v.append(arms[n].get("heldout_end", {}).get(key))  # after the last step
            pts = [(t, x) for t, x in enumerate(v) if x is not None and np.isfinite(x)]
            if pts:
                ax.plot(*zip(*pts), style, color=f"C{i}", ms=3,
                        label=f"{n}, {'greedy' if key == 'heldout_accuracy' else 'sampled'}")
    ax.set_xlabel("RL step (evaluated before the step's rollout)")
    # beside the axes: with four arms and two measures, a legend inside covers the curves
    ax.set_ylabel("held-out accuracy")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0)
    save(fig, "heldout_accuracy")
