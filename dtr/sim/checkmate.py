"""The optimal static schedule of a small trace: Checkmate's MILP (Jain et al., "Checkmate:
Breaking the Memory Wall with Optimal Tensor Rematerialization", MLSys 2020), solved by
HiGHS through ``scipy.optimize.milp`` under a time limit. It is the yardstick for DTR's
online heuristics: the least compute any static schedule of the same program needs at a
budget.

    g = checkmate.graph_of(dtr.sim.load("run.jsonl"))
    s = checkmate.solve(g, budget_bytes, time_limit=60)
    s.status, s.overhead, s.gap             # "optimal" | "time_limit" | "infeasible" | ...

The graph (``graph_of``), as the paper's simulator built it (``rewrite_checkmate``): one
node per op in program order (a topological order); an op with several fresh outputs is
one node holding their sum; views are no node (they share their base's storage, so they
are collapsed into the node they alias, and an op that makes only views costs its cost
once, as a fixed term); constants are no node either: their bytes are resident
throughout and count against the budget. In-place updates (prototype MUTATEs, live
VERSIONs) are copies, as the paper's simulator made them: a node holding a new storage.

The MILP, over stages t = 1..n where stage t first computes node t (frontier-advancing):

- binary R[t,i]: node i is computed in stage t; R[t,t] = 1, R lower triangular;
- binary S[t,i]: node i's output is kept from stage t-1 into t; S strictly lower triangular,
  S[t+1,i] <= R[t,i] + S[t,i];
- R[t,j] <= R[t,i] + S[t,i] for every edge i -> j (inputs present when a node runs);
- memory, the paper's accounting: U[t,k] is what is resident once stage t has run node k
  (its inputs, its output and all that is kept), U[t,0] = sum_i M_i S[t,i] + M_0 R[t,0],
  U[t,k+1] = U[t,k] + M_{k+1} R[t,k+1] - sum_{i in deps(k) + {k}} M_i FREE[t,i,k], and
  0 <= U[t,k] <= budget - constant bytes. Binary FREE[t,i,k] = R[t,k] (1 - S[t+1,i])
  prod_{j in users(i), k < j <= t} (1 - R[t,j]): a value is freed right after its last use
  in the stage unless it is kept for the next one, linearized with the hazard count as
  the paper does (1 - FREE <= hazards <= kappa (1 - FREE)).

Objective: minimize sum R[t,i] cost_i, the first computation of each node included.

What the optimum is optimal over: schedules that first compute nodes in program order,
recompute a node at most once between two first computations, run each stage in index
order and free values at their last use in a stage; with no workspace, views free, and
in-place updates as copies. A kept value no later stage uses is counted until its stage
ends (the paper's accounting; ``validate`` frees it at once, so it is the laxer check).
So the optimum bounds DTR from below only on programs this model fits exactly, such as
chains. On real traces it is no bound: an op's outputs are one node, kept or dropped
together, where DTR evicts each output on its own (an LSTM cell's hy, cy and workspace),
and in-place updates cost a copy's memory; bench/checkmate.py shows the MILP infeasible
at budgets where DTR runs.
"""

from __future__ import annotations

import dataclasses
import math
import time

import numpy as np
from scipy import sparse
from scipy.optimize import Bounds, LinearConstraint, milp

from ..core.reference import FOLLOW, NEW, VERSION, VIEW
from ..errors import DTRError
from . import program as P
from .parse import TraceError

MAX_NODES = 60  # the MILP has ~3 n^2 binaries plus the FREE ones; past this it crawls

__all__ = ["Graph", "Schedule", "ScheduleError", "graph_of", "solve", "validate", "MAX_NODES"]


class ScheduleError(DTRError, ValueError):
    """A schedule that does not run: an input missing, or the budget exceeded."""


@dataclasses.dataclass(frozen=True)
class Graph:
    costs: np.ndarray  # float64, per node
    nbytes: np.ndarray  # int64, per node: the bytes of its fresh outputs
    deps: tuple[tuple[int, ...], ...]  # the nodes producing its arguments, all < the node
    const_bytes: int = 0  # constants: resident throughout
    fixed_cost: float = 0.0  # ops that are no node (views only, no results): run once
    name: str = ""

    @property
    def n(self) -> int:
        return len(self.costs)

    @property
    def total_cost(self) -> float:
        """Every op once: what overheads are relative to (the Program's baseline)."""
        return float(self.costs.sum()) + self.fixed_cost

    def users(self) -> list[list[int]]:
        out: list[list[int]] = [[] for _ in range(self.n)]
        for j, deps in enumerate(self.deps):
            for i in deps:
                out[i].append(j)
        return out


@dataclasses.dataclass
class Schedule:
    status: str  # "optimal", "time_limit" (feasible, not proven), "infeasible", "unknown"
    # (HiGHS stopped otherwise: with no schedule found in time, or on a numerical failure)
    compute: float  # sum R[t,i] cost_i + the graph's fixed cost (nan: no schedule)
    baseline: float  # the graph's total cost
    gap: float  # HiGHS's relative MIP gap at the end (nan: no schedule)
    bound: float  # HiGHS's lower bound on the optimal compute (nan: no schedule)
    R: np.ndarray | None  # bool [stage, node]
    S: np.ndarray | None  # bool [stage, node]
    budget_bytes: int
    seconds: float

    @property
    def feasible(self) -> bool:
        return self.R is not None

    @property
    def overhead(self) -> float:
        return self.compute / self.baseline if self.baseline else 1.0


# ---------------------------------------------------------------------- the graph


class _Builder:
    """Walks a Program's instructions, mapping each slot to the node that holds its
    storage (-1: a constant, always resident)."""

    def __init__(self, nslots: int):
        self.node = [-1] * nslots
        self.storage = [0] * nslots  # bytes of each slot's storage
        self.costs: list[float] = []
        self.nbytes: list[int] = []
        self.deps: list[tuple[int, ...]] = []
        self.const_bytes = 0
        self.fixed_cost = 0.0

    def add(self, cost: float, args, nbytes: int, slots) -> None:
        k = len(self.costs)
        self.costs.append(float(cost))
        self.nbytes.append(int(nbytes))
        self.deps.append(tuple(sorted({self.node[a] for a in args if self.node[a] >= 0})))
        for s in slots:
            self.node[s] = k

    def const(self, slot: int, nbytes: int) -> None:
        self.node[slot], self.storage[slot] = -1, nbytes
        self.const_bytes += nbytes

    def copy(self, dst: int, src: int) -> None:
        self.node[dst], self.storage[dst] = self.node[src], self.storage[src]

    copy_from = copy

    def call(self, cost, args, results, fresh) -> None:
        new, total, later = [], 0, []
        for slot, kind, ref, nbytes in results:
            # a view of this call's result ref - len(args), or a follower of its version
            if kind in (VIEW, FOLLOW) and ref >= len(args):
                later.append((slot, results[ref - len(args)][0]))
                continue
            if kind == VIEW:  # collapsed into the node that holds the storage
                self.copy(slot, args[ref])
                continue
            if kind == VERSION and self.node[args[ref]] < 0:
                # An update of a constant (an optimizer step on a parameter): the
                # constant's bytes are already counted and it cannot be recomputed.
                self.copy(slot, args[ref])
                continue
            if kind == VERSION:  # an in-place update, as a copy of the storage
                nbytes = self.storage[args[ref]]
            elif kind != NEW:
                raise TraceError(f"dtr: unknown result kind {kind} in a CALL")
            self.storage[slot] = nbytes
            new.append(slot)
            total += nbytes
        if new:
            self.add(cost, args, total, new)
        else:
            self.fixed_cost += float(cost)
        for slot, src in later:
            self.copy(slot, src)

    def mutate(self, cost, args, pairs) -> None:
        fresh = []
        for m, slot in pairs:  # each written argument gets a fresh copy of its storage...
            if self.node[args[m]] < 0:  # ...unless it is a constant (see call())
                self.copy(slot, args[m])
            else:
                self.storage[slot] = self.storage[args[m]]
                fresh.append(slot)
        if fresh:
            self.add(cost, args, sum(self.storage[s] for s in fresh), fresh)
        else:
            self.fixed_cost += float(cost)


def graph_of(prog: P.Program, max_nodes: int = MAX_NODES) -> Graph:
    """Checkmate's graph of prog (see the module docstring).

    Raises:
        TraceError: the graph has more than max_nodes nodes (the MILP would not finish).
    """
    b = _Builder(prog.nslots)
    for ins in P.disassemble(prog):
        handler = getattr(b, ins[0].lower(), None)
        if handler is not None:  # RELEASE, INPUTS, READ...: Checkmate frees by liveness
            handler(*ins[1:])
    if len(b.costs) > max_nodes:
        raise TraceError(
            f"dtr: {prog.name or 'the trace'} has {len(b.costs)} ops after collapsing views, "
            f"more than max_nodes={max_nodes}; Checkmate's MILP is for small traces"
        )
    return Graph(
        costs=np.asarray(b.costs, dtype=np.float64),
        nbytes=np.asarray(b.nbytes, dtype=np.int64),
        deps=tuple(b.deps),
        const_bytes=b.const_bytes,
        fixed_cost=b.fixed_cost,
        name=prog.name,
    )


# ---------------------------------------------------------------------- the MILP


class _Columns:
    """Column numbers of the variables, lower-triangular entries only."""

    def __init__(self, g: Graph):
        self.R: dict = {}
        self.S: dict = {}
        self.F: dict = {}
        self.U: dict = {}
        for t in range(g.n):
            self._take(self.R, [(t, i) for i in range(t + 1)])
            self._take(self.S, [(t, i) for i in range(t)])
            self._take(self.F, [(t, i, k) for k in range(t) for i in (*g.deps[k], k)])
            self._take(self.U, [(t, k) for k in range(t + 1)])
        self.count = len(self.R) + len(self.S) + len(self.F) + len(self.U)

    def _take(self, table: dict, keys) -> None:
        start = len(self.R) + len(self.S) + len(self.F) + len(self.U)
        table.update((key, start + j) for j, key in enumerate(keys))


class _Rows:
    """A sparse constraint matrix, a row at a time."""

    def __init__(self):
        self.rows: list[int] = []
        self.cols: list[int] = []
        self.vals: list[float] = []
        self.lb: list[float] = []
        self.ub: list[float] = []

    def add(self, terms, lb: float, ub: float) -> None:
        row = len(self.lb)
        for col, val in terms:
            if val:
                self.rows.append(row)
                self.cols.append(col)
                self.vals.append(val)
        self.lb.append(lb)
        self.ub.append(ub)

    def constraint(self, ncols: int) -> LinearConstraint:
        shape = (len(self.lb), ncols)
        a = sparse.csr_array((self.vals, (self.rows, self.cols)), shape=shape)
        return LinearConstraint(a, self.lb, self.ub)


def _dependencies(g: Graph, x: _Columns, rows: _Rows) -> None:
    """R[t,j] <= R[t,i] + S[t,i]; and S[t+1,i] <= R[t,i] + S[t,i]."""
    for j, deps in enumerate(g.deps):
        for i in deps:
            for t in range(j, g.n):
                rows.add([(x.R[t, j], 1), (x.R[t, i], -1), (x.S[t, i], -1)], -np.inf, 0)
    for t in range(1, g.n):
        for i in range(t):
            prev = [(x.S[t - 1, i], -1)] if i < t - 1 else []
            rows.add([(x.S[t, i], 1), (x.R[t - 1, i], -1), *prev], -np.inf, 0)


def _frees(g: Graph, x: _Columns, rows: _Rows) -> None:
    """FREE[t,i,k] = 1 exactly when its hazard count is 0, where hazards = (1 - R[t,k])
    + S[t+1,i] + sum of R[t,j] over users j of i after k (the paper's linearization)."""
    users = g.users()
    for (t, i, k), f in x.F.items():
        h = [(x.R[t, k], -1)]  # hazards = 1 + h
        if t + 1 < g.n:
            h.append((x.S[t + 1, i], 1))
        h += [(x.R[t, j], 1) for j in users[i] if k < j <= t]
        kappa = len(h)  # the most hazards there can be
        rows.add([(f, -1)] + [(c, -v) for c, v in h], -np.inf, 0)  # 1 - FREE <= hazards
        rows.add([(f, kappa), *h], -np.inf, kappa - 1)  # hazards <= kappa (1 - FREE)


def _memory(g: Graph, x: _Columns, rows: _Rows, mem: np.ndarray) -> None:
    """U[t,0] and the recurrence U[t,k+1] = U[t,k] + M R[t,k+1] - freed after k."""
    for t in range(g.n):
        kept = [(x.S[t, i], -mem[i]) for i in range(t)]
        rows.add([(x.U[t, 0], 1), (x.R[t, 0], -mem[0]), *kept], 0, 0)
        for k in range(t):
            freed = [(x.F[t, i, k], mem[i]) for i in (*g.deps[k], k)]
            step = [(x.U[t, k + 1], 1), (x.U[t, k], -1), (x.R[t, k + 1], -mem[k + 1])]
            rows.add(step + freed, 0, 0)


def _no_schedule(status: str, g: Graph, budget: int, start: float) -> Schedule:
    nan = math.nan
    seconds = time.perf_counter() - start
    return Schedule(status, nan, g.total_cost, nan, nan, None, None, budget, seconds)


def solve(graph: Graph, budget_bytes: int, time_limit: float = 60.0) -> Schedule:
    """The least-compute schedule of graph within budget_bytes (constants included), by
    Checkmate's MILP under HiGHS, stopped after time_limit seconds (then the best schedule
    found, status "time_limit", with the gap HiGHS reached; "unknown" if none was)."""
    start = time.perf_counter()
    g = graph
    avail = budget_bytes - g.const_bytes
    if avail < 0:  # the constants alone exceed the budget
        return _no_schedule("infeasible", g, budget_bytes, start)
    if g.n == 0:
        none = np.zeros((0, 0), dtype=bool)
        fixed = g.fixed_cost
        return Schedule("optimal", fixed, fixed, 0.0, fixed, none, none, budget_bytes, 0.0)
    unit = float(max(int(g.nbytes.max()), 1))  # memory in units of the largest node
    mem = g.nbytes / unit
    x = _Columns(g)
    rows = _Rows()
    _dependencies(g, x, rows)
    _frees(g, x, rows)
    _memory(g, x, rows, mem)
    scale = float(g.costs.max()) or 1.0
    c = np.zeros(x.count)
    lb, ub = np.zeros(x.count), np.ones(x.count)
    integrality = np.ones(x.count)
    for (t, i), col in x.R.items():
        c[col] = g.costs[i] / scale
        lb[col] = 1.0 if i == t else 0.0  # the frontier advances: stage t runs node t
    u = list(x.U.values())
    ub[u], integrality[u] = avail / unit, 0
    res = milp(
        c,
        integrality=integrality,
        bounds=Bounds(lb, ub),
        constraints=[rows.constraint(x.count)],
        options={"time_limit": float(time_limit), "disp": False},
    )
    if res.x is None:
        status = "infeasible" if res.status == 2 else "unknown"
        return _no_schedule(status, g, budget_bytes, start)
    R, S = _matrices(g.n, x, res.x)
    compute = float((R * g.costs).sum()) + g.fixed_cost
    bound = getattr(res, "mip_dual_bound", None)
    return Schedule(
        status={0: "optimal", 1: "time_limit"}.get(res.status, "unknown"),
        compute=compute,
        baseline=g.total_cost,
        gap=float(getattr(res, "mip_gap", math.nan)),
        bound=compute if bound is None else min(compute, bound * scale + g.fixed_cost),
        R=R,
        S=S,
        budget_bytes=budget_bytes,
        seconds=time.perf_counter() - start,
    )


def _matrices(n: int, x: _Columns, sol: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    R = np.zeros((n, n), dtype=bool)
    S = np.zeros((n, n), dtype=bool)
    for (t, i), col in x.R.items():
        R[t, i] = sol[col] > 0.5
    for (t, i), col in x.S.items():
        S[t, i] = sol[col] > 0.5
    return R, S


# ---------------------------------------------------------------------- checking


def validate(schedule: Schedule, graph: Graph, budget: int) -> int:
    """Run schedule's R and S on graph independently of the MILP: stage by stage, nodes in
    index order, each value freed once nothing later in its stage reads it and the next
    stage does not keep it. Returns the peak bytes (constants included).

    Raises:
        ScheduleError: a node runs without an input, a kept value was not there to keep,
            a node never runs, the memory exceeds budget, or the compute is misreported.
    """
    R, S, n = schedule.R, schedule.S, graph.n
    if R is None or S is None:
        raise ScheduleError(f"dtr: no schedule to validate (status {schedule.status!r})")
    if R.shape != (n, n) or S.shape != (n, n):
        raise ScheduleError(f"dtr: R and S must be {n} x {n}, got {R.shape} and {S.shape}")
    peak = 0
    for t in range(n):
        held = (R[t - 1] | S[t - 1]) if t else np.zeros(n, dtype=bool)
        if (S[t] & ~held).any():
            i = int(np.flatnonzero(S[t] & ~held)[0])
            raise ScheduleError(f"dtr: stage {t} keeps node {i}, which stage {t - 1} lacks")
        keep = S[t + 1] if t + 1 < n else np.zeros(n, dtype=bool)
        peak = max(peak, _stage(graph, t, R[t], S[t], keep, budget))
    if not R.any(axis=0).all():
        raise ScheduleError(f"dtr: node {int(np.flatnonzero(~R.any(axis=0))[0])} never runs")
    compute = float((R * graph.costs).sum()) + graph.fixed_cost
    if not math.isclose(compute, schedule.compute, rel_tol=1e-9, abs_tol=1e-9):
        raise ScheduleError(f"dtr: the schedule computes {compute}, not {schedule.compute}")
    return peak


def _stage(g: Graph, t: int, run: np.ndarray, kept: np.ndarray, keep: np.ndarray, budget) -> int:
    """One stage: returns its peak bytes."""
    order = [int(k) for k in np.flatnonzero(run)]
    resident = {int(i) for i in np.flatnonzero(kept)}

    def drop_dead(pos: int) -> None:
        later = {i for j in order[pos:] for i in g.deps[j]}
        resident.intersection_update(later | {int(i) for i in np.flatnonzero(keep)})

    drop_dead(0)
    peak = 0
    for pos, k in enumerate(order):
        missing = [i for i in g.deps[k] if i not in resident]
        if missing:
            raise ScheduleError(f"dtr: stage {t} runs node {k} without its input {missing[0]}")
        # (a node recomputed while held counts twice: the new copy is a second buffer)
        now = g.const_bytes + sum(int(g.nbytes[i]) for i in resident) + int(g.nbytes[k])
        if now > budget:
            raise ScheduleError(
                f"dtr: stage {t} running node {k} holds {now} bytes, over the budget {budget}"
            )
        peak = max(peak, now)
        resident.add(k)
        drop_dead(pos + 1)
    return peak
