"""Plots of dtr results (matplotlib, imported only when a plot is asked for). Bench
scripts and notebooks share these, so there is one copy of the plotting code.

Each function draws one figure; given a ``path`` it saves it there, closes it and returns
the path, otherwise it returns the matplotlib Figure (what a notebook displays).
"""

from __future__ import annotations

import math
from collections import defaultdict


def _pyplot():
    # No backend is forced: headless machines fall back to Agg by themselves, and a
    # notebook keeps its inline backend.
    import matplotlib.pyplot as plt

    return plt


def _plain_ticks(ax) -> None:
    """Log axes labelled 1.2, 1.4, ... rather than 1.2 x 10^0."""
    from matplotlib.ticker import FormatStrFormatter

    for axis in (ax.xaxis, ax.yaxis):
        axis.set_major_formatter(FormatStrFormatter("%g"))
        axis.set_minor_formatter(FormatStrFormatter("%g"))


def _finish(fig, path: str | None, dpi: int = 120):
    fig.tight_layout()
    if path is None:
        return fig
    fig.savefig(path, dpi=dpi)
    _pyplot().close(fig)
    return path


def slowdown_vs_budget(
    rows: list[dict],
    path: str | None = None,
    title: str = "dtr: slowdown",
    xlabel: str = "budget / unbudgeted peak",
):
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
        ax.set_xlabel(xlabel)
        ax.set_ylabel("step time / eager")
        ax.invert_xaxis()
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(models) :]:
        ax.axis("off")
    if models:
        axes.flat[0].legend(fontsize=8)
    fig.suptitle(title)
    return _finish(fig, path)


def overhead_vs_budget(rows: list[dict], path: str | None = None, title: str = ""):
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
    return _finish(fig, path, dpi=110)


def memory_vs_compute(series: dict[str, list], path: str | None = None, title: str = ""):
    """Static schedules against DTR: total compute (relative to no checkpointing) against
    peak memory, one line per method; series maps a label to (memory, compute) points.
    A label with a single point (one static schedule) is drawn as a star."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for label, pts in sorted(series.items()):
        pts = sorted(pts)
        style = dict(marker="o")
        if len(pts) == 1:
            style = dict(marker="*", markersize=14, linestyle="none")
        elif label.startswith("checkmate"):
            style = dict(marker="s", markersize=6, linestyle="--", color="black")
        ax.plot([p[0] for p in pts], [p[1] for p in pts], label=label, **style)
    ax.set_xscale("log")
    ax.set_yscale("log")
    _plain_ticks(ax)
    ax.set_xlabel("peak memory (tensors)")
    ax.set_ylabel("total compute / chain without checkpointing")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _finish(fig, path)


def ops_per_n(series: dict[str, list], path: str | None = None):
    """The paper's Theorem 3.1 experiment: total ops / N against the chain length N at a
    budget of about 2 sqrt(N) tensors; series maps a heuristic to (N, ops / N) points."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for label, pts in sorted(series.items()):
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
    ax.set_xscale("log")
    ax.set_xlabel("chain length N")
    ax.set_ylabel("total ops / N at a budget of 2 sqrt(N) tensors")
    ax.set_title("Theorem 3.1: O(N) ops")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _finish(fig, path)


def memory_timeline(timeline, path: str | None = None, title: str = "dtr: memory per op"):
    """Resident bytes at each op boundary (session.timeline()), with the budget, the
    backward pass shaded, and the op boundaries where dtr evicted (red) or recomputed
    (green) marked on the curve. Bytes before eviction are drawn faintly above."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(9, 3.8))
    x = list(range(len(timeline)))
    mib = [b / 2**20 for b in timeline.resident_bytes]
    ax.plot(
        x,
        [b / 2**20 for b in timeline.before_bytes],
        color="tab:blue",
        alpha=0.3,
        lw=0.8,
        label="with the op's outputs",
    )
    ax.plot(x, mib, color="tab:blue", lw=1.2, label="resident")
    if timeline.budget_bytes is not None:
        ax.axhline(timeline.budget_bytes / 2**20, color="tab:red", ls="--", lw=1, label="budget")
    for column, color, marker, label in (
        (timeline.evictions, "tab:red", "v", "evictions"),
        (timeline.remats, "tab:green", "^", "recomputations"),
    ):
        prev = column[0] if column else 0
        hits = []
        for i, count in enumerate(column):
            if count > prev:
                hits.append(i)
            prev = count
        ax.scatter(
            hits, [mib[i] for i in hits], s=10, color=color, marker=marker, label=label, zorder=3
        )
    start = None  # shade each backward stretch
    for i, back in enumerate([*timeline.backward, False]):
        if back and start is None:
            start = i
        elif not back and start is not None:
            ax.axvspan(start, i, color="grey", alpha=0.12, lw=0)
            start = None
    ax.set_xlabel("op (grey: backward)")
    ax.set_ylabel("MiB")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper left")
    return _finish(fig, path)


def step_time_vs_memory(
    rows: list[dict], path: str | None = None, title: str = "step time against peak memory"
):
    """Methods side by side at equal memory: one panel per model, step time relative to
    eager against measured peak memory (MiB), one colour per method. Every run is a
    marker; the method's curve joins its pareto points (each faster than every run of
    the method at less memory), so it reads as the method's best time at that memory.
    rows: dicts with model, method, peak (bytes; None where the run failed or was
    infeasible) and ratio (step time / eager); an optional setting labels the points of
    a method with few."""
    plt = _pyplot()
    styles = {
        "eager": dict(marker="*", markersize=14, linestyle="none", color="black"),
        "checkpoint": dict(marker="s", linestyle="--", color="tab:orange"),
        "compile": dict(marker="^", linestyle="-.", color="tab:green"),
        "dtr": dict(marker="o", markersize=4, linestyle="-", color="tab:blue"),
    }
    by_model: dict[str, dict[str, list]] = defaultdict(lambda: defaultdict(list))
    for r in rows:
        ratio = r.get("ratio")
        if r.get("peak") is None or ratio is None or math.isnan(ratio):
            continue
        by_model[r["model"]][r["method"]].append(
            (r["peak"] / 2**20, ratio, str(r.get("setting") or ""))
        )
    models = list(by_model)
    cols = min(2, max(1, len(models)))
    nrows = math.ceil(len(models) / cols) if models else 1
    fig, axes = plt.subplots(nrows, cols, figsize=(6.5 * cols, 4.2 * nrows), squeeze=False)
    for ax, model in zip(axes.flat, models):
        for method, pts in by_model[model].items():
            pts.sort()
            style = dict(styles.get(method, dict(marker=".")))
            line = style.pop("linestyle", "-")
            front, best = [], math.inf
            for x, y, _ in pts:
                if y < best:
                    front.append((x, y))
                    best = y
            (drawn,) = ax.plot(
                [p[0] for p in front], [p[1] for p in front], linestyle=line, label=method, **style
            )
            ax.plot(
                [p[0] for p in pts],
                [p[1] for p in pts],
                linestyle="none",
                alpha=0.45,
                **{**style, "color": drawn.get_color()},
            )
            if method in ("checkpoint", "compile") and len(pts) <= 6:
                for x, y, setting in pts:
                    ax.annotate(
                        setting, (x, y), fontsize=6, xytext=(3, 3), textcoords="offset points"
                    )
        ratios = [p[1] for pts in by_model[model].values() for p in pts]
        if max(ratios) > 4 * min(ratios):  # linear unless a few runs are far slower
            ax.set_yscale("log")
            _plain_ticks(ax)
        ax.set_title(model)
        ax.set_xlabel("peak memory, MiB (torch.profiler)")
        ax.set_ylabel("step time / eager")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    for ax in list(axes.flat)[len(models) :]:
        ax.axis("off")
    fig.suptitle(title)
    return _finish(fig, path)
