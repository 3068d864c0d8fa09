"""Helpers shared by the bench scripts: timed training steps, an independent memory
measure, tables and CSV files. Benchmarks compare methods side by side in one process and
report ratios; absolute times on these machines are noisy."""

from __future__ import annotations

import contextlib
import csv
import dataclasses
import os
import statistics
import sys
import time
from collections.abc import Callable

import torch
from torch.profiler import ProfilerActivity, profile

import dtr

from .harness import make_optimizer, to_device
from .models import MODELS, batches, build

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")

# Bench sizes: tensors grown until an op's compute is large next to dispatch cost.
BENCH_SCALE = {"mlp": 8, "cnn": 4, "lstm": 4, "transformer": 8, "tree": 16}


@dataclasses.dataclass
class Run:
    """Step times of one configuration, or why it could not run. On CUDA, counters holds
    the caching allocator's view of the run (see timed_steps)."""

    times: list[float]
    stats: dtr.Stats | None = None
    error: str = ""
    counters: dict = dataclasses.field(default_factory=dict)

    @property
    def median(self) -> float:
        return statistics.median(self.times) if self.times else float("nan")


def timed_steps(
    name: str,
    scale: int,
    steps: int,
    warmup: int,
    dtr_kwargs: dict | None,
    optimizer: str = "adam",
    device: str = "cpu",
    size: int | None = None,
) -> Run:
    """Train warmup + steps steps (under dtr.enable(**dtr_kwargs) unless None); time the
    last `steps`. A budget dtr cannot meet is recorded, not raised. The model and batches
    (of `size` examples; default: the model's) are built on the CPU from the seeds, then
    moved to `device`. On CUDA each step is timed between two synchronizations, and
    Run.counters gets, from torch.cuda.memory_stats() over the run: cuda_peak (max
    allocated bytes over what was allocated before the model existed), inactive_split
    (peak of inactive_split_bytes: cached memory in split blocks that no allocation can
    use whole, i.e. fragmentation) and alloc_retries (times a cudaMalloc failed and the
    allocator freed its cache to retry). An allocator OOM is raised (bench/max_batch.py
    catches it)."""
    spec = MODELS[name]
    cuda = torch.device(device).type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    before: dict = {}
    if cuda:
        sync()
        torch.cuda.empty_cache()  # this run's fragmentation, not the previous run's
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_stats()
    model = build(name, scale=scale)
    data = batches(name, warmup + steps, scale=scale, size=size)
    if device != "cpu":
        model.to(device)
        data = [to_device(b, device) for b in data]
    opt = make_optimizer(optimizer, model.parameters())
    torch.manual_seed(0)
    times: list[float] = []
    ctx = dtr.enable(**dtr_kwargs) if dtr_kwargs is not None else contextlib.nullcontext()
    try:
        with ctx as session:
            for i, batch in enumerate(data):
                sync()
                start = time.perf_counter()
                loss = spec.loss(model, batch)
                loss.backward()
                opt.step()
                opt.zero_grad()
                sync()
                if i >= warmup:
                    times.append(time.perf_counter() - start)
        run = Run(times, session.stats() if dtr_kwargs is not None else None)
    except dtr.BudgetError:
        run = Run([], None, "infeasible")
    if cuda:
        after = torch.cuda.memory_stats()
        run.counters = {
            "cuda_peak": after.get("allocated_bytes.all.peak", 0)
            - before.get("allocated_bytes.all.current", 0),
            "inactive_split": after.get("inactive_split_bytes.all.peak", 0),
            "alloc_retries": after.get("num_alloc_retries", 0) - before.get("num_alloc_retries", 0),
        }
    return run


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


@contextlib.contextmanager
def quiet_stderr():
    """Kineto prints a line to the process's stderr when a profile starts and stops."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def allocated_base(device: str) -> int:
    """What a run's CUDA peak is measured over (step_peak_bytes): the bytes allocated
    before it, the cache emptied first; 0 on the CPU."""
    if torch.device(device).type != "cuda":
        return 0
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return torch.cuda.memory_allocated()


def step_peak_bytes(step: Callable[[], None], model, opt, batch, device: str, base: int = 0) -> int:
    """Peak bytes over one training step, step(). On the CPU: torch.profiler's allocation
    events (an independent measure) plus the parameters, optimizer state and batch alive
    before it. On CUDA: the caching allocator's max_memory_allocated over base
    (allocated_base, taken before the model existed: the same things, counted by the
    allocator)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        step()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base
    before = state_bytes(model, opt, batch)
    prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
    with quiet_stderr():
        prof.start()
    try:
        step()
    finally:
        with quiet_stderr():
            prof.stop()
    return before + profiled_peak(prof)


def eager_peak_bytes(name: str, scale: int, optimizer: str = "adam", device: str = "cpu") -> int:
    """Peak bytes of an eager training step (step_peak_bytes), after one step has created
    the optimizer state."""
    spec = MODELS[name]
    base = allocated_base(device)
    model = build(name, scale=scale).to(device)
    opt = make_optimizer(optimizer, model.parameters())
    data = [to_device(b, device) for b in batches(name, 2, scale=scale)]

    def step(batch):
        spec.loss(model, batch).backward()
        opt.step()
        opt.zero_grad()

    step(data[0])  # creates optimizer state
    return step_peak_bytes(lambda: step(data[1]), model, opt, data[1], device, base)


def narrow(passes: Callable[[int], bool], good: int, bad: int, resolution: float) -> int:
    """Bisect between good (passes) and bad (fails), on either side of it, until they
    are within a factor 1 + resolution of the smaller (or 1 apart); returns good. The
    smallest feasible budget and the largest batch that fits are both this search."""
    while abs(bad - good) > max(1, int(min(good, bad) * resolution)):
        mid = (good + bad) // 2
        if passes(mid):
            good = mid
        else:
            bad = mid
    return good


def mib(nbytes: float) -> str:
    return f"{nbytes / 2**20:.1f}"


def print_table(header: list[str], rows: list[list]) -> None:
    widths = [max([len(str(h))] + [len(str(r[i])) for r in rows]) for i, h in enumerate(header)]
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
