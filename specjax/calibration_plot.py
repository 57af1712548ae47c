"""Reliability diagrams of a confidence head's prefix-survival predictions, before / after STS.

The quantities and conventions (``confidence_logits`` ``[N, γ]``, ``accepted`` ``[N, γ]``,
``num_verified`` ``[N]``, which blocks enter position k) are those of :mod:`specjax.calibration`;
the layout is DSpark's Fig. 6.
"""
from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from specjax.calibration import (DEFAULT_N_BINS, _bin_index, _check_blocks, apply_temperatures,
                                 position_metrics, reliability_bins, sigmoid, survival)

__all__ = ["plot_reliability"]


def plot_reliability(
    path: str,
    confidence_logits,
    accepted,
    *,
    temperatures=None,
    num_verified=None,
    n_bins: int = DEFAULT_N_BINS,
    positions: Optional[Sequence[int]] = None,
    title: Optional[str] = None,
) -> str:
    """Reliability diagram of prefix survival, one panel per position, before / after STS.

    Each panel plots, per equal-width bin, the mean predicted survival ``a_k`` against the
    observed survival rate, for the raw confidences and (if ``temperatures`` is given) the
    calibrated ones, over a shaded histogram of sample counts per bin (calibrated predictions
    when available), with ECE and AUROC in the title — the layout of DSpark Fig. 6.

    Args:
      path: output PNG path (written with matplotlib's Agg canvas; no display needed).
      confidence_logits, accepted, num_verified, n_bins: as :func:`position_metrics`.
      temperatures: optional ``[γ]`` fitted temperatures.
      positions: 1-based positions to draw (default all).
      title: optional figure title.

    Returns:
      ``path``.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    logits, acc = _check_blocks(confidence_logits, accepted)
    gamma = logits.shape[1]
    positions = list(range(1, gamma + 1)) if positions is None else [int(k) for k in positions]
    if not positions or min(positions) < 1 or max(positions) > gamma:
        raise ValueError(f"positions must be 1-based in [1, {gamma}], got {positions}")
    survived, observed = survival(acc, num_verified)
    a_raw = np.cumprod(sigmoid(logits), axis=1)
    a_cal = (None if temperatures is None
             else np.cumprod(apply_temperatures(logits, temperatures), axis=1))
    before = position_metrics(logits, acc, num_verified=num_verified, n_bins=n_bins)
    after = (None if temperatures is None else
             position_metrics(logits, acc, temperatures=temperatures, num_verified=num_verified,
                              n_bins=n_bins))

    fig = Figure(figsize=(3.2 * len(positions), 3.6))
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, len(positions), squeeze=False)[0]
    edges = np.linspace(0.0, 1.0, n_bins + 1)
    for ax, k in zip(axes, positions):
        o = observed[:, k - 1]
        y = survived[o, k - 1]
        hist_pred = (a_cal if a_cal is not None else a_raw)[o, k - 1]
        counts = np.bincount(_bin_index(hist_pred, n_bins), minlength=n_bins)
        hx = ax.twinx()
        hx.bar(edges[:-1], counts, width=1.0 / n_bins, align="edge", color="0.85", zorder=0)
        hx.set_yticks([])
        ax.set_zorder(hx.get_zorder() + 1)
        ax.patch.set_visible(False)
        ax.plot([0, 1], [0, 1], ls="--", color="0.4", lw=1, label="perfect")
        _, mp, ml = reliability_bins(a_raw[o, k - 1], y, n_bins=n_bins)
        ax.plot(mp, ml, "o-", color="tab:red", ms=3, label="before")
        label = f"Position {k}\nECE {100 * before['ece'][k - 1]:.1f}%"
        if a_cal is not None:
            _, mp, ml = reliability_bins(a_cal[o, k - 1], y, n_bins=n_bins)
            ax.plot(mp, ml, "s-", color="tab:blue", ms=3, label="after")
            label += f" → {100 * after['ece'][k - 1]:.1f}%"
            label += f"\nAUC {before['auroc'][k - 1]:.3f} → {after['auroc'][k - 1]:.3f}"
        else:
            label += f"\nAUC {before['auroc'][k - 1]:.3f}"
        ax.set_title(label, fontsize=9)
        ax.set_xlim(0, 1)
        ax.set_ylim(0, 1)
        ax.set_xlabel("predicted survival")
    axes[0].set_ylabel("observed survival")
    axes[0].legend(loc="upper left", fontsize=7)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return path
