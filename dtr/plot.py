"""Plots of dtr results (matplotlib, imported only when a plot is asked for). Bench
scripts and notebooks share these, so there is one copy of the plotting code."""

from __future__ import annotations

import math
from collections import defaultdict


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def slowdown_vs_budget(rows: list[dict], path: str, title: str = "dtr: slowdown vs budget"):
    """One panel per model, one line per heuristic: step-time ratio to eager against the
    budget ratio. rows: dicts with model, heuristic, ratio, slowdown (NaN if infeasible)."""
    plt = _pyplot()
    by_model: dict[str, dict[str, list]] = defaultdict(lambda: defaultdict(list))
    for r in rows:
        if r["slowdown"] is not None and not math.isnan(r["slowdown"]):
            by_model[r["model"]][r["heuristic"]].append((r["ratio"], r["slowdown"]))
    models = sorted(by_model)
    cols = min(3, max(1, len(models)))
    nrows = math.ceil(len(models) / cols) if models else 1
    fig, axes = plt.subplots(nrows, cols, figsize=(5 * cols, 3.6 * nrows), squeeze=False)
    for ax, model in zip(axes.flat, models):
        for heuristic, pts in sorted(by_model[model].items()):
            pts.sort()
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=heuristic)
        ax.set_title(model)
        ax.set_xlabel("budget / unbudgeted peak")
        ax.set_ylabel("step time / eager")
        ax.invert_xaxis()
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(models) :]:
        ax.axis("off")
    if models:
        axes.flat[0].legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def overhead_vs_budget(rows: list[dict], path: str, title: str):
    """The paper's pareto figure for one trace: overhead (total compute / baseline)
    against the budget ratio, one line per heuristic; infeasible points are left out."""
    plt = _pyplot()
    by_heuristic: dict[str, list] = defaultdict(list)
    for r in rows:
        if r["status"] == "ok":
            by_heuristic[r["heuristic"]].append((r["ratio"], r["overhead"]))
    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    for heuristic, pts in sorted(by_heuristic.items()):
        pts.sort()
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=".", label=heuristic)
    ax.set_title(title)
    ax.set_xlabel("budget / unconstrained peak")
    ax.set_ylabel("compute / baseline")
    ax.invert_xaxis()
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
