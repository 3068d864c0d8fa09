"""Helpers shared by the bench scripts: timed training steps, an independent memory
measure, tables and CSV files. Benchmarks compare methods side by side in one process and
report ratios; absolute times on these machines are noisy."""

from __future__ import annotations

import contextlib
import csv
import dataclasses
import os
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

import dtr

from .harness import make_optimizer
from .models import MODELS, batches, build

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")

# Bench sizes: tensors grown until an op's compute is large next to dispatch cost.
BENCH_SCALE = {"mlp": 8, "cnn": 4, "lstm": 4, "transformer": 8, "tree": 16}


@dataclasses.dataclass
class Run:
    """Step times of one configuration, or why it could not run."""

    times: list[float]
    stats: dtr.Stats | None = None
    error: str = ""

    @property
    def median(self) -> float:
        return statistics.median(self.times) if self.times else float("nan")


def timed_steps(
    name: str, scale: int, steps: int, warmup: int, dtr_kwargs: dict | None, optimizer: str = "adam"
) -> Run:
    """Train warmup + steps steps (under dtr.enable(**dtr_kwargs) unless None); time the
    last `steps`. A budget dtr cannot meet is recorded, not raised."""
    spec = MODELS[name]
    model = build(name, scale=scale)
    opt = make_optimizer(optimizer, model.parameters())
    data = batches(name, warmup + steps, scale=scale)
    torch.manual_seed(0)
    times: list[float] = []
    ctx = dtr.enable(**dtr_kwargs) if dtr_kwargs is not None else contextlib.nullcontext()
    try:
        with ctx as session:
            for i, batch in enumerate(data):
                start = time.perf_counter()
                loss = spec.loss(model, batch)
                loss.backward()
                opt.step()
                opt.zero_grad()
                if i >= warmup:
                    times.append(time.perf_counter() - start)
    except dtr.BudgetError:
        return Run([], None, "infeasible")
    return Run(times, session.stats() if dtr_kwargs is not None else None)


def profiled_bytes(prof) -> tuple[int, int]:
    """(allocations minus frees at the end, their largest sum at any point) in a
    torch.profiler run's memory events: an independent measure of memory in use."""
    events = sorted(
        (e.start_ns(), e.nbytes())
        for e in prof.profiler.kineto_results.events()
        if e.name() == "[memory]"
    )
    live = peak = 0
    for _, nbytes in events:
        live += nbytes
        peak = max(peak, live)
    return live, peak


def profiled_peak(prof) -> int:
    """The largest sum of allocations minus frees in a torch.profiler run: an
    independent measure of a step's peak."""
    return profiled_bytes(prof)[1]


def state_bytes(model, opt, batch) -> int:
    """Bytes alive before a step: parameters, optimizer state, the batch."""
    total = sum(p.untyped_storage().nbytes() for p in model.parameters())
    total += sum(
        t.untyped_storage().nbytes()
        for s in opt.state.values()
        for t in s.values()
        if isinstance(t, torch.Tensor)
    )
    return total + sum(t.untyped_storage().nbytes() for t in batch)


def eager_peak_bytes(name: str, scale: int, optimizer: str = "adam") -> int:
    """Peak bytes of an eager training step by torch.profiler's allocation events (an
    independent measure), plus the parameters, gradients and optimizer state that exist
    before the step starts."""
    spec = MODELS[name]
    model = build(name, scale=scale)
    opt = make_optimizer(optimizer, model.parameters())
    data = batches(name, 2, scale=scale)
    spec.loss(model, data[0]).backward()  # creates optimizer state
    opt.step()
    opt.zero_grad()
    before = state_bytes(model, opt, data[1])
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        spec.loss(model, data[1]).backward()
        opt.step()
        opt.zero_grad()
    return before + profiled_peak(prof)


def mib(nbytes: float) -> str:
    return f"{nbytes / 2**20:.1f}"


def print_table(header: list[str], rows: list[list]) -> None:
    widths = [max(len(str(h)), *(len(str(r[i])) for r in rows)) for i, h in enumerate(header)]
    line = "  ".join(str(h).rjust(w) for h, w in zip(header, widths))
    print(line)
    print("-" * len(line))
    for r in rows:
        print("  ".join(str(c).rjust(w) for c, w in zip(r, widths)))


def write_csv(path: str, header: list[str], rows: list[list]) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(header)
        writer.writerows(rows)
