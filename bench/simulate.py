"""Heuristics in simulation: the DTR paper's study, on its own traces and on ours.

Replays every trace under every heuristic at budget ratios 1.0 .. 0.05 of the
unconstrained peak, with the paper's semantics for its traces and dtr's live semantics
for traces dtr recorded from the bench models. Writes ``bench/results/sim.csv``, one plot
per trace (overhead vs budget ratio, one line per heuristic: the paper's pareto figure),
and a table of the smallest feasible ratio and the overhead at 0.5 and 0.3 next to what
the paper's simulator reached.

    python -m bench.simulate                    # prototype traces + recorded bench models
    python -m bench.simulate --no-record        # prototype traces only

The bench models' traces and those of seven held-out models (``bench/heldout.py``:
programs our heuristics were not chosen on) are recorded first, under
``bench/results/traces/``; the table of the acceptance rule for a heuristic of our own shows
the held-out ones apart.
"""

from __future__ import annotations

import argparse
import csv
import glob
import math
import os
import time

import dtr
import dtr.sim as sim
from dtr.plot import overhead_vs_budget

from .common import RESULTS, print_table, write_csv
from .harness import record_traces
from .heldout import record_heldout

RATIOS = sim.SWEEP_RATIOS
# Our own heuristics, each shown against the paper's h_DTR (`dtr`) in the summary table.
OURS = ("msps_sqrt", "dtr_held", "dtr_held34")
# The acceptance rule for a heuristic of our own: a strictly lower smallest feasible ratio than
# h_DTR on at least this many traces, and at most this much more overhead on any.
RULE_LOWER, RULE_LOSS = 4, 0.05

# What the paper's own simulator reached on these traces (measured by running
# it): smallest feasible ratio on the 0.05 grid for h_DTR / h_DTR^eq / h_MSPS, and the
# overhead of h_DTR at 0.5.
PAPER = {
    "tv_densenet121": ("DenseNet-121", (0.15, 0.20, 0.15), 1.176),
    "inceptionv4": ("InceptionV4", (0.25, 0.25, 0.30), 1.092),
    "resnet32": ("ResNet-32", (0.15, 0.15, 0.15), 1.107),
    "transformer": ("Transformer", (0.20, 0.20, 0.15), 1.058),
    "unet": ("U-Net", (0.45, 0.45, 0.30), 1.159),
    "treelstm": ("TreeLSTM", (0.15, 0.25, 0.40), 1.123),
    "lstm": ("LSTM", (0.20, 0.20, 0.30), 1.065),
    "unroll_gan": ("Unrolled GAN", (0.25, 0.30, 0.65), 1.067),
}
# The paper's simulator itself, run on the same traces at 0.5, 0.4, 0.3 and 0.2 for the
# three heuristics (bench/reference/README.md says how it was measured).
SIMRD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "reference", "simrd.csv")

HEADER = [
    "trace",
    "heuristic",
    "ratio",
    "status",
    "overhead",
    "evictions",
    "remats",
    "peak_bytes",
    "budget_bytes",
    "seconds",
]


def prototype_traces(folder: str) -> list[tuple[str, str]]:
    out = []
    for key in PAPER:
        matches = sorted(glob.glob(os.path.join(folder, key + "-*")))
        if matches:
            out.append((PAPER[key][0], matches[0]))
    return out


def sweep(traces, heuristics, ratios, core: str) -> list[dict]:
    rows = []
    for label, path in traces:
        prog = sim.load(path)
        start = time.perf_counter()
        for row in sim.sweep(prog, heuristics, ratios, progress=True, core=core):
            rows.append(dict(trace=label, **row))
        print(
            f"{label}: {len(heuristics) * len(ratios)} runs of {prog.ops} ops in "
            f"{time.perf_counter() - start:.1f} s",
            flush=True,
        )
    return rows


def smallest_feasible(rows, trace, heuristic):
    ok = [
        r["ratio"]
        for r in rows
        if r["trace"] == trace and r["heuristic"] == heuristic and r["status"] == "ok"
    ]
    return min(ok) if ok else math.nan


def overhead_at(rows, trace, heuristic, ratio):
    for r in rows:
        if (r["trace"], r["heuristic"], r["ratio"]) == (trace, heuristic, ratio):
            return r["overhead"] if r["status"] == "ok" else math.nan
    return math.nan


def holes(rows, trace, heuristic) -> list[float]:
    """Feasibility holes: ratios that fail while a smaller one succeeds."""
    pts = sorted(
        (r["ratio"], r["status"] == "ok")
        for r in rows
        if r["trace"] == trace and r["heuristic"] == heuristic
    )
    smallest_ok = next((ratio for ratio, ok in pts if ok), None)
    return [
        ratio for ratio, ok in pts if not ok and smallest_ok is not None and ratio > smallest_ok
    ]


def comparison(rows) -> list[list]:
    table = []
    for label, paper_min, paper_half in PAPER.values():
        if not any(r["trace"] == label for r in rows):
            continue
        ours = [smallest_feasible(rows, label, h) for h in ("dtr", "dtr_eq", "msps")]
        half = overhead_at(rows, label, "dtr", 0.5)
        table.append(
            [
                label,
                "/".join(f"{x:.2f}" for x in ours),
                "/".join(f"{x:.2f}" for x in paper_min),
                f"{half:.3f}",
                f"{paper_half:.3f}",
                f"{overhead_at(rows, label, 'dtr', 0.3):.3f}",
                ",".join(f"{x:.2f}" for x in holes(rows, label, "dtr")) or "-",
            ]
            + [
                cell
                for h in OURS
                for cell in (
                    f"{smallest_feasible(rows, label, h):.2f}",
                    f"{overhead_at(rows, label, h, 0.5):.3f}",
                    f"{overhead_at(rows, label, h, 0.3):.3f}",
                    f"{max_loss(rows, label, h, 'dtr') * 100:+.1f}%",
                )
            ]
        )
    return table


def simrd_reference(path: str = SIMRD) -> dict[tuple[str, str, float], dict]:
    """(trace label, heuristic, ratio) -> the paper's simulator's row: status and
    overhead (None unless the run finished)."""
    out = {}
    with open(path, newline="") as f:
        for r in csv.DictReader(f):
            overhead = float(r["overhead"]) if r["status"] == "ok" else None
            out[(r["trace"], r["heuristic"], float(r["ratio"]))] = {
                "status": r["status"],
                "overhead": overhead,
            }
    return out


def against_simrd(rows) -> list[list]:
    """Each ratio of the reference: rows compared, rows feasible in both, worst and best
    overhead of ours over simrd's, and rows whose feasibility differs."""
    ref = simrd_reference()
    ours = {(r["trace"], r["heuristic"], r["ratio"]): r for r in rows}
    table = []
    for ratio in sorted({k[2] for k in ref}, reverse=True):
        both, differ, points = [], [], 0
        for (trace, h, x), want in ref.items():
            got = ours.get((trace, h, x))
            if x != ratio or got is None:
                continue
            points += 1
            if (got["status"] == "ok") != (want["status"] == "ok"):
                differ.append(f"{trace} {h}")
            elif want["overhead"] is not None:
                both.append((got["overhead"] / want["overhead"] - 1, f"{trace} {h}"))
        if not points:
            continue
        worst, best = max(both, default=(math.nan, "-")), min(both, default=(math.nan, "-"))
        table.append(
            [
                f"{ratio:.2f}",
                points,
                len(both),
                f"{worst[0] * 100:+.2f}% ({worst[1]})",
                f"{best[0] * 100:+.2f}% ({best[1]})",
                ", ".join(differ) or "none",
            ]
        )
    return table


def max_loss(rows, trace: str, ours: str, base: str) -> float:
    """Largest relative overhead increase of ours over base at ratios both reach."""
    over = {
        (r["heuristic"], r["ratio"]): r["overhead"]
        for r in rows
        if r["trace"] == trace and r["status"] == "ok"
    }
    return max(
        (
            over[(ours, x)] / over[(base, x)] - 1
            for (h, x) in over
            if h == base and (ours, x) in over
        ),
        default=math.nan,
    )


def rule(rows, ours: str, traces: list[str]) -> tuple[list[list], int, float, list[str]]:
    """The acceptance rule for ours against dtr on traces: one row per trace (smallest
    feasible ratios, ratios dtr reaches and ours does not, largest overhead loss), how
    many traces ours reaches strictly lower, its largest loss, and the traces where it
    reaches less than dtr (a higher smallest ratio or a lost ratio)."""
    table, lower, worst, short = [], 0, -math.inf, []
    for trace in traces:
        base, mine = (smallest_feasible(rows, trace, h) for h in ("dtr", ours))
        status = {
            (r["heuristic"], r["ratio"]): r["status"] == "ok" for r in rows if r["trace"] == trace
        }
        lost = [x for (h, x), ok in status.items() if h == "dtr" and ok and not status[(ours, x)]]
        loss = max_loss(rows, trace, ours, "dtr")
        lower += mine < base
        worst = max(worst, loss)
        if lost or mine > base:
            short.append(trace)
        table.append(
            [
                trace,
                ours,
                f"{base:.2f}",
                f"{mine:.2f}" + (" (lower)" if mine < base else ""),
                " ".join(f"{x:.2f}" for x in sorted(lost)) or "-",
                f"{loss * 100:+.1f}%",
            ]
        )
    return table, lower, worst, short


def print_rule(rows, traces: list[str], heuristics: list[str]) -> list[list]:
    """Prints the rule's verdict and table per heuristic of ours and trace group; returns
    the tables' rows, each led by its group."""
    out = []
    heldout = [t for t in traces if t.startswith("held-out ")]
    chosen = [t for t in traces if t not in heldout]
    header = ["trace", "heuristic", "dtr min", "ours min", "lost ratios", "max loss vs dtr"]
    for ours in (h for h in OURS if h in heuristics):
        for group, names in (("sweep", chosen), ("held-out models", heldout)):
            if not names:
                continue
            table, lower, worst, short = rule(rows, ours, names)
            if group == "sweep":
                met = lower >= RULE_LOWER and worst <= RULE_LOSS and not short
                verdict = f"{'meets' if met else 'does not meet'} the rule (lower on >= "
                verdict += f"{RULE_LOWER}, loss <= {RULE_LOSS * 100:.0f}%, never short)"
            else:  # does what it was chosen for carry over: no loss beyond the rule's?
                held = worst <= RULE_LOSS and not short
                verdict = f"{'holds' if held else 'does not hold'} here (loss <= "
                verdict += f"{RULE_LOSS * 100:.0f}%, never short)"
            print(
                f"\n{ours} against dtr, {group} ({len(names)} traces): strictly lower on "
                f"{lower}, largest loss {worst * 100:+.1f}%, short of dtr on "
                f"{', '.join(short) or 'none'}: {verdict}"
            )
            print_table(header, table)
            out += [[group] + row for row in table]
    return out


RULE_HEADER = ["group", "trace", "heuristic", "dtr min", "ours min", "lost ratios", "max loss"]


def scan_holes(traces, core: str) -> None:
    """Feasibility holes on a fine grid: budgets that fail while a smaller one succeeds
    (reported for DTR in 2026)."""
    fine = tuple(round(1.0 - 0.01 * i, 2) for i in range(96))
    heuristics = ["dtr", "dtr_held", "dtr_held34", "dtr_eq", "msps"]
    rows = sweep(traces, heuristics, fine, core)
    table = []
    for label, _ in traces:
        for h in heuristics:
            found = holes(rows, label, h)
            table.append(
                [
                    label,
                    h,
                    f"{smallest_feasible(rows, label, h):.2f}",
                    len(found),
                    " ".join(f"{x:.2f}" for x in found) or "-",
                ]
            )
    header = ["trace", "heuristic", "smallest feasible", "holes", "failing ratios above it"]
    print()
    print_table(header, table)
    write_csv(os.path.join(RESULTS, "holes.csv"), header, table)


def speed(rows) -> list[list]:
    """Simulated trace ops per second, one run at a time: the median over all runs of a
    heuristic (every trace and ratio but the held-out models': those traces are so short
    that each run's fixed costs would set the median), and its slowest run."""
    out = []
    for heuristic in sorted({r["heuristic"] for r in rows}):
        mine = [
            r
            for r in rows
            if r["heuristic"] == heuristic and not r["trace"].startswith("held-out ")
        ]
        rates = sorted(r["ops"] / r["seconds"] for r in mine if r["seconds"] > 0)
        out.append(
            [heuristic, f"{rates[len(rates) // 2]:,.0f}", f"{max(r['seconds'] for r in mine):.2f}"]
        )
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--traces", default=sim.PROTOTYPE_DIR)
    parser.add_argument("--no-record", action="store_true", help="skip the bench models")
    parser.add_argument(
        "--models", nargs="+", default=["mlp", "cnn", "lstm", "transformer", "tree"]
    )
    parser.add_argument("--heuristics", nargs="+", default=list(dtr.HEURISTICS))
    parser.add_argument("--core", default="c++", choices=["c++", "python"])
    parser.add_argument("--out", default=os.path.join(RESULTS, "sim.csv"))
    parser.add_argument(
        "--holes",
        action="store_true",
        help="instead: scan ratios 1.00 .. 0.05 in steps of 0.01 for "
        "feasibility holes (dtr, dtr_held, dtr_held34, dtr_eq, msps; bench/results/holes.csv)",
    )
    args = parser.parse_args(argv)
    if args.holes:
        scan_holes(prototype_traces(args.traces), args.core)
        return
    traces = prototype_traces(args.traces)
    if not traces:
        print(f"no prototype traces in {args.traces}; continuing with ours")
    if not args.no_record:
        traces += record_traces(args.models, os.path.join(RESULTS, "traces"))
        traces += record_heldout(os.path.join(RESULTS, "traces", "heldout"))
    if not traces:
        parser.error(f"nothing to simulate: no prototype traces in {args.traces}, and --no-record")
    start = time.perf_counter()
    rows = sweep(traces, args.heuristics, RATIOS, args.core)
    seconds = time.perf_counter() - start
    write_csv(args.out, HEADER, [[r[h] for h in HEADER] for r in rows])
    plots = os.path.join(os.path.dirname(args.out), "sim")
    os.makedirs(plots, exist_ok=True)
    for label, _ in traces:
        overhead_vs_budget(
            [r for r in rows if r["trace"] == label],
            os.path.join(plots, label.replace(" ", "_") + ".png"),
            label,
        )
    print()
    print_table(
        [
            "trace",
            "min ratio dtr/eq/msps",
            "paper",
            "dtr @0.5",
            "paper @0.5",
            "dtr @0.3",
            "dtr holes",
        ]
        + [col for h in OURS for col in (f"{h} min", "@0.5", "@0.3", "max loss vs dtr")],
        comparison(rows),
    )
    vs_simrd = against_simrd(rows)
    if vs_simrd:
        print("\nAgainst the paper's simulator run on the same traces (bench/reference/simrd.csv):")
        print_table(
            [
                "ratio",
                "points",
                "both feasible",
                "ours vs simrd, worst",
                "best",
                "feasibility differs",
            ],
            vs_simrd,
        )
    if "dtr" in args.heuristics:
        rule_rows = print_rule(rows, [label for label, _ in traces], args.heuristics)
        rule_csv = os.path.join(os.path.dirname(args.out), "own_heuristic.csv")
        write_csv(rule_csv, RULE_HEADER, rule_rows)
    print()
    print_table(["heuristic", "median ops/s", "slowest run (s)"], speed(rows))
    print(f"\n{len(rows)} runs in {seconds:.1f} s; wrote {args.out} and {plots}/")


if __name__ == "__main__":
    main()
