"""Reports of offline evaluations: JSON (:func:`write_json`, :func:`to_jsonable`), markdown tables
(:func:`results_markdown`) and figures (acceptance per draft position, acceptance against the
target's entropy) from :func:`specjax.evaluation_stats.summarize` results. Also importable from
:mod:`specjax.evaluation`.
"""
from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

import numpy as np

from specjax.paths import dump_json

__all__ = ["to_jsonable", "results_markdown", "plot_acceptance_per_position",
           "plot_acceptance_vs_entropy", "write_json"]


def to_jsonable(x: Any) -> Any:
    """Nested dicts / lists / numpy -> JSON-serialisable (NaN -> None, tuple keys -> "a@b")."""
    if isinstance(x, Mapping):
        return {("@".join(map(str, k)) if isinstance(k, tuple) else str(k)): to_jsonable(v)
                for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [to_jsonable(v) for v in x]
    if isinstance(x, np.ndarray):
        return to_jsonable(x.tolist())
    if isinstance(x, (np.floating, float)):
        v = float(x)
        return None if not math.isfinite(v) else v
    if isinstance(x, (np.integer,)):
        return int(x)
    return x


def _fmt(v, spec=".3f"):
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "—"
    return format(v, spec)


def results_markdown(results: Mapping[str, Mapping[str, Mapping[str, dict]]],
                     domains: Sequence[str], cells: Sequence[str]) -> str:
    """Markdown tables from ``results[drafter][cell][domain] = summarize(...)``.

    ``cells`` are ``"rule@temperature"`` keys. One table of τ (measured, ± s.e., and predicted),
    one of acceptance rates and α₁, one of entropy slopes.
    """
    head = ["| drafter | rule@T | " + " | ".join(domains) + " |",
            "|" + "---|" * (len(domains) + 2)]
    lines = []

    def table(title: str, cell_text) -> None:
        """One row per (drafter, cell); ``cell_text(summary)`` fills a domain's column."""
        lines.append(title)
        lines.extend(head)
        for name, by_cell in results.items():
            for cell in cells:
                if cell not in by_cell:
                    continue
                row = [name, cell]
                for d in domains:
                    m = by_cell[cell].get(d)
                    row.append("—" if m is None else cell_text(m))
                lines.append("| " + " | ".join(row) + " |")

    table("#### τ = mean emitted tokens per step (bonus included): measured ± s.e. "
          "[predicted 1 + Σ_j Π_{i≤j} α_i]\n",
          lambda m: f"{_fmt(m['tau'], '.2f')} ± {_fmt(m['tau_se'], '.2f')} "
                    f"[{_fmt(m['tau_pred'], '.2f')}]")
    table("\n#### acceptance rate = accepted / γ (± s.e.); per-position acceptance α_k\n",
          lambda m: f"{_fmt(100 * m['accept_rate'], '.1f')} ± "
                    f"{_fmt(100 * m['accept_rate_se'], '.1f')} "
                    f"({'/'.join(_fmt(v, '.2f') for v in m['acceptance'][:8])})")
    table("\n#### acceptance vs target entropy: slope b of α ≈ a − b·H (± s.e.), "
          "mean H (nats)\n",
          lambda m: f"{_fmt(-m['entropy_fit']['slope'], '.3f')} ± "
                    f"{_fmt(m['entropy_fit']['slope_se'], '.3f')} "
                    f"(H̄ {_fmt(m['entropy_mean'], '.2f')})")
    return "\n".join(lines) + "\n"


def _figure(ncols: int, width: float = 4.0, height: float = 3.4):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    fig = Figure(figsize=(width * ncols, height))
    FigureCanvasAgg(fig)
    return fig, fig.subplots(1, ncols, squeeze=False)[0]


def _save(fig, axes, path: str, ylabel: str, title: str) -> str:
    """Grid on every panel, the y label on the first, the legend on the last; writes ``path``."""
    for ax in axes:
        ax.grid(alpha=0.3)
    axes[0].set_ylabel(ylabel)
    axes[-1].legend(fontsize=7, loc="lower left")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    return path


def plot_acceptance_per_position(path: str, curves: Mapping[str, Mapping[str, Sequence[float]]],
                                 *, title: str = "") -> str:
    """One panel per domain; ``curves[domain][label] = acceptance per position``."""
    from matplotlib.ticker import MaxNLocator
    domains = list(curves)
    fig, axes = _figure(len(domains))
    for ax, d in zip(axes, domains):
        for label, acc in curves[d].items():
            acc = np.asarray(acc, np.float64)
            ax.plot(np.arange(1, acc.size + 1), acc, "o-", ms=3, label=label)
        ax.set_title(d)
        ax.set_xlabel("draft position k")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # positions are whole numbers
        ax.set_ylim(0, 1)
    return _save(fig, axes, path, "P(accept k | prefix accepted)", title)


def plot_acceptance_vs_entropy(path: str, series: Mapping[str, Mapping[str, dict]], *,
                               title: str = "") -> str:
    """One panel per domain; ``series[domain][label] = summarize(...)`` (binned means + fit)."""
    domains = list(series)
    fig, axes = _figure(len(domains))
    for ax, d in zip(axes, domains):
        for label, m in series[d].items():
            bins = m["entropy_bins"]
            c = np.asarray(bins["center"], np.float64)
            mean = np.array([np.nan if v is None else v for v in bins["mean"]], np.float64)
            n = np.asarray(bins["n"])
            ok = n >= 5
            line, = ax.plot(c[ok], mean[ok], "o", ms=3)
            f = m["entropy_fit"]
            if f["slope"] is not None and np.isfinite(f["slope"] or np.nan):
                xs = np.linspace(0, max(c[ok].max() if ok.any() else 1.0, 0.5), 20)
                ax.plot(xs, f["intercept"] + f["slope"] * xs, "-", color=line.get_color(),
                        label=f"{label} (b={-f['slope']:.3f})")
        ax.set_title(d)
        ax.set_xlabel("target entropy H(p) [nats]")
        ax.set_ylim(0, 1.02)
    return _save(fig, axes, path, "acceptance probability", title)


def write_json(path: str, obj: Any) -> str:
    """:func:`to_jsonable` of ``obj`` written to ``path`` with sorted keys; returns ``path``."""
    return dump_json(path, to_jsonable(obj), sort_keys=True)
