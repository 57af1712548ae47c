"""Numbers that docs/RESULTS.md quotes about the committed results, recomputed from the JSON.

    python -m experiments.results_audit [--dir experiments/results/full]

Prints (1) how many cells' measured τ misses the predicted E[τ] = 1 + Σ_j Π_{i≤j} α_i by more
than 0.05, per results file, with the worst miss; (2) how much wider the row-clustered standard
errors of τ are than the ones that treat every step as independent; (3) per confidence head, the
survival ECE (prefix product a_k against "drafts 1..k all accepted", the quantity STS fits and the
scheduler uses) and the conditional ECE (c_k against "draft k accepted" given the prefix was, the
head's stated meaning), before / after STS, on the scored and on the fitting half.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import statistics

TOLERANCE = 0.05


def cells(results: dict):
    """``(drafter, rule, domain, tau, tau_pred)`` for every cell of a results.json."""
    for drafter, rules in sorted(results.items()):
        for rule, domains in sorted(rules.items()):
            for domain, m in sorted(domains.items()):
                yield drafter, rule, domain, m["tau"], m["tau_pred"]


def tau_misses(results: dict, tolerance: float = TOLERANCE) -> tuple[int, int, float, str]:
    """(cells missing by > tolerance, cells, worst |τ − E[τ]|, worst cell)."""
    rows = [(abs(t - p), f"{d} {r} {dom}") for d, r, dom, t, p in cells(results)]
    worst = max(rows)
    return sum(e > tolerance for e, _ in rows), len(rows), worst[0], worst[1]


def se_ratios(results: dict) -> list:
    """Per cell with both: the row-clustered s.e. of τ over the independent-steps one."""
    out = []
    for drafter, rules in results.items():
        for rule, domains in rules.items():
            for domain, m in domains.items():
                if m.get("tau_se_iid") and m.get("tau_se") is not None:
                    out.append(m["tau_se"] / m["tau_se_iid"])
    return sorted(out)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", default=os.path.join("experiments", "results", "full"))
    args = ap.parse_args(argv)
    summary = json.load(open(os.path.join(args.dir, "summary.json")))
    print(f"## predicted vs measured τ (miss = |τ − E[τ]| > {TOLERANCE})")
    sources = {"bebop (all seeds)": summary["bebop"]["results"]} if "bebop" in summary else {}
    for part in ("dspark_g7", "dspark_g15"):
        if os.path.exists(os.path.join(args.dir, part, "results.json")):
            sources[part] = json.load(open(os.path.join(args.dir, part, "results.json")))
    for name, results in sources.items():
        miss, n, worst, where = tau_misses(results)
        print(f"{name}: {miss} of {n} cells miss; worst {worst:.3f} ({where})")
    for seed in sorted({k.rsplit("_", 1)[1] for k in summary.get("bebop", {}).get("results", {})}):
        sub = {k: v for k, v in summary["bebop"]["results"].items() if k.endswith(seed)}
        miss, n, worst, where = tau_misses(sub)
        print(f"  bebop {seed}: {miss} of {n} cells miss; worst {worst:.3f} ({where})")

    print("\n## row-clustered vs independent-steps s.e. of τ (ratio per cell)")
    for name, results in sources.items():
        r = se_ratios(results)
        if r:
            print(f"{name}: median {statistics.median(r):.2f}, range {min(r):.2f}-{max(r):.2f} "
                  f"over {len(r)} cells")
        else:
            print(f"{name}: no per-row results (older JSON)")

    print("\n## ECE per position, % (survival | conditional), before -> after STS")
    for path in sorted(glob.glob(os.path.join(args.dir, "dspark_g*", "calibration_*.json"))):
        c = json.load(open(path))
        name = os.path.basename(path)[len("calibration_"):-len(".json")]
        pct = lambda xs: " ".join(f"{100 * x:.1f}" for x in xs)  # noqa: E731
        print(f"{name} (scored n={c['n_score']}, fit n={c['n_fit']})")
        print(f"  survival scored before: {pct(c['ece_before'])}")
        print(f"  survival scored after:  {pct(c['ece_after'])}  (max {100 * max(c['ece_after']):.1f})")
        print(f"  survival fit after:     {pct(c['fit_ece_after'])}  "
              f"(max {100 * max(c['fit_ece_after']):.1f})")
        print(f"  conditional scored before: {pct(c['ece_cond_before'])}")
        print(f"  conditional scored after:  {pct(c['ece_cond_after'])}  "
              f"(range {100 * min(c['ece_cond_after']):.1f}-{100 * max(c['ece_cond_after']):.1f})")


if __name__ == "__main__":
    main()
