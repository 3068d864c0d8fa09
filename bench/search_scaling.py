"""Victim search against the number of live tensors: time per eviction decision.

Drives the bookkeeping core directly (no tensors): records N ops, each reading one or two
earlier outputs (a random DAG of mixed sizes and costs, every output held by the
program), then lowers the budget so that the core must evict, and times the evictions
it makes. Per heuristic and N = 1e3 .. 1e6 (C++ core; the Python twin up to 1e4).
Writes bench/results/search_scaling.csv.

    python -m bench.search_scaling                 # a few minutes
    python -m bench.search_scaling --sizes 1000 10000
"""

from __future__ import annotations

import argparse
import os
import random
import time

from dtr._core import core_class
from dtr._pycore import NEW

from .common import RESULTS, print_table, write_csv

EVICTIONS = 60  # decisions timed per batch
BATCHES = 3  # the fastest batch is reported (the machine is shared and noisy)


def build(cls, heuristic: str, n: int, seed: int = 0):
    """A core holding n live outputs of a random DAG (each op reads 1-2 recent outputs)."""
    rng = random.Random(seed)
    core = cls(heuristic, -1, seed, 0)
    tids: list[int] = []
    for i in range(n):
        inputs = (
            [tids[rng.randrange(max(0, i - 64), i)] for _ in range(rng.randint(1, 2))] if i else []
        )
        nbytes = rng.choice((4096, 16384, 65536, 262144))
        (t,) = core.record(inputs, rng.uniform(1e-5, 1e-3), [NEW], [-1], [nbytes])
        tids.append(t)
    return core


def time_decisions(core, evictions: int) -> tuple[float, int]:
    """Seconds per eviction decision, over `evictions` forced ones."""
    done = 0
    start = time.perf_counter()
    while done < evictions:
        core.budget = max(0, core.resident_bytes - 1)  # exactly one more pool must go
        before = core.evictions
        if not core.make_room(0):
            break
        done += core.evictions - before
    elapsed = time.perf_counter() - start
    return (elapsed / done if done else float("nan")), done


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", nargs="+", type=int, default=[1000, 10000, 100000, 1000000])
    parser.add_argument("--heuristics", nargs="+", default=["dtr", "dtr_eq", "lru", "msps"])
    parser.add_argument("--python-max", type=int, default=10000, help="largest N for the twin")
    args = parser.parse_args(argv)
    cores = [core_class(False), core_class(True)]
    rows = []
    for cls, kind in cores:
        for heuristic in args.heuristics:
            for n in args.sizes:
                if kind == "python" and n > args.python_max:
                    continue
                start = time.perf_counter()
                core = build(cls, heuristic, n)
                built = time.perf_counter() - start
                batches = [time_decisions(core, EVICTIONS) for _ in range(BATCHES)]
                per = min(b[0] for b in batches)
                done = sum(b[1] for b in batches)
                del core  # freed before the next point is built and timed
                rows.append(
                    dict(
                        core=kind,
                        heuristic=heuristic,
                        live=n,
                        us_per_decision=per * 1e6,
                        decisions=done,
                        build_s=built,
                    )
                )
                print(f"{kind} {heuristic} N={n}: {per * 1e6:.1f} us per decision", flush=True)
    header = ["core", "heuristic", "live tensors", "us per decision", "decisions", "build s"]
    table = [
        [
            r["core"],
            r["heuristic"],
            r["live"],
            f"{r['us_per_decision']:.1f}",
            r["decisions"],
            f"{r['build_s']:.1f}",
        ]
        for r in rows
    ]
    print()
    print_table(header, table)
    path = os.path.join(RESULTS, "search_scaling.csv")
    write_csv(path, header, table)
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
