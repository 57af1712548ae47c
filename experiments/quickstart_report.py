"""The quickstart's one-page summary: ``summary.md``, ``summary.png`` and ``summary.json``.

The PNG has two panels: the MTP head's acceptance per draft position (α_k, the acceptance at
position k given positions 1..k-1 were accepted, measured in the engine) per domain and
temperature, and tokens/s of the fastest plain decoder next to the speculative engine per cell.
"""
from __future__ import annotations

import json
import math
import os


def plot_summary(summary: dict, path: str) -> str:
    """Writes the two-panel PNG of :func:`write_summary` to ``path``; returns ``path``."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    cells = summary["cells"]
    fig = Figure(figsize=(10, 4))
    FigureCanvasAgg(fig)
    ax1, ax2 = fig.subplots(1, 2)
    for c in cells:
        alpha = c["decoders"]["speculative"]["alpha"]
        ax1.plot(range(1, len(alpha) + 1), alpha, marker="o",
                 ls="-" if c["temperature"] == 0 else "--",
                 label=f"{c['domain']} T={c['temperature']:g}")
    ax1.set_xlabel("draft position k")
    ax1.set_ylabel("α_k (accepted | earlier accepted)")
    ax1.set_ylim(0, 1.02)
    ax1.set_xticks(range(1, summary["gamma"] + 1))
    ax1.set_title("MTP head acceptance per position")
    ax1.legend(fontsize=8)
    labels = [f"{c['domain']}\nT={c['temperature']:g}" for c in cells]
    x = range(len(cells))
    plain = [c["decoders"][c["baseline"]]["tokens_per_s"] for c in cells]
    spec = [c["decoders"]["speculative"]["tokens_per_s"] for c in cells]
    w = 0.38
    ax2.bar([i - w / 2 for i in x], plain, w, label="fastest plain decoder")
    bars = ax2.bar([i + w / 2 for i in x], spec, w, label=f"speculative (K = {summary['gamma']})")
    for b, c in zip(bars, cells):
        ax2.annotate(f"{c['speedup']:.2f}x", (b.get_x() + b.get_width() / 2, b.get_height()),
                     ha="center", va="bottom", fontsize=8)
    ax2.set_xticks(list(x))
    ax2.set_xticklabels(labels)
    ax2.set_ylabel("tokens/s (B = 1)")
    ax2.set_title(f"decoding speed on {summary['backend']}")
    ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def summary_markdown(summary: dict, png_name: str) -> str:
    g = summary["gamma"]
    lines = [f"# specjax quickstart{' (tiny smoke run)' if summary['tiny'] else ''}", "",
             f"Backend: {summary['backend']}. Target: {summary['target_params'] / 1e6:.2f}M "
             f"parameters ({summary['target_train_s']:.0f} s, reused when cached). MTP head: "
             f"γ = {g}, {summary['sizes']['head_steps']} steps, CE then e2e-TV "
             f"({summary['head_train_s']:.0f} s{', reused' if summary['head_reused'] else ''}). "
             f"Whole run: {summary['total_s']:.0f} s.", "",
             "## Held-out loss of the target", "",
             "| domain | nats/token | perplexity | next-token accuracy |", "|---|---|---|---|"]
    for d, m in sorted(summary["heldout"].items()):
        lines.append(f"| {d} | {m['ce']:.3f} | {math.exp(m['ce']):.2f} | {m['accuracy']:.3f} |")
    lines += ["", f"Held-out math problems solved by greedy decoding: "
                  f"{summary['math_solved']:.1%}.", "",
              "## Speculative decoding vs the fastest plain decoder (B = 1)", "",
              f"{summary['prompts_per_domain']} held-out prompt(s) per domain, "
              f"{summary['new_tokens']} new tokens each, one request at a time; wall time after a "
              f"warm-up, median of {summary['reps']} runs; the same weights and max_len "
              f"({summary['max_len']}) for every decoder. Plain = the faster of "
              f"`generate(loop=\"device\")` and the engine's policy \"none\"; speculative = the "
              f"engine's device loop with the MTP head at fixed K = γ = {g}.", "",
              "| domain | T | plain tokens/s | speculative tokens/s | τ | speed-up |"
              + "".join(f" α_{k} |" for k in range(1, g + 1)),
              "|---|---|---|---|---|---|" + "---|" * g]
    for c in summary["cells"]:
        dec = c["decoders"]
        s = dec["speculative"]
        lines.append(f"| {c['domain']} | {c['temperature']:g} | "
                     f"{dec[c['baseline']]['tokens_per_s']:.0f} ({c['baseline']}) | "
                     f"{s['tokens_per_s']:.0f} | {s['tau']:.2f} | {c['speedup']:.2f}x | "
                     + " | ".join(f"{a:.2f}" for a in s["alpha"]) + " |")
    lines += ["", "τ: tokens per engine step (accepted drafts + 1). α_k: acceptance at draft "
                  "position k given positions 1..k-1 were accepted, counted over every "
                  "verification step of the timed run.", "", f"![summary]({png_name})", ""]
    return "\n".join(lines)


def write_summary(summary: dict, out_dir: str) -> dict:
    """Writes ``summary.{md,png,json}`` under ``out_dir``; returns their paths."""
    os.makedirs(out_dir, exist_ok=True)
    paths = {ext: os.path.join(out_dir, f"summary.{ext}") for ext in ("md", "png", "json")}
    plot_summary(summary, paths["png"])
    with open(paths["md"], "w") as f:
        f.write(summary_markdown(summary, "summary.png"))
    with open(paths["json"], "w") as f:
        json.dump(summary, f, indent=1, default=float)
    return paths
