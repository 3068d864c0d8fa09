"""What a session did: counters and byte counts, as a dataclass whose fields are API."""

from __future__ import annotations

import dataclasses
import json

from .units import format_bytes


class Loggable:
    """as_dict() / to_json() for the dataclasses a user logs (Stats, StepStats)."""

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.as_dict(), sort_keys=True)


@dataclasses.dataclass(frozen=True)
class Stats(Loggable):
    """Counters of one :func:`dtr.enable` session.

    Attributes:
        budget_bytes: the budget, None when unlimited.
        heuristic: the eviction heuristic.
        ops: op calls dtr recorded (managed outputs).
        evictions: pools evicted to stay within the budget (or by stress mode).
        eager_evictions: pools freed because the program dropped every handle to them.
        remats: recipes rerun to rematerialize evicted tensors.
        recompute_seconds: wall time spent rerunning recipes.
        peak_resident_bytes: the largest resident byte count at an op boundary.
        max_transient_bytes: the largest resident count at any point, including an op's
            fresh outputs before eviction brings the count back within the budget.
        resident_bytes: resident bytes now (managed values and constants).
        pinned_bytes: resident bytes that cannot be evicted (constants, and tensors whose
            lineage was cut by an in-place update).
        constant_bytes: bytes of plain tensors the managed ops read (parameters, inputs).
        core: the bookkeeping core that decided, "c++" or "python" (the native engine
            runs the C++ one).
        oom_retries: ops rerun after the allocator ran out of memory and dtr evicted.
        search_seconds: time spent choosing eviction victims.
        unmanaged_bytes: with measure="allocator", what the device's allocator had
            handed out beyond dtr's own count at the last op boundary (memory dtr does
            not manage, which came off the budget); 0 otherwise.
        real_peak_bytes: the most bytes the CPU allocator had handed out at once while
            the block ran, beyond what was in use when it was entered: activations,
            temporaries, kernel workspaces, autograd's buffers, dtr's or not (the
            budget's real memory, next to dtr's own count, peak_resident_bytes, which
            also counts constants allocated before the block: parameters, inputs).
            Over the whole block (reset_peak() does not restart it); 0 without the
            compiled extension, and CUDA memory is not in it.
        op_floor_bytes: the op-level floor seen so far: the most the constants and one op
            (its inputs and its fresh outputs) had at once in dtr's count. No
            budget below it can run the program (a BudgetError says it and the op).
    """

    budget_bytes: int | None
    heuristic: str
    ops: int
    evictions: int
    eager_evictions: int
    remats: int
    recompute_seconds: float
    peak_resident_bytes: int
    max_transient_bytes: int
    resident_bytes: int
    pinned_bytes: int
    constant_bytes: int
    core: str
    oom_retries: int = 0
    search_seconds: float = 0.0
    unmanaged_bytes: int = 0
    real_peak_bytes: int = 0
    op_floor_bytes: int = 0

    def __str__(self) -> str:
        return (
            f"dtr[{self.heuristic}, budget {format_bytes(self.budget_bytes)}, {self.core} core]: "
            f"{self.ops} ops, {self.evictions} evictions, {self.remats} remats "
            f"({self.recompute_seconds * 1e3:.1f} ms recomputing), peak "
            f"{format_bytes(self.peak_resident_bytes)}, resident "
            f"{format_bytes(self.resident_bytes)} ({format_bytes(self.pinned_bytes)} pinned)"
        )


def collect(rt) -> Stats:
    core = rt.core
    return Stats(
        budget_bytes=rt.config.budget_bytes,
        heuristic=rt.config.heuristic,
        ops=core.ops,
        evictions=core.evictions,
        eager_evictions=core.eager_evictions,
        remats=core.remats,
        recompute_seconds=rt.recompute_seconds,
        peak_resident_bytes=rt.session_peak(),
        max_transient_bytes=rt.transient_peak(),
        resident_bytes=core.resident_bytes,
        pinned_bytes=core.pinned_bytes(),
        constant_bytes=core.constant_bytes(),
        core=rt.core_kind,
        oom_retries=rt.oom_retries,
        search_seconds=core.search_seconds,
        unmanaged_bytes=rt.unmanaged_bytes,
        real_peak_bytes=rt.kernel_meter.real_peak(),
        op_floor_bytes=core.op_floor_bytes,
    )
