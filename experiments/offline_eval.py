"""Offline evaluation of trained drafters: acceptance, τ, predicted E[τ], entropy slopes, calibration.

For each drafter × (verification rule, temperature) × held-out domain, one speculative step is run
at each of ``A`` anchors of each held-out row: the context is the held-out text up to the anchor,
the drafter *samples* its γ drafts through its own chain, the target scores them in one cached
forward and the real verifier (rejection sampling / target-only / greedy, :mod:`specjax.verify`)
accepts a prefix. See :mod:`specjax.evaluation` for the exact protocol and
:mod:`specjax.evaluation_stats` for the metric definitions.

Command (drafters are trainer workdirs written by ``experiments/train_drafter.py`` or
``experiments/reproduce.py``; ``ngram`` needs no workdir)::

    python -m experiments.offline_eval --target_workdir ~/.cache/specjax/targets/full-<hash> \
        --eval_file runs/repro/data/heldout.npz --gamma 3 \
        --drafter ce=runs/repro/drafters/bebop_ce_s0 --drafter tv=runs/repro/drafters/bebop_tv_s0 \
        --out runs/eval_bebop

Writes ``results.json`` (every metric, per drafter / cell / domain), ``results.md`` (tables),
``acceptance_per_position.png``, ``acceptance_vs_entropy.png`` and, for drafters with a
confidence head, ``calibration_<name>.json`` / ``reliability_<name>.png`` (ECE per position
before / after Sequential Temperature Scaling, fitted on one half of the anchors and scored on the
other).
"""
from __future__ import annotations

import argparse
import os
import time
from typing import Mapping, Optional, Sequence

import numpy as np

DOMAINS = ("math", "code", "prose")
REPORT_DOMAINS = DOMAINS + ("all",)


def cell_key(rule: str, temperature: float) -> str:
    short = {"rejection": "RS", "target_only": "TO", "greedy": "greedy"}[rule]
    return f"{short}@{temperature:g}"


def load_heldout(eval_file: str, domains: Sequence[str] = DOMAINS,
                 max_rows: Optional[int] = None) -> dict:
    """``{domain: (tokens [R, T], lengths [R])}`` from a rows file (first ``max_rows`` each)."""
    from specjax.training import drafter_data
    rows = drafter_data.load_rows(eval_file)
    out = {}
    for d in domains:
        sel = drafter_data.select_domain(rows, d)
        n = len(sel["tokens"]) if max_rows is None else min(max_rows, len(sel["tokens"]))
        if n:
            out[d] = (sel["tokens"][:n], sel["lengths"][:n])
    return out


def load_trained(workdir: str, target_params):
    """``(drafter, params, frozen, gamma)`` of a drafter run, paired with the given target."""
    from specjax.training.drafter_run import load_drafter
    drafter, params, task = load_drafter(workdir)
    return drafter, params, task.shared_head({"target": target_params}), task.gamma


def evaluate(drafters: Mapping[str, tuple], target, heldout: Mapping[str, tuple], *,
             grid=None, anchors_per_row: int = 8, seed: int = 0, max_slots: int = 256,
             gammas: Optional[Mapping[str, int]] = None, pooled: bool = True, log=print):
    """Evaluates every drafter on every domain.

    Args:
      drafters: ``{name: (drafter, params, frozen, gamma)}``.
      target: ``(graphdef, params)``.
      heldout: ``{domain: (tokens, lengths)}``.
      grid: ``(rule, temperature)`` pairs (default :data:`specjax.evaluation.DEFAULT_GRID`).
      gammas: optional ``{name: γ}`` overriding the drafters' own γ at evaluation.
      pooled: also summarize all domains together under the domain name ``"all"`` (results only).
    Returns:
      ``(results, records)``: ``results[name][cell][domain] = summarize(...)`` and the raw
      :class:`~specjax.evaluation_stats.StepRecords` under the same keys. The anchors (and so the
      contexts) are the same for every drafter: comparisons between drafters are paired.
    """
    from specjax import evaluation as E
    from specjax.evaluation_stats import StepRecords, summarize
    grid = E.DEFAULT_GRID if grid is None else grid
    results, records = {}, {}
    for name, (drafter, params, frozen, gamma) in drafters.items():
        gamma = (gammas or {}).get(name, gamma)
        results[name], records[name] = {}, {}
        for domain, (tokens, lengths) in heldout.items():
            t0 = time.perf_counter()
            recs = E.evaluate_drafter(target, drafter, params, frozen, tokens, lengths,
                                      gamma=gamma, grid=grid, anchors_per_row=anchors_per_row,
                                      seed=seed, max_slots=max_slots)
            for (rule, temp), rec in recs.items():
                cell = cell_key(rule, temp)
                results[name].setdefault(cell, {})[domain] = summarize(rec)
                records[name].setdefault(cell, {})[domain] = rec
            first = results[name][cell_key(*grid[min(1, len(grid) - 1)])][domain]
            log(f"  eval {name:>16} {domain:>5}: {first['n_steps']} steps, "
                f"{cell_key(*grid[min(1, len(grid) - 1)])} τ={first['tau']:.2f} "
                f"({time.perf_counter() - t0:.0f}s)")
        if pooled and len(heldout) > 1:  # all domains together (wider entropy range)
            for cell, by_dom in records[name].items():
                rec = StepRecords.concat([by_dom[d] for d in heldout if d in by_dom],
                                         distinct_rows=True)
                results[name][cell]["all"] = summarize(rec)
    return results, records


def split_halves(recs, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Indices ``(fit, score)`` into the concatenated steps of ``recs`` (a list of
    :class:`~specjax.evaluation_stats.StepRecords`, e.g. one per domain): half of the held-out rows
    each when every record knows its rows (so no row's context is on both sides), otherwise half of
    the steps each, at random."""
    from specjax.evaluation_stats import StepRecords
    rng = np.random.default_rng(seed)
    if all(r.row is not None for r in recs):
        rows = StepRecords.concat(recs, distinct_rows=True).row
        ids = rng.permutation(np.unique(rows))
        in_fit = np.isin(rows, ids[: len(ids) // 2])
        return np.flatnonzero(in_fit), np.flatnonzero(~in_fit)
    perm = rng.permutation(sum(len(r.num_accepted) for r in recs))
    return perm[: len(perm) // 2], perm[len(perm) // 2:]


def save_traces(records_cell: Mapping[str, object], path: str) -> None:
    """Writes one cell's per-step outcomes as a compressed ``.npz`` (what a scheduling simulator
    replays): per domain ``<d>/num_accepted`` int16 ``[N]``, ``<d>/row`` int32 ``[N]`` and, for
    drafters with a confidence head, ``<d>/confidences`` float16 ``[N, γ]``. The drafts were all
    verified, so verifying only the first ℓ would have accepted ``min(num_accepted, ℓ)``."""
    arrays = {}
    for d, r in records_cell.items():
        arrays[f"{d}/num_accepted"] = np.asarray(r.num_accepted, np.int16)
        if r.row is not None:
            arrays[f"{d}/row"] = np.asarray(r.row, np.int32)
        if r.confidences is not None:
            arrays[f"{d}/confidences"] = np.asarray(r.confidences, np.float16)
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    np.savez_compressed(path, **arrays)


def calibration(records_cell: Mapping[str, object], out_dir: str, name: str, *,
                n_bins: int = 15, seed: int = 0) -> dict:
    """ECE per position before / after STS for one confidence drafter.

    ``records_cell``: ``{domain: StepRecords}`` of one cell (e.g. RS@1) with confidences. Anchors of
    all domains are pooled and split at random into a fitting half and a scoring half. When the
    records know their held-out rows, the split is by row (every anchor of a row lands in the same
    half), so that the scored half shares no context with the one STS was fitted on.
    """
    from specjax import calibration as C
    from specjax.calibration_plot import plot_reliability
    from specjax.evaluation import write_json
    recs = [r for r in records_cell.values() if r.confidences is not None]
    if not recs:
        return {}
    conf = np.concatenate([r.confidences for r in recs])
    acc = np.concatenate([r.accepted() for r in recs])
    logits = C.logit(conf)
    fit, score = split_halves(recs, seed)
    sts = C.sequential_temperature_scaling(logits[fit], acc[fit], n_bins=n_bins)
    before = C.position_metrics(logits[score], acc[score], n_bins=n_bins)
    after = C.position_metrics(logits[score], acc[score], temperatures=sts.temperatures,
                               n_bins=n_bins)
    out = {"temperatures": sts.temperatures, "ece_before": before["ece"],
           "ece_after": after["ece"], "auroc": before["auroc"],
           "ece_cond_before": before["ece_cond"], "ece_cond_after": after["ece_cond"],
           "n": before["n"], "survival_rate": before["survival_rate"],
           "mean_pred_before": before["mean_pred"], "mean_pred_after": after["mean_pred"],
           "fit_ece_before": sts.ece_before, "fit_ece_after": sts.ece_after,
           "n_fit": int(len(fit)), "n_score": int(len(score))}
    os.makedirs(out_dir, exist_ok=True)
    write_json(os.path.join(out_dir, f"calibration_{name}.json"), out)
    gamma = logits.shape[1]
    positions = sorted({1, min(3, gamma), min(5, gamma), gamma})
    plot_reliability(os.path.join(out_dir, f"reliability_{name}.png"), logits[score],
                     acc[score], temperatures=sts.temperatures, positions=positions,
                     n_bins=n_bins, title=f"{name}: prefix survival, held-out half "
                                          f"(STS fitted on the other half)")
    return out


def calibration_markdown(cal: Mapping[str, dict]) -> str:
    lines = []
    for name, c in cal.items():
        if not c:
            continue
        g = len(c["ece_before"])
        lines.append(f"\n**{name}** ({c['n_score']} scored blocks, STS fitted on "
                     f"{c['n_fit']} others)\n")
        lines.append("| position | " + " | ".join(str(k + 1) for k in range(g)) + " |")
        lines.append("|" + "---|" * (g + 1))
        f = lambda v: "—" if v is None or not np.isfinite(v) else f"{100 * v:.1f}"
        lines.append("| ECE before, scored half (%) | " + " | ".join(f(v) for v in c["ece_before"])
                     + " |")
        lines.append("| ECE after STS, scored half (%) | " + " | ".join(
            f(v) for v in c["ece_after"]) + " |")
        lines.append("| ECE before, fitting half (%) | " + " | ".join(
            f(v) for v in c["fit_ece_before"]) + " |")
        lines.append("| ECE after STS, fitting half (%) | " + " | ".join(
            f(v) for v in c["fit_ece_after"]) + " |")
        lines.append("| observed survival | " + " | ".join(
            "—" if not np.isfinite(v) else f"{v:.3f}" for v in c["survival_rate"]) + " |")
        lines.append("| AUROC | " + " | ".join(
            "—" if not np.isfinite(v) else f"{v:.3f}" for v in c["auroc"]) + " |")
        lines.append("| T_k | " + " | ".join(f"{v:.2f}" for v in c["temperatures"]) + " |")
    return "\n".join(lines) + "\n"


def write_report(results, out_dir: str, *, title: str = "", domains=REPORT_DOMAINS, cells=None,
                 plot_cells=("RS@1", "TO@1")) -> dict:
    """``results.json``, ``results.md`` and the two PNGs in ``out_dir``; returns the paths."""
    from specjax import evaluation as E
    os.makedirs(out_dir, exist_ok=True)
    if cells is None:
        cells = sorted({c for r in results.values() for c in r}, key=_cell_order)
    doms = [d for d in domains if any(d in r.get(c, {}) for r in results.values() for c in r)]
    paths = {"json": E.write_json(os.path.join(out_dir, "results.json"), results)}
    md = (f"### {title}\n\n" if title else "") + E.results_markdown(results, doms, cells)
    with open(os.path.join(out_dir, "results.md"), "w") as f:
        f.write(md)
    paths["md"] = os.path.join(out_dir, "results.md")
    curves = {d: {f"{n} {c}": results[n][c][d]["acceptance"] for n in results
                  for c in plot_cells if c in results[n] and d in results[n][c]} for d in doms}
    paths["per_position"] = E.plot_acceptance_per_position(
        os.path.join(out_dir, "acceptance_per_position.png"), curves, title=title)
    series = {d: {f"{n} {c}": results[n][c][d] for n in results for c in plot_cells
                  if c in results[n] and d in results[n][c]} for d in doms}
    paths["entropy"] = E.plot_acceptance_vs_entropy(
        os.path.join(out_dir, "acceptance_vs_entropy.png"), series, title=title)
    return paths


def _cell_order(cell: str):
    rule, t = cell.split("@")
    return ({"greedy": 0, "RS": 1, "TO": 2}.get(rule, 3), float(t))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--target_workdir", required=True, help="the target's trainer workdir")
    p.add_argument("--eval_file", required=True, help="held-out rows (.npz)")
    p.add_argument("--drafter", action="append", default=[],
                   help="name=workdir of a trained drafter, or 'ngram' (repeatable)")
    p.add_argument("--gamma", type=int, default=0, help="γ at evaluation (0 = each drafter's)")
    p.add_argument("--anchors_per_row", type=int, default=8)
    p.add_argument("--max_rows", type=int, default=64, help="held-out rows per domain")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)

    import json

    from specjax.drafters import NGramDrafter
    from specjax.training.config import validate_config
    from specjax.training.drafter_task import load_target
    from specjax.training.lm_task import model_config_from
    with open(os.path.join(args.target_workdir, "config.json")) as f:
        tconfig = validate_config(json.load(f))
    target = load_target(model_config_from(tconfig), args.target_workdir)
    drafters = {}
    for spec in args.drafter:
        if spec == "ngram":
            drafters["ngram"] = (NGramDrafter(model_config_from(tconfig).vocab_size), None, None,
                                 args.gamma or 4)
            continue
        name, _, wd = spec.partition("=")
        drafters[name] = load_trained(wd, target[1])
    gammas = {n: args.gamma for n in drafters} if args.gamma else None
    heldout = load_heldout(args.eval_file, max_rows=args.max_rows)
    results, records = evaluate(drafters, target, heldout, anchors_per_row=args.anchors_per_row,
                                seed=args.seed, gammas=gammas)
    paths = write_report(results, args.out, title="offline evaluation")
    cal = {n: calibration(records[n]["RS@1"], args.out, n) for n in records
           if "RS@1" in records[n]}
    if any(cal.values()):
        with open(os.path.join(args.out, "calibration.md"), "w") as f:
            f.write(calibration_markdown(cal))
    print("\n".join(f"wrote {v}" for v in paths.values()))


if __name__ == "__main__":
    main()
