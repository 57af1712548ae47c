"""Metrics as JSON lines and TensorBoard event files, and the loss-curve plot.

``metrics.jsonl`` holds one object per log event: ``{"step": s, "split": "train", ...}`` for
training and ``{"step": s, "split": "eval/<domain>", ...}`` for each evaluated domain. Only
process 0 writes. When a run resumes from step ``s``, lines with ``step > s`` (written by the
interrupted run after its last complete checkpoint) are dropped so the file describes one run.

The same values go to a TensorBoard event file next to it (``events.out.tfevents.*``, tags
``<split>/<name>``, e.g. ``train/loss``, ``eval/math/ce``; :mod:`specjax.training.tensorboard`),
so ``tensorboard --logdir <workdir>`` shows the run. A resumed run starts a new event file.
"""
from __future__ import annotations

import json
import math
import os
from typing import Any, Mapping, Optional


class MetricsWriter:
    """Appends JSON lines to ``path`` and TensorBoard scalars to an event file in its directory
    (no-op when ``enabled`` is false; no event file when ``tensorboard`` is false)."""

    def __init__(self, path: str, *, enabled: bool = True, resume_step: Optional[int] = None,
                 tensorboard: bool = True):
        self.path = path
        self.enabled = enabled
        self.events = None
        if not enabled:
            return
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        if tensorboard:
            from specjax.training.tensorboard import EventWriter
            self.events = EventWriter(os.path.dirname(path) or ".")
        if resume_step is None:
            open(path, "w").close()
        elif os.path.exists(path):
            kept = [r for r in read_metrics(path) if r.get("step", 0) <= resume_step]
            with open(path, "w") as f:
                f.writelines(json.dumps(r) + "\n" for r in kept)

    def write(self, step: int, split: str, values: Mapping[str, Any]) -> None:
        if not self.enabled:
            return
        record = {"step": int(step), "split": split}
        for k, v in values.items():
            v = float(v)
            record[k] = v if math.isfinite(v) else str(v)
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        if self.events is not None:
            self.events.scalars(step, {f"{split}/{k}": float(v) for k, v in values.items()})


def read_metrics(path: str) -> list[dict]:
    """All complete records of a metrics file (a torn last line from a killed run is skipped)."""
    out = []
    with open(path) as f:
        for line in f:
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return out


def plot_loss_curve(metrics_path: str, png_path: str, key: str = "loss") -> None:
    """Train loss (and per-domain eval ``ce``) against step, written with the Agg backend."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_metrics(metrics_path)
    fig, ax = plt.subplots(figsize=(7, 4))
    train = [(r["step"], r[key]) for r in records
             if r.get("split") == "train" and isinstance(r.get(key), float)]
    if train:
        ax.plot(*zip(*train), label=f"train {key}")
    for split in sorted({r["split"] for r in records if r.get("split", "").startswith("eval/")}):
        pts = [(r["step"], r["ce"]) for r in records
               if r.get("split") == split and isinstance(r.get("ce"), float)]
        if pts:
            ax.plot(*zip(*pts), marker="o", label=f"{split} ce")
    ax.set_xlabel("step")
    ax.set_ylabel("nats / token")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(png_path, dpi=100)
    plt.close(fig)
