"""A trace compiled for replay: a flat stream of integers, so that the C++ replay loop and
its Python twin read the same thing.

Tensors are named by *slots*: one per name in the trace (a prototype ``MUTATE`` rebinds a
name to a new slot). Instructions, each an opcode followed by its operands:

=============  ============================================================================
CONST          slot, nbytes
COPY           dst, src                        (a new handle on src's tensor)
RELEASE        slot
CALL           cost index, n, args..., m, (slot, kind, arg index, nbytes) x m, f, fresh...
               (kind FOLLOW: a pool version's follower, after the others; the core makes it)
MUTATE         cost index, n, args..., m, (arg index, new slot) x m        (prototype)
COPY_FROM      dst, src                        (dst's handle moves to src's tensor)
INPUTS         n, slots...                     (live: lock and materialize)
RESERVE        nbytes                          (live: make room for an op's outputs)
BUDGET         nbytes or -1                    (live: session.set_budget())
INVALIDATE     n, slots...                     (live)
READ           slot
EXPORT         slot
EXPORT_VERSION slot, new slot                  (live: read, then a pinned new version)
BACKWARD
END
=============  ============================================================================
"""

from __future__ import annotations

import dataclasses

import numpy as np

CONST, COPY, RELEASE, CALL, MUTATE, COPY_FROM, INPUTS, INVALIDATE, READ, EXPORT = range(10)
BACKWARD, END, RESERVE, BUDGET, EXPORT_VERSION = 10, 11, 12, 13, 14

# Replay semantics: the paper's simulator (evict before an op for its outputs, in-place
# updates as copies), or dtr's live runtime (evict after an op, in-place updates as
# versions), which is what a trace dtr wrote was made with.
PROTOTYPE, LIVE = 0, 1


@dataclasses.dataclass
class Program:
    code: np.ndarray  # int64
    costs: np.ndarray  # float64, indexed by CALL/MUTATE cost index
    nslots: int
    mode: int
    baseline: float  # total cost of the trace's ops, run once each
    ops: int  # CALL + MUTATE instructions
    name: str = ""
    meta: dict = dataclasses.field(default_factory=dict)
    # The unconstrained replay's peak, filled by dtr.sim.peak. Kept on the program (not
    # in a table keyed by id(), whose keys a later program can reuse once this one dies).
    peak_bytes: int | None = dataclasses.field(default=None, repr=False, compare=False)
    # Where the code has a BUDGET instruction (session.set_budget() in the live run).
    budget_at: tuple[int, ...] = ()

    def with_fixed_budget(self) -> Program:
        """This program without its BUDGET instructions (itself if it has none): a
        replay at another budget than the trace's keeps its own throughout."""
        if not self.budget_at:
            return self
        drop = [pc + k for pc in self.budget_at for k in (0, 1)]
        return dataclasses.replace(self, code=np.delete(self.code, drop), budget_at=())


NAMES = {
    CONST: "CONST",
    COPY: "COPY",
    RELEASE: "RELEASE",
    CALL: "CALL",
    MUTATE: "MUTATE",
    COPY_FROM: "COPY_FROM",
    INPUTS: "INPUTS",
    INVALIDATE: "INVALIDATE",
    READ: "READ",
    EXPORT: "EXPORT",
    BACKWARD: "BACKWARD",
    END: "END",
    RESERVE: "RESERVE",
    BUDGET: "BUDGET",
    EXPORT_VERSION: "EXPORT_VERSION",
}


def disassemble(prog: Program) -> list[tuple]:
    """The instructions as (name, operands...) tuples, for tests and debugging."""
    code, out, pc = prog.code.tolist(), [], 0
    while pc < len(code):
        op = code[pc]
        if op in (CONST, COPY, COPY_FROM, EXPORT_VERSION):
            out.append((NAMES[op], code[pc + 1], code[pc + 2]))
            pc += 3
        elif op in (RELEASE, READ, EXPORT, RESERVE, BUDGET):
            out.append((NAMES[op], code[pc + 1]))
            pc += 2
        elif op in (INPUTS, INVALIDATE):
            k = code[pc + 1]
            out.append((NAMES[op], tuple(code[pc + 2 : pc + 2 + k])))
            pc += 2 + k
        elif op == CALL:
            cost, nargs = prog.costs[code[pc + 1]], code[pc + 2]
            args = tuple(code[pc + 3 : pc + 3 + nargs])
            pc += 3 + nargs
            nres = code[pc]
            res = tuple(tuple(code[pc + 1 + 4 * j : pc + 5 + 4 * j]) for j in range(nres))
            pc += 1 + 4 * nres
            nfresh = code[pc]
            fresh = tuple(code[pc + 1 : pc + 1 + nfresh])
            pc += 1 + nfresh
            out.append(("CALL", cost, args, res, fresh))
        elif op == MUTATE:
            cost, nargs = prog.costs[code[pc + 1]], code[pc + 2]
            args = tuple(code[pc + 3 : pc + 3 + nargs])
            pc += 3 + nargs
            nmut = code[pc]
            pairs = tuple(tuple(code[pc + 1 + 2 * j : pc + 3 + 2 * j]) for j in range(nmut))
            pc += 1 + 2 * nmut
            out.append(("MUTATE", cost, args, pairs))
        elif op in (BACKWARD, END):
            out.append((NAMES[op],))
            pc += 1
        else:
            raise ValueError(f"dtr: bad opcode {op} at {pc}")
    return out
