"""Trace-driven simulation: replay an operator trace under any heuristic and budget,
through the same bookkeeping core as live runs.

    prog = dtr.sim.load("run.jsonl")           # ours, or the DTR prototype's (.gz or plain)
    res = dtr.sim.simulate(prog, "dtr_eq", ratio=0.4)
    res.status, res.overhead, res.evictions

Command line: ``python -m dtr.sim TRACE --heuristic dtr_eq --budget-ratio 0.4``.
"""

from __future__ import annotations

import math
import numbers
import os
import time

from ..core import core_class
from ..core.reference import DEFAULT_HEURISTIC, HEURISTICS, PyCore
from ..errors import ConfigError
from . import program
from .parse import INT64_MAX, UINT64_MAX, TraceError, integer_value, load
from .replay import Result, replay

__all__ = [
    "DEFAULT_HEURISTIC",
    "HEURISTICS",
    "PROTOTYPE_DIR",
    "SWEEP_RATIOS",
    "Result",
    "TraceError",
    "load",
    "peak",
    "recorded_heuristic",
    "simulate",
    "sweep",
]

SWEEP_RATIOS = tuple(round(1.0 - 0.05 * i, 2) for i in range(20))  # 1.0 .. 0.05

# The DTR prototype's published traces (never copied into this repository).
PROTOTYPE_DIR = os.path.normpath(
    os.path.join(
        os.path.dirname(os.path.abspath(__file__)),
        "..",
        "..",
        "..",
        "shared",
        "traces",
        "dtr-prototype",
    )
)


def _make_core(
    heuristic: str, budget: int, seed: int, core: str, sample: int = 0, min_evict: int = 0
):
    if heuristic not in HEURISTICS:
        raise ConfigError(f"dtr: unknown heuristic {heuristic!r}; valid: {', '.join(HEURISTICS)}")
    if core == "python":
        made = PyCore(heuristic, budget, seed, min_evict)
    else:
        cls, _ = core_class(False)
        made = cls(heuristic, budget, seed, min_evict)
    made.search_sample = sample
    return made


def check_ratio(ratio) -> float:
    """A budget ratio: a finite number > 0 (ConfigError otherwise)."""
    if not _is_number(ratio) or not (math.isfinite(ratio) and ratio > 0):
        raise ConfigError(f"dtr: a budget ratio must be a finite number > 0, got {ratio!r}")
    return float(ratio)


def check_thrash(thrash) -> float:
    """The recomputation cap: a finite number >= 0, 0 for none (ConfigError otherwise)."""
    if not _is_number(thrash) or not (math.isfinite(thrash) and thrash >= 0):
        raise ConfigError(
            f"dtr: thrash must be a finite number >= 0 (0: no cap), got {thrash!r}"
        )
    return float(thrash)


def check_int(name: str, value, low: int = 0, high: int = INT64_MAX) -> int:
    """An integer option the cores take (ConfigError unless an int in [low, high]: the
    C++ core's types)."""
    if (
        isinstance(value, bool)
        or not isinstance(value, numbers.Integral)
        or not low <= value <= high
    ):
        raise ConfigError(f"dtr: {name} must be an int in [{low}, {high}], got {value!r}")
    return int(value)


def _is_number(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def peak(prog: program.Program, core: str = "c++") -> int:
    """Peak resident bytes of an unconstrained replay (what budget ratios are relative to)."""
    if prog.peak_bytes is None:
        # with no budget at all, even where the live run set one (session.set_budget())
        free = prog.with_fixed_budget()
        prog.peak_bytes = simulate(free, "dtr", budget=-1, core=core).peak_bytes
    return prog.peak_bytes


def simulate(
    prog: program.Program,
    heuristic: str | None = None,
    budget: int | None = None,
    ratio: float | None = None,
    stress: bool = False,
    thrash: float = 2.0,
    seed: int | None = None,
    core: str = "c++",
    log: bool = False,
    sample: int | None = None,
    min_evict_bytes: int | None = None,
) -> Result:
    """Replay prog under heuristic (None: the one the live run recorded, or
    dtr.DEFAULT_HEURISTIC for the prototype's traces) with a budget in bytes, or ratio x
    the unconstrained peak (budget=-1 or neither: unlimited). core: "c++" (the
    compiled replay loop driving the C++ core), "python" (the Python driver on the
    pure-Python core) or "python+c++core" (the Python driver on the C++ core). sample:
    the runtime's search_sample option (the best of `sample` random candidates when
    more are evictable; 0: exact search); None takes the value the trace was recorded
    with, or 0 (exact, as the paper's simulator) for the prototype's traces. seed (the
    random heuristic's) and min_evict_bytes (pools smaller are never victims): None
    takes the trace's, or 0."""
    if heuristic is None:
        heuristic = recorded_heuristic(prog)
    sample = check_int("sample", _recorded(prog, "SEARCH_SAMPLE") if sample is None else sample)
    seed = check_int("seed", _recorded(prog, "SEED") if seed is None else seed, high=UINT64_MAX)
    min_evict_bytes = check_int(
        "min_evict_bytes",
        _recorded(prog, "MIN_EVICT_BYTES") if min_evict_bytes is None else min_evict_bytes,
    )
    thrash = check_thrash(thrash)
    if ratio is not None:
        if budget is not None:
            raise ConfigError("dtr: give a budget or a ratio, not both")
        budget = _ratio_budget(prog, check_ratio(ratio), core)
    budget = check_int("budget", -1 if budget is None else budget, low=-1)
    bookkeeping = _make_core(
        heuristic, budget, seed, "python" if core == "python" else "c++", sample, min_evict_bytes
    )
    # The prototype's traces replay on the paper's staleness clock (docs/design.md, "Two
    # replay semantics"); ours on the live runtime's, so a replay decides as the run did.
    bookkeeping.request_stamps = prog.mode == program.PROTOTYPE
    if prog.budget_at and str(budget) != prog.meta.get("BUDGET"):
        # The live run changed its budget (session.set_budget()); a replay at the run's
        # own budget follows it, one at another budget keeps that one throughout.
        prog = prog.with_fixed_budget()
    if core == "c++" and hasattr(type(bookkeeping), "replay"):
        return _cpp_replay(prog, bookkeeping, stress, thrash, log)
    return replay(prog, bookkeeping, stress, thrash, log)


def _ratio_budget(prog: program.Program, ratio: float, core: str) -> int:
    top = peak(prog, "python" if core == "python" else "c++")
    budget = int(top * ratio)
    if budget > INT64_MAX:
        raise ConfigError(
            f"dtr: budget ratio {ratio!r} x the peak ({top} bytes) is beyond {INT64_MAX} "
            "bytes; give a smaller ratio"
        )
    return budget


def recorded_heuristic(prog: program.Program) -> str:
    """The heuristic the live run that wrote prog evicted by (dtr.DEFAULT_HEURISTIC for
    the prototype's traces, which do not say)."""
    return prog.meta.get("HEURISTIC", DEFAULT_HEURISTIC)


def _recorded(prog: program.Program, name: str) -> int:
    """A setting the live run recorded in START (0 if the trace has none)."""
    raw = prog.meta.get(name, "0")
    value = integer_value(raw, 0, UINT64_MAX)
    if value is None:
        raise TraceError(f"dtr: {prog.name}: {name} {raw!r} in START is not an int")
    return value


def _cpp_replay(prog, core, stress, thrash, log) -> Result:
    start, budget = time.perf_counter(), core.budget
    status = core.replay(
        prog.code, prog.costs, prog.nslots, prog.mode, stress, thrash, prog.baseline, log
    )
    return Result.of(core, prog, status, time.perf_counter() - start, log, budget)


def sweep(
    prog: program.Program,
    heuristics=HEURISTICS,
    ratios=SWEEP_RATIOS,
    progress: bool = False,
    **options,
) -> list[dict]:
    """simulate() at every heuristic x budget ratio: one dict per run with heuristic,
    ratio, status, feasible, overhead and the Result's counters (the rows that
    dtr.plot.overhead_vs_budget draws). options go to simulate(); progress=True shows
    a tqdm bar."""
    points = [(h, r) for h in heuristics for r in ratios]
    if progress:
        from tqdm.auto import tqdm

        points = tqdm(points, desc=prog.name or "sweep", unit="run", leave=False)
    rows = []
    for heuristic, ratio in points:
        res = simulate(prog, heuristic, ratio=ratio, **options)
        rows.append(dict(heuristic=heuristic, ratio=ratio, **res.as_dict()))
    return rows
