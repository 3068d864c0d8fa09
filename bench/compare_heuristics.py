"""Compare eviction heuristics in live training runs.

For each bench model: eager step time and peak memory, dtr with no budget (its peak P is
the reference), then every heuristic at budgets of 1.0 .. 0.2 x P: step time relative to
eager (median of several steps after warm-up), evictions, recomputations, peak resident
bytes, or "infeasible". Prints a table, writes bench/results/heuristics.csv and a plot.

    python -m bench.compare_heuristics            # the full sweep (about 20 minutes)
    python -m bench.compare_heuristics --quick    # small models, a minute
"""

from __future__ import annotations

import argparse
import math
import os

from tqdm.auto import tqdm

import dtr
from dtr.plot import slowdown_vs_budget

from .common import BENCH_SCALE, RESULTS, eager_peak_bytes, mib, print_table, timed_steps, write_csv
from .models import MODELS

RATIOS = (1.0, 0.8, 0.6, 0.5, 0.4, 0.3, 0.2)
HEADER = [
    "model",
    "heuristic",
    "ratio",
    "budget_mib",
    "slowdown",
    "evictions",
    "remats",
    "peak_mib",
    "status",
]


def sweep(args) -> list[dict]:
    rows: list[dict] = []
    for name in args.models:
        scale = args.scale or (1 if args.quick else BENCH_SCALE[name])
        eager = timed_steps(name, scale, args.steps, args.warmup, None, args.optimizer)
        peak_eager = eager_peak_bytes(name, scale, args.optimizer)
        free = timed_steps(
            name, scale, args.steps, args.warmup, {"cost_model": args.cost_model}, args.optimizer
        )
        peak = free.stats.peak_resident_bytes
        print(
            f"{name} (scale {scale}): eager {eager.median * 1e3:.1f} ms/step, eager peak "
            f"{mib(peak_eager)} MiB (profiler); dtr unbudgeted {free.median / eager.median:.3f}x"
            f", peak P = {mib(peak)} MiB",
            flush=True,
        )
        rows.append(
            dict(
                model=name,
                heuristic="eager",
                ratio=math.inf,
                budget=None,
                slowdown=1.0,
                evictions=0,
                remats=0,
                peak=peak_eager,
                status="ok",
            )
        )
        rows.append(
            dict(
                model=name,
                heuristic="none",
                ratio=math.inf,
                budget=None,
                slowdown=free.median / eager.median,
                evictions=0,
                remats=0,
                peak=peak,
                status="ok",
            )
        )
        # an infeasible point is a row with its error as status, never a crash
        points = [(h, r) for h in args.heuristics for r in args.ratios]
        for heuristic, ratio in tqdm(points, desc=name, unit="run", leave=False):
            budget = int(peak * ratio)
            run = timed_steps(
                name,
                scale,
                args.steps,
                args.warmup,
                {"budget": budget, "heuristic": heuristic, "cost_model": args.cost_model},
                args.optimizer,
            )
            ok = not run.error
            rows.append(
                dict(
                    model=name,
                    heuristic=heuristic,
                    ratio=ratio,
                    budget=budget,
                    slowdown=run.median / eager.median if ok else math.nan,
                    evictions=run.stats.evictions if ok else None,
                    remats=run.stats.remats if ok else None,
                    peak=run.stats.peak_resident_bytes if ok else None,
                    status="ok" if ok else run.error,
                )
            )
            tqdm.write(
                f"  {heuristic:>9} {ratio:.2f}: "
                + (f"{rows[-1]['slowdown']:.3f}x, {run.stats.remats} remats" if ok else run.error)
            )
    return rows


def targets(rows: list[dict]) -> list[list]:
    """The runtime issue's targets per model, for the default heuristic."""
    out = []
    for name in sorted({r["model"] for r in rows}):
        mine = {(r["heuristic"], r["ratio"]): r for r in rows if r["model"] == name}
        free = mine[("none", math.inf)]["slowdown"]
        half = mine.get(("dtr", 0.5), {}).get("slowdown", math.nan)
        low = mine.get(("dtr", 0.3), {})
        out.append(
            [
                name,
                f"{free:.3f}",
                "yes" if free <= 1.10 else "no",
                f"{half:.3f}",
                "yes" if half <= 1.3 else "no",
                "yes" if low.get("status") == "ok" else "no",
            ]
        )
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument(
        "--heuristics", nargs="+", default=list(dtr.HEURISTICS), choices=list(dtr.HEURISTICS)
    )
    parser.add_argument("--ratios", nargs="+", type=float, default=list(RATIOS))
    parser.add_argument("--steps", type=int, default=5, help="timed steps per run")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--scale", type=int, default=0, help="model scale (0: bench default)")
    parser.add_argument("--optimizer", default="adam", choices=["sgd", "adam", "adamw"])
    parser.add_argument("--cost-model", default="time", choices=["time", "roofline"])
    parser.add_argument("--quick", action="store_true", help="test-size models, 2 steps")
    parser.add_argument("--out", default=os.path.join(RESULTS, "heuristics.csv"))
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.warmup = 2, 1
    rows = sweep(args)
    table = [
        [
            r["model"],
            r["heuristic"],
            "inf" if math.isinf(r["ratio"]) else r["ratio"],
            "-" if r["budget"] is None else mib(r["budget"]),
            "-" if math.isnan(r["slowdown"]) else f"{r['slowdown']:.3f}",
            "-" if r["evictions"] is None else r["evictions"],
            "-" if r["remats"] is None else r["remats"],
            "-" if r["peak"] is None else mib(r["peak"]),
            r["status"],
        ]
        for r in rows
    ]
    print()
    print_table(HEADER, table)
    write_csv(args.out, HEADER, table)
    plot = slowdown_vs_budget(
        [r for r in rows if r["heuristic"] not in ("eager", "none")],
        os.path.splitext(args.out)[0] + ".png",
        f"dtr heuristics, live ({args.cost_model} cost model)",
    )
    print()
    print_table(
        ["model", "x at budget=inf", "<=1.10", "x at 0.5 (dtr)", "<=1.3", "trains at 0.3"],
        targets(rows),
    )
    print(f"\nwrote {args.out} and {plot}")


if __name__ == "__main__":
    main()
