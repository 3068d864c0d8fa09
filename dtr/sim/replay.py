"""Replays a Program against a core: the Python twin of ``csrc/core/replay.cpp``.

The driver makes the same core calls, in the same order, as the live runtime
(``dtr/engines/subclass/runtime.py``) made when it wrote the trace (LIVE mode), or as the paper's
simulator did (PROTOTYPE mode). Keep it in step with the C++ loop: tests run both on the same traces
and compare every counter and the eviction log.
"""

from __future__ import annotations

import dataclasses
import time

from ..core.rebuild import Rebuilder
from ..core.reference import FOLLOW, NEW, VERSION
from . import program as P
from .parse import TraceError


class _Stop(Exception):
    def __init__(self, status: str):
        self.status = status


@dataclasses.dataclass
class Result:
    status: str  # "ok", "oom" (the budget cannot be met) or "thrash" (remat cap hit)
    budget_bytes: int  # -1: unlimited
    peak_bytes: int  # largest resident count (at any point)
    evictions: int
    remats: int
    remat_cost: float
    baseline: float
    ops: int
    seconds: float
    eviction_log: list[int] | None = None

    @property
    def feasible(self) -> bool:
        return self.status == "ok"

    @property
    def overhead(self) -> float:
        """Total compute / the compute of running each op once."""
        return (self.baseline + self.remat_cost) / self.baseline if self.baseline else 1.0

    @classmethod
    def of(
        cls, core, prog: P.Program, status: str, seconds: float, log: bool, budget: int
    ) -> Result:
        """The result of a replay that left core in its final state; budget: the one it
        ran under (a replay that reaches the end lifts the core's, as the runtime does
        when its block ends)."""
        return cls(
            status=status,
            budget_bytes=budget,
            peak_bytes=core.max_bytes,
            evictions=core.evictions,
            remats=core.remats,
            remat_cost=core.remat_cost,
            baseline=prog.baseline,
            ops=prog.ops,
            seconds=seconds,
            eviction_log=core.eviction_log() if log else None,
        )

    def as_dict(self) -> dict:
        return {
            "status": self.status,
            "feasible": self.feasible,
            "overhead": self.overhead,
            "evictions": self.evictions,
            "remats": self.remats,
            "peak_bytes": self.peak_bytes,
            "budget_bytes": self.budget_bytes,
            "seconds": self.seconds,
            "ops": self.ops,
            "remat_cost": self.remat_cost,
            "baseline": self.baseline,
        }


class Replay(Rebuilder):
    def __init__(self, prog: P.Program, core, stress: bool = False, thrash: float = 2.0):
        self.prog = prog
        self.core = core
        self.stress = stress
        # Recomputation may cost at most (thrash - 1) x the baseline (the paper's 2x cap).
        self.limit = (thrash - 1.0) * prog.baseline if thrash > 0 else float("inf")
        self.slots = [-1] * prog.nslots
        self.locked: list[int] = []

    def run(self) -> str:
        try:
            self._loop()
            return "ok"
        except _Stop as stop:
            return stop.status

    # ------------------------------------------------------------------ driver hooks
    def out_of_budget(self, rid: int, need: int) -> Exception:
        return _Stop("oom")

    def after_rerun(self) -> None:
        if self.core.remat_cost > self.limit:
            raise _Stop("thrash")

    # ------------------------------------------------------------------ the loop
    def _loop(self) -> None:
        code, costs, slots, core = self.prog.code.tolist(), self.prog.costs, self.slots, self.core
        live = self.prog.mode == P.LIVE
        pc, n = 0, len(code)
        while pc < n:
            op = code[pc]
            if op == P.CONST:
                slots[code[pc + 1]] = core.new_constant(code[pc + 2])
                pc += 3
            elif op == P.COPY:
                slots[code[pc + 1]] = slots[code[pc + 2]]
                core.retain(slots[code[pc + 2]])
                pc += 3
            elif op == P.RELEASE:
                t = slots[code[pc + 1]]
                # The paper's simulator kept constants resident for the whole step.
                if live or not core.is_constant(t):
                    core.release(t)
                pc += 2
            elif op == P.CALL:
                pc = self._call(code, pc, costs, live)
            elif op == P.MUTATE:
                pc = self._mutate(code, pc, costs)
            elif op == P.COPY_FROM:
                old = slots[code[pc + 1]]
                slots[code[pc + 1]] = slots[code[pc + 2]]
                core.retain(slots[code[pc + 2]])
                core.release(old)
                pc += 3
            elif op == P.INPUTS:
                k = code[pc + 1]
                tids = [slots[s] for s in code[pc + 2 : pc + 2 + k]]
                for t in tids:
                    core.lock(t)
                    self.locked.append(t)
                for t in tids:
                    self.rematerialize_if_needed(t)
                pc += 2 + k
            elif op == P.RESERVE:
                # the live runtime made room for an op's outputs before running it
                if 0 <= core.budget < core.resident_bytes + code[pc + 1]:
                    core.make_room(code[pc + 1])
                pc += 2
            elif op == P.INVALIDATE:
                k = code[pc + 1]
                self.invalidate([slots[s] for s in code[pc + 2 : pc + 2 + k]])
                pc += 2 + k
            elif op in (P.READ, P.EXPORT):
                t = slots[code[pc + 1]]
                self.read(t)
                if op == P.EXPORT:
                    core.pin(t)
                core.drain()
                pc += 2
            elif op == P.EXPORT_VERSION:
                t = slots[code[pc + 1]]
                self.read(t)
                (new,) = core.record([t], 0.0, [VERSION], [t], [0])
                slots[code[pc + 2]] = new
                core.pin(new)
                core.drain()
                pc += 3
            elif op == P.BUDGET:  # session.set_budget() in the live run, from here on
                core.budget = code[pc + 1]
                pc += 2
            elif op == P.BACKWARD:
                pc += 1
            elif op == P.END:
                self._end(live)
                pc += 1
            else:
                raise ValueError(f"dtr: bad opcode {op} at {pc}")
            core.drain()

    def _call(self, code, pc, costs, live: bool) -> int:
        core, slots = self.core, self.slots
        cost = costs[code[pc + 1]]
        nargs = code[pc + 2]
        args = [slots[s] for s in code[pc + 3 : pc + 3 + nargs]]
        pc += 3 + nargs
        nres = code[pc]
        body = code[pc + 1 : pc + 1 + 4 * nres]
        pc += 1 + 4 * nres
        nfresh = code[pc]
        fresh = [slots[s] for s in code[pc + 1 : pc + 1 + nfresh]]
        pc += 1 + nfresh
        # the results before a pool version's followers, which the core makes itself
        declared = sum(1 for k in body[1::4] if k != FOLLOW)
        kinds = body[1 : 4 * declared : 4]
        # an argument's position, or nargs + j for this call's result j (core: -(j + 1))
        refs = [
            args[r] if 0 <= r < nargs else nargs - r - 1 if r >= nargs else -1
            for r in body[2 : 4 * declared : 4]
        ]
        nbytes = body[3 : 4 * declared : 4]
        if not live:
            extra = sum(b for k, b in zip(kinds, nbytes) if k == NEW)
            outs = self._prototype_op(args, cost, kinds, refs, nbytes, lambda: extra)
            for s, t in zip(body[0::4], outs):
                slots[s] = t
            return pc
        outs = core.record(args, cost, kinds, refs, nbytes) if declared else []
        if len(outs) != nres:
            raise TraceError(
                f"dtr: a CALL names {nres - declared} followers of a pool version where the "
                f"replay made {len(outs) - declared}"
            )
        core.drain()
        for s, t in zip(body[0::4], outs):
            slots[s] = t
        locked, self.locked = self.locked, []
        for t in locked:
            core.unlock(t)
        for t in fresh:
            core.release(t)
        protect = [t for t, k in zip(outs, kinds) if k != VERSION]
        for t in protect:
            core.lock(t)
        ok = core.make_room(0)
        for t in protect:
            core.unlock(t)
        if not ok:
            raise _Stop("oom")
        if self.stress:
            core.evict_all()
        return pc

    def _mutate(self, code, pc, costs) -> int:
        core, slots = self.core, self.slots
        cost = costs[code[pc + 1]]
        nargs = code[pc + 2]
        args = [slots[s] for s in code[pc + 3 : pc + 3 + nargs]]
        pc += 3 + nargs
        nmut = code[pc]
        pairs = code[pc + 1 : pc + 1 + 2 * nmut]
        pc += 1 + 2 * nmut
        written = [args[m] for m in pairs[0::2]]
        nbytes: list[int] = []

        def room() -> int:  # each written argument gets a fresh copy of its storage
            nbytes.extend(core.pool_bytes(t) for t in written)
            return sum(nbytes)

        outs = self._prototype_op(args, cost, [NEW] * nmut, [-1] * nmut, nbytes, room)
        for s, t in zip(pairs[1::2], outs):
            slots[s] = t
        for t in written:  # the name now means the new tensor
            core.release(t)
        return pc

    def _prototype_op(self, args, cost, kinds, refs, nbytes, room) -> list[int]:
        """The paper's semantics for one op: lock and materialize its inputs, make room
        for its fresh outputs first (room() bytes), then record it."""
        core = self.core
        for t in args:
            core.touch(t)  # the paper's simulator stamped an op's inputs as it began
            core.lock(t)
        try:
            for t in args:
                self.rematerialize_if_needed(t)
            if not core.make_room(room()):
                raise _Stop("oom")
            core.drain()
            outs = core.record(args, cost, kinds, refs, nbytes) if kinds else []
        finally:
            for t in args:
                core.unlock(t)
        core.make_room(0)
        return outs

    def read(self, tid: int) -> None:
        """The program reads tid (READ, EXPORT): rebuilt if evicted, locked meanwhile."""
        self.core.lock(tid)
        try:
            self.rematerialize_if_needed(tid)
        finally:
            self.core.unlock(tid)

    def rematerialize_if_needed(self, tid: int) -> None:
        if not self.core.is_materialized(tid):
            self.rematerialize(tid)

    def _end(self, live: bool) -> None:
        core = self.core
        if live:  # the block ended: the budget is lifted and held tensors materialized
            core.budget = -1
        for t in core.alive():
            core.lock(t)
            try:
                self.rematerialize_if_needed(t)
            finally:
                core.unlock(t)
            if not live:  # the paper's simulator pinned what the step left alive
                core.pin(t)
        if not live and not core.make_room(0):
            raise _Stop("oom")


def replay(
    prog: P.Program, core, stress: bool = False, thrash: float = 2.0, log: bool = False
) -> Result:
    """Replay prog on core (a fresh Core or PyCore with its heuristic and budget set)."""
    if log:
        core.log_evictions(True)
    start, budget = time.perf_counter(), core.budget
    status = Replay(prog, core, stress, thrash).run()
    return Result.of(core, prog, status, time.perf_counter() - start, log, budget)
