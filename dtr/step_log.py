"""Per-step summaries: what dtr did between two optimizer steps, for logs and dashboards.

A step ends at each ``optimizer.step()`` (a global optimizer hook, registered only while
a session with ``log_steps=True`` is active) or when the program calls
``session.end_step()`` itself (for hand-written updates, or several optimizers per
step). Each step's summary goes to ``session.steps()`` and, at INFO, to the standard
``logging`` logger named "dtr":

    logging.basicConfig(level=logging.INFO)
    with dtr.enable(budget="2GiB", log_steps=True) as session: ...
    # INFO:dtr:dtr step 3: 1204 ops, 310 evictions, 295 remats (12.1 ms recomputing), ...
"""

from __future__ import annotations

import dataclasses
import logging
import time

from .stats import Loggable
from .units import format_bytes

log = logging.getLogger("dtr")


@dataclasses.dataclass(frozen=True)
class StepStats(Loggable):
    """One step's counters (deltas over the step, except the byte counts).

    Attributes:
        step: 1 for the first step of the session.
        ops, evictions, remats, recompute_seconds: during this step.
        peak_resident_bytes: the largest resident count at an op boundary in this step.
        max_transient_bytes: the largest at any point of this step, an op's fresh
            outputs before eviction included.
        resident_bytes: resident bytes when the step ended.
        budget_bytes: the budget then (None: unlimited).
        seconds: wall time of the step.
    """

    step: int
    ops: int
    evictions: int
    remats: int
    recompute_seconds: float
    peak_resident_bytes: int
    max_transient_bytes: int
    resident_bytes: int
    budget_bytes: int | None
    seconds: float

    def __str__(self) -> str:
        return (
            f"dtr step {self.step}: {self.ops} ops, {self.evictions} evictions, "
            f"{self.remats} remats ({self.recompute_seconds * 1e3:.1f} ms recomputing), "
            f"peak {format_bytes(self.peak_resident_bytes)} of "
            f"{format_bytes(self.budget_bytes)}, resident {format_bytes(self.resident_bytes)}, "
            f"{self.seconds:.3f} s"
        )


class StepTracker:
    """Counts the steps of one engine. ``source`` is the engine's runtime (dtr.enable's
    Runtime, or a native session): ``step_counters()`` returns (ops, evictions, remats,
    recompute_seconds, resident_bytes, budget_bytes or None) so far, and
    ``take_step_peak()`` the (peak, max transient) bytes since the last step, starting
    them afresh. ``end()`` closes the current step."""

    def __init__(self, source):
        self.source = source
        self.history: list[StepStats] = []
        self._mark = self._counters()

    def _counters(self) -> tuple:
        ops, evictions, remats, seconds, _, _ = self.source.step_counters()
        return (ops, evictions, remats, seconds, time.perf_counter())

    def end(self) -> StepStats:
        *counted, resident, budget = self.source.step_counters()
        now = (*counted, time.perf_counter())
        ops, evictions, remats, seconds, wall = (b - a for a, b in zip(self._mark, now))
        peak, transient = self.source.take_step_peak()
        step = StepStats(
            step=len(self.history) + 1,
            ops=ops,
            evictions=evictions,
            remats=remats,
            recompute_seconds=seconds,
            peak_resident_bytes=peak,
            max_transient_bytes=transient,
            resident_bytes=resident,
            budget_bytes=budget,
            seconds=wall,
        )
        self.history.append(step)
        self._mark = now
        log.info("%s", step)
        return step
