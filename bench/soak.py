"""A soak run: many small training steps under a budget, watching for anything that grows.

A small MLP trains with SGD at a fraction (default half) of its own unbudgeted peak,
measured first on the same engine, keeping a running mean of the loss (the usual logging
line, a value carried from step to step). Every K steps it samples dtr's resident,
pinned and constant bytes, the process's resident set (VmRSS), and the evictions and
recomputations per step over the last K steps; at the end each column is called flat
when its last sample is within a few percent of its first after warm-up. Writes
bench/results/soak.csv.

    python -m bench.soak --steps 10000                 # both engines, a few minutes each
    python -m bench.soak --steps 2000 --engine native
"""

from __future__ import annotations

import argparse
import os
import time

import torch
from torch import nn

import dtr

from .common import RESULTS, print_table, write_csv

ENGINES = ("subclass", "native")
# the sampled columns, and how much the last sample may exceed the first after warm-up
# (a fraction of the first, plus an absolute slack for counts that are small or zero)
COLUMNS = {
    "resident_bytes": (0.02, 64),
    "pinned_bytes": (0.02, 64),
    "constant_bytes": (0.02, 64),
    "rss_kib": (0.03, 1024),
    "evictions_per_step": (0.05, 1),
    "remats_per_step": (0.05, 1),
}


def rss_kib() -> int:
    """The process's resident set now, in KiB (VmRSS; the peak where /proc is missing)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def _model() -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Linear(16, 32), nn.Tanh()]
    for _ in range(8):
        layers += [nn.Linear(32, 32), nn.Tanh()]
    return nn.Sequential(*layers, nn.Linear(32, 1))


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(128, 16, generator=g), torch.randn(128, 1, generator=g)


def _train(session, steps: int, every: int, on_sample) -> float:
    """steps SGD steps of the MLP; on_sample(step, session) every `every` steps (and
    after the last). Returns the running mean of the loss."""
    model = _model()
    x, y = _batch()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    running = None
    for step in range(1, steps + 1):
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        d = loss.detach()
        running = d if running is None else 0.99 * running + 0.01 * d
        if step % every == 0 or step == steps:
            on_sample(step, session)
    return float(running)


def own_peak(engine: str) -> int:
    """The unbudgeted peak resident bytes of a few steps on this engine."""
    with dtr.enable(engine=engine, cost_model="roofline") as session:
        _train(session, 3, 3, lambda *_: None)
    return session.stats().peak_resident_bytes


def run(engine: str, steps: int, every: int, ratio: float = 0.5) -> list[dict]:
    """One soak run; a row per sample."""
    budget = int(ratio * own_peak(engine))
    rows: list[dict] = []
    last = {"step": 0, "evictions": 0, "remats": 0}
    start = time.perf_counter()

    def sample(step, session):
        stats = session.stats()
        n = step - last["step"]
        rows.append(
            {
                "engine": engine,
                "step": step,
                "budget_bytes": budget,
                "resident_bytes": stats.resident_bytes,
                "pinned_bytes": stats.pinned_bytes,
                "constant_bytes": stats.constant_bytes,
                "rss_kib": rss_kib(),
                "evictions_per_step": (stats.evictions - last["evictions"]) / n,
                "remats_per_step": (stats.remats - last["remats"]) / n,
                "seconds": time.perf_counter() - start,
            }
        )
        last.update(step=step, evictions=stats.evictions, remats=stats.remats)

    with dtr.enable(engine=engine, budget=budget, cost_model="roofline") as session:
        mean = _train(session, steps, every, sample)
    for r in rows:
        r["running_mean"] = mean
    return rows


def flatness(rows: list[dict], warmup: int = 1) -> dict[str, bool]:
    """Per column: whether the last sample is within its tolerance (COLUMNS) of the
    first sample after `warmup` samples."""
    first, final = rows[min(warmup, len(rows) - 1)], rows[-1]
    return {
        col: final[col] <= first[col] * (1 + frac) + slack
        for col, (frac, slack) in COLUMNS.items()
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=10000)
    parser.add_argument("--every", type=int, default=None, help="sample every K steps")
    parser.add_argument("--engine", choices=[*ENGINES, "both"], default="both")
    parser.add_argument("--ratio", type=float, default=0.5, help="budget / own peak")
    parser.add_argument("--out", default=os.path.join(RESULTS, "soak.csv"))
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    every = args.every or max(1, args.steps // 10)
    engines = ENGINES if args.engine == "both" else (args.engine,)
    rows: list[dict] = []
    for engine in engines:
        got = run(engine, args.steps, every, args.ratio)
        rows += got
        header = ["step", "resident", "pinned", "constants", "RSS KiB", "evict/step"]
        header += ["remat/step", "s"]
        table = [
            [
                r["step"],
                r["resident_bytes"],
                r["pinned_bytes"],
                r["constant_bytes"],
                r["rss_kib"],
                f"{r['evictions_per_step']:.1f}",
                f"{r['remats_per_step']:.1f}",
                f"{r['seconds']:.1f}",
            ]
            for r in got
        ]
        print(
            f"\n{engine} engine: {args.steps} steps, budget {got[0]['budget_bytes']} B "
            f"({args.ratio:g} x own peak), running mean {got[0]['running_mean']:.6g}"
        )
        print_table(header, table)
        flat = ", ".join(f"{c} {'yes' if ok else 'NO'}" for c, ok in flatness(got).items())
        print(f"flat (last sample vs first after warm-up): {flat}")
    keys = ["engine", "step", "budget_bytes", *COLUMNS, "seconds", "running_mean"]
    write_csv(args.out, keys, [[r[k] for k in keys] for r in rows])
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
