"""How fast a request's drafted confidences go stale: the production policy's budget input.

The production policy (docs/SERVING.md) searches its draft budget on each request's *latest
drafted* confidences. While it chooses plain steps it draws no new ones, so after ``k`` plain
steps it reads a vector ``k + 1`` steps old (up to ``explore_every`` = 16, or more on the device
loop's backed-off exploration). This measures how well such a vector predicts the one the request
would draft now.

One request at a time (C = 1) on the host loop with the "threshold" policy at threshold 0 (every
step drafts and verifies all γ drafts, so every step's confidences exist) serves held-out prompts
of each domain; per step it records ``S_t = Σ_j Π_{i≤j} c_{t,i}``, the expected number of
accepted drafts the confidences state (the quantity the budget search weighs). Per lag ``k``,
over all pairs ``(S_t, S_{t+k})`` of one request:

* ``corr``: their correlation;
* ``mse_stale``: mean squared error of predicting ``S_{t+k}`` by ``S_t`` (what production does);
* ``mse_mean``: by the mean of all steps' ``S`` (a running prior; in-sample, so slightly
  flattered);
* ``mse_shrunk``: by ``mean + corr · (S_t − mean)`` (the stale value shrunk towards the mean by
  the lag's correlation; in-sample too);
* ``mse_decay``: by the ``S`` of the production policy's input at ``SchedulerConfig``'s default
  ``stale_decay`` ρ: the drafted vector shrunk by ``ρ^lag`` towards the prior whose survivals
  are the mean of all steps' (:func:`specjax.scheduling.shrink_stale`, in survival space, so
  its ``S`` is ``mean + ρ^lag · (S_t − mean)``; in-sample again).

Per temperature, ``decay_fit`` gives the pooled MSE over the lags of that rule for ρ on a grid
and the ρ that minimises it (each lag weighted equally); ``best_decay_pooled`` minimises the MSE
summed over the temperatures, the figure ``SchedulerConfig.stale_decay``'s default comes from.

Run:
    python -m benchmarks.confidence_staleness --target <quickstart dir>/target-<key> \\
        --drafter <DSpark-Markov workdir>
    python -m benchmarks.confidence_staleness --quick   # random tiny target, fresh DSpark drafter

Writes ``--out`` (JSON, default ``benchmarks/results/confidence_staleness.json``; ``--quick``: a
file in the temp directory), a PNG beside it and ``<out>_traces.npz``: per temperature
(``T0/...``, ``T1/...``) each step that verified all γ drafts, request by request in order
(``request``, ``confidences``, ``num_accepted``), which ``experiments.scheduler_sim --traces FILE
--sequential`` replays step by step.
"""
from __future__ import annotations

import argparse
import os
import platform

import numpy as np

from benchmarks.mtp_window import add_model_args, check_model_args, load_models
from benchmarks.row_buckets import write_results
from specjax.machine import cpu_model
from specjax.paths import portable_values


DECAY_GRID = tuple(np.round(np.linspace(0.0, 1.0, 21), 2).tolist())


def survival_sum(conf: np.ndarray) -> np.ndarray:
    """``S = Σ_j Π_{i≤j} c_i`` of confidence vectors ``[N, γ]``."""
    from specjax.scheduling import prefix_survival
    return prefix_survival(conf).sum(axis=1)


def _pairs(vecs: list[np.ndarray], k: int):
    """Vectors ``[N, γ]`` at ``t`` and ``t + k`` within each sequence, or None if none."""
    pairs = [(v[:-k], v[k:]) for v in vecs if len(v) > k]
    if not pairs:
        return None
    return np.concatenate([p[0] for p in pairs]), np.concatenate([p[1] for p in pairs])


def _prior(vecs: list[np.ndarray]) -> np.ndarray:
    """The confidences whose survivals are the mean of all steps' (the policy's running prior,
    here in-sample)."""
    from specjax.scheduling import confidences_from_survival, prefix_survival
    return confidences_from_survival(prefix_survival(np.concatenate(vecs)).mean(axis=0))


def _mse_decay(x: np.ndarray, y_s: np.ndarray, prior: np.ndarray, k: int, decay: float) -> float:
    from specjax.scheduling import shrink_stale
    pred = shrink_stale(x, prior, np.full(len(x), k), decay)
    return float(np.mean((y_s - survival_sum(pred)) ** 2))


def lag_table(vecs: list[np.ndarray], lags, decay: float) -> list[dict]:
    """Per lag: pairs ``(S_t, S_{t+lag})`` within each sequence of confidence vectors ``vecs``
    (``[steps, γ]`` each); the module docstring's columns. Lags with fewer than 3 pairs are left
    out."""
    prior = _prior(vecs)
    mu = float(np.mean(survival_sum(np.concatenate(vecs))))
    rows = []
    for k in lags:
        got = _pairs(vecs, k)
        if got is None:
            continue
        xv, yv = got
        x, y = survival_sum(xv), survival_sum(yv)
        if len(x) < 3 or np.std(x) == 0 or np.std(y) == 0:
            continue
        rho = float(np.corrcoef(x, y)[0, 1])
        rows.append({"lag": int(k), "pairs": int(len(x)), "corr": rho,
                     "mse_stale": float(np.mean((y - x) ** 2)),
                     "mse_mean": float(np.mean((y - mu) ** 2)),
                     "mse_shrunk": float(np.mean((y - mu - rho * (x - mu)) ** 2)),
                     "mse_decay": _mse_decay(xv, y, prior, k, decay)})
    return rows


def decay_fit(vecs: list[np.ndarray], lags, grid=DECAY_GRID) -> dict:
    """Pooled MSE (mean over ``lags``, each lag weighted equally) of predicting ``S_{t+lag}`` by
    the drafted vector shrunk by ``ρ^lag``, for each ρ of ``grid``; and the best ρ."""
    prior = _prior(vecs)
    per_lag = []
    for k in lags:
        got = _pairs(vecs, k)
        if got is not None and len(got[0]) >= 3:
            per_lag.append((k, got[0], survival_sum(got[1])))
    if not per_lag:
        return {}
    mse = [float(np.mean([_mse_decay(x, y, prior, k, r) for k, x, y in per_lag])) for r in grid]
    return {"grid": list(grid), "mse": mse, "best": grid[int(np.argmin(mse))],
            "lags": [k for k, _, _ in per_lag]}


def run(args) -> dict:
    from specjax.engine import Engine, EngineConfig, Request
    from specjax.scheduling import SchedulerConfig
    target, drafter, params, frozen, gamma, prompts = load_models(args, kind="dspark")
    decay = SchedulerConfig("production").stale_decay

    class Recording(Engine):
        """Records each step's confidences of the one active slot, and with them the drafts
        the step verified and accepted."""
        seen: list = []
        verified: list = []

        def _host_confidences(self, draft):
            conf = super()._host_confidences(draft)
            if conf is not None:
                live = next(i for i, slot in enumerate(self.slots) if slot is not None)
                self.seen.append((self.slots[live].request.seed, conf[live].copy()))
            return conf

        def _step(self):
            n = len(self.seen)
            stats = super()._step()
            if stats is not None and len(self.seen) > n:
                self.verified.append((stats.drafts_verified, stats.accepted))
            return stats

    cfg = EngineConfig(num_slots=1, max_len=args.prompt_len + args.new_tokens + gamma + 2,
                       gamma=gamma, prefill_buckets=(args.prompt_len,), filters=False,
                       loop="host", scheduler=SchedulerConfig("threshold", threshold=0.0))
    eng = Recording(target, drafter, params, frozen, cfg)
    eng.warmup(profile=False)
    cells, traces = [], {}
    for t in args.temperatures:
        seqs, rec = [], []  # rec: (request, confidences, accepted) of steps verifying all γ
        for d in args.domains:
            eng.seen, eng.verified = [], []
            reqs = [Request(prompt=p, max_new_tokens=args.new_tokens, temperature=t, seed=i)
                    for i, p in enumerate(prompts[d])]
            eng.generate(reqs)
            assert len(eng.verified) == len(eng.seen)  # one record per drafting step
            by_req: dict = {}
            for (rid, c), (n_ver, n_acc) in zip(eng.seen, eng.verified):
                by_req.setdefault(rid, []).append(np.asarray(c, np.float64))
                if n_ver == gamma:  # a request's last steps verify fewer: not a full record
                    rec.append((len(seqs) + list(by_req).index(rid), c, n_acc))
            seqs += [np.stack(v) for v in by_req.values()]
        traces[f"T{t:g}/request"] = np.asarray([r[0] for r in rec], np.int32)
        traces[f"T{t:g}/confidences"] = np.asarray([r[1] for r in rec], np.float32)
        traces[f"T{t:g}/num_accepted"] = np.asarray([r[2] for r in rec], np.int16)
        flat = survival_sum(np.concatenate(seqs))
        cell = {"temperature": t, "requests": len(seqs), "steps": int(flat.size),
                "mean_s": float(flat.mean()), "sd_s": float(flat.std()),
                "lags": lag_table(seqs, args.lags, decay),
                "decay_fit": decay_fit(seqs, args.lags)}
        cells.append(cell)
        for r in cell["lags"]:
            print(f"T={t:g} lag {r['lag']:2d}: corr {r['corr']:.2f}  MSE stale {r['mse_stale']:.3f}"
                  f"  mean {r['mse_mean']:.3f}  shrunk {r['mse_shrunk']:.3f}  decay "
                  f"{r['mse_decay']:.3f}  ({r['pairs']} pairs)")
        print(f"T={t:g} best stale_decay {cell['decay_fit'].get('best')}")
    fits = [c["decay_fit"] for c in cells if c["decay_fit"]]
    pooled = None
    if fits:  # the ρ with the least MSE summed over the temperatures
        total = np.sum([f["mse"] for f in fits], axis=0)
        pooled = fits[0]["grid"][int(np.argmin(total))]
        print(f"best stale_decay over the temperatures: {pooled}")
    return {"machine": f"{cpu_model() or platform.machine()}", "gamma": gamma,
            "stale_decay": decay, "best_decay_pooled": pooled,
            "args": portable_values(vars(args)), "cells": cells, "_traces": traces}


def plot(result: dict, png: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6.4, 4))
    for i, c in enumerate(result["cells"]):
        lags = [r["lag"] for r in c["lags"]]
        for key, style in (("mse_stale", "-o"), ("mse_mean", "--"), ("mse_shrunk", ":s"),
                           ("mse_decay", "-.^")):
            ax.plot(lags, [r[key] for r in c["lags"]], style, color=f"C{i}",
                    label=f"T={c['temperature']:g} {key[4:]}"
                    + (f" ρ={result['stale_decay']:g}" if key == "mse_decay" else ""))
    ax.set_xscale("log", base=2)
    ax.set_xlabel("age of the drafted confidences (steps)")
    ax.set_ylabel("MSE predicting Σ survival now")
    ax.set_title("Stale confidences vs the mean (C = 1)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_model_args(p, kind="dspark")
    p.add_argument("--domains", nargs="+", default=["math", "code", "prose"])
    p.add_argument("--temperatures", nargs="+", type=float, default=[0.0, 1.0])
    p.add_argument("--prompts", type=int, default=16, help="held-out prompts per domain")
    p.add_argument("--prompt_len", type=int, default=32)
    p.add_argument("--new_tokens", type=int, default=96)
    p.add_argument("--lags", nargs="+", type=int, default=[1, 2, 4, 8, 16])
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    check_model_args(p, args)
    if min(args.lags) < 1 or args.prompts < 1 or args.new_tokens < 2:
        p.error("--lags must be >= 1, --prompts >= 1 and --new_tokens >= 2")
    if args.quick:
        args.domains, args.prompts, args.new_tokens, args.prompt_len = ["math"], 2, 12, 8
        args.lags = [1, 2]
    result = run(args)
    traces = result.pop("_traces")
    out = write_results(args, "confidence_staleness", result, plot)
    # the recorded steps, request by request: specjax.sched_sim.Traces.load, and
    # experiments.scheduler_sim --traces FILE --sequential
    path = os.path.splitext(out)[0] + "_traces.npz"
    np.savez_compressed(path, **traces)
    print(f"-> {path}")
    return result


if __name__ == "__main__":
    main()
