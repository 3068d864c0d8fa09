"""Chains: DTR against static checkpointing, and the paper's Theorem 3.1.

1. Static baselines on an n-op chain (forward, then backward): Chen et al.'s sqrt(n)
   segments and Griewank's optimal binomial reversal (Revolve) with several slot counts,
   each written as an explicit schedule and replayed by the simulator with no budget
   (peak memory, total compute); then DTR replaying the plain chain at each of those
   peaks. Plot: compute / n against peak memory, one series per method.
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
from dtr.sim import chain

from .common import RESULTS, print_table, write_csv

MB = 1 << 20


def _replay(path: str, heuristic: str = "dtr", tensors: float | None = None):
    prog = sim.load(path)
    budget = -1 if tensors is None else int(tensors * MB)
    return prog, sim.simulate(prog, heuristic, budget=budget, thrash=0)


def baselines(n: int, heuristics: list[str], folder: str) -> list[dict]:
    rows = []
    plain, _ = _replay(chain.plain(n, os.path.join(folder, "plain.jsonl")))
    base = plain.baseline
    statics = [("chen", chain.chen(n, os.path.join(folder, "chen.jsonl")))]
    for slots in (1, 2, 4, 8, 16, 32):
        statics.append(
            (
                f"binomial s={slots}",
                chain.binomial(n, os.path.join(folder, f"bin{slots}.jsonl"), slots),
            )
        )
    for name, path in statics:
        prog, res = _replay(path)
        peak = res.peak_bytes / MB
        rows.append(dict(method=name, peak=peak, compute=prog.baseline / base, status="ok"))
        for heuristic in heuristics:
            _, d = _replay(os.path.join(folder, "plain.jsonl"), heuristic, peak)
            rows.append(
                dict(
                    method=f"dtr ({heuristic}) at {name} memory",
                    peak=peak,
                    compute=(base + d.remat_cost) / base if d.feasible else math.nan,
                    status=d.status,
                )
            )
    return rows


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


def _plot_baselines(rows, path):
    from dtr.plot import _pyplot

    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    series: dict[str, list] = {}
    for r in rows:
        key = (
            "dtr (" + r["method"].split("(")[1].split(")")[0] + ")"
            if r["method"].startswith("dtr")
            else ("chen" if r["method"] == "chen" else "binomial (Revolve)")
        )
        if not math.isnan(r["compute"]):
            series.setdefault(key, []).append((r["peak"], r["compute"]))
    for key, pts in sorted(series.items()):
        pts.sort()
        style = (
            dict(marker="*", markersize=14, linestyle="none") if key == "chen" else dict(marker="o")
        )
        ax.plot([p[0] for p in pts], [p[1] for p in pts], label=key, **style)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("peak memory (tensors)")
    ax.set_ylabel("total compute / chain without checkpointing")
    ax.set_title("chain: DTR vs static checkpointing")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _plot_theorem(rows, path):
    from dtr.plot import _pyplot

    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for heuristic in sorted({r["heuristic"] for r in rows}):
        pts = [(r["n"], r["ops_per_n"]) for r in rows if r["heuristic"] == heuristic]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=heuristic)
    ax.set_xscale("log")
    ax.set_xlabel("chain length N")
    ax.set_ylabel("total ops / N at a budget of 2 sqrt(N) tensors")
    ax.set_title("Theorem 3.1: O(N) ops")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=400, help="chain length for the baselines")
    parser.add_argument(
        "--sizes", nargs="+", type=int, default=[10, 30, 100, 300, 1000, 3000, 10000]
    )
    parser.add_argument("--heuristics", nargs="+", default=["dtr", "dtr_eq", "lru"])
    args = parser.parse_args(argv)
    os.makedirs(RESULTS, exist_ok=True)
    with tempfile.TemporaryDirectory() as folder:
        base_rows = baselines(args.n, args.heuristics, folder)
        th_rows = theorem(args.sizes, args.heuristics, folder)
    header = ["method", "peak_tensors", "compute_ratio", "status"]
    table = [
        [r["method"], f"{r['peak']:.0f}", f"{r['compute']:.3f}", r["status"]] for r in base_rows
    ]
    print(f"\nchain of n={args.n}: compute relative to the chain without checkpointing")
    print_table(header, table)
    write_csv(os.path.join(RESULTS, "chain_baselines.csv"), header, table)
    _plot_baselines(base_rows, os.path.join(RESULTS, "chain_baselines.png"))
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
    _plot_theorem(th_rows, os.path.join(RESULTS, "chain_theorem.png"))
    print(f"\nwrote {RESULTS}/chain_baselines.csv/.png and chain_theorem.csv/.png")


if __name__ == "__main__":
    main()
