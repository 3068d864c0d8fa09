"""Compare eviction heuristics in live training runs.

For each bench model: eager step time and peak memory, dtr with no budget (its peak P is
the reference), then every heuristic at budgets of 1.0 .. 0.2 x P: step time relative to
eager (median of several steps after warm-up), evictions, recomputations, peak resident
bytes, or "infeasible". Prints a table, writes bench/results/heuristics.csv and a plot.

    python -m bench.compare_heuristics            # the full sweep (about 20 minutes)
    python -m bench.compare_heuristics --quick    # small models, a minute
    python -m bench.compare_heuristics --device cuda    # on the GPU: bench/results/gpu/

On CUDA each step is timed between two torch.cuda.synchronize() calls, "eager peak" is
the caching allocator's max_memory_allocated over an eager step (parameters, gradients
and optimizer state included, as the profiler's CPU measure), and three more columns
come from torch.cuda.memory_stats() per run: the allocator's own peak (max allocated,
MiB), the peak of inactive_split_bytes (cached memory in split blocks that no
allocation can use whole: fragmentation) and num_alloc_retries (times a cudaMalloc
failed and the allocator freed its cache to retry). Dtr's ops on a GPU always use the
roofline cost model (README), whatever --cost-model says.
"""

from __future__ import annotations

import argparse
import math
import os

import torch
from tqdm.auto import tqdm

import dtr
from dtr.plot import slowdown_vs_budget

from .common import (
    BENCH_SCALE,
    RESULTS,
    Run,
    eager_peak_bytes,
    mib,
    print_table,
    timed_steps,
    write_csv,
)
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
CUDA_HEADER = ["cuda_peak_mib", "inactive_split_bytes", "num_alloc_retries"]


def _timed(args, name: str, scale: int, dtr_kwargs: dict | None) -> tuple[Run, dict]:
    run = timed_steps(
        name, scale, args.steps, args.warmup, dtr_kwargs, args.optimizer, device=args.device
    )
    return run, run.counters


def sweep(args) -> list[dict]:
    rows: list[dict] = []
    for name in args.models:
        scale = args.scale or (1 if args.quick else BENCH_SCALE[name])
        eager, eager_counters = _timed(args, name, scale, None)
        peak_eager = eager_peak_bytes(name, scale, args.optimizer, args.device)
        free, free_counters = _timed(args, name, scale, {"cost_model": args.cost_model})
        peak = free.stats.peak_resident_bytes
        print(
            f"{name} (scale {scale}, {args.device}): eager {eager.median * 1e3:.1f} ms/step, "
            f"eager peak {mib(peak_eager)} MiB "
            f"({'allocator' if args.device == 'cuda' else 'profiler'}); dtr unbudgeted "
            f"{free.median / eager.median:.3f}x, peak P = {mib(peak)} MiB",
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
                **eager_counters,
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
                **free_counters,
            )
        )
        # an infeasible point is a row with its error as status, never a crash
        points = [(h, r) for h in args.heuristics for r in args.ratios]
        for heuristic, ratio in tqdm(points, desc=name, unit="run", leave=False):
            budget = int(peak * ratio)
            run, counters = _timed(
                args,
                name,
                scale,
                {"budget": budget, "heuristic": heuristic, "cost_model": args.cost_model},
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
                    **counters,
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
        half = mine.get((dtr.DEFAULT_HEURISTIC, 0.5), {}).get("slowdown", math.nan)
        low = mine.get((dtr.DEFAULT_HEURISTIC, 0.3), {})
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
    parser.add_argument(
        "--device",
        default="cpu",
        choices=["cpu", "cuda"],
        help="where to train (cuda: the current CUDA device; adds the allocator's columns)",
    )
    parser.add_argument(
        "--out",
        default=None,
        help="CSV path (default bench/results/heuristics.csv; on cuda bench/results/gpu/)",
    )
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch.cuda.is_available() is False on this machine")
    if args.out is None:
        folder = os.path.join(RESULTS, "gpu") if args.device == "cuda" else RESULTS
        args.out = os.path.join(folder, "heuristics.csv")
    if args.quick:
        args.steps, args.warmup = 2, 1
    rows = sweep(args)
    header = HEADER + (CUDA_HEADER if args.device == "cuda" else [])
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
        + (
            [mib(r["cuda_peak"]), r["inactive_split"], r["alloc_retries"]]
            if args.device == "cuda"
            else []
        )
        for r in rows
    ]
    print()
    print_table(header, table)
    write_csv(args.out, header, table)
    cost = "roofline" if args.device == "cuda" else args.cost_model
    where = f"on {torch.cuda.get_device_name()}, " if args.device == "cuda" else ""
    plot = slowdown_vs_budget(
        [r for r in rows if r["heuristic"] not in ("eager", "none")],
        os.path.splitext(args.out)[0] + ".png",
        f"dtr heuristics, live ({where}{cost} cost model)",
    )
    print()
    print_table(
        ["model", "x at budget=inf", "<=1.10", "x at 0.5 (dtr)", "<=1.3", "trains at 0.3"],
        targets(rows),
    )
    print(f"\nwrote {args.out} and {plot}")


if __name__ == "__main__":
    main()
