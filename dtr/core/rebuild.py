"""The rebuild protocol: sequences of core calls that the live runtime and the simulator
make the same way, so that a replayed trace reproduces a live run's decisions exactly.

The core's choices depend on the order of every call (ids are reused in the order they
are drained; staleness follows the clock), so these algorithms are written once, here.
``csrc/core/rebuild.h`` is their compiled twin (the simulator's replay loop, csrc/core/replay.cpp,
the fast path and the native engine use it); tests compare each with the Python twin.
"""

from __future__ import annotations

import contextlib

import torch

from ..errors import InternalError

# The range each recipe's rerun gets in torch.profiler (csrc/core/rebuild.h's kRematRange), so
# that time spent recomputing shows apart from the ops the program asked for.
REMAT_RANGE = "dtr::remat"


def remat_range():
    """A profiler range around one rerun while a profiler records (else nothing to pay)."""
    if torch._C._autograd._profiler_enabled():
        return torch.autograd.profiler.record_function(REMAT_RANGE)
    return contextlib.nullcontext()


class Rebuilder:
    """Base of ``dtr.engines.subclass.runtime.Runtime`` and ``dtr.sim.replay.Replay``.
    Subclasses say how a recipe is rerun, what happens when the budget cannot be met, and
    what draining the core means for them."""

    core = None

    def drain(self) -> None:
        self.core.drain()

    def rerun(self, rid: int, stolen: list[int]) -> list[int]:
        """Rerun recipe rid (its inputs are materialized and locked); return the
        measured storage size of each output, or [] to keep the recorded sizes."""
        return []

    def out_of_budget(self, rid: int, need: int) -> Exception:
        """The exception to raise when no victim frees the `need` bytes rid needs."""
        raise NotImplementedError

    def after_rerun(self) -> None:
        """Called after each recomputation (the simulator checks its recompute cap)."""

    def rematerialize(self, tid: int) -> None:
        """Rerun the recipes that rebuild tid, in the order the core schedules them
        (Invariant 7: iterative). The caller holds tid locked."""
        core = self.core
        core.remat_begin(tid)
        finished = False
        try:
            while True:
                rid = core.remat_step()
                if rid < 0:
                    break
                need = core.remat_bytes(rid)
                if not core.make_room(need):
                    raise self.out_of_budget(rid, need)
                self.drain()
                stolen = core.steals(rid)
                with remat_range():
                    nbytes = self.rerun(rid, stolen)
                core.remat_done(rid, nbytes, stolen)
                self.after_rerun()
            finished = True
        finally:
            if not finished:
                core.remat_abort()
            self.drain()

    def invalidate(self, seeds: list[int]) -> None:
        """seeds are about to be written in place without keeping their lineage: every
        tensor the program holds whose lineage reads them is materialized now and
        pinned, and lineage nobody needs any more is dropped (Invariants 3 and 4)."""
        core = self.core
        todo = list(seeds) + core.descendants(seeds)
        held: list[int] = []
        try:
            # Until every held tensor is resident: rebuilding one may evict another that
            # was resident when it was checked (it was not locked then), and a held
            # tensor must be materialized before it is pinned. Each extra pass locks at
            # least one more tensor, so this ends; with no such eviction it is one pass
            # and the core sees the same calls as before (csrc/core/replay.cpp's twin).
            again = True
            while again:
                again = False
                for t in todo:
                    if core.ext(t) > 0 and not core.is_materialized(t) and not core.is_constant(t):
                        if t in held:
                            raise InternalError(f"dtr: locked tensor {t} was evicted")
                        core.lock(t)
                        held.append(t)
                        self.rematerialize(t)
                        again = True
            for t in todo:
                core.pin(t)
        finally:
            for t in held:
                core.unlock(t)
            self.drain()
