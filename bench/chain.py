"""Chains: DTR against static checkpointing, and the paper's Theorem 3.1.

1. Static baselines on an n-op chain (forward, then backward): Chen et al.'s sqrt(n)
   segments and Griewank's optimal binomial reversal (Revolve) with several slot counts,
   each written as an explicit schedule and replayed by the simulator with no budget
   (peak memory, total compute); then DTR replaying the plain chain at each of those
   peaks. Plot: compute / n against peak memory, one series per method. The same on a
   short chain (n=16) with the optimal static schedule at each of those peaks (Checkmate's
   MILP, dtr/sim/checkmate.py) as one more series.
2. Theorem 3.1: with a budget of about 2 sqrt(N) tensors, DTR needs O(N) ops on an N-op
   chain. Total ops / N for N up to 10^4, per heuristic.

    python -m bench.chain
"""

from __future__ import annotations

import argparse
import math
import os
import tempfile

import dtr.sim as sim
from dtr.plot import memory_vs_compute, ops_per_n
from dtr.sim import chain, checkmate

from .common import RESULTS, print_table, write_csv

MB = 1 << 20


def _replay(path: str, heuristic: str = "dtr", tensors: float | None = None):
    prog = sim.load(path)
    budget = -1 if tensors is None else int(tensors * MB)
    return prog, sim.simulate(prog, heuristic, budget=budget, thrash=0)


def baselines(
    n: int, heuristics: list[str], folder: str, milp_time_limit: float | None = None
) -> list[dict]:
    """Each static schedule's (peak, compute), DTR's compute at that peak and, with
    milp_time_limit, the optimal static schedule's (Checkmate's MILP) at that peak."""
    rows = []
    plain_path = chain.plain(n, os.path.join(folder, f"plain{n}.jsonl"))
    plain, _ = _replay(plain_path)
    base = plain.baseline
    graph = checkmate.graph_of(plain, max_nodes=10**9) if milp_time_limit else None
    statics = [("chen", chain.chen(n, os.path.join(folder, "chen.jsonl")))]
    for slots in (1, 2, 4, 8, 16, 32):
        if slots < n:
            path = chain.binomial(n, os.path.join(folder, f"bin{slots}.jsonl"), slots)
            statics.append((f"binomial s={slots}", path))
    for name, path in statics:
        prog, res = _replay(path)
        peak = res.peak_bytes / MB
        rows.append(dict(method=name, peak=peak, compute=prog.baseline / base, status="ok"))
        for heuristic in heuristics:
            _, d = _replay(plain_path, heuristic, peak)
            rows.append(
                dict(
                    method=f"dtr ({heuristic}) at {name} memory",
                    peak=peak,
                    compute=(base + d.remat_cost) / base if d.feasible else math.nan,
                    status=d.status,
                )
            )
        if graph is not None:
            opt = checkmate.solve(graph, res.peak_bytes, time_limit=milp_time_limit)
            if opt.feasible:
                checkmate.validate(opt, graph, res.peak_bytes)
            rows.append(
                dict(
                    method=f"checkmate at {name} memory",
                    peak=peak,
                    compute=opt.compute / base if opt.feasible else math.nan,
                    status=opt.status,
                    gap=opt.gap,
                )
            )
    return rows


def _series(rows) -> dict[str, list]:
    """Rows grouped into the plot's lines: a method, or a heuristic at each memory."""
    out: dict[str, list] = {}
    for r in rows:
        method = r["method"]
        if method.startswith("dtr"):
            key = "dtr (" + method.split("(")[1].split(")")[0] + ")"
        elif method.startswith("checkmate"):
            key = "checkmate MILP (optimal static)"
        else:
            key = "chen sqrt(n)" if method == "chen" else "binomial (Revolve)"
        if not math.isnan(r["compute"]):
            out.setdefault(key, []).append((r["peak"], r["compute"]))
    return out


def theorem(sizes: list[int], heuristics: list[str], folder: str) -> list[dict]:
    rows = []
    for n in sizes:
        path = chain.plain(n, os.path.join(folder, f"plain{n}.jsonl"))
        tensors = math.ceil(2 * math.sqrt(n))
        for heuristic in heuristics:
            prog, res = _replay(path, heuristic, tensors)
            total = (prog.baseline + res.remat_cost) if res.feasible else math.nan
            rows.append(
                dict(
                    n=n,
                    budget_tensors=tensors,
                    heuristic=heuristic,
                    status=res.status,
                    ops_per_n=total / n,
                    remats=res.remats,
                    seconds=res.seconds,
                )
            )
            print(
                f"N={n} budget {tensors} tensors {heuristic}: {res.status}, "
                f"{total / n:.2f} ops/N ({res.seconds:.2f} s)",
                flush=True,
            )
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=400, help="chain length for the baselines")
    parser.add_argument(
        "--sizes", nargs="+", type=int, default=[10, 30, 100, 300, 1000, 3000, 10000]
    )
    parser.add_argument("--heuristics", nargs="+", default=["dtr", "dtr_eq", "lru"])
    parser.add_argument(
        "--small", type=int, default=16, help="chain length for the MILP comparison"
    )
    parser.add_argument("--time-limit", type=float, default=30.0, help="seconds per MILP")
    args = parser.parse_args(argv)
    os.makedirs(RESULTS, exist_ok=True)
    with tempfile.TemporaryDirectory() as folder:
        base_rows = baselines(args.n, args.heuristics, folder)
        small_rows = baselines(args.small, args.heuristics, folder, args.time_limit)
        th_rows = theorem(args.sizes, args.heuristics, folder)
    header = ["method", "peak_tensors", "compute_ratio", "status"]
    table = [
        [r["method"], f"{r['peak']:.0f}", f"{r['compute']:.3f}", r["status"]] for r in base_rows
    ]
    print(f"\nchain of n={args.n}: compute relative to the chain without checkpointing")
    print_table(header, table)
    write_csv(os.path.join(RESULTS, "chain_baselines.csv"), header, table)
    title = f"chain of n={args.n}: DTR vs static checkpointing"
    memory_vs_compute(_series(base_rows), os.path.join(RESULTS, "chain_baselines.png"), title)
    header = ["method", "peak_tensors", "compute_ratio", "status", "gap"]
    table = [
        [r["method"], f"{r['peak']:.0f}", f"{r['compute']:.3f}", r["status"], _gap(r)]
        for r in small_rows
    ]
    print(f"\nchain of n={args.small}, with the optimal static schedule (Checkmate's MILP)")
    print_table(header, table)
    write_csv(os.path.join(RESULTS, "chain_small.csv"), header, table)
    title = f"chain of n={args.small}: DTR, static checkpointing and the optimum"
    memory_vs_compute(_series(small_rows), os.path.join(RESULTS, "chain_small.png"), title)
    header = ["n", "budget_tensors", "heuristic", "status", "ops_per_n", "remats", "seconds"]
    table = [
        [
            r["n"],
            r["budget_tensors"],
            r["heuristic"],
            r["status"],
            f"{r['ops_per_n']:.3f}",
            r["remats"],
            f"{r['seconds']:.2f}",
        ]
        for r in th_rows
    ]
    print("\nTheorem 3.1: total ops / N at a budget of ceil(2 sqrt(N)) tensors")
    print_table(header, table)
    write_csv(os.path.join(RESULTS, "chain_theorem.csv"), header, table)
    series = {
        h: [(r["n"], r["ops_per_n"]) for r in th_rows if r["heuristic"] == h]
        for h in sorted({r["heuristic"] for r in th_rows})
    }
    ops_per_n(series, os.path.join(RESULTS, "chain_theorem.png"))
    print(f"\nwrote chain_baselines, chain_small and chain_theorem .csv/.png in {RESULTS}")


def _gap(row) -> str:
    gap = row.get("gap")
    return "" if gap is None or math.isnan(gap) else f"{gap:.3f}"


if __name__ == "__main__":
    main()
