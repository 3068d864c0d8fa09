"""The live runtime: runs each op, records its lineage in the core, evicts and recomputes.

One ``Runtime`` per :func:`dtr.enable` session. Its dispatch mode hands it every op; it
decides whether the op is managed, materializes the op's inputs (recomputing evicted ones
from their lineage), runs the op, records the outputs, and evicts until resident bytes
fit the budget again. With the C++ core, ops go first to the per-op fast path
(``csrc/subclass/fastpath.cpp``, ``Runtime.dispatch``), which does the same for the common op in
one call into C++ and hands every other op to ``handle()``. The bookkeeping is the
core's (``dtr._C.Core`` or its Python twin); this module holds the values and executes
recipes. Numbered invariants: ``docs/design.md``.
"""

from __future__ import annotations

import contextlib
import importlib
import sys
import threading
import time
import types
import warnings

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.multiprocessing.reductions import StorageWeakRef
from torch.optim.optimizer import register_optimizer_step_post_hook

from ... import cost as _cost
from ... import data_setter
from ... import device as _device
from ...config import DTRConfig
from ...core import core_class
from ...core.rebuild import Rebuilder
from ...core.reference import NEW, VERSION, VIEW
from ...errors import (
    BudgetError,
    InternalError,
    UnsupportedError,
    budget_advice,
    floor_of,
    no_autograd_message,
)
from ...grads import hand_out
from ...leaf_hooks import LeafHooks, leaf_to_hook, reads_call_for_hooks
from ...schema import OpFacts, op_facts
from ...step_log import StepStats, StepTracker
from ...timeline import Recorder
from ...units import format_bytes
from . import oom, rng
from . import recipe as _recipe
from .kernel_peaks import KernelMeter, OutputSizes
from .rebuildable_plain import FACTORIES, TRANSPOSES, FreshFactories, FreshTransposes
from .recipe import VERSION_SPEC, Rebuilt, Recipe, StandIn, copy_preserving_layout
from .storage_keys import SPARSE_LAYOUTS, freed, parts, storage_key
from .tensor import (
    CheckpointTensor,
    Node,
    Ref,
    _serials,
    dispatch_without_mode,
    materialize_ref,
    own_tensor,
    take_geometry,
)
from .tensor_args import TensorArgs, rebuild_returns, returns_of, substitute
from .trace import TraceWriter
from .view_replay import ViewReplay
from .volatile import Snapshots

aten = torch.ops.aten
_perf = time.perf_counter

# Whether sessions on the C++ core serve common ops through the C++ fast path
# (csrc/subclass/fastpath.cpp). Tests and benchmarks turn it off to compare it with handle().
FAST_PATH = True


@contextlib.contextmanager
def internal():
    """Run plain-tensor code from outside an op (hooks, materialize, exit) without dtr's
    mode seeing it and without autograd recording it."""
    with torch._C._DisableTorchDispatch(), torch._C._AutoDispatchBelowAutograd():
        yield


class _Op:
    """What the runtime knows about one managed op call while it handles it."""

    __slots__ = (
        "func",
        "facts",
        "call",
        "nodes",
        "tids",
        "vals",
        "written",
        "versioned",
        "snaps",
        "captured",
        "cost",
        "extra",
        "fresh",
        "held",
        "inputs",
        "key",
        "kernel_peak",
        "rebuilt",
    )

    def __init__(self, func, facts: OpFacts, call: TensorArgs):
        n = len(call.leaves)
        self.func = func
        self.facts = facts
        self.call = call
        self.nodes: list[Node | None] = [None] * n  # per leaf: managed node, or None
        self.tids = [0] * n  # per leaf: core tensor (constants included)
        self.vals: list = [None] * n  # per leaf: the plain value the op runs on
        self.written: list[int] = []  # leaves the op writes
        self.versioned: list[int] = []  # written leaves that get a new version
        self.snaps: dict[int, tuple[torch.Tensor, int]] = {}  # leaf -> (snapshot, its tid)
        self.captured = None  # RNG state to replay
        self.cost = 0.0
        self.extra: list[int] = []  # core inputs beyond the leaves (RNG state, sparse parts)
        self.fresh: list[int] = []  # constants first registered for this call
        self.held: list[int] = []  # older constants it reads, held while it invalidates
        self.inputs: list[int] | None = None  # the core inputs of the recorded recipe
        self.key: tuple | None = None  # its OutputSizes key, when sizes are learned
        self.kernel_peak = -1  # what its kernel had allocated at most (KernelMeter)
        self.rebuilt: dict[int, Rebuilt] = {}  # sparse leaves the recipe takes again


class Runtime(Rebuilder):
    def __init__(self, config: DTRConfig):
        self.config = config
        # measure="allocator": the budget counts the whole device (measure_device)
        self.meter = _device.allocator_meter() if config.measure == "allocator" else None
        self.unmanaged_bytes = 0  # what the meter read beyond dtr's count, last boundary
        budget = -1 if config.budget_bytes is None else config.budget_bytes
        self.core, self.core_kind = _make_core(config, budget)
        self.nodes: list[Node | None] = []
        self.recipes: list[Recipe | None] = []
        self.storages: dict[int, int] = {}  # storage key -> constant tid
        self.const_keys: dict[int, int] = {}  # constant tid -> storage key
        # constant tid -> its storage, kept while the constant lives: a recipe checks at
        # replay that each plain tensor it reads still has the storage it had (`p.data =`
        # swaps a tensor's storage with no op and no new version), and a key is an
        # address, which a storage made later could take if this one were freed.
        self.const_storages: dict[int, torch.UntypedStorage] = {}
        self.escaped: dict[int, Node] = {}  # storage key -> managed node handed out plain
        self.escaped_keys: dict[int, int] = {}  # its tid -> storage key
        self.snapshots = Snapshots()  # what recipes read of volatile memory
        # storage key -> weak reference: plain memory handed out by address in the block
        # (dtr/plain_exports.py), volatile while it lives
        self.exported_plain: dict[int, StorageWeakRef] = {}
        self.pending_refs: list[Node] = []  # handles the program dropped
        self.hooks: list = []  # the session's own hooks, removed at close
        self.leaf_hooks = LeafHooks()  # on the leaves ops read under grad mode
        self.lock = threading.RLock()
        self.is_open = True
        self.recompute_seconds = 0.0
        self.oom_retries = 0
        self.model_cost = config.cost_model == "roofline"
        self.trace = TraceWriter(config.trace, config) if config.trace else None
        self.timeline = Recorder(config.timeline) if config.timeline else None
        self.sizes = OutputSizes()
        self.kernel_meter = KernelMeter()  # detached by close()
        self.fresh = FreshFactories()  # zeros(...) and kin made in the block (rebuildable_plain.py)
        self.transposes = FreshTransposes()  # adj.t() and kin of plain sparse tensors
        self.view_replay = ViewReplay(self)  # where autograd's view replay shows
        # the session's peak_bytes and max_bytes before the last take_step_peak()
        self.peak_carry = self.max_carry = 0
        # (peak, max transient) when close() lifted the budget: materializing what the
        # program holds at the end is not an op boundary and must not count.
        self.closing_peaks: tuple[int, int] | None = None
        self._stealing: tuple[Recipe, list[int]] | None = None  # see rematerialize()
        self.steps = StepTracker(self)
        # What the dispatch mode calls for every op: the C++ fast path, or handle().
        self._fast = self._fast_path()
        self.dispatch = self._fast or self.handle
        # A step ends at every optimizer.step() while the session is open (end_step).
        self.hooks.append(
            register_optimizer_step_post_hook(lambda *_: self._end_step_from_hook())
        )

    # ================================================================== entry
    def _fast_path(self):
        """The per-op fast path in C++ (csrc/subclass/fastpath.cpp), which serves the common op
        with the same core calls as handle() and hands every other op to it. Only with
        the C++ core, and without a trace or timeline (those are written here)."""
        if not FAST_PATH or self.core_kind != "c++":
            return None
        if self.trace is not None or self.timeline is not None:
            return None
        _C = importlib.import_module("dtr._C")
        return _C.FastPath(
            self,
            _FAST_TYPES,
            self.config.stress,
            self.config.check,
            self.model_cost,
            self.meter is not None,
        )

    def fast_route(self, func) -> tuple[OpFacts, bool, int, bool, bool]:
        """How the fast path may serve func's calls, asked once per op overload:
        (facts, whether calls on managed tensors that write nothing may run there, what
        calls on plain tensors only may do there (_PLAIN_*), whether it is detach,
        whether calls that write managed tensors may run there when each written one
        gets a new version). None of handle()'s special cases may apply."""
        facts = op_facts(func)
        special = (
            facts.hidden_writes is not None
            or facts.meta_only
            or facts.view_inplace is not None
            or facts.metadata_inplace
            or facts.collective
            or facts.no_autograd
            or bool(facts.plain_returns)
            or func in _SPECIAL
        )
        managed = not special and not facts.writes
        # An op that returns a fresh tensor besides what it writes needs a snapshot of
        # the written value for its recipe (_prepare_writes): handle()'s.
        # An out= op may resize what it writes, which the wrapper must follow (handle()'s).
        writes_managed = (
            not special and bool(facts.writes) and not facts.fresh_returns and not facts.out_form
        )
        if (
            facts.collective
            or facts.hidden_writes is not None
            or facts.no_autograd  # handle() refuses it where an input requires grad
            or func in _SPECIAL
            or func in FACTORIES  # handle() remembers what they make
        ):
            plain = _PLAIN_NO
        elif facts.writes:
            plain = _PLAIN_WRITE if facts.view_inplace is None else _PLAIN_NO
        else:
            plain = _PLAIN_READ
        return facts, managed, plain, func is aten.detach.default, writes_managed

    def handle(self, func, args: tuple, kwargs: dict):
        with self.lock:
            if not self.is_open:
                # Another thread's op waited for the lock while the block ended: the
                # wrappers are plain tensors now, and a closed runtime must not record
                # (stress mode would evict values that nothing can recompute any more).
                return dispatch_without_mode(func, args, kwargs)
            if self.pending_refs:
                self._flush()
            if self.view_replay.graph_hazard is not None:
                self.view_replay.check_graph()
            facts = op_facts(func)
            call = TensorArgs(facts, args, kwargs)
            if facts.no_autograd and torch.is_grad_enabled():
                if any(t.requires_grad for t in call.leaves):
                    raise UnsupportedError(no_autograd_message(facts.name))
            managed = meta = False
            other = None  # a non-strided leaf: sparse, nested, mkldnn
            for t in call.leaves:
                if type(t) is CheckpointTensor or isinstance(t, CheckpointTensor):
                    if t._dtr_ref.runtime is not self:
                        return self.handle(func, *_unwrap_foreign(call, self))
                    managed = True
                elif t.layout != torch.strided and (other is None or other in SPARSE_LAYOUTS):
                    other = t.layout
                else:
                    meta = meta or t.is_meta or isinstance(t, FakeTensor)
            if meta and not managed:
                # Meta and fake tensors hold no memory and have nothing to recompute.
                # torch.export's tracing runs ops on FakeTensors through dtr's mode:
                # managed, they counted phantom bytes against the budget, and a failed
                # block's close() could not read their values back ("Cannot copy out of
                # meta tensor").
                return func(*args, **kwargs)
            if other is torch.jagged and managed:
                # A nested jagged tensor is a Python subclass over a values tensor: let
                # it serve the op, on its values, whose ops reach dtr with the managed
                # ones (torch.nested.as_nested_tensor of managed tensors, then any op
                # mixing one with a managed tensor, which was refused).
                return NotImplemented
            if other is not None and (
                other not in SPARSE_LAYOUTS or self._writes_sparse(facts, call)
            ):
                return self._run_other_layout(func, facts, call, managed, other, args, kwargs)
            # (dtr manages no sparse tensor's parts; a sparse tensor an op only reads, a
            # graph's adjacency in torch.sparse.mm, is a constant of its recipe:
            # dtr/engines/subclass/storage_keys.py)
            if managed and facts.collective:
                return self._run_collective(func, facts, call)
            special = _SPECIAL.get(func)
            if special is not None:
                return special(self, func, facts, call, managed)
            writes = facts.writes
            if facts.hidden_writes is not None:
                writes = writes | set(facts.hidden_writes(call.schema_values(facts)))
            if not managed:
                if writes and facts.view_inplace is None:  # t_() and kin change no data
                    self._writes_to_plain(call, writes)
                    return func(*args, **kwargs)
                if func in FACTORIES:
                    out = func(*args, **kwargs)
                    self.fresh.remember(out, func, args, kwargs)
                    return out
                if other is not None and func in TRANSPOSES:
                    out = func(*args, **kwargs)
                    self.transposes.remember(out, func, args, kwargs)
                    return out
                # meta-only ops (zeros_like(p)...) make values no gradient flows from:
                # optimizer state made outside no_grad (Adagrad's) stays plain
                if facts.view or facts.meta_only or not _wants_management(call):
                    if not (torch.is_grad_enabled() or facts.view) and reads_call_for_hooks():
                        self._hook_plain_reads(call, writes)
                    return func(*args, **kwargs)
            elif facts.meta_only:
                return self._run_meta_only(func, facts, call)
            elif facts.view_inplace is not None:
                return self._run_view_inplace(func, facts, call)
            elif facts.metadata_inplace:
                raise UnsupportedError(
                    f"dtr: {facts.name} replaces the storage of a managed tensor in place, "
                    "which dtr does not support; use the out-of-place op, or "
                    "dtr.materialize() the tensor first"
                )
            if facts.out_form:
                _refuse_shared_resize(func, facts, call)
            return self._run(func, facts, call, writes)

    # ================================================================== managed op
    def _run(self, func, facts: OpFacts, call: TensorArgs, writes):
        core = self.core
        op = _Op(func, facts, call)
        n = len(call.leaves)
        # managed stand-ins for fresh factory outputs, made (and held) before any constant
        # is registered for this op, which an error in between would leave held
        adopted = {}
        if any(t.layout in SPARSE_LAYOUTS for t in call.leaves):
            for k, t in enumerate(call.leaves):
                made = self._fresh_stand_in(t, call, k, writes)
                if made is not None:
                    adopted[k] = made
        for k, t in enumerate(call.leaves):
            if isinstance(t, CheckpointTensor) or k in adopted:
                node = (t if k not in adopted else adopted[k])._dtr_ref.node
                op.nodes[k] = node
                op.tids[k] = node.tid
            elif t.layout is torch.strided:
                op.tids[k] = self._constant(t, op.fresh)
                op.vals[k] = t
            else:  # a sparse tensor: each part's storage is a constant
                # (or its source's, for a transpose the recipe takes again:
                # dtr/engines/subclass/rebuildable_plain.py)
                rebuilt = self.transposes.rebuilt_for(t, facts.name)
                first, *rest = parts(t if rebuilt is None else rebuilt.args[0])
                op.tids[k] = self._constant(first, op.fresh)
                op.extra.extend(self._constant(p, op.fresh) for p in rest)
                op.vals[k] = t
                if rebuilt is not None:
                    op.rebuilt[k] = rebuilt
        if writes:
            op.written = [k for k in range(n) if call.positions[k] in writes]
        managed = [k for k in range(n) if op.nodes[k] is not None]
        reserve = 0
        if core.budget >= 0 or self.trace is not None:
            op.key, reserve = self.sizes.predict(func, call.leaves)
        if self.trace is not None:
            self.trace.phase(torch._C._current_graph_task_id() != -1)
            self.trace.inputs([op.nodes[k].label for k in managed], reserve)
        locked: list[int] = []
        recorded = False
        try:
            for k in managed:
                core.lock(op.tids[k])
                locked.append(op.tids[k])
            for k in managed:
                op.vals[k] = self._value(op.nodes[k])
            if reserve and 0 <= core.budget < core.resident_bytes + reserve:
                # Room for the outputs before they exist (dtr/engines/subclass/kernel_peaks.py); if
                # it cannot be made, the op boundary after the op reports the budget.
                core.make_room(reserve)
                self.drain()
            self._prepare_writes(op)
            if facts.out_form:
                # The kernel may resize what it writes: a new version's gets a tensor of its
                # own over the storage, so that the old value keeps its geometry.
                for k in op.versioned:
                    op.vals[k] = own_tensor(op.vals[k])
            if facts.fresh_returns or op.versioned:
                self._snapshot_volatile(op)
            captured = None
            if facts.seeded or facts.may_draw:
                gen = call.argument(facts, facts.generator) if facts.generator >= 0 else None
                captured = rng.capture(gen, _device_of(call.leaves))
            real_args, real_kwargs = substitute(call.args, call.kwargs, call.where, op.vals)
            in_use = self.kernel_meter.mark() if op.key is not None else -1
            start = _perf()
            try:  # (the retry is off the fast path: a try costs nothing until it raises)
                out = func(*real_args, **real_kwargs)
            except torch.OutOfMemoryError as exc:
                out = self.retry_after_oom(
                    exc, func, real_args, real_kwargs, not op.written, captured
                )
            op.cost = _perf() - start
            if facts.seeded or (captured is not None and rng.drew(captured)):
                op.captured = captured
                # The saved generator state is memory the recipe holds: count it.
                op.extra.append(self._constant(captured[1], op.fresh))
            op.kernel_peak = self.kernel_meter.peak_since(in_use)
            cpu = (not op.vals or op.vals[0].is_cpu) and _first_cpu(out)  # (a factory: none)
            if self.model_cost or not cpu:
                # On an accelerator the wall time around an asynchronous kernel is its
                # launch only, so the deterministic model stands in (dtr/cost.py); a
                # copy between devices counts as on the accelerator either way.
                op.cost = _cost.roofline(func, real_args, real_kwargs, out)
            result, protect = self._record(op, out)
            recorded = True
            if facts.out_form:
                self._take_resized(op)
        finally:
            for tid in locked:
                core.unlock(tid)
            for tid in op.fresh:  # now held by the recipe, or by nothing
                if self.trace is not None and not recorded:
                    self.trace.release(self._label(tid))
                core.release(tid)
            for tid in op.held:
                core.release(tid)
            if not recorded:
                # The op raised: the constants it registered may be gone from the core
                # now. Mirror that before the program goes on, or a new tensor whose
                # storage lands at a dead one's address would be taken for it.
                self.drain()
        self._settle(protect, func)
        return result

    def _take_resized(self, op: _Op) -> None:
        """After an out= op: each managed tensor it wrote takes what the kernel made of its
        value (torch.cat(xs, out=c) resizes c as eager does), and the core counts the
        storage's new size."""
        for k in op.written:
            t = op.call.leaves[k]
            if not isinstance(t, CheckpointTensor):
                continue
            value = op.vals[k]
            take_geometry(t, value)
            tid = t._dtr_ref.node.tid
            nbytes = value.untyped_storage().nbytes()
            if nbytes != self.core.pool_bytes(tid):
                self.core.resized(tid, nbytes)

    def _run_collective(self, func, facts: OpFacts, call: TensorArgs):
        """dist.all_reduce(t) and kin on managed tensors (a loss averaged for logging).
        No rank can rerun a collective alone, and c10d's write their tensors in place,
        asynchronously: the managed arguments are handed out as plain tensors, as
        dtr.materialize does (resident and pinned from now on; the wrappers read them),
        then the op runs as on plain tensors and returns plain tensors."""
        values = [
            self.export(t._dtr_ref) if isinstance(t, CheckpointTensor) else t for t in call.leaves
        ]
        args, kwargs = substitute(call.args, call.kwargs, call.where, values)
        if facts.writes:
            self._writes_to_plain(TensorArgs(facts, args, kwargs), facts.writes)
        return func(*args, **kwargs)

    def _run_view_inplace(self, func, facts: OpFacts, call: TensorArgs):
        """x.squeeze_(), x.t_(), ...: x becomes a view of what it was. Its data does not
        change, so this is the view op, recorded like any other, with x taking the
        result's identity and (through the real kernel) its sizes and strides."""
        x = call.leaves[0]
        view = facts.view_inplace
        y = self._run(view, op_facts(view), TensorArgs(op_facts(view), call.args, call.kwargs), ())
        x._dtr_ref = y._dtr_ref
        with torch._C._DisableTorchDispatch():
            func(*call.args, **call.kwargs)  # metadata only: the wrapper has no data
        return x

    def _run_meta_only(self, func, facts: OpFacts, call: TensorArgs):
        """empty_like(x) and kin: run on a meta stand-in of x, so neither this call nor
        its recomputation needs x's value."""
        device = _device_of(call.leaves)
        stand_ins = [StandIn(t) for t in call.leaves]
        args, kwargs = substitute(call.args, call.kwargs, call.where, [s.get() for s in stand_ins])
        if kwargs.get("device") is None:
            kwargs = {**kwargs, "device": device}
        op = _Op(func, facts, call)
        op.nodes, op.tids, op.vals = [], [], []
        core = self.core
        reserve = 0
        if core.budget >= 0 or self.trace is not None:
            op.key, reserve = self.sizes.predict(func, call.leaves)
        if self.trace is not None:
            self.trace.phase(torch._C._current_graph_task_id() != -1)
            self.trace.inputs([], reserve)
        if reserve and 0 <= core.budget < core.resident_bytes + reserve:
            core.make_room(reserve)  # room for its output before it exists (kernel_peaks.py)
            self.drain()
        if facts.seeded:
            op.captured = rng.capture(None, device)
            op.extra.append(self._constant(op.captured[1], op.fresh))
        in_use = self.kernel_meter.mark() if op.key is not None else -1
        start = _perf()
        try:
            out = func(*args, **kwargs)
        except BaseException:
            for tid in op.fresh:  # the generator state's constant: held by nothing
                self.core.release(tid)
            self.drain()
            raise
        op.cost = _perf() - start
        kernel_peak = self.kernel_meter.peak_since(in_use)
        if self.model_cost or not out.is_cpu:
            op.cost = _cost.roofline(func, args, kwargs, out)
        nbytes = out.untyped_storage().nbytes()
        if op.key is not None:
            self.sizes.learn(op.key, max(nbytes, kernel_peak))
        out_tids = self.core.record(op.extra, op.cost, [NEW], [-1], [nbytes], facts.name)
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
            op.captured,
            torch.is_grad_enabled(),
        )
        node = Node(out_tids[0], out, facts.name, out.shape)
        self._set_node(node.tid, node)
        rec.outputs.append(node)
        self._set_recipe(self.core.recipe_of(node.tid), rec)
        if self.trace is not None:
            self._trace_call(op, out_tids, [NEW], [-1])
        for tid in op.fresh:
            self.core.release(tid)
        self.drain()
        result = CheckpointTensor(Ref(node, self), out)
        self._settle([node.tid], func)
        return result

    def _prepare_writes(self, op: _Op) -> None:
        """Decide, before an in-place op runs, how each written argument keeps its
        lineage sound (Invariant 4): a new version, or invalidation and a snapshot."""
        if not op.written:
            return
        core = self.core
        invalid: list[int] = []  # written leaves whose old value loses its lineage
        for k in op.written:
            node = op.nodes[k]
            if node is not None:
                twice = sum(1 for j in op.written if op.nodes[j] is node) > 1
                if not twice and core.is_private(node.tid):
                    op.versioned.append(k)  # the old value keeps its lineage
                    continue
            invalid.append(k)
        if invalid:
            # Invalidation pins what reads the old values and drops lineage nobody
            # needs any more, which can drop a constant this op reads: several written
            # views of one storage (cuDNN's flat RNN weights under a foreach optimizer)
            # share one. Each is held until the op ends.
            for k, tid in enumerate(op.tids):
                if op.nodes[k] is None and tid not in op.fresh and tid not in op.held:
                    core.retain(tid)
                    op.held.append(tid)
        for k in invalid:
            # before invalidation drops the lineage that says what the views are
            if op.nodes[k] is not None:
                self.view_replay.on_write(op, k, op.nodes[k])
        for k in invalid:
            node = op.nodes[k]
            if node is not None:
                self.invalidate(core.members(node.tid))  # aliased: pin the pool
            else:
                self._writes_to_plain_leaf(op.vals[k], op.tids[k])
        if op.facts.fresh_returns or op.versioned:
            # The recipe must read the pre-op value of arguments that are not versioned.
            for k in op.written:
                if k not in op.versioned:
                    snap = copy_preserving_layout(op.vals[k])
                    op.snaps[k] = (snap, self._constant(snap, op.fresh))

    def _snapshot_volatile(self, op: _Op) -> None:
        """The recipe reads a snapshot of each argument in volatile memory (exported, or
        foreign: dtr/engines/subclass/volatile.py), which can change with no op dtr sees. A view's
        outputs share the argument's pool or stay plain, and are never rebuilt from it."""
        if op.facts.view:
            return
        escaped = self.escaped
        for k, t in enumerate(op.vals):
            if k in op.snaps or k in op.written or t is None or t.layout is not torch.strided:
                continue
            if op.nodes[k] is None:
                storage = self.const_storages[op.tids[k]]
                volatile = (
                    not storage.resizable()
                    or storage._cdata in escaped
                    or self._exported_plain(storage._cdata)
                )
            else:
                volatile = bool(escaped) and storage_key(t) in escaped
            if volatile:
                snap = self.snapshots.take(t)
                op.snaps[k] = (snap, self._constant(snap, op.fresh))

    def _exported_plain(self, key: int) -> bool:
        ref = self.exported_plain.get(key)
        if ref is None:
            return False
        if ref.expired():  # a dead storage's address, taken by a new one
            del self.exported_plain[key]
            return False
        return True

    def plain_exported(self, t: torch.Tensor) -> None:
        """A plain tensor's memory is handed out by address (dtr/plain_exports.py): a
        write of unknown content now and at any time after. What read it so far is
        materialized and pinned, as before an op writes it; later recipes read snapshots
        of it (_snapshot_volatile)."""
        if isinstance(t, CheckpointTensor):
            return

        def exported(p: torch.Tensor, key: int) -> None:
            if key in self.escaped:  # a managed value's, handed out by export()
                return
            self._writes_to_plain_leaf(p, self.storages.get(key, -1))
            self.exported_plain[key] = StorageWeakRef(torch._C.TensorBase.untyped_storage(p))

        self._on_plain_parts(t, exported)

    def _on_plain_parts(self, t: torch.Tensor, each) -> None:
        """each(part, its storage key) for every part of plain t, under the session's lock
        with pending drops flushed first and evictions drained after (nothing once the
        session is closed): what the program did to the memory behind dtr's back."""
        with self.lock, internal():
            if not self.is_open:
                return
            if self.pending_refs:
                self._flush()
            for p in parts(t):
                each(p, storage_key(p))
            self.drain()

    def _record(self, op: _Op, out):
        """Tell the core about the op's outputs, wrap them, and build the recipe.
        Returns (the op's result for the program, the outputs to protect while settling)."""
        kinds: list[int] = []
        refs: list[int] = []
        nbytes: list[int] = []
        specs: list[tuple[int, int]] = []
        produced: list[torch.Tensor] = []
        for k in op.versioned:
            kinds.append(VERSION)
            refs.append(op.tids[k])
            nbytes.append(0)
            specs.append((VERSION_SPEC, k))
            produced.append(op.vals[k])
        replacements: dict[tuple[int, int], object] = {}
        keys = None
        fresh_keys: dict[int, int] = {}  # storage -> its NEW output's index in kinds
        for i, j, o in returns_of(op.facts, out):
            k = _identity(o, op.vals, op.written)
            if k >= 0:  # an in-place op returned its argument
                replacements[(i, j)] = op.call.leaves[k]
                continue
            if o.layout != torch.strided or i in op.facts.plain_returns:
                continue  # a sparse result, or metadata kernels read: stays plain
            if keys is None:
                keys = {storage_key(v): k for k, v in enumerate(op.vals)}
            storage = o.untyped_storage()
            key = storage._cdata
            src = keys.get(key, -1)
            if src >= 0:
                if op.nodes[src] is None:  # a view of a constant stays plain
                    replacements[(i, j)] = o
                    continue
                kinds.append(VIEW)
                refs.append(op.tids[src])
                nbytes.append(0)
            elif (q := fresh_keys.get(key, -1)) >= 0:
                # a view of an earlier output's fresh storage (cuDNN's RNN weight
                # gradients: views of one buffer), counted once
                kinds.append(VIEW)
                refs.append(-(q + 1))
                nbytes.append(0)
            else:
                fresh_keys[key] = len(kinds)
                kinds.append(NEW)
                refs.append(-1)
                nbytes.append(storage.nbytes())
            specs.append((i, j))
            produced.append(o)
        if op.key is not None:
            self.sizes.learn(op.key, max(sum(nbytes), op.kernel_peak))
        if not kinds:
            if self.trace is not None:
                self._trace_call(op, [], [], [])
            return rebuild_returns(op.facts, out, replacements), ()
        inputs = list(op.tids)
        rec_inputs: list = [
            op.nodes[k] if op.nodes[k] is not None else op.rebuilt.get(k, op.call.leaves[k])
            for k in range(len(op.tids))
        ]
        for k, (snap, snap_tid) in op.snaps.items():
            inputs[k] = snap_tid
            rec_inputs[k] = snap
        op.inputs = inputs + op.extra
        out_tids = self.core.record(op.inputs, op.cost, kinds, refs, nbytes, op.facts.name)
        args, kwargs = substitute(
            op.call.args, op.call.kwargs, op.call.where, [None] * len(op.tids)
        )
        rec = Recipe(
            op.func,
            op.facts,
            args,
            kwargs,
            op.call.where,
            rec_inputs,
            tuple(op.written),
            specs,
            op.captured,
            torch.is_grad_enabled(),
        )
        protect: list[int] = []
        for (i, j), tid, value, kind in zip(specs, out_tids, produced, kinds):
            node = Node(tid, value, op.facts.name, value.shape)
            self._set_node(tid, node)
            rec.outputs.append(node)
            if kind == VERSION:
                op.call.leaves[j]._dtr_ref.node = node
            else:
                protect.append(tid)
                replacements[(i, j)] = CheckpointTensor(Ref(node, self), value)
        self._set_recipe(self.core.recipe_of(out_tids[0]), rec)
        if self.trace is not None:
            self._trace_call(op, out_tids, kinds, refs)
        self.drain()
        return rebuild_returns(op.facts, out, replacements), protect

    def _trace_call(self, op: _Op, outputs: list[int], kinds: list[int], refs: list[int]):
        """CALL line: the core's inputs, the outputs (a view or version names the input
        it aliases by position), and the constants released after it."""
        inputs = op.inputs if op.inputs is not None else op.tids + op.extra
        # an output aliases an input by its position, or this call's earlier output j
        # (refs -(j + 1)) by len(inputs) + j
        aliases = [
            -1 if kind == NEW else inputs.index(ref) if ref >= 0 else len(inputs) - ref - 1
            for kind, ref in zip(kinds, refs)
        ]
        label = self._label
        self.trace.call(
            op.facts.name,
            [label(t) for t in inputs],
            [label(t) for t in outputs],
            op.cost,
            kinds,
            aliases,
            [self.core.pool_bytes(t) for t in outputs],
            [label(t) for t in op.fresh],
        )

    def _label(self, tid: int) -> str:
        return self.nodes[tid].label

    def _settle(self, fresh, func) -> None:
        """Op boundary: evict until resident bytes fit the budget (Invariant 6). The
        op's own outputs are protected while choosing victims."""
        core = self.core
        before = core.resident_bytes if self.timeline is not None else 0
        if self.meter is not None:
            self.measure_device()
        for tid in fresh:
            core.lock(tid)
        try:
            ok = core.make_room(0)
        finally:
            for tid in fresh:
                core.unlock(tid)
        fits = core.op_fits()
        if not ok or not fits:
            self.drain()
            # what did not fit: its fresh outputs, or all it needed at once (the floor)
            requested = (
                sum(core.pool_bytes(t) for t in fresh)
                if fits
                else core.last_need - core.constant_bytes()
            )
            raise self._budget_error(requested, f"running {func}")
        if self.config.stress:
            core.evict_all()
        self.drain()
        if self.timeline is not None:
            self.timeline.add(core, str(func), torch._C._current_graph_task_id() != -1, before)
        if self.config.check:
            core.check()
            self.check_mirror()

    def measure_device(self) -> None:
        """measure="allocator", at an op boundary (before its evictions): the allocator's
        count beyond dtr's own is memory dtr does not manage, and comes off the budget
        the core holds resident bytes to until the next boundary. (The C++ fast path
        calls this too.)"""
        core = self.core
        self.unmanaged_bytes = max(0, self.meter() - core.resident_bytes)
        budget = self.config.budget_bytes
        if budget is not None:
            core.budget = max(0, budget - self.unmanaged_bytes)

    def check_mirror(self) -> None:
        """Check mode: the Python mirror agrees with the core. Every storage dtr knows as
        a constant names a constant the core still has, and that constant names it back."""
        for key, tid in self.storages.items():
            try:
                alive = self.core.is_constant(tid)
            except IndexError:
                alive = False
            if not alive or self.const_keys.get(tid) != key:
                raise InternalError(
                    f"dtr: storage {key:#x} is mapped to constant {tid}, which the core "
                    f"{'has with another storage' if alive else 'no longer has'}"
                )

    # ================================================================== steps
    def step_counters(self) -> tuple:
        """What StepTracker reads (dtr/step_log.py)."""
        core = self.core
        return (
            core.ops,
            core.evictions,
            core.remats,
            self.recompute_seconds,
            core.resident_bytes,
            self.config.budget_bytes,
        )

    def take_step_peak(self) -> tuple[int, int]:
        """(peak, max transient) since the last step ended; the session's are kept in
        peak_carry and max_carry."""
        peak, transient = self.core.peak_bytes, self.core.max_bytes
        self.peak_carry = max(self.peak_carry, peak)
        self.max_carry = max(self.max_carry, transient)
        self.core.reset_peak()
        return peak, transient

    def session_peak(self) -> int:
        if self.closing_peaks is not None:
            return self.closing_peaks[0]
        return max(self.peak_carry, self.core.peak_bytes)

    def transient_peak(self) -> int:
        if self.closing_peaks is not None:
            return self.closing_peaks[1]
        return max(self.max_carry, self.core.max_bytes)

    def _end_step_from_hook(self) -> None:
        if self.is_open:
            self.end_step(summarize=self.config.log_steps)

    def end_step(self, summarize: bool = True) -> StepStats | None:
        """Close a training step: held values whose lineage reaches into an earlier step
        are materialized and pinned (Core.end_step), so that a value carried from step to
        step keeps no lineage of the steps before; with summarize, the step's summary is
        closed and returned (dtr/step_log.py)."""
        with self.lock:
            if self.is_open:
                with internal():
                    if self.pending_refs:  # a handle the program dropped holds nothing
                        self._flush()
                    old = self.core.end_step()
                    if old:
                        self.invalidate(old)
            return self.steps.end() if summarize else None

    # ================================================================== values
    def _value(self, node: Node) -> torch.Tensor:
        value = node.value
        if value is None:
            self.rematerialize(node.tid)
            value = node.value
            if value is None:
                raise InternalError(f"dtr: rematerializing {node.describe()} left no value")
        return value

    # Rebuilder hooks (dtr/core/rebuild.py): rematerialize() and invalidate() come from there.
    def rematerialize(self, tid: int) -> None:
        if self._fast is not None and self._fast.rematerialize(tid):
            return  # the same calls, made from C++ (csrc/subclass/fastpath_remat.cpp)
        self._stealing = None
        try:
            super().rematerialize(tid)
        except BaseException:
            if self._stealing is not None:
                self._after_interrupted_steal()
            raise

    def _after_interrupted_steal(self) -> None:
        """A rerun that writes into the storage of the version it updates (core.steals)
        was interrupted (a KeyboardInterrupt) before remat_done told the core: the core
        may still count that old version as resident though its storage now holds the
        new value, and a second rerun would apply the op twice. Evict everything that
        can be recomputed, the old version included, and forget values the core does
        not count, so that no value is read as another."""
        rec, stolen = self._stealing
        self._stealing = None
        core = self.core
        olds = [rec.inputs[rec.specs[k][1]] for k in stolen]
        if not any(n.tid >= 0 and core.is_materialized(n.tid) for n in olds):
            return  # remat_done ran: the core knows
        core.evict_all()
        self.drain()
        for node in rec.outputs:
            if node.tid >= 0 and not core.is_materialized(node.tid):
                node.value = None

    def after_rerun(self) -> None:
        self._stealing = None  # remat_done told the core: nothing to undo any more

    def rerun(self, rid: int, stolen: list[int]) -> list[int]:
        rec = self.recipes[rid]
        if stolen:
            self._stealing = (rec, stolen)
        start = _perf()
        values = rec.replay(stolen, on_oom=self.retry_after_oom)
        self.recompute_seconds += _perf() - start
        nbytes = []
        for node, value in zip(rec.outputs, values):
            if node.tid >= 0 and node.value is None:
                node.value = value
            nbytes.append(value.untyped_storage().nbytes())
        return nbytes

    # ================================================================== allocator OOM
    def retry_after_oom(self, exc, func, args, kwargs, retry: bool, rng=None):
        """func(*args, **kwargs) raised exc, an allocator out-of-memory: evict and run
        it again (oom.py); retry=False for ops that write to an argument; rng: the
        captured (generator, state) of a random op, restored before each attempt."""
        if isinstance(exc, BudgetError):  # dtr's own, from an op nested in func
            raise exc
        return oom.retry(
            exc,
            func,
            args,
            kwargs,
            retry,
            self._evict_after_oom,
            lambda exc, retried: BudgetError(oom.oom_message(func, exc, retried, self.core)),
            rng,
        )

    def _evict_after_oom(self, exc: BaseException) -> int:
        """Evict at least what the allocator asked for, and at least an eighth of the
        resident bytes (so a failing op converges in a few rounds); returns bytes freed.
        The running op's inputs are locked, so they stay."""
        core = self.core
        before = core.resident_bytes
        want = max(oom.requested_bytes(exc), before // 8, 1)
        saved = core.budget
        core.budget = max(0, before - want)
        try:
            core.make_room(0)
        finally:
            core.budget = saved
        self.drain()
        freed = before - core.resident_bytes
        if freed > 0:
            self.oom_retries += 1
        return freed

    def out_of_budget(self, rid: int, need: int) -> Exception:
        return self._budget_error(need, f"recomputing {self.recipes[rid].facts.name}")

    def invalidate(self, seeds: list[int]) -> None:
        self.view_replay.remember(seeds)
        if self.trace is not None:
            self.trace.invalidate([self._label(t) for t in seeds])
        super().invalidate(seeds)

    def _fresh_stand_in(self, t, call: TensorArgs, k: int, writes):
        """A managed copy of t, made by the factory call that made t, if t is a factory's
        untouched output that this op (one with a sparse operand, always served here)
        only reads; else None (dtr/engines/subclass/rebuildable_plain.py)."""
        if (
            isinstance(t, CheckpointTensor)
            or t.layout is not torch.strided
            or (writes and call.positions[k] in writes)
        ):
            return None
        made = self.fresh.call_for(t)
        if made is None:
            return None
        func, args, kwargs = made
        facts = op_facts(func)
        return self._run(func, facts, TensorArgs(facts, args, kwargs), ())

    def _writes_sparse(self, facts: OpFacts, call: TensorArgs) -> bool:
        writes = facts.writes
        return bool(writes) and any(
            call.positions[k] in writes and t.layout != torch.strided
            for k, t in enumerate(call.leaves)
        )

    def _run_other_layout(self, func, facts, call, managed, layout, args, kwargs):
        """An op dtr does not record: one with a nested (or other non-strided, non-sparse)
        argument, or one that writes a sparse tensor. On plain tensors it runs as it is,
        after what reads the memory it writes is invalidated (`adj.mul_(2)` while a
        recipe reads adj)."""
        if managed:
            raise UnsupportedError(
                f"dtr: {facts.name} "
                + (
                    "writes to a sparse tensor with a managed one among its arguments"
                    if layout in SPARSE_LAYOUTS
                    else f"mixes a managed tensor with a {layout} one"
                )
                + ", which dtr does not support; dtr.materialize() the managed tensor first"
            )
        writes = facts.writes
        if writes and facts.view_inplace is None:
            self._writes_to_plain(call, writes)
        return func(*args, **kwargs)

    def _writes_to_plain(self, call: TensorArgs, writes) -> None:
        for k, t in enumerate(call.leaves):
            if call.positions[k] in writes:
                for p in parts(t):
                    self._writes_to_plain_leaf(p, self.storages.get(storage_key(p), -1))

    def _writes_to_plain_leaf(self, t: torch.Tensor, tid: int) -> None:
        """A plain tensor is about to be written: recipes that read its old value become
        invalid (the optimizer updating parameters is the common case)."""
        if tid >= 0 and self.core.has_consumers(tid):
            self.invalidate([tid])
        key = t.untyped_storage()._cdata
        node = self.escaped.get(key)
        if node is not None:
            if node.tid >= 0:
                self.invalidate(self.core.members(node.tid))
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
            # Another tensor of a known storage (cuDNN's RNN weights are views of one
            # buffer): gradient hooks are per tensor.
            if t.requires_grad and reads_call_for_hooks():
                self._hook_leaf(t)
            return tid
        tid = self.core.new_constant(storage.nbytes())
        self._set_node(tid, Node(tid, None, "constant", t.shape))
        self.storages[key] = tid
        self.const_keys[tid] = key
        self.const_storages[tid] = storage
        fresh.append(tid)
        if self.trace is not None:
            self.trace.constant(self.nodes[tid].label, storage.nbytes())
        if t.requires_grad and reads_call_for_hooks():
            self._hook_leaf(t)
        return tid

    def _hook_leaf(self, t: torch.Tensor) -> None:
        """Hook the leaf a read of t calls for (``leaf_hooks.leaf_to_hook``) so that a
        managed gradient accumulated into its .grad is handed out plain."""
        leaf = leaf_to_hook(t)
        if leaf is None or self.leaf_hooks.hooked(leaf):
            return
        self.leaf_hooks.add(leaf, self._grad_ready)

    def _hook_plain_reads(self, call: TensorArgs, writes) -> None:
        """A plain op in a custom autograd.Function's forward (grad mode off): its backward
        may accumulate a managed gradient into a parameter the op reads (what it writes
        is no such read)."""
        for k, t in enumerate(call.leaves):
            if t.requires_grad and call.positions[k] not in writes:
                self._hook_leaf(t)

    def _grad_ready(self, param: torch.Tensor) -> None:
        # Optimizers (foreach and fused paths included) see plain gradients.
        grad = param.grad
        if isinstance(grad, CheckpointTensor) and grad._dtr_ref.runtime is self:
            param.grad = hand_out(grad, self._grad_value)

    def _grad_value(self, g: CheckpointTensor) -> torch.Tensor:
        """The plain gradient for .grad: the value itself when private (export), a copy
        when other live tensors share its memory (csrc/native/engine.cpp's grad_value)."""
        ref = g._dtr_ref
        with self.lock:
            shared = self.is_open and not self.core.is_private(ref.node.tid)
            if shared:
                value = self.read(ref)
                with internal():
                    return value.clone()
        return self.export(ref)

    def data_hooks(self) -> data_setter.Hooks:
        """What `t.data = new` does in this session (dtr/data_setter.py)."""
        return data_setter.Hooks(
            is_managed=lambda t: isinstance(t, CheckpointTensor),
            plain_value=lambda t: materialize_ref(t._dtr_ref, export=True),
            plain_written=self.plain_replaced,
        )

    def plain_replaced(self, t: torch.Tensor) -> None:
        """A plain tensor is about to get another storage (`t.data = new`): recipes that
        read its old value are invalidated, as before an op writes it."""
        self._on_plain_parts(
            t, lambda p, key: self._writes_to_plain_leaf(p, self.storages.get(key, -1))
        )

    def export(self, ref: Ref) -> torch.Tensor:
        """The plain value of a managed tensor, handed out to live on outside dtr. The
        memory can be written from now on with no op dtr sees (a NumPy array, ctypes),
        so the value handed out is pinned, its lineage cut, and later recipes read
        snapshots of it (_snapshot_volatile). What read it so far keeps the value it
        read: private, the handed-out value is a new version and the old one keeps its
        lineage (Invariant 4); aliased, the readers are materialized and pinned."""
        with self.lock, internal():
            if not self.is_open:  # the block ended while this thread waited
                return materialize_ref(ref)
            core = self.core
            node = ref.node
            version = core.has_consumers(node.tid) and core.is_private(node.tid)
            core.lock(node.tid)
            try:
                value = self._value(node)
            finally:
                core.unlock(node.tid)
            if version:
                old, node = node, self._export_version(ref, value)
                if self.trace is not None:
                    self.trace.export(old.label, node.label)
            else:
                if self.trace is not None:
                    self.trace.export(node.label)
                core.pin(node.tid)
                if core.has_consumers(node.tid):
                    self.invalidate(core.members(node.tid))
            key = value.untyped_storage()._cdata
            self.escaped[key] = node
            self.escaped_keys[node.tid] = key
            self.drain()
            return value

    def _export_version(self, ref: Ref, value: torch.Tensor) -> Node:
        """The new version, with no lineage, that a value handed out becomes: it takes
        over the storage and the program's handles; the old value moves to an evicted
        pool with its recipe and readers."""
        old = ref.node
        (tid,) = self.core.record([old.tid], 0.0, [VERSION], [old.tid], [0])
        self._set_recipe(self.core.recipe_of(tid), None)  # dropped by the pin below
        node = Node(tid, value, old.name, old.shape)
        self._set_node(tid, node)
        ref.node = node
        self.core.pin(tid)
        return node

    def read(self, ref: Ref) -> torch.Tensor:
        """The value of a managed tensor, for reading it at once (repr, tolist)."""
        with self.lock, internal():
            if not self.is_open:  # the block ended while this thread waited
                return materialize_ref(ref)
            if self.pending_refs:
                self._flush()
            node = ref.node
            if self.trace is not None:
                self.trace.read(node.label)
            self.core.lock(node.tid)
            try:
                return self._value(node)
            finally:
                self.core.unlock(node.tid)
                self.drain()

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

    def drain(self) -> None:
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
                del self.const_storages[t]
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
            for k, node in enumerate(refs):
                try:
                    if node.tid >= 0:
                        if self.trace is not None:
                            self.trace.release(node.label)
                        core.release(node.tid)
                except BaseException:
                    # (a KeyboardInterrupt): the handles after this one stay pending,
                    # or their tensors and lineage would be held for good
                    self.pending_refs[:0] = refs[k + 1 :]
                    raise
            self.drain()

    def _describe(self, tid: int) -> str:
        node = self.nodes[tid] if tid < len(self.nodes) else None
        return node.describe() if node is not None else f"tensor {tid}"

    def _budget_error(self, requested: int, what: str) -> BudgetError:
        core = self.core
        rows = core.largest_pinned(5)
        largest = ", ".join(f"{self._describe(t)} {format_bytes(b)}" for t, b in rows)
        error = BudgetError(
            f"dtr: cannot stay within the memory budget of "
            f"{format_bytes(self.config.budget_bytes)} while {what}: "
            f"{format_bytes(core.resident_bytes)} resident, {format_bytes(requested)} "
            f"requested, {format_bytes(core.pinned_bytes())} pinned (constants and tensors "
            f"that cannot be recomputed) and {format_bytes(core.locked_bytes())} locked by "
            f"the running op, none of which can be evicted.{self._unmanaged_note()} "
            f"Largest unevictable: {largest or 'none'}."
            + budget_advice(
                self.config.budget_bytes, core.constant_bytes(), what, requested, floor_of(core)
            )
        )
        # A program that catches the error goes on within the budget: what the failed op
        # made past it (its outputs, locked while the budget was being met) is evicted now,
        # not at its next op.
        core.make_room(0)
        self.drain()
        return error

    def _unmanaged_note(self) -> str:
        if self.meter is None:
            return ""
        return (
            f" The budget counts the whole device (measure='allocator'): besides those, "
            f"{format_bytes(self.unmanaged_bytes)} on it is memory dtr does not manage "
            f"(optimizer state, tensors made outside the block, the allocator's rounding), "
            f"leaving {format_bytes(self.core.budget)} for what it does."
        )

    def close(self, rebuild: bool = True) -> None:
        """End of the block: materialize everything the program still holds, so that it
        reads back correctly afterwards, then forget all lineage. Without rebuild (the
        block ends with a BudgetError: rebuilding could take many times the budget) what
        is evicted stays so, and reading it raises tensor.LOST_MESSAGE (materialize_ref)."""
        interrupted = None
        with self.lock, internal():
            try:
                while rebuild:
                    try:
                        self._materialize_held()
                        break
                    except KeyboardInterrupt as exc:
                        # Finish first (the work is bounded: one recomputation of what
                        # is evicted), then re-raise: a Ctrl-C here must not leave the
                        # program holding tensors it can never read.
                        interrupted = exc
            finally:
                self.is_open = False
                if self.trace is not None:
                    self.trace.close()
                self.kernel_meter.close()
                for handle in self.hooks:
                    handle.remove()
                self.hooks.clear()
                self.leaf_hooks.remove_all()
                self.storages.clear()
                self.const_keys.clear()
                self.const_storages.clear()
                self.escaped.clear()
                self.escaped_keys.clear()
                self.exported_plain.clear()
                self.pending_refs.clear()
                self.recipes = []
                self.dispatch = self.handle  # the fast path holds this runtime
                self._fast = None
        if interrupted is not None:
            raise interrupted

    def _materialize_held(self) -> None:
        """close(): every value the program holds made resident, the budget lifted.
        Safe to call again after an interruption."""
        self._flush()
        # An exception (a KeyboardInterrupt) between an eviction and the drain that
        # mirrors it must not leave values the core counts as evicted looking resident
        # here: they would be skipped below and dropped by the last drain, and the
        # program could not read them afterwards.
        self.drain()
        if self.trace is not None:
            self.trace.close()
        if self.closing_peaks is None:
            self.closing_peaks = (self.session_peak(), self.transient_peak())
        self.core.budget = -1
        self.core.thrash = 0.0  # the budget lifted, rebuilding is bounded
        for tid in self.core.alive():
            node = self.nodes[tid] if tid < len(self.nodes) else None
            if node is not None and node.value is None:
                self.core.lock(tid)
                try:
                    self.rematerialize(tid)
                finally:
                    self.core.unlock(tid)
        self.drain()


def _wants_management(call: TensorArgs) -> bool:
    """An op on plain tensors only is managed when autograd will need its output: grad
    mode is on and an input requires grad. Model construction, optimizer steps and
    data preprocessing stay plain."""
    if not torch.is_grad_enabled():
        return False
    for t in call.leaves:
        if t.requires_grad:
            return True
    return False


def _refuse_shared_resize(func, facts: OpFacts, call: TensorArgs) -> None:
    """An out= op that would resize a managed tensor another wrapper shares (a detach()
    or .data of it, held): eager's alias keeps its old geometry over the resized storage,
    which a shared handle cannot give. What the kernel would do is asked of meta tensors
    first, only in that case; the op is refused before anything is written."""
    shared = [
        k
        for k, t in enumerate(call.leaves)
        if call.positions[k] in facts.writes
        and isinstance(t, CheckpointTensor)
        and sys.getrefcount(t._dtr_ref) > 2  # (t's own and getrefcount's argument)
    ]
    if not shared:
        return
    metas = [
        torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, device="meta")
        for t in call.leaves
    ]
    try:
        args, kwargs = substitute(call.args, call.kwargs, call.where, metas)
        with warnings.catch_warnings():  # (the op's own run warns of a resize, if it runs)
            warnings.simplefilter("ignore")
            func(*args, **kwargs)
        resizes = any(metas[k].shape != call.leaves[k].shape for k in shared)
    except Exception:  # no meta kernel: it may resize
        resizes = True
    if resizes:
        raise UnsupportedError(shared_resize_message(facts.name))


def shared_resize_message(name: str) -> str:
    # (csrc/native/engine.cpp says the same)
    return (
        f"dtr: {name} would resize its out= tensor, which another tensor shares (a "
        "detach() or .data of it is held); pass an out tensor of the result's shape, or "
        "use the out-of-place form"
    )


def _identity(o, vals, written) -> int:
    for k in written:
        if vals[k] is o:
            return k
    return -1


def _first_cpu(out) -> bool:
    """Whether an op's first returned tensor (if any) lies on the CPU."""
    if isinstance(out, torch.Tensor):
        return out.is_cpu
    if isinstance(out, (tuple, list)):
        for x in out:
            if isinstance(x, torch.Tensor):
                return x.is_cpu
    return True


def _device_of(leaves) -> torch.device:
    for t in leaves:
        return t.device
    return torch.device("cpu")


def _unwrap_foreign(call: TensorArgs, rt: Runtime):
    """Wrappers of an ended session are plain tensors to a new one."""
    values = [
        materialize_ref(t._dtr_ref)
        if isinstance(t, CheckpointTensor) and t._dtr_ref.runtime is not rt
        else t
        for t in call.leaves
    ]
    return substitute(call.args, call.kwargs, call.where, values)


# ====================================================================== special ops
def _detach(rt: Runtime, func, facts, call: TensorArgs, managed: bool):
    # Invariant: detach of a managed tensor aliases the same Ref, even while evicted
    # (autograd detaches saved tensors it has not unpacked yet).
    t = call.leaves[0] if call.leaves else None
    if not managed or not isinstance(t, CheckpointTensor):
        return func(*call.args, **call.kwargs)
    return CheckpointTensor(t._dtr_ref, t)


def _record_stream(rt: Runtime, func, facts, call: TensorArgs, managed: bool):
    # t.record_stream(s) tells the CUDA caching allocator that kernels on stream s use
    # t's memory, so that it is not reused before they ran. Its schema says it writes
    # t (`Tensor(a!) self`), which would make a new version of a managed tensor (a copy
    # whose memory the allocator would be told about instead). It changes no value: on
    # a managed tensor it applies to the value's memory if it is resident; an evicted
    # value has no memory a kernel could be using, and a recomputed one is new memory.
    t = call.args[0] if call.args else None
    if not managed or not isinstance(t, CheckpointTensor):
        return func(*call.args, **call.kwargs)
    value = t._dtr_ref.node.value
    if value is not None:
        func(value, *call.args[1:], **call.kwargs)
    return None


_SPECIAL = {aten.detach.default: _detach, aten.record_stream.default: _record_stream}

# What the fast path may do with a call on plain tensors only (handle()'s `if not
# managed:` branch): nothing (handle() serves it), run it directly unless grad mode
# needs its outputs managed, or run a write directly unless dtr knows an argument.
_PLAIN_NO, _PLAIN_READ, _PLAIN_WRITE = 0, 1, 2

# What the fast path creates and catches (csrc/subclass/fastpath.cpp reads these attributes).
_FAST_TYPES = types.SimpleNamespace(
    CheckpointTensor=CheckpointTensor,
    Node=Node,
    Ref=Ref,
    Recipe=Recipe,
    OutOfMemoryError=torch.OutOfMemoryError,
    roofline=_cost.roofline,
    # CheckpointTensor.__new__'s and Recipe's pieces, which it calls without their frames
    make_wrapper=torch.Tensor._make_wrapper_subclass,
    set_conj=torch._C._set_conj,
    set_neg=torch._C._set_neg,
    object_new=object.__new__,
    serials=_serials,
    capture=rng.capture,
    drew=rng.drew,
    recipe_freed=_recipe.freed_error,
    recipe_written=_recipe.written_error,
    recipe_replaced=_recipe.replaced_error,
    StandIn=StandIn,
    Rebuilt=Rebuilt,
    copy_preserving_layout=copy_preserving_layout,
    storage_freed=freed,
    Parameter=torch.nn.Parameter,
)


def _make_core(config: DTRConfig, budget: int):
    cls, kind = core_class(config.force_python)
    core = cls(config.heuristic, budget, config.seed, config.min_evict_bytes)
    core.search_sample = config.search_sample
    core.thrash = float(config.thrash)
    return core, kind
