"""The native engine (dtr.engines.native.session) against eager and the subclass engine.

Trains the bench models at bench scale with Adam, with no budget and at a fraction of
each engine's own unbudgeted peak, and reports step time relative to eager. Each
measurement runs in a fresh process (CPU time, median of its timed steps), and the
methods take turns, round after round: the order in which a process frees memory
decides how often glibc hands pages back to the kernel and faults them in again, and
one method's heap would otherwise be the next one's starting point.

Each comparison runs twice: with glibc's allocator as it comes, and with its allocator
held (GLIBC_TUNABLES raising the mmap and trim thresholds, for eager and the engines
alike), where freed memory stays in the heap instead of going back to the kernel to be
faulted in again. What differs between the two is the allocator's doing, not the
engine's: the order in which an engine frees memory decides how often glibc faults
(docs/design.md, "The floor at the step"). Writes bench/results/native.csv.

    python -m bench.native            # about seventeen minutes
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys

from .common import RESULTS, print_table, write_csv

MODELS = ("mlp", "cnn", "lstm", "transformer", "tree")
# glibc keeps freed memory in the heap: no block is mmapped on its own or trimmed
HELD = "glibc.malloc.mmap_threshold=4294967296:glibc.malloc.trim_threshold=4294967296"
ALLOCATORS = ("glibc", "held")
# native-nocache: the native engine without its CPU allocation cache (csrc/cpu_cache.cpp)
METHODS = ("eager", "dtr", "native", "native-nocache")

_CHILD = r"""
import contextlib, json, resource, statistics, sys, time
import torch, dtr, dtr.engines.native.session
from bench.common import BENCH_SCALE
from bench.harness import make_optimizer
from bench.models import MODELS, batches, build

name, method, ratio, steps = sys.argv[1], sys.argv[2], float(sys.argv[3]), int(sys.argv[4])
torch.set_num_threads(1)
scale = BENCH_SCALE[name]

def setup():
    torch.manual_seed(0)
    model = build(name, scale=scale)
    return model, make_optimizer("adam", model.parameters()), batches(name, steps + 1, scale=scale)

def train(model, opt, data, context):
    times, faults = [], 0
    with context as session:
        for i, batch in enumerate(data):
            if i == 1:  # page faults of the timed steps, not the first one's first touches
                faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            start = time.process_time()
            loss = MODELS[name].loss(model, batch)
            loss.backward()
            opt.step()
            opt.zero_grad()
            if i:
                times.append(time.process_time() - start)
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
    return statistics.median(times), faults / len(times), session

engines = {
    "eager": None,
    "dtr": lambda **kw: dtr.enable(engine="subclass", **kw),
    "native": dtr.engines.native.session.enable,
    "native-nocache": lambda **kw: dtr.engines.native.session.enable(cache=0, **kw),
}
enable = engines[method]
budget = None
if enable is not None and ratio < 1:
    _, _, probe = train(*setup(), enable())
    budget = int(probe.stats().peak_resident_bytes * ratio)
context = contextlib.nullcontext() if enable is None else enable(budget=budget)
seconds, faults, session = train(*setup(), context)
out = dict(seconds=seconds, faults_per_step=faults, evictions=0, remats=0)
if session is not None:
    stats = session.stats()
    out.update(evictions=stats.evictions, remats=stats.remats)
print(json.dumps(out))
"""


def _measure(name: str, method: str, ratio: float, steps: int, allocator: str) -> dict:
    env = dict(os.environ, PYTHONPATH=os.getcwd() + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("GLIBC_TUNABLES", None)
    if allocator == "held":
        env["GLIBC_TUNABLES"] = HELD
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, name, method, str(ratio), str(steps)],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["?"])[-1]
        return dict(error=last[:160])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run(
    models, ratios, rounds: int, steps: int, allocators=ALLOCATORS, methods=METHODS
) -> list[dict]:
    rows = []
    engines = [m for m in methods if m != "eager"]
    for name, allocator, ratio in itertools.product(models, allocators, ratios):
        order = ["eager", *engines] if ratio >= 1 else engines
        got: dict[str, list[dict]] = {m: [] for m in order}
        for _ in range(rounds):
            for method in order:
                got[method].append(_measure(name, method, ratio, steps, allocator))
        for method in order:
            ok = [r for r in got[method] if "error" in r] == []
            row = dict(model=name, allocator=allocator, ratio=ratio, method=method)
            if ok:
                row.update(
                    seconds=statistics.median(r["seconds"] for r in got[method]),
                    faults=statistics.median(r["faults_per_step"] for r in got[method]),
                    evictions=got[method][-1]["evictions"],
                    remats=got[method][-1]["remats"],
                )
            else:
                row["error"] = next(r["error"] for r in got[method] if "error" in r)
            rows.append(row)
    # against eager under the same allocator
    eager = {
        (r["model"], r["allocator"]): r["seconds"]
        for r in rows
        if r["method"] == "eager" and "seconds" in r
    }
    for r in rows:
        key = (r["model"], r["allocator"])
        if "seconds" in r and key in eager:
            r["x_eager"] = r["seconds"] / eager[key]
    return rows


def main(argv=None) -> None:
    """faults/step: minor page faults per timed step (the first step's first touches
    excluded)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS))
    parser.add_argument("--ratios", nargs="+", type=float, default=[1.0, 0.7])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=4, help="timed steps per process")
    parser.add_argument("--allocators", nargs="+", choices=ALLOCATORS, default=list(ALLOCATORS))
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    args = parser.parse_args(argv)
    rows = run(args.models, args.ratios, args.rounds, args.steps, args.allocators, args.methods)
    header = ["model", "allocator", "budget", "method", "ms/step", "x eager", "faults/step"]
    header.append("evictions")
    table = []
    for r in rows:
        budget = "none" if r["ratio"] >= 1 else f"{r['ratio']:g} x own peak"
        if "error" in r:
            table.append([r["model"], r["allocator"], budget, r["method"], r["error"], "", "", ""])
            continue
        table.append(
            [
                r["model"],
                r["allocator"],
                budget,
                r["method"],
                f"{r['seconds'] * 1e3:.1f}",
                f"{r.get('x_eager', float('nan')):.3f}x",
                f"{r['faults']:.0f}",
                r["evictions"],
            ]
        )
    print("\nthe native engine against eager and dtr (bench scale, Adam, one thread; medians)")
    print_table(header, table)
    path = os.path.join(RESULTS, "native.csv")
    keys = ["model", "allocator", "ratio", "method", "seconds", "x_eager", "faults"]
    keys += ["evictions", "remats"]
    write_csv(path, keys + ["error"], [[r.get(k, "") for k in keys + ["error"]] for r in rows])
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
