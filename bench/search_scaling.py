"""Victim search against the number of live tensors: time per eviction decision.

Drives the bookkeeping core directly (no tensors): records N ops, each reading one or two
earlier outputs (a random DAG of mixed sizes and costs, every output held by the
program), then lowers the budget so that the core must evict, and times the evictions
it makes. Per heuristic and N = 1e3 .. 1e6 (C++ core; the Python twin up to 1e4), with
exact search and with the default sampled search (--sample). Writes
bench/results/search_scaling.csv. Then, in live training runs of every bench model at 30%
of its unconstrained peak under the default heuristic, the share of the step spent
choosing victims (Stats.search_seconds): bench/results/search_live.csv
(search_live.native.csv for the native engine, --engine native).

    python -m bench.search_scaling                 # a few minutes
    python -m bench.search_scaling --sizes 1000 10000
    python -m bench.search_scaling --skip-synthetic --engine native   # live runs only
"""

from __future__ import annotations

import argparse
import os
import random
import time

import torch

from dtr.config import SEARCH_SAMPLE_DEFAULT, resolve
from dtr.core import core_class
from dtr.core.reference import DEFAULT_HEURISTIC, NEW

from .common import BENCH_SCALE, RESULTS, print_table, timed_steps, write_csv
from .models import MODELS

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


def synthetic(args) -> list[dict]:
    rows = []
    for cls, kind in [core_class(False), core_class(True)]:
        for heuristic in args.heuristics:
            for n in args.sizes:
                if kind == "python" and n > args.python_max:
                    continue
                for sample in (0, args.sample):
                    start = time.perf_counter()
                    core = build(cls, heuristic, n)
                    core.search_sample = sample
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
                            sample=sample or "exact",
                            us_per_decision=per * 1e6,
                            decisions=done,
                            build_s=built,
                        )
                    )
                    print(
                        f"{kind} {heuristic} N={n} sample={sample or 'exact'}: "
                        f"{per * 1e6:.1f} us per decision",
                        flush=True,
                    )
    return rows


def live(args) -> list[list]:
    """Share of a training step spent choosing victims, each bench model at args.ratio of
    its unconstrained peak (the default search_sample)."""
    rows = []
    for name in args.models:
        scale = BENCH_SCALE[name]
        engine = {"engine": args.engine}
        free = timed_steps(name, scale, 1, 1, engine)
        budget = int(free.stats.peak_resident_bytes * args.ratio)
        kwargs = {"budget": budget, "heuristic": DEFAULT_HEURISTIC, **engine}
        run = timed_steps(name, scale, args.steps, 0, kwargs)
        if run.error:
            rows.append([name, args.ratio, run.error, "", "", "", ""])
            continue
        total = sum(run.times)
        st = run.stats
        share = st.search_seconds / total
        rows.append(
            [
                name,
                args.ratio,
                "ok",
                st.evictions,
                f"{total / args.steps * 1e3:.1f}",
                f"{st.search_seconds / args.steps * 1e3:.2f}",
                f"{share * 100:.2f}",
            ]
        )
        print(f"{name}: search {share * 100:.2f}% of step time", flush=True)
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", nargs="+", type=int, default=[1000, 10000, 100000, 1000000])
    parser.add_argument(
        "--heuristics", nargs="+", default=["dtr", "dtr_held", "dtr_eq", "lru", "msps"]
    )
    parser.add_argument("--python-max", type=int, default=10000, help="largest N for the twin")
    parser.add_argument(
        "--sample", type=int, default=SEARCH_SAMPLE_DEFAULT, help="sampled search size"
    )
    parser.add_argument("--models", nargs="+", default=list(MODELS))
    parser.add_argument("--ratio", type=float, default=0.3, help="live runs: budget / peak")
    parser.add_argument("--steps", type=int, default=3, help="live runs: steps timed")
    parser.add_argument("--skip-synthetic", action="store_true")
    parser.add_argument(
        "--engine",
        default="auto",
        choices=["auto", "native", "subclass"],
        help="live runs: dtr's engine (auto: dtr.enable()'s choice here; the native "
        "engine's rows go to bench/results/search_live.native.csv)",
    )
    args = parser.parse_args(argv)
    args.engine = resolve(engine=args.engine).engine
    torch.set_num_threads(1)
    if not args.skip_synthetic:
        rows = synthetic(args)
        header = [
            "core",
            "heuristic",
            "live tensors",
            "sample",
            "us per decision",
            "decisions",
            "build s",
        ]
        table = [
            [
                r["core"],
                r["heuristic"],
                r["live"],
                r["sample"],
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
    header = ["model", "ratio", "status", "evictions", "ms/step", "search ms/step", "search %"]
    table = live(args)
    print()
    print_table(header, table)
    stem = "search_live.native" if args.engine == "native" else "search_live"
    path = os.path.join(RESULTS, stem + ".csv")
    write_csv(path, header, table)
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
