"""Memory over time: one row per op boundary, for plots of a training step.

``dtr.enable(..., timeline=True)`` keeps the newest rows (``timeline=N`` keeps N); read
them with ``session.timeline()`` and draw them with :func:`dtr.plot.memory_timeline`.
Each row is taken where the runtime settles an op (after it ran, before and after
evicting to fit the budget), so the two byte columns bracket what eviction freed.
"""

from __future__ import annotations

import collections
import dataclasses

COLUMNS = (
    "op",  # ops recorded so far (the core's counter)
    "name",  # the aten overload, e.g. "aten.mm.default"
    "backward",  # True while autograd's engine runs (a backward pass)
    "before_bytes",  # resident bytes with the op's outputs, before eviction
    "resident_bytes",  # resident bytes once the op boundary is settled
    "evictions",  # cumulative, as in Stats
    "remats",  # cumulative, as in Stats
)


@dataclasses.dataclass(frozen=True)
class Timeline:
    """Column-wise rows (lists of equal length, oldest first); ``budget_bytes`` is the
    budget at the time the timeline was read (None: unlimited)."""

    op: list[int]
    name: list[str]
    backward: list[bool]
    before_bytes: list[int]
    resident_bytes: list[int]
    evictions: list[int]
    remats: list[int]
    budget_bytes: int | None = None

    def __len__(self) -> int:
        return len(self.op)

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)

    def rows(self) -> list[dict]:
        """One dict per op boundary (for csv.DictWriter, pandas.DataFrame, ...)."""
        cols = [getattr(self, c) for c in COLUMNS]
        return [dict(zip(COLUMNS, values)) for values in zip(*cols)]


class Recorder:
    """Keeps the newest ``limit`` rows; the runtime calls :meth:`add` at each op boundary."""

    def __init__(self, limit: int):
        self._rows: collections.deque = collections.deque(maxlen=limit)

    def add(self, core, name: str, backward: bool, before: int) -> None:
        self._rows.append(
            (core.ops, name, backward, before, core.resident_bytes, core.evictions, core.remats)
        )

    def snapshot(self, budget_bytes: int | None) -> Timeline:
        cols = list(zip(*self._rows)) if self._rows else [() for _ in COLUMNS]
        return Timeline(*(list(c) for c in cols), budget_bytes=budget_bytes)
