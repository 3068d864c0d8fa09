"""The live runtime: runs each op, records its lineage in the core, evicts and recomputes.

One ``Runtime`` per :func:`dtr.enable` session. Its dispatch mode hands it every op; it
decides whether the op is managed, materializes the op's inputs (recomputing evicted ones
from their lineage), runs the op, records the outputs, and evicts until resident bytes
fit the budget again. The bookkeeping is the core's (``dtr._C.Core`` or its Python twin);
this module holds the values and executes recipes. Numbered invariants: ``dtr/NOTES.md``.
"""

from __future__ import annotations

import contextlib
import threading
import time

import torch

from . import cost as _cost
from . import rng
from ._core import make_core
from ._pycore import NEW, VERSION, VIEW
from .call import Call, rebuild_returns, returns_of, substitute
from .config import DTRConfig
from .errors import BudgetError, DTRError, InternalError, UnsupportedError
from .recipe import VERSION_SPEC, Recipe, StandIn, copy_preserving_layout
from .schema import OpFacts, op_facts
from .tensor import CheckpointTensor, Node, Ref
from .units import format_bytes

aten = torch.ops.aten
_perf = time.perf_counter


@contextlib.contextmanager
def internal():
    """Run plain-tensor code from outside an op (hooks, materialize, exit) without dtr's
    mode seeing it and without autograd recording it."""
    with torch._C._DisableTorchDispatch(), torch._C._AutoDispatchBelowAutograd():
        yield


class Runtime:
    def __init__(self, config: DTRConfig):
        self.config = config
        budget = -1 if config.budget_bytes is None else config.budget_bytes
        self.core, self.core_kind = make_core(config, budget)
        self.nodes: list[Node | None] = []
        self.recipes: list[Recipe | None] = []
        self.storages: dict[int, int] = {}  # storage key -> constant tid
        self.const_keys: dict[int, int] = {}  # constant tid -> storage key
        self.escaped: dict[int, Node] = {}  # storage key -> managed node handed out plain
        self.escaped_keys: dict[int, int] = {}  # its tid -> storage key
        self.pending_refs: list[Node] = []  # handles the program dropped
        self.hooks: list = []
        self.lock = threading.RLock()
        self.is_open = True
        self.recompute_seconds = 0.0
        self.model_cost = config.cost_model == "roofline"
        self._token = object()

    # ================================================================== entry
    def handle(self, func, args: tuple, kwargs: dict):
        with self.lock:
            if self.pending_refs:
                self._flush()
            facts = op_facts(func)
            call = Call(facts, args, kwargs)
            managed = False
            for t in call.leaves:
                if type(t) is CheckpointTensor or isinstance(t, CheckpointTensor):
                    if t._dtr_ref.runtime is not self:
                        return self.handle(func, *_unwrap_foreign(call, self))
                    managed = True
            special = _SPECIAL.get(func)
            if special is not None:
                return special(self, func, facts, call, managed)
            writes = facts.writes
            if facts.hidden_writes is not None:
                writes = writes | set(facts.hidden_writes(call.schema_values(facts)))
            if not managed:
                if writes:
                    self._writes_to_plain(call, writes)
                    return func(*args, **kwargs)
                if facts.view or not _wants_management(call):
                    return func(*args, **kwargs)
            elif facts.meta_only:
                return self._run_meta_only(func, facts, call)
            elif facts.metadata_inplace:
                raise UnsupportedError(
                    f"dtr: {facts.name} changes the sizes or storage of a managed tensor in "
                    "place, which dtr does not support; use the out-of-place op, or "
                    "dtr.materialize() the tensor first"
                )
            return self._run(func, facts, call, writes)

    # ================================================================== managed op
    def _run(self, func, facts: OpFacts, call: Call, writes):
        core = self.core
        leaves = call.leaves
        n = len(leaves)
        nodes: list[Node | None] = [None] * n
        tids = [0] * n
        vals: list = [None] * n
        fresh_consts: list[int] = []
        for k, t in enumerate(leaves):
            if isinstance(t, CheckpointTensor):
                node = t._dtr_ref.node
                nodes[k] = node
                tids[k] = node.tid
            else:
                tids[k] = self._constant(t, fresh_consts)
                vals[k] = t
        written = [k for k in range(n) if call.positions[k] in writes] if writes else []
        locked: list[int] = []
        fresh = ()
        try:
            for k in range(n):
                if nodes[k] is not None:
                    core.lock(tids[k])
                    locked.append(tids[k])
            for k in range(n):
                if nodes[k] is not None:
                    vals[k] = self._value(nodes[k])
            versioned, snaps = self._prepare_writes(facts, written, nodes, tids, vals, fresh_consts)
            captured = None
            extra_inputs: list[int] = []
            if facts.seeded:
                gen = call.argument(facts, facts.generator) if facts.generator >= 0 else None
                captured = rng.capture(gen, _device_of(call.leaves))
                # The saved generator state is memory the recipe holds: count it.
                extra_inputs.append(self._constant(captured[1], fresh_consts))
            real_args, real_kwargs = substitute(call.args, call.kwargs, call.where, vals)
            start = _perf()
            out = func(*real_args, **real_kwargs)
            cost = _perf() - start
            if self.model_cost:
                cost = _cost.roofline(func, real_args, real_kwargs, out)
            result, fresh = self._record(
                func,
                facts,
                call,
                out,
                nodes,
                tids,
                vals,
                written,
                versioned,
                snaps,
                captured,
                cost,
                extra_inputs,
            )
        finally:
            for tid in locked:
                core.unlock(tid)
            for tid in fresh_consts:  # now held by the recipe, or by nothing
                core.release(tid)
        self._settle(fresh, func)
        return result

    def _run_meta_only(self, func, facts: OpFacts, call: Call):
        """empty_like(x) and kin: run on a meta stand-in of x, so neither this call nor
        its recomputation needs x's value."""
        device = _device_of(call.leaves)
        stand_ins = [StandIn(t) for t in call.leaves]
        args, kwargs = substitute(call.args, call.kwargs, call.where, [s.get() for s in stand_ins])
        if kwargs.get("device") is None:
            kwargs = {**kwargs, "device": device}
        captured = rng.capture(None, device) if facts.seeded else None
        fresh_consts: list[int] = []
        inputs = [self._constant(captured[1], fresh_consts)] if captured is not None else []
        start = _perf()
        out = func(*args, **kwargs)
        cost = _perf() - start
        if self.model_cost:
            cost = _cost.roofline(func, args, kwargs, out)
        out_tids = self.core.record(inputs, cost, [NEW], [-1], [out.untyped_storage().nbytes()])
        for tid in fresh_consts:
            self.core.release(tid)
        t_args, t_kwargs = substitute(args, kwargs, call.where, [None] * len(stand_ins))
        rec = Recipe(
            func,
            facts,
            t_args,
            t_kwargs,
            call.where,
            stand_ins,
            (),
            [(0, -1)],
            captured,
            torch.is_grad_enabled(),
        )
        node = Node(out_tids[0], out, facts.name, out.shape)
        self._set_node(node.tid, node)
        rec.outputs.append(node)
        self._set_recipe(self.core.recipe_of(node.tid), rec)
        result = CheckpointTensor(Ref(node, self), out)
        self._settle([node.tid], func)
        return result

    def _prepare_writes(self, facts: OpFacts, written, nodes, tids, vals, fresh_consts):
        """Decide, before an in-place op runs, how each written argument keeps its
        lineage sound (Invariant 4). Returns (versioned leaves, snapshots)."""
        versioned: list[int] = []
        snaps: dict[int, tuple[torch.Tensor, int]] = {}
        if not written:
            return versioned, snaps
        core = self.core
        for k in written:
            node = nodes[k]
            if node is not None:
                twice = sum(1 for j in written if nodes[j] is node) > 1
                if not twice and core.is_private(node.tid):
                    versioned.append(k)  # the old value keeps its lineage; a new version
                    continue
                self._invalidate(core.members(node.tid))  # aliased: pin the pool
            else:
                self._writes_to_plain_leaf(vals[k], tids[k])
        if facts.fresh_returns or versioned:
            # The recipe must read the pre-op value of arguments that are not versioned.
            for k in written:
                if k not in versioned:
                    snap = copy_preserving_layout(vals[k])
                    snaps[k] = (snap, self._constant(snap, fresh_consts))
        return versioned, snaps

    def _record(
        self,
        func,
        facts,
        call,
        out,
        nodes,
        tids,
        vals,
        written,
        versioned,
        snaps,
        captured,
        cost,
        extra_inputs,
    ):
        """Tell the core about the outputs, wrap them, and build the recipe."""
        kinds: list[int] = []
        refs: list[int] = []
        nbytes: list[int] = []
        specs: list[tuple[int, int]] = []
        produced: list[torch.Tensor] = []
        for k in versioned:
            kinds.append(VERSION)
            refs.append(tids[k])
            nbytes.append(0)
            specs.append((VERSION_SPEC, k))
            produced.append(vals[k])
        replacements: dict[tuple[int, int], object] = {}
        keys = None
        for i, j, o in returns_of(facts, out):
            k = _identity(o, vals, written)
            if k >= 0:  # an in-place op returned its argument
                replacements[(i, j)] = call.leaves[k]
                continue
            if keys is None:
                keys = {v.untyped_storage()._cdata: k for k, v in enumerate(vals)}
            src = keys.get(o.untyped_storage()._cdata, -1)
            if src >= 0:
                if nodes[src] is None:  # a view of a constant stays plain
                    replacements[(i, j)] = o
                    continue
                kinds.append(VIEW)
                refs.append(tids[src])
                nbytes.append(0)
            else:
                kinds.append(NEW)
                refs.append(-1)
                nbytes.append(o.untyped_storage().nbytes())
            specs.append((i, j))
            produced.append(o)
        if not kinds:
            return rebuild_returns(facts, out, replacements), ()
        inputs = list(tids)
        rec_inputs: list = [
            nodes[k] if nodes[k] is not None else call.leaves[k] for k in range(len(tids))
        ]
        for k, (snap, snap_tid) in snaps.items():
            inputs[k] = snap_tid
            rec_inputs[k] = snap
        out_tids = self.core.record(inputs + extra_inputs, cost, kinds, refs, nbytes)
        args, kwargs = substitute(call.args, call.kwargs, call.where, [None] * len(tids))
        rec = Recipe(
            func,
            facts,
            args,
            kwargs,
            call.where,
            rec_inputs,
            tuple(written),
            specs,
            captured,
            torch.is_grad_enabled(),
        )
        name = facts.name
        fresh: list[int] = []
        for (i, j), tid, value, kind in zip(specs, out_tids, produced, kinds):
            node = Node(tid, value, name, value.shape)
            self._set_node(tid, node)
            rec.outputs.append(node)
            if kind == VERSION:
                call.leaves[j]._dtr_ref.node = node
            else:
                fresh.append(tid)
                replacements[(i, j)] = CheckpointTensor(Ref(node, self), value)
        self._set_recipe(self.core.recipe_of(out_tids[0]), rec)
        self._drain()
        return rebuild_returns(facts, out, replacements), fresh

    def _settle(self, fresh, func) -> None:
        """Op boundary: evict until resident bytes fit the budget (Invariant 6). The
        op's own outputs are protected while choosing victims."""
        core = self.core
        for tid in fresh:
            core.lock(tid)
        try:
            ok = core.make_room(0)
        finally:
            for tid in fresh:
                core.unlock(tid)
        if not ok:
            self._drain()
            requested = sum(core.pool_bytes(t) for t in fresh)
            raise self._budget_error(requested, f"running {func}")
        if self.config.stress:
            core.evict_all()
        self._drain()
        if self.config.check:
            core.check()

    # ================================================================== values
    def _value(self, node: Node) -> torch.Tensor:
        value = node.value
        if value is None:
            self._rematerialize(node.tid)
            value = node.value
            if value is None:
                raise InternalError(f"dtr: rematerializing {node.describe()} left no value")
        return value

    def _rematerialize(self, tid: int) -> None:
        """Rerun the recipes that rebuild tid, as the core schedules them (Invariant 7:
        iterative). The caller holds tid locked."""
        core = self.core
        core.remat_begin(tid)
        finished = False
        try:
            while True:
                rid = core.remat_step()
                if rid < 0:
                    break
                rec = self.recipes[rid]
                need = core.remat_bytes(rid)
                if not core.make_room(need):
                    raise self._budget_error(need, f"recomputing {rec.facts.name}")
                self._drain()
                stolen = core.steals(rid)
                start = _perf()
                values = rec.replay(stolen)
                self.recompute_seconds += _perf() - start
                nbytes = []
                for node, value in zip(rec.outputs, values):
                    if node.tid >= 0 and node.value is None:
                        node.value = value
                    nbytes.append(value.untyped_storage().nbytes())
                core.remat_done(rid, nbytes, stolen)
            finished = True
        finally:
            if not finished:
                core.remat_abort()
            self._drain()

    def _invalidate(self, seeds: list[int]) -> None:
        """The value of seeds is about to change in place and cannot keep its lineage.
        Every tensor the program holds whose lineage reads it is materialized now and
        pinned; lineage nobody needs any more is dropped (Invariants 3 and 4)."""
        core = self.core
        todo = list(seeds) + core.descendants(seeds)
        held: list[int] = []
        try:
            for t in todo:
                if core.ext(t) > 0 and not core.is_materialized(t) and not core.is_constant(t):
                    core.lock(t)
                    held.append(t)
                    self._rematerialize(t)
            for t in todo:
                core.pin(t)
        finally:
            for t in held:
                core.unlock(t)
            self._drain()

    def _writes_to_plain(self, call: Call, writes) -> None:
        for k, t in enumerate(call.leaves):
            if call.positions[k] in writes:
                key = t.untyped_storage()._cdata
                self._writes_to_plain_leaf(t, self.storages.get(key, -1))

    def _writes_to_plain_leaf(self, t: torch.Tensor, tid: int) -> None:
        """A plain tensor is about to be written: recipes that read its old value become
        invalid (the optimizer updating parameters is the common case)."""
        if tid >= 0 and self.core.has_consumers(tid):
            self._invalidate([tid])
        key = t.untyped_storage()._cdata
        node = self.escaped.get(key)
        if node is not None:
            if node.tid >= 0:
                self._invalidate(self.core.members(node.tid))
            else:
                del self.escaped[key]

    # ================================================================== constants
    def _constant(self, t: torch.Tensor, fresh: list[int]) -> int:
        """Core tensor of a plain tensor an op reads (one per storage): never evicted
        (Invariant 3), counted while a recipe reads it. A new one is held for the op in
        flight (listed in fresh) until its recipe is recorded."""
        storage = t.untyped_storage()
        key = storage._cdata
        tid = self.storages.get(key)
        if tid is not None:
            return tid
        tid = self.core.new_constant(storage.nbytes())
        self._set_node(tid, Node(tid, None, "constant", t.shape))
        self.storages[key] = tid
        self.const_keys[tid] = key
        fresh.append(tid)
        if t.requires_grad:
            self._hook_leaf(t)
        return tid

    def _hook_leaf(self, t: torch.Tensor) -> None:
        leaf = t if t.is_leaf else t._base
        if leaf is None or not leaf.is_leaf or not leaf.requires_grad:
            return
        if getattr(leaf, "_dtr_hooked", None) is self._token:
            return
        leaf._dtr_hooked = self._token
        self.hooks.append(leaf.register_post_accumulate_grad_hook(self._grad_ready))

    def _grad_ready(self, param: torch.Tensor) -> None:
        # Optimizers (foreach and fused paths included) see plain gradients.
        grad = param.grad
        if isinstance(grad, CheckpointTensor) and grad._dtr_ref.runtime is self:
            param.grad = self.export(grad._dtr_ref)

    def export(self, ref: Ref) -> torch.Tensor:
        """The plain value of a managed tensor, handed out to live on outside dtr. The
        pool is pinned: a storage the program can write to behind dtr's back must not be
        evicted or recomputed."""
        with self.lock, internal():
            node = ref.node
            self.core.lock(node.tid)
            try:
                value = self._value(node)
            finally:
                self.core.unlock(node.tid)
            self.core.pin(node.tid)
            key = value.untyped_storage()._cdata
            self.escaped[key] = node
            self.escaped_keys[node.tid] = key
            self._drain()
            return value

    def read(self, ref: Ref) -> torch.Tensor:
        """The value of a managed tensor, for reading it at once (repr, tolist)."""
        with self.lock, internal():
            if self.pending_refs:
                self._flush()
            node = ref.node
            self.core.lock(node.tid)
            try:
                return self._value(node)
            finally:
                self.core.unlock(node.tid)
                self._drain()

    # ================================================================== housekeeping
    def _set_node(self, tid: int, node: Node) -> None:
        nodes = self.nodes
        if tid >= len(nodes):
            nodes.extend([None] * (tid + 1 - len(nodes)))
        nodes[tid] = node

    def _set_recipe(self, rid: int, rec: Recipe) -> None:
        recipes = self.recipes
        if rid >= len(recipes):
            recipes.extend([None] * (rid + 1 - len(recipes)))
        recipes[rid] = rec

    def _drain(self) -> None:
        """Mirror the core: drop the values it evicted, forget what it dropped."""
        evicted, dropped, dropped_recipes = self.core.drain()
        nodes = self.nodes
        for t in evicted:
            node = nodes[t]
            if node is not None:
                node.value = None
        for t in dropped:
            node = nodes[t]
            if node is not None:
                node.value = None
                node.tid = -1
                nodes[t] = None
            key = self.const_keys.pop(t, None)
            if key is not None:
                del self.storages[key]
            key = self.escaped_keys.pop(t, None)
            if key is not None and self.escaped.get(key) is node:
                del self.escaped[key]
        recipes = self.recipes
        for r in dropped_recipes:
            recipes[r] = None

    def _flush(self) -> None:
        """Release the handles dropped since the last op (Invariant 5)."""
        core = self.core
        while self.pending_refs:
            refs, self.pending_refs = self.pending_refs, []
            for node in refs:
                if node.tid >= 0:
                    core.release(node.tid)
            self._drain()

    def _describe(self, tid: int) -> str:
        node = self.nodes[tid] if tid < len(self.nodes) else None
        return node.describe() if node is not None else f"tensor {tid}"

    def _budget_error(self, requested: int, what: str) -> BudgetError:
        core = self.core
        rows = core.largest_pinned(5)
        largest = ", ".join(f"{self._describe(t)} {format_bytes(b)}" for t, b in rows)
        return BudgetError(
            f"dtr: cannot stay within the memory budget of "
            f"{format_bytes(self.config.budget_bytes)} while {what}: "
            f"{format_bytes(core.resident_bytes)} resident, {format_bytes(requested)} "
            f"requested, {format_bytes(core.pinned_bytes())} pinned (constants and tensors "
            f"that cannot be recomputed) and {format_bytes(core.locked_bytes())} locked by "
            f"the running op, none of which can be evicted. Largest unevictable: "
            f"{largest or 'none'}. Raise the budget or reduce the batch size."
        )

    def close(self) -> None:
        """End of the block: materialize everything the program still holds, so that it
        reads back correctly afterwards, then forget all lineage."""
        with self.lock, internal():
            try:
                self._flush()
                self.core.budget = -1
                for tid in self.core.alive():
                    node = self.nodes[tid]
                    if node is not None and node.value is None:
                        self.core.lock(tid)
                        try:
                            self._rematerialize(tid)
                        finally:
                            self.core.unlock(tid)
                self._drain()
            finally:
                self.is_open = False
                for handle in self.hooks:
                    handle.remove()
                self.hooks.clear()
                self.storages.clear()
                self.const_keys.clear()
                self.escaped.clear()
                self.escaped_keys.clear()
                self.pending_refs.clear()
                self.recipes = []


def _wants_management(call: Call) -> bool:
    """An op on plain tensors only is managed when autograd will need its output: grad
    mode is on and an input requires grad. Model construction, optimizer steps and
    data preprocessing stay plain."""
    if not torch.is_grad_enabled():
        return False
    for t in call.leaves:
        if t.requires_grad:
            return True
    return False


def _identity(o, vals, written) -> int:
    for k in written:
        if vals[k] is o:
            return k
    return -1


def _device_of(leaves) -> torch.device:
    for t in leaves:
        return t.device
    return torch.device("cpu")


def _unwrap_foreign(call: Call, rt: Runtime):
    """Wrappers of an ended session are plain tensors to a new one."""
    values = [
        materialize_ref(t._dtr_ref)
        if isinstance(t, CheckpointTensor) and t._dtr_ref.runtime is not rt
        else t
        for t in call.leaves
    ]
    return substitute(call.args, call.kwargs, call.where, values)


# ====================================================================== special ops
def _detach(rt: Runtime, func, facts, call: Call, managed: bool):
    # Invariant: detach of a managed tensor aliases the same Ref, even while evicted
    # (autograd detaches saved tensors it has not unpacked yet).
    t = call.leaves[0] if call.leaves else None
    if not managed or not isinstance(t, CheckpointTensor):
        return func(*call.args, **call.kwargs)
    return CheckpointTensor(t._dtr_ref, t)


_SPECIAL = {aten.detach.default: _detach}


# ====================================================================== outside the mode
def materialize_ref(ref: Ref, export: bool = False) -> torch.Tensor:
    rt = ref.runtime
    if rt.is_open:
        return rt.export(ref) if export else rt.read(ref)
    value = ref.node.value
    if value is None:
        raise DTRError(
            "dtr: this tensor was evicted and could not be recomputed when its "
            "dtr.enable() block ended"
        )
    return value


def dispatch_without_mode(func, args: tuple, kwargs: dict):
    """An op on a CheckpointTensor with dtr's mode not active on this thread: after the
    block ended (plain semantics: run on the values, return plain tensors), or on
    another thread while it is active (served by the same runtime, under its lock)."""
    facts = op_facts(func)
    call = Call(facts, args, kwargs)
    for t in call.leaves:
        if isinstance(t, CheckpointTensor) and t._dtr_ref.runtime.is_open:
            return t._dtr_ref.runtime.handle(func, args, kwargs)
    values = [
        materialize_ref(t._dtr_ref) if isinstance(t, CheckpointTensor) else t for t in call.leaves
    ]
    new_args, new_kwargs = substitute(call.args, call.kwargs, call.where, values)
    return func(*new_args, **new_kwargs)
