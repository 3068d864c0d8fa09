"""The largest batch dtr trains at, against eager PyTorch, in the same GPU memory.

The device's memory is capped at --memory for this process
(``torch.cuda.set_per_process_memory_fraction``: the caching allocator raises
``torch.OutOfMemoryError`` past it, exactly as a smaller GPU would). For each bench model
and each method, the largest batch size that trains --warmup + --steps Adam steps without
running out is found by doubling from --start, then bisecting to within --resolution:

- **eager**: PyTorch as is; an allocator OOM ends it.
- **dtr, no budget**: ``dtr.enable()`` with no budget: when the allocator cannot satisfy
  a request, dtr evicts and reruns the op (evicting on demand), and gives up with
  ``dtr.BudgetError`` only when nothing is left to evict.
- **dtr, budget**: ``dtr.enable(budget=--budget-fraction x the cap)``: dtr keeps its own
  count under the budget (parameters, gradients and optimizer state live outside its
  count, hence less than the whole cap), and still evicts on an allocator OOM.
- **dtr, whole device**: ``dtr.enable(budget=--device-fraction x the cap,
  measure="allocator")``: the budget counts everything the caching allocator holds, so
  it can be set close to the cap (the rest is room for what an op allocates before the
  boundary after it); evicts on an allocator OOM too.

A trial that takes longer than --trial-seconds counts as failed ("slow": thrashing is
not training). Reported per method: the largest batch, its step time, time per example
relative to eager's at eager's largest batch, and the step time at eager's largest batch
(the slowdown at equal batch). Writes a table and ``bench/results/gpu/max_batch.csv``.

    python -m bench.max_batch                               # transformer and cnn, 2 GiB
    python -m bench.max_batch --models transformer --memory 4GiB --scale 8

Needs a CUDA device: on the CPU nothing caps an allocation (run bench.vs_static there).
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import sys
import time
from collections.abc import Callable

import torch

from dtr.units import format_bytes, parse_bytes

from .common import BENCH_SCALE, RESULTS, narrow, print_table, timed_steps, write_csv
from .models import MODELS

METHODS = ("eager", "dtr, no budget", "dtr, budget", "dtr, whole device")
HEADER = [
    "model",
    "scale",
    "memory_mib",
    "method",
    "max_batch",
    "vs_eager",
    "step_ms",
    "per_example_vs_eager",
    "step_ms_at_eager_max",
    "slowdown_at_eager_max",
    "evictions",
    "remats",
    "cuda_peak_mib",
    "trials",
    "first_failure",
]


def largest(fits: Callable[[int], bool], start: int, limit: int, resolution: float) -> int:
    """The largest n in [1, limit] with fits(n), assuming fits is monotone (true up to
    some n, false above): doubling from start, then bisection until the failing and the
    fitting sizes are within a factor 1 + resolution (or 1 apart). 0 if fits(1) fails."""
    lo, hi = 0, None
    n = max(1, min(start, limit))
    while hi is None:
        if fits(n):
            lo = n
            if n >= limit:
                return n
            n = min(2 * n, limit)
        else:
            hi = n
            if lo == 0 and n > 1:  # start failed: look below it
                return largest(fits, 1, n - 1, resolution)
    return narrow(fits, lo, hi, resolution)


def _dtr_kwargs(method: str, cap: int, args) -> dict | None:
    if method == "eager":
        return None
    kwargs = {"cost_model": "roofline"}
    if method == "dtr, budget":
        kwargs["budget"] = int(cap * args.budget_fraction)
    elif method == "dtr, whole device":
        kwargs["budget"] = int(cap * args.device_fraction)
        kwargs["measure"] = "allocator"
    return kwargs


def trial(name: str, scale: int, size: int, method: str, args, cap: int) -> dict:
    """One training run of `size` examples per batch: {"ok", "status", "run"}."""
    start = time.perf_counter()
    try:
        run = timed_steps(
            name,
            scale,
            args.steps,
            args.warmup,
            _dtr_kwargs(method, cap, args),
            device="cuda",
            size=size,
        )
    except torch.OutOfMemoryError:
        run = None
        status = "oom"
    finally:
        gc.collect()  # what the failed run held, before the next one starts
        torch.cuda.empty_cache()
    if run is not None:
        status = run.error or "ok"
        if status == "ok" and time.perf_counter() - start > args.trial_seconds:
            status = "slow"
    return {"ok": status == "ok", "status": status, "run": run}


def search(name: str, scale: int, method: str, args, cap: int) -> dict:
    """The largest batch `method` trains at: {"best", "trial" (its run), "count" (trials
    made), "fail" (the smallest failing size above it, and why)}."""
    tried: dict[int, dict] = {}

    def fits(size: int) -> bool:
        tried[size] = trial(name, scale, size, method, args, cap)
        print(f"  {name} {method:>15} batch {size:>6}: {tried[size]['status']}", flush=True)
        return tried[size]["ok"]

    best = largest(fits, args.start, args.limit, args.resolution)
    above = sorted(n for n, t in tried.items() if not t["ok"] and n > best)
    fail = f"{above[0]}: {tried[above[0]]['status']}" if above else "none below the limit"
    return {"best": best, "trial": tried.get(best), "count": len(tried), "fail": fail}


def measure(name: str, args, cap: int) -> list[dict]:
    scale = args.scale or BENCH_SCALE[name]
    rows = {method: search(name, scale, method, args, cap) for method in METHODS}
    eager_best = rows["eager"]["best"]
    eager_run = rows["eager"]["trial"]["run"] if eager_best else None
    out = []
    for method in METHODS:
        r = rows[method]
        run = r["trial"]["run"] if r["best"] else None
        at_eager = None
        if eager_best:
            t = trial(name, scale, eager_best, method, args, cap)
            at_eager = t["run"] if t["ok"] else None
        out.append(
            {
                "model": name,
                "scale": scale,
                "memory_mib": cap / 2**20,
                "method": method,
                "max_batch": r["best"],
                "vs_eager": r["best"] / eager_best if eager_best else math.nan,
                "step_ms": run.median * 1e3 if run else math.nan,
                "per_example_vs_eager": (run.median / r["best"]) / (eager_run.median / eager_best)
                if run and eager_run
                else math.nan,
                "step_ms_at_eager_max": at_eager.median * 1e3 if at_eager else math.nan,
                "slowdown_at_eager_max": at_eager.median / eager_run.median
                if at_eager and eager_run
                else math.nan,
                "evictions": run.stats.evictions if run and run.stats else 0,
                "remats": run.stats.remats if run and run.stats else 0,
                "cuda_peak_mib": run.counters.get("cuda_peak", 0) / 2**20 if run else math.nan,
                "trials": r["count"],
                "first_failure": r["fail"],
            }
        )
    return out


def _fmt(v):
    if isinstance(v, float):
        return "-" if math.isnan(v) else f"{v:.3g}" if abs(v) < 100 else f"{v:.0f}"
    return v


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=["transformer", "cnn"], choices=list(MODELS))
    p.add_argument("--scale", type=int, default=0, help="model scale (default: bench scale)")
    p.add_argument("--memory", default="2GiB", help="the cap on this process's GPU memory")
    p.add_argument("--budget-fraction", type=float, default=0.6)
    p.add_argument("--device-fraction", type=float, default=0.9)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--start", type=int, default=16)
    p.add_argument("--limit", type=int, default=1 << 16)
    p.add_argument("--resolution", type=float, default=0.05)
    p.add_argument("--trial-seconds", type=float, default=30.0)
    p.add_argument("--out", default=os.path.join(RESULTS, "gpu", "max_batch.csv"))
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit(
            "bench.max_batch: needs a CUDA device (the memory cap is the CUDA caching "
            "allocator's); on the CPU, bench.vs_static compares methods at equal memory"
        )
    cap = parse_bytes(args.memory)
    total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    if not 0 < cap < total:
        sys.exit(
            f"bench.max_batch: --memory {args.memory} is not below the device's "
            f"{format_bytes(total)}"
        )
    torch.cuda.set_per_process_memory_fraction(cap / total)
    print(
        f"{torch.cuda.get_device_name()}: memory capped at {format_bytes(cap)} "
        f"of {format_bytes(total)}"
    )
    rows = [row for name in args.models for row in measure(name, args, cap)]
    table = [[_fmt(r[h]) for h in HEADER] for r in rows]
    print_table(HEADER, table)
    write_csv(args.out, HEADER, [[r[h] for h in HEADER] for r in rows])
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
