"""The native engine: managed tensors as a C++ TensorImpl, every op through one C++
fallback with no Python per op (csrc/native/engine.cpp; docs/design.md, "The private-key route").
dtr.enable() runs it on a CPU-only machine (engine="auto", dtr/engines/__init__.py).

    with dtr.enable(budget="1GiB", engine="native") as session:  # or native.session.enable
        train()
    print(session.stats())

What it serves and what it refuses is in csrc/native/engine.cpp's header: it serves ops that
write nothing, views, plain ops, in-place writes (new versions, as the subclass engine's),
in-place view ops and random ops (replayed from their generator's state); it refuses
with dtr.UnsupportedError, naming the op, in-place ops that replace a managed tensor's
storage (resize_, set_), managed tensors mixed with sparse ones, and tensors off the CPU.
PyTorch's OpInfo database runs under it in stress mode bit for bit as eager
(tests/integration/test_opinfo.py, test_native_*).
Gradients accumulated into a leaf's .grad are handed out plain. An infeasible budget
raises dtr.BudgetError. Traces (trace=, DTR_TRACE) are the subclass engine's format, for
dtr.sim; timelines and per-step logs are dtr.enable()'s too, and so is the handling of
torch.distributed's collectives (never recorded; managed arguments handed over plain);
OOM retry (CUDA) is the subclass engine's only.

While a session is open, CPU allocations of 64 KiB and up in this process go through a
cache that keeps freed blocks for the next request of the same size, as CUDA's caching
allocator does, keeping at most `cache` bytes idle (default 1 GiB; 0 keeps none):
glibc otherwise hands large freed blocks back to the kernel and faults them in again,
which can cost more than the engine itself (csrc/cpu_cache.cpp). The cached blocks are
freed when the session ends. The same allocator, cache or not, meters what each op
allocates (dtr/engines/subclass/kernel_peaks.py) and the block's real peak (Stats.real_peak_bytes).
"""

from __future__ import annotations

import gzip
import os
import shutil

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from ... import config as _config
from ... import data_setter, dlpack, errors, open_sessions, plain_exports
from ... import schema as _schema
from ...errors import ConfigError, DTRError, UnsupportedError
from ...grads import hand_out
from ...leaf_hooks import LeafHooks
from ...stats import Stats
from ...step_log import StepStats, StepTracker
from ...timeline import Timeline
from . import key as native_key
from . import undispatched_reads

_installed = False
DEFAULT_CACHE = "1GiB"
# dtr.enable's options, all of which the native engine implements (`cache` its own)
OPTIONS = tuple(o for o in _config.OPTIONS if o != "engine")


def _install() -> None:
    """Register the fallback at the engine's key (dtr/engines/native/key.py), and a kernel there for
    every op whose composite kernel would take that key first."""
    global _installed
    if _installed:
        return
    from ... import _C

    native_key.check_extension(_C.native_dispatch_key())
    why = native_key.taken()
    if why is not None:
        raise UnsupportedError(
            f"dtr: the native engine needs the {native_key.NAME} dispatch key, but {why} in "
            "this process; use dtr.enable(engine='subclass') instead"
        )
    _C.native_install(_routed_ops(), _view_forms(), _collective_ops())
    native_key.claim()
    _installed = True


def _routed_ops() -> list[str]:
    """Ops that must reach the fallback as they are: those with a CompositeExplicitAutograd
    kernel (it takes the engine's key before any fallback), and those with both a CPU kernel and
    a CompositeImplicitAutograd one, which a backend without a kernel of its own gets: the
    decomposition (silu_backward, mish_backward as elementwise ops) differs from the CPU
    kernel in the last bits."""
    registered = torch._C._dispatch_get_registrations_for_dispatch_key
    ops = set(registered("CompositeExplicitAutogradNonFunctional"))
    ops |= set(registered("CompositeExplicitAutograd"))
    ops |= set(registered("CompositeImplicitAutograd")) & set(registered("CPU"))
    return sorted(op[len("aten::") :] for op in ops if op.startswith("aten::"))


def _collective_ops() -> list[tuple[str, str]]:
    """(namespace, name[.overload]) of torch.distributed's ops (dtr/schema.py's
    collectives), which the engine hands plain tensors, unrecorded."""
    ops = []
    for qualified in torch._C._dispatch_get_all_op_names():
        namespace, _, name = qualified.partition("::")
        if namespace in _schema.COLLECTIVE_NAMESPACES:
            ops.append((namespace, name))
    return sorted(ops)


def _view_forms() -> list[tuple[str, str, str]]:
    """(in-place view op, its view op's name and overload) for every overload of the
    in-place view ops (x.squeeze_(): squeeze), as dtr.enable() runs them."""
    forms = []
    for qualified in _schema.VIEW_INPLACE:
        packet = getattr(torch.ops.aten, qualified.split("::")[1])
        for overload in packet.overloads():
            inplace = getattr(packet, overload)
            view = _schema.out_of_place(inplace)._schema
            forms.append((str(inplace), view.name, view.overload_name))
    return forms


class NativeSession:
    """A context manager: the native engine is on for the thread that enters it."""

    def __init__(self, config: _config.DTRConfig):
        if config.measure != "dtr":
            raise ConfigError(
                f"dtr: measure={config.measure!r} reads the CUDA allocator's count; the native "
                "engine runs on the CPU, where dtr's own count is the measure (measure='dtr')"
            )
        self.config = config  # the settings, as dtr.enable()'s session keeps them
        # the budget now (set_budget() changes it), in bytes; -1 for none
        self.budget = -1 if config.budget_bytes is None else config.budget_bytes
        cache = config.cache_bytes
        self.cache_bytes = _config.parse_budget(DEFAULT_CACHE) if cache is None else cache
        self.cache_stats: dict | None = None  # the cache's hits and misses, after the block
        self._engine = None
        self._guard = None
        self._stance = None  # torch.compiler.set_stance("force_eager") while open
        self._hooks: list = []  # the session's own hook handles, removed at exit
        self._leaf_hooks = LeafHooks()  # on the leaves the engine's ops read under grad mode
        self._steps: StepTracker | None = None
        # the session's peaks before the last take_step_peak() (Runtime.peak_carry)
        self._peak_carry = self._max_carry = 0
        self._error_mark = 0  # errors.raised_count() at entry
        self._cache_attached = False
        self._real_peak = 0  # the allocator's peak in the block (cpu_cache), once closed

    def __enter__(self) -> NativeSession:
        _install()
        if self._engine is not None:
            raise DTRError(
                "dtr: a session can be entered only once; call dtr.enable() again for a new one"
            )
        try:
            with open_sessions.lock:  # dtr.enable() checks open_sessions.native under it
                if open_sessions.subclass is not None:
                    raise DTRError("dtr: dtr.enable() is active; the two engines do not nest")
                if open_sessions.native is not None:
                    raise DTRError(
                        "dtr: a native session is already open (one per process, on any "
                        "thread); end it first, or change its budget with session.set_budget()"
                    )
                self._error_mark = errors.raised_count()
                self._open_engine()
        except BaseException:
            # An interrupt (Ctrl-C, a signal handler's exception) can land between any two
            # steps, the lock's release included: what entry installed is undone, or every
            # later dtr.enable() in the process would be refused as nested. (No engine: the
            # checks refused, and what is installed is another session's.)
            if self._engine is not None:
                self._close((None, None, None))
            raise
        return self

    def _open_engine(self) -> None:
        """Entry's steps, each recorded on self as it is made, for _close to undo."""
        from ... import _C

        cfg = self.config
        self._engine = engine = _C.NativeEngine(
            cfg.heuristic, self.budget, cfg.seed, cfg.cost_model
        )
        open_sessions.native = self
        engine.set_leaf_hook(self._hook_leaf)
        engine.stress = cfg.stress
        engine.check_each_op = cfg.check
        engine.search_sample = cfg.search_sample
        engine.thrash = float(cfg.thrash)
        engine.min_evict_bytes = cfg.min_evict_bytes
        engine.timeline_limit = cfg.timeline
        if cfg.trace is not None:
            engine.start_trace(self._trace_file(), cfg.cost_model)
        engine.activate()
        # Attached with or without a cache (cache=0 keeps no idle blocks): it is also the meter of
        # what each op allocates (dtr/engines/subclass/kernel_peaks.py) and of the block's real
        # peak.
        self._cache_attached = True  # first: detaching a cache never attached is harmless
        _C.cpu_cache_attach(self.cache_bytes)
        self._steps = StepTracker(self)
        # a step ends at every optimizer.step() (dtr.enable's): see end_step()
        self._hooks.append(
            register_optimizer_step_post_hook(lambda *_: self._end_step_from_hook())
        )
        # torch.compile'd code runs eagerly in the block, as under dtr.enable() (where
        # Dynamo breaks its graph at every op): a managed tensor is a plain torch.Tensor
        # to Dynamo, so it would compile, and inductor's kernels read their inputs'
        # memory directly (an evicted one is an error) and allocate what they save for
        # backward as plain tensors dtr cannot evict. The stance is process-wide.
        self._stance = torch.compiler.set_stance("force_eager")
        # p.detach().numpy(), ... of a plain tensor; first: undispatched_reads' methods wrap these
        plain_exports.install()
        # tolist(), numpy(), ... of managed tensors
        undispatched_reads.install(lambda: self._engine)
        plain_exports.set_hook(_C.native_plain_exported)
        data_setter.install(_data_hooks())  # `t.data = new`
        dlpack.install()  # torch.to_dlpack of a managed tensor, for the process's life
        # made before it is entered: exiting a guard never entered changes nothing
        self._guard = torch._C._IncludeDispatchKeyGuard(native_key.KEY)
        self._guard.__enter__()

    def __exit__(self, *exc) -> None:
        self._close(exc)
        lost = errors.from_torchscript(exc[1], self._error_mark)
        if lost is not None:  # raised inside a scripted module: its type and message back
            raise lost from exc[1]

    def _close(self, exc) -> None:
        # Also undoes an entry that stopped part way: each step is undone if it was made.
        try:
            try:
                if self._guard is not None:
                    self._guard.__exit__(*exc)
            finally:
                undispatched_reads.remove()
                data_setter.remove()
                plain_exports.set_hook(None)
                if self._stance is not None:
                    self._stance.__exit__(None, None, None)  # the stance before the block
        finally:
            try:
                if self._engine is not None:
                    # After a BudgetError, what is evicted stays so (NativeEngine::close)
                    self._engine.close(rebuild=not errors.is_budget_error(exc[1]))
            finally:
                if open_sessions.native is self:
                    open_sessions.native = None
                for h in self._hooks:
                    h.remove()
                self._hooks.clear()
                self._leaf_hooks.remove_all()
                if self._cache_attached:
                    from ... import _C

                    self._cache_attached = False
                    cache = _C.cpu_cache_stats()
                    self._real_peak = cache["peak_bytes"]
                    if self.cache_bytes:
                        self.cache_stats = cache
                    _C.cpu_cache_detach()
                trace = self.config.trace
                if (
                    trace is not None
                    and self._trace_file() != trace
                    and os.path.exists(self._trace_file())
                ):
                    _compress(self._trace_file(), trace)

    @property
    def active(self) -> bool:
        return self._engine is not None and self._engine.open

    def _trace_file(self) -> str:
        """Where the engine writes its trace: the path, or beside it while compressing."""
        trace = self.config.trace
        return trace + ".part" if trace.endswith(".gz") else trace

    def _hook_leaf(self, leaf: torch.Tensor) -> None:
        # Called by the engine once per leaf an op reads under grad mode.
        self._leaf_hooks.add(leaf, self._grad_ready)

    def _grad_ready(self, param: torch.Tensor) -> None:
        # Optimizers see plain gradients, as under dtr.enable(); the value stays resident
        # (pinned) while the engine still holds it.
        grad = param.grad
        if grad is not None and self._engine.open and is_managed(grad):
            param.grad = hand_out(grad, self._engine.grad_value)

    def set_budget(self, budget) -> None:
        """Change the budget inside the block (bytes, or a string such as '2GiB'; None for
        unlimited). Takes effect at the next op; a trace records it."""
        if self._engine is None or not self._engine.open:
            raise DTRError("dtr: set_budget() needs an active session")
        parsed = _config.parse_budget(budget)
        self.budget = -1 if parsed is None else parsed
        self._engine.set_budget(self.budget)

    def reset_peak(self) -> None:
        """Start the peak counters (peak_resident_bytes, max_transient_bytes) afresh."""
        if self._engine is None or not self._engine.open:
            raise DTRError("dtr: reset_peak() needs an active session")
        self._peak_carry = self._max_carry = 0
        self._engine.reset_peak()

    @property
    def engine(self) -> str:
        """The engine running this session: "native"."""
        return self.config.engine

    def stats(self) -> Stats:
        """The same dtr.Stats as a dtr.enable() session's (core: "c++", the core it runs)."""
        if self._engine is None:
            raise DTRError(
                "dtr: this session has not been entered yet; use it in a `with` statement"
            )
        counters = self._engine.stats()
        counters["peak_resident_bytes"] = max(self._peak_carry, counters["peak_resident_bytes"])
        counters["max_transient_bytes"] = max(self._max_carry, counters["max_transient_bytes"])
        counters["real_peak_bytes"] = self._real_peak_bytes()
        return Stats(
            budget_bytes=None if self.budget < 0 else self.budget,
            heuristic=self.config.heuristic,
            core="c++",
            **counters,
        )

    def _real_peak_bytes(self) -> int:
        if not self._cache_attached:
            return self._real_peak
        from ... import _C

        return _C.cpu_cache_stats()["peak_bytes"]

    def end_step(self) -> StepStats:
        """Close a training step, as dtr.enable()'s Session.end_step: returns (and logs at
        INFO to the "dtr" logger) what the engine did since the previous one."""
        if self._engine is None or not self._engine.open:
            raise DTRError("dtr: end_step() needs an active session")
        self._engine.end_step()  # lineage carried across steps is cut (Core::end_step)
        return self._steps.end()

    def steps(self) -> list[StepStats]:
        """Every step closed so far, oldest first (see :meth:`end_step`)."""
        return [] if self._steps is None else list(self._steps.history)

    def timeline(self) -> Timeline:
        """Resident bytes at each op boundary, with evictions and remats (needs
        ``timeline=True``), as dtr.enable()'s Session.timeline; inside or after the block."""
        if self._engine is None or not self.config.timeline:
            raise DTRError(
                "dtr: this session records no timeline; pass dtr.enable(..., timeline=True)"
            )
        return Timeline(*self._engine.timeline_rows(), budget_bytes=self.stats().budget_bytes)

    # StepTracker's source (dtr/step_log.py)
    def step_counters(self) -> tuple:
        c = self._engine.stats()
        budget = None if self.budget < 0 else self.budget
        return (
            c["ops"],
            c["evictions"],
            c["remats"],
            c["recompute_seconds"],
            c["resident_bytes"],
            budget,
        )

    def take_step_peak(self) -> tuple[int, int]:
        c = self._engine.stats()
        peak, transient = c["peak_resident_bytes"], c["max_transient_bytes"]
        self._peak_carry = max(self._peak_carry, peak)
        self._max_carry = max(self._max_carry, transient)
        self._engine.reset_peak()
        return peak, transient

    def _end_step_from_hook(self) -> None:
        if self._engine is not None and self._engine.open:
            self._engine.end_step()
            if self.config.log_steps:
                self._steps.end()


def _compress(src: str, dst: str) -> None:
    with open(src, "rb") as f, gzip.open(dst, "wb") as out:
        shutil.copyfileobj(f, out)
    os.remove(src)


def enable(
    budget=None, heuristic: str | None = None, cache=DEFAULT_CACHE, **options
) -> NativeSession:
    """The native engine for a `with` block.

    Args:
        budget, heuristic: as dtr.enable's (same syntax), but given here only: the
            environment's DTR_MEMORY_BUDGET and DTR_HEURISTIC are dtr.enable's.
        **options: ``cache`` the idle bytes the CPU allocation cache may keep (same
            syntax as a budget, 0 for none; default 1 GiB); ``stress=True`` evicts every
            evictable tensor after every op, a testing mode (default: ``DTR_STRESS``);
            ``check=True`` verifies the core's invariants after every op (default:
            ``DTR_CHECK``); ``cost_model`` "roofline" or "time", as dtr.enable's
            (default: ``DTR_COST_MODEL``, else "roofline"); ``trace`` a path to write an
            operator trace to for dtr.sim, compressed if it ends in ".gz" (default:
            ``DTR_TRACE``); ``timeline=True`` keeps resident bytes per op for
            :meth:`NativeSession.timeline`; ``log_steps=True`` logs a summary per
            optimizer step (:meth:`NativeSession.end_step`); ``seed``,
            ``min_evict_bytes``, ``search_sample`` and ``thrash`` as dtr.enable's.
    """
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        raise ConfigError(
            f"dtr: unknown option(s) for dtr.engines.native.session.enable: {', '.join(unknown)}; "
            f"valid: {', '.join(OPTIONS)}"
        )
    # dtr.enable's resolution of the options and of their environment variables
    # (DTR_STRESS, DTR_CHECK, DTR_COST_MODEL, DTR_TRACE, ...), but the budget and heuristic
    # are taken as given here: DTR_MEMORY_BUDGET and DTR_HEURISTIC are dtr.enable's.
    ignored = (_config.ENV_BUDGET, _config.ENV_HEURISTIC, _config.ENV_ENGINE)
    env = {k: v for k, v in os.environ.items() if k not in ignored}
    config = _config.resolve(budget, heuristic, env=env, engine="native", cache=cache or 0, **options)
    return NativeSession(config)


def _data_hooks() -> data_setter.Hooks:
    from ... import _C

    return data_setter.Hooks(
        is_managed=_C.is_native,
        plain_value=_C.native_materialize,
        plain_written=_C.native_plain_written,
    )


def is_managed(t: torch.Tensor) -> bool:
    from ... import _C

    return _C.is_native(t)
