"""Pure-Python twin of the C++ bookkeeping core (``csrc/core/core.cpp``).

This is the reference implementation: every decision the C++ core makes (which pool to
evict, what to recompute, when lineage is dropped) must be made identically here, and the
core tests drive both with the same event sequences and compare. Keep the two files in
step; the algorithms are written in the same order so that floating-point sums agree bit
for bit.

The core knows nothing about torch. It holds three kinds of records, all addressed by
small integers that are reused after the driver has drained them:

* **tensor** (tid): one immutable value. Its producing recipe, the pool holding its
  storage, how many external handles (``ext``) the program holds, lock count, and
  whether the value is currently materialized.
* **pool** (pid): one storage, the unit of eviction and of accounting. All views of a
  storage are members of one pool; a pool is resident or evicted as a whole.
* **recipe** (rid): one op call. Its inputs, its outputs (shared by all of them), its
  cost. Recomputing it refills every kept output.

See ``docs/design.md`` for the numbered invariants that the comments cite.
"""

from __future__ import annotations

import math
import time

from ..errors import BudgetError
from ..units import format_bytes

HEURISTICS = (
    "dtr",
    "dtr_eq",
    "dtr_local",
    "lru",
    "size",
    "msps",
    "random",
    "msps_sqrt",
    "dtr_held",
    "dtr_held34",
)
# What dtr.enable() evicts by when no heuristic is given: the paper's h_DTR with the
# neighbourhood the program still holds (docs/heuristics.md gives the measurements).
DEFAULT_HEURISTIC = "dtr_held"

# The thrash stop's smallest allowance, in ops (Core.thrash; csrc/core/core.h kThrashFloor).
THRASH_FLOOR = 1000

# Output kinds for record(): a fresh storage, a view of an input, or a new version of a
# tensor mutated in place (Invariant 4: the old value keeps its lineage).
NEW, VIEW, VERSION = 0, 1, 2
# A trace's kind, never given to record(): a pool version's follower, which record() makes
# itself (_follow), named by the trace after the declared outputs.
FOLLOW = 3

_MASK64 = (1 << 64) - 1


class CoreError(RuntimeError):
    """A request the core cannot serve (e.g. recomputing a tensor with no recipe)."""


class _Tensor:
    __slots__ = ("pool", "recipe", "ext", "lock", "born", "mat", "consumers")

    def __init__(self, pool: int, recipe: int, ext: int, mat: bool, born: int):
        self.pool = pool
        self.recipe = recipe
        self.ext = ext
        self.lock = 0
        self.born = born  # the step it was recorded in (end_step)
        self.mat = mat
        self.consumers: list[int] = []


class _Pool:
    __slots__ = (
        "nbytes",
        "resident",
        "constant",
        "pinned",
        "members",
        "alive",
        "locks",
        "last_access",
        "cost",
        "uf",
        "doomed",
        "slot",
    )

    def __init__(self, nbytes: int, resident: bool, constant: bool, now: float):
        self.nbytes = nbytes
        self.resident = resident
        self.constant = constant
        self.pinned = 0  # kept members without a recipe: the pool cannot be evicted
        self.members: list[int] = []
        self.alive = 0  # members with ext > 0
        self.locks = 0  # sum of member locks
        self.last_access = now
        self.cost = 0.0  # sum of the distinct recipes of its members
        self.uf = -1  # union-find node while evicted (dtr_eq)
        # The program dropped its last handle while the pool could not be evicted (locked,
        # or holding an unrecomputable member): evict as soon as it can be (Invariant 5).
        self.doomed = False
        self.slot = -1  # index in PyCore._cands while resident and not constant


class _Frame:
    __slots__ = ("tid", "locks", "seen")

    def __init__(self, tid: int):
        self.tid = tid
        self.locks: list[int] = []
        self.seen = False  # its recipe's inputs were stamped (request_stamps)


class _Recipe:
    __slots__ = ("inputs", "outputs", "nbytes", "version_of", "cost", "kept", "pool_version")

    def __init__(self, inputs: list[int], cost: float):
        self.inputs = inputs
        self.outputs: list[int] = []
        self.nbytes: list[int] = []  # bytes of each fresh output storage (0 for views)
        self.version_of: list[int] = []  # per output: the tensor it updated in place, or -1
        self.cost = cost
        self.kept = 0
        self.pool_version = False  # it has followers (_follow)


class PyCore:
    """Bookkeeping, heuristics and victim selection. Same interface as ``dtr._C.Core``."""

    def __init__(
        self, heuristic: str = "dtr", budget: int = -1, seed: int = 0, min_evict_bytes: int = 0
    ):
        if heuristic not in HEURISTICS:
            raise CoreError(f"dtr: unknown heuristic {heuristic!r}")
        self.heuristic = heuristic
        self._h = HEURISTICS.index(heuristic)
        self.budget = int(budget)
        self.min_evict_bytes = int(min_evict_bytes)
        self._rng = seed & _MASK64
        self._T: list[_Tensor | None] = []
        self._P: list[_Pool | None] = []
        self._R: list[_Recipe | None] = []
        self._free_t: list[int] = []
        self._free_p: list[int] = []
        self._free_r: list[int] = []
        # Ids dropped since the last drain(); reused only after the driver has seen them.
        self._dropped_t: list[int] = []
        self._dropped_r: list[int] = []
        self._dropped_p: list[int] = []
        self._evicted: list[int] = []  # tensors whose values the driver must release
        self._uf_parent: list[int] = []
        self._uf_cost: list[float] = []
        self._evicted_pools = 0
        self._frames: list[_Frame] = []
        self._followed: list[int] = []  # see followed()
        self._log: list[int] | None = None
        # Resident, non-constant pools: the only possible victims, kept as a dense list
        # (swap-remove, the same order in the C++ core) so that victim search never walks
        # evicted or freed pools, and can sample (see _choose).
        self._cands: list[int] = []
        # The paper's simulator's clock for staleness: a pool is stamped when an op (or a
        # rerun) that reads it is requested, and when an op creates it; never by a lock,
        # nor by a rerun finishing. False: dtr's own (stamp on lock, record, rerun).
        self.request_stamps = False
        self.search_sample = 0  # > 0: score this many sampled candidates when there are more
        self.search_seconds = 0.0  # time spent choosing victims
        self.now = 0.0
        self.resident_bytes = 0
        self.peak_bytes = 0
        self.max_bytes = 0  # including the transient outputs of an op before eviction
        self.ops = 0
        self.remats = 0
        self.remat_cost = 0.0
        self.evictions = 0
        self.eager_evictions = 0
        self.step = 0  # steps closed by end_step()
        # The thrash stop (docs/design.md, "Thrash stop"): with thrash > 1, a step reruns at
        # most (thrash - 1) x max(its ops so far, the previous step's ops, THRASH_FLOOR)
        # recipes, and remat_step raises BudgetError rather than start one more. 0: no stop.
        self.thrash = 0.0
        # ops and remats when the step began; the previous step's ops and peak (-1: none)
        self._step_ops = self._step_remats = 0
        self._prev_ops = self._prev_peak = -1
        self._step_evictions = self._step_max = 0  # evictions when the step began; its max
        self._const_bytes = 0  # constant_bytes(), kept as pools come and go
        # The op-level floor, live (dtr.sim.floor's): no budget below the constants plus
        # what one op has resident at once (its distinct inputs and its fresh outputs) can
        # run it; kernels' own buffers are left out (Core in csrc/core/core.h says why). last_need:
        # the last recorded call's; op_floor_bytes: the largest so far, set by floor_op in
        # step floor_step, floor_need_bytes of it the op's own; step_floor_bytes: this
        # step's.
        self.last_need = 0
        self.op_floor_bytes = 0
        self.floor_need_bytes = 0
        self.floor_step = -1
        self.step_floor_bytes = 0
        self.floor_op = ""
        self._pending_need = 0  # op_fits()'s
        # The largest resident count (at any point) of a step that evicted nothing: the
        # peak a step reaches without eviction (-1: no such step closed yet).
        self.free_peak_bytes = -1

    # ------------------------------------------------------------------ allocation
    def _new_tensor(self, pool: int, recipe: int, ext: int, mat: bool) -> int:
        t = _Tensor(pool, recipe, ext, mat, self.step)
        if self._free_t:
            tid = self._free_t.pop()
            self._T[tid] = t
        else:
            tid = len(self._T)
            self._T.append(t)
        p = self._P[pool]
        p.members.append(tid)
        if ext > 0:
            p.alive += 1
        if recipe < 0 and not p.constant:
            p.pinned += 1
        return tid

    def _new_pool(self, nbytes: int, resident: bool, constant: bool) -> int:
        p = _Pool(nbytes, resident, constant, self.now)
        if self._free_p:
            pid = self._free_p.pop()
            self._P[pid] = p
        else:
            pid = len(self._P)
            self._P.append(p)
        if constant:
            self._const_bytes += nbytes
        if resident:
            self._add_resident(nbytes)
            if not constant:
                self._cand_add(pid, p)
        return pid

    def _cand_add(self, pid: int, p: _Pool) -> None:
        p.slot = len(self._cands)
        self._cands.append(pid)

    def _cand_remove(self, p: _Pool) -> None:
        if p.slot < 0:
            return
        last = self._cands.pop()
        if p.slot < len(self._cands):
            self._cands[p.slot] = last
            self._P[last].slot = p.slot
        p.slot = -1

    def _add_resident(self, nbytes: int) -> None:
        self.resident_bytes += nbytes
        if self.resident_bytes > self.max_bytes:
            self.max_bytes = self.resident_bytes
        if self.resident_bytes > self._step_max:
            self._step_max = self.resident_bytes

    def _note_need(
        self, inputs: list[int], kinds: list[int], nbytes: list[int], name: str
    ) -> None:
        need = 0  # the distinct pools of its managed inputs
        for k, i in enumerate(inputs):
            pid = self._T[i].pool
            if self._P[pid].constant:
                continue
            if any(self._T[inputs[q]].pool == pid for q in range(k)):
                continue
            need += self._P[pid].nbytes
        need += sum(int(b) for kind, b in zip(kinds, nbytes) if kind == NEW)  # fresh outputs
        self.last_need = self._pending_need = self._const_bytes + need
        if self.last_need > self.step_floor_bytes:
            self.step_floor_bytes = self.last_need
        if self.last_need > self.op_floor_bytes:
            self.op_floor_bytes = self.last_need
            self.floor_need_bytes = need
            self.floor_op = name
            self.floor_step = self.step

    def op_fits(self) -> bool:
        """The call recorded since the last op_fits() fits the budget (its need is then
        forgotten: a later budget is not held against an op already settled)."""
        need, self._pending_need = self._pending_need, 0
        return self.budget < 0 or need <= self.budget

    def _pool_cost(self, p: _Pool) -> None:
        # Sum of the distinct recipes of the members, in member order.
        seen: set[int] = set()
        cost = 0.0
        for m in p.members:
            r = self._T[m].recipe
            if r >= 0 and r not in seen:
                seen.add(r)
                cost += self._R[r].cost
        p.cost = cost

    # ------------------------------------------------------------------ recording
    def new_constant(self, nbytes: int) -> int:
        """A tensor the runtime did not create (parameter, input): never evicted
        (Invariant 3), counted while a recipe reads it. It starts with one handle, which
        the driver releases once the op that reads it is recorded."""
        pid = self._new_pool(int(nbytes), True, True)
        return self._new_tensor(pid, -1, 1, True)

    def record(
        self,
        inputs: list[int],
        cost: float,
        kinds: list[int],
        refs: list[int],
        nbytes: list[int],
        name: str = "",
    ) -> list[int]:
        """Record one op call that has just run; returns the tids of its outputs.

        Each output k is NEW (fresh storage of nbytes[k]), VIEW (joins the pool of tensor
        refs[k], or with refs[k] = -(j + 1) that of this call's earlier output j: cuDNN
        returns an RNN's weight gradients as views of one fresh buffer) or VERSION (the
        in-place update of tensor refs[k]: the new tensor takes over its storage, and the
        old value moves to a fresh evicted pool with its lineage intact; the external
        handles move to the new tensor).

        name: the op of a call the program made, which counts towards the op-level floor
        (_note_need); empty for a record the engine makes itself (a version for a write).
        """
        if name:
            self._note_need(inputs, kinds, nbytes, name)
        self.ops += 1
        rid = self._alloc_recipe(list(inputs), float(cost))
        r = self._R[rid]
        for i in r.inputs:
            self._T[i].consumers.append(rid)
            if not self.request_stamps:
                self._P[self._T[i].pool].last_access = self.now
        self.now += r.cost
        n = len(kinds)
        outs = [-1] * n
        r.nbytes = [0] * n
        r.version_of = [-1] * n
        moved: dict[int, int] = {}
        # Versions first: a view returned by the same op is a view of the new value.
        for k in range(n):
            if kinds[k] == VERSION:
                outs[k] = self._version(refs[k], rid)
                moved[refs[k]] = outs[k]
                r.nbytes[k] = self._P[self._T[outs[k]].pool].nbytes
                r.version_of[k] = refs[k]
        # The pool's other held members follow each version into the new storage (after
        # the declared outputs): they alias the written one, as in eager.
        followers: list[tuple[int, int]] = []
        for k in range(n):
            if kinds[k] == VERSION:
                self._follow(refs[k], outs[k], rid, followers)
        moved.update(followers)
        for k in range(n):
            kind = kinds[k]
            if kind == NEW:
                pid = self._new_pool(int(nbytes[k]), True, False)
                outs[k] = self._new_tensor(pid, rid, 1, True)
                r.nbytes[k] = int(nbytes[k])
            elif kind == VIEW:
                src = refs[k]
                if src < 0:  # -(j + 1): a view of this call's output j (j < k)
                    j = -src - 1
                    if j >= k or outs[j] < 0:
                        raise CoreError(
                            f"dtr: record: output {k} is a view of output {j}, which is "
                            "not an earlier one"
                        )
                    src = outs[j]
                pid = self._T[moved.get(src, src)].pool
                outs[k] = self._new_tensor(pid, rid, 1, True)
            elif kind != VERSION:
                raise CoreError(f"dtr: bad output kind {kind}")
        r.pool_version = bool(followers)
        self._followed = [m for m, _ in followers]
        for _, follower in followers:
            outs.append(follower)
            r.nbytes.append(0)  # the version counts the pool's bytes
            r.version_of.append(-1)  # what it followed is lineage only and may be dropped
        for tid in outs:
            r.outputs.append(tid)
            r.kept += 1
            p = self._P[self._T[tid].pool]
            p.last_access = self.now
            self._pool_cost(p)
        if r.kept == 0:
            self._drop_recipe(rid)
        return outs

    def _alloc_recipe(self, inputs: list[int], cost: float) -> int:
        r = _Recipe(inputs, cost)
        if self._free_r:
            rid = self._free_r.pop()
            self._R[rid] = r
        else:
            rid = len(self._R)
            self._R.append(r)
        return rid

    def _version(self, old: int, rid: int) -> int:
        # Invariant 4: the storage now holds the new value; every old member moves to a
        # fresh, evicted pool so that it is recomputed into new storage when needed.
        to = self._T[old]
        pid = to.pool
        p = self._P[pid]
        ext = to.ext
        old_pid = self._new_pool(p.nbytes, False, False)
        op = self._P[old_pid]
        op.members = p.members
        op.last_access = p.last_access
        op.locks = p.locks
        op.pinned = p.pinned
        p.members = []
        p.locks = 0
        p.pinned = 0
        p.alive = 0
        to.ext = 0
        for m in op.members:
            tm = self._T[m]
            tm.pool = old_pid
            if tm.ext > 0:
                op.alive += 1
            if tm.mat:
                tm.mat = False
                self._evicted.append(m)
        self._pool_cost(op)
        self._mark_evicted(old_pid)
        return self._new_tensor(pid, rid, ext, True)

    def _follow(self, old: int, version: int, rid: int, out: list[tuple[int, int]]) -> None:
        # A pool version (Invariant 4): the members of old's pool the program still holds
        # (now in the old, evicted pool) become members of the new version's pool, made by
        # the same recipe, and take their handles over; their old values keep their lineage.
        old_pid = self._T[old].pool
        pid = self._T[version].pool
        for m in list(self._P[old_pid].members):
            tm = self._T[m]
            ext = tm.ext
            if m == old or ext == 0:
                continue
            tm.ext = 0
            self._P[old_pid].alive -= 1
            out.append((m, self._new_tensor(pid, rid, ext, True)))

    # ------------------------------------------------------------------ handles
    def retain(self, tid: int) -> None:
        t = self._T[tid]
        if t.ext == 0:
            p = self._P[t.pool]
            p.alive += 1
            p.doomed = False
        t.ext += 1

    def release(self, tid: int) -> None:
        """The program dropped one handle; a pool nobody holds is freed at once
        (Invariant 5), its lineage kept only while something still needs it."""
        t = self._T[tid]
        if t.ext <= 0:
            raise CoreError(f"dtr: release of tensor {tid} with no handles")
        t.ext -= 1
        if t.ext == 0:
            pid = t.pool
            p = self._P[pid]
            p.alive -= 1
            if p.alive == 0:
                p.doomed = True
            self._maybe_drop(tid)
            self._maybe_eager_evict(pid)

    def lock(self, tid: int) -> None:
        """Invariant 2: a locked tensor's pool is not evicted until it is unlocked."""
        t = self._T[tid]
        t.lock += 1
        p = self._P[t.pool]
        p.locks += 1
        if not self.request_stamps:
            p.last_access = self.now

    def touch(self, tid: int) -> None:
        """Stamp tid's pool as accessed now (an op that reads it was requested)."""
        self._P[self._T[tid].pool].last_access = self.now

    def unlock(self, tid: int) -> None:
        t = self._T[tid]
        if t.lock <= 0:
            raise CoreError(f"dtr: unlock of tensor {tid} that is not locked")
        t.lock -= 1
        pid = t.pool
        self._P[pid].locks -= 1
        if t.lock == 0:
            self._maybe_drop(tid)
        self._maybe_eager_evict(pid)

    def resized(self, tid: int, nbytes: int) -> None:
        """tid's storage holds nbytes now: an out= op resized it in place."""
        p = self._P[self._T[tid].pool]
        if not p.resident:
            raise CoreError(f"dtr: resized tensor {tid}, which is not resident")
        self._add_resident(int(nbytes) - p.nbytes)
        if p.constant:
            self._const_bytes += int(nbytes) - p.nbytes
        p.nbytes = int(nbytes)

    def pin(self, tid: int) -> None:
        """Cut a tensor's lineage: it becomes unrecomputable, so its pool is never
        evicted (Invariant 3); ancestors nobody else needs are dropped. A tensor the
        program holds must be materialized first; one it does not hold may be cut while
        evicted (it is then dropped once nothing reads it)."""
        t = self._T[tid]
        if t is None:  # dropped earlier in the same invalidation
            return
        rid = t.recipe
        if rid < 0:
            return
        if t.ext > 0 and not t.mat:
            raise CoreError(f"dtr: pin of tensor {tid}, which is held but not materialized")
        r = self._R[rid]
        r.outputs[r.outputs.index(tid)] = -1
        r.kept -= 1
        t.recipe = -1
        p = self._P[t.pool]
        if not p.constant:
            p.pinned += 1
        self._pool_cost(p)
        if r.kept == 0:
            self._drop_recipe(rid)
        self._maybe_drop(tid)

    # ------------------------------------------------------------------ dropping
    def _droppable(self, t: _Tensor) -> bool:
        return t.ext == 0 and t.lock == 0 and not t.consumers

    def _maybe_drop(self, tid: int) -> None:
        if self._droppable(self._T[tid]):
            self._drop([tid])

    def _drop(self, stack: list[int]) -> None:
        # Iterative (Invariant 7): lineage chains can be long.
        while stack:
            tid = stack.pop()
            t = self._T[tid]
            if t is None or not self._droppable(t):
                continue
            pid = t.pool
            p = self._P[pid]
            p.members.remove(tid)
            if t.recipe >= 0:
                r = self._R[t.recipe]
                r.outputs[r.outputs.index(tid)] = -1
                r.kept -= 1
                if r.kept == 0:
                    for i in self._release_recipe(t.recipe):
                        stack.append(i)
            elif not p.constant:
                p.pinned -= 1
            self._T[tid] = None
            self._dropped_t.append(tid)
            if not p.members:
                self._free_pool(pid)
            else:
                self._pool_cost(p)
                self._maybe_eager_evict(pid)

    def _drop_recipe(self, rid: int) -> None:
        self._drop(self._release_recipe(rid))

    def _release_recipe(self, rid: int) -> list[int]:
        r = self._R[rid]
        for i in r.inputs:
            self._T[i].consumers.remove(rid)
        self._R[rid] = None
        self._dropped_r.append(rid)
        return [i for i in r.inputs if self._droppable(self._T[i])]

    def _free_pool(self, pid: int) -> None:
        p = self._P[pid]
        if p.constant:
            self._const_bytes -= p.nbytes
        if p.resident:
            self.resident_bytes -= p.nbytes
            self._cand_remove(p)
        elif p.uf >= 0:
            self._uf_leave(p)
        self._P[pid] = None
        self._dropped_p.append(pid)

    def drain(self) -> tuple[list[int], list[int], list[int]]:
        """(evicted tids, dropped tids, dropped rids) since the last call. The driver
        releases the values of evicted tensors and forgets dropped ones; only then are
        their ids reused."""
        ev, dt, dr = self._evicted, self._dropped_t, self._dropped_r
        self._evicted, self._dropped_t, self._dropped_r = [], [], []
        self._free_t.extend(dt)
        self._free_r.extend(dr)
        self._free_p.extend(self._dropped_p)
        self._dropped_p = []
        return ev, dt, dr

    # ------------------------------------------------------------------ eviction
    def _evictable(self, p: _Pool) -> bool:
        return p.resident and not p.constant and p.pinned == 0 and p.locks == 0 and p.nbytes > 0

    def _maybe_eager_evict(self, pid: int) -> None:
        # Only pools the program let go of: tensors rebuilt for lineage stay resident
        # until a heuristic picks them (they are often needed again at once).
        p = self._P[pid]
        if p is not None and p.doomed and p.alive == 0 and self._evictable(p):
            self._evict(pid)
            self.eager_evictions += 1

    def _evict(self, pid: int) -> None:
        p = self._P[pid]
        p.resident = False
        p.doomed = False
        self.resident_bytes -= p.nbytes
        self._cand_remove(p)
        for m in p.members:
            t = self._T[m]
            if t.mat:
                t.mat = False
                self._evicted.append(m)
        self._mark_evicted(pid)

    def make_room(self, extra: int = 0) -> bool:
        """Evict until resident + extra fits the budget (Invariant 6). False if no
        victim is left; the caller reports the budget error."""
        if self.budget >= 0:
            while self.resident_bytes + extra > self.budget:
                v = self._choose()
                if v < 0:
                    return False
                self._evict(v)
                self.evictions += 1
                if self._log is not None:
                    self._log.append(v)
        if self.resident_bytes > self.peak_bytes:
            self.peak_bytes = self.resident_bytes
        return True

    def log_evictions(self, on: bool = True) -> None:
        """Keep the pool id of every eviction the budget forces (for comparing runs)."""
        self._log = [] if on else None

    def eviction_log(self) -> list[int]:
        return list(self._log or [])

    def reset_peak(self) -> None:
        """Start measuring peak_bytes and max_bytes afresh from the current count."""
        self.peak_bytes = self.max_bytes = self.resident_bytes

    def evict_all(self) -> int:
        """Stress mode: evict every evictable pool."""
        n = 0
        for pid, p in enumerate(self._P):
            if p is not None and self._evictable(p):
                self._evict(pid)
                self.evictions += 1
                n += 1
        return n

    def _choose(self) -> int:
        start = time.perf_counter()
        cands = self._cands
        k = self.search_sample
        best = -1
        if 0 < k < len(cands):
            # Sampled search: the best of k candidates drawn uniformly (with repetition),
            # O(k) per decision however many tensors are resident. Exact when no sampled
            # candidate is evictable, so a victim is found whenever one exists.
            n = len(cands)
            best = self._best_of([cands[self._next_random() % n] for _ in range(k)])
        if best < 0:
            best = self._best_of(cands)
        self.search_seconds += time.perf_counter() - start
        return best

    def _best_of(self, pids: list[int]) -> int:
        """The lowest-scoring evictable pool of pids. Ties go to the larger pool, then
        the cheaper recomputation (the score's numerator), then the smallest pid, so the
        choice does not depend on the order of pids (csrc/core/core.cpp says why)."""
        if self._h == 6:  # random: uniform over the candidates, in pid order
            ok = sorted(
                {pid for pid in pids if self._eligible(self._P[pid])},
            )
            return ok[self._next_random() % len(ok)] if ok else -1
        best, best_key = -1, None
        for pid in pids:
            p = self._P[pid]
            if not self._eligible(p):
                continue
            s, cost = self._score(pid, p, best_key[0] if best_key else math.inf)
            key = (s, -p.nbytes, cost, pid)
            if best < 0 or key < best_key:
                best, best_key = pid, key
        return best

    def _eligible(self, p: _Pool) -> bool:
        return self._evictable(p) and p.nbytes >= self.min_evict_bytes

    def _score(self, pid: int, p: _Pool, bound: float) -> tuple[float, float]:
        """The pool's score and its cost term (1 for lru and size); a neighbourhood walk
        stops once the score is known to be > bound (it cannot win or tie then: costs
        are non-negative and float sums of them only grow), which keeps the choice exact
        while skipping most of the walking."""
        h = self._h
        m = float(p.nbytes)
        stale = self.now - p.last_access
        if h == 4:  # size
            return (1.0 / m if m > 0 else math.inf), 1.0
        if h == 5:  # msps: (c + evicted ancestors) / m, Capuchin
            if m <= 0:
                return math.inf, 1.0
            c = self._neighborhood(pid, True, False, p.cost, m, bound)
            return c / m, c
        if h == 7:  # msps_sqrt: (c + evicted ancestors) / (m * sqrt(staleness)), ours
            if m <= 0 or stale <= 0:
                return math.inf, 1.0
            denom = m * math.sqrt(stale)
            c = self._neighborhood(pid, True, False, p.cost, denom, bound)
            return c / denom, c
        if h == 9:  # dtr_held34: dtr_held with staleness^(3/4), ours
            if m <= 0 or stale <= 0:
                return math.inf, 1.0
            root = math.sqrt(stale)
            denom = m * (root * math.sqrt(root))  # as the C++ core rounds it
            c = self._neighborhood(pid, True, True, p.cost, denom, bound, True)
            return c / denom, c
        denom = m * stale
        if h == 3:  # lru
            return (1.0 / stale if stale > 0 else math.inf), 1.0
        if denom <= 0:
            return math.inf, 1.0
        if h == 0 or h == 8:  # dtr: exact evicted neighbourhood; dtr_held: held part
            c = self._neighborhood(pid, True, True, p.cost, denom, bound, h == 8)
        elif h == 1:  # dtr_eq: union-find classes of evicted neighbours
            c = p.cost + self._eq_neighbors(pid)
        else:  # dtr_local
            c = p.cost
        return c / denom, c

    # ------------------------------------------------------------------ neighbourhoods
    def _pool_parents(self, pid: int) -> list[int]:
        out = []
        for m in self._P[pid].members:
            r = self._T[m].recipe
            if r >= 0:
                for i in self._R[r].inputs:
                    out.append(self._T[i].pool)
        return out

    def _pool_children(self, pid: int) -> list[int]:
        out = []
        for m in self._P[pid].members:
            for r in self._T[m].consumers:
                for o in self._R[r].outputs:
                    if o >= 0:
                        out.append(self._T[o].pool)
        return out

    def _neighborhood(
        self,
        pid: int,
        up: bool,
        down: bool,
        total: float = 0.0,
        denom: float = 1.0,
        bound: float = math.inf,
        held: bool = False,
    ) -> float:
        """total + the costs of the evicted pools reachable from pid through evicted
        pools: ancestors (up) and descendants (down), the paper's e*(t). Stops early,
        returning a partial sum, once total / denom > bound. held (dtr_held): below
        pid's own children, descendants the program no longer holds are walked through
        but not counted (the C++ core's Core::neighborhood says why)."""
        for direction in (0, 1):
            if (direction == 0 and not up) or (direction == 1 and not down):
                continue
            seen = {pid}
            stack = [pid]
            while stack:
                q = stack.pop()
                nbrs = self._pool_parents(q) if direction == 0 else self._pool_children(q)
                for n in nbrs:
                    if n in seen:
                        continue
                    seen.add(n)
                    pn = self._P[n]
                    if pn.resident:
                        continue
                    stack.append(n)
                    if held and direction == 1 and pn.alive == 0 and q != pid:
                        continue
                    total += pn.cost
                    if total / denom > bound:
                        return total
        return total

    def _uf_find(self, x: int) -> int:
        root = x
        while self._uf_parent[root] != root:
            root = self._uf_parent[root]
        while self._uf_parent[x] != root:
            self._uf_parent[x], x = root, self._uf_parent[x]
        return root

    def _mark_evicted(self, pid: int) -> None:
        if self._h != 1:
            return
        self._evicted_pools += 1
        p = self._P[pid]
        node = len(self._uf_parent)
        self._uf_parent.append(node)
        self._uf_cost.append(p.cost)
        p.uf = node
        for n in self._pool_parents(pid) + self._pool_children(pid):
            pn = self._P[n]
            if n == pid or pn.resident or pn.uf < 0:
                continue
            a, b = self._uf_find(pn.uf), self._uf_find(node)
            if a != b:
                self._uf_parent[a] = b
                self._uf_cost[b] += self._uf_cost[a]

    def _uf_leave(self, p: _Pool) -> None:
        # Union-find cannot split: the pool's cost leaves its class, the node stays.
        root = self._uf_find(p.uf)
        self._uf_cost[root] -= p.cost
        p.uf = -1
        self._evicted_pools -= 1
        if self._evicted_pools == 0:
            self._uf_parent.clear()
            self._uf_cost.clear()

    def _eq_neighbors(self, pid: int) -> float:
        roots: list[int] = []
        total = 0.0
        for n in self._pool_parents(pid) + self._pool_children(pid):
            pn = self._P[n]
            if n == pid or pn.resident or pn.uf < 0:
                continue
            r = self._uf_find(pn.uf)
            if r not in roots:
                roots.append(r)
                total += self._uf_cost[r]
        return total

    def _next_random(self) -> int:
        # splitmix64, identical in the C++ core.
        self._rng = (self._rng + 0x9E3779B97F4A7C15) & _MASK64
        z = self._rng
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
        return z ^ (z >> 31)

    # ------------------------------------------------------------------ rematerialization
    # Rematerialization walks a stack of frames, one per tensor being rebuilt (Invariant
    # 7: iterative, never recursive). A frame locks an input only once it is known to be
    # materialized: a child it rebuilt is locked for it as the child finishes, and inputs
    # that were already resident are locked only when the frame's recipe is about to run.
    # Until then they may be evicted (and are rebuilt if they were), so a long chain does
    # not pin every side input along it. Each frame gains a lock per finished child, so
    # the walk terminates.
    def remat_begin(self, tid: int) -> None:
        """Start rebuilding tid (which the caller holds locked)."""
        if self._frames:
            raise CoreError("dtr: a rematerialization is already in progress")
        self._frames = [_Frame(tid)]

    def remat_step(self) -> int:
        """The next recipe to rerun, its inputs materialized and locked; -1 when done."""
        frames = self._frames
        while frames:
            f = frames[-1]
            t = self._T[f.tid]
            if t.mat:
                self._pop_frame()
                continue
            if t.recipe < 0:
                raise CoreError(f"dtr: tensor {f.tid} is evicted and has no recipe")
            r = self._R[t.recipe]
            if self.request_stamps and not f.seen:
                f.seen = True
                for i in r.inputs:
                    self._P[self._T[i].pool].last_access = self.now
            # The first evicted input, but one whose recipe reads inputs before one that
            # reads none (Core::remat_step says why)
            missing = -1
            for i in r.inputs:
                if not self._T[i].mat:
                    if missing < 0:
                        missing = i
                    rec = self._T[i].recipe
                    if rec >= 0 and self._R[rec].inputs:
                        missing = i
                        break
            if missing >= 0:
                frames.append(_Frame(missing))
                continue
            if self.thrashing():
                # a program that catches the error starts a new allowance
                msg = self.thrash_message()
                self._step_remats = self.remats
                raise BudgetError(msg)
            held = list(f.locks)
            for i in r.inputs:
                if i in held:
                    held.remove(i)
                else:
                    self.lock(i)
                    f.locks.append(i)
            return t.recipe
        return -1

    def _pop_frame(self) -> None:
        f = self._frames.pop()
        if self._frames:  # lock the finished child for its parent before letting go
            self.lock(f.tid)
            self._frames[-1].locks.append(f.tid)
        for i in f.locks:
            self.unlock(i)

    def remat_abort(self) -> None:
        """Release every lock of an interrupted rematerialization."""
        frames, self._frames = self._frames, []
        for f in frames:
            for i in f.locks:
                self.unlock(i)

    def steals(self, rid: int) -> list[int]:
        """Outputs k of an in-place recipe that may be recomputed in the storage of the
        tensor they updated, instead of a copy: that tensor is materialized, nobody holds
        it, only this recipe has it locked, and nothing else in its pool is materialized
        (a dropout mask built by empty_like -> bernoulli_ -> div_ then needs one buffer,
        not three)."""
        r = self._R[rid]
        out = []
        for k, old in enumerate(r.version_of):
            if old < 0 or r.outputs[k] < 0:
                continue
            t = self._T[old]
            p = self._P[t.pool]
            if (
                t.mat
                and t.ext == 0
                and t.lock == 1
                and p.pinned == 0
                and not p.constant
                and all(m == old or not self._blocks_steal(r, self._T[m]) for m in p.members)
            ):
                out.append(k)
        return out

    @staticmethod
    def _blocks_steal(r: _Recipe, m: _Tensor) -> bool:
        # A pool version's old members (their handles went to the followers) are lineage
        # only: the storage is theirs to give up unless a rebuild has one locked.
        return m.lock > 0 or m.ext > 0 if r.pool_version else m.mat

    def remat_bytes(self, rid: int) -> int:
        """Bytes the recipe allocates when rerun: its fresh outputs, less the storage it
        takes over from the tensors it updates in place (see steals())."""
        r = self._R[rid]
        stolen = self.steals(rid)
        return sum(b for k, b in enumerate(r.nbytes) if k not in stolen)

    def remat_done(self, rid: int, nbytes: list[int], stolen: list[int] = ()) -> None:
        """The recipe was rerun: its kept outputs are materialized (its inputs stay locked
        until remat_step() moves on). nbytes[k] is the measured storage size of output k;
        stolen lists the outputs computed in the storage of the tensor they update (see
        steals())."""
        r = self._R[rid]
        self.remats += 1
        self.remat_cost += r.cost
        self.now += r.cost
        for k in stolen:
            old = self._T[r.version_of[k]]
            p = self._P[old.pool]
            for m in p.members:  # old, then what a pool version's steal gave up
                if m == r.version_of[k] or self._T[m].mat:
                    self._T[m].mat = False
                    self._evicted.append(m)
            p.resident = False
            self.resident_bytes -= p.nbytes
            self._cand_remove(p)
            self._mark_evicted(old.pool)
        for k, o in enumerate(r.outputs):
            if o < 0:
                continue
            t = self._T[o]
            if t.mat:
                continue
            p = self._P[t.pool]
            if not p.resident:
                if k < len(nbytes) and nbytes[k] > 0:
                    p.nbytes = int(nbytes[k])
                p.resident = True
                if p.uf >= 0:
                    self._uf_leave(p)
                self._add_resident(p.nbytes)
                if not p.constant:
                    self._cand_add(t.pool, p)
            t.mat = True
            if not self.request_stamps:
                p.last_access = self.now
        if not self.request_stamps:
            for i in r.inputs:
                self._P[self._T[i].pool].last_access = self.now

    # ------------------------------------------------------------------ queries
    def is_materialized(self, tid: int) -> bool:
        return self._T[tid].mat

    def is_private(self, tid: int) -> bool:
        """True when tid may be updated in place by versioning: it is the only member of
        its pool the program holds, and every member can be recomputed."""
        return self.can_version(tid) and self._P[self._T[tid].pool].alive == 1

    def can_version(self, tid: int) -> bool:
        """True when tid may get a new version: its pool can be recomputed and the program
        holds tid. Private (is_private), the old value's storage is taken over; otherwise
        a pool version: the pool's other held members follow it into the new storage
        (record() returns them after the declared outputs; followed() names what each
        replaced)."""
        t = self._T[tid]
        p = self._P[t.pool]
        return not p.constant and p.pinned == 0 and t.recipe >= 0 and t.ext > 0

    def followed(self) -> list[int]:
        """The held members whose handles the last record()'s followers took over, in
        the followers' order."""
        return list(self._followed)

    def is_constant(self, tid: int) -> bool:
        return self._P[self._T[tid].pool].constant

    def has_consumers(self, tid: int) -> bool:
        return bool(self._T[tid].consumers)

    def recipe_of(self, tid: int) -> int:
        return self._T[tid].recipe

    def ext(self, tid: int) -> int:
        return self._T[tid].ext

    def members(self, tid: int) -> list[int]:
        return list(self._P[self._T[tid].pool].members)

    def pool_of(self, tid: int) -> int:
        return self._T[tid].pool

    def pool_bytes(self, tid: int) -> int:
        return self._P[self._T[tid].pool].nbytes

    def descendants(self, seeds: list[int]) -> list[int]:
        """Every kept tensor whose lineage reads one of seeds (seeds excluded)."""
        seen = set(seeds)
        out: list[int] = []
        stack = list(seeds)
        while stack:
            t = stack.pop()
            for r in self._T[t].consumers:
                for o in self._R[r].outputs:
                    if o >= 0 and o not in seen:
                        seen.add(o)
                        out.append(o)
                        stack.append(o)
        return out

    def end_step(self) -> list[int]:
        """Closes a step: the held tensors whose lineage reaches into an earlier step,
        which the driver cuts (materialized and pinned), and the next step begins.

        A value carried from step to step (a running mean of the loss) reads the previous
        step's, so its lineage would grow by a step's ops every step, with the evictions
        and recomputations that walk it. Lineage that stays within one step (the graph of
        a model still awaiting its backward) is left as it is."""
        T, R, P = self._T, self._R, self._P
        # Per tensor: 0 not seen, 1 being walked, 2 its lineage stays in this step, 3 it
        # does not. A post-order walk (Invariant 7), each recomputable tensor visited once.
        state = [0] * len(T)

        def old_lineage(root: int) -> bool:
            stack: list[list[int]] = []
            if state[root] < 2:
                state[root] = 1
                stack.append([root, 0])
            while stack:
                frame = stack[-1]
                x = frame[0]
                inputs = R[T[x].recipe].inputs
                result = 2
                while frame[1] < len(inputs):
                    i = inputs[frame[1]]
                    inp = T[i]
                    if inp.recipe < 0 or P[inp.pool].constant:  # a root of lineage
                        frame[1] += 1
                        continue
                    if inp.born < self.step or state[i] == 3:
                        result = 3
                        break
                    if state[i] == 0:
                        result = 0  # walk the input first, then look at it again
                        break
                    frame[1] += 1
                if result == 0:
                    i = inputs[frame[1]]
                    state[i] = 1
                    stack.append([i, 0])
                    continue
                state[x] = result
                stack.pop()
            return state[root] == 3

        out = [
            tid
            for tid, t in enumerate(T)
            if t is not None
            and t.ext > 0
            and t.recipe >= 0
            and not P[t.pool].constant
            and old_lineage(tid)
        ]
        self.step += 1
        self._prev_ops = self.ops - self._step_ops
        self._prev_peak = self.peak_bytes
        self._step_ops = self.ops
        self._step_remats = self.remats
        if self.evictions == self._step_evictions and self._step_max > self.free_peak_bytes:
            self.free_peak_bytes = self._step_max
        self._step_evictions = self.evictions
        self._step_max = self.resident_bytes
        self.step_floor_bytes = 0
        return out

    def thrashing(self) -> bool:
        if not self.thrash > 1.0:
            return False
        base = max(self.ops - self._step_ops, self._prev_ops, THRASH_FLOOR)
        return float(self.remats - self._step_remats) >= (self.thrash - 1.0) * float(base)

    def thrash_message(self) -> str:
        previous = (
            "no step completed yet"
            if self._prev_ops < 0
            else f"the previous step had {self._prev_ops} ops and peaked at "
            f"{format_bytes(self._prev_peak)}"
        )
        budget = format_bytes(self.budget if self.budget >= 0 else None)
        return (
            f"dtr: cannot stay within the memory budget of {budget}: recomputation is "
            f"running away, {self.remats - self._step_remats} recomputations "
            f"in this step against its {self.ops - self._step_ops} ops ({previous}), past "
            f"the thrash limit (thrash={self.thrash:g}: at most thrash - 1 recomputations "
            f"per op, counted against at least {THRASH_FLOOR} ops); "
            f"{format_bytes(self.resident_bytes)} resident, "
            f"{format_bytes(self.pinned_bytes())} pinned. The budget is too small for this "
            "program: raise it (to at least the peak of a step that completed without this "
            "stop), or pass thrash=0 (DTR_THRASH=0) to recompute without limit."
        )

    def alive(self) -> list[int]:
        """Managed tensors the program still holds."""
        return [
            tid
            for tid, t in enumerate(self._T)
            if t is not None and t.ext > 0 and not self._P[t.pool].constant
        ]

    def pinned_bytes(self) -> int:
        return sum(
            p.nbytes
            for p in self._P
            if p is not None and p.resident and (p.constant or p.pinned > 0)
        )

    def constant_bytes(self) -> int:
        return self._const_bytes

    def locked_bytes(self) -> int:
        return sum(
            p.nbytes
            for p in self._P
            if p is not None and p.resident and not p.constant and p.pinned == 0 and p.locks > 0
        )

    def largest_pinned(self, k: int) -> list[tuple[int, int]]:
        """(a member tid, bytes) of the k largest resident pools that cannot be evicted."""
        rows = [
            (p.nbytes, p.members[0])
            for p in self._P
            if p is not None
            and p.resident
            and p.members
            and (p.constant or p.pinned > 0 or p.locks > 0)
        ]
        rows.sort(key=lambda r: (-r[0], r[1]))
        return [(tid, nb) for nb, tid in rows[:k]]

    def counts(self) -> tuple[int, int, int]:
        """Live (tensors, pools, recipes)."""
        return (
            sum(t is not None for t in self._T),
            sum(p is not None for p in self._P),
            sum(r is not None for r in self._R),
        )

    def check(self) -> None:
        """Verify the internal invariants; raises CoreError on the first violation."""
        resident = constants = 0
        for pid, p in enumerate(self._P):
            if p is None:
                continue
            if p.resident:
                resident += p.nbytes
            if p.constant:
                constants += p.nbytes
            alive = sum(1 for m in p.members if self._T[m].ext > 0)
            locks = sum(self._T[m].lock for m in p.members)
            pinned = sum(1 for m in p.members if self._T[m].recipe < 0) if not p.constant else 0
            if (alive, locks, pinned) != (p.alive, p.locks, p.pinned):
                raise CoreError(
                    f"dtr: pool {pid} counters {(p.alive, p.locks, p.pinned)} "
                    f"!= {(alive, locks, pinned)}"
                )
            for m in p.members:
                if self._T[m].pool != pid:
                    raise CoreError(f"dtr: tensor {m} not in its pool {pid}")
                if self._T[m].mat and not p.resident:
                    raise CoreError(f"dtr: tensor {m} materialized in evicted pool {pid}")
        if resident != self.resident_bytes:
            raise CoreError(f"dtr: resident {self.resident_bytes} != {resident}")
        if constants != self._const_bytes:
            raise CoreError(f"dtr: constants {self._const_bytes} != {constants}")
        want = sorted(
            pid for pid, p in enumerate(self._P) if p is not None and p.resident and not p.constant
        )
        if sorted(self._cands) != want or any(
            self._P[pid].slot != k for k, pid in enumerate(self._cands)
        ):
            raise CoreError("dtr: victim candidate list out of step with resident pools")
        for rid, r in enumerate(self._R):
            if r is None:
                continue
            if r.kept != sum(1 for o in r.outputs if o >= 0) or r.kept == 0:
                raise CoreError(f"dtr: recipe {rid} kept count {r.kept}")
            for i in r.inputs:
                if self._T[i] is None or rid not in self._T[i].consumers:
                    raise CoreError(f"dtr: recipe {rid} input {i} lost")
