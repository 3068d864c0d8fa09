"""The zoo: third-party models (torchvision, timm, transformers) and the repo's programs in
their shapes, each trained eagerly and under dtr at no budget and at budgets set as the
parameters' bytes plus a fraction r of the memory dtr counts above them with no budget
("a0.5": half of it).

For each model and budget: feasible or not, bitwise with eager (the losses and every
gradient of two steps, the parameters after both optimizer steps), evictions,
recomputations, dtr's peak count, the real allocation peak (torch.profiler's running sum
of the allocations made during a third step's forward and backward into gradients that
exist already, plus the parameters and the batch it reads: the bytes a budget is meant
to bound), and dtr/eager step time
(medians of timed steps; eager's timed steps run just before each dtr configuration's,
so the two share the machine's state). Writes a table, bench/results/zoo.csv and
bench/results/zoo.png (time against budget per model, through dtr.plot).

Then, per model, where rematerialization's limit lies: P (dtr's peak with no budget), F
(the op-level floor: parameters and batch plus the most any single op needs at once,
computed by dtr.sim.floor from a trace of the run) and B (dtr's smallest feasible budget
for two steps, bisected to 2%), with B's place between F and P; bench/results/zoo.floor.csv.

    python -m bench.zoo                                # every model, about 20 minutes
    python -m bench.zoo --models resnet18 gpt2 --ratios 0.5
    python -m bench.zoo --engine subclass

torchvision and timm come from `pip install --no-deps torchvision==0.28.0 timm`.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import math
import os
import signal
import statistics
import tempfile
import time

import torch

import dtr

from .common import RESULTS, mib, narrow, print_table, profiled_peak, quiet_stderr, write_csv
from .zoo_models import ZOO, Entry

RATIOS = (1.0, 0.7, 0.5, 0.3, 0.2)
CHECKED_STEPS = 2  # steps compared with eager

HEADER = [
    "model",
    "source",
    "engine",
    "config",
    "budget_mib",
    "status",
    "bitwise",
    "evictions",
    "remats",
    "dtr_peak_mib",
    "real_peak_mib",
    "real_vs_budget",
    "step_ms",
    "eager_ms",
    "time_vs_eager",
    "detail",
]


class RunTimeout(Exception):
    """A configuration ran past --timeout (runaway recomputation)."""


@contextlib.contextmanager
def deadline(seconds: float):
    if not math.isfinite(seconds):
        yield
        return

    def expire(signum, frame):
        raise RunTimeout(f"no result within {seconds:g} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


@dataclasses.dataclass
class Outcome:
    """One configuration's run: the checked steps, the metered step, the timed steps."""

    losses: list[float] = dataclasses.field(default_factory=list)
    grads: list[list[torch.Tensor | None]] = dataclasses.field(default_factory=list)
    params: list[torch.Tensor] = dataclasses.field(default_factory=list)
    real_peak: int = 0
    param_bytes: int = 0
    times: list[float] = dataclasses.field(default_factory=list)
    stats: dtr.Stats | None = None
    status: str = "ok"
    detail: str = ""

    def differences(self, eager: Outcome) -> list[str]:
        out = []
        if self.losses != eager.losses:
            out.append(f"losses {self.losses} != {eager.losses}")
        for step, (mine, theirs) in enumerate(zip(self.grads, eager.grads, strict=True)):
            for i, (g, h) in enumerate(zip(mine, theirs, strict=True)):
                if (g is None) != (h is None) or (g is not None and not torch.equal(g, h)):
                    out.append(f"grad {i} at step {step}")
        for i, (p, q) in enumerate(zip(self.params, eager.params, strict=True)):
            if not torch.equal(p, q):
                out.append(f"param {i}")
        return out


def param_bytes(model: torch.nn.Module) -> int:
    return sum(p.untyped_storage().nbytes() for p in model.parameters())


def batch_bytes(batch: tuple) -> int:
    total = 0
    for t in batch:
        if t.layout is torch.sparse_coo:
            total += t.indices().untyped_storage().nbytes() + t.values().untyped_storage().nbytes()
        else:
            total += t.untyped_storage().nbytes()
    return total


def run(
    entry: Entry,
    dtr_kwargs: dict | None,
    timed: int,
    timeout: float,
    meter: bool = True,
    check: bool = True,
) -> Outcome:
    """Train CHECKED_STEPS (+ 1 metered unless not meter) + timed steps of `entry`
    (under dtr.enable(**dtr_kwargs) unless None) from the same seeds every time. Without
    check, only the timed steps after one untimed step (eager's times next to a dtr
    configuration's)."""
    torch.manual_seed(0)
    model = entry.build()
    model.train()
    params = list(model.parameters())
    out = Outcome(param_bytes=param_bytes(model))
    opt = torch.optim.AdamW(params, lr=1e-3)
    g = torch.Generator().manual_seed(1)
    data = [entry.batch(g) for _ in range(CHECKED_STEPS + 1 + timed)]
    grad_buffers = [torch.zeros_like(p) for p in params]  # made outside dtr: plain
    torch.manual_seed(2)

    def forward_backward(batch):
        loss = entry.loss(model, batch)
        loss.backward()
        return loss

    def update():
        opt.step()
        opt.zero_grad()

    ctx = dtr.enable(**dtr_kwargs) if dtr_kwargs is not None else contextlib.nullcontext()
    try:
        with deadline(timeout), ctx as session:
            if not check:
                for i, batch in enumerate(data[CHECKED_STEPS:]):
                    start = time.perf_counter()
                    forward_backward(batch)
                    update()
                    if i > 0:  # the first warms up
                        out.times.append(time.perf_counter() - start)
                return _finish(out, session, dtr_kwargs)
            for batch in data[:CHECKED_STEPS]:
                loss = forward_backward(batch)
                out.grads.append([None if p.grad is None else p.grad.clone() for p in params])
                out.losses.append(loss.item())
                update()
            out.params = [p.detach().clone() for p in params]
            if not meter:
                return _finish(out, session, dtr_kwargs)
            # Gradients the parameters already hold are accumulated in place: the metered
            # step then counts what the budget covers, not the gradients (sized by the user).
            for p, zeros in zip(params, grad_buffers, strict=True):
                p.grad = zeros
            out.real_peak = metered(forward_backward, data[CHECKED_STEPS], model)
            update()
            for batch in data[CHECKED_STEPS + 1 :]:
                start = time.perf_counter()
                forward_backward(batch)
                update()
                out.times.append(time.perf_counter() - start)
        _finish(out, session, dtr_kwargs)
    except dtr.BudgetError as exc:
        out.status, out.detail = "infeasible", _first_line(exc)
    except RunTimeout as exc:
        out.status, out.detail = "timeout", str(exc)
    except dtr.DTRError as exc:
        out.status, out.detail = type(exc).__name__, _first_line(exc)
    except Exception as exc:  # a model dtr breaks is a finding, not a crash of the sweep
        out.status, out.detail = "error", f"{type(exc).__name__}: {_first_line(exc)}"
    return out


def _finish(out: Outcome, session, dtr_kwargs) -> Outcome:
    if dtr_kwargs is not None:
        out.stats = session.stats()
    return out


def metered(forward_backward, batch, model) -> int:
    """The real peak of one forward and backward into gradients that exist already: the
    parameters and the batch, plus the largest running sum of the allocations
    torch.profiler saw during it."""
    prof = torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True
    )
    with quiet_stderr():
        prof.start()
    try:
        forward_backward(batch)
    finally:
        with quiet_stderr():
            prof.stop()
    return param_bytes(model) + batch_bytes(batch) + profiled_peak(prof)


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [""])[0][:200]


def _median_ms(times: list[float]) -> float:
    return statistics.median(times) * 1e3 if times else math.nan


def sweep(
    entry: Entry, engine: str, ratios, timed: int, timeout: float, progress, floor_folder=None
) -> tuple[list[list], list | None]:
    """Rows for one model (eager, dtr with no budget, dtr at each ratio) and, given a
    folder for its trace, its floor row (FLOOR_HEADER)."""
    base = {"engine": engine}
    eager = run(entry, None, timed, timeout)
    progress()
    if eager.status != "ok":
        return [[entry.name, entry.source, engine, "eager", "", eager.status] + [""] * 9 + [eager.detail]], None
    rows = [_row(entry, engine, "eager", None, eager, eager, eager.times)]
    free = run(entry, base, timed, timeout)
    progress()
    rows.append(_row(entry, engine, "no budget", None, free, eager, eager.times))
    if free.status != "ok":
        progress(len(ratios))
        return rows, None
    params = free.param_bytes
    above = max(free.stats.peak_resident_bytes - params, 0)
    for r in ratios:
        budget = params + int(r * above)
        eager_again = run(entry, None, timed, timeout, check=False)  # timed next to it
        got = run(entry, {**base, "budget": budget}, timed, timeout)
        progress()
        rows.append(_row(entry, engine, f"a{r:g}", budget, got, eager, eager_again.times))
    if floor_folder is None:
        return rows, None
    return rows, floor_row(entry, engine, params, free.stats.peak_resident_bytes, timeout, floor_folder)


FLOOR_HEADER = [
    "model",
    "engine",
    "params_mib",
    "peak_P_mib",
    "floor_F_mib",
    "smallest_B_mib",
    "B_as_a",
    "B_vs_floor",  # (B - F) / (P - F): 0 at the floor, 1 at the unbudgeted peak
    "within_F+0.25",
    "within_F+0.5",
]


def op_floor(entry: Entry, engine: str, folder: str) -> int:
    """The op-level floor F of two steps (dtr.sim.floor, from a trace of a run with no
    budget)."""
    from dtr.sim import load
    from dtr.sim.floor import op_floor as trace_floor

    path = os.path.join(folder, f"{entry.name}.{engine}.jsonl.gz")
    got = run(entry, {"engine": engine, "trace": path}, 0, math.inf, meter=False)
    if got.status != "ok":
        raise RuntimeError(f"{entry.name}: tracing failed: {got.status} {got.detail}")
    return trace_floor(load(path))


def smallest_budget(entry: Entry, engine: str, lo: int, hi: int, timeout: float) -> int | None:
    """dtr's smallest feasible budget for two steps, bisected between lo (infeasible or
    the floor) and hi until they are within 2%; None when hi itself is infeasible."""

    def feasible(budget: int) -> bool:
        got = run(entry, {"engine": engine, "budget": budget}, 0, timeout, meter=False)
        return got.status == "ok"

    if not feasible(hi):
        return None
    return narrow(feasible, hi, lo, 0.02)


def floor_row(entry: Entry, engine: str, params: int, peak: int, timeout: float, folder) -> list:
    floor = op_floor(entry, engine, folder)
    best = smallest_budget(entry, engine, floor, peak, timeout)
    span = max(peak - floor, 1)

    def within(k: float) -> str:
        return "" if best is None else ("yes" if best <= floor + k * span else "NO")

    return [
        entry.name,
        engine,
        f"{params / 2**20:.2f}",
        f"{peak / 2**20:.2f}",
        f"{floor / 2**20:.2f}",
        "none" if best is None else f"{best / 2**20:.2f}",
        "" if best is None else f"{(best - params) / max(peak - params, 1):.2f}",
        "" if best is None else f"{(best - floor) / span:.2f}",
        within(0.25),
        within(0.5),
    ]


def _row(entry, engine, config, budget, got: Outcome, eager: Outcome, eager_times) -> list:
    feasible = got.status == "ok"
    diffs = got.differences(eager) if feasible else []
    stats = got.stats
    step, eager_ms = _median_ms(got.times), _median_ms(eager_times)
    return [
        entry.name,
        entry.source,
        engine,
        config,
        "" if budget is None else mib(budget),
        got.status,
        ("yes" if not diffs else "NO") if feasible else "",
        stats.evictions if stats else "",
        stats.remats if stats else "",
        mib(stats.peak_resident_bytes) if stats else "",
        mib(got.real_peak) if feasible else "",
        f"{got.real_peak / budget:.2f}" if feasible and budget else "",
        f"{step:.1f}" if feasible else "",
        f"{eager_ms:.1f}",
        f"{step / eager_ms:.2f}" if feasible else "",
        "; ".join(diffs[:3]) if diffs else got.detail,
    ]


def plot(rows: list[list], path: str) -> None:
    """Step time over eager's against the budget's fraction a, one panel per model."""
    from dtr import plot as dtr_plot

    points = [
        {"model": r[0], "heuristic": r[2], "ratio": float(r[3][1:]), "slowdown": float(r[14])}
        for r in rows
        if r[3].startswith("a") and r[5] == "ok"
    ]
    if points:
        dtr_plot.slowdown_vs_budget(
            points,
            path,
            "dtr zoo: step time / eager against the budget",
            xlabel="a: budget = parameters + a x (peak - parameters)",
        )


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=list(ZOO), choices=list(ZOO))
    p.add_argument("--ratios", nargs="+", type=float, default=list(RATIOS))
    p.add_argument("--engine", default="native", choices=["native", "subclass"])
    p.add_argument("--timed", type=int, default=3, help="timed steps per configuration")
    p.add_argument(
        "--timeout",
        type=float,
        default=60.0,
        help="seconds per configuration (checked between Python calls: a backward that "
        "recomputes without end is stopped by dtr's thrash stop instead)",
    )
    p.add_argument("--no-floor", action="store_true", help="skip the floor F and bisected B")
    p.add_argument("--out", default=os.path.join(RESULTS, "zoo.csv"))
    args = p.parse_args(argv)
    stem = os.path.splitext(args.out)[0]
    from tqdm import tqdm

    bar = tqdm(total=len(args.models) * (2 + len(args.ratios)), unit="run")
    rows, floors = [], []
    with tempfile.TemporaryDirectory() as traces:
        for name in args.models:
            bar.set_description(name)
            got, floor = sweep(
                ZOO[name], args.engine, args.ratios, args.timed, args.timeout, bar.update,
                None if args.no_floor else traces,
            )
            rows += got
            floors += [floor] if floor else []
            write_csv(args.out, HEADER, rows)  # a partial sweep is kept
            if floors:
                write_csv(stem + ".floor.csv", FLOOR_HEADER, floors)
    bar.close()
    print_table(HEADER[:-1], [r[:-1] for r in rows])
    for r in rows:
        if r[-1]:
            print(f"{r[0]} {r[3]}: {r[-1]}")
    if floors:
        print()
        print_table(FLOOR_HEADER, floors)
    plot(rows, stem + ".png")
    print(f"wrote {args.out}" + (f" and {stem}.floor.csv" if floors else ""))


if __name__ == "__main__":
    main()
