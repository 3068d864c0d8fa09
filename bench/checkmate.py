"""DTR's heuristics against the optimal static schedule (Checkmate's MILP), on small traces.

For chains of n = 8, 12, 16 ops (forward and backward: 2n + 2 nodes), and the bench
models' traces where they are small enough once views are collapsed, at budget ratios
0.9 .. 0.3 of the unconstrained peak: the MILP's optimum (overhead, MIP gap, status,
solve seconds) next to the overhead dtr's simulator reaches with h_DTR, our default
`dtr_held`, h_DTR^eq and h_MSPS at the same budget in bytes (no cap on recomputation),
and whether each is within 10% of the optimum ("?" when the MILP stopped at its time
limit and its gap leaves the answer open). Writes ``bench/results/checkmate.csv``.

    python -m bench.checkmate                      # chains and the bench models
    python -m bench.checkmate --time-limit 20 --no-record
"""

from __future__ import annotations

import argparse
import math
import os
import tempfile

import dtr.sim as sim
from dtr.sim import chain, checkmate

from .common import RESULTS, print_table, write_csv
from .harness import record_traces

RATIOS = (0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3)
WITHIN = 1.10  # "close to optimal": at most 10% more compute than the optimum


def chain_traces(sizes: list[int], folder: str) -> list[tuple[str, str]]:
    paths = [chain.plain(n, os.path.join(folder, f"chain{n}.jsonl")) for n in sizes]
    return [(f"chain n={n}", path) for n, path in zip(sizes, paths)]


def within(overhead: float, sched: checkmate.Schedule) -> str:
    """Whether a heuristic's overhead is within 10% of the optimum: decided against the
    MILP's lower bound and its best schedule when the solve stopped early."""
    if not sched.feasible or math.isnan(overhead):
        return "-"
    low, high = sched.bound / sched.baseline, sched.overhead
    if overhead <= WITHIN * low + 1e-9:
        return "yes"
    return "no" if overhead > WITHIN * high + 1e-9 else "?"


def point(label, prog, graph, ratio, heuristics, time_limit) -> dict:
    budget = int(sim.peak(prog) * ratio)
    sched = checkmate.solve(graph, budget, time_limit=time_limit)
    if sched.feasible:
        checkmate.validate(sched, graph, budget)  # the bench reports only schedules that run
    row = dict(
        trace=label,
        nodes=graph.n,
        ratio=ratio,
        budget_bytes=budget,
        milp_status=sched.status,
        milp_overhead=sched.overhead,
        milp_bound=sched.bound / sched.baseline,
        gap=sched.gap,
        solve_s=sched.seconds,
    )
    for h in heuristics:
        res = sim.simulate(prog, h, budget=budget, thrash=0)
        overhead = res.overhead if res.feasible else math.nan
        row[h] = overhead
        row[f"{h}_status"] = res.status
        row[f"{h}_within10"] = within(overhead, sched)
    return row


def sweep(traces, ratios, heuristics, time_limit, max_nodes) -> list[dict]:
    rows = []
    for label, path in traces:
        prog = sim.load(path)
        try:
            graph = checkmate.graph_of(prog, max_nodes=max_nodes)
        except sim.TraceError as exc:
            print(f"{label}: skipped, {exc}", flush=True)
            continue
        for ratio in ratios:
            row = point(label, prog, graph, ratio, heuristics, time_limit)
            rows.append(row)
            print(
                f"{label} ({graph.n} nodes) at {ratio:.1f}: milp {row['milp_status']} "
                f"{row['milp_overhead']:.3f} in {row['solve_s']:.1f} s; "
                + ", ".join(f"{h} {row[h]:.3f}" for h in heuristics),
                flush=True,
            )
    return rows


def _fmt(x) -> str:
    if isinstance(x, float):
        return "nan" if math.isnan(x) else f"{x:.3f}"
    return str(x)


def _csv(x):
    return f"{x:.6g}" if isinstance(x, float) else x


def table(rows, heuristics) -> tuple[list[str], list[list[str]]]:
    header = ["trace", "nodes", "ratio", "milp", "optimum", "bound", "gap", "solve_s"]
    for h in heuristics:
        header += [h, f"{h}<=1.1x"]
    out = []
    for r in rows:
        line = [r["trace"], r["nodes"], f"{r['ratio']:.1f}", r["milp_status"]]
        line += [_fmt(r["milp_overhead"]), _fmt(r["milp_bound"]), _fmt(r["gap"])]
        line.append(f"{r['solve_s']:.1f}")
        for h in heuristics:
            shown = _fmt(r[h]) if r[f"{h}_status"] == "ok" else r[f"{h}_status"]
            line += [shown, r[f"{h}_within10"]]
        out.append(line)
    return header, out


def summary(rows, heuristics) -> None:
    for h in heuristics:
        verdicts = [r[f"{h}_within10"] for r in rows]
        print(
            f"{h}: within 10% of the optimum at {verdicts.count('yes')} points, "
            f"not at {verdicts.count('no')}, undecided at {verdicts.count('?')}, "
            f"no comparison at {verdicts.count('-')} (of {len(rows)})"
        )


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", nargs="+", type=int, default=[8, 12, 16], help="chain n")
    parser.add_argument("--ratios", nargs="+", type=float, default=list(RATIOS))
    parser.add_argument("--heuristics", nargs="+", default=["dtr", "dtr_held", "dtr_eq", "msps"])
    parser.add_argument(
        "--time-limit", type=float, default=60.0, help="seconds per MILP (HiGHS stops there)"
    )
    parser.add_argument("--max-nodes", type=int, default=checkmate.MAX_NODES)
    parser.add_argument("--no-record", action="store_true", help="skip the bench models")
    parser.add_argument(
        "--models", nargs="+", default=["mlp", "cnn", "lstm", "transformer", "tree"]
    )
    parser.add_argument("--out", default=os.path.join(RESULTS, "checkmate.csv"))
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as folder:
        traces = chain_traces(args.sizes, folder)
        if not args.no_record:
            traces += record_traces(args.models, folder)
        rows = sweep(traces, args.ratios, args.heuristics, args.time_limit, args.max_nodes)
    header, lines = table(rows, args.heuristics)
    print("\noverhead (total compute / each op once) at the same budget in bytes")
    print_table(header, lines)
    if rows:
        write_csv(args.out, list(rows[0]), [[_csv(v) for v in r.values()] for r in rows])
    print()
    summary(rows, args.heuristics)
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
