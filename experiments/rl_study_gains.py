"""Paired, row-clustered standard errors of the RL study's adaptation gains (docs/RL.md §1).

The study's adaptation cells report one held-out acceptance per trained head. Whether e2e-TV beats
KL by Bebop's 3-8 points needs the error of the *difference*: both heads are evaluated here on the
same held-out rows and the same anchors, and the gain's standard error is clustered by row (the
anchors of one row share its text, so they are not independent).

Per row i and head h: ``y_hi`` = Σ over the row's anchor blocks of the teacher-forced
rejection-sampling acceptance ``1 − e2e_tv``
(:func:`specjax.training.drafter_task.block_acceptance`, the blocks the drafter run's eval sums),
``n_i`` = its valid blocks. A head's acceptance is ``Σ y_hi / Σ n_i`` (the drafter run's
``accept_rate``, pooled over rows instead of averaged over batches); the gain is the ratio
estimator of ``y_ai − y_bi`` over ``n_i``, with the cluster-robust error of
:func:`specjax.stats.clustered_ratio`.
"""
from __future__ import annotations

import json
import os

import numpy as np

__all__ = ["row_acceptance", "paired_gain", "paired_gains"]


def row_acceptance(head_workdir: str, eval_file: str):
    """``(y [rows], n [rows])``: per held-out row, summed acceptance over its anchor blocks and
    the number of valid blocks, for the head trained in ``head_workdir`` (anchors drawn as the
    trainer's eval draws them: ``PRNGKey(0)`` per batch, so two heads see the same anchors)."""
    import jax

    from specjax.training import drafter_data
    from specjax.training.drafter_run import load_drafter
    from specjax.training.drafter_task import block_acceptance, position_tv

    _, params, task = load_drafter(head_workdir)
    frozen = task.init_frozen()
    with open(os.path.join(head_workdir, "config.json")) as f:
        batch_size = int(json.load(f)["data"]["batch_size"])  # the trainer's eval batches

    rows = drafter_data.load_rows(eval_file)

    @jax.jit
    def per_row(params, batch, frozen):
        z, _, p, _, mask = task.teacher_forced(params, batch, jax.random.PRNGKey(0), frozen)
        acc, valid = block_acceptance(position_tv(z, p), mask)
        return acc.reshape(acc.shape[0], -1).sum(1), valid.reshape(valid.shape[0], -1).sum(1)

    ys, ns = [], []
    for batches in drafter_data.eval_batches(rows, batch_size=batch_size).values():
        for b in batches:
            y, n = jax.device_get(per_row(params, b, frozen))
            ys.append(y)
            ns.append(n)
    y, n = np.concatenate(ys).astype(np.float64), np.concatenate(ns).astype(np.float64)
    keep = n > 0  # padding rows of the last batch
    return y[keep], n[keep]


def paired_gain(a: tuple, b: tuple) -> dict:
    """Gain of head a over head b in points, from their :func:`row_acceptance` on the same rows:
    ``{"a", "b", "gain_points", "gain_se_points", "rows"}``."""
    from specjax.stats import clustered_ratio
    (ya, na), (yb, nb) = a, b
    if na.shape != nb.shape or not np.array_equal(na, nb):
        raise ValueError("the two heads were not evaluated on the same rows and anchors")
    d, se = clustered_ratio(ya - yb, na)
    return {"a": float(ya.sum() / na.sum()), "b": float(yb.sum() / nb.sum()),
            "gain_points": 100.0 * d, "gain_se_points": 100.0 * se, "rows": int(na.size)}


def paired_gains(workdir: str, cells: list[dict], loss_a: str = "e2e_tv",
                 loss_b: str = "kl") -> list[dict]:
    """:func:`paired_gain` of ``loss_a`` over ``loss_b`` for every (γ, capacity, temperature) cell
    the study trained both for (heads in ``<workdir>/adapt/<cell name>``, eval rows in
    ``<workdir>/data/eval_t<temp>.npz``)."""
    by_key = {(c["loss"], c["gamma"], c["cap"], c["temp"]): c for c in cells}
    out = []
    for (loss, g, cap, t), c in sorted(by_key.items()):
        other = by_key.get((loss_b, g, cap, t))
        if loss != loss_a or other is None:
            continue
        eval_file = os.path.join(workdir, "data", f"eval_t{t}.npz")
        res = paired_gain(row_acceptance(os.path.join(workdir, "adapt", c["name"]), eval_file),
                          row_acceptance(os.path.join(workdir, "adapt", other["name"]), eval_file))
        out.append({"gamma": g, "cap": cap, "temp": t, **res})
    return out
