"""The op-level floor of a trace: the least memory any schedule of its ops needs.

Whatever is evicted and recomputed, each op runs with its inputs resident and its fresh
outputs allocated, next to the constants alive at that moment (parameters, the batch).
The floor is the largest such sum over the trace's ops: no budget below it can be met
by rematerialization. Values dtr pinned while tracing (lineage cut by an in-place write)
count only where an op reads them: a better runtime need not pin them. Kernels' own
workspaces are left out (traces do not record them).
"""

from __future__ import annotations

from ..core.reference import NEW, PyCore
from . import program as P
from .replay import Replay


class _FloorReplay(Replay):
    """An unconstrained replay (nothing is evicted) that measures each op's need before
    recording it: the constants, the distinct pools its other arguments live in, and its
    fresh outputs."""

    floor = 0

    def _call(self, code, pc, costs, live: bool) -> int:
        nargs = code[pc + 2]
        args = [self.slots[s] for s in code[pc + 3 : pc + 3 + nargs]]
        nres = code[pc + 3 + nargs]
        body = code[pc + 4 + nargs : pc + 4 + nargs + 4 * nres]
        fresh = sum(b for k, b in zip(body[1::4], body[3::4]) if k == NEW)
        core = self.core
        pools = {core.pool_of(t): t for t in args if not core.is_constant(t)}
        need = core.constant_bytes() + sum(core.pool_bytes(t) for t in pools.values()) + fresh
        self.floor = max(self.floor, need)
        return super()._call(code, pc, costs, live)


def op_floor(prog: P.Program) -> int:
    """The op-level floor of prog in bytes (see the module's docstring)."""
    core = PyCore("dtr", -1, 0)
    core.request_stamps = prog.mode == P.PROTOTYPE
    replay = _FloorReplay(prog.with_fixed_budget(), core)
    status = replay.run()
    if status != "ok":  # (an unconstrained replay cannot run out)
        raise RuntimeError(f"dtr: the unconstrained replay of {prog.name} ended {status}")
    return replay.floor
