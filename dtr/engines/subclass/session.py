"""The subclass engine's session: the ``dtr.enable()`` block whose ops a dispatch mode
hands to a ``Runtime``."""

from __future__ import annotations

import threading
import types

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ... import data_setter, dlpack, errors, open_sessions, plain_exports
from ...config import DTRConfig, parse_budget
from ...errors import DTRError
from ...stats import Stats, collect
from ...step_log import StepStats
from ...timeline import Timeline
from . import undispatched_reads
from .runtime import Runtime


class _Mode(TorchDispatchMode):
    """Sends every op on this thread to the runtime."""

    def __init__(self, runtime: Runtime):
        super().__init__()
        self.runtime = runtime
        fast = runtime._fast
        if fast is not None:
            # The dispatcher looks __torch_dispatch__ up on the mode object: an instance
            # attribute bound to the mode (it must be the mode's method) whose function
            # is the fast path's C++ entry saves this class's Python frame per op (it
            # does what __torch_dispatch__ below does).
            fast.set_mode_hooks(_eval_frame_callback, _handle_without_dynamo)
            self.__torch_dispatch__ = types.MethodType(fast.torch_dispatch, self)

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False  # see _handle_without_dynamo below

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        try:
            if _eval_frame_callback() is None:
                return self.runtime.dispatch(func, args, kwargs or {})
            return _handle_without_dynamo(self.runtime, func, args, kwargs or {})
        except BaseException as exc:  # for errors.from_torchscript (the fast path: C++)
            errors.note_raised(exc)
            raise


def _handle(runtime: Runtime, func, args, kwargs):
    return runtime.handle(func, args, kwargs)


# PyTorch wraps a mode's __torch_dispatch__ in torch._disable_dynamo, so that Dynamo's
# frame hook (set while a torch.compile'd function runs) never compiles the handler. The
# wrapper costs 4-7 us per op (of ~55 for a small op) for a hook that is almost never
# set, so _Mode opts out (_should_skip_dynamo) and does the same itself: its own frame
# is marked for the hook to skip, and the runtime runs with the hook off when it is set.
try:
    from torch._C._dynamo.eval_frame import (
        _FrameAction,
        _FrameExecStrategy,
        get_eval_frame_callback,
        set_code_exec_strategy,
    )

    set_code_exec_strategy(
        _Mode.__torch_dispatch__.__code__,
        _FrameExecStrategy(_FrameAction.SKIP, _FrameAction.DEFAULT),
    )
    _eval_frame_callback = get_eval_frame_callback
except (ImportError, AttributeError, TypeError):  # another torch: always the safe path

    def _eval_frame_callback():
        return True


_handle_without_dynamo = torch._disable_dynamo(_handle, recursive=True)


def _leave_mode(mode: _Mode) -> None:
    """Undo ``mode.__enter__()``, which an interrupt may have stopped part way."""
    depth = torch._C._len_torch_dispatch_stack()
    if depth and torch._C._get_dispatch_stack_at(depth - 1) is mode:
        mode.__exit__(None, None, None)
        return
    # Not pushed: TorchDispatchMode.__enter__ saves each module flag of
    # torch.utils._python_dispatch in a list on the mode before it changes the flag.
    from torch.utils import _python_dispatch as pd

    for saved, flag in (
        ("old_dispatch_mode_flags", "_is_in_torch_dispatch_mode"),
        ("old_non_infra_dispatch_mode_flags", "_is_in_non_infra_torch_dispatch_mode"),
        (
            "old_without_ignore_compile_internals_dispatch_mode_flags",
            "_is_in_any_mode_without_ignore_compile_internals",
        ),
    ):
        values = mode.__dict__.get(saved)
        if values and hasattr(pd, flag):
            setattr(pd, flag, values.pop())
    if hasattr(pd, "set_is_in_mode_without_ignore_compile_internals"):
        pd.set_is_in_mode_without_ignore_compile_internals(
            getattr(pd, "_is_in_any_mode_without_ignore_compile_internals", False)
        )


class Session:
    """A block of code under dtr. Returned by :func:`dtr.enable`; use it as a context
    manager, and read :meth:`stats` during or after the block."""

    def __init__(self, config: DTRConfig):
        self.config = config
        self._runtime: Runtime | None = None
        self._mode: _Mode | None = None
        self._final: Stats | None = None
        self._final_timeline: Timeline | None = None
        self._final_steps: list[StepStats] = []
        self._thread: threading.Thread | None = None  # the thread that entered it
        self._error_mark = 0  # errors.raised_count() at entry

    def __enter__(self) -> Session:
        try:
            with open_sessions.lock:
                self._check_can_enter()
                undispatched_reads.install()
                dlpack.install()  # torch.to_dlpack of a managed tensor
                self._error_mark = errors.raised_count()
                self._runtime = Runtime(self.config)
                self._mode = _Mode(self._runtime)
                self._mode.__enter__()
                self._thread = threading.current_thread()
                open_sessions.subclass = self
                data_setter.install(self._runtime.data_hooks())
                plain_exports.install()  # p.detach().numpy(), ... of a plain tensor
                plain_exports.set_hook(self._runtime.plain_exported)
        except BaseException:
            # An interrupt (Ctrl-C, a signal handler's exception) can land between any two
            # steps, the lock's release included: a session left active would refuse every
            # later dtr.enable(), and a mode left on this thread's stack would send every
            # later op to a runtime no block owns.
            self._abort_entry()
            raise
        return self

    def _check_can_enter(self) -> None:
        active = open_sessions.subclass
        if active is not None:
            if active._thread is not threading.current_thread():
                raise DTRError(
                    "dtr: dtr.enable() is already active on thread "
                    f"{active._thread.name!r}; concurrent sessions are not supported "
                    "(one per process). Use that session's tensors from this thread "
                    "(dtr serves them under its lock), or enter a session once it ended."
                )
            raise DTRError(
                "dtr: dtr.enable() is already active; nested or concurrent sessions are "
                "not supported. End the outer block first, or change its budget with "
                "session.set_budget()."
            )
        if self._final is not None:
            raise DTRError(
                "dtr: a session can be entered only once; call dtr.enable() again for a new one"
            )
        if open_sessions.native is not None:
            raise DTRError("dtr: a native engine session is open; the two engines do not nest")

    def _abort_entry(self) -> None:
        """Undo what __enter__ made before it stopped (nothing if its checks refused)."""
        try:
            if self._runtime is not None:  # (past the checks: no other session's to remove)
                data_setter.remove()  # (harmless when it was not installed)
                plain_exports.set_hook(None)
            if self._mode is not None:
                _leave_mode(self._mode)
        finally:
            if self._mode is not None:
                self._mode.__dict__.pop("__torch_dispatch__", None)  # holds the fast path
            # The runtime and its C++ fast path refer to each other, a cycle the garbage
            # collector cannot see: only close() breaks it.
            if self._runtime is not None:
                self._runtime.close()
            self._runtime = self._mode = None
            if open_sessions.subclass is self:
                open_sessions.subclass = None

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            try:
                self._mode.__exit__(exc_type, exc, tb)
            finally:
                self._mode.__dict__.pop("__torch_dispatch__", None)  # holds the fast path
                try:
                    # After a BudgetError, what is evicted stays so (Runtime.close)
                    self._runtime.close(rebuild=not errors.is_budget_error(exc))
                finally:
                    rt = self._runtime
                    self._final = collect(rt)
                    self._final_steps = rt.steps.history
                    if rt.timeline is not None:
                        self._final_timeline = rt.timeline.snapshot(rt.config.budget_bytes)
        finally:
            # Even if the above failed (a KeyboardInterrupt can land anywhere in it), the
            # session must end: else every later dtr.enable() is refused as nested.
            data_setter.remove()
            plain_exports.set_hook(None)
            self._runtime = None
            self._mode = None
            with open_sessions.lock:
                open_sessions.subclass = None
        lost = errors.from_torchscript(exc, self._error_mark)
        if lost is not None:  # raised inside a scripted module: its type and message back
            raise lost from exc

    @property
    def active(self) -> bool:
        return self._runtime is not None

    @property
    def engine(self) -> str:
        """The engine running this session: "subclass"."""
        return self.config.engine

    def stats(self) -> Stats:
        """Counters so far (inside the block) or final (after it)."""
        if self._runtime is not None:
            with self._runtime.lock:
                return collect(self._runtime)
        if self._final is None:
            raise DTRError(
                "dtr: this session has not been entered yet; use it in a `with` statement"
            )
        return self._final

    def reset_peak(self) -> None:
        """Measure peak_resident_bytes afresh from now on (e.g. once per training step)."""
        if self._runtime is None:
            raise DTRError("dtr: reset_peak() needs an active session")
        with self._runtime.lock:
            self._runtime.peak_carry = self._runtime.max_carry = 0
            self._runtime.core.reset_peak()

    def end_step(self) -> StepStats:
        """Close a training step: returns (and logs at INFO to the "dtr" logger) what dtr
        did since the previous one. Every optimizer.step() closes a step too (logged with
        ``log_steps=True``); call this yourself for hand-written updates. At a step's end,
        a held value whose lineage reaches into an earlier step (a running mean of the
        loss) is materialized and pinned, so that no lineage grows from step to step."""
        if self._runtime is None:
            raise DTRError("dtr: end_step() needs an active session")
        return self._runtime.end_step()

    def steps(self) -> list[StepStats]:
        """Every step closed so far, oldest first (see :meth:`end_step`)."""
        if self._runtime is not None:
            with self._runtime.lock:
                return list(self._runtime.steps.history)
        return list(self._final_steps)

    def timeline(self) -> Timeline:
        """Resident bytes at each op boundary, with evictions and remats (needs
        ``dtr.enable(..., timeline=True)``); plot it with dtr.plot.memory_timeline."""
        rt = self._runtime
        if rt is not None:
            if rt.timeline is None:
                raise DTRError(
                    "dtr: this session records no timeline; pass dtr.enable(..., timeline=True)"
                )
            with rt.lock:
                return rt.timeline.snapshot(rt.config.budget_bytes)
        if self._final_timeline is None:
            raise DTRError(
                "dtr: this session recorded no timeline (pass dtr.enable(..., timeline=True))"
                if self._final is not None
                else "dtr: this session has not been entered yet; use it in a `with` statement"
            )
        return self._final_timeline

    def set_budget(self, budget) -> None:
        """Change the budget inside the block (bytes, or a string such as '2GiB';
        None for unlimited). Takes effect at the next op."""
        if self._runtime is None:
            raise DTRError("dtr: set_budget() needs an active session")
        nbytes = parse_budget(budget)
        rt = self._runtime
        with rt.lock:
            rt.config = DTRConfig(**{**rt.config.__dict__, "budget_bytes": nbytes})
            rt.core.budget = -1 if nbytes is None else nbytes
            if rt.trace is not None:
                rt.trace.budget(nbytes)
