"""The default cost model (roofline: deterministic estimates) against measured wall time
(``cost_model="time"``), live, on zoo models at a few budgets.

Each model is trained as bench.zoo trains it (two steps checked against eager, one
metered, then --timed timed steps), --repeats times per cost model and budget, from the
same seeds, the two cost models' runs alternating. A budget is the parameters' bytes
plus a fraction a of what dtr counts above them with no budget (bench.zoo's "a0.5").
Per model, budget and cost model: runs that met the budget, runs bitwise equal to eager,
the range of evictions and recomputations over the runs, how many different
(evictions, recomputations) pairs the runs made (1: the same decisions every run), the
median timed step, time's median step over roofline's, and how the other runs failed
("infeasible": dtr.BudgetError). Prints a table and writes bench/results/cost_models.csv.

    python -m bench.cost_models      # both engines, about 3 minutes on 2 busy cores
    python -m bench.cost_models --models gpt2 --ratios 0.5 --repeats 5
"""

from __future__ import annotations

import argparse
import math
import os
import statistics

import torch

from .common import RESULTS, mib, print_table, write_csv
from .zoo import run
from .zoo_models import ZOO

MODELS = ("looped_transformer", "gpt2", "llama", "mamba", "resnet18")
RATIOS = (0.7, 0.5, 0.3)
COST_MODELS = ("roofline", "time")  # the default first: time's steps are given against it

HEADER = [
    "model",
    "engine",
    "budget",
    "budget_mib",
    "cost_model",
    "feasible",
    "bitwise",
    "evictions",
    "remats",
    "distinct",
    "step_ms",
    "vs_roofline",
    "failed",
]


def _span(values: list[int]) -> str:
    if not values:
        return ""
    lo, hi = min(values), max(values)
    return str(lo) if lo == hi else f"{lo}-{hi}"


def _step_ms(outs) -> float:
    times = [t for o in outs if o.status == "ok" for t in o.times]
    return statistics.median(times) * 1e3 if times else math.nan


def _row(config: list, outs, eager, default_ms: float) -> list:
    met = [o for o in outs if o.status == "ok"]
    counts = [(o.stats.evictions, o.stats.remats) for o in met]
    step_ms = _step_ms(outs)
    return config + [
        f"{len(met)}/{len(outs)}",
        f"{sum(not o.differences(eager) for o in met)}/{len(met)}",
        _span([e for e, _ in counts]),
        _span([r for _, r in counts]),
        len(set(counts)),
        f"{step_ms:.1f}",
        f"{step_ms / default_ms:.3f}",
        ",".join(sorted({o.status for o in outs if o.status != "ok"})),
    ]


def sweep(name: str, engine: str, ratios, repeats: int, timed: int, timeout: float) -> list:
    """Rows for one model: each budget, each cost model."""
    entry = ZOO[name]
    eager = run(entry, None, timed, timeout, meter=False)
    free = run(entry, {"engine": engine}, timed, timeout, meter=False)
    if eager.status != "ok" or free.status != "ok":
        print(f"{name}: eager {eager.status}, no budget {free.status}", flush=True)
        return []
    params = free.param_bytes
    above = max(free.stats.peak_resident_bytes - params, 0)
    rows = []
    for ratio in ratios:
        budget = params + int(ratio * above)
        runs: dict[str, list] = {cost_model: [] for cost_model in COST_MODELS}
        for _ in range(repeats):  # alternated, so that both see the machine's load alike
            for cost_model, outs in runs.items():
                options = {"engine": engine, "budget": budget, "cost_model": cost_model}
                outs.append(run(entry, options, timed, timeout))
        default_ms = _step_ms(runs[COST_MODELS[0]])
        for cost_model, outs in runs.items():
            config = [name, engine, f"a{ratio:g}", mib(budget), cost_model]
            rows.append(_row(config, outs, eager, default_ms))
            print("  ".join(str(c) for c in rows[-1]), flush=True)
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=sorted(ZOO))
    parser.add_argument("--ratios", nargs="+", type=float, default=list(RATIOS))
    parser.add_argument(
        "--engines", nargs="+", default=["native", "subclass"], choices=["native", "subclass"]
    )
    parser.add_argument("--repeats", type=int, default=4, help="runs per cost model and budget")
    parser.add_argument("--timed", type=int, default=3, help="timed steps per run")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per run")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--out", default=os.path.join(RESULTS, "cost_models.csv"))
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = []
    for engine in args.engines:
        for name in args.models:
            rows += sweep(name, engine, args.ratios, args.repeats, args.timed, args.timeout)
    print(f"\ncost models, live ({args.repeats} runs each)")
    print_table(HEADER, rows)
    write_csv(args.out, HEADER, rows)


if __name__ == "__main__":
    main()
